"""Activation checkpointing (``train.gradient_checkpointing``, issue 39 item 4) on the tiny backbone.

    pytest tests/unit/test_gradient_checkpointing.py

With checkpointing the decoder layers (and ``token_logps``' logit chunks) are recomputed in
backward; the gradients of every trainable parameter (LoRA, budget policy, projector; MemGen's
weaver and trigger) must equal those of the same model without it, for soft tokens and for
per-layer KV memories, in torch's non-reentrant and reentrant variants, also for passes of the
frozen base model (adapter off: the warm-up's reconstruction, MemGen's reasoner), which backward
must recompute with the adapter off again. The recomputation is checked to happen (each layer's
MLP starts twice per backward); rollouts, in eval mode without gradients, to be untouched (same
trajectories, decoding from the KV cache: one new position per step); and GRPO training with the
key to end where it ends without it.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_elasticmem import bank, data, memory_cfg, tiny_backbone  # noqa: F401  (fixtures)
from test_kv_content import N_CACHE, kv_bank  # noqa: F401  (fixture; built from test_elasticmem's data)
from test_memgen import make_memgen

import elasticmem.model.generation as generation
from elasticmem.config import LoraConfig
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.projector import ProjectorConfig

NO_DROPOUT = {"lora": LoraConfig(r=4, alpha=8, dropout=0.0), "projector": ProjectorConfig(hidden_size=64, dropout=0.0)}


def _model(bank_, checkpointing: bool, reentrant: bool = False, **kw) -> ElasticMem:
    """The tiny model (seeded: every call the same weights), LoRA perturbed away from B = 0."""
    torch.manual_seed(0)
    policy = {"dropout": 0.0, **kw.pop("policy", {})}
    model = ElasticMem(tiny_backbone(), memory_cfg(**{**NO_DROPOUT, "policy": policy, **kw}), bank_)
    with torch.no_grad():
        for n, p in model.lm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.2)
    if checkpointing:
        model.enable_activation_checkpointing(reentrant=reentrant)
    return model.eval()


def _mlp_calls(model) -> list[int]:
    """Counts of MLP forward calls (one per layer per pass; a recomputed layer adds one)."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    for layer in model.base.get_decoder().layers:
        layer.mlp.register_forward_pre_hook(hook)  # a recomputation may stop inside the MLP
    return calls


def _grads(model, traj, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of every trainable parameter after one scoring pass (train mode) and backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model.score(traj)
    loss = -(out.logp_answer.sum() + out.logp_budget.sum() + out.logp_control.sum())
    if out.query_state is not None:
        loss = loss + out.query_state.pow(2).mean()  # the query state's own path (retrieval loss)
    loss.backward()
    model.eval()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _same_grads(got: dict, ref: dict, trained: set[str]) -> None:
    assert got.keys() == ref.keys()
    assert trained <= {n.split(".", 1)[0] for n, g in ref.items() if g.abs().sum() > 0}, "parts without gradients"
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r, atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("content", ["soft", "kv"])
def test_checkpointing_gives_the_same_gradients(bank, kv_bank, reentrant, content):  # noqa: F811
    """Soft tokens (projector), or per-layer KV memories read from a cache every layer attends to."""
    bank_, examples = bank
    kw = {"detach_policy_inputs": False}  # the adapter also gets the policy's gradients through h
    if content == "kv":
        bank_, kw = kv_bank, {**kw, "content": "kv", "policy": {"max_budget": N_CACHE}}
    plain, ckpt = _model(bank_, False, **kw), _model(bank_, True, reentrant, **kw)
    torch.manual_seed(1)
    traj = plain.sample(examples[:3], group_size=2)
    assert int(traj.memory_tokens.sum()) > 0
    calls = _mlp_calls(ckpt)
    got, ref = _grads(ckpt, traj), _grads(plain, traj)
    layers = len(ckpt.base.get_decoder().layers)
    assert calls[0] == 2 * layers, calls  # every layer ran again in backward
    _same_grads(got, ref, {"lm", "policy"} | ({"projector"} if content == "soft" else set()))


def test_checkpointing_keeps_dropout_masks(bank):  # noqa: F811
    """Dropout on (LoRA, policy, projector): the recomputation replays the forward's masks."""
    bank_, examples = bank
    kw = {"lora": LoraConfig(r=4, alpha=8, dropout=0.3), "projector": ProjectorConfig(hidden_size=64, dropout=0.3),
          "policy": {"dropout": 0.3}}
    plain, ckpt = _model(bank_, False, **kw), _model(bank_, True, **kw)
    torch.manual_seed(1)
    traj = plain.sample(examples[:3], group_size=2)
    _same_grads(_grads(ckpt, traj, seed=5), _grads(plain, traj, seed=5), {"lm", "policy", "projector"})


@pytest.mark.parametrize("reentrant", [False, True])
def test_long_targets_recompute_their_logit_chunks(bank, monkeypatch, reentrant):  # noqa: F811
    """The warm-up's reconstruction (the chunk's own text as target, read by the frozen base model:
    the adapter is off in the forward pass, and must be off again when backward recomputes it):
    with chunks of 7 rows the targets span several ``token_logps`` chunks, recomputed in backward;
    the projector's gradients are those without checkpointing."""
    bank_, _ = bank
    monkeypatch.setattr(generation, "LOGIT_CHUNK_ELEMENTS", 7 * len(tiny_backbone().tokenizer))
    plain, ckpt = _model(bank_, False), _model(bank_, True, reentrant)
    rows, budgets = torch.arange(6), torch.tensor([1, 2, 3, 4, 5, 6])
    grads = []
    for model in (plain, ckpt):
        model.train()
        logp, mask = model.reconstruction_logps(rows, budgets, [1, 2], [3])
        assert int(mask.sum()) > 14  # more rows than two chunks
        (-(logp * mask).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.projector.named_parameters()})
    _same_grads(grads[1], grads[0], {"net"})


@pytest.mark.parametrize("reentrant", [False, True])
def test_memgen_checkpointing_gives_the_same_gradients(bank, reentrant):  # noqa: F811
    """The weaver (adapter on) and the frozen reasoner (adapter off) both recomputed as they ran."""
    bank_, examples = bank
    models = []
    for on in (False, True):
        m = make_memgen(bank_, invoke_bias=2.0, memory={"lora": LoraConfig(r=4, alpha=8, dropout=0.0)})
        if on:
            m.enable_activation_checkpointing(reentrant)
        models.append(m)
    torch.manual_seed(1)
    traj = models[0].sample(examples[:2], group_size=2)
    assert bool((traj.budgets > 0).any()), "the weaver should be invoked during answers"
    ref, got = _grads(models[0], traj), _grads(models[1], traj)
    _same_grads(got, ref, {"lm", "weaver", "trigger"})


def test_rollouts_are_untouched_and_decode_with_the_kv_cache(bank):  # noqa: F811
    bank_, examples = bank
    plain, ckpt = _model(bank_, False), _model(bank_, True)
    lengths: list[int] = []  # positions each forward pass of ckpt's first layer reads
    ckpt.base.get_decoder().layers[0].mlp.register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[1]))
    traj = {}
    for name, model in (("plain", plain), ("ckpt", ckpt)):
        torch.manual_seed(3)
        traj[name] = model.sample(examples[:2], group_size=2)
    a, b = traj["plain"], traj["ckpt"]
    assert torch.equal(a.answer_ids, b.answer_ids) and torch.equal(a.budgets, b.budgets)
    torch.testing.assert_close(a.logp_answer, b.logp_answer, atol=0, rtol=0)
    # the prompt, the control token, the answer's prefill, then one new position per decoding step
    assert len(lengths) > 3 and set(lengths[3:]) == {1}, lengths


def test_grpo_training_with_checkpointing_equals_without(tmp_path, monkeypatch):
    """train.gradient_checkpointing=true reaches the trainer's model and changes nothing else: 3
    GRPO steps (dropout on every part, 2 optimizer steps per rollout batch) end with the same
    weights and metrics, and a resumed run may switch it."""
    from conftest import ROOT
    from safetensors.torch import load_file

    from elasticmem.backbone import load_backbone
    from elasticmem.bank import build_bank
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic
    from elasticmem.grpo import trainer
    from elasticmem.training.runtime import config_changes

    enabled = []
    enable = ElasticMem.enable_activation_checkpointing
    monkeypatch.setattr(ElasticMem, "enable_activation_checkpointing",
                        lambda self, *a, **kw: (enabled.append(a), enable(self, *a, **kw))[1])
    base = [f"data.dir={tmp_path}/data", f"bank.dir={tmp_path}/bank", "train.max_steps=3", "train.eval_split=",
            "memory.lora.dropout=0.1", "memory.policy.dropout=0.1", "memory.projector.dropout=0.1",
            "memory.top_z=2", "train.num_iterations=2"]
    cfg = load_config(ROOT / "configs/tiny.yaml", base)
    write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    build_bank({s: load_split(cfg.data.dir, s) for s in ("train", "val", "test")}, load_backbone(cfg.backbone),
               cfg.chunking, cfg.bank, torch.float32, show_progress=False)
    runs = {name: load_config(ROOT / "configs/tiny.yaml", [*base, f"train.output_dir={tmp_path / name}", *extra])
            for name, extra in (("plain", []), ("ckpt", ["train.gradient_checkpointing=true"]))}
    assert config_changes(runs["plain"], runs["ckpt"]) == ["train.output_dir"]  # resuming may switch it
    for name, cfg in runs.items():
        trainer.train(cfg)
        assert len(enabled) == (name == "ckpt")
    for f in ("adapter/adapter_model.safetensors", "budget_policy.safetensors", "projector.safetensors"):
        a, b = (load_file(str(tmp_path / name / "final" / f)) for name in runs)
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=f"{f} {k}")
    rows = {name: [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in runs}
    for a, b in zip(rows["plain"], rows["ckpt"], strict=True):
        for k, v in a.items():
            if not k.startswith("time/"):
                assert b[k] == (pytest.approx(v, rel=1e-5, abs=1e-6) if isinstance(v, float) else v), (a["step"], k)
