"""The math of a bank row: a chunk's key and content cache (DESIGN.md section 1.1).

For chunk i with final-layer states ``H_i`` [L_i, d] (``hidden_states[-1]``):
``key_i = H_i[L_i-1] / ||H_i[L_i-1]||`` and ``cache_i = H_i[max(0, L_i-N_c):]``,
stored right-aligned in an [N_c, d] slot with ``cache_len_i = min(L_i, N_c)``.
``bank.content_layer`` (a departure; manifest ``content_layer``, absent = -1) takes the cache
from another layer's states ``hidden_states[l]`` instead; the key stays as above.

Key variants (``bank.key``; departures from the paper, whose key is ``last``; the content
cache is always the paper's, from the plain chunk encoding): ``mean`` = mean of all
final-layer states; ``layer_mean`` = mean over the configured layers (``hidden_states[l]``,
0 = the input embeddings) of the L2-normalised mean of that layer's states at positions
1..L-1 (position 0, the attention sink, carries no chunk content and, from the middle
layers on, a state ~100x larger than the others); ``prompt`` = last final-layer state of the
chunk wrapped in ``bank.key_template`` (PromptEOL). ``key_spec`` gives the manifest's
``key`` record; ``pool_key`` / ``key_states`` compute a key from states / token ids, and the
model computes matching query states with the same functions (``memory.retrieval`` = the
variant's name).

(``elasticmem.bank.builder`` runs these over a corpus in shards.)

    python -m pytest -q tests/unit/test_bank.py
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from elasticmem.bank.kv import rotary_module, window_kv
from elasticmem.config import BankConfig


KEY_VARIANTS = ("last", "mean", "prompt", "layer_mean")
"""Bank key variants: 'last' is the paper's (DESIGN.md 1.1), the others are departures."""
PAPER_KEY = {"variant": "last"}
"""The ``key`` record of a bank built by the paper's definition (and of every bank built before
banks recorded their key)."""


def key_spec(bank_cfg: BankConfig) -> dict[str, Any]:
    """The manifest's ``key`` record for ``bank_cfg``: ``{"variant"}``, plus ``layers`` for
    ``layer_mean`` and ``template`` for ``prompt``."""
    v = bank_cfg.key
    if v not in KEY_VARIANTS:
        raise ValueError(f"bank.key must be one of {KEY_VARIANTS}, got {v!r}")
    if v == "layer_mean":
        if not bank_cfg.key_layers:
            raise ValueError("bank.key=layer_mean needs at least one layer in bank.key_layers")
        return {"variant": v, "layers": [int(x) for x in bank_cfg.key_layers]}
    if v == "prompt":
        if "{text}" not in bank_cfg.key_template:
            raise ValueError(f"bank.key_template must contain {{text}}, got {bank_cfg.key_template!r}")
        return {"variant": v, "template": bank_cfg.key_template}
    return {"variant": v}


def _right_pad(token_ids: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, L] right-padded, attention mask [B, L], lengths [B]."""
    lengths = torch.tensor([len(t) for t in token_ids], device=device)
    if int(lengths.min()) < 1:
        raise ValueError("every sequence needs at least one token")
    L = int(lengths.max())
    ids = torch.full((len(token_ids), L), pad_id, dtype=torch.long)
    for i, t in enumerate(token_ids):
        ids[i, : len(t)] = torch.as_tensor(t, dtype=torch.long)
    mask = (torch.arange(L, device=device)[None, :] < lengths[:, None]).long()
    return ids.to(device), mask, lengths


def pool_key(hidden_states: Sequence[torch.Tensor], lengths: torch.Tensor, spec: dict[str, Any]) -> torch.Tensor:
    """The key of each right-padded sequence under ``spec`` (``key_spec``), L2-normalised.

    Args:
        hidden_states: the model's ``hidden_states`` (every layer, [B, L, d] each; the last is
            the final-layer state after the norm); for variants other than ``layer_mean`` a
            1-tuple holding only the final layer is enough.
        lengths: [B] valid lengths (positions >= length are padding).
    Returns: [B, d] float32. ``last`` / ``prompt``: the state at position L-1 (for ``prompt``
    the sequence is the wrapped chunk); ``mean``: mean of the final layer over positions 0..L-1;
    ``layer_mean``: mean over ``spec["layers"]`` of the L2-normalised mean of that layer over
    positions 1..L-1 (0..L-1 when L = 1).
    """
    H = hidden_states[-1]
    B, L = H.shape[:2]
    pos = torch.arange(L, device=H.device)[None, :]
    variant = spec["variant"]
    if variant in ("last", "prompt"):
        out = H[torch.arange(B, device=H.device), lengths - 1].float()
    elif variant == "mean":
        w = (pos < lengths[:, None]).float()[:, :, None]
        out = (H.float() * w).sum(1) / w.sum(1)
    elif variant == "layer_mean":
        w = ((pos < lengths[:, None]) & ((pos >= 1) | (lengths[:, None] == 1))).float()[:, :, None]
        out = 0
        for layer in spec["layers"]:
            m = (hidden_states[layer].float() * w).sum(1) / w.sum(1)
            out = out + torch.nn.functional.normalize(m, dim=-1)
        out = out / len(spec["layers"])
    else:
        raise ValueError(f"unknown key variant {variant!r} (one of {KEY_VARIANTS})")
    return torch.nn.functional.normalize(out, dim=-1)


def key_states(decoder: torch.nn.Module, token_ids: Sequence[Sequence[int]], spec: dict[str, Any],
               pad_id: int) -> torch.Tensor:
    """Keys [B, d] (float32, L2-normalised) of B token sequences encoded alone (right padding,
    so no result depends on the batch): ``pool_key`` of the decoder's states. For ``prompt``
    the sequences must already be wrapped (``prompt_key_ids``)."""
    device = next(decoder.parameters()).device
    ids, mask, lengths = _right_pad(token_ids, pad_id, device)
    every = spec["variant"] == "layer_mean"
    out = decoder(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=every)
    return pool_key(out.hidden_states if every else (out.last_hidden_state,), lengths, spec)


def prompt_key_ids(tokenizer, texts: Sequence[str], token_ids: Sequence[Sequence[int]], template: str,
                   max_tokens: int, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each chunk wrapped in ``template`` (its ``{text}`` replaced by the chunk): the
    chunk's text, or, when its tokens reached the cap ``max_tokens`` (it may have been cut), the
    decoded capped tokens, so the wrapped text holds what the bank holds and the template's end
    is never cut off."""
    out = []
    for text, ids in zip(texts, token_ids):
        if len(ids) >= max_tokens:
            text = tokenizer.decode(list(ids), skip_special_tokens=True)
        out.append(tokenizer(template.replace("{text}", text), add_special_tokens=add_special_tokens)["input_ids"])
    return out


def encode_batch(
    decoder: torch.nn.Module, token_ids: Sequence[Sequence[int]], n_cache: int, pad_id: int,
    key: dict[str, Any] | None = None, key_ids: Sequence[Sequence[int]] | None = None,
    content_layer: int = -1, kv: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Keys and content caches of a batch of chunks.

    Args:
        decoder: the base transformer (``model.get_decoder()``) whose ``last_hidden_state``
            equals ``hidden_states[-1]`` of the causal LM (after the final norm).
        token_ids: B lists of token ids, lengths L_i >= 1.
        key: the key variant (``key_spec``); None = the paper's ``last``.
        key_ids: for ``prompt`` keys, the B wrapped sequences (``prompt_key_ids``).
        content_layer: the ``hidden_states`` index the cache takes its states from (-1 = the
            final layer, the paper; ``bank.content_layer``).
        kv: also return every layer's keys and values at the same positions (``bank.kv_cache``).
    Returns:
        keys [B, d] float32 L2-normalised; cache [B, n_cache, d] in the model dtype,
        valid states right-aligned, zeros elsewhere; cache_len [B] int32; with ``kv``, then
        kv [B, n_cache, layers, 2, H_kv, hd] (``elasticmem.bank.kv.window_kv``).
    """
    key = key or PAPER_KEY
    device = next(decoder.parameters()).device
    ids, mask, lengths = _right_pad(token_ids, pad_id, device)
    every = key["variant"] == "layer_mean" or content_layer != -1
    out = decoder(input_ids=ids, attention_mask=mask, use_cache=kv, output_hidden_states=every)
    H = out.last_hidden_state  # [B, L, d]
    C = H if content_layer == -1 else out.hidden_states[content_layer]
    if key["variant"] == "prompt":
        if key_ids is None or len(key_ids) != len(token_ids):
            raise ValueError("prompt keys need the wrapped token ids of every chunk (key_ids)")
        keys = key_states(decoder, key_ids, key, pad_id)
    else:
        keys = pool_key(out.hidden_states if every else (H,), lengths, key)
    pos = lengths[:, None] - n_cache + torch.arange(n_cache, device=device)[None, :]  # [B, n_cache]
    valid = pos >= 0
    cache = torch.gather(C, 1, pos.clamp(min=0)[:, :, None].expand(-1, -1, C.shape[-1]))
    cache = cache * valid[:, :, None].to(cache.dtype)
    cache_len = lengths.clamp(max=n_cache).to(torch.int32)
    if kv:
        return keys, cache, cache_len, window_kv(out.cache, lengths, n_cache, rotary_module(decoder))
    return keys, cache, cache_len
