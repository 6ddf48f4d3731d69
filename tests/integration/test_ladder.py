"""The reading ladder (python -m elasticmem.apps.ladder) on the tiny mechanism task, checked
against the data: each rung reads what it says, its figures recount from its predictions, and
each rung is paired with the one above it.

    OMP_NUM_THREADS=1 python -m pytest -q tests/integration/test_ladder.py
"""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, load_script, tiny_ladder_checkpoint

from elasticmem.config import load_config

LIMIT = 24
CAPS = (2, 6)


@pytest.fixture(scope="module", params=["hidden", "kv"])
def ladder_run(request, tmp_path_factory):
    """Data, a bank (with per-layer KV for content=kv), an untrained checkpoint with a perturbed
    policy, and its ladder with the cost dial."""
    from elasticmem.apps import ladder

    root = tmp_path_factory.mktemp(f"ladder_{request.param}")
    overrides = [f"data.dir={root}/data", f"bank.dir={root}/bank", "data.synthetic.num_histories=20",
                 f"memory.content={request.param}", f"bank.kv_cache={request.param == 'kv'}", "eval.split=val"]
    cfg = load_config(ROOT / "configs/tiny_mechanism.yaml", overrides)
    tiny_ladder_checkpoint(root, overrides)
    out = root / "ladder"
    code = ladder.main(["--config", str(ROOT / "configs/tiny_mechanism.yaml"), *overrides,
                        f"eval.checkpoint={root / 'ckpt'}", f"eval.output_dir={out}", f"eval.limit={LIMIT}",
                        "eval.batch_size=5", "--caps", ",".join(map(str, CAPS))])
    assert code == 0
    return cfg, out


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_each_rung_reads_what_it_says(ladder_run):
    from elasticmem.bank import Bank
    from elasticmem.data.schema import load_split
    from elasticmem.eval.retrieval import evidence_rows

    cfg, out = ladder_run
    bank = Bank.open(cfg.bank.dir)
    examples = {ex.id: ex for ex in load_split(cfg.data.dir, "val")[:LIMIT]}
    top = cfg.memory.policy.max_budget
    lens = (bank.kv_lengths if cfg.memory.content == "kv" else bank.cache_lengths)
    rec = {name: {r["id"]: r for r in _records(out / name / "predictions.jsonl")}
           for name in ("no_memory", "text_evidence", "latent_evidence", "latent_uniform", "latent_oracle",
                        "latent_learned", "text_topz")}
    for i, ex in examples.items():
        ev = evidence_rows(ex, bank)
        assert ev
        rows = {name: [int(m["ref"].split(":")[1]) for m in r[i]["retrieved"]] for name, r in rec.items()}
        assert rows["no_memory"] == [] and rec["no_memory"][i]["tokens"]["memory"] == 0
        assert set(rows["latent_evidence"]) == ev == set(rows["text_evidence"])
        assert rows["latent_uniform"] == rows["latent_oracle"] == rows["latent_learned"] == rows["text_topz"]
        assert len(rows["latent_learned"]) == cfg.memory.top_z
        budgets = {name: [m["budget"] for m in r[i]["retrieved"]] for name, r in rec.items()}
        assert budgets["latent_evidence"] == [top] * len(ev)
        assert budgets["latent_uniform"] == [top] * cfg.memory.top_z
        assert budgets["latent_oracle"] == [top if r in ev else 0 for r in rows["latent_oracle"]]
        # memory tokens: the readable states each budget takes; text: the chunk's tokens
        want = sum(min(b, int(lens([r])[0])) for r, b in zip(rows["latent_oracle"], budgets["latent_oracle"]))
        assert rec["latent_oracle"][i]["tokens"]["memory"] == want
        assert rec["text_evidence"][i]["tokens"]["memory"] == sum(m["tokens"] for m in rec["text_evidence"][i]["retrieved"])
    # the learned rung's budgets are the policy's own (uneven, not all max)
    assert len({m["budget"] for r in rec["latent_learned"].values() for m in r["retrieved"]}) > 1


def test_figures_recount_from_predictions_and_rungs_pair_with_the_one_above(ladder_run):
    from elasticmem.eval import stats
    from elasticmem.apps.ladder import RUNGS, _applies

    cfg, out = ladder_run
    data = json.loads((out / "ladder.json").read_text())
    names = [r.name for r in RUNGS if _applies(r, cfg.memory.top_z)]
    assert list(data["rungs"]) == names
    correct = {n: {r["id"]: bool(r["correct"]) for r in _records(out / n / "predictions.jsonl")} for n in names}
    for above, name in zip(names, names[1:]):
        row = data["rungs"][name]
        k, n = sum(correct[name].values()), len(correct[name])
        assert row["n"] == n == len(correct["no_memory"]) > 10 and row["accuracy"] == pytest.approx(k / n)
        assert row["ci95"] == pytest.approx(list(stats.wilson_interval(k, n)))
        ids = sorted(correct[name])
        pc = stats.paired_comparison([correct[above][i] for i in ids], [correct[name][i] for i in ids])
        assert row["vs_above"]["reference"] == above
        assert row["vs_above"]["only_a_correct"] == pc.only_a_correct
        assert row["vs_above"]["only_b_correct"] == pc.only_b_correct
        assert row["vs_above"]["p_value"] == pytest.approx(pc.p_value)
    # budgets of evidence vs other memories, recounted
    recs = _records(out / "latent_oracle" / "predictions.jsonl")
    ev = [m["budget"] for r in recs for m in r["retrieved"] if int(m["ref"][4:]) in r["extra"]["evidence"]["rows"]]
    other = [m["budget"] for r in recs for m in r["retrieved"] if int(m["ref"][4:]) not in r["extra"]["evidence"]["rows"]]
    b = data["rungs"]["latent_oracle"]["budgets"]
    assert b["evidence"] == pytest.approx(sum(ev) / len(ev)) and b["other"] == 0.0 == max(other)
    assert b["evidence_memories"] == len(ev) and b["other_memories"] == len(other)
    assert "| latent_learned |" in (out / "ladder.md").read_text()


def test_cost_dial_keeps_each_question_within_its_cap(ladder_run):
    cfg, out = ladder_run
    data = json.loads((out / "ladder.json").read_text())
    assert [d["cap"] for d in data["cost_dial"]] == list(CAPS)
    learned = {r["id"]: r for r in _records(out / "latent_learned" / "predictions.jsonl")}
    for cap in CAPS:
        for r in _records(out / f"learned_cap{cap}" / "predictions.jsonl"):
            budgets = [m["budget"] for m in r["retrieved"]]
            full = [m["budget"] for m in learned[r["id"]]["retrieved"]]
            assert sum(budgets) <= cap and all(b <= f for b, f in zip(budgets, full))
            if sum(full) <= cap:
                assert budgets == full
        for r in _records(out / f"uniform_cap{cap}" / "predictions.jsonl"):
            budgets = [m["budget"] for m in r["retrieved"]]
            assert sum(budgets) == min(cap, cfg.memory.policy.max_budget * len(budgets))
            assert max(budgets) - min(budgets) <= 1


def test_pool_over_seeds_recounts_each_seed_and_sums_the_pairs(ladder_run, tmp_path):
    """``python -m elasticmem.apps.ladder pool``: a second "seed" is the ladder with some learned
    answers flipped; per seed, pooled (per question: each question's mean over the seeds, n =
    the questions) and by-seed figures recount from the two folders."""
    import shutil

    from elasticmem.apps import ladder
    from elasticmem.eval import stats

    _, out = ladder_run
    other = tmp_path / "seed1"
    shutil.copytree(out, other)
    path = other / "latent_learned" / "predictions.jsonl"
    recs = _records(path)
    for r in recs[:5]:
        r["correct"] = not r["correct"]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert ladder.main(["pool", str(out), str(other), "--pairs", "latent_uniform:latent_learned",
                        "--out", str(tmp_path / "summary.md")]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    got = summary["comparisons"]["latent_learned - latent_uniform"]
    diffs, per_question = [], []
    for i, d in enumerate((out, other)):
        a = {r["id"]: bool(r["correct"]) for r in _records(d / "latent_uniform" / "predictions.jsonl")}
        b = {r["id"]: bool(r["correct"]) for r in _records(d / "latent_learned" / "predictions.jsonl")}
        ids = sorted(a)
        pc = stats.paired_comparison([a[k] for k in ids], [b[k] for k in ids])
        assert got["per_seed"][i]["only_b_correct"] == pc.only_b_correct
        assert got["per_seed"][i]["only_a_correct"] == pc.only_a_correct
        diffs.append(sum(b.values()) / len(b) - sum(a.values()) / len(a))
        per_question.append([int(b[k]) - int(a[k]) for k in ids])
    d_q = [(x + y) / 2 for x, y in zip(*per_question)]  # each question's mean difference over the 2 seeds
    assert got["pooled"]["n"] == len(d_q) and got["pooled"]["difference"] == pytest.approx(sum(d_q) / len(d_q))
    assert got["pooled"]["p_value"] == pytest.approx(stats.sign_flip_p(d_q)[0])
    assert got["pooled"]["pooling"] == f"per question, mean over 2 seeds, paired bootstrap over {len(d_q)} questions"
    assert got["by_seed"]["difference"] == pytest.approx(sum(diffs) / 2)
    assert "latent_learned - latent_uniform" in (tmp_path / "summary.md").read_text()
    # each rung's accuracy per seed and pooled, recounted from the predictions
    learned = summary["rungs"]["latent_learned"]
    k = [sum(r["correct"] for r in _records(d / "latent_learned" / "predictions.jsonl")) for d in (out, other)]
    n = [len(_records(d / "latent_learned" / "predictions.jsonl")) for d in (out, other)]
    assert [s["accuracy"] for s in learned["per_seed"]] == pytest.approx([k[0] / n[0], k[1] / n[1]])
    assert learned["pooled"]["n"] == n[0] == n[1] and learned["pooled"]["accuracy"] == pytest.approx(sum(k) / sum(n))
    by_q = {}
    for d in (out, other):
        for r in _records(d / "latent_learned" / "predictions.jsonl"):
            by_q.setdefault(r["id"], []).append(float(r["correct"]))
    per_q = [sum(v) / 2 for _, v in sorted(by_q.items())]
    assert learned["pooled"]["ci95"] == pytest.approx(list(stats.bootstrap_mean_interval(per_q)))
    assert set(summary["rungs"]) >= {r.name for r in ladder.RUNGS if not r.derived and ladder._applies(r, 4)}

    # a rung one seed lacks (a control still running there) is compared over the seeds that have it
    shutil.rmtree(other / "latent_oracle")
    assert ladder.main(["pool", str(out), str(other), "--pairs", "latent_oracle:latent_learned",
                        "--out", str(tmp_path / "partial.md")]) == 0
    partial = json.loads((tmp_path / "partial.json").read_text())
    got = partial["comparisons"]["latent_learned - latent_oracle"]
    assert got["dirs"] == [str(out)] and got["pooled"]["n"] == n[0] and got["by_seed"]["difference_ci"] is None
    assert partial["rungs"]["latent_oracle"]["dirs"] == [str(out)]
    assert partial["rungs"]["latent_learned"]["pooled"]["n"] == n[0]
    assert partial["rungs"]["latent_learned"]["pooled"]["seeds"] == 2


def test_persona_results_tables_recount_from_the_seeds_ladders(ladder_run, tmp_path):
    """``scripts/persona_results.py`` (docs/recipe.md's tables over seeds): each published cell
    equals the figure recounted from the seeds' predictions' text (pooled per question), and a
    control one seed lacks reads "not run" there and is pooled over the seeds that have it."""
    import shutil

    from elasticmem.eval import stats
    from elasticmem.eval.rescore import rescore_file, rescore_record

    _, out = ladder_run
    root = tmp_path / "OUT"
    for s in ("0", "1"):
        shutil.copytree(out, root / f"s{s}" / "ladder")
    learned = root / "s1" / "ladder" / "latent_learned" / "predictions.jsonl"
    recs = _records(learned)
    for r in recs[:7]:  # the answer's text flipped; its stored flag left stale: the tables follow the text
        r["prediction"] = f"({'b' if r['gold'] == 'a' else 'a'})" if rescore_record(r, 4) else f"({r['gold']})"
    learned.write_text("".join(json.dumps(r) + "\n" for r in recs))
    shutil.rmtree(root / "s1" / "ladder" / "latent_oracle")
    shutil.copytree(root / "s0" / "ladder" / "no_memory", root / "s0" / "ladder" / "no_memory_trained")

    res = tmp_path / "results"
    assert load_script("persona_results").main([str(root), "--commit", "abc1234", "--results", str(res)]) == 0
    render = load_script("gen_results_tables").render
    rungs = {row.split(" | ")[0].strip("| *"): row.split(" | ")
             for row in render(json.loads((res / "persona_rungs.json").read_text())).splitlines()[2:]}

    def acc(k, n):
        lo, hi = stats.wilson_interval(k, n)
        return f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]"

    got = [rescore_file(root / f"s{s}" / "ladder" / "latent_learned" / "predictions.jsonl", 4) for s in ("0", "1")]
    k = [sum(g.values()) for g in got]
    n = len(recs)
    per_q = [(got[0][i] + got[1][i]) / 2 for i in sorted(got[0])]  # each question's mean over the 2 seeds
    lo, hi = stats.bootstrap_mean_interval(per_q)
    row = rungs["top 8, latent, learned budgets (ElasticMem)"]
    assert row[1:4] == [acc(k[0], n), acc(k[1], n),
                        f"{sum(k) / (2 * n):.3f} [{lo:.3f}, {hi:.3f}], n = {n} questions x 2 seeds"]
    oracle = rungs["top 8, latent, oracle budgets"]
    assert oracle[2] == "not run" and oracle[3].endswith(f"n = {n} questions x 1 seed")
    control = rungs["no-memory reasoner, same recipe (control)"]
    assert control[2] == "not run" and "text memory, same recipe (control)" not in rungs

    comparisons = render(json.loads((res / "persona_comparisons.json").read_text()))
    a = {r["id"]: bool(r["correct"]) for s in ("0",)
         for r in _records(root / f"s{s}" / "ladder" / "latent_uniform" / "predictions.jsonl")}
    b = {r["id"]: bool(r["correct"]) for r in _records(root / "s0" / "ladder" / "latent_learned" / "predictions.jsonl")}
    pc = stats.paired_comparison(*stats.pair_by_id(a, b))
    lo, hi = pc.difference_ci
    assert f"{100 * pc.difference:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}], p = {pc.p_value:.2g}" in comparisons
    dial = render(json.loads((res / "persona_cost_dial.json").read_text()))
    assert [line.split(" | ")[0].strip("| ") for line in dial.splitlines()[2:]] == [str(c) for c in CAPS]
    spec = json.loads((res / "persona_losses.json").read_text())
    assert spec["commit"] == "abc1234" and "persona_results.py" in spec["command"]
