"""The shared-prompt reader (how Mem0, LangMem and A-Mem answer with ``answer_prompt=shared``)
against the systems whose prompt it shares, on the tiny random backbone.

    pytest tests/unit/test_reader.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elasticmem.backbone import load_backbone
from elasticmem.bank import Bank, build_bank
from elasticmem.config import BankConfig, ChunkingConfig, MemoryConfig, BackboneConfig
from elasticmem.data.synthetic import SyntheticConfig, generate
from elasticmem.eval.reader import SharedPromptReader
from elasticmem.systems import ElasticMemSystem
from elasticmem.model.elasticmem import ElasticMem


def backbone():
    """The tiny random model with larger weights (the same on every call): its greedy answers
    differ from input to input, which the default init's do not."""
    bb = load_backbone(BackboneConfig(name_or_path="tiny", device="cpu"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in bb.model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return bb


def settings(**kw) -> MemoryConfig:
    # 8 new tokens: the random model runs past EOS-free answers of several tokens
    return MemoryConfig(**{"top_z": 3, "max_new_tokens": 8, "suffix_template": "\n{options}\nAnswer:", **kw})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    data = generate(SyntheticConfig(variant="tiny", num_histories=6, num_facts=4, num_options=4), seed=0)
    examples = [ex for split in data.values() for ex in split]
    out = tmp_path_factory.mktemp("bank")
    build_bank({"all": examples}, backbone(), ChunkingConfig(max_tokens=32), BankConfig(dir=str(out), n_cache=4),
               torch.float32, show_progress=False)
    return Bank.open(out), examples[:10]


def system_predictions(bank, examples, **kw):
    """What ElasticMem's own path answers (untrained adapter: the base model), by its own retrieval."""
    torch.manual_seed(0)
    model = ElasticMem(backbone(), settings(**kw), bank).eval()
    return ElasticMemSystem(model, "x").predict(examples)


@pytest.mark.parametrize("retrieval", ["control", "query_only"])
def test_the_reader_answers_exactly_as_text_rag_from_the_same_texts(setup, retrieval):
    """Given the chunks text_rag retrieved, the reader (another copy of the base model, no bank,
    no retrieval) produces text_rag's answers and #Tok split, batched over examples: with
    retrieval 'control' its prompt carries the same greedy control token, with 'query_only' none."""
    bank, examples = setup
    rag = system_predictions(bank, examples, injection="text", retrieval=retrieval)
    assert all(len(p.retrieved) == 3 for p in rag)
    assert all(("control_token" in p.extra) == (retrieval == "control") for p in rag)
    reader = SharedPromptReader.from_backbone(backbone(), settings(retrieval=retrieval))
    reads = reader.answer(examples, [[r.text for r in p.retrieved] for p in rag])
    assert len({r.text for r in reads}) > 1  # the answers depend on the input
    for p, r in zip(rag, reads):
        assert r.text == p.text
        assert (r.prompt_tokens, r.memory_tokens, r.generated_tokens) == (p.prompt_tokens, p.memory_tokens,
                                                                          p.generated_tokens)
        assert r.memory_token_counts == [m.tokens for m in p.retrieved]


def test_no_memory_texts_read_as_the_no_memory_system(setup):
    bank, examples = setup
    none = system_predictions(bank, examples, top_z=0)
    reads = SharedPromptReader.from_backbone(backbone(), settings()).answer(examples, [[] for _ in examples])
    assert [r.text for r in reads] == [p.text for p in none]
    assert [(r.prompt_tokens, r.memory_tokens, r.generated_tokens) for r in reads] == [
        (p.prompt_tokens, p.memory_tokens, p.generated_tokens) for p in none]


def test_batched_equals_one_at_a_time_with_ragged_and_empty_memories(setup):
    _, examples = setup
    reader = SharedPromptReader.from_backbone(backbone(), settings())
    texts = [["Ana moved to Porto.", "", "She likes tea and long walks by the sea."][: i % 4] for i in range(len(examples))]
    batched = reader.answer(examples, texts)
    alone = [reader.answer([ex], [t])[0] for ex, t in zip(examples, texts)]
    assert batched == alone
    # an empty text is left out (no separator), but keeps its slot in the counts
    assert batched[3].memory_token_counts[1] == 0
    assert batched[3].prompt_tokens == batched[0].prompt_tokens + 2 * len(reader.sep_ids) + (
        len(reader.tokenizer(examples[3].question)["input_ids"]) - len(reader.tokenizer(examples[0].question)["input_ids"]))


def test_one_memory_list_per_example(setup):
    _, examples = setup
    with pytest.raises(ValueError, match="memory lists"):
        SharedPromptReader.from_backbone(backbone(), settings()).answer(examples[:2], [[]])


def test_a_question_without_evidence_reads_nothing_at_the_evidence_rungs(setup):
    """A question that records no evidence (LoCoMo has two in its test split) reads no memory at the
    evidence-alone rung and gets no budget at the oracle's, in a batch whose other questions read
    their own evidence."""
    from elasticmem.eval.retrieval import evidence_rows

    bank, examples = setup
    bare = dataclasses.replace(examples[0], extra={k: v for k, v in examples[0].extra.items() if k != "evidence"})
    batch = [bare, *examples[1:4]]
    assert not evidence_rows(bare, bank) and all(evidence_rows(ex, bank) for ex in batch[1:])
    model = ElasticMem(backbone(), settings(), bank).eval()
    alone = ElasticMemSystem(model, "x", memories="evidence", budgets="max").predict(batch)
    assert alone[0].retrieved == [] and alone[0].memory_tokens == 0
    for ex, p in zip(batch[1:], alone[1:]):
        assert {int(m.ref[4:]) for m in p.retrieved} == evidence_rows(ex, bank) and p.memory_tokens > 0
    oracle = ElasticMemSystem(model, "x", budgets="oracle").predict(batch)
    assert len(oracle[0].retrieved) == 3 and [m.budget for m in oracle[0].retrieved] == [0, 0, 0]
    assert oracle[0].memory_tokens == 0
    for ex, p in zip(batch[1:], oracle[1:]):
        ev = evidence_rows(ex, bank)
        assert [m.budget > 0 for m in p.retrieved] == [int(m.ref[4:]) in ev for m in p.retrieved]
