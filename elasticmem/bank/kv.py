"""Per-layer key/value content of memory chunks (``bank.kv_cache``; a departure from the paper).

The paper's content cache holds a chunk's last ``N_c`` final-layer states, which a projector maps
into input embeddings. With ``bank.kv_cache`` the bank also keeps, for the same ``N_c``
positions, every layer's attention keys and values as the frozen encoder computed them over the
chunk alone. A reasoner with ``memory.content=kv`` attends to them directly, with no projector:
for those positions it reads what it would read from the chunk's text (each state computed with
the whole chunk as context, not with the reader's prompt).

Position 0 of a chunk encoded alone is the encoder's attention sink (from the middle layers on its
states are ~100x larger than the others' and carry no content): a reader that met it in the
middle of its input would have a second sink there. It is never stored: a window that reaches
the chunk's start holds zeros in that slot, and a chunk of L tokens has ``min(N_c, L - 1)``
readable slots (``Bank.kv_lengths``).

Keys carry rotary position embeddings of their positions in the chunk. They are stored
re-rotated to one frame, slot ``s`` of the ``N_c`` slots at position ``s`` (so a chunk's last
state sits at ``N_c - 1`` whatever the chunk's length), and rotated again when read, to the
positions the reader places them at (``rotate_keys``). Rotary embedding turns each pair of
dimensions by an angle linear in the position, so a key at position ``p`` rotated by ``d`` equals
the key computed at ``p + d``; values carry no position.

Test with::

    pytest tests/unit/test_kv_content.py
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def kv_spec(config: Any) -> dict[str, int]:
    """The manifest's ``kv`` record for a model config: layers, KV heads and head width."""
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}


def rotary_module(decoder: nn.Module) -> nn.Module:
    """The decoder's rotary embedding (``decoder.rotary_emb``: Llama, Qwen2, Mistral, ...); a
    clear error for models without one (absolute positions cannot be moved by rotation)."""
    rot = getattr(decoder, "rotary_emb", None)
    if rot is None:
        raise ValueError(f"{type(decoder).__name__} has no rotary_emb: per-layer KV memories (bank.kv_cache, "
                         "memory.content=kv) need a model with rotary position embeddings")
    return rot


def _rotate_half(x: Tensor) -> Tensor:
    # the rotate_half convention of Llama/Qwen2 (GPT-NeoX style): pairs (i, i + hd/2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotate_keys(keys: Tensor, delta: Tensor, rotary: nn.Module) -> Tensor:
    """Keys moved by ``delta`` positions: rotary embedding applied at angle ``delta``.

    Args:
        keys: [B, H, T, hd] post-rotary keys (any float dtype).
        delta: [B] or [B, T] long, positions to move by (may be negative).
        rotary: the model's rotary embedding module (``rotary_module``), whose
            ``forward(x, position_ids)`` gives cos and sin [B, T, hd].
    Returns: [B, H, T, hd] in ``keys``' dtype, computed in float32.
    """
    B, _, T, hd = keys.shape
    pos = delta.to(keys.device, torch.long)
    pos = pos[:, None].expand(B, T) if pos.dim() == 1 else pos
    cos, sin = rotary(keys.float(), position_ids=pos)
    # attention_scaling (YaRN, LongRoPE) scales q and k once, in the encoder; do not apply it twice
    scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    cos, sin = cos.float()[:, None] / scale, sin.float()[:, None] / scale
    if cos.shape[-1] != hd:
        raise ValueError(f"rotary embedding of width {cos.shape[-1]} for keys of width {hd}: partial rotary "
                         "embeddings are not supported for KV memories")
    k = keys.float()
    return (k * cos + _rotate_half(k) * sin).to(keys.dtype)


def window_kv(cache, lengths: Tensor, n_cache: int, rotary: nn.Module) -> Tensor:
    """Every layer's keys and values at each right-padded sequence's last ``n_cache`` positions.

    Args:
        cache: the decoder's ``Cache`` after a forward over the batch (``use_cache=True``);
            ``cache.layers[l].keys`` / ``.values`` [B, H_kv, L, hd].
        lengths: [B] valid lengths (right padding).
    Returns: [B, n_cache, layers, 2, H_kv, hd] (index 0 keys, 1 values), positions 1..L-1
    right-aligned as in the content cache (zeros before them and for position 0, the attention
    sink), keys re-rotated so that slot ``s`` sits at position ``s`` (module docstring).
    """
    layers = cache.layers
    k0 = layers[0].keys
    B, device = k0.shape[0], k0.device
    lengths = lengths.to(device)
    slots = torch.arange(n_cache, device=device)
    pos = lengths[:, None] - n_cache + slots[None, :]  # [B, n_cache] chunk position of each slot
    valid = pos >= 1  # position 0: the sink, not stored
    idx = pos.clamp(min=0)[:, None, :, None]
    delta = (n_cache - lengths)[:, None].expand(B, n_cache)  # slot s = chunk position p + (n_cache - L)
    out = []
    for layer in layers:
        k = torch.gather(layer.keys, 2, idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1]))
        v = torch.gather(layer.values, 2, idx.expand(-1, layer.values.shape[1], -1, layer.values.shape[-1]))
        k = rotate_keys(k, delta, rotary)
        out.append(torch.stack([k, v], 1))  # [B, 2, H_kv, n_cache, hd]
    kv = torch.stack(out, 1).permute(0, 4, 1, 2, 3, 5)  # [B, n_cache, layers, 2, H_kv, hd]
    return kv * valid[:, :, None, None, None, None].to(kv.dtype)


__all__ = ["kv_spec", "rotary_module", "rotate_keys", "window_kv"]
