"""evaluate.py: every system and ablation on the tiny model, resumable (never across systems,
checkpoints or data), 2 processes == 1, checkpoints.

    OMP_NUM_THREADS=1 python -m pytest -q tests/integration/test_evaluate.py
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from unittest.mock import ANY

import pytest
from conftest import ROOT, launch_2, run_cli_here
from test_train import _env, tiny_setup  # noqa: F401  (fixture)

VARIANTS = ("{elasticmem: [], no_memory: [eval.system=no_memory], text_rag: [eval.system=text_rag], "
            "full_context: [eval.system=full_context, memory.recent_max_tokens=60], "
            "identity_projector: [memory.projector.variant=identity], clip1: [memory.policy.clip_budget=1], "
            "uniform: [memory.policy.variant=uniform], semantic: [memory.retrieval=semantic], "
            "control: [memory.retrieval=control]}")


def _evaluate(root: Path, out: Path, *overrides: str, launcher=(sys.executable,), env=None, code=0):
    args = [*launcher, "evaluate.py", "--config", "configs/tiny.yaml", f"data.dir={root}/data",
            f"bank.dir={root}/bank", f"eval.output_dir={out}", *overrides]
    p = subprocess.run(args, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == code, f"exit {p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"
    return p


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def variants_run(tiny_setup, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("variants")
    p = _evaluate(tiny_setup, out, "eval.limit=24", "eval.batch_size=5", f"eval.variants={VARIANTS}")
    (out / "stdout.txt").write_text(p.stdout)
    return tiny_setup, out


def _wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The 95 % Wilson score interval of k / n, from its textbook formula."""
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z / d * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def _mcnemar(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value of b and c discordant pairs (a binomial test at 1/2)."""
    return min(1.0, 2 * sum(math.comb(b + c, i) for i in range(min(b, c) + 1)) / 2 ** (b + c))


def test_every_system_and_ablation_runs_and_is_compared(variants_run):
    _, out = variants_run
    names = ["elasticmem", "no_memory", "text_rag", "full_context", "identity_projector", "clip1", "uniform",
             "semantic", "control"]
    comparison = (out / "comparison.md").read_text()
    for name in names:
        res = json.loads((out / name / "results.json").read_text())
        predictions = _records(out / name / "predictions.jsonl")
        right = sum(bool(r["correct"]) for r in predictions)
        assert res["num_examples"] == len(predictions) == 24 and res["accuracy"] == pytest.approx(right / 24), name
        for key in ("avg_tokens", "avg_memory_tokens", "latency_s_per_example", "per_type"):
            assert key in res, (name, key)
        assert name in comparison
        assert res["accuracy_ci95"] == pytest.approx(_wilson(right, 24), abs=1e-9), name
        assert set(res["per_type_ci95"]) == set(res["per_type"]) == set(res["per_type_counts"]), name
    # every system against the first, paired on the same 24 questions; recounted from the predictions
    summary = json.loads((out / "comparison.json").read_text())
    assert summary["reference"] == "elasticmem" and list(summary["systems"]) == names
    assert summary["too_few_for_headline"] == names  # 24 < 200
    ref = {r["id"]: r["correct"] for r in _records(out / "elasticmem" / "predictions.jsonl")}
    stdout = (out / "stdout.txt").read_text()
    assert "**n < 200: too few questions for a headline**" in comparison and "## Paired against elasticmem" in comparison
    for name in names[1:]:
        pair = summary["paired"][name]
        other = {r["id"]: r["correct"] for r in _records(out / name / "predictions.jsonl")}
        assert pair["n"] == 24 and pair["reference"] == "elasticmem", name
        assert pair["only_a_correct"] == sum(ref[i] and not other[i] for i in ref), name
        assert pair["only_b_correct"] == sum(other[i] and not ref[i] for i in ref), name
        assert pair["difference"] == pytest.approx((sum(other.values()) - sum(ref.values())) / 24), name
        assert pair["difference_ci"][0] <= pair["difference"] <= pair["difference_ci"][1], name
        assert pair["p_value"] == pytest.approx(_mcnemar(pair["only_a_correct"], pair["only_b_correct"])), name
        assert f"| {name} | 24 | " in comparison and f"evaluate.py: {name} - elasticmem: " in stdout, name
    assert "evaluate.py: no_memory: accuracy " in stdout and "(n = 24)" in stdout
    png = (out / "accuracy_vs_tokens.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    for plot in ("budget_by_rank", "budget_vs_score", "budget_histogram"):
        data = (out / "elasticmem" / f"{plot}.png").read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000, plot
    assert "## " in (out / "elasticmem" / "case_study.md").read_text()


def test_memory_tokens_match_what_each_system_injects(variants_run):
    """Recomputed from the bank's chunk texts and the tokenizer, independently of the model."""
    from elasticmem.backbone import build_tiny_tokenizer
    from elasticmem.bank import Bank
    from elasticmem.config import load_config

    root, out = variants_run
    bank = Bank.open(root / "bank")
    chunks = bank.chunks()
    cfg = load_config(ROOT / "configs/tiny.yaml")
    tok = build_tiny_tokenizer(cfg.backbone.tiny.char_fallback)

    def n_tok(row: int) -> int:
        return len(tok(chunks[row]["text"], add_special_tokens=False)["input_ids"])

    assert all(r["tokens"]["memory"] == 0 and not r["retrieved"] for r in _records(out / "no_memory/predictions.jsonl"))
    for rec in _records(out / "text_rag" / "predictions.jsonl"):
        rows = [int(m["ref"].split(":")[1]) for m in rec["retrieved"]]
        assert len(rows) == cfg.memory.top_z
        assert rec["tokens"]["memory"] == sum(n_tok(r) for r in rows)
        assert all(m["budget"] is None for m in rec["retrieved"])
    for rec in _records(out / "full_context" / "predictions.jsonl"):
        rows = [int(m["ref"].split(":")[1]) for m in rec["retrieved"]]
        group = chunks[rows[0]]["group"]
        start, end = bank.group_rows(group)
        want, used = [], 0  # the latest chunks whose tokens fit in 60, oldest first
        for r in range(end - 1, start - 1, -1):
            used += chunks[r]["n_tokens"]
            if used > 60:
                break
            want.insert(0, r)
        assert rows == want
    for rec in _records(out / "elasticmem" / "predictions.jsonl"):
        rows = [int(m["ref"].split(":")[1]) for m in rec["retrieved"]]
        _, cache_len = bank.gather(rows)
        injected = [min(m["budget"], int(n)) for m, n in zip(rec["retrieved"], cache_len)]
        assert [m["tokens"] for m in rec["retrieved"]] == injected
        assert rec["tokens"]["memory"] == sum(injected)
        assert rec["tokens"]["total"] == rec["tokens"]["prompt"] + rec["tokens"]["memory"] + rec["tokens"]["generated"]
    assert all(max(r["budgets"], default=0) <= 1 for r in _records(out / "clip1" / "predictions.jsonl"))


def test_evidence_recall_is_recounted_from_the_data_and_the_bank(variants_run):
    """Each record's evidence rows are the bank chunks holding the question's evidence turns
    (looked up here from chunks.jsonl's session/turns and the split file), and results.json's
    recall, chance and accuracy given a hit are recounted from the predictions."""
    from elasticmem.bank import Bank

    root, out = variants_run
    bank = Bank.open(root / "bank")
    holder = {(c["group"], c["session"], t): c["row"] for c in bank.chunks() for t in c["turns"]}
    group_rows = {}
    for c in bank.chunks():
        group_rows[c["group"]] = group_rows.get(c["group"], 0) + 1
    questions = {q["id"]: q for q in _records(root / "data" / "test.jsonl")}
    for name in ("elasticmem", "text_rag", "full_context"):
        recs = _records(out / name / "predictions.jsonl")
        hits, chance, right_if_hit = [], [], []
        for r in recs:
            q = questions[r["id"]]
            want = sorted({holder[(q["group"], s, t)] for s, t in q["evidence"] if (q["group"], s, t) in holder})
            assert want, r["id"]  # every synthetic question states its fact in the history
            assert r["extra"]["evidence"] == {"rows": want, "group_rows": group_rows[q["group"]]}, (name, r["id"])
            got = {int(m["ref"].split(":")[1]) for m in r["retrieved"]}
            hits.append(bool(got & set(want)))
            m, k, e = group_rows[q["group"]], len(got), len(want)
            chance.append(1 - math.comb(m - e, k) / math.comb(m, k))
            if hits[-1]:
                right_if_hit.append(r["correct"])
        res = json.loads((out / name / "results.json").read_text())["evidence_retrieval"]
        assert res["n"] == len(recs) == 24 and res["hits"] == sum(hits), name
        assert res["recall_any"] == pytest.approx(sum(hits) / 24) and res["n_hit"] == sum(hits)
        assert res["random_recall_any"] == pytest.approx(sum(chance) / 24)
        if right_if_hit:
            assert res["accuracy_given_hit"] == pytest.approx(sum(right_if_hit) / len(right_if_hit))
        assert "## Evidence retrieval" in (out / name / "report.md").read_text()
    assert "evidence_retrieval" not in json.loads((out / "no_memory" / "results.json").read_text())
    assert "| elasticmem | 24 | " in (out / "comparison.md").read_text().split("## Evidence retrieval")[1]


def test_interrupted_evaluation_resumes_and_writes_each_example_once(tiny_setup, tmp_path):  # noqa: F811
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.eval.runner import PART, evaluate
    from elasticmem.systems import build_system

    cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.dir={tiny_setup}/data", f"bank.dir={tiny_setup}/bank"])
    examples = load_split(cfg.data.dir, "test")[:20]
    system = build_system(cfg)
    calls: list[list[str]] = []

    class Crash(Exception):
        pass

    class Crashing:
        name = "crashing"
        crash_at = 3

        def predict(self, batch):
            calls.append([ex.id for ex in batch])
            if len(calls) == self.crash_at:
                raise Crash
            return system.predict(batch)

        def identity(self):
            return system.identity()

    with pytest.raises(Crash):
        evaluate(Crashing(), examples, tmp_path, batch_size=4, progress=False)
    part = tmp_path / PART.format(rank=0)
    assert len(_records(part)) == 8
    with part.open("a") as f:
        f.write('{"id": "half-writ')  # a crash in the middle of a line
    calls.clear()
    Crashing.crash_at = -1
    res = evaluate(Crashing(), examples, tmp_path, batch_size=4, progress=False)
    assert sum(len(c) for c in calls) == 12, "only the 12 unanswered examples are answered again"
    ids = [r["id"] for r in _records(tmp_path / "predictions.jsonl")]
    assert ids == [ex.id for ex in examples]
    assert sorted(r["id"] for r in _records(part)) == sorted(ids)  # each example written once
    assert res["num_examples"] == 20
    straight = evaluate(system, examples, tmp_path / "straight", batch_size=4, progress=False)
    assert res["accuracy"] == straight["accuracy"]
    assert [r["prediction"] for r in _records(tmp_path / "predictions.jsonl")] == \
        [r["prediction"] for r in _records(tmp_path / "straight" / "predictions.jsonl")]


def _evaluate_here(root: Path, out: Path, capsys, *overrides: str, code=0) -> str:
    """evaluate.py's main() in this process (no start-up cost); its stderr."""
    got, _, err = run_cli_here("evaluate.py", ["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={root}/data",
                                               f"bank.dir={root}/bank", f"eval.output_dir={out}", *overrides], capsys)
    assert got == code, f"exit {got}\n{err[-4000:]}"
    return err


def test_another_system_in_the_same_folder_is_refused_until_overwrite(tiny_setup, tmp_path, capsys):  # noqa: F811
    """no_memory then text_rag into one folder: refused, naming both, with the folder left as it was;
    eval.overwrite=true gives real text-RAG results."""
    out = tmp_path / "ev"
    _evaluate_here(tiny_setup, out, capsys, "system=no_memory", "eval.limit=4")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    err = _evaluate_here(tiny_setup, out, capsys, "system=text_rag", "eval.limit=6", code=2)
    assert "'no_memory'" in err and "'text_rag'" in err and "eval.overwrite=true" in err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    _evaluate_here(tiny_setup, out, capsys, "system=text_rag", "eval.limit=6", "eval.overwrite=true")
    res = json.loads((out / "results.json").read_text())
    assert res["system"] == "text_rag" and res["num_examples"] == 6 and res["avg_memory_tokens"] > 0
    assert all(r["retrieved"] and r["tokens"]["memory"] > 0 for r in _records(out / "predictions.jsonl"))


def test_a_bank_of_other_data_is_refused_before_answering(tiny_setup, tmp_path, capsys):  # noqa: F811
    """A history edited after the bank was built: evaluate.py exits 2 naming the group, answers nothing."""
    data, out = tmp_path / "data", tmp_path / "ev"
    shutil.copytree(tiny_setup / "data", data)
    lines = (data / "test.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["history"][0][0]["content"] += " and more"
    (data / "test.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    err = _evaluate_here(tmp_path, out, capsys, f"bank.dir={tiny_setup}/bank", "eval.limit=4", code=2)
    assert first["group"] in err and "test.jsonl" in err
    assert not list(out.glob("predictions*"))


def _quick(system, examples, out):
    from elasticmem.eval.runner import evaluate

    return evaluate(system, examples, out, batch_size=4, progress=False, case_studies=0, plots=False)


def test_a_checkpoint_retrained_at_the_same_path_is_refused(tiny_setup, tmp_path):  # noqa: F811
    from safetensors.torch import load_file, save_file

    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.eval.runner import OutputDirError
    from elasticmem.systems import build_system

    ckpt, out = tmp_path / "final", tmp_path / "ev"
    overrides = [f"data.dir={tiny_setup}/data", f"bank.dir={tiny_setup}/bank"]
    build_system(load_config(ROOT / "configs/tiny.yaml", overrides)).model.save_pretrained(ckpt)
    cfg = load_config(ROOT / "configs/tiny.yaml", [*overrides, f"eval.checkpoint={ckpt}"])
    examples = load_split(cfg.data.dir, "test")[:4]
    first = _quick(build_system(cfg), examples, out)
    assert _quick(build_system(cfg), examples, out) == {**first, "written_at": ANY}  # loaded again: resumed
    weights = load_file(ckpt / "projector.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, ckpt / "projector.safetensors")
    with pytest.raises(OutputDirError, match="checkpoint"):
        _quick(build_system(cfg), examples, out)


def test_a_changed_data_file_is_refused(tiny_setup, tmp_path):  # noqa: F811
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.eval.runner import OutputDirError
    from elasticmem.systems import build_system

    data, out = tmp_path / "data", tmp_path / "ev"
    shutil.copytree(tiny_setup / "data", data)
    system = build_system(load_config(ROOT / "configs/tiny.yaml", [f"data.dir={data}", f"bank.dir={tiny_setup}/bank",
                                                                   "eval.system=no_memory"]))
    _quick(system, load_split(data, "test")[:4], out)
    lines = (data / "test.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["question"] += " Think twice."
    (data / "test.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    with pytest.raises(OutputDirError, match=f"data differ.*{first['id']}"):
        _quick(system, load_split(data, "test")[:6], out)


def test_two_processes_give_the_predictions_of_one(variants_run, tmp_path):
    root, out = variants_run
    launcher = launch_2()
    _evaluate(root, tmp_path / "two", "eval.limit=24", "eval.batch_size=5", launcher=launcher,
              env=_env(ACCELERATE_USE_CPU="1"))
    parts = sorted((tmp_path / "two").glob("predictions.part-*.jsonl"))
    assert [p.name for p in parts] == ["predictions.part-0.jsonl", "predictions.part-1.jsonl"]
    assert all(_records(p) for p in parts), "both processes answered"
    one = _records(out / "elasticmem" / "predictions.jsonl")
    two = _records(tmp_path / "two" / "predictions.jsonl")
    assert len(one) == len(two) == 24

    def exact(r):  # batches are composed differently: scores may differ in the last float bits
        return {**{k: v for k, v in r.items() if k not in ("latency", "retrieved")},
                "retrieved": [{k: v for k, v in m.items() if k != "score"} for m in r["retrieved"]]}

    assert [exact(r) for r in one] == [exact(r) for r in two]
    for a, b in zip(one, two):
        assert [m["score"] for m in a["retrieved"]] == pytest.approx([m["score"] for m in b["retrieved"]], abs=1e-5)


def test_checkpoint_evaluation_equals_the_trainers_greedy_eval(tiny_setup, tmp_path, capsys):  # noqa: F811
    """evaluate.py checkpoint=final on val == the accuracy and #Tok the trainer measured itself."""
    from test_train import _train_cli

    run = tmp_path / "run"
    _train_cli(tiny_setup, run, "train.max_steps=20", "train.eval_split=val", "train.save_every=100")
    trainer_eval = json.loads((run / "eval_val.json").read_text())
    _evaluate_here(tiny_setup, tmp_path / "ev", capsys, f"checkpoint={run}/final", "split=val", "eval.batch_size=7")
    res = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert res["num_examples"] == trainer_eval["num_examples"]
    assert res["accuracy"] == pytest.approx(trainer_eval["accuracy"])
    assert res["accuracy_ci95"] == pytest.approx(trainer_eval["accuracy_ci95"])
    assert res["per_type_ci95"] == {t: pytest.approx(ci) for t, ci in trainer_eval["per_type_ci95"].items()}
    assert res["avg_tokens"] == pytest.approx(trainer_eval["avg_tokens"])
    assert res["avg_memory_tokens"] == pytest.approx(trainer_eval["avg_memory_tokens"])
    assert res["checkpoint"] == f"{run}/final"


def test_text_memory_trained_by_grpo_is_evaluated_as_text(tiny_setup, tmp_path, capsys):  # noqa: F811
    """memory.injection=text trains through the same trainer (no budget actions in the loss) and
    its checkpoint evaluates with the same injection: the paper's text-memory + GRPO control."""
    from test_train import _metrics, _train_cli

    run = tmp_path / "run"
    _train_cli(tiny_setup, run, "memory.injection=text", "train.max_steps=3", "train.eval_split=")
    rows = _metrics(run)
    assert all(r["units/budget"] == 0 and r["units/lm"] > 0 for r in rows)
    _evaluate_here(tiny_setup, tmp_path / "ev", capsys, f"checkpoint={run}/final", "eval.limit=10")
    recs = _records(tmp_path / "ev" / "predictions.jsonl")
    assert all(m["budget"] is None and m["tokens"] > 0 for r in recs for m in r["retrieved"])
    assert json.loads((tmp_path / "ev" / "results.json").read_text())["avg_memory_tokens"] > 0


def test_amem_runs_in_the_same_harness(tiny_setup, tmp_path, capsys):  # noqa: F811
    """eval.system=amem (notes written by the tiny model, MiniLM embeddings) answers through
    evaluate.py like the other systems; its notes appear as retrieved memories."""
    _evaluate_here(tiny_setup, tmp_path, capsys, "system=amem", "amem.llm.model=tiny", "eval.limit=4",
                   "amem.max_new_tokens=96")
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["system"] == "amem" and res["num_examples"] == 4
    recs = _records(tmp_path / "predictions.jsonl")
    assert all(r["retrieved"] and r["tokens"]["memory"] > 0 for r in recs)
    assert all(m["budget"] is None for r in recs for m in r["retrieved"])
