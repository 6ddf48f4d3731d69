"""GRPO advantages and the ElasticMem clipped policy loss (DESIGN.md section 1, item 7).

Shapes: N trajectories in B groups of G (the G trajectories of one query are
contiguous, N = B * G); T answer positions; Z budget slots. A trajectory has two
kinds of *units* (actions with a log-probability):

* LM units: the retrieval-control token a (when present) and the answer tokens;
* budget units: the budget decision b_j of every retrieved memory.

Per unit ``-w * min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)`` with
``rho = exp(logp - logp_old)`` and the trajectory's advantage A; LM units add
``kl_beta * k3`` against the adapter-disabled model, budget units subtract
``entropy_coef * entropy``. ``LossConfig.loss_type`` decides how the unit losses
are averaged, mirroring TRL's GRPOTrainer:

* ``grpo``: per trajectory, mean over its LM units + mean over its budget units,
  then the mean over trajectories (the paper's loss);
* ``dr_grpo``: sum over LM units / (trajectories * max LM units per trajectory)
  + the same for budget units (constant denominators, no length bias);
* ``dapo``: sum over LM units / LM units in the batch + sum over budget units /
  budget units in the batch (token-level).

Every denominator comes from a ``Normalizer`` that describes the whole optimizer
batch, so losses of micro-batches computed with the same ``Normalizer`` add up to
the full-batch loss, and their gradients to the full-batch gradient: gradient
accumulation and data parallelism (after summing the counts over processes, and
with DDP's gradient *mean* undone by the caller) change nothing.

Test with::

    pytest tests/unit/test_loss.py
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

from elasticmem.config import ADVANTAGE_SCALES, LOSS_TYPES, LossConfig  # noqa: F401  (re-exported)
from elasticmem.utils.common import require as _require

if TYPE_CHECKING:  # only for annotations
    from elasticmem.model.trajectories import ScoreOutput, Trajectories

_EPS = 1e-8
"""Added to the std floor in the advantage denominator (DESIGN.md)."""


# ---------------------------------------------------------------------------- advantages


def group_advantages(rewards: Tensor, cfg: LossConfig) -> Tensor:
    """Group-relative advantages: rewards [B, G] -> advantages [B, G] (float).

    'group': ``clamp((r - mean) / (max(std, std_floor) + 1e-8), -c, c)``, std unbiased
    (TRL's choice); 'none': ``clamp(r - mean, -c, c)``. A group of one (G = 1) has std 0
    and advantage 0, not NaN. A uniform group gets advantage 0 either way.
    """
    _require(rewards.dim() == 2, f"rewards must be [B, G], got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    centred = r - r.mean(dim=1, keepdim=True)
    if cfg.advantage_scale == "group":
        # torch.std over one sample is NaN (division by G - 1 = 0); such a group has no spread
        std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(centred[:, :1])
        centred = centred / (std.clamp_min(cfg.std_floor) + _EPS)
    if cfg.advantage_clamp is not None:
        centred = centred.clamp(-cfg.advantage_clamp, cfg.advantage_clamp)
    return centred


def uniform_groups(rewards: Tensor) -> Tensor:
    """Rewards [B, G] -> [B] bool, True where all G rewards of a group are equal (so is G = 1)."""
    _require(rewards.dim() == 2, f"rewards must be [B, G], got shape {tuple(rewards.shape)}")
    return (rewards == rewards[:, :1]).all(dim=1)


def keep_trajectories(rewards: Tensor, cfg: LossConfig) -> Tensor | None:
    """The ``keep`` argument of ``elasticmem_loss`` for rewards [B, G]: [B * G] bool, or None
    (keep all) unless ``cfg.skip_uniform_groups``."""
    if not cfg.skip_uniform_groups:
        return None
    return (~uniform_groups(rewards)).repeat_interleave(rewards.shape[1])


# ---------------------------------------------------------------------------- elementwise terms


def clipped_objective(
    logp: Tensor, logp_old: Tensor, adv: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate, elementwise: ``min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)``.

    ``logp``, ``logp_old``: [N, ...]; ``adv``: [N] or anything that broadcasts after trailing
    singleton dims are added (so [N] works with [N, T]). Returns the objective [N, ...] and a
    bool tensor [N, ...], True where the clipped branch is active (``rho`` beyond the clip range
    in the direction the advantage pushes it), whose mean is the clip fraction.
    """
    adv = adv.reshape(adv.shape + (1,) * (logp.dim() - adv.dim()))
    ratio = torch.exp(logp - logp_old)
    objective = torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    return objective, clipped


def k3_kl(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(pi || pi_ref), elementwise: ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    delta = logp_ref - logp
    return torch.exp(delta) - delta - 1


# ---------------------------------------------------------------------------- containers


def _select(t: Tensor | None, index: slice | Tensor) -> Tensor | None:
    return None if t is None else t[index]


@dataclass
class PartLogProbs:
    """Log-probabilities of one batch's actions, per kind (0 where a unit is absent)."""

    control: Tensor
    """[N] log pi(a) of the retrieval-control token (anything where there is none)."""
    budget: Tensor
    """[N, Z] log pi_phi(b_j) of each budget decision."""
    answer: Tensor
    """[N, T] log-probs of the answer tokens."""
    budget_entropy: Tensor | None = None
    """[N, Z] entropy of each budget distribution (needed for the entropy bonus of ``new``)."""

    @classmethod
    def of(cls, out: ScoreOutput | Trajectories) -> PartLogProbs:
        """From ``ElasticMem.score`` (current, with gradients) or ``Trajectories`` (old, recorded at rollout)."""
        return cls(out.logp_control, out.logp_budget, out.logp_answer, out.entropy_budget)

    def select(self, index: slice | Tensor) -> PartLogProbs:
        """The trajectories ``index`` (a slice or indices/bool mask over N), e.g. one micro-batch."""
        return PartLogProbs(self.control[index], self.budget[index], self.answer[index],
                            _select(self.budget_entropy, index))


@dataclass
class PartMasks:
    """Which units exist: True at a present control token, retrieved memory, answer token."""

    control: Tensor
    """[N] bool: the trajectory has a retrieval-control token."""
    budget: Tensor
    """[N, Z] bool: slot j holds a retrieved memory (so a budget decision)."""
    answer: Tensor
    """[N, T] bool: answer token t exists (up to and including the first EOS)."""

    @classmethod
    def of(cls, traj: Trajectories) -> PartMasks:
        """From rollout ``Trajectories`` (control -1 means no control token)."""
        budget = traj.mask.bool() & getattr(traj, "budget_actions", True)
        return cls(traj.control >= 0, budget, traj.answer_mask.bool())

    def select(self, index: slice | Tensor) -> PartMasks:
        """The trajectories ``index``, as ``PartLogProbs.select``."""
        return PartMasks(self.control[index], self.budget[index], self.answer[index])


@dataclass(frozen=True)
class Normalizer:
    """Denominators of the loss: counts over the FULL optimizer batch (all micro-batches, all
    processes), only over kept trajectories. Build it once per optimizer step and pass the same
    one to every micro-batch's ``elasticmem_loss``."""

    num_trajectories: int
    """Kept trajectories ('grpo', 'dr_grpo')."""
    lm_units: int
    """Present LM units (control tokens + answer tokens) of kept trajectories ('dapo')."""
    budget_units: int
    """Present budget decisions of kept trajectories ('dapo')."""
    max_lm_units: int
    """Most LM units one trajectory can have: max_new_tokens (+1 with a control token) ('dr_grpo')."""
    max_budget_units: int
    """Most budget units one trajectory can have: Z ('dr_grpo')."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                     f"Normalizer.{f.name} must be an int >= 0, got {value!r}")

    @classmethod
    def from_masks(
        cls, masks: PartMasks, max_new_tokens: int, keep: Tensor | None = None, with_control: bool = True
    ) -> Normalizer:
        """Counts of one batch; ``with_control``: the retrieval mode samples a control token
        (so a trajectory can have up to 1 + max_new_tokens LM units). Combine the counts of
        several processes or micro-batches with ``Normalizer.combine``."""
        _require(max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {max_new_tokens}")
        keep = _keep_mask(keep, masks.control.shape[0], masks.control.device)
        answer_units = (masks.answer & keep[:, None]).sum(dim=1)
        _require(not bool((answer_units > max_new_tokens).any()),
                 f"a trajectory has {int(answer_units.max())} answer tokens, more than max_new_tokens={max_new_tokens}")
        _require(with_control or not bool((masks.control & keep).any()),
                 "with_control=False but a kept trajectory has a control token")
        return cls(
            num_trajectories=int(keep.sum()),
            lm_units=int((masks.control & keep).sum() + answer_units.sum()),
            budget_units=int((masks.budget & keep[:, None]).sum()),
            max_lm_units=max_new_tokens + int(with_control),
            max_budget_units=masks.budget.shape[1],
        )

    @classmethod
    def combine(cls, parts: Sequence[Normalizer]) -> Normalizer:
        """The normalizer of the union of disjoint batches (summed counts; the maxima must agree)."""
        _require(len(parts) > 0, "Normalizer.combine needs at least one part")
        first = parts[0]
        _require(all((p.max_lm_units, p.max_budget_units) == (first.max_lm_units, first.max_budget_units)
                     for p in parts), "Normalizer.combine: parts disagree on max_lm_units/max_budget_units")
        return cls(sum(p.num_trajectories for p in parts), sum(p.lm_units for p in parts),
                   sum(p.budget_units for p in parts), first.max_lm_units, first.max_budget_units)


# ---------------------------------------------------------------------------- the loss


def _keep_mask(keep: Tensor | None, n: int, device: torch.device) -> Tensor:
    if keep is None:
        return torch.ones(n, dtype=torch.bool, device=device)
    _require(keep.shape == (n,) and keep.dtype == torch.bool, f"keep must be [N] = [{n}] bool, got "
             f"{tuple(keep.shape)} {keep.dtype}")
    return keep.to(device)


def _float(t: Tensor) -> Tensor:
    # bf16 log-probs lose the small ratio differences the clip acts on; float64 stays float64
    return t.to(torch.promote_types(t.dtype, torch.float32))


@dataclass
class _Units:
    """Per-unit results of one kind: losses, objective, clip flags, ratios, kl; all [N, U], 0 where absent."""

    mask: Tensor
    loss: Tensor
    objective: Tensor
    clipped: Tensor
    ratio: Tensor
    kl: Tensor | None


def _units(
    mask: Tensor, logp: Tensor, logp_old: Tensor, logp_ref: Tensor | None, adv: Tensor, weight: Tensor,
    cfg: LossConfig,
) -> _Units:
    """Unit losses ``-weight * clipped objective (+ kl_beta * k3)`` for [N, U] units (weight broadcasts to [N, U])."""
    # zero absent units *before* exp: masking afterwards leaves 0 * inf = NaN in the backward pass
    logp = torch.where(mask, _float(logp), 0.0)
    logp_old = torch.where(mask, _float(logp_old.detach()), 0.0)
    objective, clipped = clipped_objective(logp, logp_old, adv, cfg.clip_eps, cfg.eps_high)
    loss = -weight * objective
    kl = None
    if logp_ref is not None:
        kl = torch.where(mask, k3_kl(logp, torch.where(mask, _float(logp_ref.detach()), 0.0)), 0.0)
        loss = loss + cfg.kl_beta * kl
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    return _Units(mask, torch.where(mask, loss, zero), torch.where(mask, objective, zero), clipped & mask,
                  torch.where(mask, torch.exp(logp - logp_old), zero).detach(), kl)


def _normalised(units: _Units, per_trajectory: int, total: int, cfg: LossConfig, norm: Normalizer) -> Tensor:
    """One kind's term of the loss (scalar) under ``cfg.loss_type``; ``per_trajectory``/``total``
    are its maximum units per trajectory and its unit count in the full batch."""
    if cfg.loss_type == "grpo":
        per_traj = units.loss.sum(dim=1) / units.mask.sum(dim=1).clamp(min=1)
        return per_traj.sum() / max(norm.num_trajectories, 1)
    if cfg.loss_type == "dr_grpo":
        return units.loss.sum() / max(norm.num_trajectories * per_trajectory, 1)
    return units.loss.sum() / max(total, 1)


def _unit_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values.float() * mask).sum().detach() / mask.sum().clamp(min=1)


def elasticmem_loss(
    new: PartLogProbs,
    old: PartLogProbs,
    advantages: Tensor,
    masks: PartMasks,
    cfg: LossConfig,
    norm: Normalizer,
    ref: PartLogProbs | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The ElasticMem GRPO loss of one (micro-)batch: (scalar loss, metrics).

    ``new``: current log-probs with gradients (control [N], budget [N, Z], answer [N, T],
    budget_entropy [N, Z]); ``old``: the same recorded at rollout (no gradient, entropy
    unused); ``advantages``: [N], detached; ``masks``: which units exist; ``norm``: counts of
    the full optimizer batch (see ``Normalizer``); ``ref``: log-probs with the adapter disabled
    (control and answer used) for ``kl_beta`` > 0; ``keep``: [N] bool, trajectories that count
    (the others contribute nothing). Absent units may hold any finite or non-finite value.

    Metrics (detached scalars over this call's kept units; 0 where there are none):
    ``loss/lm``, ``loss/budget`` (the two normalised terms: they add up over micro-batches),
    ``objective/{lm,budget}`` (mean clipped objective, unweighted), ``clip_frac/{lm,budget}``,
    ``ratio/{lm,budget}`` (mean rho), ``entropy/budget`` (with ``new.budget_entropy``), ``kl``
    (with ``ref``), and the unit counts ``units/{lm,budget}`` for weighting means across calls.
    """
    answer_mask, budget_mask = masks.answer.bool(), masks.budget.bool()
    n, t = answer_mask.shape
    z = budget_mask.shape[1]
    shapes = {"new.control": (new.control, (n,)), "new.budget": (new.budget, (n, z)),
              "new.answer": (new.answer, (n, t)), "old.control": (old.control, (n,)),
              "old.budget": (old.budget, (n, z)), "old.answer": (old.answer, (n, t)),
              "advantages": (advantages, (n,)), "masks.control": (masks.control, (n,)),
              "masks.budget": (budget_mask, (n, z))}
    if new.budget_entropy is not None:
        shapes["new.budget_entropy"] = (new.budget_entropy, (n, z))
    if ref is not None:
        shapes.update({"ref.control": (ref.control, (n,)), "ref.answer": (ref.answer, (n, t))})
    for name, (tensor, shape) in shapes.items():
        _require(tuple(tensor.shape) == shape, f"{name} must have shape {shape} (N={n}, Z={z}, T={t}), "
                 f"got {tuple(tensor.shape)}")
    _require(ref is not None or cfg.kl_beta == 0, "kl_beta > 0 needs reference log-probs (ref)")
    _require(new.budget_entropy is not None or cfg.entropy_coef == 0 or z == 0,
             "entropy_coef > 0 needs new.budget_entropy")

    device = new.answer.device
    keep_mask = _keep_mask(keep, n, device)
    adv = _float(advantages.detach().to(device))

    # LM units side by side: column 0 is the control token, columns 1..T the answer tokens
    lm_mask = torch.cat([masks.control.bool().to(device)[:, None], answer_mask.to(device)], dim=1) & keep_mask[:, None]
    lm_weight = torch.tensor([cfg.control_weight] + [cfg.answer_weight] * t, device=device)
    lm = _units(
        lm_mask,
        torch.cat([new.control[:, None], new.answer], dim=1),
        torch.cat([old.control[:, None], old.answer], dim=1).to(device),
        None if ref is None else torch.cat([ref.control[:, None], ref.answer], dim=1).to(device),
        adv, lm_weight, cfg,
    )
    b_mask = budget_mask.to(device) & keep_mask[:, None]
    budget = _units(b_mask, new.budget, old.budget.to(device), None, adv,
                    torch.tensor(cfg.budget_weight, device=device), cfg)
    entropy = None
    if new.budget_entropy is not None:
        entropy = torch.where(b_mask, _float(new.budget_entropy), 0.0)
        budget.loss = budget.loss - cfg.entropy_coef * entropy

    lm_term = _normalised(lm, norm.max_lm_units, norm.lm_units, cfg, norm)
    budget_term = _normalised(budget, norm.max_budget_units, norm.budget_units, cfg, norm)

    metrics = {"loss/lm": lm_term.detach(), "loss/budget": budget_term.detach()}
    for kind, units in (("lm", lm), ("budget", budget)):
        metrics[f"objective/{kind}"] = _unit_mean(units.objective, units.mask)
        metrics[f"clip_frac/{kind}"] = _unit_mean(units.clipped, units.mask)
        metrics[f"ratio/{kind}"] = _unit_mean(units.ratio, units.mask)
        metrics[f"units/{kind}"] = units.mask.sum().float()
    if entropy is not None:
        metrics["entropy/budget"] = _unit_mean(entropy, b_mask)
    if lm.kl is not None:
        metrics["kl"] = _unit_mean(lm.kl, lm_mask)
    return lm_term + budget_term, metrics


def retrieval_loss(
    h: Tensor, keys: Tensor, candidates: Tensor, positive: Tensor, temperature: float, count: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """Auxiliary retrieval loss (``LossConfig.retrieval_weight``, a departure from the paper).

    ``h``: [N, d] query states (with gradients); ``keys``: [N, M, d] L2-normalised keys of each
    trajectory's candidate chunks (its group, padded to M); ``candidates``: [N, M] bool, real
    chunks; ``positive``: [N, M] bool, evidence chunks (a trajectory without any contributes
    nothing); ``count``: trajectories with evidence in the whole optimizer batch (all
    micro-batches and processes), the normaliser, so micro-batch losses add up to the batch's.

    Per trajectory with evidence: ``-log sum_{i in evidence} softmax_i(cos(h, k) / temperature)``
    over its candidates. Returns (sum of those / count, metrics): ``loss/retrieval`` (the term,
    additive like the other ``loss/*``) and ``units/retrieval`` (trajectories with evidence here).
    """
    _require(h.dim() == 2 and keys.dim() == 3 and keys.shape[:1] == h.shape[:1] and keys.shape[2] == h.shape[1],
             f"h must be [N, d] and keys [N, M, d], got {tuple(h.shape)} and {tuple(keys.shape)}")
    _require(candidates.shape == keys.shape[:2] and positive.shape == keys.shape[:2],
             f"candidates and positive must be [N, M] = {tuple(keys.shape[:2])}")
    _require(temperature > 0, f"temperature must be > 0, got {temperature}")
    has = (positive & candidates).any(-1)
    # rows without evidence see every slot as a positive: their term is exactly 0, and no
    # logsumexp runs over -inf only (whose backward is NaN even where the result is unused)
    cand = candidates | ~has[:, None]
    pos = (positive & candidates) | ~has[:, None]
    hn = torch.nn.functional.normalize(_float(h), dim=-1)
    logits = torch.einsum("nd,nmd->nm", hn, keys.to(hn)) / temperature
    log_all = torch.logsumexp(logits.masked_fill(~cand, float("-inf")), dim=-1)
    log_pos = torch.logsumexp(logits.masked_fill(~pos, float("-inf")), dim=-1)
    term = ((log_all - log_pos) * has).sum() / max(count, 1)
    return term, {"loss/retrieval": term.detach(), "units/retrieval": has.sum().float()}


def token_loss(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    norm: Normalizer,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``elasticmem_loss`` for plain token trajectories (no control token, no budgets): TRL's
    GRPO setting. ``logp``, ``logp_old``, ``logp_ref``, ``mask``: [N, T]; ``adv``: [N]."""
    n = logp.shape[0]
    empty = logp.new_zeros(n, 0)

    def parts(answer: Tensor) -> PartLogProbs:
        return PartLogProbs(control=answer.new_zeros(n), budget=empty, answer=answer)

    masks = PartMasks(control=torch.zeros(n, dtype=torch.bool, device=mask.device),
                      budget=torch.zeros(n, 0, dtype=torch.bool, device=mask.device), answer=mask.bool())
    return elasticmem_loss(parts(logp), parts(logp_old), adv, masks, cfg, norm,
                           ref=None if logp_ref is None else parts(logp_ref))
