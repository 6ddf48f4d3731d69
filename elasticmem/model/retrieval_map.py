"""The runtime half of a learned query/key map for retrieval (``memory.retrieval_map``; a departure
from the paper): the map, its file, the check that it fits the model, and the index that ranks
by ``cos(f_q(h), f_k(k_i))``. ``ElasticMem`` builds it when the config names a map; training one
is ``elasticmem.warmup.retrieval_map`` (whose docstring describes the kinds, the loss and the
file format), which sits above the model and imports this module, never the other way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from elasticmem.bank.follow import RowVectors
from elasticmem.bank.index import SearchResult, TorchIndex
from elasticmem.bank.store import Bank

FORMAT_VERSION = 1
KINDS = ("standardize", "linear", "mlp")


class RetrievalMapError(ValueError):
    """A retrieval map file is missing, malformed, or made for another mode, key or encoder."""


# --------------------------------------------------------------------------- the map


class RetrievalMap(nn.Module):
    """``f_q`` and ``f_k``: per-dimension standardisation, then (``linear``/``mlp``) a small net each."""

    def __init__(self, d_in: int, kind: str = "linear", d_out: int = 256, hidden: int = 1024, dropout: float = 0.1,
                 residual: bool = False):
        super().__init__()
        if kind not in KINDS:
            raise RetrievalMapError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.d_in, self.hidden, self.dropout = kind, int(d_in), int(hidden), float(dropout)
        self.residual = bool(residual) and kind != "standardize"
        self.d_out = int(d_in) if kind == "standardize" or self.residual else int(d_out)
        for side in ("query", "key"):
            self.register_buffer(f"{side}_mean", torch.zeros(d_in))
            self.register_buffer(f"{side}_std", torch.ones(d_in))
        self.query = self._net()
        self.key = self._net()

    def _net(self) -> nn.Module:
        if self.kind == "standardize":
            return nn.Identity()
        if self.kind == "linear":
            net = nn.Linear(self.d_in, self.d_out)
        else:
            net = nn.Sequential(nn.Linear(self.d_in, self.hidden), nn.GELU(), nn.Dropout(self.dropout),
                                nn.Linear(self.hidden, self.d_out))
        if self.residual:  # x + net(x), net(x) = 0 at the start: training starts at the standardisation
            last = net if self.kind == "linear" else net[-1]
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)
        return net

    def _apply(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x + net(x) if self.residual else net(x)

    def set_statistics(self, queries: torch.Tensor, keys: torch.Tensor) -> None:
        """Standardisation statistics from training query states [N, d] and keys [M, d]."""
        for side, x in (("query", queries), ("key", keys)):
            x = x.float()
            getattr(self, f"{side}_mean").copy_(x.mean(0))
            getattr(self, f"{side}_std").copy_(x.std(0).clamp_min(1e-6) if x.shape[0] > 1 else torch.ones(x.shape[1]))

    def map_queries(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d_in] -> [..., d_out] (not normalised; the index normalises)."""
        h = h.float().to(self.query_mean.device)
        return self._apply(self.query, (h - self.query_mean) / self.query_std)

    def map_keys(self, k: torch.Tensor) -> torch.Tensor:
        k = k.float().to(self.key_mean.device)
        return self._apply(self.key, (k - self.key_mean) / self.key_std)

    def save(self, path: str | Path, retrieval: str, key: dict[str, Any], encoder: dict[str, str],
             train: dict[str, Any] | None = None) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format_version": str(FORMAT_VERSION), "kind": self.kind, "d_in": str(self.d_in),
                "d_out": str(self.d_out), "hidden": str(self.hidden), "dropout": str(self.dropout),
                "residual": str(int(self.residual)),
                "retrieval": retrieval, "key": json.dumps(key, sort_keys=True),
                "encoder": json.dumps(encoder, sort_keys=True), "train": json.dumps(train or {}, sort_keys=True)}
        tensors = {n: t.detach().float().cpu().contiguous() for n, t in self.state_dict().items()}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
        return path


def load_retrieval_map(path: str | Path) -> tuple[RetrievalMap, dict[str, Any]]:
    """The map (eval mode, CPU) and its metadata (``key``, ``encoder``, ``train`` parsed from JSON)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise RetrievalMapError(f"retrieval map {path} not found (train one with "
                                f"`python -m elasticmem.warmup.retrieval_map --config ... --out {path}`)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {n: f.get_tensor(n) for n in f.keys()}
    except Exception as e:  # safetensors raises its own error types for broken files
        raise RetrievalMapError(f"{path} is not a readable safetensors file ({e})") from None
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise RetrievalMapError(f"{path}: not a retrieval map of format {FORMAT_VERSION} "
                                f"(format_version {meta.get('format_version')!r})")
    for name in ("key", "encoder", "train"):
        meta[name] = json.loads(meta[name])
    m = RetrievalMap(int(meta["d_in"]), meta["kind"], int(meta["d_out"]), int(meta["hidden"]), float(meta["dropout"]),
                     bool(int(meta.get("residual", "0"))))
    m.load_state_dict(tensors)
    return m.eval().requires_grad_(False), meta


def check_retrieval_map(meta: dict[str, Any], path: str | Path, retrieval: str, key: dict[str, Any],
                        fingerprint: str) -> None:
    """Refuse a map trained for another retrieval mode, key variant or encoder."""
    problems = []
    if meta["retrieval"] != retrieval:
        problems.append(f"it maps '{meta['retrieval']}' query states but memory.retrieval is '{retrieval}'")
    if meta["key"] != key:
        problems.append(f"it was trained on keys {meta['key']} but the bank's keys are {key}")
    if meta["encoder"].get("fingerprint") != fingerprint:
        problems.append(f"it was trained on states of {meta['encoder'].get('name_or_path')!r} "
                        f"({str(meta['encoder'].get('fingerprint'))[:23]}...), not of this backbone "
                        f"({fingerprint[:23]}...)")
    if problems:
        raise RetrievalMapError(f"retrieval map {path} does not fit: " + "; ".join(problems)
                                + ". Train a map for these settings (python -m elasticmem.warmup.retrieval_map)")


class MappedIndex:
    """Exact cosine top-k of ``f_q(h)`` over ``f_k(keys)`` of a bank (mapped once, kept in memory)."""

    def __init__(self, bank: Bank, rmap: RetrievalMap, batch_rows: int = 8192):
        self.map = rmap
        self.batch_rows = batch_rows
        self._rows = RowVectors(rmap.d_out, self._map_rows)
        self.refresh(bank)

    @property
    def keys(self) -> torch.Tensor:
        """[rows, d_out] normalised mapped keys by bank row (zeros for deleted rows)."""
        return self._rows.vectors

    def refresh(self, bank: Bank) -> "MappedIndex":
        """Follow ``bank``, a newer snapshot of this bank, in place: map only the rows appended since
        and zero those deleted since; another bank is mapped anew."""
        self._rows.follow(bank)
        self.bank = bank
        self._index = TorchIndex(bank, self.keys)
        return self

    def _map_rows(self, bank: Bank, segs: list[tuple[int, int]]) -> torch.Tensor:
        b = self.batch_rows
        with torch.no_grad():
            parts = [self.map.map_keys(bank.keys(s, min(s + b, end))) for a, end in segs for s in range(a, end, b)]
        return nn.functional.normalize(torch.cat(parts), dim=-1)

    def search(self, queries: torch.Tensor, k: int, groups: Sequence[str] | None = None) -> SearchResult:
        with torch.no_grad():
            return self._index.search(self.map.map_queries(queries.detach().cpu()), k, groups)
