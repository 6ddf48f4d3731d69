"""How a shard stores the per-layer keys and values of its rows (``bank.kv_cache``), and reads them back.

Two layouts, named by the manifest's ``kv.layout``:

- ``padded`` (every bank built before issue 55; absent = padded): one tensor ``kv``
  [rows, n_cache, layers, 2, H_kv, hd] in ``kv.dtype``, zeros where a chunk has no state.
- ``ragged``: only the readable slots, ``min(kv.slots, L - 1)`` for a chunk of L tokens (its
  position 0, the attention sink, is never stored: ``elasticmem.bank.kv``), chunk after chunk:
  ``kv_len`` [rows] int32 counts each row's slots, and every tensor whose name starts with
  ``kv_slots`` has one entry per slot (the row's slots oldest first, rows in order). Float dtypes
  store ``kv_slots`` [S, layers, 2, H_kv, hd]; ``int8`` / ``int4`` (``elasticmem.bank.quant``)
  store ``kv_slots_codes`` [S, layers, 2, H_kv, hd * bits / 8] uint8 (keys, values), or, with
  ``kv.key_dtype`` (``bank.kv_key_dtype``: keys at another width than the values),
  ``kv_slots_kcodes`` / ``kv_slots_vcodes`` [S, layers, H_kv, hd * bits / 8] each at its own width
  (two tensors, as one cannot hold two widths; every bank without the field keeps the one), the
  values' per-group ``kv_slots_vscale`` / ``kv_slots_vmin`` [S, layers, H_kv, hd / group_size]
  float16, and the keys' ranges ``kv_kscale`` / ``kv_kmin``: per chunk [rows, layers, H_kv, hd]
  float16, or, with ``kv.key_group`` (``bank.kv_key_group``) G, per run of G slots from the row's
  oldest [rows, ceil(kv.slots / G), layers, H_kv, hd] float16 (zeros for the runs past a row's last
  slot).
  The runs are kept per row, not per slot, so a row's ranges stay one entry of the row: a short
  chunk pays for the runs it does not fill (a 39-slot chunk at G = 16, kv.slots 64: one of 4).

Every other tensor has one entry per row. So a shard's tensors concatenate with another's by
``torch.cat`` name by name (``cat_rows``), and rows are zeroed through ``zero_rows``, which finds a
row's slots from ``kv_len``. ``kv.slots`` (at most ``n_cache``) is the most slots a chunk keeps:
``min(n_cache, memory.policy.max_budget)`` of the config the bank was built with, as a reader
never takes more than its budget from one memory.

    pytest tests/unit/test_kv_quant.py tests/unit/test_kv_content.py
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from elasticmem.bank.manifest import KV_FORMAT_VERSION, BankError
from elasticmem.bank.quant import SCHEME, dequantize_slots, key_range_of, key_ranges, quantize_slots
from elasticmem.config import KV_INT_BITS, BankConfig, KVScheme, MemoryConfig
from elasticmem.utils.configuration import ConfigError

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
KV_DTYPES = FLOAT_DTYPES + tuple(KV_INT_BITS)
SLOTS = "kv_slots"
"""Prefix of the tensors with one entry per stored slot (ragged layout)."""
KV_LEN = "kv_len"
QUANT_TENSORS = {"codes": f"{SLOTS}_codes", "v_scale": f"{SLOTS}_vscale", "v_min": f"{SLOTS}_vmin",
                 "k_scale": "kv_kscale", "k_min": "kv_kmin"}
"""The shard tensors of an integer scheme whose keys and values share a width (``codes``: both)."""
SPLIT_CODES = {"k_codes": f"{SLOTS}_kcodes", "v_codes": f"{SLOTS}_vcodes"}
"""The codes' tensors of a scheme whose keys have their own width (``bank.kv_key_dtype``)."""


def quant_tensors(scheme: KVScheme) -> dict[str, str]:
    """An integer scheme's stored parts -> the shard tensors holding them (module docstring)."""
    if scheme.key_bits == scheme.value_bits:
        return QUANT_TENSORS
    return {**SPLIT_CODES, **{k: n for k, n in QUANT_TENSORS.items() if k != "codes"}}


@dataclass(frozen=True)
class KVFormat:
    """How a bank stores its per-layer keys and values (the manifest's ``kv`` record, less the
    model's shape): the scheme of its codes and where its slots lie."""

    scheme: KVScheme
    """dtype, keys' width and ranges, value groups (``elasticmem.config.KVScheme``)."""
    slots: int
    """The most slots a chunk keeps (``n_cache`` in a padded bank)."""
    layout: str = "ragged"
    """'ragged' or 'padded' (module docstring)."""

    @classmethod
    def of(cls, manifest: Mapping[str, Any]) -> "KVFormat | None":
        """The format of a bank's manifest (None: no per-layer KV). The fields added after a
        bank was built read as their defaults (absent ``key_group``: 0, ``key_dtype``: 'same')."""
        kv = manifest.get("kv")
        if kv is None:
            return None
        if kv["dtype"] not in KV_DTYPES:
            raise BankError(f"per-layer KV dtype {kv['dtype']!r} unknown to this version (one of {KV_DTYPES})")
        try:
            scheme = KVScheme(kv["dtype"], kv.get("key_dtype", "same"), int(kv.get("key_group", 0)),
                              int(kv.get("group_size", 0)))
        except ValueError as e:
            raise BankError(f"per-layer KV record {dict(kv)} unknown to this version: {e}") from None
        return cls(scheme, int(kv.get("slots", manifest["n_cache"])), kv.get("layout", "padded"))

    @property
    def dtype(self) -> str:
        """The scheme's dtype (one of ``KV_DTYPES``)."""
        return self.scheme.dtype

    @property
    def key_ranges(self) -> int:
        """Key ranges a row of an integer format keeps (``elasticmem.bank.quant.key_ranges``)."""
        return key_ranges(self.slots, self.scheme.key_group)

    def record(self, spec: Mapping[str, int]) -> dict[str, Any]:
        """The manifest's ``kv`` record: ``kv_spec`` of the model plus this format."""
        s = self.scheme
        rec: dict[str, Any] = {**spec, "dtype": s.dtype}
        if self.layout == "padded":
            return rec  # as banks were written before the other fields existed
        rec.update(layout=self.layout, slots=self.slots)
        if s.quantized:
            rec.update(scheme=SCHEME, group_size=s.group_size)
        # absent = the default: the records of banks built before these fields stay as they were
        if s.key_group:
            rec["key_group"] = s.key_group
        if s.key_dtype != "same":
            rec["key_dtype"] = s.key_dtype
        return rec

    def describe(self) -> str:
        """E.g. 'int4 (keys int8 per channel over each chunk, values per token in groups of 32;
        ragged, <= 64 slots)': what error messages and the build's summary say."""
        how = self.scheme.how()
        return f"{self.dtype} ({how + '; ' if how else ''}{self.layout}, <= {self.slots} slots)"


def storage_of(bank_cfg: BankConfig, memory: MemoryConfig | None = None) -> tuple[bool, KVFormat | None]:
    """What a build of ``bank_cfg`` stores besides keys and cache lengths: whether the hidden-state
    cache, and how the per-layer KV (None: not stored).

    ``memory``: the ``memory`` section of the config the bank is built for (its ``content`` and
    ``policy.max_budget``); None (a caller that does not know its reader) keeps the hidden cache and
    ``n_cache`` KV slots a chunk. ``bank.hidden_cache=auto`` stores the hidden cache unless the
    reader reads per-layer KV (``memory.content=kv`` with ``bank.kv_cache``); the KV keeps at most
    ``min(n_cache, max_budget)`` slots a chunk, all a reader's budget can take.
    """
    reads_kv = memory is not None and memory.content == "kv"
    hidden = {"true": True, "false": False}.get(bank_cfg.hidden_cache, not (bank_cfg.kv_cache and reads_kv))
    if not hidden and memory is not None and memory.content == "hidden":
        raise ConfigError("bank.hidden_cache=false but memory.content=hidden reads the hidden-state cache: "
                          "set bank.hidden_cache=auto or true")
    if not bank_cfg.kv_cache:
        return hidden, None
    slots = bank_cfg.n_cache if memory is None else min(bank_cfg.n_cache, int(memory.policy.max_budget))
    return hidden, KVFormat(bank_cfg.kv_scheme(), max(1, slots), "ragged")


def storage_fields(hidden_cache: bool, fmt: KVFormat | None, spec: Mapping[str, int] | None) -> dict[str, Any]:
    """The manifest fields that say what the shards hold besides keys (``storage_of``'s pair, with
    ``spec = kv_spec`` of the model): ``kv``, ``hidden_cache`` (absent = stored) and the
    ``format_version`` a reader needs for them (absent: the version of banks built before)."""
    out: dict[str, Any] = {}
    if fmt is not None:
        g = fmt.scheme.group_size
        if fmt.scheme.quantized and spec["head_dim"] % g:
            raise ValueError(f"bank.kv_group_size {g} does not divide the head width {spec['head_dim']}")
        out["kv"] = fmt.record(spec)
    if not hidden_cache:
        out["hidden_cache"] = False
    if not hidden_cache or (fmt is not None and fmt.layout != "padded"):
        out["format_version"] = KV_FORMAT_VERSION  # a reader before it would misread these shards
    return out


def content_record(rec: Mapping[str, Any], n_cache: int) -> dict[str, Any]:
    """The part of a ``kv`` record that says what a chunk's states are, not how they are stored (what
    a build's plan id hashes): the model's shape, the float dtype the states are kept at (float16
    for the integer dtypes, which quantize the float16 states), and the slot cap when below
    ``n_cache``. A float16 bank and its int8 / int4 conversions hash alike; the banks built before
    these fields existed hash as they did."""
    out = {k: rec[k] for k in ("layers", "kv_heads", "head_dim")}
    out["dtype"] = rec["dtype"] if rec["dtype"] in FLOAT_DTYPES else "float16"
    if int(rec.get("slots", n_cache)) < n_cache:
        out["slots"] = int(rec["slots"])
    return out


def encode_rows(window: Tensor, counts: Tensor, fmt: KVFormat) -> dict[str, Tensor]:
    """The shard tensors of a block of rows, from their encoder window (``window_kv``).

    Args:
        window: [B, n_cache, layers, 2, H, hd] float, the valid states right-aligned.
        counts: [B] long, slots to keep per row (the last ``counts[b]`` of the window).
    Returns: for ``padded``, ``kv`` [B, n_cache, ...] in ``fmt.dtype``; for ``ragged``, ``kv_len``
    and the slot tensors of the module docstring, on ``window``'s device.
    """
    if fmt.layout == "padded":
        return {"kv": window.to(getattr(torch, fmt.dtype))}
    B, N = window.shape[:2]
    counts = counts.to(window.device)
    flat = window[window_mask(counts, N)]  # [S, ...] row by row, each row's slots oldest first
    out = {KV_LEN: counts.to(torch.int32)}
    s = fmt.scheme
    if not s.quantized:
        return {**out, SLOTS: flat.to(getattr(torch, fmt.dtype))}
    if bool((counts > fmt.slots).any()):  # a row's key runs would spill into the next row's
        raise ValueError(f"more slots than the format's {fmt.slots} a row: {counts.tolist()}")
    chunk = torch.arange(B, device=window.device).repeat_interleave(counts)
    place = torch.arange(chunk.numel(), device=window.device) - (counts.cumsum(0) - counts)[chunk]
    n = fmt.key_ranges
    q = quantize_slots(flat, chunk * n + key_range_of(place, s.key_group), B * n, s)
    if s.key_group:  # [B, n, ...]: each row's runs stay one entry of the row (module docstring)
        q.update({k: q[k].unflatten(0, (B, n)) for k in ("k_scale", "k_min")})
    if s.key_bits == s.value_bits:  # one codes tensor, keys then values, as KIVI banks store it
        q = {"codes": torch.stack([q.pop("k_codes"), q.pop("v_codes")], 2), **q}
    names = quant_tensors(s)
    return {**out, **{names[k]: t for k, t in q.items()}}


def window_mask(counts: Tensor, n_cache: int) -> Tensor:
    """[B, n_cache] bool: the window places of each row's last ``counts[b]`` slots (right-aligned)."""
    return torch.arange(n_cache, device=counts.device)[None, :] >= (n_cache - counts)[:, None]


def to_window(flat: Tensor, counts: Tensor, n_cache: int) -> Tensor:
    """Slots row after row ([sum(counts), ...]) as windows [B, n_cache, ...], right-aligned, zeros
    elsewhere (the inverse of ``encode_rows``' selection); on ``flat``'s device and dtype."""
    out = flat.new_zeros(counts.numel(), n_cache, *flat.shape[1:])
    out[window_mask(counts, n_cache).to(out.device)] = flat
    return out


def slot_offsets(kv_len: Tensor) -> Tensor:
    """[rows + 1] long: the first slot of each row of a ragged shard, and the shard's slot count."""
    return torch.cat([torch.zeros(1, dtype=torch.long), kv_len.long().cumsum(0)])


def _slot_ranges(tensors: Mapping[str, Tensor], lo: int, hi: int) -> tuple[int, int]:
    """``[a, b)`` slots of rows ``[lo, hi)`` in a block's slot tensors."""
    off = slot_offsets(tensors[KV_LEN])
    return int(off[lo]), int(off[hi])


def split_rows(block: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
    """A block's tensors row by row (views): each dict one row's tensors, slot tensors its slots."""
    n = next(t for name, t in block.items() if not name.startswith(SLOTS)).shape[0]
    out = []
    for r in range(n):
        a, b = _slot_ranges(block, r, r + 1) if KV_LEN in block else (0, 0)
        out.append({name: t[a:b] if name.startswith(SLOTS) else t[r:r + 1] for name, t in block.items()})
    return out


def cat_rows(blocks: list[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Blocks of rows (shards, or ``split_rows``' rows) as one block, in order."""
    return {name: torch.cat([b[name] for b in blocks]) for name in blocks[0]}


def zero_rows(tensors: dict[str, Tensor], lo: int, hi: int) -> None:
    """Zero rows ``[lo, hi)`` of a shard's tensors in place: their row entries and their slots
    (``kv_len`` is kept, as it places the later rows' slots)."""
    a, b = _slot_ranges(tensors, lo, hi) if KV_LEN in tensors else (0, 0)
    for name, t in tensors.items():
        if name.startswith(SLOTS):
            t[a:b] = 0
        elif name != KV_LEN:
            t[lo:hi] = 0


def read_slots(get: Callable[[str], Tensor], offsets: Tensor | None, rows: Tensor, counts: Tensor, fmt: KVFormat,
               n_cache: int, device: torch.device | str | None = None) -> Tensor:
    """The last ``counts[k]`` stored slots of rows ``rows[k]`` of one shard, dequantized on ``device``.

    Args:
        get: the shard's tensor by name (memory-mapped).
        offsets: [rows + 1] long, first slot of each row (``kv_len``'s cumulative sum); None for padded.
        rows: [R] long, rows of the shard; counts: [R] long, each at most the row's stored slots.
    Returns: [sum(counts), layers, 2, H, hd], row after row, each row's slots oldest first; in
    ``fmt.dtype`` for a float format, float16 for an integer one.
    """
    if fmt.layout == "padded":
        kv = get("kv")
        return torch.cat([kv[r, n_cache - c:] for r, c in zip(rows.tolist(), counts.tolist())]).to(device)
    which = torch.arange(rows.numel()).repeat_interleave(counts)  # the read row of each slot
    local = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts)[which]  # 0.. within each row read
    place = (offsets[rows + 1] - offsets[rows] - counts)[which] + local  # among the row's stored slots, 0 = oldest
    idx = offsets[rows][which] + place
    s = fmt.scheme
    if not s.quantized:
        return get(SLOTS).index_select(0, idx).to(device)
    # only the codes and scales asked for move to the device; the read rows' key ranges are
    # repeated per slot there
    at = (which.to(device), key_range_of(place, s.key_group).to(device)) if s.key_group else which.to(device)
    q = {k: get(name).index_select(0, idx).to(device) if name.startswith(SLOTS) else get(name)[rows].to(device)[at]
         for k, name in quant_tensors(s).items()}
    if "codes" in q:
        q["k_codes"], q["v_codes"] = q.pop("codes").unbind(2)
    return dequantize_slots(q, s)


def tensor_names(manifest: Mapping[str, Any]) -> list[str]:
    """The tensors every shard of a bank holds, by its manifest."""
    names = ["keys", *(["cache"] if manifest.get("hidden_cache", True) else []), "cache_len"]
    fmt = KVFormat.of(manifest)
    if fmt is None:
        return names
    if fmt.layout == "padded":
        return [*names, "kv"]
    return [*names, KV_LEN, *(quant_tensors(fmt.scheme).values() if fmt.scheme.quantized else [SLOTS])]


def bytes_by_part(tensors: Mapping[str, Tensor]) -> dict[str, int]:
    """A shard's tensor bytes by part: ``keys``, ``cache`` (the hidden states and their lengths) and
    ``kv`` (every per-layer KV tensor)."""
    out = {"keys": 0, "cache": 0, "kv": 0}
    for name, t in tensors.items():
        part = "kv" if name.startswith("kv") else "cache" if name.startswith("cache") else "keys"
        out[part] += t.numel() * t.element_size()
    return out


__all__ = ["FLOAT_DTYPES", "KVFormat", "KV_DTYPES", "KV_LEN", "QUANT_TENSORS", "SLOTS", "SPLIT_CODES", "bytes_by_part",
           "cat_rows", "content_record", "encode_rows", "quant_tensors", "read_slots", "slot_offsets", "split_rows",
           "storage_fields", "storage_of", "tensor_names", "to_window", "window_mask", "zero_rows"]
