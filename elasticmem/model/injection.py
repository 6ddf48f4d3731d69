"""Soft-token injection: assemble ``[prompt][a][Z_1][sep]...[Z_Z][sep][suffix][answer]`` as input embeddings.

Every trajectory has its own number of soft tokens, so sequences differ in
length; they are left-padded (generation appends on the right) with an
attention mask and position ids that count only real tokens, so a padded row
computes exactly what the same row would alone. Memories with no soft tokens
leave no trace, not even a separator (DESIGN.md section 1 item 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class Layout:
    """The parts of one trajectory's input, before embedding."""

    prompt: list[int]
    """Token ids of prompt(q)."""
    control: int | None
    """The retrieval-control token a, or None in modes without one."""
    memories: list[torch.Tensor]
    """Projected soft tokens per injected memory, rank order, each [c_j, d] with c_j >= 1."""
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
    embedding: torch.nn.Module, layouts: Sequence[Layout], sep: Sequence[int]
) -> Assembled:
    """Embed and left-pad a batch of layouts.

    Args:
        embedding: the LM's input embedding (``model.get_input_embeddings()``); token
            parts are embedded with it, soft tokens are cast to its dtype.
        sep: token ids of the separator written after each injected memory.
    """
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
