"""Forget memories: delete rows of a bank so that search never returns them and, after the next
compaction, no file of the bank holds a byte of their text or cached states.

A delete is committed like an append (``elasticmem.bank.append``): one checksummed ``delete``
record in the manifest's journal, fsynced, under the folder's lock. The record names the deleted
rows and carries each touched group's new row segments and ``groups_sha256`` (of the survivors'
texts), so readers apply it without reading any chunk (``manifest.apply_record``). A crash before
the record is whole leaves the bank as before (a torn record is ignored, then cut off by the next
writer); after it, the whole delete holds. From the commit on, the rows are in no group: every
search restricted to a group skips them, in this process at once and in another after its
``Bank.refresh()``; an unrestricted search skips ``Bank.deleted`` too (``elasticmem.bank.index``).

Rows keep their numbers: a survivor's row id (what ``LiveMemory.chunks`` lists, what an index
returns) never changes, and a deleted row's number is never given to another memory. The data
leaves the disk at compaction (``append.compact``): every shard holding a deleted row is rewritten
with that row's keys, caches and per-layer KV zeroed, and its chunk line replaced by
``manifest.forgotten_record`` (``{"row", "deleted": true}``, no text, no group); the replaced files
are unlinked at once, not after ``append.GRACE_S``, and a saved FAISS index (it holds keys) is
removed, to be rebuilt. The journal holds no chunk text (only row numbers, group names and
hashes), so it needs no rewriting. ``forget_rows(..., purge=True)`` does both in one call.

    from elasticmem.bank.forget import forget_rows
    forget_rows("runs/live/bank", [17, 18], purge=True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from elasticmem.bank.append import _append_journal, _checkpoint, _compact, _latest
from elasticmem.bank.builder import _dir_lock
from elasticmem.bank.manifest import GROUPS_SHA256, MANIFEST, BankError, apply_record, rows_to_segments
from elasticmem.bank.store import Bank
from elasticmem.data.chunking import chunks_fingerprint


class MemoryNotFound(LookupError):
    """A row to forget is in no group of the bank (never there, or deleted already)."""


@dataclass
class ForgetResult:
    bank: Bank
    """The bank after the delete (and the purge, when asked)."""
    rows: dict[str, list[int]] = field(default_factory=dict)
    """Deleted rows per group, in row order."""
    purged: bool = False
    seconds: float = 0.0

    @property
    def deleted(self) -> int:
        return sum(len(r) for r in self.rows.values())


def _owners(bank: Bank, rows: set[int]) -> dict[str, list[int]]:
    """The group of each row (all must be live rows of some group), rows in row order per group."""
    out: dict[str, list[int]] = {}
    left = set(rows)
    for g, segs in bank.groups.items():
        mine = sorted(r for r in left if any(a <= r < b for a, b in segs)) if left else []
        if mine:
            out[g] = mine
            left.difference_update(mine)
    if left:
        raise MemoryNotFound(f"no memory with row id {sorted(left)[:10]} in bank {bank.root} (never added, or "
                             "forgotten already)")
    return out


def forget_rows(root: str | Path | Bank, rows: Iterable[int], purge: bool = False,
                fingerprint: str | None = None) -> ForgetResult:
    """Delete ``rows`` (bank row ids) from the bank at ``root`` (a folder, or the snapshot last
    returned, which is brought up to date): one journal record, committed atomically. With
    ``purge``, compact at once so that no file keeps their data. Raises ``MemoryNotFound`` (nothing
    is deleted) when a row is in no group. ``rows`` empty: nothing is written."""
    t0 = time.perf_counter()
    snapshot = root if isinstance(root, Bank) else None
    root = root.root if isinstance(root, Bank) else Path(root)
    if not (root / MANIFEST).is_file():
        raise BankError(f"no bank at {root}")
    wanted = {int(r) for r in rows}
    with _dir_lock(root):
        bank = _latest(root, snapshot, fingerprint or (snapshot.fingerprint if snapshot else Bank.open(root).fingerprint))
        owners = _owners(bank, wanted)
        if not owners:
            return ForgetResult(bank, {}, False, time.perf_counter() - t0)
        chunks = bank.chunks()
        groups, sha = {}, {}
        for g, gone in owners.items():
            drop = set(gone)
            keep = [r for r in bank.group_row_ids(g).tolist() if r not in drop]
            groups[g] = rows_to_segments(keep)
            sha[g] = chunks_fingerprint([chunks[r]["text"] for r in keep]) if keep else None
        record = {"op": "delete", "rows": rows_to_segments(wanted), "groups": groups, GROUPS_SHA256: sha}
        if bank.journal is None:  # a build's bank: start a journal, as a first append does
            grown = _checkpoint(bank, apply_record(bank.manifest, record))
        else:
            grown = bank._grown([record], _append_journal(bank.journal, record))  # the commit
        for g in owners:  # the append memo holds each chunk text's sha256: rebuilt from the survivors when next read
            grown._store.memo.pop(g, None)
        if purge:
            grown = _compact(grown)
    return ForgetResult(grown, owners, purge, time.perf_counter() - t0)


__all__ = ["ForgetResult", "MemoryNotFound", "forget_rows"]
