"""The reading ladder's simple budget rules (top-K, the score gap chosen on validation, the learned
policy's total spread evenly, each under the cost dial's caps) on the tiny mechanism task: each
rule gives the budgets it says, the gap is the validation's best, and the comparisons with the
learned budgets recount from the predictions.

    OMP_NUM_THREADS=1 python -m pytest -q tests/integration/test_ladder_rules.py
"""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, load_script, tiny_ladder_checkpoint

from elasticmem.config import load_config

LIMIT = 24
CAPS = (2, 6)
GAPS = (0.0, 0.05, 0.3, 2.0)
RUNGS = "latent_uniform,latent_learned,rule_top1,rule_top2,rule_gap,rule_spread,text_top2"


@pytest.fixture(scope="module")
def rules_run(tmp_path_factory):
    """Data, a bank, an untrained checkpoint with a perturbed policy, and the ladder's rule rungs."""
    from elasticmem.apps import ladder

    root = tmp_path_factory.mktemp("ladder_rules")
    overrides = [f"data.dir={root}/data", f"bank.dir={root}/bank", "data.synthetic.num_histories=60",
                 "eval.split=test"]
    cfg = load_config(ROOT / "configs/tiny_mechanism.yaml", overrides)
    tiny_ladder_checkpoint(root, overrides)
    out = root / "ladder"
    code = ladder.main(["--config", str(ROOT / "configs/tiny_mechanism.yaml"), *overrides,
                        f"eval.checkpoint={root / 'ckpt'}", f"eval.output_dir={out}", f"eval.limit={LIMIT}",
                        "eval.batch_size=6", "--caps", ",".join(map(str, CAPS)), "--rungs", RUNGS
                        + "," + ",".join(f"{r}_cap{c}" for r in ("learned", "uniform", "top1", "top2", "gap")
                                         for c in CAPS),
                        "ladder.gaps=" + ",".join(map(str, GAPS))])
    assert code == 0
    return cfg, out


def _records(path):
    return {r["id"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}


def _budgets(r):
    return [m["budget"] for m in sorted(r["retrieved"], key=lambda m: m["rank"])]


def test_each_rule_gives_the_budgets_it_says(rules_run):
    cfg, out = rules_run
    top, Z = cfg.memory.policy.max_budget, cfg.memory.top_z
    data = json.loads((out / "ladder.json").read_text())
    gap = data["score_gap"]
    learned = _records(out / "latent_learned" / "predictions.jsonl")
    total = round(sum(r["tokens"]["memory"] for r in learned.values()) / len(learned))
    rec = {name: _records(out / name / "predictions.jsonl") for name in ("rule_top1", "rule_top2", "rule_gap",
                                                                         "rule_spread", "latent_uniform")}
    assert len(learned) == LIMIT
    for i, r in learned.items():
        rows = [m["ref"] for m in r["retrieved"]]
        for name in rec:  # every rule reads the learned rung's memories
            assert [m["ref"] for m in rec[name][i]["retrieved"]] == rows
        assert _budgets(rec["rule_top1"][i]) == [top] + [0] * (Z - 1)
        assert _budgets(rec["rule_top2"][i]) == [top] * 2 + [0] * (Z - 2)
        scores = [m["score"] for m in sorted(rec["rule_gap"][i]["retrieved"], key=lambda m: m["rank"])]
        assert _budgets(rec["rule_gap"][i]) == [top if s >= max(scores) - gap - 1e-6 else 0 for s in scores]
        spread = _budgets(rec["rule_spread"][i])
        assert sum(spread) == min(total, top * Z) and max(spread) - min(spread) <= 1
    for c in CAPS:  # the rules under a cap keep their memories by rank until the cap
        for i, r in _records(out / f"top2_cap{c}" / "predictions.jsonl").items():
            want, left = [], c
            for b in _budgets(rec["rule_top2"][i]):
                want.append(min(b, left))
                left -= want[-1]
            assert _budgets(r) == want


def test_the_gap_is_the_validations_best(rules_run):
    _, out = rules_run
    data = json.loads((out / "ladder.json").read_text())
    val = {g: json.loads((out / "gap_val" / f"gap_{g:g}" / "results.json").read_text()) for g in GAPS}
    for g, res in val.items():
        assert res["num_examples"] == LIMIT
    best = max(val.values(), key=lambda r: r["accuracy"])["accuracy"]
    ties = [g for g in GAPS if val[g]["accuracy"] == best]
    fewest = min(val[g]["avg_memory_tokens"] for g in ties)
    assert data["score_gap"] == min(g for g in ties if val[g]["avg_memory_tokens"] == fewest)
    # the widest gap keeps every memory: the uniform rung's budgets on validation
    widest = _records(out / "gap_val" / f"gap_{max(GAPS):g}" / "predictions.jsonl")
    assert all(min(_budgets(r)) > 0 for r in widest.values())


def test_learned_against_the_best_rule_recounts(rules_run):
    from elasticmem.eval import stats
    from elasticmem.eval.budget_rules import RULES, TOKEN_SLACK

    _, out = rules_run
    data = json.loads((out / "ladder.json").read_text())
    res = {n: json.loads((out / n / "results.json").read_text()) for n in ("latent_learned", *RULES)
           if (out / n / "results.json").is_file()}
    learned_tokens = res["latent_learned"]["avg_memory_tokens"]
    within = [n for n in RULES if n in res and res[n]["avg_memory_tokens"] <= learned_tokens + TOKEN_SLACK]
    got = data["rules"]["at_equal_or_fewer_tokens"]
    if not within:
        assert got is None
    else:
        best = min(within, key=lambda n: (-res[n]["accuracy"], res[n]["avg_memory_tokens"], n))  # ties: fewer tokens
        assert got["rule"] == best
        a = {i: r["correct"] for i, r in _records(out / best / "predictions.jsonl").items()}
        b = {i: r["correct"] for i, r in _records(out / "latent_learned" / "predictions.jsonl").items()}
        pc = stats.paired_comparison(*stats.pair_by_id(a, b))
        assert got["difference"] == pytest.approx(pc.difference) and got["p_value"] == pytest.approx(pc.p_value)
    assert [d["cap"] for d in data["rules"]["cost_dial"]] == list(CAPS)
    for d in data["rules"]["cost_dial"]:
        accs = {r: json.loads((out / f"{r}_cap{d['cap']}" / "results.json").read_text())["accuracy"]
                for r in ("uniform", "top1", "top2", "gap")}
        assert d["rule_accuracy"] == pytest.approx(max(accs.values()))
    md = (out / "ladder.md").read_text()
    assert "## The learned budgets against the simple rules" in md and "## The learned budget vectors" in md


def test_budget_vectors_recount(rules_run):
    from collections import Counter

    _, out = rules_run
    data = json.loads((out / "ladder.json").read_text())
    vectors = [tuple(_budgets(r)) for r in _records(out / "latent_learned" / "predictions.jsonl").values()]
    got = data["budget_vectors"]
    assert got["n"] == len(vectors) and got["distinct"] == len(set(vectors))
    for row, (v, c) in zip(got["most_common"], Counter(vectors).most_common(8)):
        assert row["share"] == pytest.approx(c / len(vectors))
        assert Counter(vectors)[tuple(row["budgets"])] == c


def test_ladder_results_publish_re_scored_figures_and_refuse_edited_text(rules_run, tmp_path):
    """scripts/ladder_results.py: each cell re-counts from the trimmed predictions' answer text, and
    the table generator refuses the file once an answer's text no longer gives its figure."""
    from elasticmem.data.rewards import parse_option_letter
    from elasticmem.eval import stats

    _, out = rules_run

    res = tmp_path / "results"
    assert load_script("ladder_results").main([str(out), "--name", "x/ladder", "--title", "tiny", "--num-options", "4",
                                          "--results", str(res)]) == 0
    spec = json.loads((res / "x" / "ladder.json").read_text())
    gen = load_script("gen_results_tables")
    gen.verify(spec, res / "x" / "ladder.json")  # the published figures follow from the text
    rows = {r.split(" | ")[0].strip("| *"): r.split(" | ") for r in gen.render(spec).splitlines()[2:]}
    texts = _records(out / "rule_top2" / "predictions.jsonl")
    right = {i: parse_option_letter(r["prediction"], 4) == r["gold"] for i, r in texts.items()}
    k, n = sum(right.values()), len(right)
    lo, hi = stats.wilson_interval(k, n)
    assert rows["rule_top2"][2] == f"{k / n:.3f} [{lo:.3f}, {hi:.3f}], n = {n}"
    learned = {i: parse_option_letter(r["prediction"], 4) == r["gold"]
               for i, r in _records(out / "latent_learned" / "predictions.jsonl").items()}
    pc = stats.paired_comparison(*stats.pair_by_id(right, learned))
    assert rows["rule_top2"][4].startswith(f"{100 * pc.difference:+.1f}")
    # an answer's text edited after publishing: the figure no longer follows, the generator refuses
    trimmed = res / "x" / "ladder" / "rule_top2.predictions.jsonl"
    recs = [json.loads(line) for line in trimmed.read_text().splitlines()]
    first = recs[0]
    first["prediction"] = (f"({'b' if first['gold'] != 'b' else 'c'})" if right[first["id"]] else f"({first['gold']})")
    trimmed.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(ValueError, match="rule_top2"):
        gen.verify(spec, res / "x" / "ladder.json")


def test_ladder_results_on_one_question_type_count_only_its_questions(rules_run, tmp_path):
    """``--question-type T``: every cell re-counts over the questions of type T alone (the ladder's
    own records filtered independently here), and no budget file is written for the subset."""
    from elasticmem.data.rewards import parse_option_letter
    from elasticmem.eval import stats

    import shutil

    _, ran = rules_run
    out = tmp_path / "ladder"  # the tiny task has one question type: a copy whose odd questions are "other"
    shutil.copytree(ran, out)
    ids = sorted(_records(out / "latent_learned" / "predictions.jsonl"))
    other = set(ids[1::2])
    for f in out.glob("*/predictions*.jsonl"):
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        f.write_text("".join(json.dumps({**r, "question_type": "other" if r["id"] in other else r["question_type"]}) + "\n"
                             for r in recs))
    texts = _records(out / "rule_top2" / "predictions.jsonl")
    qtype = "other"
    res = tmp_path / "results"
    assert load_script("ladder_results").main([str(out), "--name", "x/typed", "--title", "tiny", "--num-options", "4",
                                               "--results", str(res), "--question-type", qtype]) == 0
    spec = json.loads((res / "x" / "typed.json").read_text())
    assert spec["question_type"] == qtype and not (res / "x" / "typed_budgets.json").exists()
    gen = load_script("gen_results_tables")
    gen.verify(spec, res / "x" / "typed.json")
    rows = {r.split(" | ")[0].strip("| *"): r.split(" | ") for r in gen.render(spec).splitlines()[2:]}
    right = [parse_option_letter(r["prediction"], 4) == r["gold"] for r in texts.values() if r["question_type"] == qtype]
    k, n = sum(right), len(right)
    assert 0 < n < len(texts)
    lo, hi = stats.wilson_interval(k, n)
    assert rows["rule_top2"][2] == f"{k / n:.3f} [{lo:.3f}, {hi:.3f}], n = {n}"
