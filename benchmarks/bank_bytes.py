"""Bank bytes per chunk and per million tokens of history, for SmolLM2 and Qwen2.5 0.5B / 3B / 7B shapes at
every KV dtype, next to the hidden-state (projector) variant: the planner of docs/cluster.md.

    python benchmarks/bank_bytes.py [--chunk-tokens 90] [--out docs/results/cluster/bank_bytes.json]
    python benchmarks/bank_bytes.py --bank runs/bank/locomo_mc10 --max-budget 128   # a built bank at every scheme

No model is loaded: each shape's per-layer keys and values for one block of chunks are random tensors of
that shape, stored by the bank's own code (``elasticmem.bank.kv_store.encode_rows``, the int8 / int4
scheme included; int4 also with ``bank.kv_key_group=16``, and with int8 keys, ``bank.kv_key_dtype=int8``),
and their bytes counted with ``bytes_by_part``; so the figures are the storage format's, not a formula's
(quantization's scales and minima included). A chunk of ``--chunk-tokens`` tokens keeps
``min(tokens - 1, B_max)`` positions (its first, the attention sink, is never stored), in a bank whose
chunks keep at most ``B_max`` (its ``kv.slots``: key runs are counted over those, filled or not); its key
is 4 B x d.
The hidden-state variant stores ``n_cache`` float16 states of width d (``memory.content=hidden``). The
SmolLM2 row can be checked against a measured bank: ``build.bytes_per_chunk`` in its manifest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import write_json  # noqa: E402

from elasticmem.bank.kv_store import KV_DTYPES, KVFormat, bytes_by_part, encode_rows  # noqa: E402
from elasticmem.config import KVScheme  # noqa: E402

SHAPES = {  # hidden width d, layers, KV heads, head width (the models' config.json)
    "SmolLM2-135M": (576, 30, 3, 64),
    "Qwen2.5-0.5B": (896, 24, 2, 64),
    "Qwen2.5-3B": (2048, 36, 2, 128),
    "Qwen2.5-7B": (3584, 28, 4, 128),
}
DTYPES = [d for d in KV_DTYPES if d != "bfloat16"]  # bfloat16 stores as many bytes as float16
SCHEMES = {**{d: KVScheme(d) for d in DTYPES},
           "int4, kv_key_group 16": KVScheme("int4", key_group=16),
           "int4 values, int8 keys": KVScheme("int4", key_dtype="int8")}  # K8V4: int4's most accurate
"""The storages of the planner's rows, by their label."""


def kv_bytes_per_chunk(layers: int, heads: int, head_dim: int, scheme: KVScheme, slots: int, cap: int | None = None,
                       rows: int = 8) -> float:
    """Bytes of per-layer KV one chunk of ``slots`` stored positions takes in a bank whose chunks keep at
    most ``cap`` (default ``slots``; a chunk's key runs are counted over ``cap``), by the bank's storage code."""
    cap = cap or slots
    gen = torch.Generator().manual_seed(0)
    window = torch.randn(rows, cap, layers, 2, heads, head_dim, generator=gen)
    tensors = encode_rows(window, torch.full((rows,), slots), KVFormat(scheme, cap))
    return bytes_by_part(tensors)["kv"] / rows


def plan(chunk_tokens: int, max_budget: int, n_cache_hidden: int) -> list[dict]:
    """One row per shape and storage: bytes per chunk and per million tokens of history."""
    slots = min(chunk_tokens - 1, max_budget)
    chunks_per_m = 1e6 / chunk_tokens
    out = []
    for name, (d, layers, heads, hd) in SHAPES.items():
        key = 4 * d
        hidden = key + 2 * n_cache_hidden * d
        out.append({"model": name, "storage": f"hidden states (n_cache {n_cache_hidden}, float16)",
                    "bytes_per_chunk": hidden, "gb_per_m_tokens": hidden * chunks_per_m / 1e9})
        for label, scheme in SCHEMES.items():
            b = key + kv_bytes_per_chunk(layers, heads, hd, scheme, slots, max_budget)
            out.append({"model": name, "storage": f"per-layer KV, {label}", "bytes_per_chunk": b,
                        "gb_per_m_tokens": b * chunks_per_m / 1e9})
    return out


def bank_at_schemes(root: str, max_budget: int, schemes: dict[str, KVScheme] | None = None) -> list[dict]:
    """What a built bank's per-layer KV and keys would take at each storage, from its chunks' token
    counts (``chunks.jsonl``) and its backbone's shape: each chunk keeps ``min(n_tokens - 1, max_budget)``
    positions. ``schemes``: the storages by label (default: the planner's ``SCHEMES``)."""
    from elasticmem.bank import Bank

    bank = Bank.open(root)
    if not bank.kv:
        raise SystemExit(f"{root} holds no per-layer KV (bank.kv_cache=false): nothing to plan")
    layers, heads, hd = bank.kv["layers"], bank.kv["kv_heads"], bank.kv["head_dim"]
    slots = [min(c["n_tokens"] - 1, max_budget) for c in bank.chunks()]
    counts = {s: slots.count(s) for s in set(slots)}
    out = []
    for label, scheme in (schemes or SCHEMES).items():
        per = {s: kv_bytes_per_chunk(layers, heads, hd, scheme, s, max_budget, rows=2) for s in counts}
        total = sum(n * (4 * bank.hidden_size + per[s]) for s, n in counts.items())
        out.append({"storage": label, "chunks": len(slots), "bytes": total})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-tokens", type=int, default=90, help="tokens a chunk (LoCoMo's turn pairs: median 87)")
    ap.add_argument("--max-budget", type=int, default=128, help="memory.policy.max_budget: positions kept a chunk")
    ap.add_argument("--n-cache-hidden", type=int, default=20, help="bank.n_cache of the hidden-state variant")
    ap.add_argument("--out", help="also write the rows as a results file")
    ap.add_argument("--bank", help="instead: a built bank's bytes at every storage (its chunks' lengths)")
    args = ap.parse_args(argv)
    if args.bank:
        for r in bank_at_schemes(args.bank, args.max_budget):
            print(f"{r['storage']:24s} {r['bytes'] / 1e9:7.2f} GB ({r['chunks']} chunks, KV + keys)")
        return 0
    rows = plan(args.chunk_tokens, args.max_budget, args.n_cache_hidden)
    for r in rows:
        print(f"{r['model']:14s} {r['storage']:36s} {r['bytes_per_chunk'] / 1e6:8.3f} MB a chunk "
              f"{r['gb_per_m_tokens']:8.1f} GB per 1M tokens")
    if args.out:
        kept = min(args.chunk_tokens - 1, args.max_budget)
        table = {"header": [f"backbone, storage ({args.chunk_tokens}-token chunks, {kept} positions kept)",
                            "MB a chunk", "GB per 1M tokens of history"],
                 "rows": [[f"{r['model']}, {r['storage']}", f"{{rows[{i}][mb_per_chunk]:.3f}}",
                           f"{{rows[{i}][gb_per_m_tokens]:.1f}}"] for i, r in enumerate(rows)]}
        data = {"rows": [{**r, "mb_per_chunk": r["bytes_per_chunk"] / 1e6} for r in rows],
                "chunk_tokens": args.chunk_tokens, "max_budget": args.max_budget}
        write_json(args.out, {"provenance": "the bank's storage code on random tensors of each shape (no model)",
                              "data": data, "table": table}, __file__, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
