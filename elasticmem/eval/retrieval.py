"""Retrieval quality against each question's evidence: evidence bank rows and recall@k.

Examples carry their evidence as ``extra["evidence"]``, [session, turn] positions in the
example's history (LoCoMo: the question's ``evidence`` dia_ids; LongMemEval: the turns
flagged ``has_answer``; the synthetic task: the user turns that state the fact). A bank's
``chunks.jsonl`` records each row's ``session`` and ``turns`` (the one or two turns the chunk
holds), so the evidence of a question is the set of rows of its group whose turns include an
evidence turn (``evidence_rows``).

``recall_at_k`` scores retrieved rows against those sets, two ways:

- ``recall_any@k``: fraction of questions with at least one evidence chunk in the top k
  (the usual "recall@k" of retrieval papers; a binomial proportion, so it takes a Wilson
  interval, and ``hits_any@k`` gives its count);
- ``recall_frac@k``: mean over questions of the fraction of their evidence chunks in the top k
  (equal to ``recall_any@k`` when every question has one evidence chunk).

Questions without evidence are left out of both and counted (``n_no_evidence``).
``random_recall`` is the exact expectation of both under a uniformly random top k.

Pure functions over torch tensors and Python sets, cheap enough to log on every training step.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

_TURN_ROWS: weakref.WeakKeyDictionary[Any, dict[str, dict[tuple[int, int], int]]] = weakref.WeakKeyDictionary()
"""Per bank, per group: (session, turn) -> row (built on first use; a ``Bank`` is a snapshot that
never changes: an append makes a new one)."""


def _turn_rows(bank, group: str) -> dict[tuple[int, int], int]:
    per_bank = _TURN_ROWS.setdefault(bank, {})
    if group not in per_bank:
        chunks = bank.chunks()
        lookup: dict[tuple[int, int], int] = {}
        for row in bank.group_row_ids(group).tolist():
            c = chunks[row]
            if "session" not in c or "turns" not in c:
                raise ValueError(f"bank {getattr(bank, 'root', '?')}: chunks.jsonl row {row} has no 'session'/'turns' "
                                 f"(rebuild the bank with build_bank.py)")
            for t in c["turns"]:
                lookup[(int(c["session"]), int(t))] = row
        per_bank[group] = lookup
    return per_bank[group]


def evidence_rows(example, bank) -> set[int]:
    """Bank rows of the chunks of ``example``'s group that hold one of its evidence turns.

    ``example.extra["evidence"]``: [session, turn] pairs (missing or empty: no evidence, an
    empty set). Evidence turns that no chunk holds (a position outside the history) are
    ignored. ``bank``: a ``Bank`` (``group_row_ids`` and ``chunks()`` with ``session``/``turns``).
    """
    evidence = example.extra.get("evidence") or []
    if not evidence:
        return set()
    lookup = _turn_rows(bank, example.group)
    rows = (lookup.get((int(s), int(t))) for s, t in evidence)
    return {r for r in rows if r is not None}


def recall_at_k(retrieved_rows: torch.Tensor, evidence: Sequence[set[int]], ks: Sequence[int]) -> dict[str, float]:
    """Recall of evidence chunks in the top k of each question's retrieved rows.

    Args:
        retrieved_rows: [N, K] long, bank rows in rank order; -1 (a missing slot) never matches.
        evidence: N sets of evidence rows (``evidence_rows``); an empty set = no evidence.
        ks: cut-offs, each 1 <= k <= K.

    Returns ``n`` (questions with evidence), ``n_no_evidence`` (left out), and per k:
    ``recall_any@k`` (fraction of the n with any evidence chunk in the top k), ``hits_any@k``
    (that count) and ``recall_frac@k`` (mean fraction of a question's evidence chunks in the
    top k). With n = 0 only the two counts are returned.
    """
    rows = torch.as_tensor(retrieved_rows, dtype=torch.long).cpu()
    if rows.dim() != 2 or rows.shape[0] != len(evidence):
        raise ValueError(f"retrieved_rows must be [N, K] with N = len(evidence) = {len(evidence)}, "
                         f"got shape {tuple(rows.shape)}")
    K = rows.shape[1]
    for k in ks:
        if not 1 <= k <= K:
            raise ValueError(f"k = {k} is outside 1..K = {K} (retrieve at least max(ks) rows)")
    keep = [i for i, e in enumerate(evidence) if e]
    out: dict[str, float] = {"n": len(keep), "n_no_evidence": len(evidence) - len(keep)}
    if not keep:
        return out
    E = max(len(evidence[i]) for i in keep)
    ev = torch.full((len(keep), E), -2, dtype=torch.long)  # -2 matches neither a row nor a missing slot
    for j, i in enumerate(keep):
        ev[j, : len(evidence[i])] = torch.tensor(sorted(evidence[i]), dtype=torch.long)
    n_ev = (ev >= 0).sum(-1)  # [n]
    match = rows[keep][:, :, None] == ev[:, None, :]  # [n, K, E]
    for k in ks:
        found = match[:, :k].any(1).sum(-1)  # [n] evidence chunks in the top k
        hits = int((found > 0).sum())
        out[f"recall_any@{k}"] = hits / len(keep)
        out[f"hits_any@{k}"] = hits
        out[f"recall_frac@{k}"] = float((found / n_ev).mean())
    return out


def random_recall(group_sizes: Sequence[int], evidence: Sequence[set[int]], ks: Sequence[int]) -> dict[str, float]:
    """Exact expectation of ``recall_at_k`` when each question's top k is a uniformly random
    set of min(k, M) of its group's M chunks.

    Per question with E evidence chunks: P(any in top k) = 1 - C(M - E, k') / C(M, k') and
    E[fraction found] = k' / M, k' = min(k, M). Same keys as ``recall_at_k`` (``hits_any@k`` is
    the expected count, a float).
    """
    if len(group_sizes) != len(evidence):
        raise ValueError(f"{len(group_sizes)} group sizes for {len(evidence)} evidence sets")
    keep = [(int(m), len(e)) for m, e in zip(group_sizes, evidence) if e]
    out: dict[str, float] = {"n": len(keep), "n_no_evidence": len(evidence) - len(keep)}
    if not keep:
        return out
    for k in ks:
        p_any = [1.0 - math.comb(m - e, min(k, m)) / math.comb(m, min(k, m)) for m, e in keep]
        out[f"recall_any@{k}"] = sum(p_any) / len(keep)
        out[f"hits_any@{k}"] = sum(p_any)
        out[f"recall_frac@{k}"] = sum(min(k, m) / m for m, _ in keep) / len(keep)
    return out
