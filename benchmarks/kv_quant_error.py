"""Per-layer KV quantization schemes on real SmolLM2 states: reconstruction error, reader KL, bytes a chunk.

    python -m elasticmem.backbone fetch smollm2          # once
    OMP_NUM_THREADS=1 python benchmarks/kv_quant_error.py                 # 24 persona chunks, ~15 s on 1 core
    OMP_NUM_THREADS=1 python benchmarks/kv_quant_error.py --chunks 48 --n-cache 64

Encodes persona chunks (the quickstart's task) with SmolLM2-135M-Instruct as a build does
(``encode_batch``, float16 states, position 0 left out), then, for int8 and int4 and each scheme
below, reports the relative Frobenius error of the keys and of the values against the float16
states, and the mean KL (nats) of a reader's next-token distributions over a question after one
chunk read as KV memory (``elasticmem.model.injection.assemble``, as ``memory.content=kv``
reads), with its top-1 agreement. The schemes are written here with plain tensor ops (min-max
codes, float16 scales and minima, as the bank stores them), apart from the bank's own code, whose
scheme is the first row (``elasticmem.bank.quant``, where the table is quoted). Last, the bytes a
chunk of about 40 tokens takes in each storage (``elasticmem.bank.kv_store``, the bank's code).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
import _bench  # noqa: E402,F401  (puts this checkout's root on sys.path)
from elasticmem.backbone import load_backbone  # noqa: E402
from elasticmem.bank.builder import collect_groups, encode_shard  # noqa: E402
from elasticmem.bank.encoding import encode_batch  # noqa: E402
from elasticmem.bank.kv import rotary_module, rotate_keys  # noqa: E402
from elasticmem.bank.kv_store import KVFormat, bytes_by_part  # noqa: E402
from elasticmem.config import BackboneConfig, SyntheticConfig  # noqa: E402
from elasticmem.data.chunking import chunk_history, tokenize_chunks  # noqa: E402
from elasticmem.data.synthetic import generate  # noqa: E402
from elasticmem.model.injection import KVPiece, Layout, assemble  # noqa: E402


def minmax(x: torch.Tensor, dims: tuple[int, ...], bits: int, symmetric: bool = False) -> torch.Tensor:
    """``x`` read back after min-max codes over ``dims`` (one range per the other indices)."""
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (x.abs().amax(dim=dims, keepdim=True) / qmax).half().float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (x / safe).round().clamp(-qmax - 1, qmax) * scale
    lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    qmax = 2 ** bits - 1
    scale, lo = ((hi - lo) / qmax).half().float(), lo.half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return lo + ((x - lo) / safe).round().clamp(0, qmax) * scale


def per_token(x: torch.Tensor, bits: int, group: int, symmetric: bool = False) -> torch.Tensor:
    """[c, layers, H, hd]: a range per slot and group of ``group`` channels."""
    c, L, H, hd = x.shape
    return minmax(x.reshape(c, L, H, hd // group, group), (-1,), bits, symmetric).reshape(x.shape)


def per_channel(x: torch.Tensor, bits: int, slots: int | None = None, symmetric: bool = False) -> torch.Tensor:
    """[c, layers, H, hd]: a range per channel over the chunk's slots (or over runs of ``slots``)."""
    if slots is None:
        return minmax(x, (0,), bits, symmetric)
    return torch.cat([minmax(x[i:i + slots], (0,), bits, symmetric) for i in range(0, x.shape[0], slots)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--n-cache", type=int, default=64)
    args = ap.parse_args()
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

    schemes = {
        "K channel (chunk) / V token g32 [bank]": (lambda k, f, b: per_channel(k, b), lambda v, b: per_token(v, b, 32)),
        "K channel (chunk) / V token g64": (lambda k, f, b: per_channel(k, b), lambda v, b: per_token(v, b, 64)),
        "K channel (chunk) / V token g16": (lambda k, f, b: per_channel(k, b), lambda v, b: per_token(v, b, 16)),
        "K channel (16 slots) / V token g32": (lambda k, f, b: per_channel(k, b, 16), lambda v, b: per_token(v, b, 32)),
        "K token g32 / V token g32": (lambda k, f, b: per_token(k, b, 32), lambda v, b: per_token(v, b, 32)),
        "K, V channel (chunk)": (lambda k, f, b: per_channel(k, b), lambda v, b: per_channel(v, b)),
        "K channel before rotary / V token g32": (lambda k, f, b: pre_rope(per_channel(pre_rope(k, f, -1), b), f, 1),
                                                  lambda v, b: per_token(v, b, 32)),
        "symmetric K channel / V token g32": (lambda k, f, b: per_channel(k, b, symmetric=True),
                                              lambda v, b: per_token(v, b, 32, symmetric=True)),
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
    print(f"{'scheme':42s} {'bits':>4s} {'K err':>7s} {'V err':>7s} {'KL':>8s} {'top-1':>6s}")
    for bits in (8, 4):
        for name, (fk, fv) in schemes.items():
            q = [torch.stack([fk(p[:, :, 0], N - c, bits), fv(p[:, :, 1], bits)], 2) for p, c in zip(pieces, lens)]
            err = [math.sqrt(sum(float((a[:, :, i] - p[:, :, i]).pow(2).sum()) for a, p in zip(q, pieces))
                             / sum(float(p[:, :, i].pow(2).sum()) for p in pieces)) for i in (0, 1)]
            lq = logprobs(q)
            kl = float((ref.exp() * (ref - lq)).sum(-1).mean())
            top1 = float((ref.argmax(-1) == lq.argmax(-1)).float().mean())
            print(f"{name:42s} {bits:4d} {err[0]:7.4f} {err[1]:7.4f} {kl:8.5f} {top1:6.3f}")

    one = [min(ids, key=lambda i: abs(len(i) - 41))]  # a chunk of ~40 tokens
    print(f"\nbytes of one chunk of {len(one[0])} tokens at n_cache {N} (keys, cache = hidden states + lengths, kv):")
    for label, fmt, hidden, cache_dtype in [
        ("float16, padded + float32 hidden cache (before)", KVFormat("float16", N, "padded"), True, torch.float32),
        ("float16, padded + float16 hidden cache (before, CUDA)", KVFormat("float16", N, "padded"), True,
         torch.float16),
        *[(f"{d}, ragged{' + float32 hidden cache' if h else ''}", KVFormat(d, N, "ragged", 32 if d[0] == "i" else 0),
           h, torch.float32) for d in ("float16", "int8", "int4") for h in (True, False)]]:
        t = encode_shard(dec, one, N, 1, bb.tokenizer.pad_token_id, cache_dtype, kv_format=fmt, hidden_cache=hidden)
        parts = bytes_by_part(t)
        print(f"  {label:55s} {sum(parts.values()):>10,}  {parts}")


if __name__ == "__main__":
    main()
