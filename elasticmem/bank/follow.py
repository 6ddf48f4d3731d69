"""Follow a bank's snapshots: which rows a newer snapshot adds and which it takes away, and per-row
vectors (sentence embeddings of the texts, mapped keys) kept up to date in place.

A bank changes in two ways only (``elasticmem.bank.append``, ``elasticmem.bank.forget``): appends
add rows after the last one, and deletes take rows out (their numbers stay taken). So a copy of
the bank's rows made from one snapshot is brought up to a newer one by adding its new live rows
and dropping the rows it deleted since: ``snapshot_change`` says which. Every derived copy a
process holds (the FAISS index, ``RowVectors`` for the text-RAG retriever and the retrieval map's
index) follows it, so a forgotten row leaves each of them at the next refresh, and an append costs
the new rows, not the bank.

    python -m pytest -q tests/unit/test_forget_copies.py
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from elasticmem.bank.store import Bank

Segments = Sequence[tuple[int, int]]


def clip_segments(segs: Segments, start: int, end: int) -> list[tuple[int, int]]:
    """The parts of ``segs`` inside ``[start, end)``."""
    return [(max(a, start), min(b, end)) for a, b in segs if max(a, start) < min(b, end)]


def subtract_segments(segs: Segments, minus: Segments) -> list[tuple[int, int]]:
    """The rows of ``segs`` that no segment of ``minus`` holds (both sorted and coalesced)."""
    out, j = [], 0
    for a, b in segs:
        while j < len(minus) and minus[j][1] <= a:
            j += 1
        k = j  # ``minus`` segments that may cut this one (a later one of ``segs`` starts no earlier)
        while a < b and k < len(minus) and minus[k][0] < b:
            c, d = minus[k]
            if c > a:
                out.append((a, c))
            a = max(a, d)
            k += 1
        if a < b:
            out.append((a, b))
    return out


def segment_rows(segs: Segments) -> np.ndarray:
    """[n] int64: every row of ``segs``, in order (FAISS ids)."""
    if not segs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in segs])


class Change(NamedTuple):
    removed: list[tuple[int, int]]
    """Rows the older state held live that the newer one deleted."""
    added: list[tuple[int, int]]
    """Live rows of the newer state beyond the older one's (rows appended and deleted since are
    neither added nor removed)."""


def rows_change(old_rows: int, old_deleted: Segments, new_rows: int, new_deleted: Segments) -> Change | None:
    """How a copy of the live rows of a state (``old_rows`` rows, ``old_deleted`` of them deleted)
    becomes one of a newer state of the same line of appends; None when the newer state is not
    the older one grown (fewer rows, or an older state's delete it does not hold): copy it anew."""
    if new_rows < old_rows or subtract_segments(old_deleted, new_deleted):
        return None
    removed = clip_segments(subtract_segments(new_deleted, old_deleted), 0, old_rows)
    added = subtract_segments([(old_rows, new_rows)] if new_rows > old_rows else [], new_deleted)
    return Change(removed, added)


def snapshot_change(old: Bank, new: Bank) -> Change | None:
    """``rows_change`` between two snapshots (None: ``new`` is another bank, or older)."""
    if not new.extends(old):
        return None
    return rows_change(old.num_chunks, old.deleted, new.num_chunks, new.deleted)


class RowVectors:
    """One vector per bank row ([rows, dim] float32), computed from the bank by ``compute(bank,
    segments)`` ([rows of the segments, dim], in order) and kept up to date in place with its
    snapshots (``follow``): new live rows are computed and written into spare room (which doubles
    when full, so an append costs its rows, not the bank), deleted rows are zeroed, so that no
    vector of a forgotten memory stays in memory. Rows keep their numbers: deleted rows read
    zeros (searches skip them: ``TorchIndex`` searches the live rows only)."""

    def __init__(self, dim: int, compute: Callable[[Bank, list[tuple[int, int]]], torch.Tensor]):
        self.dim, self.compute = dim, compute
        self.bank: Bank | None = None
        self._buf = torch.zeros(0, dim)
        self._n = 0

    @property
    def vectors(self) -> torch.Tensor:
        """[rows, dim]: a view of the buffer (zeros for deleted rows)."""
        return self._buf[: self._n]

    def follow(self, bank: Bank) -> Change:
        """Bring the vectors up to ``bank`` (another bank, or an older snapshot: computed anew) and
        return what changed."""
        change = None if self.bank is None else snapshot_change(self.bank, bank)
        if change is None:
            self._buf, self._n = torch.zeros(0, self.dim), 0
            change = Change([], list(bank.live_segments()))
        for a, b in change.removed:
            self._buf[a:b] = 0
        self._reserve(bank.num_chunks)
        if change.added:
            new = self.compute(bank, change.added)
            at = 0
            for a, b in change.added:
                self._buf[a:b] = new[at:at + b - a]
                at += b - a
        self._n, self.bank = bank.num_chunks, bank
        return change

    def _reserve(self, rows: int) -> None:
        if rows > self._buf.shape[0]:  # doubling: each row is copied O(1) times over all appends
            buf = torch.zeros(max(rows, 2 * self._buf.shape[0]), self.dim)
            buf[: self._n] = self._buf[: self._n]
            self._buf = buf


__all__ = ["Change", "RowVectors", "clip_segments", "rows_change", "segment_rows", "snapshot_change",
           "subtract_segments"]
