"""Tests of the GRPO advantages and loss (elasticmem.grpo.loss).

The token-level loss is checked against TRL's own ``GRPOTrainer._compute_loss``
(run on a stub trainer), the ElasticMem loss against a loop over DESIGN.md's
formula, and gradient accumulation by summing micro-batch losses.

Run with::

    pytest tests/unit/test_loss.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from elasticmem.grpo.loss import (
    LOSS_TYPES,
    LossConfig,
    Normalizer,
    PartLogProbs,
    PartMasks,
    clipped_objective,
    elasticmem_loss,
    group_advantages,
    k3_kl,
    keep_trajectories,
    token_loss,
    uniform_groups,
)
from elasticmem.utils.configuration import field_docs

ATOL = 1e-6


# ---------------------------------------------------------------------------- config


def test_every_config_field_is_documented():
    docs = field_docs(LossConfig)
    assert not [f.name for f in dataclasses.fields(LossConfig) if not docs.get(f.name)]


@pytest.mark.parametrize("bad", [
    dict(advantage_scale="batch"), dict(loss_type="bnpo"), dict(advantage_clamp=0.0), dict(std_floor=-1.0),
    dict(clip_eps=1.0), dict(clip_eps=-0.1), dict(clip_eps_high=-0.1), dict(control_weight=-1.0),
    dict(budget_weight=float("nan")), dict(answer_weight=float("inf")), dict(entropy_coef=-0.1), dict(kl_beta=-1.0),
])
def test_config_rejects(bad):
    with pytest.raises(ValueError):
        LossConfig(**bad)


def test_eps_high_defaults_to_clip_eps():
    assert LossConfig(clip_eps=0.1).eps_high == 0.1
    assert LossConfig(clip_eps=0.1, clip_eps_high=0.3).eps_high == 0.3


# ---------------------------------------------------------------------------- advantages


def numpy_advantages(rewards: np.ndarray, scale: str, clamp: float | None, floor: float) -> np.ndarray:
    out = np.zeros_like(rewards, dtype=np.float64)
    for b, group in enumerate(rewards):
        mean = sum(group) / len(group)
        if scale == "group":
            var = sum((r - mean) ** 2 for r in group) / (len(group) - 1) if len(group) > 1 else 0.0
            denom = max(var ** 0.5, floor) + 1e-8
        else:
            denom = 1.0
        for g, r in enumerate(group):
            a = (r - mean) / denom
            out[b, g] = a if clamp is None else min(max(a, -clamp), clamp)
    return out


REWARDS = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.5, 0.0],
                    [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("scale", ["group", "none"])
@pytest.mark.parametrize("clamp", [5.0, 1.0, None])
def test_group_advantages_match_numpy(scale, clamp):
    cfg = LossConfig(advantage_scale=scale, advantage_clamp=clamp)
    got = group_advantages(torch.tensor(REWARDS), cfg)
    np.testing.assert_allclose(got.numpy(), numpy_advantages(REWARDS, scale, clamp, cfg.std_floor), rtol=1e-12)


def test_group_advantages_clamp_is_active():
    rewards = torch.tensor([[0.0] * 99 + [1.0]])  # the lone success sits (99/10)^0.5 / ... ~ 9.9 std above the mean
    unclamped = group_advantages(rewards, LossConfig(advantage_clamp=None))
    assert unclamped.max() > 5
    assert group_advantages(rewards, LossConfig()).max() == pytest.approx(5.0)


def test_group_advantages_uniform_groups_and_single_trajectories_are_zero():
    for rewards in (torch.ones(3, 4), torch.tensor([[1.0], [0.0]]), torch.tensor([[1], [0]])):
        for scale in ("group", "none"):
            adv = group_advantages(rewards, LossConfig(advantage_scale=scale))
            assert adv.dtype == torch.float32 and torch.equal(adv, torch.zeros_like(adv))


def test_group_advantages_rejects_flat_rewards():
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        group_advantages(torch.ones(8), LossConfig())


def test_uniform_groups_and_keep():
    rewards = torch.tensor(REWARDS)
    assert uniform_groups(rewards).tolist() == [False, True, False, False, True]
    assert uniform_groups(torch.tensor([[1.0], [0.0]])).tolist() == [True, True]
    assert keep_trajectories(rewards, LossConfig()) is None
    keep = keep_trajectories(rewards, LossConfig(skip_uniform_groups=True))
    assert keep.tolist() == [True] * 4 + [False] * 4 + [True] * 8 + [False] * 4


# ---------------------------------------------------------------------------- elementwise terms


def test_clipped_objective_by_hand():
    logp_old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]]))
    adv = torch.tensor([2.0, -1.0])  # [N] broadcasts over [N, T]
    objective, clipped = clipped_objective(logp, logp_old, adv, 0.2, 0.3)
    expected = torch.tensor([[0.5 * 2, 1.0 * 2, 1.3 * 2], [-0.8, -1.0, -1.5]])
    torch.testing.assert_close(objective, expected)
    assert clipped.tolist() == [[False, False, True], [True, False, False]]


def test_k3_kl_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0, -2.0])
    expected = [np.exp(r - lp) - (r - lp) - 1 for lp, r in zip(logp.tolist(), ref.tolist())]
    np.testing.assert_allclose(k3_kl(logp, ref).numpy(), expected, rtol=1e-6)
    assert k3_kl(logp, ref)[0] == 0 and (k3_kl(logp, ref) >= 0).all()


# ---------------------------------------------------------------------------- TRL oracle


class _Accelerator:
    """What ``_compute_loss`` asks of accelerate, for one process."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def autocast(self):
        return contextlib.nullcontext()


class _TRLStub:
    """The attributes of a GRPOTrainer that ``_compute_loss`` reads, set from a real GRPOConfig the
    way ``GRPOTrainer.__init__`` sets them; the model forward is replaced by given log-probs."""

    def __init__(self, args, per_token_logps: torch.Tensor):
        self.args = args
        self.loss_type = args.loss_type
        self.beta = args.beta
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.max_completion_length = args.max_completion_length
        self.importance_sampling_level = args.importance_sampling_level
        self.off_policy_mask_threshold = args.off_policy_mask_threshold
        self.top_entropy_quantile = args.top_entropy_quantile
        self.use_vllm = args.use_vllm
        self.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
        self.entropy_coef = args.entropy_coef
        self.use_adaptive_entropy = args.use_adaptive_entropy
        self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy
        self.aux_loss_enabled = False
        self.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        self.accelerator = _Accelerator()
        self.model = SimpleNamespace(training=True)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._per_token_logps = per_token_logps

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == self._per_token_logps.shape[1]
        return self._per_token_logps, torch.zeros_like(self._per_token_logps), None


@pytest.fixture(scope="module")
def trl_grpo():
    pytest.importorskip("trl", reason="trl is not installed: the TRL oracle tests need it (pip install trl)")
    from trl import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    return GRPOTrainer, GRPOConfig


def trl_loss(trl_grpo, logp, logp_old, adv, mask, logp_ref, *, loss_type, eps, eps_high, beta, total_tokens,
             accumulation_steps=1):
    """TRL's loss of one micro-batch (and its logged metrics) for the given per-token log-probs."""
    GRPOTrainer, GRPOConfig = trl_grpo
    n, t = logp.shape
    with warnings.catch_warnings():  # TrainingArguments' own deprecation notices, not ours to fix
        warnings.simplefilter("ignore", FutureWarning)
        args = GRPOConfig(
            output_dir="unused", report_to=[], use_cpu=True, bf16=False, loss_type=loss_type, epsilon=eps,
            epsilon_high=eps_high, beta=beta, max_completion_length=t,
            # TRL's default multiplies the KL by the ratio (importance-sampling correction); the
            # classic GRPO k3, which we implement, is without it
            use_bias_correction_kl=False,
            gradient_accumulation_steps=accumulation_steps, per_device_train_batch_size=n, num_generations=2,
        )
    stub = _TRLStub(args, logp)
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": adv, "old_per_token_logps": logp_old,
        # dapo: the token count of the whole generation batch, which TRL gathers over processes
        "num_items_in_batch": torch.tensor(float(total_tokens)),
    }
    if beta != 0:
        inputs["ref_per_token_logps"] = logp_ref
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items()}


def token_batch(n: int = 6, t: int = 5, seed: int = 0):
    """Log-probs with old != new (num_iterations > 1 style): ratios on both sides of any clip range."""
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(n, t, generator=g) * 3
    logp = (logp_old + 0.3 * torch.randn(n, t, generator=g)).requires_grad_()
    logp_ref = logp_old + 0.5 * torch.randn(n, t, generator=g)
    adv = torch.randn(n, generator=g)
    adv[1] = 0.0
    lengths = torch.tensor([5, 3, 1, 4, 0, 2])[:n]  # row 4: an empty completion
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return logp, logp_old, logp_ref, adv, mask


TRL_CASES = [(loss_type, eps, eps_high, beta) for loss_type in LOSS_TYPES
             for eps, eps_high in ((0.2, None), (0.05, 0.28)) for beta in (0.0, 0.04)]


@pytest.mark.parametrize("loss_type, eps, eps_high, beta", TRL_CASES)
def test_token_loss_matches_trl(trl_grpo, loss_type, eps, eps_high, beta):
    logp, logp_old, logp_ref, adv, mask = token_batch()
    cfg = LossConfig(loss_type=loss_type, clip_eps=eps, clip_eps_high=eps_high, kl_beta=beta)
    norm = Normalizer.from_masks(PartMasks(torch.zeros(len(mask), dtype=torch.bool), torch.zeros(len(mask), 0,
                                           dtype=torch.bool), mask), max_new_tokens=mask.shape[1], with_control=False)
    ours, metrics = token_loss(logp, logp_old, adv, mask, cfg, norm, logp_ref if beta else None)
    (grad_ours,) = torch.autograd.grad(ours, logp)

    theirs, trl_metrics = trl_loss(trl_grpo, logp, logp_old, adv, mask, logp_ref, loss_type=loss_type, eps=eps,
                                   eps_high=eps_high, beta=beta, total_tokens=norm.lm_units)
    (grad_theirs,) = torch.autograd.grad(theirs, logp)

    assert metrics["clip_frac/lm"] > 0  # the clip is active, so the comparison covers it
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad_ours, grad_theirs, atol=ATOL, rtol=0)
    assert metrics["clip_frac/lm"].item() == pytest.approx(trl_metrics["clip_ratio/region_mean"], abs=ATOL)
    if beta:
        assert metrics["kl"].item() == pytest.approx(trl_metrics["kl"], abs=ATOL)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_token_loss_accumulates_like_trl(trl_grpo, loss_type):
    """Two equal micro-batches under TRL's gradient accumulation (its losses are divided by the
    accumulation steps) add up to our micro-batch losses under one full-batch Normalizer."""
    logp, logp_old, logp_ref, adv, mask = token_batch()
    cfg = LossConfig(loss_type=loss_type, clip_eps=0.2, kl_beta=0.04)
    no_control = torch.zeros(len(mask), dtype=torch.bool)
    norm = Normalizer.from_masks(PartMasks(no_control, no_control[:, None][:, :0], mask), mask.shape[1],
                                 with_control=False)
    ours, theirs = torch.zeros(()), torch.zeros(())
    for part in (slice(0, 3), slice(3, 6)):
        ours = ours + token_loss(logp[part], logp_old[part], adv[part], mask[part], cfg, norm, logp_ref[part])[0]
        theirs = theirs + trl_loss(trl_grpo, logp[part], logp_old[part], adv[part], mask[part], logp_ref[part],
                                   loss_type=loss_type, eps=0.2, eps_high=None, beta=0.04,
                                   total_tokens=norm.lm_units, accumulation_steps=2)[0]
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    grads = [torch.autograd.grad(x, logp)[0] for x in (ours, theirs)]
    torch.testing.assert_close(grads[0], grads[1], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------- ElasticMem loss vs DESIGN.md


N, Z, T = 4, 3, 3
MAX_NEW_TOKENS = 4  # > T: dr_grpo's constant is the configured maximum, not the longest answer seen


def hand_made():
    """N=4 trajectories by hand: clipping in both directions, a trajectory without budgets (2),
    one without a control token (3), absent units holding garbage (NaN, inf) that must not leak."""
    nan, inf = float("nan"), float("inf")
    masks = PartMasks(
        control=torch.tensor([True, True, True, False]),
        budget=torch.tensor([[True, True, True], [True, True, False], [False, False, False], [True, False, False]]),
        answer=torch.tensor([[True, True, False], [True, True, True], [True, True, True], [True, False, False]]),
    )
    old = PartLogProbs(
        control=torch.tensor([-1.0, -2.0, -0.5, 0.0]),
        budget=torch.tensor([[-1.0, -2.0, -3.0], [-1.5, -0.7, 0.0], [0.0, 0.0, 0.0], [-2.0, 0.0, 0.0]]),
        answer=torch.tensor([[-0.2, -1.0, 0.0], [-0.3, -0.8, -2.0], [-1.1, -0.4, -0.9], [-0.6, 0.0, 0.0]]),
    )
    # new - old: +0.2 (ratio 1.22) clips with A > 0, -0.3 (0.74) clips with A < 0, +-0.02 stays inside
    new = PartLogProbs(
        control=torch.tensor([-0.8, -2.3, -0.52, 7.0]),
        budget=torch.tensor([[-0.8, -2.02, -3.3], [-1.8, -0.5, nan], [inf, nan, -inf], [-2.01, 5.0, nan]]),
        answer=torch.tensor([[-0.18, -0.7, nan], [-0.6, -0.78, -1.7], [-1.0, -0.42, -0.9], [-0.9, inf, 3.0]]),
        budget_entropy=torch.tensor([[1.2, 0.7, 2.0], [0.3, 1.5, nan], [9.0, 9.0, 9.0], [0.9, 4.0, 4.0]]),
    )
    ref = PartLogProbs(
        control=torch.tensor([-1.1, -1.5, -0.4, nan]),
        budget=torch.zeros(N, Z),
        answer=torch.tensor([[-0.5, -0.9, nan], [-0.3, -1.0, -1.6], [-1.2, -0.3, -1.0], [-0.7, nan, nan]]),
    )
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    return new, old, ref, adv, masks


def leaves(parts: PartLogProbs) -> PartLogProbs:
    return PartLogProbs(*(x.double().requires_grad_() for x in (parts.control, parts.budget, parts.answer,
                                                                 parts.budget_entropy)))


def design_loss(new, old, ref, adv, masks, cfg: LossConfig, keep=None):
    """DESIGN.md section 1.7 written out unit by unit, with TRL's three normalisations."""
    keep = [True] * N if keep is None else keep
    lo, hi = 1 - cfg.clip_eps, 1 + cfg.eps_high

    def clip(lp, lp_old, a):
        rho = torch.exp(lp - lp_old)
        return torch.minimum(rho * a, torch.clamp(rho, lo, hi) * a)

    def kl(lp, lp_ref):
        return torch.exp(lp_ref - lp) - (lp_ref - lp) - 1

    lm_units, budget_units = [], []  # per kept trajectory: its unit losses
    for i in range(N):
        if not keep[i]:
            continue
        lm, bud = [], []
        if masks.control[i]:
            lm.append(-cfg.control_weight * clip(new.control[i], old.control[i], adv[i])
                      + (cfg.kl_beta * kl(new.control[i], ref.control[i]) if ref is not None else 0.0))
        for t in range(T):
            if masks.answer[i, t]:
                lm.append(-cfg.answer_weight * clip(new.answer[i, t], old.answer[i, t], adv[i])
                          + (cfg.kl_beta * kl(new.answer[i, t], ref.answer[i, t]) if ref is not None else 0.0))
        for j in range(Z):
            if masks.budget[i, j]:
                bud.append(-cfg.budget_weight * clip(new.budget[i, j], old.budget[i, j], adv[i])
                           - cfg.entropy_coef * new.budget_entropy[i, j])
        lm_units.append(lm)
        budget_units.append(bud)
    kept = len(lm_units)
    if cfg.loss_type == "grpo":
        per_traj = [(sum(lm) / len(lm) if lm else 0.0) + (sum(b) / len(b) if b else 0.0)
                    for lm, b in zip(lm_units, budget_units)]
        return sum(per_traj) / kept
    lm_sum = sum(u for lm in lm_units for u in lm)
    b_sum = sum(u for b in budget_units for u in b)
    if cfg.loss_type == "dr_grpo":
        return lm_sum / (kept * (MAX_NEW_TOKENS + 1)) + b_sum / (kept * Z)
    return lm_sum / sum(map(len, lm_units)) + b_sum / sum(map(len, budget_units))


def test_hand_made_batch_clips_both_ways():
    new, old, _, adv, masks = hand_made()
    for got, was, mask in ((new.budget, old.budget, masks.budget), (new.answer, old.answer, masks.answer)):
        _, clipped = clipped_objective(torch.where(mask, got, 0), torch.where(mask, was, 0), adv, 0.05, 0.05)
        up, down = clipped & mask & (adv[:, None] > 0), clipped & mask & (adv[:, None] < 0)
        assert up.any() and down.any()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("variant", [
    dict(),
    dict(kl_beta=0.1),
    dict(control_weight=2.0, budget_weight=0.5, answer_weight=3.0, entropy_coef=0.05, clip_eps_high=0.28),
    dict(keep=[True, False, True, True]),
])
def test_elasticmem_loss_matches_design(loss_type, variant):
    variant = dict(variant)
    keep = variant.pop("keep", None)
    cfg = LossConfig(loss_type=loss_type, **variant)
    new, old, ref, adv, masks = hand_made()
    new = leaves(new)
    ref = ref if cfg.kl_beta else None
    keep_t = None if keep is None else torch.tensor(keep)
    norm = Normalizer.from_masks(masks, MAX_NEW_TOKENS, keep=keep_t)
    ours, metrics = elasticmem_loss(new, old, adv, masks, cfg, norm, ref=ref, keep=keep_t)
    expected = design_loss(new, old, ref, adv.double(), masks, cfg, keep)
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours, expected, atol=1e-12, rtol=0)
    params = [new.control, new.budget, new.answer, new.budget_entropy]
    ours_grad = torch.autograd.grad(ours, params)
    expected_grad = torch.autograd.grad(expected, params, allow_unused=True)
    for got, want in zip(ours_grad, expected_grad):
        torch.testing.assert_close(got, torch.zeros_like(got) if want is None else want, atol=1e-12, rtol=0)
    assert metrics["loss/lm"] + metrics["loss/budget"] == pytest.approx(ours.item(), abs=1e-12)
    assert all(torch.isfinite(v) for v in metrics.values())


def lm_units(parts: PartLogProbs, masks: PartMasks) -> torch.Tensor:
    """The present LM units of a batch, flattened trajectory by trajectory: control token, then answer tokens."""
    present = torch.cat([masks.control[:, None], masks.answer], 1)
    return torch.cat([parts.control[:, None], parts.answer], 1)[present]


def test_metrics_by_hand():
    new, old, ref, adv, masks = hand_made()
    cfg = LossConfig(kl_beta=0.1)
    _, metrics = elasticmem_loss(new, old, adv, masks, cfg, Normalizer.from_masks(masks, MAX_NEW_TOKENS), ref=ref)
    lm_new, lm_old, lm_ref = (lm_units(p, masks) for p in (new, old, ref))
    lm_adv = lm_units(PartLogProbs(adv, adv[:, None], adv[:, None].expand(N, T)), masks)
    assert metrics["units/lm"] == len(lm_new) == 12 and metrics["units/budget"] == masks.budget.sum() == 6
    objective, clipped = clipped_objective(lm_new, lm_old, lm_adv, 0.05, 0.05)
    assert metrics["objective/lm"].item() == pytest.approx(objective.mean().item(), abs=1e-6)
    assert metrics["clip_frac/lm"].item() == pytest.approx(clipped.float().mean().item(), abs=1e-6)
    assert metrics["ratio/lm"].item() == pytest.approx((lm_new - lm_old).exp().mean().item(), abs=1e-6)
    assert metrics["kl"].item() == pytest.approx(k3_kl(lm_new, lm_ref).mean().item(), abs=1e-6)
    assert metrics["entropy/budget"].item() == pytest.approx(new.budget_entropy[masks.budget].mean().item(), abs=1e-6)
    assert all(not v.requires_grad for v in metrics.values())


def test_kl_term_by_hand():
    """With every advantage 0 the clipped objective vanishes: the loss is kl_beta times the mean k3."""
    new, old, ref, _, masks = hand_made()
    cfg = LossConfig(kl_beta=0.25, entropy_coef=0.0, loss_type="dapo")
    loss, _ = elasticmem_loss(new, old, torch.zeros(N), masks, cfg, Normalizer.from_masks(masks, MAX_NEW_TOKENS),
                              ref=ref)
    k3 = [np.exp(r - lp) - (r - lp) - 1 for lp, r in zip(lm_units(new, masks).tolist(), lm_units(ref, masks).tolist())]
    assert loss.item() == pytest.approx(0.25 * sum(k3) / len(k3), rel=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_weights_scale_their_terms(loss_type):
    """The loss is linear in the weights: each weight scales exactly its own units' terms."""
    new, old, _, adv, masks = hand_made()
    norm = Normalizer.from_masks(masks, MAX_NEW_TOKENS)

    def loss(**weights):
        cfg = LossConfig(loss_type=loss_type, entropy_coef=0.0, **weights)
        return elasticmem_loss(new, old, adv, masks, cfg, norm)[0]

    only = {k: loss(**{w: float(w == k) for w in ("control_weight", "budget_weight", "answer_weight")})
            for k in ("control_weight", "budget_weight", "answer_weight")}
    assert all(v != 0 for v in only.values())
    mixed = loss(control_weight=2.0, budget_weight=0.5, answer_weight=3.0)
    expected = 2.0 * only["control_weight"] + 0.5 * only["budget_weight"] + 3.0 * only["answer_weight"]
    assert mixed.item() == pytest.approx(expected.item(), abs=1e-6)
    # the entropy bonus only lowers the budget term
    with_bonus = elasticmem_loss(new, old, adv, masks, LossConfig(loss_type=loss_type, entropy_coef=0.1), norm)[1]
    without = elasticmem_loss(new, old, adv, masks, LossConfig(loss_type=loss_type, entropy_coef=0.0), norm)[1]
    assert with_bonus["loss/lm"] == without["loss/lm"] and with_bonus["loss/budget"] < without["loss/budget"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_keep_equals_loss_of_the_kept_subset(loss_type):
    new, old, ref, adv, masks = hand_made()
    cfg = LossConfig(loss_type=loss_type, kl_beta=0.1)
    keep = torch.tensor([True, False, False, True])
    masked, _ = elasticmem_loss(new, old, adv, masks, cfg, Normalizer.from_masks(masks, MAX_NEW_TOKENS, keep=keep),
                                ref=ref, keep=keep)
    sub_masks = masks.select(keep)
    subset, _ = elasticmem_loss(new.select(keep), old.select(keep), adv[keep], sub_masks, cfg,
                                Normalizer.from_masks(sub_masks, MAX_NEW_TOKENS), ref=ref.select(keep))
    assert masked.item() == pytest.approx(subset.item(), abs=ATOL)
    nothing = torch.zeros(N, dtype=torch.bool)
    empty, _ = elasticmem_loss(leaves(new), old, adv, masks, cfg,
                               Normalizer.from_masks(masks, MAX_NEW_TOKENS, keep=nothing), ref=ref, keep=nothing)
    assert empty.item() == 0.0 and empty.requires_grad


# ---------------------------------------------------------------------------- micro-batching


def random_batch(n: int = 8, z: int = 4, t: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    masks = PartMasks(control=torch.ones(n, dtype=torch.bool), budget=torch.rand(n, z, generator=g) < 0.7,
                      answer=torch.arange(t)[None, :] < torch.randint(1, t + 1, (n,), generator=g)[:, None])
    masks.budget[2] = False  # a trajectory without retrieved memories
    old = PartLogProbs(-torch.rand(n, generator=g) * 3, -torch.rand(n, z, generator=g) * 3,
                       -torch.rand(n, t, generator=g) * 3)
    new = PartLogProbs(*(x + 0.2 * torch.randn(x.shape, generator=g) for x in (old.control, old.budget, old.answer)),
                       budget_entropy=torch.rand(n, z, generator=g) * 2)
    ref = PartLogProbs(*(x + 0.3 * torch.randn(x.shape, generator=g) for x in (old.control, old.budget, old.answer)))
    return new, old, ref, torch.randn(n, generator=g), masks


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("splits", [(0, 3, 8), (0, 1, 5, 8)])
def test_micro_batches_sum_to_the_full_batch(loss_type, splits):
    new, old, ref, adv, masks = random_batch()
    cfg = LossConfig(loss_type=loss_type, kl_beta=0.05, entropy_coef=0.01, clip_eps=0.1)
    keep = torch.ones(8, dtype=torch.bool)
    keep[5] = False
    parts = [slice(a, b) for a, b in zip(splits, splits[1:])]
    norm = Normalizer.from_masks(masks, max_new_tokens=6, keep=keep)
    assert norm == Normalizer.combine([Normalizer.from_masks(masks.select(p), 6, keep=keep[p]) for p in parts])

    def grads(parts_: list[slice]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaf = leaves(new)
        total = sum(elasticmem_loss(leaf.select(p), old.select(p), adv[p], masks.select(p), cfg, norm,
                                    ref=ref.select(p), keep=keep[p])[0] for p in parts_)
        return total, list(torch.autograd.grad(total, [leaf.control, leaf.budget, leaf.answer, leaf.budget_entropy]))

    full, full_grads = grads([slice(0, 8)])
    summed, summed_grads = grads(parts)
    torch.testing.assert_close(summed, full, atol=1e-12, rtol=0)
    for a, b in zip(summed_grads, full_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------- inputs


def test_normalizer_from_masks_counts():
    _, _, _, _, masks = hand_made()
    norm = Normalizer.from_masks(masks, MAX_NEW_TOKENS, keep=torch.tensor([True, True, False, True]))
    assert norm == Normalizer(num_trajectories=3, lm_units=2 + (2 + 3 + 1), budget_units=6,
                              max_lm_units=MAX_NEW_TOKENS + 1, max_budget_units=Z)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Normalizer.from_masks(masks, max_new_tokens=2)
    with pytest.raises(ValueError, match="with_control"):
        Normalizer.from_masks(masks, MAX_NEW_TOKENS, with_control=False)
    with pytest.raises(ValueError, match="max_lm_units"):
        Normalizer.combine([norm, dataclasses.replace(norm, max_lm_units=9)])
    with pytest.raises(ValueError, match="num_trajectories"):
        Normalizer(-1, 0, 0, 1, 1)


def test_part_containers_read_rollout_outputs():
    traj = SimpleNamespace(control=torch.tensor([5, -1]), mask=torch.tensor([[True, False], [True, True]]),
                           answer_mask=torch.tensor([[True], [False]]), logp_control=torch.tensor([-1.0, 0.0]),
                           logp_budget=torch.zeros(2, 2), entropy_budget=torch.ones(2, 2),
                           logp_answer=torch.full((2, 1), -0.5))
    masks, parts = PartMasks.of(traj), PartLogProbs.of(traj)
    assert masks.control.tolist() == [True, False] and masks.budget.dtype == torch.bool
    assert parts.budget_entropy is traj.entropy_budget and parts.answer is traj.logp_answer
    assert parts.select(slice(1, 2)).control.tolist() == [0.0]


def test_bad_inputs_raise():
    new, old, ref, adv, masks = hand_made()
    norm = Normalizer.from_masks(masks, MAX_NEW_TOKENS)
    cfg = LossConfig()
    with pytest.raises(ValueError, match="old.answer"):
        elasticmem_loss(new, dataclasses.replace(old, answer=old.answer[:, :2]), adv, masks, cfg, norm)
    with pytest.raises(ValueError, match="advantages"):
        elasticmem_loss(new, old, adv[:, None], masks, cfg, norm)
    with pytest.raises(ValueError, match="ref"):
        elasticmem_loss(new, old, adv, masks, LossConfig(kl_beta=0.1), norm)
    with pytest.raises(ValueError, match="budget_entropy"):
        elasticmem_loss(dataclasses.replace(new, budget_entropy=None), old, adv, masks, cfg, norm)
    with pytest.raises(ValueError, match="keep"):
        elasticmem_loss(new, old, adv, masks, cfg, norm, keep=torch.ones(N))


# ---------------------------------------------------------------------------- auxiliary retrieval loss


def _retrieval_reference(h, keys, candidates, positive, tau, count):
    """Per trajectory, in plain Python: -log(sum of softmax probabilities of the evidence)."""
    import math as m

    total = 0.0
    for i in range(h.shape[0]):
        cand = [j for j in range(keys.shape[1]) if candidates[i, j]]
        pos = [j for j in cand if positive[i, j]]
        if not pos:
            continue
        hn = h[i] / h[i].norm()
        e = {j: m.exp(float(hn @ keys[i, j]) / tau) for j in cand}
        total += -m.log(sum(e[j] for j in pos) / sum(e.values()))
    return total / count


def test_retrieval_loss_equals_softmax_cross_entropy_and_adds_over_micro_batches():
    from elasticmem.grpo.loss import retrieval_loss

    g = torch.Generator().manual_seed(0)
    N, M, d = 6, 5, 8
    h = torch.randn(N, d, generator=g, dtype=torch.float64, requires_grad=True)
    keys = torch.nn.functional.normalize(torch.randn(N, M, d, generator=g, dtype=torch.float64), dim=-1)
    candidates = torch.ones(N, M, dtype=torch.bool)
    candidates[1, 3:] = False  # a smaller group, padded
    positive = torch.zeros(N, M, dtype=torch.bool)
    positive[0, 1] = positive[1, 0] = positive[2, 2] = positive[2, 4] = positive[4, 3] = True  # 3: none; 5: none
    positive[1, 4] = True  # evidence in a padded slot does not count
    count = 4
    loss, m = retrieval_loss(h, keys, candidates, positive, 0.1, count)
    assert float(loss) == pytest.approx(_retrieval_reference(h.detach(), keys, candidates, positive, 0.1, count),
                                        rel=1e-10)
    assert float(m["units/retrieval"]) == 4
    loss.backward()
    assert torch.isfinite(h.grad).all() and h.grad[3].abs().max() == 0 and h.grad[5].abs().max() == 0
    # micro-batches with the same normaliser add up to the batch
    parts = [retrieval_loss(h[s], keys[s], candidates[s], positive[s], 0.1, count)[0] for s in (slice(0, 2), slice(2, 6))]
    assert float(sum(parts)) == pytest.approx(float(loss), rel=1e-12)
    # a trajectory with its evidence ranked first by far has a loss near 0
    sharp = keys[0, 1].clone()[None] * 50
    near0, _ = retrieval_loss(sharp, keys[:1], candidates[:1], positive[:1], 0.01, 1)
    assert float(near0) < 1e-6
