"""The ElasticMem model on the tiny random backbone: batching, exact scoring, injection, gradients, save/load.

    pytest tests/unit/test_elasticmem.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elasticmem.backbone import load_backbone
from elasticmem.bank import Bank, BankError, build_bank
from elasticmem.config import BankConfig, ChunkingConfig, LoraConfig, MemoryConfig, ModelConfig, TinyModelConfig
from elasticmem.data.synthetic import SyntheticConfig, generate
from elasticmem.model.budget_policy import BudgetPolicyConfig
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.injection import Layout, assemble
from elasticmem.model.projector import ProjectorConfig

N_CACHE = 6


def tiny_backbone(seed: int = 0):
    return load_backbone(ModelConfig(name_or_path="tiny", device="cpu", tiny=TinyModelConfig(seed=seed)))


@pytest.fixture(scope="module")
def data():
    cfg = SyntheticConfig(variant="tiny", num_histories=10, num_facts=5, num_options=4)
    return generate(cfg, seed=0)


@pytest.fixture(scope="module")
def bank(tmp_path_factory, data):
    """A bank whose chunks are longer and shorter than N_CACHE (persona-style long turns added)."""
    from elasticmem.data.schema import Turn

    examples = [ex for split in data.values() for ex in split]
    # Lengthen some histories so cache_len varies around N_CACHE.
    longer = {}
    for ex in examples:
        if ex.group not in longer:
            extra = [Turn("user", "the cat sat on the mat " * (len(longer) % 3))] if len(longer) % 2 else []
            longer[ex.group] = [ex.history[0] + extra]
    examples = [dataclasses.replace(ex, history=longer[ex.group]) for ex in examples]
    out = tmp_path_factory.mktemp("bank")
    build_bank({"all": examples}, tiny_backbone(), ChunkingConfig(max_tokens=32),
               BankConfig(dir=str(out), n_cache=N_CACHE, shard_rows=16), torch.float32, show_progress=False)
    return Bank.open(out), examples


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


def test_chat_template_prompt(bank):
    bank, examples = bank
    model = make_model(bank, prompt_template="chat")
    prompt, suffix = model.encode_texts(examples[0])
    text = model.tokenizer.decode(prompt + suffix)
    assert "<|im_start|>" in text and text.rstrip().endswith("assistant")
    traj = model.sample(examples[:2], group_size=2)
    _close(model.score(traj).logp_answer, traj.logp_answer)


def test_sampling_distribution_is_temperature_only(bank):
    """The generation config applies no hidden top-k/top-p: processed scores == raw logits / T."""
    bank, examples = bank
    model = make_model(bank)
    torch.manual_seed(0)
    ids = torch.tensor([model.encode_texts(examples[0])[0]])
    cfg = model.generation_config(0.7, greedy=False)
    cfg.output_scores = True
    out = model.lm.generate(input_ids=ids, generation_config=cfg)
    for raw, processed in zip(out.logits, out.scores):
        assert torch.allclose(raw / 0.7, processed, atol=1e-6)
