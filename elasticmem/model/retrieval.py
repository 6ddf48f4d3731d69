"""Retrieval's parts apart from the top-Z search itself (DESIGN.md section 1 items 1-2): the bank's
checks at construction (its encoder and keys), memory.retrieval_map's index, the query
token ids of the key-like retrieval modes, the latest rows of a group (retrieval 'recent'), exactly
given memories ranked as retrieval would rank them, and evidence rows put among the retrieved ones.

``query_state.key_like_states``, ``ElasticMem._retrieve``, ``_given`` and ``_include`` call these.

    python -m pytest -q tests/unit/test_elasticmem.py tests/unit/test_retrieval_options.py
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from elasticmem.bank.store import Bank, BankError
from elasticmem.config import MemoryConfig


def check_bank(cfg: MemoryConfig, bank: Bank, fingerprint: str) -> None:
    """Refuse (``BankError``) a bank encoded by another model (``fingerprint``: the backbone's), or whose
    keys the query states of memory.retrieval (and memory.key) would not be comparable with."""
    if bank.fingerprint != fingerprint:
        raise BankError(
            f"bank {bank.root} was encoded by {bank.manifest['encoder']['name_or_path']!r} "
            f"({bank.fingerprint[:23]}...), not by this backbone ({fingerprint[:23]}...): "
            f"rebuild the bank with build_bank.py for this model"
        )
    own_key = {"mean": "mean", "prompt": "prompt", "layer_mean": "layer_mean"}.get(cfg.retrieval, "last")
    expected = cfg.key or own_key
    searches = cfg.top_z > 0  # a no-memory model (top_z 0) never compares query states with keys
    if searches and cfg.retrieval not in ("semantic", "recent") and bank.key_variant != expected:
        raise BankError(
            f"bank {bank.root} has '{bank.key_variant}' keys ({bank.key}) but memory.retrieval="
            f"{cfg.retrieval}{' with memory.key=' + cfg.key if cfg.key else ''} expects '{expected}' keys: "
            f"query states and keys would not be comparable. Build a bank with bank.key={expected} or "
            f"choose the retrieval mode of this bank (memory.retrieval={bank.key_variant}, or memory.key)"
        )
    if searches and cfg.retrieval == "layer_mean" and bank.key_variant != "layer_mean":
        raise BankError(f"memory.retrieval=layer_mean takes its layers from a layer_mean bank; {bank.root} "
                        f"has '{bank.key_variant}' keys")


def build_mapped_index(cfg: MemoryConfig, bank: Bank, fingerprint: str):
    """memory.retrieval_map's ``MappedIndex`` over ``bank`` (f_q(h) against f_k(keys), exact search),
    checked against the retrieval mode, keys and backbone ``fingerprint``; None without one (or top_z 0)."""
    if not (cfg.retrieval_map and cfg.top_z > 0):
        return None
    from elasticmem.model.retrieval_map import MappedIndex, check_retrieval_map, load_retrieval_map

    if cfg.retrieval in ("semantic", "recent"):
        raise ValueError(f"memory.retrieval_map maps the model's own states; retrieval={cfg.retrieval} has none")
    rmap, meta = load_retrieval_map(cfg.retrieval_map)
    check_retrieval_map(meta, cfg.retrieval_map, cfg.retrieval, bank.key, fingerprint)
    return MappedIndex(bank, rmap)


def key_query_ids(cfg: MemoryConfig, bank: Bank, tokenizer, questions: list[str]) -> tuple[list[list[int]], dict]:
    """Token ids per question and the key spec (``bank.encoding.key_states``') of retrieval 'mean' /
    'layer_mean' (the question tokenised as the bank's chunks, pooled like its keys) and 'prompt'
    (last state of memory.query_template)."""
    from elasticmem.data.chunking import tokenize_chunks

    mode, tok = cfg.retrieval, bank.manifest["tokenization"]
    if mode == "prompt":
        texts = [cfg.query_template.replace("{question}", q) for q in questions]
        ids = [tokenizer(t, add_special_tokens=tok["add_special_tokens"])["input_ids"] for t in texts]
    else:
        ids = tokenize_chunks(questions, tokenizer, tok["max_tokens"], tok["truncation_side"],
                              tok["add_special_tokens"])
    spec = bank.key if mode == "layer_mean" else {"variant": mode}
    return ids, spec


def recent_rows(bank: Bank, groups: list[str], top_z: int, max_tokens: int,
                picked_rows: dict[str, list[int]]) -> torch.Tensor:
    """[N, Z'] the latest rows of each group, oldest first, within ``top_z`` and ``max_tokens``
    (memory.recent_max_tokens); ``picked_rows`` (group -> rows) keeps each group's pick."""
    chunks = bank.chunks()
    for g in dict.fromkeys(groups):
        if g in picked_rows:  # picked once per bank snapshot (refresh_bank clears them)
            continue
        picked, used = [], 0
        for r in reversed(bank.group_row_ids(g).tolist()):
            used += chunks[r]["n_tokens"]
            if len(picked) == top_z or used > max_tokens:
                break
            picked.append(r)
        picked_rows[g] = picked[::-1]
    Z = max(1, max(len(picked_rows[g]) for g in groups))
    rows = torch.full((len(groups), Z), -1, dtype=torch.long)
    for i, g in enumerate(groups):
        rows[i, : len(picked_rows[g])] = torch.as_tensor(picked_rows[g], dtype=torch.long)
    return rows


def given_rows(h: torch.Tensor, memories: Sequence[set[int]], gather_keys: Callable[[torch.Tensor], torch.Tensor]):
    """Rows [N, Z'] (Z' the most given), cosine scores of h [N, d] and mask for exactly the ``memories``
    of each example, highest score first (the order retrieval would give them). ``gather_keys``: rows
    [N, Z'] -> their keys [N, Z', d]."""
    N = len(memories)
    if N != h.shape[0]:
        raise ValueError(f"{N} memory sets for {h.shape[0]} trajectories")
    Z = max([1] + [len(m) for m in memories])
    rows = torch.full((N, Z), -1, dtype=torch.long)
    for i, m in enumerate(memories):
        rows[i, : len(m)] = torch.as_tensor(sorted(m), dtype=torch.long)
    keys = torch.nn.functional.normalize(gather_keys(rows).float().cpu(), dim=-1)
    scores = torch.einsum("nzd,nd->nz", keys, torch.nn.functional.normalize(h.float().cpu(), dim=-1))
    scores = torch.where(rows >= 0, scores, torch.full_like(scores, float("-inf")))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rows, scores = rows.gather(1, order), scores.gather(1, order)
    mask = rows >= 0
    return rows, torch.where(mask, scores, torch.zeros_like(scores)), mask


def include_rows(h: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
                 include: Sequence[set[int]] | None, bank: Bank, other_space: bool):
    """``rows`` [N, Z] with each example's ``include`` rows in place of its lowest-ranked others, by
    score (their cosine to h [N, d] over the bank's keys; ``other_space``: the scores are not those
    cosines (a retrieval map, semantic retrieval), so they are ranked first); unchanged without
    ``include`` or without memories. Returns rows, scores and mask [N, Z]."""
    if include is None or rows.shape[1] == 0:
        return rows, scores, mask
    N, Z = rows.shape
    hn = torch.nn.functional.normalize(h.float().cpu(), dim=-1)
    out_r, out_s = rows.clone(), scores.clone()
    for i in range(N):
        want = sorted(include[i])
        if not want:
            continue
        kept = {r for r in rows[i].tolist() if r >= 0 and r not in include[i]}
        keys = torch.nn.functional.normalize(bank.gather_keys(torch.as_tensor(want)).float(), dim=-1)
        want_s = (keys @ hn[i]).tolist()
        if other_space:
            # another score space: rank the evidence first rather than mix incomparable scores
            want_s = [float(scores[i, 0]) + 1.0] * len(want)
        pairs = sorted(zip(want_s, want), reverse=True)[:Z]
        size = min(Z, max(int(mask[i].sum()), len(pairs)))
        keep = [(float(s), r) for s, r in zip(scores[i].tolist(), rows[i].tolist()) if r in kept]
        keep = keep[: size - len(pairs)]
        merged = sorted(pairs + keep, reverse=True)
        out_r[i] = -1
        out_s[i] = 0.0
        for j, (sc, r) in enumerate(merged):
            out_r[i, j], out_s[i, j] = r, sc
    return out_r, out_s, out_r >= 0
