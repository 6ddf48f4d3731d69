"""What a GRPO step logs: loss metrics over micro-batches and processes, and the metrics.jsonl row.

Every function that reduces over processes is a collective: all processes call it, in the
same order, or the run hangs.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from elasticmem.grpo.rollouts import token_cost

if TYPE_CHECKING:
    from elasticmem.model.trajectories import Trajectories


class LossLog:
    """Loss metrics of one rollout step, over micro-batches, processes and inner iterations.

    ``elasticmem_loss`` returns, per micro-batch, additive values (the normalised loss terms
    ``loss``, ``loss/lm``, ``loss/budget`` and the unit counts ``units/*``: they add up to
    the full batch's) and unit means (``objective/*``, ``clip_frac/*``, ``ratio/*``,
    ``entropy/budget``, ``kl``). Additive values are summed, means are weighted by their
    units (budget units for ``*/budget``, LM units otherwise); both are summed over
    processes and averaged over the inner iterations.
    """

    ADDITIVE = ("loss", "loss/lm", "loss/budget", "loss/retrieval", "units/lm", "units/budget", "units/retrieval")

    def __init__(self, num_iterations: int) -> None:
        self.n = num_iterations
        self.sums: Counter = Counter()

    @staticmethod
    def _units_key(key: str) -> str:
        return "units/budget" if key.endswith("/budget") else "units/lm"

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        values["loss"] = float(loss.detach())
        for k, v in values.items():
            weight = 1.0 if k in self.ADDITIVE else values[self._units_key(k)]
            self.sums[k] += v * weight / self.n

    def reduce(self, acc) -> dict[str, float]:
        """The step's metrics (a collective when there are several processes)."""
        keys = sorted(self.sums)
        vals = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64)
        if acc.num_processes > 1:
            vals = acc.reduce(vals.to(acc.device), reduction="sum").cpu()
        tot = dict(zip(keys, vals.tolist()))
        return {k: v if k in self.ADDITIVE else v / max(tot[self._units_key(k)], 1.0) for k, v in tot.items()}


def step_metrics(step: int, traj: Trajectories, rewards: torch.Tensor, m: dict[str, float], acc, core,
                 grad_norm: float, scheduler, state: dict[str, Any], evidence: dict[str, set[int]],
                 times: dict[str, float], cost: float = 0.0) -> dict[str, Any]:
    """Per-step metrics, reduced over processes (per-trajectory values are gathered).

    ``rewards`` [N] are the task rewards (before the token ``cost``), ``m`` the reduced
    ``LossLog``, ``times`` the step's phases in seconds.
    """
    dev = acc.device
    ev = evidence_stats(traj, evidence)  # [N, 6]
    per_traj = torch.cat([torch.stack([rewards.float(), traj.memory_tokens.float(), traj.num_tokens.float()], 1),
                          ev], 1).to(dev)
    allv = acc.gather(per_traj).cpu() if acc.num_processes > 1 else per_traj.cpu()
    bmax = core.budget_levels
    hist = torch.bincount(traj.budgets[traj.mask].clamp(0, bmax), minlength=bmax + 1).to(dev)
    if acc.num_processes > 1:
        hist = acc.reduce(hist, reduction="sum")
    r = allv[:, 0]
    row = {
        "step": step,
        "reward/mean": float(r.mean()),
        "reward/std": float(r.std()) if len(r) > 1 else 0.0,
        "accuracy": float((r > 0.5).float().mean()),
        "loss": float(m.get("loss", 0.0)),
        **{k: float(v) for k, v in sorted(m.items()) if k != "loss"},
        "grad_norm": grad_norm,
        "lr": float(scheduler.get_last_lr()[0]),
        "budget/mean_B_mem": float(allv[:, 1].mean()),
        "budget/histogram": hist.cpu().tolist(),
        "tokens/per_trajectory": float(allv[:, 2].mean()),
        **evidence_metrics(allv[:, 3:], traj.rows.shape[1]),
        **({"reward/shaped": float(token_cost(r, allv[:, 1], cost).mean())} if cost else {}),
        "skipped_steps": state["skipped_steps"],
        "processes": acc.num_processes,
        "distributed_type": str(acc.distributed_type.value),
        **{f"time/{k}": v for k, v in times.items()},
    }
    return row


def evidence_stats(traj: Trajectories, evidence: dict[str, set[int]]) -> torch.Tensor:
    """Per trajectory [N, 6]: has evidence, evidence retrieved (any, in the top Z), budget given to
    evidence memories, evidence memories retrieved, budget given to the other memories, other
    memories retrieved."""
    out = torch.zeros(len(traj), 6)
    for i, ex_id in enumerate(traj.example_ids):
        ev = evidence.get(ex_id)
        if not ev:
            continue
        rows, present = traj.rows[i], traj.mask[i].bool()
        is_ev = torch.tensor([int(r) in ev for r in rows.tolist()], dtype=torch.bool) & present
        b = traj.budgets[i].float()
        other = present & ~is_ev
        out[i] = torch.tensor([1.0, float(is_ev.any()), float(b[is_ev].sum()), float(is_ev.sum()),
                               float(b[other].sum()), float(other.sum())])
    return out


def evidence_metrics(stats: torch.Tensor, z: int) -> dict[str, float]:
    """``retrieval/recall@Z`` (any evidence chunk among the retrieved) and the mean budget of
    evidence and other retrieved memories, over trajectories whose query has evidence
    (``stats`` [N, 6] of ``evidence_stats``)."""
    has = stats[:, 0] > 0
    if not bool(has.any()) or z == 0:
        return {}
    s = stats[has]
    return {f"retrieval/recall@{z}": float(s[:, 1].mean()),
            "budget/evidence": float(s[:, 2].sum() / s[:, 3].sum().clamp(min=1)),
            "budget/other": float(s[:, 4].sum() / s[:, 5].sum().clamp(min=1))}
