"""Convert a built bank's per-layer keys and values to another storage (``build_bank.py --convert``).

A float16 bank becomes an int8 or int4 one (``elasticmem.bank.quant``, any ``KVScheme``: keys'
ranges per chunk or per run of ``bank.kv_key_group`` positions, keys at their own width with
``bank.kv_key_dtype``), a padded one (built before issue 55) ragged
(``elasticmem.bank.kv_store``), and the hidden-state cache can be dropped, all without encoding
anything: each shard's stored states are re-laid out by the function a build
uses (``kv_store.encode_rows``), so a converted float16 bank holds the bytes a build at the new
dtype writes. Converting from int8 / int4 dequantizes first: what the first quantization lost
stays lost.

The conversion is atomic, as an append is (``elasticmem.bank.append``): under the folder's lock,
every new shard is written under a new name, then one atomic replacement of ``manifest.json``
(with a new journal; the old one is sealed, so readers reopen) commits them all. A crash before
leaves the old bank, whose files are untouched; the new files it left are orphans that a later
conversion or compaction deletes. The replaced shards are deleted after the commit (a reader of
the old snapshot keeps the files it has open).

    pytest tests/unit/test_kv_quant.py
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from elasticmem.bank.append import _checkpoint, _next_index
from elasticmem.bank.builder import _atomic_write_bytes, _dir_lock, bytes_per_chunk
from elasticmem.bank.kv_store import (KVFormat, bytes_by_part, cat_rows, encode_rows, read_slots, slot_offsets,
                                      storage_fields, to_window)
from elasticmem.bank.manifest import BankError
from elasticmem.bank.store import Bank, shard_name
from elasticmem.config import KVScheme

ROWS_AT_ONCE = 64
"""Rows whose states are held as float32 windows at once (SmolLM2, n_cache 64: 190 MB)."""


def _window(get, bank: Bank, fmt: KVFormat, start: int, rows: range) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored states of shard rows ``rows`` (shard starting at global row ``start``) as encoder
    windows [B, n_cache, layers, 2, H, hd] float32 (zeros where nothing is stored), and their
    stored slot counts [B]."""
    local = torch.tensor(list(rows), dtype=torch.long)
    if fmt.layout == "padded":
        n = bank.kv_lengths(local + start)
        return get("kv")[local].float(), n
    off = slot_offsets(get("kv_len"))
    n = off[local + 1] - off[local]
    return to_window(read_slots(get, off, local, n, fmt, bank.n_cache).float(), n, bank.n_cache), n


def convert_bank(root: str | Path, scheme: KVScheme, hidden_cache: bool | None = None) -> Bank:
    """Store the bank in ``root`` with per-layer KV as ``scheme`` says (``BankConfig.kv_scheme()``:
    its dtype, the keys' width and ranges, the value groups) in the ragged layout, and without the
    hidden-state cache when ``hidden_cache`` is False (None or True: kept as it is; a missing one
    cannot be added without encoding). Returns the converted bank (the same one when nothing
    changes)."""
    root = Path(root)
    with _dir_lock(root):
        bank = Bank.open(root)
        old = bank.kv_format
        if old is None:
            raise BankError(f"bank {root} holds no per-layer keys and values (bank.kv_cache): nothing to convert")
        if hidden_cache and not bank.hidden_cache:
            raise BankError(f"bank {root} holds no hidden-state cache; it cannot be added without encoding the "
                            f"chunks again: rebuild the bank with bank.hidden_cache=true")
        new = KVFormat(scheme, old.slots, "ragged")
        keep_hidden = bank.hidden_cache and hidden_cache is not False
        if new == old and keep_hidden == bank.hidden_cache:
            return bank
        m = bank.manifest
        spec = {k: bank.kv[k] for k in ("layers", "kv_heads", "head_dim")}
        fields = storage_fields(keep_hidden, new, spec)
        nxt = max(_next_index(m), 1 + max((int(p.name[6:11]) for p in root.glob("shard-?????.safetensors")),
                                          default=-1))
        shards, records = [], []
        for i, s in enumerate(bank.shards):
            with safe_open(str(root / s.file), framework="pt") as f:
                get = f.get_tensor
                tensors = {n: get(n) for n in ("keys", "cache", "cache_len") if n in f.keys()}
                if not keep_hidden:
                    tensors.pop("cache", None)
                blocks = []
                for a in range(0, s.rows, ROWS_AT_ONCE):
                    window, n = _window(get, bank, old, s.start, range(a, min(a + ROWS_AT_ONCE, s.rows)))
                    blocks.append(encode_rows(window, n, new))
                tensors.update(cat_rows(blocks))
                meta = {**(f.metadata() or {}), "converted": new.dtype}
            data = st_save(tensors, metadata=meta)
            name = shard_name(nxt + i)
            _atomic_write_bytes(root / name, data)
            shards.append({"file": name, "rows": s.rows, "sha256": hashlib.sha256(data).hexdigest(),
                           "bytes": len(data)})
            records.append({**shards[-1], "tensor_bytes": bytes_by_part(tensors)})
        build = {**m.get("build", {}), "bytes_per_chunk": bytes_per_chunk(records, bank.num_chunks),
                 "converted": [*m.get("build", {}).get("converted", []),
                               {"from": old.describe(), "to": new.describe(), "hidden_cache": keep_hidden}]}
        manifest = {k: v for k, v in m.items() if k != "hidden_cache"}
        manifest.update({**fields, "shards": shards, "build": build,
                         "format_version": max(int(m["format_version"]), fields.get("format_version", 0))})
        converted = _checkpoint(bank, manifest)  # the commit
        for s in bank.shards:
            (root / s.file).unlink(missing_ok=True)
        return converted


__all__ = ["convert_bank"]
