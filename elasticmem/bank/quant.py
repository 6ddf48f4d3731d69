"""Integer storage of per-layer keys and values (``bank.kv_dtype`` int8 / int4): the KIVI layout.

Keys are quantized per channel: each (layer, KV head, channel) of a chunk gets one scale and one
minimum over the chunk's stored slots, or, with ``bank.kv_key_group`` G > 0, over each run of G
slots from the chunk's oldest (the newest run may be shorter); at the values' width, or at their
own with ``bank.kv_key_dtype`` (int8 keys over int4 values: K8V4). Values are quantized per token:
each slot's (layer, KV head) row of ``head_dim`` channels is cut into groups of ``group_size``
channels, each with its own scale and minimum. Both are asymmetric min-max codes
``q = round((x - min) / scale)`` in ``0..2^bits - 1`` (``scale = (max - min) / (2^bits - 1)``),
dequantized as ``min + q * scale``; scales and minima are stored as float16. int4 codes are packed
two to a byte along the channels (channel ``2j`` in the low nibble, ``2j + 1`` in the high one).

Why this layout (measured on SmolLM2-135M-Instruct, 24 persona chunks of 36-56 tokens at
``n_cache=64``, ``benchmarks/kv_quant_error.py``): keys have a few channels of large magnitude
(outlier channels), so a per-channel range fits them and a per-token range, spread over all
channels, does not; values have no such channels. Relative Frobenius error of keys / values,
the bits an int4 value takes (its code and its share of the scales and minima, mean of keys and
values, as the bank stores them: ceil(64 / G) key runs a chunk, filled or not), and the mean KL
(nats) of a reader's next-token distributions over a 14-token question after one chunk read as
KV memory (``memory.content=kv``), against the float16 states:

======================================== ================= ================= ====== =======
scheme                                    int8 K / V        int4 K / V        bits   int4 KL
======================================== ================= ================= ====== =======
K per channel (chunk), V per token g32    0.0026 / 0.0048   0.044 / 0.081     4.85   0.0054
K per channel (chunk), V per token g64    0.0026 / 0.0056   0.044 / 0.095     4.60   0.0057
K per channel (chunk), V per token g16    0.0026 / 0.0039   0.044 / 0.066     5.35   0.0049
K per channel (32 slots), V g32           0.0022 / 0.0048   0.037 / 0.081     5.19   0.0046
K per channel (16 slots), V g32           0.0018 / 0.0048   0.030 / 0.081     5.88   0.0034
K per channel (16 slots), V g64           0.0018 / 0.0056   0.030 / 0.095     5.63   0.0043
K per channel (16 slots), V g16           0.0018 / 0.0039   0.030 / 0.066     6.38   0.0032
K per channel (8 slots), V g32            0.0013 / 0.0048   0.022 / 0.081     7.27   0.0021
K int8 per channel (chunk), V int4 g32 *                    0.0026 / 0.081    6.85   0.0012
K int8 per channel (chunk), V int4 g64                      0.0026 / 0.095    6.60   0.0017
K per token g32, V per token g32          0.0060 / 0.0048   0.102 / 0.081     5.00   0.0167
K, V per channel (chunk)                  0.0026 / 0.0049   0.044 / 0.083     4.69   0.0076
K per channel before rotary, V g32        0.0023 / 0.0048   0.039 / 0.081     4.85   0.0053
symmetric (absmax) K ch., V tok. g32      0.0040 / 0.0057   0.072 / 0.104     4.85   0.0197
======================================== ================= ================= ====== =======

(int8: KL <= 6e-5 for every scheme, top-1 agreement >= 0.997; int4: 0.95 to 0.997; * =
``bank.kv_dtype=int4 bank.kv_key_dtype=int8``, top-1 0.997, against int4's 0.982.) Per-token
keys are 2-3x worse than per-channel ones (the KL 3x higher), while values gain nothing from
per-channel ranges; undoing the rotary embedding first (stable outlier channels) gains little and
would need the model's rotary embedding at every read. The keys' error is what the KL follows:
narrower key ranges lower it more per bit than finer value groups. Of the schemes at <= 6 bits a
value, key ranges per 16 slots with value groups of 32 (``bank.kv_key_group=16``) have the lowest
KL, 37 % under one range per chunk (0.0034 against 0.0054) for 1 bit a value more (2.1 a key: a
float16 scale and minimum per run of 16 values, 4 runs a chunk at 64 slots, where one range per
chunk costs ~0.7); the default stays one range per chunk (``kv_key_group=0``), as banks were
built. Keys at int8 with int4 values (``bank.kv_key_dtype=int8``, K8V4) lower the KL 5x (0.0012,
top-1 0.997: int8's agreement) at 6.85 bits a value, the most accurate int4-class setting
measured, for fewer bits than key runs of 8 slots (0.0021 at 7.27): 390,392 bytes a 40-token
chunk, 0.24x the 1.62 MB of the layout banks were built in before (``docs/bank.md``). The two
widths are stored as two codes tensors (``elasticmem.bank.kv_store``). Groups of 32 value
channels (1 bit of overhead a value) sit between 64 (0.5 bit, more error) and 16 (2 bits,
``bank.kv_group_size=16``).

Why written here and not taken from a library: transformers' quantized KV caches use
optimum-quanto or HQQ, neither of which is installed, and both quantize a live cache layer by
layer as generation appends to it (HQQ fits its ranges by an optimisation per call); a bank
stores each chunk once and reads arbitrary slots of it back on any device, which needs only the
min-max codes above. The float16 states are what is quantized (the input is rounded to float16
first), so converting a float16 bank gives the bytes a build at this dtype writes.

    pytest tests/unit/test_kv_quant.py
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from elasticmem.config import KVScheme

SCHEME = "kivi"
"""The manifest's name for this layout (keys per channel over a chunk, or over runs of ``kv.key_group``
slots, maybe at their own width ``kv.key_dtype``; values per token in groups)."""


def _range(lo: Tensor, hi: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """float16 scale and minimum of min-max codes over ``[lo, hi]`` (same shapes)."""
    return ((hi - lo) / (2 ** bits - 1)).to(torch.float16), lo.to(torch.float16)


def _quantize(x: Tensor, scale: Tensor, lo: Tensor, bits: int) -> Tensor:
    """uint8 codes of ``x`` with the float16 ``scale`` and ``lo`` the reader will use (broadcast to ``x``)."""
    s = scale.float()
    # a constant range (one slot, or a purged row) has scale 0: every code is 0, read back as the minimum
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round((x - lo.float()) / safe).clamp_(0, 2 ** bits - 1).to(torch.uint8)


def pack_int4(q: Tensor) -> Tensor:
    """[..., 2n] codes in 0..15 -> [..., n] uint8, channel 2j in the low nibble."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(p: Tensor) -> Tensor:
    """Inverse of ``pack_int4``: [..., n] uint8 -> [..., 2n] uint8."""
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)


def _pack(q: Tensor, bits: int) -> Tensor:
    return pack_int4(q) if bits == 4 else q


def _unpack(codes: Tensor, bits: int) -> Tensor:
    """float32 codes of ``codes`` stored at ``bits``."""
    return (unpack_int4(codes) if bits == 4 else codes).float()


def key_ranges(slots: int, key_group: int) -> int:
    """Key ranges a chunk of at most ``slots`` stored slots keeps: one per run of ``key_group``
    slots (``bank.kv_key_group``), one for the whole chunk when ``key_group`` is 0."""
    return -(-slots // key_group) if key_group else 1


def key_range_of(pos: Tensor, key_group: int) -> Tensor:
    """[S] long: the key range of each slot from its place ``pos`` [S] among its chunk's stored
    slots (0 = the oldest); runs of ``key_group`` start at the oldest slot, so only the newest run
    may be short, and a slot's range does not depend on how many slots a reader takes."""
    return pos // key_group if key_group else torch.zeros_like(pos)


def quantize_slots(x: Tensor, key_range: Tensor, n_ranges: int, scheme: KVScheme) -> dict[str, Tensor]:
    """Quantize stored slots whose keys share ``n_ranges`` per-channel ranges, as ``scheme`` (an
    integer one) says: keys at ``scheme.key_bits``, values at ``scheme.value_bits`` in groups of
    ``scheme.group_size`` channels.

    Args:
        x: [S, layers, 2, H, hd] float keys (index 0) and values of every slot, chunk after chunk.
        key_range: [S] long, the key range (0..n_ranges-1) of each slot: its chunk for KIVI, its
            chunk's run of ``bank.kv_key_group`` slots otherwise (``elasticmem.bank.kv_store``).
    Returns: ``k_codes``, ``v_codes`` [S, layers, H, hd * bits / 8] uint8 (each at its own width);
    ``v_scale``, ``v_min`` [S, layers, H, hd / group_size] float16 (values, per slot and group);
    ``k_scale``, ``k_min`` [n_ranges, layers, H, hd] float16 (keys, per range and channel; zeros for
    a range of no slot).
    """
    kb, vb, group = scheme.key_bits, scheme.value_bits, scheme.group_size
    x = x.to(torch.float16).float()  # the float16 states are what is quantized (module docstring)
    key_range = key_range.to(x.device)
    S, layers, _, H, hd = x.shape
    k, v = x[:, :, 0], x[:, :, 1]
    idx = key_range[:, None, None, None].expand_as(k)
    zeros = torch.zeros(n_ranges, layers, H, hd, device=x.device)
    k_scale, k_min = _range(zeros.scatter_reduce(0, idx, k, "amin", include_self=False),
                            zeros.scatter_reduce(0, idx, k, "amax", include_self=False), kb)
    kq = _quantize(k, k_scale[key_range], k_min[key_range], kb)
    vg = v.reshape(S, layers, H, hd // group, group)
    v_scale, v_min = _range(vg.amin(-1), vg.amax(-1), vb)
    vq = _quantize(vg, v_scale[..., None], v_min[..., None], vb).reshape(k.shape)
    return {"k_codes": _pack(kq, kb), "v_codes": _pack(vq, vb), "v_scale": v_scale, "v_min": v_min,
            "k_scale": k_scale, "k_min": k_min}


def dequantize_slots(q: Mapping[str, Tensor], scheme: KVScheme, dtype: torch.dtype = torch.float16) -> Tensor:
    """Inverse of ``quantize_slots`` for slots whose key ranges are given per slot.

    Args:
        q: ``k_codes``, ``v_codes`` [S, layers, H, hd * bits / 8] uint8; ``v_scale``, ``v_min``
            [S, layers, H, hd / group_size]; ``k_scale``, ``k_min`` [S, layers, H, hd], each slot's
            key range (repeated per slot).
    Returns: [S, layers, 2, H, hd] in ``dtype``, computed in float32 on the codes' device.
    """
    k = q["k_min"].float() + _unpack(q["k_codes"], scheme.key_bits) * q["k_scale"].float()
    S, layers, H, hd = k.shape
    vq = _unpack(q["v_codes"], scheme.value_bits).reshape(S, layers, H, hd // scheme.group_size, scheme.group_size)
    v = (q["v_min"].float()[..., None] + vq * q["v_scale"].float()[..., None]).reshape(k.shape)
    return torch.stack([k, v], 2).to(dtype)


__all__ = ["KVScheme", "SCHEME", "dequantize_slots", "key_range_of", "key_ranges", "pack_int4",
           "quantize_slots", "unpack_int4"]
