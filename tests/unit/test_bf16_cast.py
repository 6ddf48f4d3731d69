"""The trainable parts in bf16, as DeepSpeed's bf16 mode casts them (issue 39, item 1).

    pytest tests/unit/test_bf16_cast.py

With ``mixed_precision: bf16`` DeepSpeed casts the whole prepared module to bf16 (budget policy,
projector, LoRA, MemGen's weaver and trigger) and runs it without autocast, so every small module
on the rollout and scoring path must take its float32 inputs in its weights' dtype and hand its
logits back in float32. Each test casts a part (or a whole model) with ``.to(torch.bfloat16)``,
runs the real forward paths, and compares with the same weights in float32: the independent
reference, within what bf16's 8-bit mantissa allows.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_budget_policy import make_inputs, make_policy
from test_elasticmem import bank, data, make_model, memory_cfg, tiny_backbone  # noqa: F401  (fixtures)
from test_kv_content import N_CACHE, kv_bank  # noqa: F401  (fixture; built from test_elasticmem's data)
from test_memgen import make_memgen

from elasticmem.model.budget_policy import LEARNED_VARIANTS
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.projector import Projector, ProjectorConfig

BF16 = torch.bfloat16


def _bf16_twin(model, build):
    """A second model from ``build()`` with ``model``'s weights, cast to bf16 (as DeepSpeed does)."""
    twin = build()
    twin.load_state_dict(model.state_dict())
    return twin.to(BF16)


def _near(got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float = 0.02) -> None:
    assert got.dtype == torch.float32, got.dtype  # logits and log-probs come back in float32
    torch.testing.assert_close(got, ref.to(got.device), atol=atol, rtol=rtol)


@pytest.mark.parametrize("variant", LEARNED_VARIANTS)
def test_budget_policy_in_bf16_agrees_with_float32(variant):
    p32 = make_policy(variant)
    p16 = copy.deepcopy(p32).to(BF16)
    h, keys, scores, mask = make_inputs()
    with torch.no_grad():
        drawn = p16.sample(h, keys, scores, mask, generator=torch.Generator().manual_seed(0))
        greedy = p16.sample(h, keys, scores, mask, greedy=True)
    for s in (drawn, greedy):
        assert s.log_prob.dtype == s.entropy.dtype == torch.float32
        assert bool((s.budgets[mask] >= 0).all()) and bool((s.budgets[~mask] == 0).all())
    budgets = drawn.budgets
    lp16, ent16 = p16.log_prob(h, keys, scores, mask, budgets)
    lp32, ent32 = p32.log_prob(h, keys, scores, mask, budgets)
    _near(lp16, lp32, atol=0.05)
    _near(ent16, ent32, atol=0.05)
    _near(drawn.log_prob, lp32, atol=0.05)  # the draw's own log-prob, from the sampling path
    lg16 = p16.logits(h, keys, scores, mask, budgets)
    lg32 = p32.logits(h, keys, scores, mask, budgets)
    _near(lg16[mask], lg32[mask], atol=0.05)
    lp16.sum().backward()  # gradients reach the bf16 weights
    assert all(p.grad is not None and p.grad.dtype == BF16 for p in p16.parameters() if p.requires_grad)


def test_projector_in_bf16_agrees_with_float32():
    torch.manual_seed(0)
    p32 = Projector(ProjectorConfig(hidden_size=64), 16).eval()
    p16 = copy.deepcopy(p32).to(BF16)
    states = torch.randn(5, 7, 16)
    out = p16(states)  # float32 states in (the bank's, or the caller's cast), float32 soft tokens out
    _near(out, p32(states), atol=0.05)


def test_elasticmem_rollout_and_score_in_bf16(bank):  # noqa: F811
    bank, examples = bank
    m32 = make_model(bank)
    m16 = _bf16_twin(m32, lambda: make_model(bank))
    assert {p.dtype for p in m16.parameters()} == {BF16}
    torch.manual_seed(1)
    traj = m16.sample(examples[:3], group_size=2)
    assert int(traj.memory_tokens.sum()) > 0  # soft tokens went through the bf16 projector
    o16, o32 = m16.score(traj), m32.score(traj)
    _near(o16.logp_control, o32.logp_control, atol=0.05)
    _near(o16.logp_budget, o32.logp_budget, atol=0.05)
    _near(o16.logp_answer, o32.logp_answer, atol=0.1)
    # the bf16 model's scoring reproduces its own rollout (the rollout's policy pass under no_grad
    # takes PyTorch's fused encoder kernel, whose bf16 rounding differs a little)
    _near(o16.logp_budget, traj.logp_budget, atol=0.02, rtol=0)
    _near(o16.logp_answer, traj.logp_answer, atol=0.02, rtol=0)
    assert len(m16.greedy(examples[:3]).answers) == 3
    m16.train()
    (-m16.score(traj).logp_answer.sum() - o16.logp_budget.sum()).backward()
    trained = {n.split(".", 1)[0] for n, p in m16.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"lm", "policy", "projector"} <= trained


def test_kv_content_rollout_and_score_in_bf16(kv_bank, bank):  # noqa: F811
    _, examples = bank  # the same data as kv_bank's (test_elasticmem's fixture)

    def build():
        torch.manual_seed(0)
        return ElasticMem(tiny_backbone(), memory_cfg(content="kv", policy={"max_budget": N_CACHE}), kv_bank).eval()

    m32 = build()
    m16 = _bf16_twin(m32, build)
    torch.manual_seed(1)
    traj = m16.sample(examples[:3], group_size=2)
    assert int(traj.memory_tokens.sum()) > 0  # keys and values read in bf16
    o16, o32 = m16.score(traj), m32.score(traj)
    _near(o16.logp_budget, o32.logp_budget, atol=0.05)
    _near(o16.logp_answer, o32.logp_answer, atol=0.1)


def test_memgen_rollout_and_score_in_bf16(bank):  # noqa: F811
    bank, examples = bank
    m32 = make_memgen(bank)
    m16 = _bf16_twin(m32, lambda: make_memgen(bank))
    torch.manual_seed(1)
    traj = m16.sample(examples[:3], group_size=2)
    assert bool(traj.mask.any()), "the trigger should be offered decisions"
    o16, o32 = m16.score(traj), m32.score(traj)
    _near(o16.logp_budget, o32.logp_budget, atol=0.05)
    _near(o16.entropy_budget, o32.entropy_budget, atol=0.05)
    _near(o16.logp_answer, o32.logp_answer, atol=0.1)
    _near(o16.logp_budget, traj.logp_budget, atol=0.02, rtol=0)
    assert len(m16.greedy(examples[:3]).answers) == 3
    h = torch.randn(4, m16.trigger.net[0].in_features)  # a float32 state, as callers may hand it
    _near(m16.trigger(h), m32.trigger(h), atol=0.05)
