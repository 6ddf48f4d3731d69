"""Budgets that the policy does not draw (``ElasticMem._budgets``): the diagnostics 'max'
(max_budget each), 'uniform' (a draw in 1..max_budget each) and 'oracle' (max_budget for each
trajectory's evidence rows, 0 for the others), and the simple rules a learned policy has to beat:
'topK' (max_budget for the K best-ranked memories, e.g. 'top1', 'top2') and 'gap' (max_budget for
every memory whose retrieval score is within ``score_gap`` of the best). They measure reading apart
from the policy (``elasticmem.apps.ladder``), supervise the warm-up, and a rule can stand in for the
policy at evaluation (``eval.budgets``).

    python -m pytest -q tests/unit/test_budget_rules.py tests/unit/test_warmup_reading.py tests/unit/test_elasticmem.py
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from elasticmem.model.budget_policy import cap_budgets, spread_budgets

FIXED_MODES = ("max", "uniform", "oracle", "gap")
"""The fixed modes by name; 'topK' (K >= 1) is a family: ``is_fixed_mode``."""
_TOP = re.compile(r"top([1-9][0-9]*)")


def top_k_of(mode: str) -> int | None:
    """K of a 'topK' mode ('top2' -> 2), None for every other mode."""
    m = _TOP.fullmatch(mode)
    return int(m.group(1)) if m else None


def is_fixed_mode(mode: str) -> bool:
    """True for the budget modes ``fixed_budgets`` sets (all but 'policy')."""
    return mode in FIXED_MODES or top_k_of(mode) is not None


def by_rank(mask: torch.Tensor) -> torch.Tensor:
    """Value [N, Z] that orders memories by rank (the first highest), for ``cap_budgets``."""
    Z = mask.shape[1]
    return (Z - torch.arange(Z, dtype=torch.float32)).expand(mask.shape)


def fixed_budgets(mode: str, rows: torch.Tensor, mask: torch.Tensor, max_budget: int, cap: int | None,
                  generator: torch.Generator | None = None,
                  evidence: Sequence[set[int]] | None = None,
                  scores: torch.Tensor | None = None, score_gap: float | None = None) -> torch.Tensor:
    """Budgets [N, Z] of ``mode`` for ``rows`` and ``mask`` [N, Z] (0 at masked slots).

    'topK' gives max_budget to the K best-ranked memories; 'gap' to every memory whose score
    (``scores`` [N, Z], the retrieval's) is at least the row's best minus ``score_gap`` (the best
    one always). ``cap`` (memory.policy.token_cap, greedy mode) limits each trajectory's total:
    'max' shares it out evenly, 'oracle', 'topK' and 'gap' keep their memories by rank; 'uniform'
    draws with ``generator``."""
    N, Z = rows.shape
    mask = mask.bool()
    k = top_k_of(mode)
    if mode == "max":
        return spread_budgets(mask, max_budget, cap)
    if mode == "uniform":
        b = torch.randint(1, max_budget + 1, (N, Z), generator=generator)
        return torch.where(mask, b, torch.zeros_like(b))
    if k is not None:
        keep = torch.arange(Z).expand(N, Z) < k
    elif mode == "gap":
        if scores is None or score_gap is None or score_gap < 0:
            raise ValueError(f"budgets='gap' needs the retrieval scores and a score gap >= 0, got {score_gap!r}")
        s = torch.where(mask, scores.float(), torch.full((N, Z), float("-inf")))
        keep = s >= s.max(-1, keepdim=True).values - score_gap
    elif mode == "oracle":
        if evidence is None or len(evidence) != N:
            raise ValueError(f"budgets='oracle' needs the evidence rows of each of the {N} trajectories")
        keep = torch.tensor([[r in evidence[i] for r in row] for i, row in enumerate(rows.tolist())],
                            dtype=torch.bool).reshape(N, Z)
    else:
        raise ValueError(f"unknown budget mode {mode!r}: 'max', 'uniform', 'oracle', 'gap' or 'topK' (K >= 1)")
    b = torch.where(keep & mask, max_budget, 0).long()
    if cap is not None:
        b = cap_budgets(b, by_rank(mask), mask, cap)
    return b
