"""What each retrieved memory puts into the reader's input (DESIGN.md section 1 item 4): projected soft
tokens (the last min(b_j, c_j) valid cached states of memory j, through the projector), per-layer keys
and values (memory.content=kv), or the chunk's own token embeddings (memory.injection=text).

Each builder returns, per trajectory, the pieces of its memories with at least one token (rank order)
and the token counts [N, Z] that were injected. ``ElasticMem._soft_tokens`` picks the builder.

    python -m pytest -q tests/unit/test_elasticmem.py tests/unit/test_kv_content.py
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from elasticmem.bank.follow import snapshot_change
from elasticmem.bank.store import Bank
from elasticmem.config import KVScheme
from elasticmem.model.injection import KVPiece
from elasticmem.model.projector import Projector, select_last_valid


def projected_memories(bank: Bank, projector: Projector, rows: torch.Tensor, budgets: torch.Tensor,
                       device: torch.device) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Projected soft tokens per trajectory (memories with 0 tokens left out) and counts [N, Z].

    ``rows`` [N, Z] bank rows (-1: no memory), ``budgets`` [N, Z]; each piece is [c_j, d] on ``device``.
    """
    N, Z = rows.shape
    flat_rows, flat_b = rows.reshape(-1), budgets.reshape(-1)
    use = (flat_rows >= 0) & (flat_b > 0)
    counts = torch.zeros(N * Z, dtype=torch.long)
    per_traj: list[list[torch.Tensor]] = [[] for _ in range(N)]
    if use.any():
        cache, cache_len = bank.gather(flat_rows[use])
        states, c = select_last_valid(cache, cache_len, flat_b[use])
        soft = projector(states.to(device, torch.float32))
        counts[use] = c
        pieces = soft.split(c.tolist())
        for k, flat_idx in enumerate(use.nonzero().reshape(-1).tolist()):
            if c[k] > 0:
                per_traj[flat_idx // Z].append(pieces[k])
    return per_traj, counts.reshape(N, Z)


def kv_memories(bank: Bank, rows: torch.Tensor, budgets: torch.Tensor, device: torch.device | None = None,
                kv: KVScheme | None = None) -> tuple[list[list[KVPiece]], torch.Tensor]:
    """memory.content=kv: per trajectory, each memory's last min(b_j, readable slots) per-layer
    keys and values (``Bank.kv_lengths``), and those counts [N, Z]; ``rows``, ``budgets`` [N, Z].

    Only those slots are read from the bank and moved to ``device`` (None: they stay on the CPU),
    where an int8 / int4 bank's codes are dequantized (``Bank.kv_slots``). ``kv``: the
    ``bank.kv_scheme()`` the reader was configured with; a bank stored otherwise is refused
    (``Bank.require_kv``; None: not checked).
    """
    if kv is not None:
        bank.require_kv(kv)
    N, Z = rows.shape
    flat_rows, flat_b = rows.reshape(-1), budgets.reshape(-1)
    use = (flat_rows >= 0) & (flat_b > 0)
    counts = torch.zeros(N * Z, dtype=torch.long)
    per_traj: list[list[KVPiece]] = [[] for _ in range(N)]
    if use.any():
        c = torch.minimum(flat_b[use], bank.kv_lengths(flat_rows[use]))
        counts[use] = c
        read = c > 0
        slots = bank.kv_slots(flat_rows[use][read], c[read], device).split(c[read].tolist())
        for k, flat_idx in enumerate(use.nonzero().reshape(-1)[read].tolist()):
            per_traj[flat_idx // Z].append(KVPiece(slots[k], bank.n_cache - int(slots[k].shape[0])))
    return per_traj, counts.reshape(N, Z)


def chunk_ids(bank: Bank, tokenizer, cache: dict[int, list[int]], row: int) -> list[int]:
    """The token ids of bank row ``row``'s text (no special tokens), kept in ``cache`` (row -> ids)."""
    if row not in cache:
        text = bank.chunk(row)["text"]
        cache[row] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return cache[row]


def text_memories(embeddings: nn.Module, ids_of: Callable[[int], list[int]], rows: torch.Tensor,
                  device: torch.device) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Text injection: each retrieved chunk's token embeddings [n_j, d], and token counts [N, Z].

    ``ids_of(row)``: a chunk's token ids (``chunk_ids``); ``rows`` [N, Z] bank rows (-1: none).
    """
    N, Z = rows.shape
    counts = torch.zeros(N, Z, dtype=torch.long)
    ids = [[ids_of(int(r)) if r >= 0 else [] for r in row] for row in rows.tolist()]
    flat = [t for row in ids for chunk in row for t in chunk]
    per_traj: list[list[torch.Tensor]] = [[] for _ in range(N)]
    if not flat:
        return per_traj, counts
    # One embedding call for the batch (one parameter gather under ZeRO-3).
    emb = embeddings(torch.as_tensor(flat, device=device))
    pieces = iter(emb.split([len(c) for row in ids for c in row]))
    for i, row in enumerate(ids):
        for j, chunk in enumerate(row):
            piece = next(pieces)
            if chunk:
                per_traj[i].append(piece)
                counts[i, j] = len(chunk)
    return per_traj, counts


def forget_chunk_ids(cache: dict[int, list[int]], old: Bank, new: Bank) -> None:
    """Drop from ``cache`` (``chunk_ids``') the rows that ``new`` no longer holds as ``old`` did: all of
    them for another bank (or an older snapshot), the ones deleted since for a newer snapshot of the
    same bank (their tokens leave this process too)."""
    change = snapshot_change(old, new)
    if change is None:
        cache.clear()
        return
    for a, b in change.removed:
        for r in range(a, b):
            cache.pop(r, None)
