"""Grow a bank while it is read: encode new sessions of some groups and append them.

An append encodes the new chunks exactly as a build does (``encode_shard``: the frozen encoder,
the bank's own tokenization, key variant, content layer, cache length and dtype), then

1. writes them as one new shard and one new chunk file, under names no manifest refers to yet
   (each through a temporary file, fsync and rename), and
2. replaces the manifest atomically (the same tmp + rename), which is the commit.

A crash at any point before 2 leaves the previous manifest, which names only the previous
files: the bank opens and reads as before (a later append writes over the orphaned files).
Readers hold a snapshot (``Bank``): the files a manifest names never change, so a reader opened
before an append keeps reading its rows; ``Bank.refresh()`` opens the newest manifest and
``KeyIndex.refresh`` adds the new rows to a search index. Appends to one folder are serialised
by an exclusive lock on the folder (processes and threads alike).

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
    chunks_fingerprint,
    encode_shard,
    key_spec,
    prompt_key_ids,
)
from elasticmem.bank.kv import kv_spec, rotary_module
from elasticmem.bank.store import APPEND_FORMAT_VERSION, CHUNKS, MANIFEST, Bank, BankError, shard_name
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
        "build": {"plan_id": f"live-{uuid.uuid4().hex}", "appends": 0},
    }
    if bank_cfg.content_layer != -1:
        manifest["content_layer"] = int(bank_cfg.content_layer)
    if bank_cfg.kv_cache:
        rotary_module(backbone.model.get_decoder())
        manifest["kv"] = {**kv_spec(backbone.model.config), "dtype": bank_cfg.kv_dtype}
    _atomic_write_text(root / CHUNKS, "")
    _atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_dir(root)
    return Bank.open(root)


def _new_chunks(bank: Bank, items: Sequence[SessionAdd]) -> tuple[list[tuple[int, Chunk]], list[int]]:
    """The chunks of ``items`` that their groups do not hold yet, each with the index of its item,
    grouped by group (first appearance order, so each group's new rows are contiguous), and the
    skipped count of each item."""
    chunks = bank.chunks()
    known: dict[str, set[str]] = {}
    next_session: dict[str, int] = {}
    for g in dict.fromkeys(it.group for it in items):
        rows = bank.group_row_ids(g).tolist() if g in bank.groups else []
        known[g] = {text_sha256(chunks[r]["text"]) for r in rows}
        next_session[g] = 1 + max((int(chunks[r].get("session", -1)) for r in rows), default=-1)
    by_group: dict[str, list[tuple[int, Chunk]]] = {g: [] for g in known}
    skipped = [0] * len(items)
    for i, it in enumerate(items):
        if not it.group or not isinstance(it.group, str):
            raise ValueError(f"a memory group must be a non-empty string, got {it.group!r}")
        s = next_session[it.group] if it.session is None else int(it.session)
        if s < 0:
            raise ValueError(f"session index must be >= 0, got {s}")
        made = 0
        for c in chunk_history([list(it.turns)], it.group):
            h = text_sha256(c.text)
            if h in known[it.group]:
                skipped[i] += 1
                continue
            known[it.group].add(h)
            by_group[it.group].append((i, Chunk(c.group, c.text, s, c.turns)))
            made += 1
        if made:
            next_session[it.group] = max(next_session[it.group], s + 1)
    return [c for cs in by_group.values() for c in cs], skipped


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
    against the bank's. Returns the new snapshot and the rows added per group."""
    t0 = time.perf_counter()
    root = root.root if isinstance(root, Bank) else Path(root)
    if not (root / MANIFEST).is_file():
        raise BankError(f"no bank at {root}: create one first (elasticmem.bank.append.create_bank, or build_bank.py)")
    with _dir_lock(root):
        bank = Bank.open(root, expect_fingerprint=fingerprint)
        for p in root.iterdir():  # debris of an append that crashed before its commit
            if ".tmp" in p.name and p.name.startswith((MANIFEST, "chunks", "shard-")):
                p.unlink(missing_ok=True)
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
                               kv_dtype=getattr(torch, bank.kv["dtype"]) if bank.kv else None)
        bar.close()
        i, start = _next_index(m), bank.num_chunks
        data = st_save(tensors, metadata={"plan_id": m.get("build", {}).get("plan_id") or "", "append": str(i)})
        _atomic_write_bytes(root / shard_name(i), data)
        lines = []
        for r, ((item, c), t) in enumerate(zip(tagged, ids), start):
            rows[c.group].append(r)
            per_item[item][0].append(r)
            lines.append(json.dumps({"row": r, "group": c.group, "text": c.text, "n_tokens": len(t),
                                     "session": c.session, "turns": list(c.turns)}, ensure_ascii=False))
        text = ("\n".join(lines) + "\n").encode("utf-8")
        _atomic_write_bytes(root / chunk_file_name(i), text)

        manifest = json.loads(json.dumps(m))  # a deep copy
        manifest["format_version"] = APPEND_FORMAT_VERSION
        manifest["num_chunks"] = start + len(new)
        manifest["shards"].append({"file": shard_name(i), "rows": len(new), "sha256": hashlib.sha256(data).hexdigest(),
                                   "bytes": len(data)})
        manifest.setdefault("chunk_files", []).append(
            {"file": chunk_file_name(i), "rows": len(new), "sha256": hashlib.sha256(text).hexdigest(),
             "bytes": len(text)})
        old_texts = bank.chunks()
        fps = manifest.setdefault("groups_sha256", {})
        for g, rs in rows.items():
            if not rs:
                continue
            segs = [list(s) for s in bank.groups.get(g, ())]
            if segs and segs[-1][1] == rs[0]:
                segs[-1][1] = rs[-1] + 1
            else:
                segs.append([rs[0], rs[-1] + 1])
            manifest["groups"][g] = segs
            before = [old_texts[r]["text"] for r in (bank.group_row_ids(g).tolist() if g in bank.groups else [])]
            fps[g] = chunks_fingerprint(before + [new[r - start].text for r in rs])
        build = manifest.setdefault("build", {})
        build["appends"] = int(build.get("appends", 0)) + 1
        build.setdefault("lineage", uuid.uuid4().hex)  # see Bank.extends
        _atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=1))  # the commit
        _fsync_dir(root)
        grown = Bank.open(root, expect_fingerprint=fingerprint)
        if sum(1 for c in grown.manifest["chunk_files"] if c["rows"] < COMPACT_ROWS) > MAX_SMALL_SHARDS:
            grown = _compact(grown)
        return AppendResult(grown, rows, skipped, per_item, time.perf_counter() - t0)


COMPACT_ROWS = 4096
"""Appended shards are merged into shards of up to this many rows (``compact``)."""
MAX_SMALL_SHARDS = 32
"""An append that leaves more appended shards smaller than ``COMPACT_ROWS`` compacts the bank: a
server adding one session per request would otherwise write two files per request, and every
open of the bank maps every shard."""
GRACE_S = 600.0
"""Files a compaction replaced are deleted by a later one once they are this old: a reader that
opened the bank before may still read them (its snapshot's chunk texts are read on first use)."""


def _next_index(manifest: dict[str, Any]) -> int:
    """A shard number no file of the manifest uses (after a compaction, numbers have gaps)."""
    used = [int(s["file"].removeprefix("shard-").split(".")[0]) for s in manifest["shards"]]
    return max(used, default=-1) + 1


def compact(root: str | Path, target_rows: int | None = None) -> Bank:
    """Merge runs of consecutive appended shards (and their chunk files) into shards of up to
    ``target_rows`` rows (default ``COMPACT_ROWS``). Rows keep their numbers, order and values, so
    search results, cached row ids and indexes stay valid; readers keep their snapshot. Files no
    manifest needs any more are deleted once ``GRACE_S`` old. Append calls this by itself
    (``MAX_SMALL_SHARDS``)."""
    root = Path(root)
    with _dir_lock(root):
        return _compact(Bank.open(root), target_rows)


def _compact(bank: Bank, target_rows: int | None = None) -> Bank:
    """``compact`` with the folder's lock held."""
    from safetensors import safe_open

    target_rows = target_rows or COMPACT_ROWS
    root, m = bank.root, bank.manifest
    appended = m.get("chunk_files", [])
    first = len(m["shards"]) - len(appended)  # shards before are a build's (texts in chunks.jsonl)
    runs: list[list[int]] = []
    for k in range(len(appended)):
        rows = m["shards"][first + k]["rows"]
        if rows >= target_rows:
            continue
        size = sum(m["shards"][first + j]["rows"] for j in runs[-1]) if runs else 0
        if runs and runs[-1][-1] == k - 1 and size + rows <= target_rows:
            runs[-1].append(k)
        else:
            runs.append([k])
    runs = [r for r in runs if len(r) > 1]
    manifest = json.loads(json.dumps(m))
    nxt = _next_index(m)
    replace: dict[int, tuple[dict, dict]] = {}  # first appended index of a run -> merged shard, chunk file
    for run in runs:
        parts: dict[str, list[torch.Tensor]] = {"keys": [], "cache": [], "cache_len": [], **({"kv": []} if bank.kv else {})}
        text = b""
        for k in run:
            with safe_open(str(root / m["shards"][first + k]["file"]), framework="pt") as f:
                for name in parts:
                    parts[name].append(f.get_tensor(name))
            text += (root / appended[k]["file"]).read_bytes()
        data = st_save({n: torch.cat(v) for n, v in parts.items()},
                       metadata={"plan_id": m.get("build", {}).get("plan_id") or "", "compacted": str(len(run))})
        rows = sum(appended[k]["rows"] for k in run)
        _atomic_write_bytes(root / shard_name(nxt), data)
        _atomic_write_bytes(root / chunk_file_name(nxt), text)
        replace[run[0]] = ({"file": shard_name(nxt), "rows": rows, "sha256": hashlib.sha256(data).hexdigest(),
                            "bytes": len(data)},
                           {"file": chunk_file_name(nxt), "rows": rows, "sha256": hashlib.sha256(text).hexdigest(),
                            "bytes": len(text)})
        nxt += 1
    if replace:
        merged = {k for run in runs for k in run}
        shards, chunk_files = manifest["shards"][:first], []
        for k in range(len(appended)):
            if k in replace:
                shards.append(replace[k][0])
                chunk_files.append(replace[k][1])
            elif k not in merged:
                shards.append(manifest["shards"][first + k])
                chunk_files.append(appended[k])
        manifest["shards"], manifest["chunk_files"] = shards, chunk_files
        build = manifest.setdefault("build", {})
        build["compactions"] = int(build.get("compactions", 0)) + 1
        _atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=1))
        _fsync_dir(root)
    _collect_garbage(root, manifest)
    return Bank.open(root, expect_fingerprint=bank.fingerprint) if replace else bank


def _collect_garbage(root: Path, manifest: dict[str, Any], grace_s: float | None = None) -> None:
    """Delete shard and chunk files the manifest does not name, once older than ``grace_s``
    (default ``GRACE_S``)."""
    grace_s = GRACE_S if grace_s is None else grace_s
    needed = {s["file"] for s in manifest["shards"]} | {c["file"] for c in manifest.get("chunk_files", [])}
    now = time.time()
    for p in root.iterdir():
        if (p.name.startswith("shard-") or p.name.startswith("chunks-")) and p.name not in needed and (
                ".tmp" not in p.name and now - p.stat().st_mtime > grace_s):
            p.unlink(missing_ok=True)


__all__ = ["AppendResult", "SessionAdd", "append_sessions", "chunk_file_name", "compact", "create_bank",
           "text_sha256"]
