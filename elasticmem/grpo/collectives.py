"""What the processes agree on inside one GRPO optimizer step (DDP; DeepSpeed does its own).

The loss normalisers count the whole optimizer batch; the processes agree that every loss
was finite before the one collective that sums the gradients, so a non-finite loss on one
process skips the step on all of them and never leaves them in different collectives.
On one process every function here is a no-op or a local computation.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from elasticmem.grpo.loss import Normalizer


def reduce_normalizer(norm: Normalizer, acc) -> Normalizer:
    """Counts of the whole optimizer batch over all processes."""
    if acc.num_processes == 1:
        return norm
    counts = torch.tensor([norm.num_trajectories, norm.lm_units, norm.budget_units], device=acc.device)
    parts = acc.gather(counts).reshape(acc.num_processes, 3).tolist()
    return Normalizer.combine([dataclasses.replace(norm, num_trajectories=a, lm_units=b, budget_units=c)
                               for a, b, c in parts])


def all_finite(local_ok: bool, acc) -> bool:
    """True on every process when every process's losses were finite (one collective)."""
    if acc.num_processes == 1:
        return local_ok
    ok = torch.tensor(float(local_ok), device=acc.device)
    return bool(acc.reduce(ok, reduction="sum") == acc.num_processes)


def sum_gradients(params: Sequence[torch.nn.Parameter], acc) -> None:
    """Sum the gradients of ``params`` over processes, in one flat all-reduce.

    Written out instead of DDP's bucketed hooks so that no gradient collective starts
    before the processes agree to step; the trainable parameters are LoRA, policy and
    projector, small enough that losing the overlap with backward costs little. A
    parameter without a gradient here (e.g. the projector when every budget was 0)
    contributes zeros, as it may have one on another process.
    """
    if acc.num_processes == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = acc.reduce(torch.cat([g.reshape(-1) for g in grads]), reduction="sum")
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p).clone()


def grad_norm(params: Sequence[torch.nn.Parameter], acc, max_norm: float) -> float:
    """Global gradient norm before clipping (and clip to ``max_norm`` when > 0)."""
    if max_norm > 0:
        return float(acc.clip_grad_norm_(params, max_norm))
    grads = [p.grad.detach().norm() for p in params if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0
