"""Grow a bank while it is read: encode new sessions of some groups and append them.

Why one file (about 650 lines): appending, compaction and forgetting's purge write the same on-disk
records under the same folder lock and crash rules (new names, fsync, a journal record as the
commit, garbage collected later); kept together, those rules are written and checked once.
Compaction runs inside an append, under the same lock, and commits through the same journal and
checkpoint functions: apart, the two halves would each import the other's private commit steps.

An append encodes the new chunks exactly as a build does (``encode_shard``: the frozen encoder,
the bank's own tokenization, key variant, content layer, cache length and dtype), then

1. writes them as one new shard and one new chunk file, under names no manifest refers to yet
   (each through a temporary file, fsync and rename), and
2. appends one checksummed record naming them to the manifest's journal and fsyncs it, which is
   the commit (``elasticmem.bank.store``: the bank is ``manifest.json`` with its journal's
   records applied). A bank without a journal yet (a build's) commits its first append by
   replacing ``manifest.json`` atomically (tmp + rename) with one that names a new journal.

A crash at any point before 2 leaves the previous state, which names only the previous files:
the bank opens and reads as before (a later append writes over the orphaned files and truncates
a torn journal record). Readers hold a snapshot (``Bank``): the files a manifest names never
change, so a reader opened before an append keeps reading its rows; ``Bank.refresh()`` reads the
journal's new records and ``KeyIndex.refresh`` adds the new rows to a search index. Appends to one
folder are serialised by an exclusive lock on the folder (processes and threads alike).

What an append costs does not grow with the bank: the snapshot appended to is brought up to date
from the journal's tail, the per-group state (chunk hashes, next session, the running
``groups_sha256``) is kept between appends of a process (``Bank``'s shared records), and only the
new rows are encoded and written. Small appended shards are merged by ``compact`` in levels
(``COMPACT_FANOUT``), which writes each row about ``log_fanout(COMPACT_ROWS)`` times in all; it
then rewrites ``manifest.json`` with a new journal.

A chunk is identified within its group by the sha256 of its text: a chunk whose text the
group already holds is skipped, so a retried or repeated append adds nothing. Chunks are
made by ``chunk_history`` (one per user+assistant pair of a session), so appending a
conversation's sessions one by one gives each group the rows, in the same order, that a build
of the whole history gives (``tests/unit/test_bank_append.py`` checks keys and caches to 1e-6).

    python build_bank.py --config configs/quickstart.yaml --append   # add new data to a built bank
    from elasticmem.live import LiveMemory                            # the agent-facing API on top
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save as st_save
from tqdm.auto import tqdm

from elasticmem.bank.builder import (
    _atomic_write_bytes,
    _atomic_write_text,
    _dir_lock,
    encode_shard,
    key_spec,
    prompt_key_ids,
)
from elasticmem.bank.kv import kv_spec, rotary_module
from elasticmem.bank.kv_store import storage_fields, storage_of, tensor_names, zero_rows
from elasticmem.bank.manifest import (
    APPEND_FORMAT_VERSION,
    CHUNKS,
    GROUPS_SHA256,
    MANIFEST,
    BankError,
    apply_record,
    forgotten_record,
    journal_line,
)
from elasticmem.bank.store import Bank, shard_name
from elasticmem.config import BankConfig, ChunkingConfig
from elasticmem.data.chunking import Chunk, chunk_history, tokenize_chunks
from elasticmem.data.schema import Turn


@dataclass(frozen=True)
class SessionAdd:
    """One session of turns to remember in ``group``."""

    group: str
    turns: Sequence[Turn]
    session: int | None = None
    """Its index in the group's history (what ``chunks()`` records as ``session``, which evidence
    positions refer to); None = after the group's last session."""


@dataclass
class AppendResult:
    bank: Bank
    """The bank after the append (a new snapshot; the one appended to stays valid)."""
    rows: dict[str, list[int]] = field(default_factory=dict)
    """New rows per group, in row order (a group whose chunks were all known has [])."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Per group, chunks left out because the group already held their text."""
    per_item: list[tuple[list[int], int]] = field(default_factory=list)
    """Per item appended, in order: its new rows and its skipped chunk count."""
    seconds: float = 0.0

    @property
    def added(self) -> int:
        return sum(len(r) for r in self.rows.values())


def text_sha256(text: str) -> str:
    """A chunk's identity within its group: sha256 (hex) of its UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def chunk_file_name(i: int) -> str:
    """The chunk texts of the i-th shard when an append wrote it (a build's are in ``chunks.jsonl``)."""
    return f"chunks-{i:05d}.jsonl"


def _journal_name() -> str:
    return f"journal-{uuid.uuid4().hex[:16]}.log"


def _fsync_dir(path: Path) -> None:
    """Make the renames in ``path`` durable (a rename is only on disk once its folder is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_bank(root: str | Path, backbone, chunking: ChunkingConfig, bank_cfg: BankConfig,
                cache_dtype: torch.dtype) -> Bank:
    """An empty bank in ``root`` (which must not hold one) for appends to fill: the manifest of a
    build of no data with these settings, so its rows match those a build would encode."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        raise BankError(f"{root} already holds a bank; open it with Bank.open")
    root.mkdir(parents=True, exist_ok=True)
    n = backbone.model.config.num_hidden_layers
    if not -(n + 1) <= bank_cfg.content_layer <= n:
        raise ValueError(f"bank.content_layer {bank_cfg.content_layer} out of range for {n} layers")
    manifest: dict[str, Any] = {
        "format_version": APPEND_FORMAT_VERSION,
        "encoder": {"name_or_path": backbone.name_or_path, "fingerprint": backbone.fingerprint,
                    "dtype": str(next(backbone.model.parameters()).dtype).removeprefix("torch.")},
        "hidden_size": backbone.hidden_size,
        "n_cache": bank_cfg.n_cache,
        "cache_dtype": str(cache_dtype).removeprefix("torch."),
        "num_chunks": 0,
        "tokenization": {"add_special_tokens": chunking.add_special_tokens, "max_tokens": chunking.max_tokens,
                         "truncation_side": chunking.truncation_side},
        "key": key_spec(bank_cfg),
        "shards": [], "chunk_files": [], "groups": {}, "groups_sha256": {},
        # a unique plan id: an index saved for another bank that lived in this folder is never reused
        "build": {"plan_id": f"live-{uuid.uuid4().hex}", "appends": 0, "journal": _journal_name()},
    }
    if bank_cfg.content_layer != -1:
        manifest["content_layer"] = int(bank_cfg.content_layer)
    if bank_cfg.kv_cache:
        rotary_module(backbone.model.get_decoder())
    manifest.update(storage_fields(*storage_of(bank_cfg), kv_spec(backbone.model.config)))  # as a build stores
    _atomic_write_text(root / CHUNKS, "")
    _atomic_write_bytes(root / manifest["build"]["journal"], b"")
    _atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_dir(root)
    return Bank.open(root)


class _GroupMemo:
    """What an append needs to know of a group's rows, kept up to date from the new rows only:
    the sha256 of each chunk text, the next session index and the running ``groups_sha256``
    (``chunks_fingerprint`` hashes ``json.dumps(texts)``, which is ``[`` + the texts' JSON joined
    by ``, `` + ``]``: it can be fed one text at a time)."""

    def __init__(self):
        self.n = 0
        self.covered: tuple[tuple[int, int], ...] = ()
        """The group's segments the memo was last brought up to (a delete changes earlier ones)."""
        self.version = (0, 0)
        self.known: set[str] = set()
        self.next_session = 0
        self.hasher = hashlib.sha256(b"[")

    def add(self, rec: dict[str, Any]) -> None:
        self.feed(self.hasher, rec["text"], self.n)
        self.known.add(text_sha256(rec["text"]))
        self.next_session = max(self.next_session, int(rec.get("session", -1)) + 1)
        self.n += 1

    @staticmethod
    def feed(hasher, text: str, n_before: int) -> None:
        hasher.update((", " if n_before else "").encode() + json.dumps(text, ensure_ascii=False).encode("utf-8"))

    def fingerprint(self, more: Sequence[str] = ()) -> str:
        h = self.hasher.copy()
        for k, t in enumerate(more):
            self.feed(h, t, self.n + k)
        h.update(b"]")
        return h.hexdigest()


def _tail_rows(segments: Sequence[tuple[int, int]], skip: int) -> list[int]:
    """The rows of ``segments`` after the first ``skip``, walking from the end (the cost is the
    rows returned and the segments they span, not the group's size)."""
    out: list[list[int]] = []
    want = sum(b - a for a, b in segments) - skip
    for a, b in reversed(segments):
        if want <= 0:
            break
        take = min(want, b - a)
        out.append(list(range(b - take, b)))
        want -= take
    return [r for part in reversed(out) for r in part]


def _prefix(segments: Sequence[tuple[int, int]], n: int) -> tuple[tuple[int, int], ...]:
    """The segments covering the first ``n`` rows of ``segments``."""
    out = []
    for a, b in segments:
        if n <= 0:
            break
        out.append((a, min(b, a + n)))
        n -= out[-1][1] - a
    return tuple(out)


def _group_memo(bank: Bank, group: str) -> _GroupMemo:
    """``group``'s memo as of ``bank`` (a new group: empty), brought up to date with its rows."""
    memos = bank._store.memo
    segs = tuple(bank.groups.get(group, ()))
    size = sum(b - a for a, b in segs)
    memo = memos.get(group)
    # a first look, an older snapshot than the memo's, or rows the memo read were deleted since
    if memo is None or memo.n > size or _prefix(segs, memo.n) != _prefix(memo.covered, memo.n):
        stale = memo
        memo = _GroupMemo()
        if stale is None or _version(bank) >= stale.version:  # keep the newest snapshot's
            memos[group] = memo
    if memo.n < size:
        chunks = bank.chunks()
        for r in _tail_rows(segs, memo.n):
            memo.add(chunks[r])
    memo.covered, memo.version = segs, _version(bank)
    return memo


def _memos_follow(bank: Bank, grown: Bank, touched: dict[str, list[int]], records: list[dict[str, Any]],
                  start: int) -> None:
    """Bring the memos of the groups an append touched, which were up to date with ``bank``, up to
    ``grown``'s rows at once: the next append to them then reads nothing (an append's cost would
    otherwise carry, for each group, the rows its previous one added)."""
    memos = bank._store.memo
    for g, rs in touched.items():
        memo = memos.get(g)
        if memo is None or memo.covered != tuple(bank.groups.get(g, ())) or memo.version != _version(bank):
            continue  # another snapshot's: _group_memo brings it up to date when it is next read
        for r in rs:
            memo.add(records[r - start])
        memo.covered, memo.version = tuple(grown.groups.get(g, ())), _version(grown)


def _version(bank: Bank) -> tuple[int, int]:
    """Orders the snapshots of one line of appends: deletes committed, then rows."""
    return int(bank.manifest.get("build", {}).get("deletes", 0)), bank.num_chunks


def _new_chunks(bank: Bank, items: Sequence[SessionAdd]) -> tuple[list[tuple[int, Chunk]], list[int]]:
    """The chunks of ``items`` that their groups do not hold yet, each with the index of its item,
    grouped by group (first appearance order, so each group's new rows are contiguous), and the
    skipped count of each item."""
    for it in items:
        if not it.group or not isinstance(it.group, str):
            raise ValueError(f"a memory group must be a non-empty string, got {it.group!r}")
    memos = {g: _group_memo(bank, g) for g in dict.fromkeys(it.group for it in items)}
    added: dict[str, set[str]] = {g: set() for g in memos}  # the memos change only once rows are committed
    next_session = {g: m.next_session for g, m in memos.items()}
    by_group: dict[str, list[tuple[int, Chunk]]] = {g: [] for g in memos}
    skipped = [0] * len(items)
    for i, it in enumerate(items):
        s = next_session[it.group] if it.session is None else int(it.session)
        if s < 0:
            raise ValueError(f"session index must be >= 0, got {s}")
        made = 0
        for c in chunk_history([list(it.turns)], it.group):
            h = text_sha256(c.text)
            if h in memos[it.group].known or h in added[it.group]:
                skipped[i] += 1
                continue
            added[it.group].add(h)
            by_group[it.group].append((i, Chunk(c.group, c.text, s, c.turns)))
            made += 1
        if made:
            next_session[it.group] = max(next_session[it.group], s + 1)
    return [c for cs in by_group.values() for c in cs], skipped


def _latest(root: Path, bank: Bank | None, fingerprint: str) -> Bank:
    """The bank's newest state (the folder's lock held): ``bank`` brought up to date from the
    journal's tail, or opened; a journal record a crash tore is cut off, so the next one follows
    the last whole record."""
    if bank is None or bank.fingerprint != fingerprint:
        bank = Bank.open(root, expect_fingerprint=fingerprint, like=bank)
    else:
        bank = bank.refresh()
    journal = bank.journal
    if journal is not None and journal.is_file() and journal.stat().st_size > bank._journal_offset:
        with open(journal, "r+b") as f:
            f.truncate(bank._journal_offset)
            os.fsync(f.fileno())
    return bank


def _append_journal(journal: Path, record: dict[str, Any]) -> int:
    """Commit ``record``: append its line to ``journal`` and make it durable. Returns the journal's
    new length."""
    line = journal_line(record)
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND)
    try:
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _checkpoint(bank: Bank, manifest: dict[str, Any]) -> Bank:
    """Commit ``manifest`` (the state of ``bank``'s folder from now on) as ``manifest.json`` with a
    new, empty journal, and seal the journal ``bank`` read (readers then reopen the manifest)."""
    root = bank.root
    name = _journal_name()
    _atomic_write_bytes(root / name, b"")
    manifest = {**manifest, "build": {**manifest.get("build", {}), "journal": name}}
    _atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=1))  # the commit
    _fsync_dir(root)
    old = bank.journal
    if old is not None and old.is_file():
        _append_journal(old, {"op": "seal", "by": name})
    return Bank.open(root, expect_fingerprint=bank.fingerprint, like=bank)


def append_sessions(
    root: str | Path | Bank,
    items: Sequence[SessionAdd],
    decoder: torch.nn.Module,
    tokenizer,
    fingerprint: str,
    batch_size: int = 16,
    show_progress: bool = False,
) -> AppendResult:
    """Encode the chunks of ``items`` and append them to the bank at ``root`` (see the module
    docstring). ``decoder`` must compute the frozen encoder's states (for a LoRA-wrapped model,
    call this inside its ``disable_adapter()``); ``fingerprint`` is the encoder's, checked
    against the bank's. Returns the new snapshot and the rows added per group. Given a ``Bank``
    (the snapshot last returned, as ``ElasticMem.remember`` passes), the append reads only what
    changed since; given a folder, it opens the bank."""
    t0 = time.perf_counter()
    snapshot = root if isinstance(root, Bank) else None
    root = root.root if isinstance(root, Bank) else Path(root)
    if not (root / MANIFEST).is_file():
        raise BankError(f"no bank at {root}: create one first (elasticmem.bank.append.create_bank, or build_bank.py)")
    with _dir_lock(root):
        bank = _latest(root, snapshot, fingerprint)
        for name in os.listdir(root):  # debris of an append that crashed before its commit (names: no Paths)
            if ".tmp" in name and name.startswith((MANIFEST, "chunks", "shard-", "journal-")):
                (root / name).unlink(missing_ok=True)
        tagged, item_skipped = _new_chunks(bank, items)
        new = [c for _, c in tagged]
        rows: dict[str, list[int]] = {it.group: [] for it in items}
        skipped = dict.fromkeys(rows, 0)
        for it, k in zip(items, item_skipped):
            skipped[it.group] += k
        per_item: list[tuple[list[int], int]] = [([], k) for k in item_skipped]
        if not new:
            return AppendResult(bank, rows, skipped, per_item, time.perf_counter() - t0)
        m = bank.manifest
        tok = m["tokenization"]
        ids = tokenize_chunks([c.text for c in new], tokenizer, tok["max_tokens"], tok["truncation_side"],
                              tok["add_special_tokens"])
        key = bank.key
        key_ids = None
        if key["variant"] == "prompt":
            key_ids = prompt_key_ids(tokenizer, [c.text for c in new], ids, key["template"], tok["max_tokens"],
                                     tok["add_special_tokens"])
        bar = tqdm(total=len(new), desc="encoding new chunks", unit="chunk", disable=not show_progress,
                   file=sys.stderr, dynamic_ncols=True)
        tensors = encode_shard(decoder, ids, bank.n_cache, batch_size, tokenizer.pad_token_id, bank.cache_dtype,
                               progress=bar.update, key=key, key_ids=key_ids, content_layer=bank.content_layer,
                               kv_format=bank.kv_format, hidden_cache=bank.hidden_cache)
        bar.close()
        i, start = _next_index(m), bank.num_chunks
        data = st_save(tensors, metadata={"plan_id": m.get("build", {}).get("plan_id") or "", "append": str(i)})
        _atomic_write_bytes(root / shard_name(i), data)
        records = []
        for r, ((item, c), t) in enumerate(zip(tagged, ids), start):
            rows[c.group].append(r)
            per_item[item][0].append(r)
            records.append({"row": r, "group": c.group, "text": c.text, "n_tokens": len(t),
                            "session": c.session, "turns": list(c.turns)})
        text = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records).encode("utf-8")
        _atomic_write_bytes(root / chunk_file_name(i), text)
        _fsync_dir(root)  # the files are in the folder before a record names them

        touched = {g: rs for g, rs in rows.items() if rs}
        record = {
            "op": "append", "num_chunks": start + len(new),
            "shard": {"file": shard_name(i), "rows": len(new), "sha256": hashlib.sha256(data).hexdigest(),
                      "bytes": len(data)},
            "chunk_file": {"file": chunk_file_name(i), "rows": len(new), "sha256": hashlib.sha256(text).hexdigest(),
                           "bytes": len(text)},
            "groups": {g: [rs[0], rs[-1] + 1] for g, rs in touched.items()},
            GROUPS_SHA256: {g: _group_memo(bank, g).fingerprint([new[r - start].text for r in rs])
                            for g, rs in touched.items()},
            "lineage": m.get("build", {}).get("lineage") or uuid.uuid4().hex,  # see Bank.extends
        }
        if bank.journal is None:  # a build's bank (or one appended to before journals): start one
            grown = _checkpoint(bank, apply_record(m, record))
        else:
            grown = bank._grown([record], _append_journal(bank.journal, record))  # the commit
        grown._add_records(start, records)
        _memos_follow(bank, grown, touched, records, start)
        if _merge_plan(_appended_rows(grown.manifest)):
            grown = _compact(grown)
        elif grown._journal_records >= CHECKPOINT_RECORDS:
            grown = _checkpoint(grown, grown.manifest)
        return AppendResult(grown, rows, skipped, per_item, time.perf_counter() - t0)


COMPACT_ROWS = 4096
"""Appended shards are merged into shards of at least this many rows (and fewer than twice as
many); a shard this large is never merged again."""
COMPACT_FANOUT = 64
"""Merge levels: shards are merged as soon as consecutive ones smaller than
``COMPACT_ROWS / COMPACT_FANOUT**k`` hold that many rows together. A row is rewritten at most
once per level (``ceil(log_fanout(COMPACT_ROWS))`` = 2 times), and at most about
``COMPACT_FANOUT - 1`` shards of each level stay small: a server adding one session per request
neither writes each row many times nor keeps a file pair per request."""
MAX_SMALL_SHARDS = 256
"""A mix of append sizes that leaves more small shards than this (one large append after each
run of small ones, repeatedly) has them merged with their neighbours up to ``COMPACT_ROWS``."""
CHECKPOINT_RECORDS = 256
"""A journal with this many records is folded into a new ``manifest.json`` (opening a bank
replays its journal)."""
GRACE_S = 600.0
"""Files and journals a compaction replaced are deleted by a later one once replaced this long
ago: a reader that opened the bank before may still read them (its snapshot's chunk texts are
read on first use)."""


def _next_index(manifest: dict[str, Any]) -> int:
    """A shard number no file of the manifest uses (after a compaction, numbers have gaps)."""
    used = [int(s["file"].removeprefix("shard-").split(".")[0]) for s in manifest["shards"]]
    return max(used, default=-1) + 1


def _appended_rows(manifest: dict[str, Any]) -> list[int]:
    """The rows of each appended shard (the shards that have chunk files), in order."""
    return [int(c["rows"]) for c in manifest.get("chunk_files", [])]


def _merge_plan(sizes: Sequence[int], target_rows: int | None = None, fanout: int | None = None) -> list[list[int]]:
    """Which runs of consecutive appended shards (given their row counts) to merge: for each level
    ``b = target / fanout**k`` from the smallest up, consecutive pieces smaller than ``b`` are
    gathered from the oldest until they hold ``b`` rows, and merged. A merged piece holds at least
    ``b`` rows, so a row changes level at each rewrite. The merges of one call compose (a run is
    written once, from the original shards)."""
    target = target_rows or COMPACT_ROWS
    fanout = fanout or COMPACT_FANOUT
    bounds, b = [], float(target)
    while b > 1:
        bounds.append(b)
        b /= fanout
    pieces = [([k], n) for k, n in enumerate(sizes)]
    for b in sorted(bounds):
        out: list[tuple[list[int], int]] = []
        run: list[tuple[list[int], int]] = []
        held = 0  # the rows of ``run``: kept as it grows, since every append plans over every shard
        for piece in pieces:
            if piece[1] >= b:
                out += run + [piece]
                run, held = [], 0
                continue
            run.append(piece)
            held += piece[1]
            if held >= b:
                out.append(([k for ks, _ in run for k in ks], held))
                run, held = [], 0
        pieces = out + run
    if sum(1 for _, n in pieces if n < target) > MAX_SMALL_SHARDS:
        out, cur = [], ([], 0)
        for ks, n in pieces:
            if cur[0] and cur[1] + n > target:
                out.append(cur)
                cur = ([], 0)
            cur = (cur[0] + ks, cur[1] + n)
        pieces = out + [cur]
    return [ks for ks, _ in pieces if len(ks) > 1]


def compact(root: str | Path, target_rows: int | None = None) -> Bank:
    """Merge runs of consecutive appended shards (and their chunk files) by ``_merge_plan``
    (levels up to ``target_rows``, default ``COMPACT_ROWS``), purge deleted rows, and fold the
    journal into a new ``manifest.json``. Rows keep their numbers, order and values, so search
    results, cached row ids and indexes stay valid; readers keep their snapshot. Files no manifest
    needs any more are deleted once replaced ``GRACE_S`` ago, except those that held a deleted
    row's data: those at once (forgetting does not wait for old readers; a reader holding an old
    snapshot keeps its open shards, but must refresh to read chunk texts). Append calls this by
    itself when shards are to be merged."""
    root = Path(root)
    with _dir_lock(root):
        bank = Bank.open(root)
        return _compact(_latest(root, bank, bank.fingerprint), target_rows)


def _in(segments: Sequence[tuple[int, int]], a: int, b: int) -> bool:
    """Whether rows ``[a, b)`` meet any of ``segments``."""
    return any(x < b and a < y for x, y in segments)


def _purged(tensors: dict[str, torch.Tensor], lines: list[bytes], first: int,
            deleted: Sequence[tuple[int, int]]) -> None:
    """Zero the tensors and replace the chunk lines (in place) of the deleted rows among the
    rows ``first...`` they hold: a forgotten row leaves no byte of its text or states."""
    n = len(lines) if lines else next(iter(tensors.values())).shape[0]
    for a, b in deleted:
        lo, hi = max(a, first) - first, min(b, first + n) - first
        if lo >= hi:
            continue
        zero_rows(tensors, lo, hi)  # rows' slots of per-layer KV too (elasticmem.bank.kv_store)
        for j in range(lo, min(hi, len(lines))):
            lines[j] = (json.dumps(forgotten_record(first + j)) + "\n").encode()


def _compact(bank: Bank, target_rows: int | None = None) -> Bank:
    """``compact`` with the folder's lock held."""
    from safetensors import safe_open

    root, m = bank.root, bank.manifest
    appended = m.get("chunk_files", [])
    first = len(m["shards"]) - len(appended)  # shards before are a build's (texts in chunks.jsonl)
    runs = _merge_plan(_appended_rows(m), target_rows)
    unpurged, deleted = bank.unpurged, bank.deleted
    holds = [_in(unpurged, s.start, s.start + s.rows) for s in bank.shards]
    merged = {k for run in runs for k in run}
    # an appended shard holding a deleted row is rewritten alone when no merge rewrites it
    runs += [[k] for k in range(len(appended)) if k not in merged and holds[first + k]]
    nxt = _next_index(m)
    names = tensor_names(m)
    meta = {"plan_id": m.get("build", {}).get("plan_id") or ""}
    replace: dict[int, tuple[dict, dict]] = {}  # first appended index of a run -> merged shard, chunk file
    for run in runs:
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        lines: list[bytes] = []
        for k in run:
            with safe_open(str(root / m["shards"][first + k]["file"]), framework="pt") as f:
                for name in parts:
                    parts[name].append(f.get_tensor(name))
            lines += (root / appended[k]["file"]).read_bytes().splitlines(keepends=True)
        tensors = {n: torch.cat(v).clone() for n, v in parts.items()}
        _purged(tensors, lines, bank.shards[first + run[0]].start, deleted)
        data = st_save(tensors, metadata={**meta, "compacted": str(len(run))})
        text = b"".join(lines)
        rows = sum(appended[k]["rows"] for k in run)
        _atomic_write_bytes(root / shard_name(nxt), data)
        _atomic_write_bytes(root / chunk_file_name(nxt), text)
        replace[run[0]] = ({"file": shard_name(nxt), "rows": rows, "sha256": hashlib.sha256(data).hexdigest(),
                            "bytes": len(data)},
                           {"file": chunk_file_name(nxt), "rows": rows, "sha256": hashlib.sha256(text).hexdigest(),
                            "bytes": len(text)})
        nxt += 1
    built: dict[int, dict] = {}  # a build's shard holding a deleted row -> its rewrite
    for i in (i for i in range(first) if holds[i]):
        with safe_open(str(root / m["shards"][i]["file"]), framework="pt") as f:
            tensors = {n: f.get_tensor(n).clone() for n in names}
        _purged(tensors, [], bank.shards[i].start, deleted)
        data = st_save(tensors, metadata={**meta, "purged": "1"})
        _atomic_write_bytes(root / shard_name(nxt), data)
        built[i] = {"file": shard_name(nxt), "rows": bank.shards[i].rows,
                    "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        nxt += 1
    if built:  # the build's chunk texts are one file, not in the manifest (no size to match): rewritten in place
        lines = (root / CHUNKS).read_bytes().splitlines(keepends=True)
        _purged({}, lines, 0, deleted)
        _atomic_write_bytes(root / CHUNKS, b"".join(lines))
    grown = bank
    if replace or built or unpurged:
        _fsync_dir(root)
        run_of = {k: run for run in runs for k in run}
        shards = [built.get(i, s) for i, s in enumerate(m["shards"][:first])]
        chunk_files = []
        for k in range(len(appended)):
            if k in replace:
                shards.append(replace[k][0])
                chunk_files.append(replace[k][1])
            elif k not in run_of:
                shards.append(m["shards"][first + k])
                chunk_files.append(appended[k])
        build = dict(m.get("build", {}))
        build["compactions"] = int(build.get("compactions", 0)) + 1
        if unpurged:
            # Every shard and chunk file the new manifest does not name may hold a forgotten row (those
            # just replaced, those an earlier merge replaced within the grace time, a crashed writer's
            # temporary files): all are deleted now, and by any later compaction should a crash stop
            # this one. Names are never reused (numbers only grow), so the list stays true.
            needed = {s["file"] for s in shards} | {c["file"] for c in chunk_files}
            build["forgotten_files"] = sorted(
                {f for f in build.get("forgotten_files", []) if (root / f).exists()}
                | {p.name for p in root.iterdir() if p.name.startswith(("shard-", "chunks-")) and p.name not in needed})
        grown = _checkpoint(bank, {**m, "shards": shards, "chunk_files": chunk_files, "build": build, "unpurged": []})
        now = time.time()
        for k in run_of:  # their grace time starts now, when they stop being the bank's
            for f in (m["shards"][first + k]["file"], appended[k]["file"]):
                os.utime(root / f, (now, now))
        if unpurged:  # a saved FAISS index holds the forgotten keys: it is rebuilt when next loaded
            for name in ("index.faiss", "index.json"):
                (root / name).unlink(missing_ok=True)
    _collect_garbage(root, grown.manifest)
    return grown


def _collect_garbage(root: Path, manifest: dict[str, Any], grace_s: float | None = None) -> None:
    """Delete shard, chunk and journal files the manifest does not name, once older than
    ``grace_s`` (default ``GRACE_S``); those that held a forgotten row (``build.forgotten_files``)
    at once."""
    grace_s = GRACE_S if grace_s is None else grace_s
    needed = ({s["file"] for s in manifest["shards"]} | {c["file"] for c in manifest.get("chunk_files", [])}
              | {manifest.get("build", {}).get("journal")})
    forgotten = set(manifest.get("build", {}).get("forgotten_files", ())) - needed
    now = time.time()
    for p in root.iterdir():
        if p.name in forgotten:
            p.unlink(missing_ok=True)
        elif p.name.startswith(("shard-", "chunks-", "journal-")) and p.name not in needed and (
                ".tmp" not in p.name and now - p.stat().st_mtime > grace_s):
            p.unlink(missing_ok=True)
    if forgotten:
        _fsync_dir(root)


__all__ = ["AppendResult", "SessionAdd", "append_sessions", "chunk_file_name", "compact", "create_bank",
           "text_sha256"]
