"""Cosine top-k over bank keys, optionally restricted to one group per query.

Keys are L2-normalised, so cosine is the inner product; queries are
normalised here. A search restricted to a group (training and evaluation
restrict every query to its group) is exact for every index type: a matrix
product of the queries with the group's keys, on ``index.device`` (the model's
device when the caller sets it; ``cuda:gpu_device`` with ``bank.index.gpu``;
else the CPU). A group occupies one contiguous row range (more after appends);
only its rows travel to the device, block by block, at each call: no device
holds the bank's keys for restricted search. Unrestricted search (and a group
that is the whole bank) goes to the index named by ``bank.index.type``: exact
``torch`` (the same matrix product over every row) or FAISS ``flat``, or, for
large shared banks, FAISS ``ivf`` (IVFFlat, inner product) or ``hnsw``
(HNSWFlat, inner product). ``flat`` and ``ivf`` can search on a GPU
(``index.gpu``, faiss-gpu), whose copy of the index is made at the first
unrestricted search (never, when every query is restricted).

Exact results are ordered by descending score, equal scores by ascending row
(also at the k-th place: a tie across it keeps its lowest rows), as FAISS does
not promise (it orders exact ties, e.g. of repeated chunks, differently with k).

A bank that grew (``elasticmem.bank.append``) or lost rows (``elasticmem.bank.forget``) is
searched through ``refresh(bank)``: the new rows are added to the index (FAISS adds them to the
trained IVF lists or the HNSW graph) and the deleted ones removed (``remove_ids`` on the id map
over the flat index and on the IVF lists; an HNSW graph is rebuilt from the live keys), so the
FAISS index holds exactly the bank's live rows, its ids being bank rows. A saved IVF/HNSW index is
brought up to the bank the same way when loaded, unless the bank has more than doubled since it
was trained (IVF centroids trained on half the data place the rest badly) or an HNSW graph lost
rows, when it is stale and rebuilt; it is never saved from a snapshot older than the bank's last
delete (it would bring the forgotten keys back to disk after the purge).

When a group has fewer than k rows the missing places hold row -1 and
score -inf (callers use what exists). Deleted rows are in no group and never returned.
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple, Protocol, Sequence

import numpy as np
import torch

from elasticmem.bank.builder import _dir_lock
from elasticmem.bank.follow import clip_segments, rows_change, segment_rows, snapshot_change
from elasticmem.bank.store import Bank
from elasticmem.config import IndexConfig


class SearchResult(NamedTuple):
    scores: torch.Tensor
    """[Q, k] float32 cosine scores, descending; -inf where a group had fewer than k rows."""
    rows: torch.Tensor
    """[Q, k] int64 global bank rows; -1 where a group had fewer than k rows."""


class KeyIndex(Protocol):
    def search(self, queries: torch.Tensor, k: int, groups: Sequence[str] | None = None) -> SearchResult:
        """Top-``k`` rows for each query [Q, d]; ``groups[q]`` restricts query q to one group."""
        ...

    def refresh(self, bank: Bank) -> "KeyIndex":
        """This index over ``bank``: a newer snapshot of the same bank (``Bank.refresh``) gets the
        appended rows added; another bank is indexed anew with the same settings."""
        ...


def _normalise(q: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(q.detach().float().cpu(), dim=-1)


def _by_group(groups: Sequence[str] | None, n: int) -> dict[str | None, list[int]]:
    """Query indices per group (None = whole bank), keeping order of first appearance."""
    if groups is None:
        return {None: list(range(n))}
    if len(groups) != n:
        raise ValueError(f"got {n} queries but {len(groups)} groups")
    out: dict[str | None, list[int]] = {}
    for i, g in enumerate(groups):
        out.setdefault(g, []).append(i)
    return out


def _empty(n: int, k: int) -> SearchResult:
    return SearchResult(torch.full((n, k), float("-inf")), torch.full((n, k), -1, dtype=torch.long))


BLOCK_BYTES = 256 << 20
"""Keys one step of an exact search multiplies at once (float32 bytes; twice that on CUDA, in
float64): the most of them on the device at a time. A group's rows are moved to the device at
each call rather than cached there: a group of 1000 rows of d=3584 is 14 MB, milliseconds over
PCIe next to a forward pass of the model, the keys are read from the memory-mapped shards
either way, and nothing goes stale when the bank grows."""


def _top(s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` scores [Q, k] and their columns of ``s`` [Q, n] (k <= n): by descending score,
    equal scores by ascending column (also at the cut: the lowest columns of a tie are kept).
    NaN scores rank below every number (their score reads -inf)."""
    nan = s.isnan()
    if nan.any():
        s = s.masked_fill(nan, float("-inf"))
    vals, cols = torch.topk(s, k, dim=1)
    v = vals[:, -1:]
    cut = ((s == v).sum(1) > (vals == v).sum(1)).nonzero().squeeze(1)  # ties across the cut
    if cut.numel():  # keep the lowest columns of the tie: those above it, then the first tied ones
        sc, vc = s[cut], v[cut]
        above, tied = sc > vc, sc == vc
        need = k - above.sum(1, keepdim=True)
        keep = above | (tied & (tied.cumsum(1, dtype=torch.int32) <= need))
        cols[cut] = keep.nonzero()[:, 1].view(-1, k)  # row-major: each row's columns ascending
    cols = cols.sort(dim=1).values
    vals, order = s.gather(1, cols).sort(dim=1, descending=True, stable=True)
    return vals, cols.gather(1, order)


def _blocks(segs: Sequence[tuple[int, int]], rows: int):
    """The row ranges of ``segs`` (in row order) in blocks of at most ``rows`` rows."""
    block, n = [], 0
    for a, b in segs:
        while a < b:
            m = min(b - a, rows - n)
            block.append((a, a + m))
            a, n = a + m, n + m
            if n == rows:
                yield block
                block, n = [], 0
    if block:
        yield block


def exact_search(q: torch.Tensor, k: int, segs: Sequence[tuple[int, int]], keys_of,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor] | None:
    """Exact top-``min(k, rows)`` (scores, global rows), both [Q, min(k, rows)] on the CPU, of the
    normalised queries ``q`` [Q, d] over the rows ``segs`` (``[start, end)`` ranges in row order)
    whose keys ``keys_of(start, end)`` gives; None when ``segs`` holds no row. The product runs on
    ``device``, a block of rows (``BLOCK_BYTES``) at a time; on CUDA in float64, so that neither an
    enclosing autocast nor TF32 matmuls change the ranking (float32 elsewhere)."""
    device = torch.device(device)
    kk = min(k, sum(b - a for a, b in segs))
    if kk == 0:
        return None
    dtype = torch.float64 if device.type == "cuda" else torch.float32
    qd = q.to(device, dtype)
    per_block = max(1, BLOCK_BYTES // (4 * q.shape[1]))
    scores, rows = [], []
    with torch.autocast(device.type, enabled=False):
        for block in _blocks(segs, per_block):
            keys = torch.cat([keys_of(a, b) for a, b in block]) if len(block) > 1 else keys_of(*block[0])
            s, c = _top((qd @ keys.to(device, dtype).T).float(), min(kk, keys.shape[0]))
            ids = torch.cat([torch.arange(a, b) for a, b in block]).to(device)
            scores.append(s)
            rows.append(ids[c])
    s, r = torch.cat(scores, 1), torch.cat(rows, 1)
    if len(scores) > 1:  # merge the blocks' candidates: equal scores already stand in row order
        s, c = _top(s, kk)  # (blocks in row order, and ties by row inside each)
        r = r.gather(1, c)
    return s.cpu(), r.cpu()


def _fill(res: SearchResult, idx: list[int], found) -> None:
    if found is not None:
        t, (s, r) = torch.as_tensor(idx), found
        res.scores[t, : s.shape[1]] = s
        res.rows[t, : r.shape[1]] = r


class TorchIndex:
    """Exact search by matrix product over the bank's memory-mapped keys, or over other
    per-row vectors ``keys`` [rows, d'] (e.g. sentence embeddings of the chunk texts), on
    ``device`` (an attribute the caller may set: the model's device)."""

    def __init__(self, bank: Bank, keys: torch.Tensor | None = None, device: torch.device | str = "cpu"):
        if keys is not None and keys.shape[0] != bank.num_chunks:
            raise ValueError(f"got {keys.shape[0]} key rows for a bank of {bank.num_chunks}")
        self.bank = bank
        self._keys = keys
        self.device = torch.device(device)

    def refresh(self, bank: Bank) -> "TorchIndex":
        if self._keys is not None:
            raise ValueError("a TorchIndex over given vectors cannot follow a growing bank; build it anew")
        # it reads the bank's keys: nothing to add
        return self if bank is self.bank else TorchIndex(bank, device=self.device)

    def _keys_of(self, start: int, end: int) -> torch.Tensor:
        return self.bank.keys(start, end) if self._keys is None else self._keys[start:end]

    def search(self, queries: torch.Tensor, k: int, groups: Sequence[str] | None = None) -> SearchResult:
        q = _normalise(queries)
        res = _empty(q.shape[0], k)
        for g, idx in _by_group(groups, q.shape[0]).items():
            # unrestricted: every row but the deleted ones (elasticmem.bank.forget)
            segs = self.bank.live_segments() if g is None else self.bank.group_segments(g)
            _fill(res, idx, exact_search(q[idx], k, segs, self._keys_of, self.device))
        return res


def _live_keys(bank: Bank, segs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``segs`` (FAISS ids, int64 [n]) and their keys ([n, d] float32, contiguous)."""
    ids = segment_rows(segs)
    if not len(ids):
        return ids, np.zeros((0, bank.hidden_size), dtype=np.float32)
    keys = torch.cat([bank.keys(a, b) for a, b in segs]) if len(segs) > 1 else bank.keys(*segs[0])
    return ids, np.ascontiguousarray(keys.numpy(), dtype=np.float32)


class FaissIndex:
    """FAISS flat (exact), IVF or HNSW over all keys for unrestricted search; a search restricted
    to a group is the exact matrix product over the group's keys on ``device`` (an attribute the
    caller may set: the model's device; None = ``cuda:gpu_device`` with ``cfg.gpu``, else the CPU)."""

    def __init__(self, bank: Bank, cfg: IndexConfig, seed: int = 0, gpu_device: int = 0,
                 device: torch.device | str | None = None):
        import faiss

        self.faiss, self.bank, self.cfg = faiss, bank, cfg
        self.seed, self.gpu_device = seed, gpu_device
        if device is None:
            device = f"cuda:{gpu_device}" if cfg.gpu else "cpu"
        self.device = torch.device(device)
        if cfg.gpu:  # refused before any build
            if cfg.type == "hnsw":
                raise ValueError("bank.index.gpu: faiss-gpu has no HNSW index; use type 'flat' or 'ivf'")
            if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
                raise ValueError("bank.index.gpu needs faiss-gpu and a CUDA GPU (pip uninstall -y faiss-cpu && "
                                 "pip install 'elasticmem[gpu]'); this faiss sees no GPU")
        self.index = self._load_or_build()
        self.gpu_index = None  # with cfg.gpu: made by the first unrestricted search (_gpu)

    def _gpu(self):
        if self.gpu_index is None:
            self.gpu_index = self._to_gpu(self.gpu_device)
        return self.gpu_index

    def _to_gpu(self, device: int):
        faiss = self.faiss
        self._gpu_resources = faiss.StandardGpuResources()  # must outlive the GPU index
        index = faiss.index_cpu_to_gpu(self._gpu_resources, device, self.index)
        if self.cfg.type == "ivf":
            faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", self.cfg.nprobe)
        return index

    def refresh(self, bank: Bank) -> "FaissIndex":
        """This index over ``bank``, a newer snapshot of its bank, in place: the rows appended since
        are added and the rows deleted since are removed (``follow.snapshot_change``), so that the
        index holds exactly the bank's live rows; another bank (or an older snapshot) gets a new
        index."""
        if bank is self.bank:
            return self
        change = snapshot_change(self.bank, bank)
        if change is None:
            return FaissIndex(bank, self.cfg, self.seed, self.gpu_device, self.device)
        if change.removed:
            self.index = self._without(self.index, change.removed, bank, self.bank.num_chunks)
            self.gpu_index = None  # its copy holds them too: made again from self.index when next searched
        ids, keys = _live_keys(bank, change.added)
        if len(ids):
            self.index.add_with_ids(keys, ids)
            if self.gpu_index is not None:  # one not made yet is copied from self.index, these rows included
                self.gpu_index.add_with_ids(keys, ids)
        self.bank = bank
        return self

    def _without(self, index, removed: Sequence[tuple[int, int]], bank: Bank, rows: int):
        """``index`` (of the first ``rows`` rows) without the rows ``removed``: taken out in place where
        FAISS can (the id map over a flat index, IVF lists: ``remove_ids``, which also drops their
        bytes from a later ``write_index``); an HNSW graph cannot lose nodes, so it is rebuilt from
        the live keys of ``bank``'s first ``rows`` rows."""
        if self.cfg.type == "hnsw":
            ids, keys = _live_keys(bank, clip_segments(bank.live_segments(), 0, rows))
            fresh = self._empty_index(keys.shape[1], keys)
            fresh.add_with_ids(keys, ids)
            return fresh
        index.remove_ids(self.faiss.IDSelectorBatch(segment_rows(removed)))
        return index

    def _describe(self, nlist: int | None = None) -> dict:
        c = self.cfg
        params = {"flat": {}, "ivf": {"nlist": nlist or self._nlist()},
                  "hnsw": {"m": c.hnsw_m, "ef_construction": c.ef_construction}}
        # "ids": FAISS ids are bank rows (an older file counted positions, which deletes would shift)
        return {"type": c.type, **params[c.type], "ids": "rows", "num_chunks": self.bank.num_chunks,
                "deleted": [list(s) for s in self.bank.deleted],
                "plan_id": self.bank.manifest.get("build", {}).get("plan_id")}

    def _nlist(self) -> int:
        return self.cfg.nlist or max(1, int(4 * math.sqrt(self.bank.num_chunks)))

    def _load_saved(self, path, meta):
        """The saved index when it was built for this bank and settings, brought up to it (rows
        appended since added, rows deleted since removed) and saved again; None when it is stale
        (another bank or settings, the bank more than doubled since it was trained, or an HNSW graph
        that lost rows) and must be rebuilt."""
        saved = json.loads(meta.read_text())
        nlist = saved.get("nlist")
        if self.cfg.type == "ivf" and self.cfg.nlist not in (0, nlist):
            return None
        n, gone = saved.get("num_chunks", -1), [tuple(s) for s in saved.get("deleted", [])]
        varies = {"num_chunks": 0, "deleted": []}  # what a saved index is brought up to, below
        if {**saved, **varies} != {**self._describe(nlist), **varies}:
            return None
        if n != self.bank.num_chunks and not 0 < n < self.bank.num_chunks <= 2 * n:
            return None
        change = rows_change(n, gone, self.bank.num_chunks, self.bank.deleted)
        if change is None or (change.removed and self.cfg.type == "hnsw"):
            return None
        index = self.faiss.read_index(str(path))
        if index.ntotal != n - sum(b - a for a, b in clip_segments(gone, 0, n)):
            return None
        if change.removed:
            index = self._without(index, change.removed, self.bank, n)
        ids, keys = _live_keys(self.bank, change.added)
        if len(ids):
            index.add_with_ids(keys, ids)
        if change.removed or len(ids):
            self._save(index, path, meta, nlist)
        return index

    def _save(self, index, path, meta, nlist: int | None = None) -> None:
        """Write ``index`` to ``path`` (and its description to ``meta``) unless rows were deleted from
        the bank since this snapshot: the index would hold them again, after the compaction that
        purged the bank's files (and removed the saved index) has run. The check and the renames
        hold the bank folder's lock, which deletes and compactions take."""
        # per-process temporary names: two readers extending the same saved index do not collide
        tmp = path.with_name(f"index.faiss.tmp{os.getpid()}")
        tmp_meta = meta.with_name(f"index.json.tmp{os.getpid()}")
        self.faiss.write_index(index, str(tmp))
        tmp_meta.write_text(json.dumps(self._describe(nlist)))
        with _dir_lock(self.bank.root):
            if self.bank.refresh().deleted != self.bank.deleted:
                tmp.unlink()
                tmp_meta.unlink()
                return
            tmp.replace(path)
            tmp_meta.replace(meta)

    def _empty_index(self, d: int, keys: np.ndarray):
        """An empty index of ``cfg.type`` whose ids are bank rows (an IVF one trained on ``keys``)."""
        faiss, cfg = self.faiss, self.cfg
        if cfg.type == "flat":
            return faiss.IndexIDMap(faiss.IndexFlatIP(d))
        if cfg.type == "ivf":
            nlist = min(self._nlist(), keys.shape[0])
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
            sample = keys
            if keys.shape[0] > cfg.train_size:
                sample = keys[np.random.default_rng(self.seed).choice(keys.shape[0], cfg.train_size, replace=False)]
            index.train(sample)
            return index  # IVF lists keep ids themselves
        if cfg.type == "hnsw":
            graph = faiss.IndexHNSWFlat(d, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            graph.hnsw.efConstruction = cfg.ef_construction
            return faiss.IndexIDMap(graph)
        raise ValueError(f"unknown index type {cfg.type!r}")

    def _load_or_build(self):
        cfg = self.cfg
        path, meta = self.bank.root / "index.faiss", self.bank.root / "index.json"
        if cfg.type != "flat" and cfg.save and path.is_file() and meta.is_file():
            index = self._load_saved(path, meta)
            if index is not None:
                return index
        ids, keys = _live_keys(self.bank, self.bank.live_segments())
        if cfg.type != "flat" and not len(ids):
            raise ValueError(f"bank.index.type={cfg.type} needs keys to train on; bank {self.bank.root} holds no "
                             f"memory (use 'flat' or 'torch' until it holds memories)")
        index = self._empty_index(self.bank.hidden_size, keys)
        index.add_with_ids(keys, ids)
        if cfg.type != "flat" and cfg.save:
            self._save(index, path, meta)
        return index

    def _params(self):
        faiss, cfg = self.faiss, self.cfg
        if cfg.type == "ivf":
            return faiss.SearchParametersIVF(nprobe=cfg.nprobe)
        if cfg.type == "hnsw":
            return faiss.SearchParametersHNSW(efSearch=cfg.ef_search)
        return None

    def search(self, queries: torch.Tensor, k: int, groups: Sequence[str] | None = None) -> SearchResult:
        q = _normalise(queries)
        res = _empty(q.shape[0], k)
        for g, idx in _by_group(groups, q.shape[0]).items():
            segs = None if g is None else self.bank.group_segments(g)
            if segs is not None and segs != ((0, self.bank.num_chunks),):
                _fill(res, idx, exact_search(q[idx], k, segs, self.bank.keys, self.device))
                continue
            if self.cfg.gpu:
                D, I = self._gpu().search(q[idx].numpy(), k)
            else:
                D, I = self.index.search(q[idx].numpy(), k, params=self._params())
            t = torch.as_tensor(idx)
            rows = torch.from_numpy(I).long()  # the index holds live rows only (refresh removes deleted ones)
            scores = torch.from_numpy(D).float()
            scores[rows < 0] = float("-inf")
            res.scores[t], res.rows[t] = scores, rows
        return res


def build_index(bank: Bank, cfg: IndexConfig, seed: int = 0, gpu_device: int = 0,
                device: torch.device | str | None = None) -> KeyIndex:
    """The index named by ``cfg.type`` over ``bank`` (``gpu_device``: the GPU of ``cfg.gpu``).
    ``device``: where exact searches (restricted to a group; every search of 'torch') multiply,
    best the model's device; None = ``cuda:gpu_device`` with ``cfg.gpu``, else the CPU."""
    if cfg.type == "torch":
        if cfg.gpu:
            raise ValueError("bank.index.gpu applies to FAISS indexes ('flat', 'ivf'), not 'torch'")
        return TorchIndex(bank, device="cpu" if device is None else device)
    return FaissIndex(bank, cfg, seed, gpu_device, device)
