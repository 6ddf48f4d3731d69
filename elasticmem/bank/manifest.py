"""A bank's on-disk format: the manifest's fields and versions, and the journal of records that changes it.

``elasticmem.bank.store`` replays a manifest and its journal into a ``Bank``; ``elasticmem.bank.append`` and
``elasticmem.bank.forget`` write the records. Each record is one line, checksummed
(``journal_line``), and ``apply_record`` is the one definition of what it does to a manifest, so every
reader and writer agrees on it. The commit protocol around it is described in ``elasticmem.bank.store``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Iterable

FORMAT_VERSION = 1
"""Written by a build. A bank that has been appended to is written as ``APPEND_FORMAT_VERSION``."""
APPEND_FORMAT_VERSION = 2
"""Groups may hold several row segments and chunk texts several files (``elasticmem.bank.append``); readers
of format 1 refuse such a bank with a clear message instead of misreading it."""
KV_FORMAT_VERSION = 3
"""Shards without the hidden-state cache (manifest ``hidden_cache: false``) or with per-layer KV in the
ragged layout (``kv.layout``, ``elasticmem.bank.kv_store``), maybe as integer codes; appended to or not.
Readers of formats 1 and 2 refuse such a bank instead of misreading its shards."""
READABLE_VERSIONS = (FORMAT_VERSION, APPEND_FORMAT_VERSION, KV_FORMAT_VERSION)
MANIFEST = "manifest.json"
CHUNKS = "chunks.jsonl"
GROUPS_SHA256 = "groups_sha256"
"""Manifest field: {group: ``builder.chunks_fingerprint`` of its chunk texts in row order}."""


class BankError(RuntimeError):
    """A bank folder is missing, incomplete, corrupted or built for another encoder."""


# ---------------------------------------------------------------------- journal


def journal_line(record: dict[str, Any]) -> bytes:
    """One journal record as the line an appender writes (checksummed, newline-terminated)."""
    body = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(body).hexdigest()[:16].encode() + b" " + body + b"\n"


def read_journal(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int, bool]:
    """The whole records of the journal ``path`` from byte ``offset`` on: (records, the offset
    after the last one, whether a ``seal`` record ends them; the seal is not returned). A missing
    journal reads as sealed (a compaction replaced it and its grace time passed)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset, True
    records, pos = [], 0
    while True:
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        line = data[pos:nl]
        digest, _, body = line.partition(b" ")
        if hashlib.sha256(body).hexdigest()[:16].encode() != digest:
            break  # torn by a crash (or still being written): not committed
        rec = json.loads(body)
        if rec.get("op") == "seal":
            return records, offset + pos, True
        records.append(rec)
        pos = nl + 1
    return records, offset + pos, False


def merge_segments(*parts: Iterable[Sequence[int]]) -> list[list[int]]:
    """The union of ``[start, end)`` row segments, sorted and coalesced."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for part in parts for a, b in part):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif a < b:
            out.append([a, b])
    return out


def rows_to_segments(rows: Iterable[int]) -> list[list[int]]:
    """Sorted row numbers as coalesced ``[start, end)`` segments."""
    return merge_segments([(r, r + 1) for r in rows])


def parse_segments(value: Any) -> tuple[tuple[int, int], ...]:
    """A manifest ``groups`` entry: ``[start, end]`` (a built bank) or ``[[start, end], ...]``."""
    if len(value) and isinstance(value[0], (list, tuple)):
        return tuple((int(a), int(b)) for a, b in value)
    a, b = value
    return ((int(a), int(b)),)


def _apply_delete(manifest: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    """A ``delete`` record: ``rows`` (segments) leave the groups, whose new segments (none: the
    group is gone) and ``groups_sha256`` the record carries."""
    m = dict(manifest)
    m["format_version"] = max(int(m["format_version"]), APPEND_FORMAT_VERSION)
    groups = m["groups"] = dict(m["groups"])
    sha = m[GROUPS_SHA256] = dict(m.get(GROUPS_SHA256, {}))
    for g, segs in rec["groups"].items():
        if segs:
            groups[g] = [list(x) for x in segs]
            sha[g] = rec[GROUPS_SHA256][g]
        else:
            groups.pop(g, None)
            sha.pop(g, None)
    m["deleted"] = merge_segments(m.get("deleted", []), rec["rows"])
    m["unpurged"] = merge_segments(m.get("unpurged", []), rec["rows"])
    build = m["build"] = dict(m.get("build", {}))
    build["deletes"] = int(build.get("deletes", 0)) + 1
    return m


def apply_record(manifest: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    """The manifest after one journal record. ``manifest`` is not changed: containers that change
    are copied (one level), the others shared, so snapshots share what they have in common."""
    if rec.get("op") == "delete":
        return _apply_delete(manifest, rec)
    if rec.get("op") != "append":
        raise BankError(f"unknown journal record {rec.get('op')!r}: written by a newer elasticmem?")
    m = dict(manifest)
    m["format_version"] = max(int(m["format_version"]), APPEND_FORMAT_VERSION)
    m["num_chunks"] = int(rec["num_chunks"])
    m["shards"] = [*m["shards"], rec["shard"]]
    m["chunk_files"] = [*m.get("chunk_files", []), rec["chunk_file"]]
    groups = m["groups"] = dict(m["groups"])
    for g, (a, b) in rec["groups"].items():
        segs = [list(x) for x in parse_segments(groups[g])] if g in groups else []
        if segs and segs[-1][1] == a:
            segs[-1] = [segs[-1][0], b]
        else:
            segs.append([a, b])
        groups[g] = segs
    m[GROUPS_SHA256] = {**m.get(GROUPS_SHA256, {}), **rec[GROUPS_SHA256]}
    build = m["build"] = dict(m.get("build", {}))
    build["appends"] = int(build.get("appends", 0)) + 1
    build.setdefault("lineage", rec["lineage"])
    return m


def forgotten_record(row: int) -> dict[str, Any]:
    """What stands for a deleted row in the chunk records and files (its number is kept)."""
    return {"row": int(row), "group": None, "text": "", "n_tokens": 0, "session": -1, "turns": [], "deleted": True}
