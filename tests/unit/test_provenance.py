"""Statistics and provenance that hold up: what made a results file, figures re-scored from the
answers' text, and seeds pooled per question.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_provenance.py

- a tiny evaluation (evaluate.py's main on the tiny random model, with a checkpoint) writes a
  ``results.json`` whose ``provenance`` names the commit (``git rev-parse HEAD`` run here), the
  dirty flag (``git status --porcelain``) and hashes recomputed here with hashlib: the resolved
  config, the bank manifest, the checkpoint folder and the predictions;
- ``scripts/gen_results_tables.py`` refuses a results file whose predictions re-score from their
  text to another figure (or whose sha256 differs), and accepts the unmodified one;
- ``stats.pooled_per_question`` / ``pooled_paired_per_question`` against independent computations
  (identical seeds, a case worked by hand, ``scipy.stats.bootstrap`` / ``permutation_test``, the
  exact McNemar test on one seed);
- ``ladder.pool`` and ``scripts/persona_results.py`` on a synthetic fixture of three seeds'
  ladder folders: n = questions, each pooled figure says how it was pooled, and the tables follow
  the answers' text, not the stored ``correct`` flags.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from scipy import stats as scipy_stats

from elasticmem.eval import stats as S


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _tree_sha(root: Path) -> str:
    """The checkpoint's content hash as documented: sha256 over "<relative path>\\0<file sha256>\\n"
    lines of its files, sorted by relative path (walked here with os.walk)."""
    files = sorted((Path(d, f).relative_to(root).as_posix(), Path(d, f)) for d, _, fs in os.walk(root) for f in fs)
    return hashlib.sha256("".join(f"{rel}\0{_sha(p)}\n" for rel, p in files).encode()).hexdigest()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- a tiny evaluation's provenance


@pytest.fixture(scope="module")
def tiny_eval(tmp_path_factory):
    """Tiny data, its bank, an untrained checkpoint, and evaluate.py's run of it on 12 questions."""
    import torch

    from elasticmem.apps import evaluate

    from elasticmem.backbone import load_backbone
    from elasticmem.bank import build_bank
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic
    from elasticmem.systems import build_system

    root = tmp_path_factory.mktemp("prov")
    data = [f"data.dir={root}/data", f"bank.dir={root}/bank", "data.synthetic.num_histories=20"]
    cfg = load_config(ROOT / "configs/tiny.yaml", data)
    write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    examples = {s: load_split(cfg.data.dir, s) for s in ("train", "val", "test")}
    build_bank(examples, load_backbone(cfg.backbone), cfg.chunking, cfg.bank, torch.float32, show_progress=False)
    build_system(cfg).model.save_pretrained(root / "ckpt")
    args = [*data, f"eval.checkpoint={root / 'ckpt'}", f"eval.output_dir={root / 'ev'}", "eval.limit=12",
            "eval.split=val", "eval.plots=false", "eval.case_studies=0"]
    assert evaluate.main(["--config", str(ROOT / "configs/tiny.yaml"), *args]) == 0  # evaluate.py's main
    return root, args


def test_results_json_names_the_commit_the_dirty_flag_and_the_hashes(tiny_eval):
    from elasticmem.config import load_config
    from elasticmem.apps import evaluate

    root, args = tiny_eval
    prov = json.loads((root / "ev" / "results.json").read_text())["provenance"]
    head, porcelain = _git("rev-parse", "HEAD").strip(), _git("status", "--porcelain")
    assert prov["code"]["commit"] == head and prov["code"]["reason"] is None
    assert prov["code"]["dirty"] is bool(porcelain.strip())
    assert Path(prov["code"]["repo"]).resolve() == ROOT.resolve()
    # the config as the CLI resolves it, hashed here from its canonical JSON
    cfg = load_config(ROOT / "configs/tiny.yaml", evaluate._expand(args))
    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    assert prov["config_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert prov["bank_manifest"]["sha256"] == _sha(root / "bank" / "manifest.json")
    assert Path(prov["bank_manifest"]["path"]).resolve() == (root / "bank" / "manifest.json").resolve()
    assert prov["checkpoint"]["sha256"] == _tree_sha(root / "ckpt")
    assert prov["checkpoint"]["files"] == sum(len(fs) for _, _, fs in os.walk(root / "ckpt")) > 1
    assert prov["retrieval_map"] is None  # memory.retrieval_map not set
    assert prov["predictions_sha256"] == _sha(root / "ev" / "predictions.jsonl")


def test_retrieval_map_missing_inputs_and_a_folder_outside_git(tmp_path):
    from elasticmem.config import load_config
    from elasticmem.eval import provenance as P

    (tmp_path / "map.safetensors").write_bytes(os.urandom(3 * (1 << 20) + 17))  # more than one 1 MB block
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"memory.retrieval_map={tmp_path / 'map.safetensors'}",
                                                  f"eval.checkpoint={tmp_path / 'no_such_ckpt'}"])
    prov = P.evaluation_provenance(cfg, bank_dir=tmp_path / "no_bank")
    assert prov["retrieval_map"]["sha256"] == _sha(tmp_path / "map.safetensors")
    assert prov["checkpoint"]["sha256"] is None and prov["checkpoint"]["reason"] == "does not exist"
    assert prov["bank_manifest"]["sha256"] is None
    # another config, another hash; the same config, the same hash
    other = load_config(ROOT / "configs/tiny.yaml", ["memory.top_z=2"])
    assert P.config_sha256(other) != P.config_sha256(cfg) == P.config_sha256(dataclasses.replace(cfg))
    outside = P.git_state(tmp_path)
    assert outside["commit"] is None and outside["dirty"] is None and "not a git checkout" in outside["reason"]


# ---------------------------------------------------------------- re-scored published figures


def _results_file(tmp_path: Path, predictions: Path, name: str = "table.json") -> Path:
    """A docs/results-style file whose one figure comes from ``predictions`` (re-scored now)."""
    from elasticmem.eval.rescore import predictions_entry

    entry = predictions_entry(predictions, ROOT, num_options=4, figure="systems.tiny.accuracy")
    spec = {"command": "evaluate.py ...", "commit": "abc1234", "provenance": "a test", "predictions": {"tiny": entry},
            "data": {"systems": {"tiny": {"accuracy": entry["accuracy"]}}},
            "table": {"header": ["system", "accuracy"], "rows": [["tiny", "{systems[tiny][accuracy]:.3f}"]]}}
    path = tmp_path / name
    path.write_text(json.dumps(spec))
    return path


def _flip_one(predictions: Path) -> None:
    """Rewrite one answer's text so that it re-scores the other way; its stored flag stays."""
    from elasticmem.eval.rescore import rescore_record

    recs = [json.loads(line) for line in predictions.read_text().splitlines()]
    r = recs[0]
    r["prediction"] = f"({'b' if r['gold'] == 'a' else 'a'})" if rescore_record(r, 4) else f"({r['gold']})"
    predictions.write_text("".join(json.dumps(x) + "\n" for x in recs))


def test_table_generator_refuses_predictions_that_rescore_to_another_figure(tiny_eval, tmp_path, capsys):
    root, _ = tiny_eval
    gen = _script("gen_results_tables")
    preds = tmp_path / "predictions.jsonl"
    preds.write_bytes((root / "ev" / "predictions.jsonl").read_bytes())
    good = _results_file(tmp_path, preds)
    assert gen.main(["--verify", str(good)]) == 0
    assert "as published" in capsys.readouterr().out
    published = json.loads(good.read_text())["predictions"]["tiny"]["accuracy"]

    # one answer's text edited (its stored correct flag kept), sha256 updated: the figure is refused
    _flip_one(preds)
    spec = json.loads(good.read_text())
    spec["predictions"]["tiny"]["sha256"] = _sha(preds)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(spec))
    assert gen.main(["--verify", str(bad)]) == 2
    err = capsys.readouterr().err
    n = len(preds.read_text().splitlines())
    assert "bad.json" in err and str(preds) in err and repr(published) in err
    assert any(repr((round(published * n) + d) / n) in err for d in (-1, 1))  # the re-scored figure
    # the same edit without a new sha256: refused as other predictions than the published ones
    assert gen.main(["--verify", str(good)]) == 2
    assert "sha256" in capsys.readouterr().err

    # the Python check says the same
    from elasticmem.eval.rescore import RescoreError, check_predictions

    with pytest.raises(RescoreError, match="re-scores from its text"):
        check_predictions(json.loads(bad.read_text()), ROOT, where="bad.json")
    # a figure in data that is not the checked one is refused too; a malformed 'changed' list as well
    spec = json.loads(_results_file(tmp_path, preds, "ok.json").read_text())
    assert check_predictions(spec, ROOT)[0]["rescored"] == spec["predictions"]["tiny"]["accuracy"]
    spec["data"]["systems"]["tiny"]["accuracy"] += 0.01
    with pytest.raises(RescoreError, match="data.systems.tiny.accuracy"):
        check_predictions(spec, ROOT)
    spec["data"]["systems"]["tiny"]["accuracy"] -= 0.01
    spec["changed"] = [{"figure": "tiny accuracy", "was": 0.5, "now": 0.6, "why": "re-scored from text"}]
    check_predictions(spec, ROOT)
    spec["changed"] = [{"figure": "tiny accuracy", "was": 0.5}]
    with pytest.raises(RescoreError, match="lacks now, why"):
        check_predictions(spec, ROOT)


def test_rescoring_reads_the_text_with_the_evaluation_parser():
    from elasticmem.eval.rescore import rescore_record

    rec = {"id": "q", "gold": "c", "correct": False}
    assert rescore_record({**rec, "prediction": "The answer is (C)."}, 4)
    assert rescore_record({**rec, "prediction": "(e) c"}, 4)  # (e) is not one of 4 options: the bare c counts
    assert not rescore_record({**rec, "prediction": "b"}, 4)
    with pytest.raises(ValueError, match="option letters"):
        rescore_record({**rec, "gold": "e", "prediction": "e"}, 4)
    assert rescore_record({"id": "f", "gold": "Paris", "prediction": " paris ", "correct": False}, scorer="exact_match")


# ---------------------------------------------------------------- pooled per question


def test_identical_seeds_pool_to_the_single_seed():
    rng = np.random.default_rng(3)
    one = (rng.random(336) < 0.6).astype(float)
    pooled = S.pooled_per_question(np.stack([one, one, one]))
    k = int(one.sum())
    assert pooled["accuracy"] == pytest.approx(k / 336) and pooled["n"] == 336 and pooled["seeds"] == 3
    assert pooled["ci95"] == pytest.approx(list(S.wilson_interval(k, 336)), abs=0.01)  # close to Wilson
    assert pooled["ci95"] == S.pooled_per_question(one)["ci95"]  # exactly the single seed's bootstrap
    assert pooled["pooling"] == "per question, mean over 3 seeds, bootstrap over 336 questions"
    # scipy's percentile bootstrap of the same per-question vector
    ref = scipy_stats.bootstrap((one,), np.mean, n_resamples=10_000, method="percentile",
                                random_state=np.random.default_rng(12345)).confidence_interval
    assert pooled["ci95"] == pytest.approx([ref.low, ref.high], abs=0.01)
    # paired, identical seeds: the single seed's difference; its exact McNemar p when few disagree
    other = one.copy()
    other[:9] = 1 - other[:9]
    paired = S.pooled_paired_per_question(np.stack([one] * 3), np.stack([other] * 3))
    single = S.paired_comparison(list(one), list(other))
    assert paired["difference"] == pytest.approx(single.difference) and paired["n"] == 336
    assert paired["p_value"] == pytest.approx(single.p_value)  # 9 discordant: all 2^9 sign patterns
    assert paired["pooling"] == "per question, mean over 3 seeds, paired bootstrap over 336 questions"


def test_a_small_case_worked_by_hand():
    # 2 seeds x 4 questions. Per question, mean over seeds: a = [1, .5, .5, 0], b = [1, 1, 0, .5]
    a = [[1, 0, 1, 0], [1, 1, 0, 0]]
    b = [[1, 1, 0, 1], [1, 1, 0, 0]]
    acc = S.pooled_per_question(a)
    assert acc["accuracy"] == 0.5 and acc["n"] == 4 and acc["seeds"] == 2
    d = [0.0, 0.5, -0.5, 0.5]  # per question mean over seeds of b - a
    paired = S.pooled_paired_per_question(a, b)
    assert paired["difference"] == pytest.approx(sum(d) / 4) == pytest.approx(0.125)
    assert paired["accuracy_a"] == 0.5 and paired["accuracy_b"] == 0.625
    # sign flips of the 3 non-zero differences: |sum| >= 0.5 in every one of the 8 patterns -> p = 1
    hits = sum(abs(sum(s * x for s, x in zip(signs, (0.5, -0.5, 0.5)))) >= 0.5 - 1e-12
               for signs in itertools.product((-1, 1), repeat=3))
    assert paired["p_value"] == hits / 8 == 1.0
    # ... and with d = [1, 1, 1, 0.5] only the all-plus and all-minus patterns reach |mean| 0.875
    p, how = S.sign_flip_p([1.0, 1.0, 1.0, 0.5])
    assert p == 2 / 16 and "exact" in how
    lo, hi = paired["difference_ci"]
    assert -0.5 <= lo <= 0.125 <= hi <= 0.5  # inside the range of the resampled means of d


def test_pooled_difference_matches_scipy_on_many_questions():
    rng = np.random.default_rng(7)
    a = (rng.random((3, 336)) < 0.5).astype(float)
    b = np.where(rng.random((3, 336)) < 0.15, 1 - a, a)  # b disagrees with a on ~15 % of answers
    paired = S.pooled_paired_per_question(a, b)
    d = (b - a).mean(axis=0)
    assert paired["difference"] == pytest.approx(d.mean()) and paired["n"] == 336 and paired["seeds"] == 3
    ref = scipy_stats.bootstrap((d,), np.mean, n_resamples=10_000, method="percentile",
                                random_state=np.random.default_rng(1)).confidence_interval
    assert paired["difference_ci"] == pytest.approx([ref.low, ref.high], abs=0.006)
    perm = scipy_stats.permutation_test((d,), np.mean, permutation_type="samples", n_resamples=10_000,
                                        random_state=np.random.default_rng(1)).pvalue
    assert paired["p_value"] == pytest.approx(perm, abs=0.02)
    assert S.pooled_paired_per_question(a, b) == paired  # seeded: the same figures every run


def test_seeds_on_other_questions_are_refused():
    with pytest.raises(S.PairingError, match="other questions"):
        S.outcome_matrix([{"q1": True, "q2": False}, {"q1": True, "q3": False}])
    ids, m = S.outcome_matrix([{"q2": False, "q1": True}, {"q1": False, "q2": True}])
    assert ids == ["q1", "q2"] and m.tolist() == [[1.0, 0.0], [0.0, 1.0]]


# ---------------------------------------------------------------- pool and persona_results on a fixture

Q = 40
ROWS = ("no_memory", "text_evidence", "latent_evidence", "latent_uniform", "latent_oracle", "latent_learned",
        "text_topz", "no_memory_trained", "text_trained", "learned_cap8", "uniform_cap8")


def _truth(seed: int, rung: int) -> np.ndarray:
    """Whether each of the Q questions is answered right: (Q,) booleans."""
    rng = np.random.default_rng(100 * seed + rung)
    return rng.random(Q) < 0.3 + 0.05 * rung


@pytest.fixture
def seed_ladders(tmp_path):
    """OUT/s0..s2/ladder: every rung's predictions (answer text, gold, a stored flag that is wrong
    for every fifth answer) and results.json; ladder.json for the seed discovery."""
    out = tmp_path / "OUT"
    for seed in range(3):
        lad = out / f"s{seed}" / "ladder"
        for j, name in enumerate(ROWS):
            right = _truth(seed, j)
            recs = []
            for q in range(Q):
                gold = "abcd"[q % 4]
                text = f"({gold})" if right[q] else f"({'abcd'[(q + 1) % 4]}) I think"
                recs.append({"id": f"q{q:02d}", "question_type": "t", "prediction": text, "gold": gold,
                             "correct": bool(right[q]) ^ (q % 5 == 0), "retrieved": [], "budgets": [],
                             "tokens": {"prompt": 5, "memory": 8 * j, "generated": 2, "total": 15 + 8 * j},
                             "latency": {}})
            (lad / name).mkdir(parents=True)
            (lad / name / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
            stored = [r["correct"] for r in recs]
            (lad / name / "results.json").write_text(json.dumps(
                {"accuracy": sum(stored) / Q, "num_examples": Q, "accuracy_ci95": [0.0, 1.0],
                 "avg_memory_tokens": 8.0 * j, "avg_tokens": 15.0 + 8 * j}))
        (lad / "ladder.json").write_text("{}")
    return out


def test_pool_pools_per_question_and_says_so(seed_ladders):
    from elasticmem.apps import ladder
    from elasticmem.eval.rescore import rescore_file

    dirs = [seed_ladders / f"s{s}" / "ladder" for s in range(3)]
    data = ladder.pool(dirs, [("latent_uniform", "latent_learned")], correct_of=lambda p: rescore_file(p, 4))
    learned = data["rungs"]["latent_learned"]["pooled"]
    j = ROWS.index("latent_learned")
    truth = np.stack([_truth(s, j) for s in range(3)]).astype(float)
    assert learned["n"] == Q and learned["seeds"] == 3 and learned["accuracy"] == pytest.approx(truth.mean())
    assert learned["pooling"] == f"per question, mean over 3 seeds, bootstrap over {Q} questions"
    cmp = data["comparisons"]["latent_learned - latent_uniform"]
    ref = np.stack([_truth(s, ROWS.index("latent_uniform")) for s in range(3)]).astype(float)
    assert cmp["pooled"]["difference"] == pytest.approx((truth - ref).mean()) and cmp["pooled"]["n"] == Q
    assert cmp["by_seed"]["seeds"] == 3 and cmp["by_seed"]["difference_ci"] is not None  # the t interval stays
    md = ladder.pool_markdown(data, dirs)
    assert "Pooled per question" in md and f"n = {Q} questions x 3 seeds" in md


def test_persona_results_pool_per_question_from_the_answers_text(seed_ladders, tmp_path):
    res = tmp_path / "results"
    pr = _script("persona_results")
    assert pr.main([str(seed_ladders), "--commit", "abc1234", "--results", str(res)]) == 0
    render = _script("gen_results_tables").render
    spec = json.loads((res / "persona_rungs.json").read_text())
    table = render(spec)
    assert "pooled per question over 3 seeds" in table.splitlines()[0]
    rows = {line.split(" | ")[0].strip("| *"): line.split(" | ") for line in table.splitlines()[2:]}
    j = ROWS.index("latent_learned")
    truth = np.stack([_truth(s, j) for s in range(3)]).astype(float)
    lo, hi = S.bootstrap_mean_interval(truth.mean(axis=0))
    cell = rows["top 8, latent, learned budgets (ElasticMem)"][4]
    assert cell == f"{truth.mean():.3f} [{lo:.3f}, {hi:.3f}], n = {Q} questions x 3 seeds"  # not n = 120
    assert "per question" in spec["pooling"] and "re-scored from the answer text" in spec["pooling"]
    assert spec["data"]["rungs"]["latent_learned"]["pooled"]["pooling"].startswith("per question, mean over 3")
    assert set(spec["inputs"]) >= {f"s{s}/ladder/latent_learned/predictions.jsonl" for s in range(3)}
    # the stored flags are wrong for every fifth answer: the per-seed cells follow the text
    assert rows["top 8, latent, learned budgets (ElasticMem)"][1].startswith(f"{truth[0].mean():.3f} [")
    cmp = render(json.loads((res / "persona_comparisons.json").read_text()))
    assert f"n = {Q} questions x 3 seeds" in cmp and "pooled per question" in cmp.splitlines()[0]
    # per-seed losses and the cost dial are recounted from the text too (ladder_data, re-scored)
    losses = json.loads((res / "persona_losses.json").read_text())["data"]["losses"]["s0"]
    w, wo = (ROWS.index("text_evidence"), ROWS.index("latent_evidence"))
    assert losses["reading"]["difference"] == pytest.approx(_truth(0, w).mean() - _truth(0, wo).mean())
    dial = json.loads((res / "persona_cost_dial.json").read_text())["data"]["dial"]["s1"]["cap8"]["paired"]
    assert dial["difference"] == pytest.approx(_truth(1, ROWS.index("learned_cap8")).mean()
                                               - _truth(1, ROWS.index("uniform_cap8")).mean())


def test_ladder_json_records_its_provenance(seed_ladders):
    from elasticmem.apps.ladder import ladder_data

    lad = seed_ladders / "s0" / "ladder"
    data = ladder_data(lad, ["no_memory", "latent_learned"])
    prov = data["provenance"]
    assert prov["code"]["commit"] == _git("rev-parse", "HEAD").strip() and prov["rescored"] is False
    got = prov["rungs"]["latent_learned"]
    assert got["predictions_sha256"] == _sha(lad / "latent_learned" / "predictions.jsonl")
    assert got["results_sha256"] == _sha(lad / "latent_learned" / "results.json")
    assert got["run"] is None  # a results.json written before provenance was recorded
