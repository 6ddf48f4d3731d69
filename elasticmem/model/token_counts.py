"""A trajectory's token bookkeeping, the same for a rollout and for teacher forcing (``rollout.py``):
token lists padded into tensors (the answers; the reconstruction's targets too), each example's
items repeated for its G trajectories, and the tokens a trajectory read and wrote (#Tok, B_mem).

    python -m pytest -q tests/unit/test_elasticmem.py tests/unit/test_warmup_reading.py
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import torch

T = TypeVar("T")


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [N, T] right-padded with ``pad_id`` and their mask [N, T] (bool, True on the
    tokens), T the longest sequence and at least 1, so that an empty answer still has a column."""
    T = max(1, max((len(t) for t in seqs), default=0))
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, t in enumerate(seqs):
        ids[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
        mask[i, : len(t)] = True
    return ids, mask


def per_trajectory(items: Sequence[T], G: int) -> list[T]:
    """Each example's item once per trajectory, example-major: [B] -> [B * G]."""
    return [x for x in items for _ in range(G)]


def query_index(B: int, G: int) -> torch.Tensor:
    """[B * G] the example (0..B-1) of each trajectory, example-major."""
    return torch.arange(B).repeat_interleave(G)


def trajectory_tokens(prompts: Sequence[Sequence[int]], suffixes: Sequence[Sequence[int]], control: torch.Tensor,
                      soft_counts: torch.Tensor, sep_len: int, answer_mask: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per trajectory, (#Tok [N], memory tokens [N]): #Tok counts the task's text (its prompt and
    suffix, [N] lists, and the control token where one was drawn: ``control`` [N], -1 = none), the
    memories' soft tokens (``soft_counts`` [N, Z]) with one separator of ``sep_len`` tokens after
    each memory that got any, and the answer (``answer_mask`` [N, T]); memory tokens are the soft
    tokens alone (B_mem as injected)."""
    memory_tokens = soft_counts.sum(-1)
    task = torch.tensor([len(p) + len(s) + int(a >= 0) for p, s, a in zip(prompts, suffixes, control.tolist())])
    n_mem = (soft_counts > 0).sum(-1)
    return task + memory_tokens + n_mem * sep_len + answer_mask.sum(-1), memory_tokens
