"""What one batch of trajectories recorded (``Trajectories``) and what scoring them returns
(``ScoreOutput``): the records GRPO's rollouts, replay and loss pass around.

    python -m pytest -q tests/unit/test_elasticmem.py
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

import torch


@dataclass
class Trajectories:
    """N = B * G trajectories; tensors on CPU. Padded slots: rows -1, mask False, budgets 0."""

    example_ids: list[str]
    query_index: torch.Tensor
    """[N] which query of the batch (0..B-1); trajectories of one query are contiguous."""
    prompt_ids: list[list[int]]
    suffix_ids: list[list[int]]
    groups: list[str]
    control: torch.Tensor
    """[N] control token a, -1 in modes without one."""
    rows: torch.Tensor
    """[N, Z] retrieved bank rows, rank order; -1 where the group had fewer than Z chunks."""
    scores: torch.Tensor
    """[N, Z] cosine scores (0 at missing slots)."""
    mask: torch.Tensor
    """[N, Z] bool, True where a memory was retrieved."""
    budgets: torch.Tensor
    """[N, Z] long, sampled budgets b_j (0 at missing slots)."""
    soft_counts: torch.Tensor
    """[N, Z] long, soft tokens injected per memory: min(b_j, cache_len_j) (after clipping in greedy)."""
    answer_ids: torch.Tensor
    """[N, T] generated tokens, pad after the first EOS."""
    answer_mask: torch.Tensor
    """[N, T] bool, True up to and including the first EOS."""
    answers: list[str]
    """Decoded answers (without EOS)."""
    logp_control: torch.Tensor
    """[N] log pi(a | prompt) at temperature tau (0 without a control token)."""
    logp_budget: torch.Tensor
    """[N, Z] log pi_phi(b_j) (0 at missing slots)."""
    entropy_budget: torch.Tensor
    """[N, Z] entropy of each budget distribution (0 at missing slots)."""
    logp_answer: torch.Tensor
    """[N, T] log-probs of answer tokens at the answer temperature (0 where answer_mask is False, and
    everywhere in greedy rollouts: evaluation does not use them, so they are not computed)."""
    query_state: torch.Tensor
    """[N, d_h] the retrieval query state h (detached)."""
    answer_temperature: float
    control_temperature: float
    greedy: bool
    num_tokens: torch.Tensor
    """[N] #Tok = task-text tokens (prompt, a, suffix) + injected soft tokens + separators + generated tokens."""
    memory_tokens: torch.Tensor
    """[N] injected soft tokens, sum_j soft_counts (B_mem as injected)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of the batch's phases: 'retrieval' (prompt encoding, query states, search), 'policy'
    (budget allocation), 'generation' (projection, injection, decoding)."""
    budget_actions: bool = True
    """False when no policy chose the budgets (text injection): no budget term in the loss."""
    retrieved_rows: torch.Tensor | None = None
    """[N, Z] the rows retrieval gave before ``include_rows`` put the evidence among them
    (``teacher_forced``; None elsewhere): what the reasoner would have found by itself."""

    def __len__(self) -> int:
        return len(self.example_ids)

    def memories(self, i: int) -> list[tuple[int, float, int | None, int]]:
        """Trajectory i's memories as (bank row, score, budget, tokens added), rank order; budget
        None for text injection."""
        latent = self.budget_actions
        return [(r, float(self.scores[i, j]), int(self.budgets[i, j]) if latent else None,
                 int(self.soft_counts[i, j])) for j, r in enumerate(self.rows[i].tolist()) if r >= 0]

    def select(self, idx: Sequence[int] | torch.Tensor) -> "Trajectories":
        """The trajectories at ``idx`` (every per-trajectory field sliced, the rest kept)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        n, out = len(self), {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
                out[f.name] = v[idx_t]
            elif isinstance(v, list) and len(v) == n:
                out[f.name] = [v[i] for i in idx_t.tolist()]
            else:
                out[f.name] = v
        return type(self)(**out)

    @staticmethod
    def concat(parts: Sequence["Trajectories"]) -> "Trajectories":
        """Join trajectory batches (same Z); answers are right-padded to the longest."""
        T = max(p.answer_ids.shape[1] for p in parts)
        out = {}
        cls = type(parts[0])
        for f in fields(cls):
            vals = [getattr(p, f.name) for p in parts]
            if isinstance(vals[0], torch.Tensor) and vals[0].dim() > 0:
                if f.name in ("answer_ids", "answer_mask", "logp_answer"):
                    vals = [torch.nn.functional.pad(v, (0, T - v.shape[1])) for v in vals]
                out[f.name] = torch.cat(vals)
            elif isinstance(vals[0], list):
                out[f.name] = [x for v in vals for x in v]
            else:
                out[f.name] = vals[0]
        offsets = torch.tensor([0] + [int(p.query_index.max()) + 1 for p in parts[:-1]]).cumsum(0)
        out["query_index"] = torch.cat([p.query_index + o for p, o in zip(parts, offsets)])
        return cls(**out)


@dataclass
class ScoreOutput:
    logp_control: torch.Tensor
    """[N] (0 without a control token)."""
    logp_budget: torch.Tensor
    """[N, Z]"""
    entropy_budget: torch.Tensor
    """[N, Z]"""
    logp_answer: torch.Tensor
    """[N, T] (0 where answer_mask is False)"""
    query_state: torch.Tensor | None = None
    """[N, d_h] the retrieval query state h, with gradients to the adapter in the modes that
    compute it with the reasoner (control, query_only); None in the others."""
