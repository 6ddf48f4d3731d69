"""Integer storage of per-layer keys and values (``bank.kv_dtype`` int8 / int4): the KIVI layout.

Keys are quantized per channel: each (layer, KV head, channel) of a chunk gets one scale and one
minimum over the chunk's stored slots. Values are quantized per token: each slot's (layer, KV
head) row of ``head_dim`` channels is cut into groups of ``group_size`` channels, each with its
own scale and minimum. Both are asymmetric min-max codes ``q = round((x - min) / scale)`` in
``0..2^bits - 1`` (``scale = (max - min) / (2^bits - 1)``), dequantized as ``min + q * scale``;
scales and minima are stored as float16. int4 codes are packed two to a byte along the channels
(channel ``2j`` in the low nibble, ``2j + 1`` in the high one).

Why this layout (measured on SmolLM2-135M-Instruct, 24 persona chunks of 36-56 tokens at
``n_cache=64``, ``benchmarks/kv_quant_error.py``): keys have a few channels of large magnitude
(outlier channels), so a per-channel range fits them and a per-token range, spread over all
channels, does not; values have no such channels. Relative Frobenius error of keys / values,
and the mean KL (nats) of a reader's next-token distributions over a 14-token question after
one chunk read as KV memory (``memory.content=kv``), against the float16 states:

====================================== ================= ================= =========
scheme                                  int8 K / V        int4 K / V        int4 KL
====================================== ================= ================= =========
K per channel (chunk), V per token g32  0.0026 / 0.0048   0.044 / 0.081     0.0054
K per channel (chunk), V per token g64  0.0026 / 0.0056   0.044 / 0.095     0.0057
K per channel (chunk), V per token g16  0.0026 / 0.0039   0.044 / 0.066     0.0049
K per channel (16 slots), V g32         0.0018 / 0.0048   0.030 / 0.081     0.0034
K per token g32, V per token g32        0.0060 / 0.0048   0.102 / 0.081     0.0167
K, V per channel (chunk)                0.0026 / 0.0049   0.044 / 0.083     0.0076
K per channel before rotary, V g32      0.0023 / 0.0048   0.039 / 0.081     0.0053
symmetric (absmax) K ch., V tok. g32    0.0040 / 0.0057   0.072 / 0.104     0.0197
====================================== ================= ================= =========

(int8: KL <= 6e-5 for every scheme, top-1 agreement >= 0.997; int4: 0.95 to 0.985.) Per-token
keys are 2-3x worse than per-channel ones (the KL 3x higher), while values gain nothing from
per-channel ranges; undoing the rotary embedding first (stable outlier channels) gains little and
would need the model's rotary embedding at every read. Key ranges per 16 slots lower the int4 KL
by a third but cost 2 bits a key instead of ~0.7 (a float16 scale and minimum per 16 values
instead of per chunk); one range per chunk keeps the keys' scales a row of the shard
(``elasticmem.bank.kv_store``). Groups of 32 value channels (1 bit of overhead a value) sit
between 64 (0.5 bit, more error) and 16 (2 bits, ``bank.kv_group_size=16``).

Why written here and not taken from a library: transformers' quantized KV caches use
optimum-quanto or HQQ, neither of which is installed, and both quantize a live cache layer by
layer as generation appends to it (HQQ fits its ranges by an optimisation per call); a bank
stores each chunk once and reads arbitrary slots of it back on any device, which needs only the
min-max codes above. The float16 states are what is quantized (the input is rounded to float16
first), so converting a float16 bank gives the bytes a build at this dtype writes.

    pytest tests/unit/test_kv_quant.py
"""

from __future__ import annotations

import torch
from torch import Tensor

BITS = {"int8": 8, "int4": 4}
"""Code width of each integer ``bank.kv_dtype``."""
SCHEME = "kivi"
"""The manifest's name for this layout (keys per channel over a chunk, values per token in groups)."""


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


def quantize_slots(x: Tensor, chunk: Tensor, n_chunks: int, bits: int, group_size: int) -> dict[str, Tensor]:
    """Quantize the stored slots of ``n_chunks`` chunks.

    Args:
        x: [S, layers, 2, H, hd] float keys (index 0) and values of every slot, chunk after chunk.
        chunk: [S] long, the chunk (0..n_chunks-1) of each slot.
    Returns: ``codes`` [S, layers, 2, H, hd * bits / 8] uint8; ``v_scale``, ``v_min``
    [S, layers, H, hd / group_size] float16 (values, per slot and group); ``k_scale``, ``k_min``
    [n_chunks, layers, H, hd] float16 (keys, per chunk and channel; zeros for a chunk of no slot).
    """
    x = x.to(torch.float16).float()  # the float16 states are what is quantized (module docstring)
    chunk = chunk.to(x.device)
    S, layers, _, H, hd = x.shape
    k, v = x[:, :, 0], x[:, :, 1]
    idx = chunk[:, None, None, None].expand_as(k)
    zeros = torch.zeros(n_chunks, layers, H, hd, device=x.device)
    k_scale, k_min = _range(zeros.scatter_reduce(0, idx, k, "amin", include_self=False),
                            zeros.scatter_reduce(0, idx, k, "amax", include_self=False), bits)
    kq = _quantize(k, k_scale[chunk], k_min[chunk], bits)
    vg = v.reshape(S, layers, H, hd // group_size, group_size)
    v_scale, v_min = _range(vg.amin(-1), vg.amax(-1), bits)
    vq = _quantize(vg, v_scale[..., None], v_min[..., None], bits)
    codes = torch.stack([kq, vq.reshape(k.shape)], 2)
    return {"codes": pack_int4(codes) if bits == 4 else codes, "v_scale": v_scale, "v_min": v_min,
            "k_scale": k_scale, "k_min": k_min}


def dequantize_slots(codes: Tensor, v_scale: Tensor, v_min: Tensor, k_scale: Tensor, k_min: Tensor, bits: int,
                     group_size: int, dtype: torch.dtype = torch.float16) -> Tensor:
    """Inverse of ``quantize_slots`` for slots whose chunks' key ranges are given per slot.

    Args:
        codes: [S, layers, 2, H, hd * bits / 8] uint8; v_scale, v_min: [S, layers, H, hd / group_size];
        k_scale, k_min: [S, layers, H, hd], each slot's chunk's key ranges (repeated per slot).
    Returns: [S, layers, 2, H, hd] in ``dtype``, computed in float32 on ``codes``' device.
    """
    q = (unpack_int4(codes) if bits == 4 else codes).float()
    k = k_min.float() + q[:, :, 0] * k_scale.float()
    S, layers, H, hd = k.shape
    vq = q[:, :, 1].reshape(S, layers, H, hd // group_size, group_size)
    v = (v_min.float()[..., None] + vq * v_scale.float()[..., None]).reshape(k.shape)
    return torch.stack([k, v], 2).to(dtype)


__all__ = ["BITS", "SCHEME", "dequantize_slots", "pack_int4", "quantize_slots", "unpack_int4"]
