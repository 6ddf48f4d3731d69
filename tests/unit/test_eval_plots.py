"""Tests of the evaluation pictures (elasticmem.eval.plots) and markdown reports (elasticmem.eval.report).

Run with::

    OMP_NUM_THREADS=1 pytest tests/unit/test_eval_plots.py

Every plot is drawn from saved outputs written here (predictions.jsonl, metrics.jsonl,
results.json), saved as a PNG, and must show those outputs: the drawn arrays (image, bars,
points, lines) are compared with values worked out from the formulas that wrote the files.
The reports must hold the numbers worked out by hand in the comments.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from elasticmem.eval import plots, report, stats

PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert Path(path).read_bytes()[:8] == PNG


@pytest.fixture
def drawn(monkeypatch) -> dict[str, object]:
    """{file name: figure} of every plot saved (and still written) during the test."""
    figures, real = {}, plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.setdefault(Path(path).name, fig) and real(fig, path))
    return figures


def memories() -> list[tuple[int, int, float]]:
    """(rank, budget, score) of each retrieved memory, as the ``predictions`` fixture writes them."""
    return [(j, max(0, 6 - j - i % 3), 0.9 - 0.1 * j - 0.001 * i) for i in range(40) for j in range(5)]


def check_budget_figures(drawn: dict, heat: str, scatter: str, hist: str) -> None:
    """The heat map, scatter and histogram show the fixture's budgets, ranks and scores."""
    mems = memories()
    # heat map: image[b, r] = number of memories at rank r given budget b; white line: mean budget per rank
    (ax, _) = drawn[heat].axes
    want = np.zeros((7, 5), dtype=int)
    for r, b, _ in mems:
        want[b, r] += 1
    assert np.array_equal(np.asarray(ax.get_images()[0].get_array()), want)
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0, 1, 2, 3, 4]
    assert list(line.get_ydata()) == pytest.approx([sum(b for r, b, _ in mems if r == k) / 40 for k in range(5)])
    # scatter: x = score, y = budget + jitter of at most 0.15, colour = rank
    (ax, _) = drawn[scatter].axes
    points = ax.collections[0]
    xy = np.asarray(points.get_offsets())
    assert list(xy[:, 0]) == pytest.approx([s for _, _, s in mems])
    assert np.abs(xy[:, 1] - [b for _, b, _ in mems]).max() <= 0.15
    assert list(points.get_array()) == [r for r, _, _ in mems]
    # histogram: one bar per budget value, its height the number of memories given it
    (ax,) = drawn[hist].axes
    heights = [p.get_height() for p in ax.patches]
    assert heights == [sum(b == v for _, b, _ in mems) for v in range(7)]


@pytest.fixture(scope="module")
def predictions(tmp_path_factory) -> Path:
    """40 examples x 5 retrieved memories with budgets that fall with rank."""
    path = tmp_path_factory.mktemp("eval") / "predictions.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            retrieved = [{"rank": j, "ref": f"row:{i * 5 + j}", "score": 0.9 - 0.1 * j - 0.001 * i,
                          "budget": max(0, 6 - j - i % 3), "tokens": max(0, 6 - j - i % 3), "text": "m"}
                         for j in range(5)]
            f.write(json.dumps({"id": f"q{i}", "question_type": "t", "prediction": "(a)", "gold": "a",
                                "correct": i % 2 == 0, "retrieved": retrieved,
                                "budgets": [m["budget"] for m in retrieved],
                                "tokens": {"prompt": 100, "memory": 10, "generated": 2, "total": 112},
                                "latency": {"retrieval": 0.01, "policy": 0.001, "generation": 0.1}}) + "\n")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A training run's metrics.jsonl with the trainer's keys and two greedy-eval rows."""
    d = tmp_path_factory.mktemp("run")
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(1, 31):
            f.write(json.dumps({"step": s, "reward/mean": s / 30, "reward/std": 0.2, "accuracy": s / 30,
                                "loss": 1 / s, "budget/mean_B_mem": 40 - s, "budget/histogram": [1, 2]}) + "\n")
            if s % 15 == 0:
                f.write(json.dumps({"step": s, "eval": {"accuracy": s / 40, "num_examples": 8}}) + "\n")
    return d


def results(acc: float, tok: float, **kw) -> dict:
    return {"accuracy": acc, "num_examples": 200, "avg_tokens": tok, "avg_memory_tokens": tok / 10,
            "latency_s_per_example": 0.25, "per_type": {"temporal": acc, "single_hop": acc - 0.3},
            "per_type_counts": {"temporal": 120, "single_hop": 80},
            "latency_split_s": {"retrieval": 0.05, "policy": 0.0, "generation": 0.2}, "retrieval_share": 0.2, **kw}


# --------------------------------------------------------------------------- plots


def test_budget_plots(predictions, tmp_path, drawn):
    assert_png(plots.budget_by_rank(predictions, tmp_path / "heat.png"))
    assert_png(plots.budget_vs_score(predictions, tmp_path / "scatter.png"))
    assert_png(plots.budget_histogram(plots.load_records(predictions), tmp_path / "hist.png"))  # loaded records
    check_budget_figures(drawn, "heat.png", "scatter.png", "hist.png")


def test_rank_budget_score_rows(predictions):
    a = plots.rank_budget_score(plots.load_records(predictions))
    assert a.shape == (200, 3)  # 40 examples x 5 memories
    # example 0, rank 2: budget 6 - 2 - 0 = 4, score 0.9 - 0.2 = 0.7
    assert list(a[2]) == pytest.approx([2, 4, 0.7])


def test_budget_plots_refuse_records_without_budgets(tmp_path):
    text_rag = [{"id": "q", "question_type": "t", "retrieved": [{"rank": 0, "score": 0.5, "budget": None}],
                 "budgets": []}]
    with pytest.raises(ValueError, match="no budgets"):
        plots.budget_histogram(text_rag, tmp_path / "x.png")


def check_learning_curves(fig) -> None:
    """The ``run_dir`` fixture's steps 1..30 drawn raw (the faint first line of each panel):
    reward s / 30, accuracy s / 30 with the greedy evaluations at steps 15 and 30 (s / 40),
    B_mem 40 - s, loss 1 / s."""
    steps = list(range(1, 31))
    axes = {ax.get_title().split(" (")[0]: ax for ax in fig.axes}
    for title, value in (("reward", lambda s: s / 30), ("accuracy", lambda s: s / 30),
                         ("mean B_mem", lambda s: 40 - s), ("loss", lambda s: 1 / s)):
        raw = axes[title].get_lines()[0]
        assert list(raw.get_xdata()) == steps, title
        assert list(raw.get_ydata()) == pytest.approx([value(s) for s in steps]), title
    (greedy,) = [line for line in axes["accuracy"].get_lines() if line.get_label() == "greedy eval"]
    assert list(greedy.get_xdata()) == [15, 30] and list(greedy.get_ydata()) == pytest.approx([15 / 40, 30 / 40])


def test_learning_curves(run_dir, drawn):
    out = plots.learning_curves(run_dir)
    assert out == run_dir / "learning_curves.png"
    assert_png(out)
    check_learning_curves(drawn["learning_curves.png"])
    train, evals = plots.read_metrics(run_dir / "metrics.jsonl")
    assert len(train) == 30 and [e["step"] for e in evals] == [15, 30]


def test_learning_curves_draw_each_warmup_stage_apart(tmp_path, monkeypatch):
    """A warm-up's alignment loss (squared distances) and answer loss (nats) are two lines, each
    averaged within its own stage; memory_tokens fill the B_mem panel."""
    rows = ([{"step": s, "stage": "align", "loss": 20.0 - s, "token_accuracy": 0.01 * s, "memory_tokens": 19.0}
             for s in range(1, 11)]
            + [{"step": s, "stage": "answer", "loss": 1.0, "token_accuracy": 0.5, "memory_tokens": 80.0}
               for s in range(11, 16)])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.setdefault("fig", fig) and Path(path))
    plots.learning_curves(tmp_path, smooth=3)
    axes = {ax.get_title(): ax for ax in drawn["fig"].axes}
    loss = {line.get_label(): line for line in axes["loss"].get_lines() if not line.get_label().startswith("_")}
    assert set(loss) == {"loss (align)", "loss (answer)"}
    assert list(loss["loss (align)"].get_xdata()) == list(range(1, 11))
    assert list(loss["loss (answer)"].get_ydata()) == [1.0] * 5  # not averaged with the alignment steps
    assert {line.get_label() for line in axes["mean B_mem"].get_lines()} >= {"memory_tokens (answer)"}


def check_points(fig, want: dict[str, tuple[float, float]]) -> None:
    """One labelled point (#Tok, accuracy) per system, in the order given."""
    (ax,) = fig.axes
    points = np.concatenate([np.asarray(c.get_offsets()) for c in ax.collections])
    np.testing.assert_allclose(points, np.array(list(want.values()), dtype=float))
    assert [t.get_text() for t in ax.texts] == list(want)


def test_accuracy_vs_tokens(tmp_path, drawn):
    out = plots.accuracy_vs_tokens({"ElasticMem": results(0.7, 300), "text-RAG": results(0.6, 2500),
                                    "no memory": results(0.4, 120)}, tmp_path / "cmp.png")
    assert_png(out)
    check_points(drawn["cmp.png"], {"ElasticMem": (300, 0.7), "text-RAG": (2500, 0.6), "no memory": (120, 0.4)})
    assert drawn["cmp.png"].axes[0].get_xscale() == "log"  # 2500 / 120 > 10


def test_cli(run_dir, predictions, tmp_path, drawn):
    assert plots.main(["learning-curves", str(run_dir), "--out", str(tmp_path / "lc.png")]) == 0
    assert_png(tmp_path / "lc.png")
    check_learning_curves(drawn["lc.png"])
    paths = []
    for name, (acc, tok) in {"a": (0.5, 100), "b": (0.6, 200)}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(results(acc, tok)))
        paths.append(str(tmp_path / name / "results.json"))
    assert plots.main(["compare", *paths, "--out", str(tmp_path / "cmp.png")]) == 0
    assert_png(tmp_path / "cmp.png")
    check_points(drawn["cmp.png"], {"a": (100, 0.5), "b": (200, 0.6)})
    assert drawn["cmp.png"].axes[0].get_xscale() == "linear"  # 200 / 100 < 10
    assert plots.main(["budgets", str(predictions), "--out-dir", str(tmp_path / "b")]) == 0
    for name in ("budget_by_rank.png", "budget_vs_score.png", "budget_histogram.png"):
        assert_png(tmp_path / "b" / name)
    check_budget_figures(drawn, "budget_by_rank.png", "budget_vs_score.png", "budget_histogram.png")


# --------------------------------------------------------------------------- reports


def free_form(f1_multi: float, f1_temporal: float) -> dict:
    metrics = lambda f1: {"f1": f1, "bleu1": f1 / 2, "rougeL": 0.3, "rouge2": 0.1, "sbert": 0.8}
    return {"overall": metrics((f1_multi + f1_temporal) / 2),
            "per_type": {"2": metrics(f1_temporal), "1": metrics(f1_multi)},
            "counts": {"1": 3, "2": 5}, "absent": {"meteor": "METEOR needs WordNet"}}


def test_report_one_evaluation():
    r = results(0.615, 231.44, system="elasticmem", avg_B_mem=43.04, accuracy_ci95=[0.5452, 0.6803],
                per_type_ci95={"temporal": [0.526, 0.6971], "single_hop": [0.2204, 0.4296]},
                budget_stats={"avg_B_mem": 43.04, "mean_budget": 2.151, "zero_fraction": 0.25, "max_budget": 20,
                              "histogram": [1]},
                free_form=free_form(0.4, 0.2))
    md = report.results_markdown(r)
    assert "| accuracy | 61.5 % [54.5, 68.0] (n = 200) |" in md  # the interval as stored in results.json
    assert "too few questions" not in md  # n = 200
    assert "| #Tok (tokens per example) | 231.4 |" in md
    assert "| B_mem (sum of budgets per example) | 43.0 |" in md
    assert "| question type | n | accuracy (%) [95 % CI] |" in md
    assert "| temporal | 120 | 61.5 [52.6, 69.7] |" in md and "| single_hop | 80 | 31.5 [22.0, 43.0] |" in md
    # latency 0.05 + 0 + 0.2 = 0.25 s; retrieval 0.05 / 0.25 = 20.0 %
    assert "| retrieval | 0.0500 | 20.0 |" in md and "| **total** | 0.2500 | 100.0 |" in md
    assert "| 2.15 | 25.0 | 20 | 43.0 |" in md
    # A-Mem Table 1: Multi Hop (category 1) before Temporal (2); F1 40.00 / BLEU-1 20.00, then 20.00 / 10.00;
    # overall F1 30.00, BLEU-1 15.00
    assert "| system | Multi Hop F1 | Multi Hop BLEU-1 | Temporal F1 | Temporal BLEU-1 |" in md
    assert "| elasticmem | 40.00 | 20.00 | 20.00 | 10.00 | 30.00 | 15.00 | 231.4 |" in md
    # all-metrics table: METEOR absent, named with its reason, not a number
    assert "| category | n | F1 | BLEU-1 | ROUGE-L | ROUGE-2 | SBERT |" in md
    assert "| Multi Hop | 3 | 40.00 | 20.00 | 30.00 | 10.00 | 80.00 |" in md
    assert "| **Overall** | 8 |" in md
    assert "meteor not computed: METEOR needs WordNet" in md


def test_report_of_a_small_run_written_before_intervals():
    """A results.json without interval fields gets the Wilson interval of its counts, and n < 200
    is flagged. 5 of 10: centre 0.5, half-width 1.96 / 13.84 * sqrt(2.5 + 0.96) = 0.2634;
    3 of 4: centre (3 + 1.92) / 7.84 = 0.6276, half-width 1.96 / 7.84 * sqrt(0.75 + 0.96) = 0.3269."""
    r = {"accuracy": 0.5, "num_examples": 10, "per_type": {"a": 0.75, "b": 1 / 3},
         "per_type_counts": {"a": 4, "b": 6}}
    md = report.results_markdown(r)
    assert "| accuracy | 50.0 % [23.7, 76.3] (n = 10) |" in md
    assert "**n < 200: too few questions for a headline** (n = 10)" in md
    assert "| a | 4 | 75.0 [30.1, 95.4] |" in md
    r = {"success_rate": 0.5, "accuracy": 0.5, "num_examples": 10}
    assert "| success rate | 50.0 % [23.7, 76.3] (n = 10) |" in report.results_markdown(r)


def _predictions(path: Path, outcomes: dict[str, bool]) -> dict[str, bool]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "correct": c}) + "\n" for i, c in outcomes.items()))
    return outcomes


def _mcnemar_by_hand(b: int, c: int) -> float:
    return min(1.0, 2 * sum(math.comb(b + c, i) for i in range(min(b, c) + 1)) / 2 ** (b + c))


def test_report_comparison(tmp_path):
    # 200 questions: both right on q0-q99, only ElasticMem on q100-q139, only text-RAG on q140-q159, neither after:
    # ElasticMem 140/200 = 70 %, text-RAG 120/200 = 60 %; text-RAG - ElasticMem = -10 points on 60 discordant
    em = {f"q{i}": i < 140 for i in range(200)}
    rag = {f"q{i}": i < 100 or 140 <= i < 160 for i in range(200)}
    rs = {"ElasticMem": results(0.7, 300.0, avg_B_mem=42.0, accuracy_ci95=[0.6332, 0.7592]),
          "text-RAG": results(0.6, 2500.0, accuracy_ci95=[0.5308, 0.6654])}
    md = report.comparison_markdown(rs, correct={"ElasticMem": em, "text-RAG": rag})
    assert "| system | n | accuracy (%) [95 % CI] | #Tok | B_mem | memory tokens | latency (s) |" in md
    assert ("| ElasticMem | 200 | 70.0 [63.3, 75.9] | 300.0 | 42.0 | 30.0 | 0.2500 | 0.0500 | 0.0000 | 0.2000 |"
            in md)
    assert "| text-RAG | 200 | 60.0 [53.1, 66.5] | 2500.0 | – | 250.0 |" in md
    assert "too few questions" not in md  # 200 questions
    assert "## Paired against ElasticMem" in md
    c = stats.paired_comparison(*stats.pair_by_id(em, rag))
    assert c.p_value == pytest.approx(_mcnemar_by_hand(40, 20))
    lo, hi = (f"{100 * x:+.1f}" for x in c.difference_ci)
    p = f"{c.p_value:.3f}"
    assert f"| text-RAG | 200 | -10.0 [{lo}, {hi}] | 20 | 40 | {p} |  |" in md
    # per type, with n: temporal 70 %, single_hop 40 % (results() puts acc - 0.3 there)
    assert "| system | single_hop | temporal |" in md
    assert "| ElasticMem | 40.0 [" in md and "(n = 80) | 70.0 [" in md and "(n = 120) |" in md
    assert "Free-form" not in md  # no free-form metrics in these results

    # other questions: not paired, said so; fewer than 200 flagged
    small = {"a": results(0.5, 10.0, num_examples=4), "b": results(0.75, 10.0, num_examples=4)}
    md = report.comparison_markdown(small, correct={"a": {"x": True, "y": False}, "b": {"x": True, "z": False}})
    assert "**n < 200: too few questions for a headline**: a, b" in md
    assert "| b | – | – | – | – | – | not paired: not the same questions: 1 id(s) only in the first" in md

    # the CLI pairs by the predictions.jsonl beside each results.json; writes comparison.json beside the .md
    for name, r, outcomes in (("em", rs["ElasticMem"], em), ("rag", rs["text-RAG"], rag)):
        _predictions(tmp_path / name / "predictions.jsonl", outcomes)
        (tmp_path / name / "results.json").write_text(json.dumps(r))
    assert report.main(["compare", str(tmp_path / "em/results.json"), str(tmp_path / "rag/results.json"),
                        "--names", "em", "rag", "--out", str(tmp_path / "c.md")]) == 0
    assert f"| rag | 200 | -10.0 [{lo}, {hi}] | 20 | 40 | {p} |" in (tmp_path / "c.md").read_text()
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["reference"] == "em" and data["too_few_for_headline"] == [] and set(data["systems"]) == {"em", "rag"}
    pair = data["paired"]["rag"]
    assert (pair["n"], pair["only_a_correct"], pair["only_b_correct"], pair["both_correct"]) == (200, 40, 20, 100)
    assert pair["difference"] == pytest.approx(-0.1) and pair["difference_ci"] == pytest.approx(list(c.difference_ci))
    assert pair["p_value"] == pytest.approx(_mcnemar_by_hand(40, 20))

    p = tmp_path / "r.json"
    p.write_text(json.dumps(results(0.5, 10.0, system="x")))
    assert report.main(["one", str(p)]) == 0
    # 100 of 200 (no stored interval): centre 0.5, half-width 1.96 / 203.84 * sqrt(50 + 0.96) = 0.0686
    assert "| accuracy | 50.0 % [43.1, 56.9] (n = 200) |" in (tmp_path / "report.md").read_text()
    assert report.main(["compare", str(p), str(p), "--names", "u", "v", "--out", str(tmp_path / "c.md")]) == 0
    text = (tmp_path / "c.md").read_text()
    assert "| u | 200 | 50.0 [43.1, 56.9] |" in text
    assert "not paired: no per-example outcomes of u" in text  # no predictions.jsonl beside r.json


def test_load_correct_refuses_a_repeated_id(tmp_path):
    path = tmp_path / "predictions.jsonl"
    path.write_text('{"id": "q1", "correct": true}\n{"id": "q1", "correct": false}\n')
    with pytest.raises(ValueError, match="q1.*twice"):
        report.load_correct(path)


def test_locomo_category_names():
    assert [report.locomo_category(t) for t in ("1", "category_4", "Multi-Hop", "adversarial", "knowledge-update")] \
        == ["multi_hop", "single_hop", "multi_hop", "adversarial", None]
