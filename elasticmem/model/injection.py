"""Soft-token injection: assemble ``[prompt][a][Z_1][sep]...[Z_Z][sep][suffix][answer]`` as input embeddings.

Every trajectory has its own number of soft tokens, so sequences differ in
length; they are left-padded (generation appends on the right) with an
attention mask and position ids that count only real tokens, so a padded row
computes exactly what the same row would alone. Memories with no soft tokens
leave no trace, not even a separator (DESIGN.md section 1 item 5).

Per-layer KV memories (``memory.content=kv``, a departure: ``elasticmem.bank.kv``) take the
same places in the sequence, but as keys and values every layer attends to rather than as
input embeddings: ``assemble`` then puts the text tokens (prompt, a, separators, suffix,
answer) in ``embeds`` with their positions, the memories' keys (rotated to the positions
they occupy) and values in a KV cache that the forward pass starts from, and builds the 4D
attention mask in which each text token sees the memory slots and text tokens before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from elasticmem.bank.kv import rotate_keys


@dataclass
class KVPiece:
    """One memory read as per-layer keys and values (``memory.content=kv``)."""

    kv: torch.Tensor
    """[c, layers, 2, H_kv, hd], c >= 1: keys (index 0) and values of its c slots, oldest first."""
    first: int
    """Position of slot 0 in the frame its keys are rotated to (the bank's window frame:
    ``n_cache - c`` for the last c slots)."""


@dataclass
class Layout:
    """The parts of one trajectory's input, before embedding."""

    prompt: list[int]
    """Token ids of prompt(q)."""
    control: int | None
    """The retrieval-control token a, or None in modes without one."""
    memories: list[Any]
    """Per injected memory, rank order: projected soft tokens [c_j, d] with c_j >= 1, or a
    ``KVPiece`` (every memory of a batch the same kind)."""
    suffix: list[int]
    """Token ids of suffix(u): the task instruction and the options."""
    answer: list[int]
    """Answer token ids to score (empty when generating)."""


@dataclass
class Assembled:
    embeds: torch.Tensor
    """[N, L, d] input embeddings, left-padded with zeros."""
    attention_mask: torch.Tensor
    """[N, L] long, 0 on padding."""
    position_ids: torch.Tensor
    """[N, L] long: 0.. over real tokens (padding gets 0)."""
    query_pos: torch.Tensor
    """[N] index of the query-state position: the control token, or the last prompt token without one."""
    answer_start: torch.Tensor
    """[N] index of the first answer token (= L - len(answer))."""
    lengths: torch.Tensor
    """[N] real (unpadded) lengths."""
    cache: Any = None
    """KV memories: the ``Cache`` the forward pass starts from (memory slots [N, H_kv, M, hd]
    per layer, M the batch's most slots, padded); None for soft tokens."""
    past_valid: torch.Tensor | None = None
    """KV memories: [N, M] bool, True at a row's real memory slots (what later tokens may see)."""

    def forward_kwargs(self) -> dict[str, Any]:
        """Arguments of the decoder's forward for this input (the cache, if any, is consumed:
        the forward appends the text tokens' keys and values to it)."""
        kw = dict(inputs_embeds=self.embeds, attention_mask=self.attention_mask, position_ids=self.position_ids)
        if self.cache is not None:
            kw["cache"] = self.cache
        return kw

    @property
    def text_valid(self) -> torch.Tensor:
        """[N, L] bool, True at real (unpadded) text positions."""
        L = self.embeds.shape[1]
        return torch.arange(L, device=self.embeds.device)[None, :] >= (L - self.lengths)[:, None]


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [N, L] left-padded with ``pad_id`` and their attention mask [N, L] (long, 0 on
    padding), L the longest sequence."""
    L = max(len(t) for t in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, t in enumerate(seqs):
        ids[i, L - len(t):] = torch.as_tensor(list(t), dtype=torch.long)
        mask[i, L - len(t):] = 1
    return ids, mask


def assemble(
    embedding: torch.nn.Module, layouts: Sequence[Layout], sep: Sequence[int], rotary: torch.nn.Module | None = None,
    additive: bool = False,
) -> Assembled:
    """Embed and left-pad a batch of layouts.

    Args:
        embedding: the LM's input embedding (``model.get_input_embeddings()``); token
            parts are embedded with it, soft tokens are cast to its dtype.
        sep: token ids of the separator written after each injected memory.
        rotary: the decoder's rotary embedding, for layouts whose memories are ``KVPiece``s
            (``assemble_kv``, and ``additive`` for its mask).
    """
    if any(isinstance(m, KVPiece) for lay in layouts for m in lay.memories):
        if rotary is None:
            raise ValueError("KV memories need the decoder's rotary embedding to be placed")
        return assemble_kv(embedding, layouts, sep, rotary, additive)
    weight = embedding.weight
    device, dtype = weight.device, weight.dtype
    # All token pieces of the batch go through the embedding in one call (one kernel, and
    # one parameter gather under ZeRO-3), then are cut apart again.
    pieces: list[list[int]] = []
    query_idx = []
    for lay in layouts:
        head = lay.prompt + ([lay.control] if lay.control is not None else [])
        query_idx.append(len(head) - 1)
        pieces += [head, list(sep), lay.suffix + lay.answer]
    flat = torch.as_tensor([t for p in pieces for t in p], dtype=torch.long, device=device)
    embedded = iter(embedding(flat).split([len(p) for p in pieces]))
    seqs = []
    for lay in layouts:
        head_e, sep_e, tail_e = next(embedded), next(embedded), next(embedded)
        parts = [head_e]
        for mem in lay.memories:
            parts.append(mem.to(device=device, dtype=dtype))
            parts.append(sep_e)
        parts.append(tail_e)
        seqs.append(torch.cat(parts, dim=0))
    lengths = torch.tensor([s.shape[0] for s in seqs], device=device)
    L = int(lengths.max())
    pad = L - lengths
    embeds = torch.stack([torch.nn.functional.pad(s, (0, 0, L - s.shape[0], 0)) for s in seqs])
    mask = (torch.arange(L, device=device)[None, :] >= pad[:, None]).long()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    answer_len = torch.tensor([len(lay.answer) for lay in layouts], device=device)
    return Assembled(
        embeds=embeds,
        attention_mask=mask,
        position_ids=position_ids,
        query_pos=pad + torch.tensor(query_idx, device=device),
        answer_start=L - answer_len,
        lengths=lengths,
    )


def assemble_kv(embedding: torch.nn.Module, layouts: Sequence[Layout], sep: Sequence[int],
                rotary: torch.nn.Module, additive: bool = False) -> Assembled:
    """``assemble`` for layouts whose memories are ``KVPiece``s.

    Positions run as in the soft-token layout, ``[prompt][a][m_1][sep]...[m_Z][sep][suffix][answer]``,
    memory j taking c_j positions; the text tokens (everything but the memories) are embedded and
    left-padded into ``embeds`` [N, T, d] with their positions, the memories' keys are rotated from
    their frame to their positions and, with their values, right-padded into a cache of M slots.
    ``attention_mask`` [N, 1, T, M + T] is boolean (True = attend; SDPA takes it as it is), or
    additive (0 / dtype min) with ``additive``, for the eager attention: text token t of a row sees
    the row's memory slots at positions before its own and its text tokens up to itself; a padded
    text position sees only itself (no empty softmax row).
    """
    from transformers import DynamicCache

    weight = embedding.weight
    device, dtype = weight.device, weight.dtype
    pieces: list[list[int]] = []
    for lay in layouts:
        head = lay.prompt + ([lay.control] if lay.control is not None else [])
        pieces += [head, list(sep), lay.suffix + lay.answer]
    flat = torch.as_tensor([t for p in pieces for t in p], dtype=torch.long, device=device)
    embedded = iter(embedding(flat).split([len(p) for p in pieces]))
    seqs, text_pos, mem_slots, mem_pos, mem_delta, query_idx = [], [], [], [], [], []
    for lay in layouts:
        head_e, sep_e, tail_e = next(embedded), next(embedded), next(embedded)
        parts, pos, slots, spos, delta = [head_e], list(range(head_e.shape[0])), [], [], []
        p = head_e.shape[0]
        for mem in lay.memories:
            c = mem.kv.shape[0]
            slots.append(mem.kv)
            spos += range(p, p + c)
            delta += [p - mem.first] * c  # its slot i moves from first + i to p + i
            p += c
            parts.append(sep_e)
            pos += range(p, p + sep_e.shape[0])
            p += sep_e.shape[0]
        parts.append(tail_e)
        pos += range(p, p + tail_e.shape[0])
        query_idx.append(head_e.shape[0] - 1)
        seqs.append(torch.cat(parts))
        text_pos.append(pos)
        mem_slots.append(torch.cat(slots) if slots else None)
        mem_pos.append(spos)
        mem_delta.append(delta)
    N = len(layouts)
    lengths = torch.tensor([s.shape[0] for s in seqs], device=device)
    T = int(lengths.max())
    pad = T - lengths
    embeds = torch.stack([torch.nn.functional.pad(s, (0, 0, T - s.shape[0], 0)) for s in seqs])
    position_ids = torch.zeros(N, T, dtype=torch.long, device=device)
    for i, pos in enumerate(text_pos):
        position_ids[i, T - len(pos):] = torch.as_tensor(pos, device=device)
    text_valid = torch.arange(T, device=device)[None, :] >= pad[:, None]
    # memory slots: right-padded to M, keys rotated to their places
    counts = [len(sp) for sp in mem_pos]
    M = max(counts)
    first = next(x for x in mem_slots if x is not None)
    n_layers, _, H, hd = first.shape[1:]
    all_kv = torch.cat([x for x in mem_slots if x is not None]).to(device)  # [S, layers, 2, H, hd]
    deltas = torch.as_tensor([d for ds in mem_delta for d in ds], device=device)
    S = all_kv.shape[0]
    k = all_kv[:, :, 0].reshape(S, n_layers * H, 1, hd)
    k = rotate_keys(k, deltas, rotary).reshape(S, n_layers, H, hd)
    v = all_kv[:, :, 1]
    slot_valid = torch.arange(M, device=device)[None, :] < torch.as_tensor(counts, device=device)[:, None]  # [N, M]
    keys = torch.zeros(N, M, n_layers, H, hd, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    keys[slot_valid] = k.to(dtype)
    values[slot_valid] = v.to(dtype)
    slot_pos = torch.full((N, M), -1, dtype=torch.long, device=device)
    for i, sp in enumerate(mem_pos):
        slot_pos[i, : len(sp)] = torch.as_tensor(sp, dtype=torch.long, device=device)
    # [N, M, layers, H, hd] -> per layer [N, H, M, hd]
    keys, values = keys.permute(2, 0, 3, 1, 4), values.permute(2, 0, 3, 1, 4)
    cache = DynamicCache(ddp_cache_data=[(keys[li], values[li]) for li in range(n_layers)])
    sees_mem = slot_valid[:, None, :] & (slot_pos[:, None, :] < position_ids[:, :, None])  # [N, T, M]
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    sees_text = causal[None] & text_valid[:, None, :] & text_valid[:, :, None]
    sees_text = sees_text | torch.eye(T, dtype=torch.bool, device=device)[None]
    allowed = torch.cat([sees_mem & text_valid[:, :, None], sees_text], -1)
    mask = attention_bias(allowed, dtype) if additive else allowed
    answer_len = torch.tensor([len(lay.answer) for lay in layouts], device=device)
    return Assembled(
        embeds=embeds, attention_mask=mask[:, None], position_ids=position_ids,
        query_pos=pad + torch.tensor(query_idx, device=device), answer_start=T - answer_len, lengths=lengths,
        cache=cache, past_valid=slot_valid,
    )


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True = attend) as the additive bias eager attention adds."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
