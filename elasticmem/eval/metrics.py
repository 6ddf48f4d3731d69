"""Scores, costs and the ``results.json`` summary of one evaluation.

``evaluate.py`` writes one :class:`PredictionRecord` per example to ``predictions.jsonl``;
:func:`build_results` turns those records into the ``results.json`` dict of DESIGN.md
section 3.1. Everything here is a pure function of the records, so a saved run can be
re-scored (or scored with metrics added later) without running a model again.

What is measured (DESIGN.md section 1 item 8):

- **accuracy** (success rate for ALFWorld): mean of the records' ``correct``; per question
  type; across datasets, the test-size-weighted mean ``sum_i n_i acc_i / sum_i n_i``
  (as the ElasticMem paper averages its datasets), :func:`weighted_accuracy`.
- **#Tok** (``avg_tokens``): task-text input + memory tokens (+ separators) + generated
  tokens, i.e. ``Prediction.total_tokens``; **B_mem** apart: ``avg_memory_tokens`` (the
  tokens memories added, ``Prediction.memory_tokens``) and ``avg_B_mem`` (the mean sum of
  the budgets the policy chose, for systems that choose budgets).
- **latency** per example, split into ``retrieval``, ``policy`` and ``generation``
  (whatever stages the system timed), and the share of retrieval in the total.
- **evidence retrieval** (systems that retrieve bank rows, questions with evidence): how often
  the retrieved rows hold an evidence turn, against its chance level, and accuracy when they
  do and when they do not (:func:`evidence_stats`): a memory that is found but not read shows
  as a high recall with accuracy-given-hit near the miss rate.
- **free-form answer metrics** (LoCoMo, to compare with A-Mem): token F1, BLEU-1, ROUGE-L,
  ROUGE-2, METEOR and SBERT cosine similarity, computed as A-Mem's public evaluation code
  computes them (:mod:`elasticmem.eval.free_form`), per question type.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from elasticmem.eval.free_form import aggregate_by_category, free_form_scores, golds_are_free_text

if TYPE_CHECKING:
    from elasticmem.eval.system import Prediction

# --------------------------------------------------------------------------- the record format


class RetrievedRecord(TypedDict):
    """One memory put in front of the reasoner (``elasticmem.eval.system.Retrieved``)."""

    rank: int
    """0 = best."""
    ref: str
    """``"row:123"`` for a bank row, a note id for A-Mem."""
    score: float
    """Cosine retrieval score."""
    budget: int | None
    """Latent tokens the policy gave it (ElasticMem); None for text memories."""
    tokens: int
    """Tokens it added to the reasoner's input."""
    text: str
    """The memory's text."""


class TokenRecord(TypedDict):
    """Token counts of one example; ``total`` is ``#Tok``."""

    prompt: int
    memory: int
    generated: int
    total: int


class PredictionRecord(TypedDict):
    """One line of ``predictions.jsonl``: what :func:`build_results`, the plots and the
    report read. :func:`make_record` builds one from a ``Prediction``.

    ``budgets`` are the budgets the policy chose, in rank order, one per retrieved memory
    (``[]`` for systems without budgets). ``latency`` maps a stage name (``retrieval``,
    ``policy``, ``generation``; others are allowed) to seconds for this example.
    For free-form answers (LoCoMo with A-Mem's metrics) ``gold`` is the reference answer text;
    for multiple choice it is the option letter. A record may also hold ``extra``, the
    ``Prediction``'s system-specific details when it has any (e.g. an agent episode's trace).
    """

    id: str
    question_type: str
    prediction: str
    gold: str
    correct: bool
    retrieved: list[RetrievedRecord]
    budgets: list[int]
    tokens: TokenRecord
    latency: dict[str, float]


LATENCY_STAGES = ("retrieval", "policy", "generation")
"""The stages every system reports (zero when a system has no such stage)."""


def make_record(pred: Prediction, *, question_type: str, gold: str, correct: bool,
                budgets: Sequence[int] | None = None) -> PredictionRecord:
    """The ``predictions.jsonl`` line of one ``Prediction``.

    ``budgets`` defaults to the retrieved memories' budgets in rank order (those that have one).
    """
    retrieved = sorted(pred.retrieved, key=lambda r: r.rank)
    if budgets is None:
        budgets = [r.budget for r in retrieved if r.budget is not None]
    return {
        "id": pred.id,
        "question_type": question_type,
        "prediction": pred.text,
        "gold": gold,
        "correct": bool(correct),
        "retrieved": [{"rank": r.rank, "ref": r.ref, "score": float(r.score), "budget": r.budget,
                       "tokens": r.tokens, "text": r.text} for r in retrieved],
        "budgets": [int(b) for b in budgets],
        "tokens": {"prompt": pred.prompt_tokens, "memory": pred.memory_tokens,
                   "generated": pred.generated_tokens, "total": pred.total_tokens},
        "latency": {k: float(v) for k, v in pred.latency.items()},
        **({"extra": pred.extra} if pred.extra else {}),
    }


def load_records(path: str | Path) -> list[PredictionRecord]:
    """The records of a ``predictions.jsonl`` file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_results(path: str | Path) -> dict[str, Any]:
    """A ``results.json`` dict."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- accuracy


def accuracy(records: Sequence[Mapping[str, Any]]) -> float:
    """Fraction of records with ``correct`` true."""
    if not records:
        raise ValueError("accuracy of no records")
    return sum(bool(r["correct"]) for r in records) / len(records)


def group_by_type(records: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Records grouped by ``question_type``, types sorted by name."""
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in records:
        groups[str(r["question_type"])].append(r)
    return dict(sorted(groups.items()))


def per_type_accuracy(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``{question_type: accuracy}``."""
    return {t: accuracy(rs) for t, rs in group_by_type(records).items()}


def weighted_mean(values_and_counts: Iterable[tuple[float, int]]) -> float:
    """``sum_i n_i v_i / sum_i n_i`` over ``(v_i, n_i)`` pairs."""
    pairs = list(values_and_counts)
    n = sum(c for _, c in pairs)
    if n <= 0:
        raise ValueError("weighted mean over no examples")
    return sum(v * c for v, c in pairs) / n


def weighted_accuracy(results: Mapping[str, Mapping[str, Any]], key: str = "accuracy") -> float:
    """Accuracy averaged over datasets weighted by test-set size, as the ElasticMem paper does.

    ``results`` maps a dataset name to its ``results.json`` dict (``key`` and ``num_examples``).
    """
    return weighted_mean((float(r[key]), int(r["num_examples"])) for r in results.values())


# --------------------------------------------------------------------------- tokens, budgets, latency


def _mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs)) if xs else 0.0


def token_stats(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean token counts per example: ``avg_tokens`` (#Tok), ``avg_memory_tokens``,
    ``avg_prompt_tokens``, ``avg_generated_tokens``."""
    return {
        "avg_tokens": _mean([r["tokens"]["total"] for r in records]),
        "avg_memory_tokens": _mean([r["tokens"]["memory"] for r in records]),
        "avg_prompt_tokens": _mean([r["tokens"]["prompt"] for r in records]),
        "avg_generated_tokens": _mean([r["tokens"]["generated"] for r in records]),
    }


def budget_stats(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Statistics of the chosen budgets, or None when no record has budgets.

    ``avg_B_mem``: mean over examples of ``sum_j b_j``; ``mean_budget``: mean per retrieved
    memory; ``zero_fraction``: share of memories dropped (``b_j = 0``); ``histogram``:
    count of each budget value ``0..max``.
    """
    with_budgets = [r["budgets"] for r in records if r.get("budgets")]
    if not with_budgets:
        return None
    flat = [int(b) for bs in with_budgets for b in bs]
    hist = [0] * (max(flat) + 1)
    for b in flat:
        hist[b] += 1
    return {
        "avg_B_mem": _mean([sum(bs) for bs in with_budgets]),
        "mean_budget": _mean(flat),
        "zero_fraction": hist[0] / len(flat),
        "max_budget": max(flat),
        "histogram": hist,
    }


_PER_NOTE = ("tokens_per_note", "seconds_per_note")


def construction_stats(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Memory-construction cost of the library baselines, apart from answering, or None when no
    record carries one.

    Read once per conversation from the records' ``extra[system]`` (``group`` and ``build``):
    Mem0 / LangMem's ``build`` holds the endpoint's counters (calls, prompt and completion
    tokens, seconds, failures, memories stored), A-Mem's holds notes added and tokens and
    seconds per note; where A-Mem's memory holds more notes (``notes_in_memory``) than its cost
    covers (a store begun before its journal kept costs), ``notes_unmeasured`` counts the
    difference. ``tokens`` sums every construction token of every conversation;
    ``tokens_per_example`` spreads it over the evaluated examples (add it to ``avg_tokens`` for
    the whole cost), ``tokens_per_group`` over the conversations; the other counters are sums.
    """
    builds: dict[tuple[str, str], Mapping[str, Any]] = {}
    for r in records:
        for name, e in (r.get("extra") or {}).items():
            if isinstance(e, Mapping) and isinstance(e.get("build"), Mapping) and "group" in e:
                b = dict(e["build"])
                if "notes_in_memory" in e and "notes_added" in b:
                    b["notes_unmeasured"] = max(0, int(e["notes_in_memory"]) - int(b["notes_added"]))
                builds[(name, str(e["group"]))] = b
    if not builds:
        return None
    sums: dict[str, float] = defaultdict(float)
    for b in builds.values():
        for k, v in b.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _PER_NOTE:
                sums[k] += float(v)
        if "prompt_tokens" in b or "completion_tokens" in b:
            sums["tokens"] += float(b.get("prompt_tokens", 0)) + float(b.get("completion_tokens", 0))
        else:  # A-Mem: per-note means
            notes = float(b.get("notes_added", 0) or 0)
            sums["tokens"] += notes * float(b.get("tokens_per_note", 0) or 0)
            sums["seconds"] += notes * float(b.get("seconds_per_note", 0) or 0)
    if not sums.get("notes_unmeasured"):
        sums.pop("notes_unmeasured", None)
    return {"groups": len(builds), **dict(sorted(sums.items())),
            "tokens_per_example": sums["tokens"] / len(records), "tokens_per_group": sums["tokens"] / len(builds)}


def evidence_stats(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """How often the bank rows a system retrieved hold the question's evidence, and how accuracy
    depends on it; None when no record carries its evidence rows or nothing was retrieved.

    Systems that retrieve bank rows (ElasticMem and the systems on its code path) record each
    question's evidence as ``extra["evidence"]`` = {``rows``: the bank rows holding an evidence
    turn, ``group_rows``: the rows of its group}; retrieved rows are the ``row:N`` refs. Systems
    with memories of their own (A-Mem's notes) record ``refs``, the refs of the memories holding
    an evidence turn, and ``group_rows``, how many memories the group has; every retrieved ref
    counts. Over the n questions with evidence, with k = the memories retrieved for a question:

    - ``recall_any`` (Wilson ``recall_any_ci95``, count ``hits``): any evidence row retrieved;
    - ``recall_frac``: mean fraction of a question's evidence rows retrieved;
    - ``random_recall_any``: its exact expectation for k rows drawn uniformly from the group
      (:func:`elasticmem.eval.retrieval.random_recall`), the chance level to compare with;
    - ``accuracy_given_hit`` / ``accuracy_given_miss`` (with ``n_hit`` / ``n_miss`` and Wilson
      intervals): whether the answers use what was found (None where the set is empty);
    - ``mean_retrieved`` (mean k) and ``n_no_evidence`` (records left out).
    """
    from elasticmem.eval.retrieval import random_recall
    from elasticmem.eval.stats import accuracy_with_interval

    def parse(r: Mapping[str, Any]) -> tuple[set[str], list[str]]:
        """(refs holding evidence, refs retrieved): bank rows as ``row:N``, or a system's own refs."""
        e = (r.get("extra") or {}).get("evidence") or {}
        got = [str(m.get("ref", "")) for m in r.get("retrieved", [])]
        if e.get("rows"):
            return {f"row:{x}" for x in e["rows"]}, [g for g in got if g.startswith("row:")]
        return {str(x) for x in e.get("refs") or ()}, got

    parsed = [(r, *parse(r)) for r in records]
    scored = [r for r, ev, _ in parsed if ev]
    evidence = [ev for _, ev, _ in parsed if ev]
    got = [g for _, ev, g in parsed if ev]
    if not any(got):
        return None
    found = [len(ev & set(g)) for ev, g in zip(evidence, got)]
    hit = [f > 0 for f in found]
    chance = [random_recall([r["extra"]["evidence"]["group_rows"]], [ev], [len(g)])[f"recall_any@{len(g)}"]
              for r, ev, g in zip(scored, evidence, got)]
    n = len(scored)
    recall, _, ci = accuracy_with_interval(hit)
    out: dict[str, Any] = {"n": n, "n_no_evidence": len(records) - n, "mean_retrieved": sum(map(len, got)) / n,
                           "recall_any": recall, "recall_any_ci95": ci, "hits": sum(hit),
                           "recall_frac": sum(f / len(ev) for f, ev in zip(found, evidence)) / n,
                           "random_recall_any": sum(chance) / n}
    for name, want in (("hit", True), ("miss", False)):
        outcomes = [r["correct"] for r, h in zip(scored, hit) if h == want]
        acc, k, aci = accuracy_with_interval(outcomes)
        out[f"n_{name}"] = k
        out[f"accuracy_given_{name}"] = acc if k else None
        out[f"accuracy_given_{name}_ci95"] = aci if k else None
    return out


def latency_stats(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean seconds per example, in total and by stage, and retrieval's share of the total.

    Stages missing from a record count as 0 s. ``retrieval_share`` is total retrieval time
    over total time (None when nothing was timed, rather than a made-up 0).
    """
    stages = list(LATENCY_STAGES) + sorted({k for r in records for k in r.get("latency", {})} - set(LATENCY_STAGES))
    per_stage = {s: [float(r.get("latency", {}).get(s, 0.0)) for r in records] for s in stages}
    totals = [sum(per_stage[s][i] for s in stages) for i in range(len(records))]
    total = sum(totals)
    return {
        "latency_s_per_example": _mean(totals),
        "latency_split_s": {s: _mean(v) for s, v in per_stage.items()},
        "retrieval_share": sum(per_stage["retrieval"]) / total if total > 0 else None,
    }


# --------------------------------------------------------------------------- results.json


def build_results(records: Sequence[Mapping[str, Any]], *, free_form: bool | None = None,
                  primary: str = "accuracy", system: str | None = None, with_meteor: bool = True,
                  with_sbert: bool = True, sbert_model=None) -> dict[str, Any]:
    """The ``results.json`` dict of one evaluation, from its ``predictions.jsonl`` records.

    Keys: ``accuracy`` (also under ``primary``, e.g. ``success_rate`` for ALFWorld),
    ``accuracy_ci95`` [lo, hi] (its 95 % Wilson interval, :func:`elasticmem.eval.stats.wilson_interval`;
    also as ``<primary>_ci95``), ``num_examples``, ``per_type`` {question_type: accuracy},
    ``per_type_counts`` {question_type: n}, ``per_type_ci95`` {question_type: [lo, hi]},
    ``avg_tokens`` (#Tok), ``avg_memory_tokens``, ``avg_prompt_tokens``,
    ``avg_generated_tokens``, ``latency_s_per_example``, ``latency_split_s`` {stage: s},
    ``retrieval_share``; with budgets ``avg_B_mem`` and ``budget_stats``; for systems that build
    their memory with an LLM (Mem0, LangMem, A-Mem) ``construction`` (:func:`construction_stats`);
    for systems that retrieve bank rows of questions with evidence ``evidence_retrieval``
    (:func:`evidence_stats`);
    with free-form golds ``free_form`` ({overall, per_type, counts} of :func:`aggregate_by_category`, plus
    ``absent`` {metric: reason}). ``free_form=None`` decides by :func:`golds_are_free_text`.
    """
    from elasticmem.eval.stats import accuracy_with_interval

    if not records:
        raise ValueError("no records to summarise")
    acc, n, ci = accuracy_with_interval(r["correct"] for r in records)
    out: dict[str, Any] = {}
    if system is not None:
        out["system"] = system
    out["accuracy"] = acc
    out["accuracy_ci95"] = ci
    if primary != "accuracy":
        out[primary] = acc
        out[f"{primary}_ci95"] = ci
    out["num_examples"] = n
    groups = {t: accuracy_with_interval(r["correct"] for r in rs) for t, rs in group_by_type(records).items()}
    out["per_type"] = {t: g[0] for t, g in groups.items()}
    out["per_type_counts"] = {t: g[1] for t, g in groups.items()}
    out["per_type_ci95"] = {t: g[2] for t, g in groups.items()}
    out.update(token_stats(records))
    budgets = budget_stats(records)
    if budgets is not None:
        out["avg_B_mem"] = budgets["avg_B_mem"]
        out["budget_stats"] = budgets
    out.update(latency_stats(records))
    construction = construction_stats(records)
    if construction is not None:
        out["construction"] = construction
    evidence = evidence_stats(records)
    if evidence is not None:
        out["evidence_retrieval"] = evidence
    if free_form is None:
        free_form = golds_are_free_text(records)
    if free_form:
        scores, absent = free_form_scores([r["prediction"] for r in records], [r["gold"] for r in records],
                                          with_meteor=with_meteor, with_sbert=with_sbert, sbert_model=sbert_model)
        out["free_form"] = {**aggregate_by_category(scores, [r["question_type"] for r in records]),
                            "absent": absent}
    _check_finite(out)
    return out


def _check_finite(obj: Any, path: str = "results") -> None:
    """Refuse NaN/inf: JSON has no such numbers and a summary with one is wrong somewhere."""
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"{path} is {obj}")
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _check_finite(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_finite(v, f"{path}[{i}]")


if __name__ == "__main__":  # the CLI of the offline NLTK data, at the path scripts/test.sh calls
    from elasticmem.eval.nltk_data import main

    main()
