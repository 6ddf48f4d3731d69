"""Cosine top-k over bank keys, optionally restricted to one group per query.

Keys are L2-normalised, so cosine is the inner product; queries are
normalised here. Exact search: ``torch`` (matmul + topk) or FAISS ``flat``.
Approximate search for large shared banks: FAISS ``ivf`` (IVFFlat, inner
product) or ``hnsw`` (HNSWFlat, inner product). ``flat`` and ``ivf`` can search on
a GPU (``index.gpu``, faiss-gpu). A group occupies one contiguous row range
(more after appends), so exact restricted search is a slice of the keys and
approximate restricted search an ``IDSelectorRange`` filter (``IDSelectorBatch``
over the group's rows once it has several ranges).

A bank that grew (``elasticmem.bank.append``) is searched through ``refresh(bank)``: the new
rows are added to the index (FAISS adds them to the trained IVF lists or the HNSW
graph). A saved IVF/HNSW index of fewer rows than the bank is extended the same
way when loaded, unless the bank has more than doubled since it was trained, when
it is stale and rebuilt (IVF centroids trained on half the data place the rest badly).

When a group has fewer than k rows the missing places hold row -1 and
score -inf (callers use what exists).
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple, Protocol, Sequence

import numpy as np
import torch

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


class TorchIndex:
    """Exact search by matrix product over the bank's memory-mapped keys, or over other
    per-row vectors ``keys`` [rows, d'] (e.g. sentence embeddings of the chunk texts)."""

    def __init__(self, bank: Bank, keys: torch.Tensor | None = None):
        if keys is not None and keys.shape[0] != bank.num_chunks:
            raise ValueError(f"got {keys.shape[0]} key rows for a bank of {bank.num_chunks}")
        self.bank = bank
        self._keys = keys

    def refresh(self, bank: Bank) -> "TorchIndex":
        if self._keys is not None:
            raise ValueError("a TorchIndex over given vectors cannot follow a growing bank; build it anew")
        return self if bank is self.bank else TorchIndex(bank)  # it reads the bank's keys: nothing to add

    def _keys_of(self, start: int, end: int) -> torch.Tensor:
        return self.bank.keys(start, end) if self._keys is None else self._keys[start:end]

    def search(self, queries: torch.Tensor, k: int, groups: Sequence[str] | None = None) -> SearchResult:
        q = _normalise(queries)
        res = _empty(q.shape[0], k)
        for g, idx in _by_group(groups, q.shape[0]).items():
            segs = ((0, self.bank.num_chunks),) if g is None else self.bank.group_segments(g)
            if len(segs) == 1:
                (start, end), ids = segs[0], None
                keys = self._keys_of(start, end)
            else:
                keys = torch.cat([self._keys_of(a, b) for a, b in segs])
                ids = torch.cat([torch.arange(a, b) for a, b in segs])
            kk = min(k, keys.shape[0])
            if kk == 0:
                continue
            s, r = torch.topk(q[idx] @ keys.T, kk, dim=-1)
            t = torch.as_tensor(idx)
            res.scores[t, :kk] = s
            res.rows[t, :kk] = r + segs[0][0] if ids is None else ids[r]
        return res


class FaissIndex:
    """FAISS flat (exact), IVF or HNSW over all keys; groups via an ID-range selector."""

    def __init__(self, bank: Bank, cfg: IndexConfig, seed: int = 0, gpu_device: int = 0):
        import faiss

        self.faiss, self.bank, self.cfg = faiss, bank, cfg
        self.seed, self.gpu_device = seed, gpu_device
        if cfg.gpu:  # refused before any build
            if cfg.type == "hnsw":
                raise ValueError("bank.index.gpu: faiss-gpu has no HNSW index; use type 'flat' or 'ivf'")
            if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
                raise ValueError("bank.index.gpu needs faiss-gpu and a CUDA GPU (pip uninstall -y faiss-cpu && "
                                 "pip install 'elasticmem[gpu]'); this faiss sees no GPU")
        self.index = self._load_or_build(seed)
        self.gpu_index = self._to_gpu(gpu_device) if cfg.gpu else None

    def _to_gpu(self, device: int):
        faiss = self.faiss
        self._gpu_resources = faiss.StandardGpuResources()  # must outlive the GPU index
        index = faiss.index_cpu_to_gpu(self._gpu_resources, device, self.index)
        if self.cfg.type == "ivf":
            faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", self.cfg.nprobe)
        return index

    def refresh(self, bank: Bank) -> "FaissIndex":
        """Add the rows ``bank`` has beyond this index's to it (in place) and search ``bank`` from now
        on (rows are only ever appended: those indexed are unchanged); a bank that is not this one
        grown gets a new index."""
        if bank is self.bank:
            return self
        if not bank.extends(self.bank):
            return FaissIndex(bank, self.cfg, self.seed, self.gpu_device)
        tail = np.ascontiguousarray(bank.keys(self.index.ntotal, bank.num_chunks).numpy(), dtype=np.float32)
        if len(tail):
            self.index.add(tail)
            if self.gpu_index is not None:
                self.gpu_index.add(tail)
        self.bank = bank
        return self

    def _describe(self, nlist: int | None = None) -> dict:
        c = self.cfg
        params = {"flat": {}, "ivf": {"nlist": nlist or self._nlist()},
                  "hnsw": {"m": c.hnsw_m, "ef_construction": c.ef_construction}}
        return {"type": c.type, **params[c.type], "num_chunks": self.bank.num_chunks,
                "plan_id": self.bank.manifest.get("build", {}).get("plan_id")}

    def _nlist(self) -> int:
        return self.cfg.nlist or max(1, int(4 * math.sqrt(self.bank.num_chunks)))

    def _load_saved(self, path, meta):
        """The saved index when it was built for this bank and settings, extended by the rows
        appended since it was saved; None when it is stale (another bank or settings, or the bank
        more than doubled since it was trained) and must be rebuilt."""
        saved = json.loads(meta.read_text())
        nlist = saved.get("nlist")
        if self.cfg.type == "ivf" and self.cfg.nlist not in (0, nlist):
            return None
        n = saved.get("num_chunks", -1)
        if {**saved, "num_chunks": 0} != {**self._describe(nlist), "num_chunks": 0}:
            return None
        if n != self.bank.num_chunks and not 0 < n < self.bank.num_chunks <= 2 * n:
            return None
        index = self.faiss.read_index(str(path))
        if index.ntotal != n:
            return None
        if n < self.bank.num_chunks:
            index.add(np.ascontiguousarray(self.bank.keys(n, self.bank.num_chunks).numpy(), dtype=np.float32))
            self._save(index, path, meta, nlist)
        return index

    def _save(self, index, path, meta, nlist: int | None = None) -> None:
        # per-process temporary names: two readers extending the same saved index do not collide
        tmp = path.with_name(f"index.faiss.tmp{os.getpid()}")
        self.faiss.write_index(index, str(tmp))
        tmp.replace(path)
        tmp_meta = meta.with_name(f"index.json.tmp{os.getpid()}")
        tmp_meta.write_text(json.dumps(self._describe(nlist)))
        tmp_meta.replace(meta)

    def _load_or_build(self, seed: int):
        faiss, cfg = self.faiss, self.cfg
        path, meta = self.bank.root / "index.faiss", self.bank.root / "index.json"
        if cfg.type != "flat" and cfg.save and path.is_file() and meta.is_file():
            index = self._load_saved(path, meta)
            if index is not None:
                return index
        if cfg.type != "flat" and self.bank.num_chunks == 0:
            raise ValueError(f"bank.index.type={cfg.type} needs keys to train on; bank {self.bank.root} is empty "
                             f"(use 'flat' or 'torch' until it holds memories)")
        keys = np.ascontiguousarray(self.bank.keys().numpy(), dtype=np.float32)
        d = keys.shape[1]
        if cfg.type == "flat":
            index = faiss.IndexFlatIP(d)
        elif cfg.type == "ivf":
            nlist = min(self._nlist(), keys.shape[0])
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
            rng = np.random.default_rng(seed)
            sample = keys if keys.shape[0] <= cfg.train_size else keys[rng.choice(keys.shape[0], cfg.train_size, replace=False)]
            index.train(sample)
        elif cfg.type == "hnsw":
            index = faiss.IndexHNSWFlat(d, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = cfg.ef_construction
        else:
            raise ValueError(f"unknown index type {cfg.type!r}")
        index.add(keys)
        if cfg.type != "flat" and cfg.save:
            self._save(index, path, meta)
        return index

    def _params(self, sel):
        faiss, cfg = self.faiss, self.cfg
        if cfg.type == "ivf":
            return faiss.SearchParametersIVF(sel=sel, nprobe=cfg.nprobe)
        if cfg.type == "hnsw":
            return faiss.SearchParametersHNSW(sel=sel, efSearch=cfg.ef_search)
        return faiss.SearchParameters(sel=sel) if sel is not None else None

    def search(self, queries: torch.Tensor, k: int, groups: Sequence[str] | None = None) -> SearchResult:
        q = _normalise(queries).numpy()
        res = _empty(q.shape[0], k)
        for g, idx in _by_group(groups, q.shape[0]).items():
            sel = None
            if g is not None:
                segs = self.bank.group_segments(g)
                if len(segs) > 1:
                    sel = self.faiss.IDSelectorBatch(self.bank.group_row_ids(g).numpy())
                elif segs[0] != (0, self.bank.num_chunks):
                    sel = self.faiss.IDSelectorRange(*segs[0])
            if sel is None and self.gpu_index is not None:
                D, I = self.gpu_index.search(q[idx], k)
            else:
                D, I = self.index.search(q[idx], k, params=self._params(sel))
            t = torch.as_tensor(idx)
            rows = torch.from_numpy(I).long()
            scores = torch.from_numpy(D).float()
            scores[rows < 0] = float("-inf")
            res.scores[t], res.rows[t] = scores, rows
        return res


def build_index(bank: Bank, cfg: IndexConfig, seed: int = 0, gpu_device: int = 0) -> KeyIndex:
    """The index named by ``cfg.type`` over ``bank`` (``gpu_device``: the GPU of ``cfg.gpu``)."""
    if cfg.type == "torch":
        if cfg.gpu:
            raise ValueError("bank.index.gpu applies to FAISS indexes ('flat', 'ivf'), not 'torch'")
        return TorchIndex(bank)
    return FaissIndex(bank, cfg, seed, gpu_device)
