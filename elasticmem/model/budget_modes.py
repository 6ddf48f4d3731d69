"""Budgets that the policy does not draw (``ElasticMem._budgets``): 'max' (max_budget each), 'uniform'
(a draw in 1..max_budget each) and 'oracle' (max_budget for each trajectory's evidence rows, 0 for
the others). They measure reading apart from the policy (``elasticmem.eval.ladder``) and supervise
the warm-up.

    python -m pytest -q tests/unit/test_warmup_reading.py tests/unit/test_elasticmem.py
"""

from __future__ import annotations

from typing import Sequence

import torch

from elasticmem.model.budget_policy import cap_budgets, spread_budgets

FIXED_MODES = ("max", "uniform", "oracle")


def fixed_budgets(mode: str, rows: torch.Tensor, mask: torch.Tensor, max_budget: int, cap: int | None,
                  generator: torch.Generator | None = None,
                  evidence: Sequence[set[int]] | None = None) -> torch.Tensor:
    """Budgets [N, Z] of ``mode`` for ``rows`` and ``mask`` [N, Z] (0 at masked slots). ``cap``
    (memory.policy.token_cap, greedy mode) limits each trajectory's total: 'max' shares it out
    evenly, 'oracle' keeps the evidence by rank; 'uniform' draws with ``generator``."""
    N, Z = rows.shape
    if mode == "max":
        b = spread_budgets(mask, max_budget, cap)
    elif mode == "uniform":
        b = torch.randint(1, max_budget + 1, (N, Z), generator=generator)
    else:
        if evidence is None or len(evidence) != N:
            raise ValueError(f"budgets='oracle' needs the evidence rows of each of the {N} trajectories")
        b = torch.tensor([[max_budget if r in evidence[i] else 0 for r in row] for i, row in enumerate(rows.tolist())],
                         dtype=torch.long).reshape(N, Z)
        if cap is not None:
            b = cap_budgets(b, b.float(), mask, cap)
    return torch.where(mask, b, torch.zeros_like(b))
