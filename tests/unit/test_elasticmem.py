"""The ElasticMem model on the tiny random backbone: batching, exact scoring, injection, gradients, save/load.

    pytest tests/unit/test_elasticmem.py
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from elasticmem.backbone import Backbone, load_backbone
from elasticmem.bank import Bank, BankError, build_bank
from elasticmem.config import BankConfig, ChunkingConfig, LoraConfig, MemoryConfig, BackboneConfig, TinyModelConfig
from elasticmem.data.synthetic import SyntheticConfig, generate
from elasticmem.model.budget_policy import BudgetPolicyConfig
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.injection import Layout, assemble
from elasticmem.model.projector import ProjectorConfig

N_CACHE = 6


def tiny_backbone(seed: int = 0):
    return load_backbone(BackboneConfig(name_or_path="tiny", device="cpu", tiny=TinyModelConfig(seed=seed)))


@pytest.fixture(scope="module")
def data():
    cfg = SyntheticConfig(variant="tiny", num_histories=10, num_facts=5, num_options=4)
    return generate(cfg, seed=0)


@pytest.fixture(scope="module")
def bank(tmp_path_factory, data):
    """A bank whose chunks are longer and shorter than N_CACHE (persona-style long turns added)."""
    examples = lengthened([ex for split in data.values() for ex in split])
    out = tmp_path_factory.mktemp("bank")
    build_bank({"all": examples}, tiny_backbone(), ChunkingConfig(max_tokens=32),
               BankConfig(dir=str(out), n_cache=N_CACHE, shard_rows=16), torch.float32, show_progress=False)
    return Bank.open(out), examples


def lengthened(examples):
    """The examples with every other history given a longer last turn, so that chunk lengths (and
    cache_len) vary around N_CACHE."""
    from elasticmem.data.schema import Turn

    longer = {}
    for ex in examples:
        if ex.group not in longer:
            extra = [Turn("user", "the cat sat on the mat " * (len(longer) % 3))] if len(longer) % 2 else []
            longer[ex.group] = [ex.history[0] + extra]
    return [dataclasses.replace(ex, history=longer[ex.group]) for ex in examples]


def memory_cfg(**kw) -> MemoryConfig:
    policy = kw.pop("policy", {})
    base = dict(
        top_z=4, max_new_tokens=3, suffix_template="\n{options}\nAnswer:",
        lora=LoraConfig(r=4, alpha=8, dropout=0.1),
        policy=BudgetPolicyConfig(**{"d_model": 32, "num_heads": 2, "num_layers": 1, "max_budget": 8, **policy}),
        projector=ProjectorConfig(hidden_size=64),
    )
    base.update(kw)
    return MemoryConfig(**base)


def make_model(bank, seed: int = 0, **kw) -> ElasticMem:
    torch.manual_seed(seed)
    model = ElasticMem(tiny_backbone(), memory_cfg(**kw), bank)
    with torch.no_grad():  # LoRA B starts at zero; make the adapter matter
        for n, p in model.lm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.2)
    return model.eval()


def _close(a, b, atol=1e-5):
    assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=atol), (a - b).abs().max()


def test_batched_greedy_equals_one_at_a_time(bank):
    bank, examples = bank
    model = make_model(bank)
    batch = examples[:6]
    together = model.greedy(batch)
    assert together.budgets[together.mask].unique().numel() > 1, "policy should give varied budgets"
    for i, ex in enumerate(batch):
        alone = model.greedy([ex])
        assert alone.control.tolist() == together.control[i : i + 1].tolist()
        assert torch.equal(alone.rows, together.rows[i : i + 1])
        assert torch.equal(alone.budgets, together.budgets[i : i + 1])
        n = int(alone.answer_mask.sum())
        assert alone.answer_ids[0, :n].tolist() == together.answer_ids[i, :n].tolist()
        _close(alone.logp_control, together.logp_control[i : i + 1])
        _close(alone.logp_budget, together.logp_budget[i : i + 1])
        _close(alone.logp_answer[0, :n], together.logp_answer[i, :n])


MODES = ["control", "query_only", "frozen", "semantic"]
VARIANTS = ["transformer", "autoregressive", "mlp", "uniform", "random"]


@pytest.mark.parametrize(
    "retrieval, variant",
    [(m, "transformer") for m in MODES] + [(m, v) for m in ("control", "query_only") for v in VARIANTS[1:]],
)
def test_score_reproduces_sampling(bank, retrieval, variant):
    bank, examples = bank
    model = make_model(bank, retrieval=retrieval, policy={"variant": variant})
    torch.manual_seed(1)
    traj = model.sample(examples[:3], group_size=3, temperature=1.0)
    assert len(traj.example_ids) == 9 and traj.query_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    out = model.score(traj)
    _close(out.logp_control, traj.logp_control)
    _close(out.logp_budget, traj.logp_budget)
    _close(out.entropy_budget, traj.entropy_budget)
    _close(out.logp_answer, traj.logp_answer)
    if retrieval == "control":
        assert (traj.control >= 0).all() and (traj.logp_control < 0).all()
    else:
        assert (traj.control == -1).all() and (traj.logp_control == 0).all()
        # Without a stochastic control token the G trajectories of a query retrieve the same rows.
        assert torch.equal(traj.rows[0], traj.rows[1])


def test_soft_token_counts_and_no_memory_equivalence(bank):
    bank, examples = bank
    model = make_model(bank)
    traj = model.greedy(examples[:5])
    _, cache_len = bank.gather(traj.rows.clamp(min=0).reshape(-1))
    expected = torch.minimum(traj.budgets.reshape(-1), cache_len.long()) * traj.mask.reshape(-1)
    assert torch.equal(traj.soft_counts.reshape(-1), expected)
    assert (cache_len.long() < traj.budgets.reshape(-1)).any(), "test needs budgets above some cache lengths"
    # With every budget 0 the injected sequence is exactly the memory-free token sequence.
    zero = make_model(bank, policy={"variant": "uniform", "uniform_budget": 0})
    tz = zero.greedy(examples[:3])
    assert (tz.soft_counts == 0).all() and (tz.memory_tokens == 0).all()
    emb = zero.base.get_input_embeddings()
    for i in range(3):
        layout = Layout(tz.prompt_ids[i], int(tz.control[i]), [], tz.suffix_ids[i], [])
        x = assemble(emb, [layout], zero.sep_ids)
        plain = emb(torch.tensor(tz.prompt_ids[i] + [int(tz.control[i])] + tz.suffix_ids[i]))
        assert torch.equal(x.embeds[0], plain)
        ids = torch.tensor([tz.prompt_ids[i] + [int(tz.control[i])] + tz.suffix_ids[i]])
        with torch.no_grad():
            ref = zero.lm.generate(input_ids=ids, max_new_tokens=3, do_sample=False,
                                   pad_token_id=zero.tokenizer.pad_token_id)[0, ids.shape[1]:]
        n = int(tz.answer_mask[i].sum())
        assert tz.answer_ids[i, :n].tolist() == ref[:n].tolist()
    # #Tok = task text + soft tokens + separators + generated tokens.
    sep = len(model.sep_ids)
    for i in range(5):
        task = len(traj.prompt_ids[i]) + 1 + len(traj.suffix_ids[i])
        mems = int((traj.soft_counts[i] > 0).sum())
        assert traj.num_tokens[i] == task + traj.memory_tokens[i] + mems * sep + traj.answer_mask[i].sum()


def test_gradients_reach_exactly_lora_policy_projector(bank):
    bank, examples = bank
    model = make_model(bank).train()
    base_before = {n: p.detach().clone() for n, p in model.lm.named_parameters() if "lora_" not in n}
    torch.manual_seed(0)
    traj = model.sample(examples[:4], group_size=2)
    out = model.score(traj)
    loss = -(out.logp_control.sum() + out.logp_budget.sum() + out.logp_answer.sum())
    loss.backward()
    trainable = model.trainable_parameters()
    assert trainable and all(("lora_" in n) or n.startswith(("policy.", "projector.")) for n in trainable)
    for prefix in ("lm.", "policy.", "projector."):
        grads = [p.grad for n, p in trainable.items() if n.startswith(prefix)]
        assert grads and all(g is not None for g in grads), prefix
        assert sum(g.abs().sum() for g in grads) > 0, prefix
    for n, p in model.named_parameters():
        if n not in trainable:
            assert p.grad is None, n
    opt = torch.optim.AdamW(list(trainable.values()), lr=1e-2)
    opt.step()
    for n, p in model.lm.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), f"frozen weight {n} changed"


def test_bank_encoder_is_the_adapter_disabled_backbone(bank, tmp_path):
    bank_, examples = bank
    model = make_model(bank_)  # LoRA weights are non-zero
    from elasticmem.backbone import Backbone, model_fingerprint

    assert model_fingerprint(model.lm, model.tokenizer) == bank_.fingerprint
    with model.lm.disable_adapter():
        bb = Backbone(model.base, model.tokenizer, "tiny")
        build_bank({"x": examples[:5]}, bb, ChunkingConfig(max_tokens=32),
                   BankConfig(dir=str(tmp_path / "b"), n_cache=N_CACHE), torch.float32, show_progress=False)
    again = Bank.open(tmp_path / "b")
    rows = range(*again.group_rows(examples[0].group))
    a0, b0 = again.group_rows(examples[0].group)
    r0, _ = bank_.group_rows(examples[0].group)
    _close(again.keys(a0, b0), bank_.keys(r0, r0 + (b0 - a0)))
    assert len(rows) > 0


def test_save_load_roundtrip(bank, tmp_path):
    bank, examples = bank
    model = make_model(bank)
    with torch.no_grad():
        for p in model.policy.parameters():
            p.add_(0.01)
    model.save_pretrained(tmp_path / "ckpt")
    names = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"adapter", "budget_policy.safetensors", "projector.safetensors", "elasticmem_config.json"} <= names
    loaded = ElasticMem.from_pretrained(tmp_path / "ckpt", tiny_backbone(), bank).eval()
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ta, tb = model.greedy(examples[:3]), loaded.greedy(examples[:3])
    assert torch.equal(ta.answer_ids, tb.answer_ids) and torch.equal(ta.budgets, tb.budgets)
    with pytest.raises(ValueError, match="was trained on"):
        ElasticMem.from_pretrained(tmp_path / "ckpt", tiny_backbone(seed=5), bank)


def test_bad_inputs(bank):
    bank, examples = bank
    with pytest.raises(BankError, match="not by this backbone"):
        ElasticMem(tiny_backbone(seed=3), memory_cfg(), bank)
    model = make_model(bank, top_z=50)
    with pytest.warns(UserWarning, match="top_z=50 is larger than"):
        traj = model.greedy(examples[:2])
    assert traj.rows.shape[1] == 50 and (traj.rows[~traj.mask] == -1).all()
    assert (traj.budgets[~traj.mask] == 0).all() and (traj.soft_counts[~traj.mask] == 0).all()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.greedy(examples[2:3])  # said once per model
    clipped = make_model(bank, policy={"clip_budget": 2})
    assert clipped.greedy(examples[:4]).budgets.max() <= 2
    with pytest.raises(ValueError, match="empty batch"):
        model.greedy([])


def test_suffix_template_fills_options_question_and_extra_fields(bank):
    from elasticmem.model.prompt import format_suffix

    ex = bank[1][0]
    step = dataclasses.replace(ex, extra={"commands": "go to sink 1\nlook", "n": 3})
    assert format_suffix("{question}|{options}|{commands}", step) == (
        f"{ex.question}|" + "\n".join(f"({'abcd'[i]}) {c}" for i, c in enumerate(ex.choices)) + "|go to sink 1\nlook")
    with pytest.raises(ValueError, match=r"names \{n\}.*has \['commands', 'options', 'question'\]"):
        format_suffix("{n}", step)  # only string fields are offered


def test_chat_template_prompt(bank):
    bank, examples = bank
    model = make_model(bank, prompt_template="chat")
    prompt, suffix = model.encode_texts(examples[0])
    text = model.tokenizer.decode(prompt + suffix)
    assert "<|im_start|>" in text and text.rstrip().endswith("assistant")
    traj = model.sample(examples[:2], group_size=2)
    _close(model.score(traj).logp_answer, traj.logp_answer)


# ---------------------------------------------------------------- sampling distribution

# Fields transformers reads while generating that are not knobs on the next-token distribution:
# set by ElasticMem.generation_config itself (do_sample, temperature) or plumbing.
NOT_DECODING_KNOBS = {"do_sample", "temperature", "use_cache", "is_assistant", "assistant_confidence_threshold"}


def decoding_fields() -> set[str]:
    """GenerationConfig fields that the installed transformers reads to build logits processors
    and warpers, choose the decoding method, or stop early, read from its source."""
    import inspect
    import re

    from transformers import GenerationConfig
    from transformers.generation.utils import GenerationMixin

    read = set()
    for fn, pattern in [(GenerationMixin._get_logits_processor, r"generation_config\.(\w+)"),
                        (GenerationMixin._get_stopping_criteria, r"generation_config\.(\w+)"),
                        (GenerationConfig.get_generation_mode, r"self\.(\w+)")]:
        read |= set(re.findall(pattern, inspect.getsource(fn)))
    return (read & set(GenerationConfig().to_dict())) - NOT_DECODING_KNOBS


def test_generation_config_turns_off_every_decoding_knob():
    from elasticmem.model.generation import DECODING_OFF

    fields = decoding_fields()
    assert {"suppress_tokens", "bad_words_ids", "top_k", "min_p", "num_beams", "stop_strings"} <= fields
    assert not fields - DECODING_OFF.keys(), "transformers reads fields ElasticMem does not turn off"


def checkpoint_generation_settings(model, ex, top: list[int], group: str) -> dict:
    """Non-neutral values, as a checkpoint's generation_config.json could carry them, for every field
    in ``decoding_fields()``, aimed at the likeliest first answer tokens ``top`` and the gold letter."""
    from transformers import WatermarkingConfig

    gold = model.tokenizer.convert_tokens_to_ids(chr(ord("a") + ex.answer_index))
    n = model.cfg.max_new_tokens
    processors = dict(  # GenerationMixin._get_logits_processor
        suppress_tokens=[top[0], gold], begin_suppress_tokens=[top[1]], bad_words_ids=[[top[2]]],
        sequence_bias={(top[5],): 8.0}, forced_bos_token_id=top[3], forced_eos_token_id=model.eos_ids[0],
        min_new_tokens=n, min_length=n + 20, exponential_decay_length_penalty=(0, 1.5),
        repetition_penalty=2.0, encoder_repetition_penalty=2.0, no_repeat_ngram_size=1,
        encoder_no_repeat_ngram_size=1, guidance_scale=3.0, remove_invalid_values=True, renormalize_logits=True,
        temperature=0.2, top_k=1, top_p=0.3, min_p=0.5, typical_p=0.3, epsilon_cutoff=0.2, eta_cutoff=0.2,
        top_h=0.3, watermarking_config=WatermarkingConfig(bias=10.0),
    )
    decoding = dict(  # GenerationConfig.get_generation_mode, GenerationMixin._get_stopping_criteria
        num_beams=2, num_beam_groups=2, diversity_penalty=1.0, num_return_sequences=2, length_penalty=3.0,
        early_stopping=True, penalty_alpha=0.6, dola_layers="high", constraints=[], force_words_ids=[[top[0]]],
        use_mtp=True, prompt_lookup_num_tokens=2, assistant_early_exit=1, max_length=2, max_time=0.0,
        stop_strings=["a"], token_healing=True,
    )
    assert decoding_fields() <= processors.keys() | decoding.keys()
    return processors if group == "processors" else decoding


def first_answer_logits(model, traj) -> torch.Tensor:
    """[V] next-token logits before the first answer token of trajectory 0, from a plain forward."""
    soft, _ = model._soft_tokens(traj.rows[:1], traj.budgets[:1])
    layout = Layout(traj.prompt_ids[0], None, soft[0], traj.suffix_ids[0], [])
    x = assemble(model.base.get_input_embeddings(), [layout], model.sep_ids)
    with torch.no_grad():
        H, _ = model._forward_hidden(inputs_embeds=x.embeds, attention_mask=x.attention_mask,
                                     position_ids=x.position_ids, use_cache=False)
        return model._logits(H[0, x.answer_start[0] - 1])


@pytest.mark.parametrize("group", ["processors", "decoding"])
def test_sampling_distribution_is_temperature_only(bank, group):
    """Answers are drawn from softmax(logits / T), argmax when greedy, whatever the checkpoint's
    generation_config says; the recorded log-probs are of that distribution."""
    bank, examples = bank
    tau = 0.7
    # No control token and fixed budgets: the G trajectories of a query share one input.
    model = make_model(bank, retrieval="query_only", policy={"variant": "uniform", "uniform_budget": 3})
    with torch.no_grad():  # sharper next-token distributions, so a frequency test has power
        model.base.model.norm.weight.mul_(6.0)
    ex = examples[0]
    clean_greedy = model.greedy([ex])
    torch.manual_seed(0)
    clean = model.sample([ex], group_size=40, temperature=tau)
    logits = first_answer_logits(model, clean)
    p = torch.softmax(logits / tau, -1)
    top = p.topk(6).indices.tolist()
    assert p[top[0]] > 0.1, "test needs a peaked first-token distribution"

    gen = model.base.generation_config
    for k, v in checkpoint_generation_settings(model, ex, top, group).items():
        setattr(gen, k, v)
    # Greedy: argmax, and the same answer as with an empty generation config.
    greedy = model.greedy([ex])
    assert torch.equal(greedy.rows, clean.rows[:1]) and torch.equal(greedy.budgets, clean.budgets[:1])
    assert int(greedy.answer_ids[0, 0]) == int(logits.argmax())
    assert torch.equal(greedy.answer_ids, clean_greedy.answer_ids)
    # Sampling: the same draws as with an empty generation config, log-probs == recomputed ones...
    torch.manual_seed(0)
    again = model.sample([ex], group_size=40, temperature=tau)
    assert torch.equal(again.answer_ids, clean.answer_ids) and torch.equal(again.logp_answer, clean.logp_answer)
    _close(model.score(again).logp_answer, again.logp_answer)
    torch.manual_seed(1)
    traj = model.sample([ex], group_size=1000, temperature=tau)
    _close(traj.logp_answer[:, 0], torch.log(p)[traj.answer_ids[:, 0]])
    # ...and first tokens distributed as softmax(logits / T): chi-square over the tokens expected
    # 5+ times, the rest pooled (fixed seed: deterministic).
    n = traj.answer_ids.shape[0]
    counts = torch.bincount(traj.answer_ids[:, 0], minlength=p.numel()).double()
    assert counts[top[0]] > 0, "the likeliest token was never drawn"
    expected = n * p.double()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, f"first answer tokens are not distributed as softmax(logits / T): chi2={chi2:.1f}, " \
                           f"{len(obs) - 1} dof, p={p_value:.2g}"


# ---------------------------------------------------------------- rollout memory


class VocabWideMemory(TorchDispatchMode):
    """Peak bytes of live tensors whose last dimension is the vocabulary size V.

    Follows every op's outputs: a storage counts once (views share it) from the op that makes
    it until its last tracked Python tensor dies; the model's weights are left out (the tied
    output embedding's transposes are [d, V]). Deterministic, unlike process RSS.
    """

    def __init__(self, vocab: int, weights: set[int]):
        super().__init__()
        self.vocab, self.weights = vocab, weights
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, live tensors]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and t.numel():
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in self.weights:
                    continue
                if key not in self.live:
                    self.live[key] = [storage.nbytes(), 0]
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                self.live[key][1] += 1
                weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.now -= entry[0]


def test_rollout_memory_does_not_grow_with_answer_length(data, tmp_path):
    """A rollout holds a few [N, V] step buffers, not [N, T, V] logits (+ a log-softmax of them)."""
    V = 5003  # a vocabulary far larger than any other dimension of the tiny model
    bb = tiny_backbone()
    bb.model.resize_token_embeddings(V, mean_resizing=False)
    bb = Backbone(bb.model, bb.tokenizer, "tiny")
    batch = [split[0] for split in data.values()][:2]
    build_bank({"x": batch}, bb, ChunkingConfig(max_tokens=32), BankConfig(dir=str(tmp_path), n_cache=N_CACHE),
               torch.float32, show_progress=False)
    model = ElasticMem(bb, memory_cfg(), Bank.open(tmp_path)).eval()
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    peak = {}
    for greedy in (False, True):
        for T in (2, 6):
            model.cfg.max_new_tokens = T
            torch.manual_seed(0)
            with VocabWideMemory(V, weights) as mem:
                traj = model.greedy(batch) if greedy else model.sample(batch, group_size=4)
            N = traj.answer_ids.shape[0]
            assert traj.answer_ids.shape[1] == T and mem.now == 0
            peak[greedy, T] = mem.peak / (N * V * 4)  # in [N, V] float32 step buffers
    # Before: every step's logits were kept, stacked and log-softmaxed: 3 T buffers (18 at T=6).
    # Now: the model's logits, transformers' float32 copy, (sampling) its warped scores and
    # probabilities, and one step's log-softmax.
    assert peak[False, 6] <= peak[False, 2] <= 6 and peak[True, 6] <= peak[True, 2] <= 3, peak


def test_greedy_memo_reuses_retrieval_and_budgets_with_the_same_answers(bank):
    """An agent episode asks with the same prompt at every step: with a memo, the second call
    reuses the first's control token, memories and budgets (no retrieval time) and answers as
    a call without the memo does, also in a batch mixing seen and unseen prompts."""
    bank, examples = bank
    model = make_model(bank)
    batch = examples[:3]
    plain = model.greedy(batch)
    memo: dict = {}
    first = model.greedy(batch[:2], memo=memo)
    assert len(memo) == 2
    again = model.greedy(batch[:2], memo=memo)
    assert again.timings["policy"] == 0.0 and again.timings["retrieval"] < first.timings["retrieval"]
    mixed = model.greedy(batch, memo=memo)  # one unseen prompt: computed for the whole batch
    assert len(memo) == 3
    for t in (first, again):
        assert torch.equal(t.rows, plain.rows[:2]) and torch.equal(t.budgets, plain.budgets[:2])
        assert t.answers == plain.answers[:2] and t.control.tolist() == plain.control[:2].tolist()
    assert mixed.answers == plain.answers and torch.equal(mixed.budgets, plain.budgets)
    with pytest.raises(ValueError, match="memo"):
        model._rollout(batch, 2, 1.0, greedy=False, memo={})


# ---------------------------------------------------------------- target log-probs in chunks


def _log_softmax_gather(head, h, targets, temperature):
    """The straightforward reference: the whole [M, V] log-softmax, then the targets' entries."""
    return torch.log_softmax(head(h).float() / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows, recompute", [(None, None), (5, None), (5, {"use_reentrant": False}),
                                             (5, {"use_reentrant": True})])
def test_token_logps_in_chunks_equal_log_softmax_gather(dtype, temperature, rows, recompute):
    """``token_logps`` (target logit - logsumexp, chunks of ``rows`` rows, optionally recomputed in
    backward) gives the reference's log-probs and gradients, for float32 and bf16 heads."""
    from elasticmem.model.generation import token_logps

    V, d, M = 101, 16, 23  # 23 rows: 5 chunks of 5, the last one short
    torch.manual_seed(0)
    head = torch.nn.Linear(d, V, bias=False).to(dtype)
    h = (3 * torch.randn(M, d)).to(dtype).requires_grad_()
    targets = torch.randint(V, (M,))
    weight = torch.randn(M)  # a loss that weighs each row differently
    ref = _log_softmax_gather(head, h, targets, temperature)
    (ref * weight).sum().backward()
    ref_grads = [h.grad.clone(), head.weight.grad.clone()]
    h.grad = head.weight.grad = None
    got = token_logps(head, h, targets, temperature, chunk_elements=(rows or M) * V, recompute=recompute)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    (got * weight).sum().backward()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for g, r in zip([h.grad, head.weight.grad], ref_grads):
        torch.testing.assert_close(g, r, **tol)


def test_token_logps_vocab_wide_memory_is_bounded_by_one_chunk():
    """Forward and backward hold a few chunks of logits, not [M, V] copies: the saved chunks add up
    to one [M, V] float32 without recomputation, and stay at one chunk with it."""
    from elasticmem.model.generation import token_logps

    V, d, M, rows = 997, 8, 64, 8
    torch.manual_seed(0)
    head = torch.nn.Linear(d, V, bias=False)
    h = torch.randn(M, d, requires_grad=True)
    targets = torch.randint(V, (M,))
    weights = {p.untyped_storage().data_ptr() for p in head.parameters()}

    def peak(fn) -> float:  # in [rows, V] float32 chunk buffers
        with VocabWideMemory(V, weights) as mem:
            fn().sum().backward()
        return mem.peak / (rows * V * 4)

    chunks = M // rows
    full = peak(lambda: _log_softmax_gather(head, h, targets, 0.7))
    chunked = peak(lambda: token_logps(head, h, targets, 0.7, chunk_elements=rows * V))
    recomputed = peak(lambda: token_logps(head, h, targets, 0.7, chunk_elements=rows * V,
                                          recompute={"use_reentrant": False}))
    assert full >= 3 * chunks, full  # the scaled logits, the log-softmax and its gradient at once
    assert chunked <= chunks + 5, chunked  # measured: the 8 saved chunks and 3 transient ones
    assert recomputed <= 5, recomputed  # measured: 4
