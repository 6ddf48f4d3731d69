"""Persistence of one A-Mem memory in one folder, crash-safe.

Layout::

    manifest.json   {format_version, embedder, dim, build, vectors_op}
    notes.jsonl     journal: {"op": n, "note": {...}} records, then {"commit": n, "cost": {...}}, per add
    vectors.faiss   snapshot of the vector index (IndexIDMap2 over IndexFlatIP, id = note seq)

Each ``add`` appends the new note and every neighbour it changed, then a commit line (flushed
and fsync'ed): an add is on disk entirely or not at all. Loading replays the journal up to the
last commit and cuts off a torn or uncommitted tail, so a crash in the middle of ``add`` leaves
the memory as it was before that add. The vector index is snapshotted every ``save_every`` adds
and on ``save()`` (file written to a temp name, then ``os.replace``); notes changed after the
snapshot (``note.updated_op > manifest.vectors_op``) are re-embedded when the memory is loaded.
Re-embedding is deterministic, so a crash between writing the index and the manifest only costs
some recomputation. ``save()`` also compacts the journal to one record per note.

A commit line carries what its add cost (LLM calls, tokens, seconds) and the compacted journal's
one commit line the sum so far (``"stats"``), so a build resumed over several runs reports its
whole construction cost. Journals written before costs were kept have commits without them;
their notes count as built at an unrecorded cost.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from elasticmem.baselines.amem.notes import Note

FORMAT_VERSION = 1


class StoreError(RuntimeError):
    """The folder is not a usable A-Mem store (corrupt journal, other format, other encoder)."""


def _write_atomic(path: Path, data: bytes, fsync: bool = True) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


class VectorIndex:
    """Exact cosine top-k over unit vectors, keyed by note seq (faiss IndexIDMap2 + IndexFlatIP)."""

    def __init__(self, dim: int, index=None):
        import faiss

        self.dim = dim
        self.index = index if index is not None else faiss.IndexIDMap2(faiss.IndexFlatIP(dim))

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def ids(self) -> set[int]:
        import faiss

        return set(faiss.vector_to_array(self.index.id_map).tolist()) if len(self) else set()

    def upsert(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        """Add or replace the vectors of ``ids`` ([len(ids), dim] float32, unit rows)."""
        if not len(ids):
            return
        arr = np.asarray(ids, dtype=np.int64)
        present = self.ids()
        old = arr[[i in present for i in arr.tolist()]]
        if len(old):
            self.index.remove_ids(old)
        self.index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), arr)

    def remove(self, ids: Iterable[int]) -> None:
        arr = np.asarray(list(ids), dtype=np.int64)
        if len(arr):
            self.index.remove_ids(arr)

    def get(self, seq: int) -> np.ndarray:
        return self.index.reconstruct(int(seq))

    def search(self, queries: np.ndarray, k: int, exclude: set[int] | None = None) -> list[list[tuple[int, float]]]:
        """Per query, up to ``k`` (seq, cosine) pairs, best first, skipping ``exclude``."""
        if len(self) == 0 or k <= 0:
            return [[] for _ in range(len(queries))]
        extra = len(exclude) if exclude else 0
        kk = min(len(self), k + extra)
        scores, ids = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), kk)
        out = []
        for srow, irow in zip(scores, ids):
            hits = [(int(i), float(s)) for i, s in zip(irow, srow) if i != -1 and not (exclude and int(i) in exclude)]
            out.append(hits[:k])
        return out

    def save(self, path: Path, fsync: bool = True) -> None:
        import faiss

        _write_atomic(path, faiss.serialize_index(self.index).tobytes(), fsync)

    @classmethod
    def load(cls, path: Path, dim: int) -> VectorIndex:
        import faiss

        index = faiss.deserialize_index(np.fromfile(path, dtype=np.uint8))
        if index.d != dim:
            raise StoreError(f"{path}: vectors have dimension {index.d}, the manifest says {dim}")
        return cls(dim, index)


class NoteStore:
    """The files of one memory; ``AgenticMemory`` decides when to append and snapshot."""

    def __init__(self, path: str | os.PathLike, fsync: bool = True):
        self.path = Path(path)
        self.fsync = fsync

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def journal_path(self) -> Path:
        return self.path / "notes.jsonl"

    @property
    def vectors_path(self) -> Path:
        return self.path / "vectors.faiss"

    def exists(self) -> bool:
        return self.manifest_path.is_file()

    def create(self, embedder: str, dim: int, build: dict[str, Any]) -> dict[str, Any]:
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = {"format_version": FORMAT_VERSION, "embedder": embedder, "dim": dim, "build": build,
                    "vectors_op": 0}
        self.write_manifest(manifest)
        if not self.journal_path.exists():
            _write_atomic(self.journal_path, b"", self.fsync)
        return manifest

    def read_manifest(self) -> dict[str, Any]:
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StoreError(f"{self.manifest_path}: unreadable manifest ({e})") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise StoreError(f"{self.path}: store format {manifest.get('format_version')}, "
                             f"this code reads {FORMAT_VERSION}")
        return manifest

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        _write_atomic(self.manifest_path, json.dumps(manifest, indent=2).encode(), self.fsync)

    def append(self, op: int, notes: Sequence[Note], cost: dict[str, float] | None = None) -> None:
        """Journal one add: its notes, then the commit line (with the add's ``cost``) that makes
        them count."""
        records = "".join(json.dumps({"op": op, "note": n.to_json()}, ensure_ascii=False) + "\n" for n in notes)
        with open(self.journal_path, "a", encoding="utf-8") as f:
            f.write(records)
            f.flush()
            self._write_commit(f, op, cost)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def _write_commit(self, f, op: int, cost: dict[str, float] | None) -> None:
        # A separate method so that tests can fail here, i.e. crash between records and commit.
        f.write(json.dumps({"commit": op, **({"cost": cost} if cost else {})}) + "\n")

    def replay(self) -> tuple[dict[str, Note], int, dict[str, float]]:
        """Notes as of the last committed add, that add's number, and the committed adds' summed
        cost (the compacted ``"stats"`` plus each later commit's ``"cost"``; empty if none kept one).

        A torn last line or records without a commit (a crash during ``append``) are cut off the
        file, so later appends start on a clean line.
        """
        notes: dict[str, Note] = {}
        pending: list[Note] = []
        last_op = 0
        good_end = 0
        totals: dict[str, float] = {}
        if not self.journal_path.exists():
            return notes, 0, totals
        with open(self.journal_path, "rb") as f:
            data = f.read()
        pos = 0
        lines = data.split(b"\n")
        for lineno, raw in enumerate(lines, 1):
            end = pos + len(raw) + 1
            is_last = lineno == len(lines) or (lineno == len(lines) - 1 and lines[-1] == b"")
            if raw.strip():
                try:
                    rec = json.loads(raw)
                except json.JSONDecodeError:
                    if is_last or end >= len(data):
                        break  # torn final write
                    raise StoreError(f"{self.journal_path}:{lineno}: corrupt record in the middle of the journal")
                if "commit" in rec:
                    for n in pending:
                        notes[n.id] = n
                    pending = []
                    last_op = int(rec["commit"])
                    good_end = min(end, len(data))
                    if "stats" in rec:  # a compacted journal's sum so far
                        totals = {k: float(v) for k, v in rec["stats"].items()}
                    for k, v in (rec.get("cost") or {}).items():
                        totals[k] = totals.get(k, 0.0) + float(v)
                else:
                    pending.append(Note.from_json(rec["note"]))
            pos = end
        if good_end < len(data):
            with open(self.journal_path, "r+b") as f:
                f.truncate(good_end)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        elif data and not data.endswith(b"\n"):  # a commit torn just before its newline
            with open(self.journal_path, "ab") as f:
                f.write(b"\n")
        return notes, last_op, totals

    def load_vectors(self, dim: int) -> VectorIndex | None:
        if not self.vectors_path.is_file():
            return None
        try:
            return VectorIndex.load(self.vectors_path, dim)
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 - faiss raises RuntimeError or worse on a damaged file
            # An unreadable snapshot is no loss: every vector is re-embedded from its note.
            import logging

            logging.getLogger(__name__).warning("%s unreadable (%s); re-embedding the notes", self.vectors_path, e)
            return None

    def snapshot(self, notes: Iterable[Note], index: VectorIndex, op: int, manifest: dict[str, Any],
                 stats: dict[str, float] | None = None) -> None:
        """Vectors, then the manifest saying which add they include, then the compacted journal
        (its commit line carries ``stats``, the summed cost of the adds so far)."""
        index.save(self.vectors_path, self.fsync)
        manifest["vectors_op"] = op
        self.write_manifest(manifest)
        body = "".join(json.dumps({"op": op, "note": n.to_json()}, ensure_ascii=False) + "\n" for n in notes)
        body += json.dumps({"commit": op, **({"stats": stats} if stats else {})}) + "\n"
        _write_atomic(self.journal_path, body.encode("utf-8"), self.fsync)
