"""Open a built bank: manifest, memory-mapped shards, chunk texts.

The format itself (the manifest's fields, the journal's records and what each does to a manifest) is
``elasticmem.bank.manifest``.

Shards are safetensors files read through ``safe_open``, which maps them: a
10 GB bank opens in milliseconds and only the rows you touch are read.
Opening checks that every shard exists with its recorded size (a cheap test
that catches truncation); ``verify=True`` (or ``Bank.verify()``) re-hashes
every shard against the manifest's sha256, which reads the whole bank.
Whether the bank holds the chunks of given examples is checked by
``elasticmem.data.validate.validate_examples`` against ``Bank.groups_sha256``.

A bank grows by appends (``elasticmem.bank.append``): each adds a shard and a chunk file under
new names and then commits by appending one record to the manifest's journal (the file
``build.journal`` of ``manifest.json`` names; ``manifest.json`` itself is rewritten only when an
append starts a journal or a compaction regroups the files). The bank is ``manifest.json`` with
the journal's records applied in order. A ``Bank`` is a snapshot: it keeps reading the files its
manifest named, and ``refresh()`` reads only what was committed since (the journal's new
records), sharing the chunk records already read. Appended rows come after every earlier row, so
a group's rows are one or more segments (``group_segments``).

Journal: one record per line, ``<first 16 hex of sha256(body)> <body JSON>``. A reader stops at
the first line that is incomplete or does not match its checksum (an append in progress, or one
a crash tore): the records before it are the bank; an appender truncates such a tail before it
writes. A journal that a compaction replaced ends with a ``seal`` record.

Forgetting (``elasticmem.bank.forget``): a ``delete`` record names rows to forget; they leave their
groups' segments (so every search restricted to a group, and ``chunks()`` through the groups, skips
them from the commit on) and join ``deleted`` (every row ever deleted) and ``unpurged`` (deleted
rows whose text and tensors some file still holds). Rows keep their numbers: the survivors' ids
never change. Compaction purges: it rewrites the files holding ``unpurged`` rows with those rows
zeroed (text, keys, caches) and deletes the files it replaced at once.

Why one file (about 610 lines): ``Bank`` is one snapshot class; its reads (keys, hidden caches, KV
slots and their dequantization), group segments and ``refresh`` share its private file handles and
chunk records, and the storage layouts it reads are already their own modules (``kv_store``,
``quant``, ``manifest``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from safetensors import safe_open

from elasticmem.bank.kv_store import KVFormat, read_slots, slot_offsets, to_window
from elasticmem.bank.manifest import (
    CHUNKS,
    GROUPS_SHA256,
    MANIFEST,
    READABLE_VERSIONS,
    BankError,
    apply_record,
    forgotten_record,
    parse_segments,
    read_journal,
)
from elasticmem.config import KVScheme
from elasticmem.utils.common import sha256_file

def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when ``manifest.json`` is replaced (a rename gives another inode, size or time)."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class _RowStore:
    """The chunk records of one line of appends, shared by all its snapshots: rows are never
    rewritten (appends add rows, compaction only regroups files), so the first n records are
    every snapshot's first n. ``records`` only grows; ``memo`` is for appenders (per-group state).
    A deleted row's record is replaced by ``forgotten_record`` as soon as a snapshot sees the delete
    (the text leaves this process's memory too, also for older snapshots: they never list it)."""

    def __init__(self):
        self.records: list[dict[str, Any]] = []
        self.memo: dict[str, Any] = {}
        self.lock = threading.Lock()


class ChunkRecords(Sequence):
    """A snapshot's chunk records, rows ``0..n-1`` (a read-only view of the shared records)."""

    def __init__(self, records: list[dict[str, Any]], n: int):
        self._records, self._n = records, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._records[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"row {i} out of range [0, {self._n})")
        return self._records[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self._records[i] for i in range(self._n))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == self._n and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"ChunkRecords({self._n} rows)"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


@dataclass(frozen=True)
class ShardInfo:
    file: str
    rows: int
    sha256: str
    bytes: int
    start: int
    """First global row of the shard."""


class Bank:
    """Read-only view of a bank folder (DESIGN.md section 3.1)."""

    def __init__(self, root: Path, manifest: dict[str, Any], like: "Bank | None" = None,
                 changed_groups: Iterable[str] | None = None):
        """``like``: a snapshot of the same line of appends whose open shard files, chunk records
        and groups (all but ``changed_groups``) this one reuses instead of reading them again."""
        self.root = root
        self.manifest = manifest
        self.shards: list[ShardInfo] = []
        start = 0
        for s in manifest["shards"]:
            self.shards.append(ShardInfo(s["file"], int(s["rows"]), s["sha256"], int(s["bytes"]), start))
            start += int(s["rows"])
        if start != self.num_chunks:
            raise BankError(f"{root / MANIFEST}: shards hold {start} rows but num_chunks is {self.num_chunks}")
        self._starts = np.array([s.start for s in self.shards], dtype=np.int64)
        if like is not None and changed_groups is not None:
            self.groups = dict(like.groups)
            for g in changed_groups:
                if g in manifest["groups"]:
                    self.groups[g] = parse_segments(manifest["groups"][g])
                else:  # every row of it deleted
                    self.groups.pop(g, None)
        else:
            self.groups: dict[str, tuple[tuple[int, int], ...]] = {
                g: parse_segments(v) for g, v in manifest["groups"].items()}
        """Each group's ``[start, end)`` row segments, in row order (one for a built bank)."""
        reuse = {s.file: h for s, h in zip(like.shards, like._handles)} if like is not None else {}
        self._handles: list[Any] = []
        for s in self.shards:
            if s.file in reuse:  # a file name is never reused for other content within a line of appends
                self._handles.append(reuse[s.file])
                continue
            path = root / s.file  # here only: an append's snapshot reuses all but one (a Path per shard costs)
            try:
                self._handles.append(safe_open(str(path), framework="pt"))
            except Exception as e:  # safetensors raises its own error types for broken headers
                raise BankError(f"bank shard {path} cannot be opened ({e}); rebuild the bank") from None
        self._store = like._store if like is not None else _RowStore()
        self._kv_offsets: dict[int, torch.Tensor] = {}  # shard -> first slot of each row (ragged KV)
        self.kv_format = KVFormat.of(manifest)
        """How the per-layer keys and values are stored (``elasticmem.bank.kv_store``); None: none are."""
        # where this snapshot's state was read from: manifest.json's stamp, the journal and how far
        self._stamp: tuple[int, ...] | None = None
        self._journal_offset = 0
        self._journal_records = 0

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, root: str | Path, expect_fingerprint: str | None = None, verify: bool = False,
             like: "Bank | None" = None, expect_kv: KVScheme | None = None) -> "Bank":
        """The bank in ``root``: ``manifest.json`` with its journal's records applied. ``like``: an
        older snapshot of this bank whose chunk records are reused when this one extends it.
        ``expect_kv``: the ``bank.kv_scheme()`` the caller reads per-layer KV with
        (``Config.kv_scheme_read``; None: not checked); a bank stored otherwise is refused
        (``require_kv``)."""
        root = Path(root)
        mpath = root / MANIFEST
        for _ in range(100):  # a compaction may replace the manifest between our reads of it and its journal
            try:
                with open(mpath, "rb") as f:
                    stamp = _stamp(os.fstat(f.fileno()))
                    text = f.read()
            except FileNotFoundError:
                hint = " (an unfinished build: run build_bank.py again to resume it)" if (root / ".build").is_dir() else ""
                raise BankError(f"no bank at {root}: {MANIFEST} is missing{hint}") from None
            try:
                manifest = json.loads(text)
            except json.JSONDecodeError as e:
                raise BankError(f"{mpath}: not valid JSON ({e})") from None
            journal = manifest.get("build", {}).get("journal")
            records, offset, sealed = read_journal(root / journal) if journal else ([], 0, False)
            if not sealed:
                break
        else:
            raise BankError(f"{mpath} names a replaced journal {journal}: the bank is being rewritten; retry")
        for rec in records:
            manifest = apply_record(manifest, rec)
        version = manifest.get("format_version")
        if version not in READABLE_VERSIONS:
            raise BankError(f"{mpath}: format_version {version} is not supported (expected one of "
                            f"{READABLE_VERSIONS})")
        enc = manifest["encoder"]
        if expect_fingerprint is not None and enc["fingerprint"] != expect_fingerprint:
            raise BankError(
                f"bank {root} was encoded by {enc['name_or_path']!r} (fingerprint {enc['fingerprint'][:23]}...), "
                f"but the model in use has fingerprint {expect_fingerprint[:23]}...: keys and caches would "
                f"not match its hidden states. Rebuild the bank with this model (build_bank.py) or load the "
                f"encoder it was built with."
            )
        for s in manifest["shards"] + manifest.get("chunk_files", []):
            p = root / s["file"]
            if not p.is_file():
                raise BankError(f"bank file {p} is missing")
            size = p.stat().st_size
            if size != s["bytes"]:
                raise BankError(
                    f"bank file {p} is {size} bytes but the manifest records {s['bytes']}: the file is "
                    f"truncated or was replaced; rebuild the bank"
                )
        bank = cls(root, manifest)
        if expect_kv is not None:
            bank.require_kv(expect_kv)
        bank._stamp, bank._journal_offset, bank._journal_records = stamp, offset, len(records)
        if like is not None and bank.extends(like):
            bank._store = like._store
        bank._scrub()
        if verify:
            bank.verify()
        return bank

    @property
    def journal(self) -> Path | None:
        """The journal file appends commit to (None: the next append starts one)."""
        name = self.manifest.get("build", {}).get("journal")
        return self.root / name if name else None

    def refresh(self) -> "Bank":
        """The bank as its folder holds it now: ``self`` when no append happened since this
        snapshot was opened, else a new ``Bank`` on the newest state (this one stays valid).
        Costs a stat and a read of the journal's new records, unless a compaction rewrote the
        manifest."""
        try:
            stamp = _stamp(os.stat(self.root / MANIFEST))
        except FileNotFoundError:
            raise BankError(f"no bank at {self.root} any more: {MANIFEST} is missing") from None
        if stamp == self._stamp:
            if self.journal is None:
                return self
            records, end, sealed = read_journal(self.journal, self._journal_offset)
            if not sealed:
                return self._grown(records, end) if records else self
        new = Bank.open(self.root, expect_fingerprint=self.fingerprint, like=self)
        if new.manifest == self.manifest:  # rewritten with the same content: keep reading this snapshot
            self._stamp, self._journal_offset, self._journal_records = (
                new._stamp, new._journal_offset, new._journal_records)
            return self
        return new

    def _grown(self, records: list[dict[str, Any]], end: int) -> "Bank":
        """This snapshot with journal ``records`` (read up to byte ``end``) applied."""
        m = self.manifest
        for rec in records:
            m = apply_record(m, rec)
        for s in m["shards"][len(self.shards):] + m["chunk_files"][len(self.manifest.get("chunk_files", [])):]:
            if (self.root / s["file"]).stat().st_size != s["bytes"]:
                raise BankError(f"bank file {self.root / s['file']} does not have the size the journal records")
        grown = Bank(self.root, m, like=self, changed_groups={g for r in records for g in r["groups"]})
        grown._stamp, grown._journal_offset = self._stamp, end
        grown._journal_records = self._journal_records + len(records)
        if any(r.get("op") == "delete" for r in records):
            grown._scrub()
        return grown

    def _scrub(self) -> None:
        """Replace the shared chunk records of deleted rows (read before the delete) by
        ``forgotten_record``."""
        store = self._store
        with store.lock:
            for a, b in self.deleted:
                for r in range(a, min(b, len(store.records))):
                    if not store.records[r].get("deleted"):
                        store.records[r] = forgotten_record(r)

    def extends(self, other: "Bank") -> bool:
        """Whether this bank is ``other`` or ``other`` grown by appends, so that ``other``'s rows are
        this bank's first rows, unchanged: the same encoder and build plan, and at least as many
        rows, appended in the same line of appends (``build.lineage``, set by the first append:
        a bank rebuilt and appended to again starts another). Rows are never rewritten: appends
        add rows and compaction only regroups files."""
        build = lambda b, k: b.manifest.get("build", {}).get(k)  # noqa: E731
        return (self.fingerprint == other.fingerprint and build(self, "plan_id") == build(other, "plan_id")
                and build(other, "lineage") in (None, build(self, "lineage"))
                and self.num_chunks >= other.num_chunks)

    def verify(self) -> None:
        """Re-hash every shard (reads the whole bank) and compare with the manifest."""
        for s in self.shards:
            digest = sha256_file(self.root / s.file)
            if digest != s.sha256:
                raise BankError(
                    f"bank shard {self.root / s.file} is corrupted: sha256 {digest[:16]}... does not match "
                    f"the manifest's {s.sha256[:16]}...; rebuild the bank"
                )

    # ------------------------------------------------------------------ facts

    @property
    def num_chunks(self) -> int:
        return int(self.manifest["num_chunks"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def n_cache(self) -> int:
        return int(self.manifest["n_cache"])

    @property
    def content_layer(self) -> int:
        """The ``hidden_states`` index the content cache was taken from (-1 = the final layer,
        the paper; banks built before the field existed hold it)."""
        return int(self.manifest.get("content_layer", -1))

    @property
    def fingerprint(self) -> str:
        return self.manifest["encoder"]["fingerprint"]

    @property
    def key(self) -> dict[str, Any]:
        """How the keys were made: the manifest's ``key`` record (``{"variant": "last"}`` — the
        paper's — ``"mean"``, ``"prompt"`` with ``template``, or ``"layer_mean"`` with ``layers``;
        see ``encoding.key_spec``). A bank built before banks recorded it has the paper's keys."""
        return dict(self.manifest.get("key") or {"variant": "last"})

    @property
    def key_variant(self) -> str:
        return self.key["variant"]

    @property
    def groups_sha256(self) -> dict[str, str] | None:
        """Per group, the fingerprint of its chunk texts; None for a bank built before banks recorded it."""
        return self.manifest.get(GROUPS_SHA256)

    def __len__(self) -> int:
        return self.num_chunks

    @property
    def deleted(self) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` segments of every row deleted (``elasticmem.bank.forget``); their numbers
        stay taken, no group holds them."""
        return tuple((int(a), int(b)) for a, b in self.manifest.get("deleted", ()))

    @property
    def unpurged(self) -> tuple[tuple[int, int], ...]:
        """Deleted rows whose text and tensors some file still holds, until a compaction purges them."""
        return tuple((int(a), int(b)) for a, b in self.manifest.get("unpurged", ()))

    def live_segments(self) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` segments of every row not deleted (what an unrestricted search covers)."""
        out, at = [], 0
        for a, b in self.deleted:
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < self.num_chunks:
            out.append((at, self.num_chunks))
        return tuple(out)

    def group_segments(self, group: str) -> tuple[tuple[int, int], ...]:
        """The ``[start, end)`` row segments of a group, in row order (one unless appended to)."""
        try:
            return self.groups[group]
        except KeyError:
            raise KeyError(f"group {group!r} is not in bank {self.root} ({len(self.groups)} groups)") from None

    def group_rows(self, group: str) -> tuple[int, int]:
        """``[start, end)`` rows of a group whose rows are contiguous (every group of a built bank)."""
        segs = self.group_segments(group)
        if len(segs) != 1:
            raise BankError(f"group {group!r} of bank {self.root} was appended to and holds {len(segs)} row "
                            f"segments; use group_row_ids / group_segments")
        return segs[0]

    def group_row_ids(self, group: str) -> torch.Tensor:
        """[n] int64: every row of a group, in row order (the group's chunks in the order added)."""
        return torch.cat([torch.arange(a, b) for a, b in self.group_segments(group)])

    def group_size(self, group: str) -> int:
        return sum(b - a for a, b in self.group_segments(group))

    # ------------------------------------------------------------------ tensors

    def _shard_tensor(self, i: int, name: str) -> torch.Tensor:
        return self._handles[i].get_tensor(name)  # memory-mapped, no copy

    def _range(self, name: str, start: int, end: int) -> torch.Tensor:
        parts = []
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < end:
            s = self.shards[i]
            a, b = start - s.start, min(end, s.start + s.rows) - s.start
            parts.append(self._shard_tensor(i, name)[a:b])
            start = s.start + b
            i += 1
        if not parts:
            return self._empty(name)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def keys(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Keys of rows ``[start, end)``: [rows, d] float32, L2-normalised (a view when in one shard)."""
        return self._range("keys", start, self.num_chunks if end is None else end)

    def group_keys(self, group: str) -> torch.Tensor:
        """[n, d] keys of a group's rows in row order."""
        return torch.cat([self.keys(a, b) for a, b in self.group_segments(group)])

    def _empty(self, name: str) -> torch.Tensor:
        """Zero rows of a shard tensor (also for a bank with no shard yet, which an append starts)."""
        d, dtype = self.hidden_size, self.cache_dtype
        return {"keys": torch.zeros(0, d), "cache": torch.zeros(0, self.n_cache, d, dtype=dtype),
                "cache_len": torch.zeros(0, dtype=torch.int32)}[name]

    def _gather_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows [R] (valid indices) of one shard tensor, read from the memory-mapped shards."""
        if rows.numel() and (rows.min() < 0 or rows.max() >= self.num_chunks):
            raise IndexError(f"rows out of range [0, {self.num_chunks})")
        empty = self._empty(name)
        out = torch.empty(rows.numel(), *empty.shape[1:], dtype=empty.dtype)
        shard_of = np.searchsorted(self._starts, rows.numpy(), side="right") - 1
        for i in np.unique(shard_of):
            sel = torch.from_numpy(np.nonzero(shard_of == i)[0])
            out[sel] = self._shard_tensor(i, name)[rows[sel] - self.shards[i].start]
        return out

    def gather(self, rows: torch.Tensor | np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Content caches of arbitrary rows.

        Returns ``cache`` [R, n_cache, d] (valid states right-aligned, zeros left) and
        ``cache_len`` [R] int32.
        """
        if not self.hidden_cache:
            raise BankError(f"bank {self.root} holds no hidden-state cache (built with bank.hidden_cache=false, or "
                            f"auto for a reader of per-layer KV): memory.content=hidden and the projector's warm-up "
                            f"read it; rebuild the bank with bank.hidden_cache=true")
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        return self._gather_rows("cache", rows), self._gather_rows("cache_len", rows)

    @property
    def hidden_cache(self) -> bool:
        """Whether the shards hold the hidden-state cache ``cache`` (banks built before the manifest
        field ``hidden_cache`` existed all do; ``cache_len`` is always there)."""
        return bool(self.manifest.get("hidden_cache", True))

    def require_kv(self, scheme: KVScheme) -> None:
        """Refuse to read this bank's per-layer KV as ``scheme`` (a reader's ``bank.kv_scheme()``)
        when it is stored otherwise (``KVScheme.held``: the dtype, the keys' width and their
        ranges): a reader trained on one scheme's states is not fed another's silently. The error
        names the settings that differ, both ways."""
        fmt = self._kv_or_raise()
        stored, asked = fmt.scheme.held(), scheme.held()
        differ = [k for k in asked if asked[k] != stored[k]]
        if differ:
            read = " ".join(f"{k}={stored[k]}" for k in differ)
            convert = " ".join(f"{k}={asked[k]}" for k in differ)
            raise BankError(f"bank {self.root} stores its per-layer keys and values as {fmt.describe()}, but "
                            f"{scheme.describe()} was asked: set {read} to read it, or convert it (build_bank.py "
                            f"--config ... {convert} --convert; from a float16 bank, as what a quantization lost "
                            f"stays lost)")

    def _kv_or_raise(self) -> KVFormat:
        if self.kv_format is None:
            raise BankError(f"bank {self.root} holds no per-layer keys and values: build it with bank.kv_cache=true "
                            f"to read memories with memory.content=kv")
        return self.kv_format

    def gather_kv(self, rows: torch.Tensor | np.ndarray | list[int],
                  device: torch.device | str | None = None) -> torch.Tensor:
        """Per-layer keys and values of arbitrary rows (a bank built with ``bank.kv_cache``):
        [R, n_cache, layers, 2, H_kv, hd], right-aligned like ``gather``'s cache (zeros where no
        slot is stored), keys in the window frame of ``elasticmem.bank.kv``; dequantized (float16)
        on ``device`` for an integer ``kv.dtype``."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        n = self.kv_lengths(rows)
        return to_window(self.kv_slots(rows, n, device), n, self.n_cache)

    def kv_slots(self, rows: torch.Tensor, counts: torch.Tensor,
                 device: torch.device | str | None = None) -> torch.Tensor:
        """The last ``counts[k]`` readable KV slots of each row ``rows[k]`` (at most
        ``kv_lengths``), read and, for an integer ``kv.dtype``, dequantized on ``device``:
        [sum(counts), layers, 2, H_kv, hd], row after row, each row's slots oldest first (slot
        ``i`` of row k sits at window position ``n_cache - counts[k] + i``)."""
        fmt = self._kv_or_raise()
        rows, counts = rows.reshape(-1).long(), counts.reshape(-1).long()
        if rows.numel() and (rows.min() < 0 or rows.max() >= self.num_chunks):
            raise IndexError(f"rows out of range [0, {self.num_chunks})")
        held = self.kv_lengths(rows)
        if bool((counts > held).any()):
            raise IndexError(f"more KV slots asked than rows {rows.tolist()} hold ({held.tolist()})")
        shard_of = torch.from_numpy(np.searchsorted(self._starts, rows.numpy(), side="right") - 1)
        parts, order = [], []
        for i in shard_of.unique().tolist():
            sel = (shard_of == i).nonzero().reshape(-1)
            off = None
            if fmt.layout == "ragged":
                if i not in self._kv_offsets:
                    self._kv_offsets[i] = slot_offsets(self._shard_tensor(i, "kv_len"))
                off = self._kv_offsets[i]
            parts.append(read_slots(lambda name: self._shard_tensor(i, name), off, rows[sel] - self.shards[i].start,
                                    counts[sel], fmt, self.n_cache, device))
            order.append(sel)
        if not parts:
            return self._kv_empty(device)
        # back to the order asked: each row's slots as one block
        blocks = {int(k): b for sel, p in zip(order, parts) for k, b in zip(sel, p.split(counts[sel].tolist()))}
        return torch.cat([blocks[k] for k in range(rows.numel())])

    def _kv_empty(self, device) -> torch.Tensor:
        fmt, kv = self.kv_format, self.kv
        dtype = torch.float16 if fmt.scheme.quantized else getattr(torch, fmt.dtype)
        return torch.zeros(0, kv["layers"], 2, kv["kv_heads"], kv["head_dim"], dtype=dtype, device=device)

    def kv_lengths(self, rows: torch.Tensor | np.ndarray | list[int]) -> torch.Tensor:
        """Readable per-layer KV slots [R] long of ``rows``: ``min(kv.slots, L - 1)`` for a chunk of L
        tokens (its position 0, the encoder's attention sink, is not stored: ``elasticmem.bank.kv``;
        ``kv.slots``: ``n_cache`` unless the bank was built for a smaller ``memory.policy.max_budget``)."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        chunks = self.chunks()
        n_tokens = torch.tensor([chunks[r]["n_tokens"] for r in rows.tolist()], dtype=torch.long)
        slots = self.kv_format.slots if self.kv_format is not None else self.n_cache
        return (n_tokens - 1).clamp(min=0, max=slots)

    def cache_lengths(self, rows: torch.Tensor | np.ndarray | list[int]) -> torch.Tensor:
        """Valid cache lengths [R] int32 of ``rows``, without reading their caches."""
        return self._gather_rows("cache_len", torch.as_tensor(rows, dtype=torch.long).reshape(-1))

    def gather_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """Keys of rows of any shape [...] -> [..., d]; row -1 (a missing search result) gives zeros."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        flat = rows.reshape(-1)
        out = torch.zeros(flat.numel(), self.hidden_size, dtype=torch.float32)
        ok = flat >= 0
        out[ok] = self._gather_rows("keys", flat[ok])
        return out.reshape(*rows.shape, self.hidden_size)

    @property
    def kv(self) -> dict[str, Any] | None:
        """The manifest's ``kv`` record ({layers, kv_heads, head_dim, dtype}, and layout, slots,
        scheme, group_size, key_group, key_dtype for banks of ``elasticmem.bank.kv_store``'s ragged
        layout; ``KVFormat.of`` reads it) of a bank built
        with ``bank.kv_cache``; None for a bank of hidden states only."""
        return self.manifest.get("kv")

    @property
    def cache_dtype(self) -> torch.dtype:
        return getattr(torch, self.manifest["cache_dtype"])

    # ------------------------------------------------------------------ text

    @property
    def chunk_files(self) -> list[dict[str, Any]]:
        """The files holding the chunk records, in row order: ``{file, rows, bytes}`` each (a built
        bank has one, ``chunks.jsonl``, not listed in its manifest; each append adds one)."""
        base = self.num_chunks - sum(int(c["rows"]) for c in self.manifest.get("chunk_files", []))
        return [{"file": CHUNKS, "rows": base}, *self.manifest.get("chunk_files", [])]

    def chunks(self) -> ChunkRecords:
        """All chunk records ``{row, group, text, n_tokens, ...}`` in row order (a read-only
        sequence; read on first use, and only the rows no earlier snapshot of this bank read)."""
        store = self._store
        if len(store.records) < self.num_chunks:
            with store.lock:
                if len(store.records) < self.num_chunks:
                    self._read_records(store.records)
        return ChunkRecords(store.records, self.num_chunks)

    def _read_records(self, records: list[dict[str, Any]]) -> None:
        """Append rows ``len(records)..num_chunks-1`` to ``records`` from the chunk files holding them."""
        have, start = len(records), 0
        for rec in self.chunk_files:
            rows, first = int(rec["rows"]), start
            start += rows
            if start <= have:
                continue
            path = self.root / rec["file"]
            if rec["file"] == CHUNKS and not path.is_file() and rows == 0:
                continue  # a bank created empty for appends
            with open(path, encoding="utf-8") as f:
                part = [json.loads(line) for line in f if line.strip()]
            if len(part) != rows:
                raise BankError(f"{path} has {len(part)} lines, expected {rows}")
            records.extend(part[have - first if have > first else 0:])
            have = len(records)

    def _add_records(self, first: int, new: list[dict[str, Any]]) -> None:
        """Share chunk records an appender just wrote (rows ``first``...), so that no reader of this
        line of appends reads them back from disk; ignored unless they come right after those read."""
        with self._store.lock:
            if len(self._store.records) == first:
                self._store.records.extend(new)

    def chunk(self, row: int) -> dict[str, Any]:
        return self.chunks()[row]

    def iter_groups(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(group, its rows [n] int64) for every group."""
        for g in self.groups:
            yield g, self.group_row_ids(g)

    def nbytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.root.iterdir() if p.is_file())
