"""Per-layer KV quantization schemes on real SmolLM2 states: reconstruction error, reader KL, bytes a chunk.

    python -m elasticmem.backbone fetch smollm2          # once
    OMP_NUM_THREADS=1 python benchmarks/kv_quant_error.py                 # 24 persona chunks, ~90 s on 1 core
    OMP_NUM_THREADS=1 python benchmarks/kv_quant_error.py --chunks 48 --n-cache 64
    OMP_NUM_THREADS=1 python benchmarks/kv_quant_error.py --out docs/results/bank/kv_schemes.json

Encodes persona chunks (the quickstart's task) with SmolLM2-135M-Instruct as a build does
(``encode_batch``, float16 states, position 0 left out), then, for int8 and int4 and each scheme
below, reports the bits a stored value takes (its code and its share of the float16 scales and
minima, keys / values and their mean, counted as the bank stores them: key runs of G slots take
ceil(n_cache / G) ranges a chunk), the relative Frobenius error of the keys and of the values
against the float16 states, and the mean KL (nats) of a reader's next-token distributions over a
question after one chunk read as KV memory (``elasticmem.model.injection.assemble``, as
``memory.content=kv`` reads), with its top-1 agreement. The schemes are written here with plain
tensor ops (min-max codes, float16 scales and minima, as the bank stores them); the rows marked
``[bank code]`` write and read the chunks with the bank's own code (``elasticmem.bank.kv_store``)
at each setting of ``BANK_SCHEMES``: they equal the first row, the "K channel (16 slots) / V token
g32" row and the "K int8 channel (chunk) / V token g32" row; ``elasticmem.bank.quant`` quotes the
table. Last, the bytes a chunk of about 40 tokens takes in each storage (``elasticmem.bank.kv_store``,
the bank's code). ``--out`` writes the bank's settings (their bits, KL, top-1 and bytes a chunk without
the hidden cache) as the results file of docs/bank.md's table of schemes.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
import _bench  # noqa: E402,F401  (puts this checkout's root on sys.path)
from _bench import write_json  # noqa: E402
from elasticmem.backbone import load_backbone  # noqa: E402
from elasticmem.bank.builder import collect_groups, encode_shard  # noqa: E402
from elasticmem.bank.encoding import encode_batch  # noqa: E402
from elasticmem.bank.kv import rotary_module, rotate_keys  # noqa: E402
from elasticmem.bank.kv_store import KVFormat, bytes_by_part, encode_rows, read_slots, slot_offsets  # noqa: E402
from elasticmem.config import BackboneConfig, KVScheme, SyntheticConfig  # noqa: E402
from elasticmem.data.chunking import chunk_history, tokenize_chunks  # noqa: E402
from elasticmem.data.synthetic import generate  # noqa: E402
from elasticmem.model.injection import KVPiece, Layout, assemble  # noqa: E402


RANGE_BITS = 32
"""Bits of one range: a float16 scale and a float16 minimum (or absmax scale, stored alike)."""
BANK_SCHEMES = {  # name -> (label, the settings that build it, the scheme)
    "float16": ("float16", "bank.kv_dtype=float16", KVScheme("float16")),
    "int8": ("int8", "bank.kv_dtype=int8", KVScheme("int8")),
    "int8_k16": ("int8, key runs of 16", "bank.kv_dtype=int8 bank.kv_key_group=16", KVScheme("int8", key_group=16)),
    "int4": ("int4", "bank.kv_dtype=int4", KVScheme("int4")),
    "int4_k16": ("int4, key runs of 16", "bank.kv_dtype=int4 bank.kv_key_group=16", KVScheme("int4", key_group=16)),
    "k8v4": ("K8V4: int8 keys, int4 values", "bank.kv_dtype=int4 bank.kv_key_dtype=int8",
             KVScheme("int4", key_dtype="int8")),
}
"""The bank's own settings, written and read by its code (the ``[bank code]`` rows and ``--out``)."""


def minmax(x: torch.Tensor, dims: tuple[int, ...], bits: int, symmetric: bool = False) -> tuple[torch.Tensor, int]:
    """``x`` read back after min-max codes over ``dims`` (one range per the other indices), and the
    number of ranges stored."""
    ranges = x.numel() // math.prod(x.shape[d] for d in dims)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (x.abs().amax(dim=dims, keepdim=True) / qmax).half().float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (x / safe).round().clamp(-qmax - 1, qmax) * scale, ranges
    lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    qmax = 2 ** bits - 1
    scale, lo = ((hi - lo) / qmax).half().float(), lo.half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return lo + ((x - lo) / safe).round().clamp(0, qmax) * scale, ranges


def per_token(x: torch.Tensor, bits: int, group: int, symmetric: bool = False) -> tuple[torch.Tensor, int]:
    """[c, layers, H, hd]: a range per slot and group of ``group`` channels."""
    c, L, H, hd = x.shape
    y, n = minmax(x.reshape(c, L, H, hd // group, group), (-1,), bits, symmetric)
    return y.reshape(x.shape), n


def per_channel(x: torch.Tensor, bits: int, slots: int | None = None, cap: int = 0,
                symmetric: bool = False) -> tuple[torch.Tensor, int]:
    """[c, layers, H, hd]: a range per channel over the chunk's slots, or over runs of ``slots``
    slots from the oldest (the last run shorter), as ``bank.kv_key_group`` cuts them. The ranges
    counted are those a bank stores: ``ceil(cap / slots)`` runs a chunk of at most ``cap`` slots,
    filled or not (``elasticmem.bank.kv_store``)."""
    if slots is None:
        return minmax(x, (0,), bits, symmetric)
    runs = [minmax(x[i:i + slots], (0,), bits, symmetric)[0] for i in range(0, x.shape[0], slots)]
    return torch.cat(runs), -(-max(cap, x.shape[0]) // slots) * math.prod(x.shape[1:])


def bank_roundtrip(kv: torch.Tensor, lens: list[int], fmt: KVFormat) -> tuple[list[torch.Tensor], float]:
    """The chunks' slots written and read back by the bank's own code (``encode_rows``, ``read_slots``)
    at ``fmt``, and the bits a stored value takes there (codes, scales and minima; ``kv_len`` left out).

    kv: [R, n_cache, layers, 2, H, hd] windows; lens: each row's stored slots."""
    counts = torch.tensor(lens)
    block = encode_rows(kv, counts, fmt)
    got = read_slots(block.__getitem__, slot_offsets(block["kv_len"]), torch.arange(len(lens)), counts, fmt,
                     kv.shape[1]).float()
    values = int(counts.sum()) * math.prod(kv.shape[2:])
    bits = 8 * (bytes_by_part(block)["kv"] - 4 * len(lens)) / values
    return list(got.split(lens)), bits


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--n-cache", type=int, default=64)
    ap.add_argument("--out", help="also write the bank's settings' rows as a results file")
    args = ap.parse_args(argv)
    N = args.n_cache
    bb = load_backbone(BackboneConfig(name_or_path="smollm2", device="cpu"))
    dec = bb.model.get_decoder()
    rot = rotary_module(dec)
    data = generate(SyntheticConfig(num_histories=max(6, args.chunks // 4), num_sessions=2, num_facts=4,
                                    num_filler=0), seed=0)
    chunks = [c for g, ex in collect_groups(data).items() for c in chunk_history(ex.history, g)][:args.chunks]
    ids = tokenize_chunks([c.text for c in chunks], bb.tokenizer, 128, "right", True)
    print(f"{len(ids)} chunks of {min(map(len, ids))}-{max(map(len, ids))} tokens, n_cache {N}")
    with torch.inference_mode():
        kv = torch.cat([encode_batch(dec, ids[a:a + 8], N, bb.tokenizer.pad_token_id, kv=True)[-1]
                        for a in range(0, len(ids), 8)]).half().float()
    lens = [min(N, len(i) - 1) for i in ids]
    pieces = [kv[r, N - c:] for r, c in enumerate(lens)]  # [c, layers, 2, H, hd] float16 values

    def pre_rope(k: torch.Tensor, first: int, sign: int) -> torch.Tensor:  # keys moved to position 0 and back
        c, L, H, hd = k.shape
        pos = (torch.arange(c) + first) * sign
        return rotate_keys(k.permute(1, 2, 0, 3).reshape(1, L * H, c, hd), pos[None], rot).reshape(
            L, H, c, hd).permute(2, 0, 1, 3)

    def rope_channel(k: torch.Tensor, first: int, bits: int) -> tuple[torch.Tensor, int]:
        y, n = per_channel(pre_rope(k, first, -1), bits)
        return pre_rope(y, first, 1), n

    def ch(slots: int | None = None, width: int | None = None):  # keys per channel (over runs of slots)
        return lambda k, f, b: per_channel(k, width or b, slots, N)

    def tok(group: int):  # per token in groups of channels
        return lambda x, *a: per_token(x, a[-1], group)

    # name -> (keys, values, the keys' code width when it is not the row's: K int8 / V int4 rows
    # are printed with int4 only)
    schemes = {
        "K channel (chunk) / V token g32 [bank]": (ch(), tok(32), None),
        "K channel (chunk) / V token g64": (ch(), tok(64), None),
        "K channel (chunk) / V token g16": (ch(), tok(16), None),
        "K channel (32 slots) / V token g32": (ch(32), tok(32), None),
        "K channel (16 slots) / V token g32": (ch(16), tok(32), None),
        "K channel (8 slots) / V token g32": (ch(8), tok(32), None),
        "K channel (16 slots) / V token g64": (ch(16), tok(64), None),
        "K channel (16 slots) / V token g16": (ch(16), tok(16), None),
        "K channel (32 slots) / V token g16": (ch(32), tok(16), None),
        "K int8 channel (chunk) / V token g32": (ch(width=8), tok(32), 8),
        "K int8 channel (chunk) / V token g64": (ch(width=8), tok(64), 8),
        "K token g32 / V token g32": (tok(32), tok(32), None),
        "K, V channel (chunk)": (ch(), lambda v, b: per_channel(v, b), None),
        "K channel before rotary / V token g32": (rope_channel, tok(32), None),
        "symmetric K channel / V token g32": (lambda k, f, b: per_channel(k, b, symmetric=True),
                                              lambda v, b: per_token(v, b, 32, symmetric=True), None),
    }
    emb = bb.model.get_input_embeddings()
    head = bb.tokenizer("You remember:", add_special_tokens=False)["input_ids"]
    question = bb.tokenizer("\nQuestion: what did I tell you about my pet? Answer:",
                            add_special_tokens=False)["input_ids"]

    def logprobs(pcs: list[torch.Tensor]) -> torch.Tensor:
        x = assemble(emb, [Layout(head, None, [KVPiece(p, N - p.shape[0])], question, []) for p in pcs], [], rot)
        with torch.inference_mode():
            h = dec(**x.forward_kwargs(), use_cache=False).last_hidden_state[:, -len(question):]
            return torch.log_softmax(bb.model.lm_head(h).float(), -1)

    ref = logprobs(pieces)

    def row(name: str, label: str, q: list[torch.Tensor], bits: str) -> dict[str, float]:
        err = [math.sqrt(sum(float((a[:, :, i] - p[:, :, i]).pow(2).sum()) for a, p in zip(q, pieces))
                         / sum(float(p[:, :, i].pow(2).sum()) for p in pieces)) for i in (0, 1)]
        lq = logprobs(q)
        kl = float((ref.exp() * (ref - lq)).sum(-1).mean())
        top1 = float((ref.argmax(-1) == lq.argmax(-1)).float().mean())
        print(f"{name:40s} {label:>5s} {bits:>20s} {err[0]:7.4f} {err[1]:7.4f} {kl:8.5f} {top1:6.3f}")
        return {"k_err": err[0], "v_err": err[1], "kl": kl, "top1": top1}

    values = sum(p[:, :, 0].numel() for p in pieces)  # keys (and as many values) stored
    print("bits: a stored value's code and its share of the float16 scales and minima, keys / values (mean)")
    print(f"{'scheme':40s} {'dtype':>5s} {'bits K / V (mean)':>20s} {'K err':>7s} {'V err':>7s} {'KL':>8s} "
          f"{'top-1':>6s}")
    for bits in (8, 4):
        for name, (fk, fv, kbits) in schemes.items():
            if bits == 8 and kbits is not None:
                continue
            ks = [fk(p[:, :, 0], N - c, bits) for p, c in zip(pieces, lens)]
            vs = [fv(p[:, :, 1], bits) for p in pieces]
            bk = (kbits or bits) + RANGE_BITS * sum(n for _, n in ks) / values
            bv = bits + RANGE_BITS * sum(n for _, n in vs) / values
            row(name, f"int{bits}" if kbits is None else f"{kbits}/{bits}",
                [torch.stack([k, v], 2) for (k, _), (v, _) in zip(ks, vs)],
                f"{bk:5.2f} / {bv:5.2f} ({(bk + bv) / 2:4.2f})")
    # the bank's own write and read of its settings: these rows equal the plain rows above
    bank_rows = {}
    for name, (label, _, scheme) in BANK_SCHEMES.items():
        q, b = bank_roundtrip(kv, lens, KVFormat(scheme, N))
        width = "8/4" if scheme.key_bits != scheme.value_bits else scheme.dtype[:5]
        bank_rows[name] = {"bits": b, **row(f"[bank code] {label}", width, q, f"({b:4.2f})")}

    one = [min(ids, key=lambda i: abs(len(i) - 41))]  # a chunk of ~40 tokens
    print(f"\nbytes of one chunk of {len(one[0])} tokens at n_cache {N} (keys, cache = hidden states + lengths, kv):")
    sizes = {}
    for label, fmt, hidden, cache_dtype in [
        ("float16, padded + float32 hidden cache (before)", KVFormat(KVScheme(), N, "padded"), True, torch.float32),
        ("float16, padded + float16 hidden cache (before, CUDA)", KVFormat(KVScheme(), N, "padded"), True,
         torch.float16),
        *[(f"{d}, ragged + float32 hidden cache", KVFormat(KVScheme(d), N), True, torch.float32)
          for d in ("float16", "int8", "int4")],
        *[(f"{label}, ragged", KVFormat(scheme, N), False, torch.float32)
          for label, _, scheme in BANK_SCHEMES.values()]]:
        t = encode_shard(dec, one, N, 1, bb.tokenizer.pad_token_id, cache_dtype, kv_format=fmt, hidden_cache=hidden)
        parts = bytes_by_part(t)
        sizes[label] = sum(parts.values())
        print(f"  {label:55s} {sizes[label]:>10,}  {parts}")
    if args.out:
        write_results(args.out, bank_rows, sizes, len(one[0]), len(pieces), N, argv)


def write_results(out: str, bank_rows: dict[str, dict[str, float]], sizes: dict[str, int], tokens: int,
                  chunks: int, n_cache: int, argv: list[str] | None) -> None:
    """docs/bank.md's table of schemes: each of ``BANK_SCHEMES`` with its bits, KL, top-1 and bytes a
    chunk of ``tokens`` tokens without the hidden cache, and those bytes over the layout's before."""
    before = sizes["float16, padded + float32 hidden cache (before)"]
    rows = {name: {**bank_rows[name], "scheme": label, "settings": settings, "bytes": sizes[f"{label}, ragged"],
                   "x_before": sizes[f"{label}, ragged"] / before}
            for name, (label, settings, _) in BANK_SCHEMES.items()}
    table = {"header": ["scheme", "settings", "bits a value", "KL", "top-1", f"bytes a {tokens}-token chunk",
                        "x before"],
             "rows": [[f"{{rows[{n}][scheme]}}", f"`{{rows[{n}][settings]}}`", f"{{rows[{n}][bits]:.2f}}",
                       f"{{rows[{n}][kl]:.5f}}", f"{{rows[{n}][top1]:.3f}}", f"{{rows[{n}][bytes]:,}}",
                       f"{{rows[{n}][x_before]:.2f}}"] for n in rows]}
    data = {"rows": rows, "bytes_before": before, "bytes_before_cuda": sizes[
        "float16, padded + float16 hidden cache (before, CUDA)"], "chunks": chunks, "n_cache": n_cache}
    write_json(out, {"provenance": f"SmolLM2-135M-Instruct's states of {chunks} persona chunks, written and read "
                                   f"by the bank's code; bytes of one {tokens}-token chunk without the hidden cache",
                     "data": data, "table": table}, __file__, argv)


if __name__ == "__main__":
    main()
