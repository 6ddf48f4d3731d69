"""scripts/compare_baselines.sh on the tiny preset: data and bank once, ElasticMem (warm-up then GRPO)
and MemGen (weaver SFT then GRPO) trained at two seeds as separate processes, every system evaluated on the same test
questions (with ElasticMem's ablations: each seed's checkpoint with nothing retrieved, and reading its retrieved chunks
as text), then comparison.md and seeds.md; a rerun starts nothing and reports the same.

    pytest tests/integration/test_compare_baselines.py -q       # ~1 min on 2 cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compare_baselines.sh"
SYSTEMS = ["elasticmem", "elasticmem_no_memory", "elasticmem_text", "memgen", "text_rag", "no_memory"]
TRAINED = ("elasticmem", "elasticmem_no_memory", "elasticmem_text", "memgen")
GRPO_STEPS = 4
"""GRPO steps of each trained arm: the test checks the plumbing (seeds, resumption, every system on the
same questions), which a few steps show as well as 30; learning is test_train.py's and test_mechanism.py's."""
OVERRIDES = ["data.synthetic.num_histories=40", "warmup.steps=2", "warmup.align_steps=0", f"train.max_steps={GRPO_STEPS}",
             "train.save_every=0", "memgen.prompt_latents=2", "memgen.inference_latents=2", "memgen.trigger_hidden=16"]

pytestmark = pytest.mark.slow


def run(out: Path, **env_) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "CONFIG": "configs/tiny.yaml", "SYSTEMS": " ".join(SYSTEMS),
           "SEEDS": "0 1", "JOBS": "2", "MEMGEN_STEPS": "3", "ELASTICMEM_VENV": sys.prefix, **env_}
    return subprocess.run(["bash", str(SCRIPT), *OVERRIDES], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=540)


def accuracy(run_dir: Path) -> tuple[float, int]:
    """Recomputed from the predictions, not read from results.json."""
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines() if line.strip()]
    return sum(r["correct"] for r in rows) / len(rows), len(rows)


def test_trains_every_seed_evaluates_every_system_and_resumes(tmp_path):
    out = tmp_path / "compare"
    p = run(out)
    assert p.returncode == 0, p.stderr[-3000:]
    test_ids = [json.loads(line)["id"] for line in (out / "data" / "test.jsonl").read_text().splitlines()]

    # each trained run is its own seed, from the one data folder and bank
    for s in (0, 1):
        em = yaml.safe_load((out / f"s{s}" / "elasticmem" / "config.yaml").read_text())
        assert em["seed"] == s and em["train"]["init_from"] == str(out / f"s{s}" / "warmup" / "final")
        assert em["data"]["dir"] == str(out / "data") and em["bank"]["dir"] == str(out / "bank")
        # MemGen: the same warm-up steps as its weaver's SFT, then the same GRPO steps from it
        sft = [json.loads(line) for line in (out / f"s{s}" / "memgen_sft" / "metrics.jsonl").read_text().splitlines()]
        assert [m["stage"] for m in sft] == ["answer", "answer"]
        mg_cfg = yaml.safe_load((out / f"s{s}" / "memgen" / "config.yaml").read_text())
        assert mg_cfg["seed"] == s and mg_cfg["train"]["init_from"] == str(out / f"s{s}" / "memgen_sft" / "final")
        assert mg_cfg["train"]["system"] == "memgen" and mg_cfg["train"]["lr"] == em["train"]["lr"]
        mg = json.loads((out / f"s{s}" / "memgen" / "final" / "elasticmem_config.json").read_text())
        assert mg["system"] == "memgen"
        steps = [json.loads(line) for line in (out / f"s{s}" / "memgen" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in steps if "loss" in m] == list(range(1, GRPO_STEPS + 1))

    # every system on the same test questions; the reports carry each run's own accuracy
    seeds = json.loads((out / "seeds.json").read_text())
    assert list(seeds["systems"]) == SYSTEMS and seeds["reference"] == "elasticmem"
    for name in SYSTEMS:
        runs = [f"{name}@{s}" for s in (0, 1)] if name in TRAINED else [name, name]
        expected = []
        for r in runs:
            d = out / "eval" / r / r
            ids = [json.loads(line)["id"] for line in (d / "predictions.jsonl").read_text().splitlines()]
            assert sorted(ids) == sorted(test_ids)
            expected.append(accuracy(d))
        got = seeds["systems"][name]
        assert got["seeds"] == 2 and got["n_per_seed"] == [n for _, n in expected]
        assert got["per_seed"] == pytest.approx([a for a, _ in expected])
    # the memory ablation: each seed's own ElasticMem checkpoint, answering with nothing retrieved
    for s in (0, 1):
        d = out / "eval" / f"elasticmem_no_memory@{s}" / f"elasticmem_no_memory@{s}"
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        assert cfg["eval"]["system"] == "no_memory"
        assert cfg["eval"]["checkpoint"] == str(out / f"s{s}" / "elasticmem" / "final")
        rows = [json.loads(line) for line in (d / "predictions.jsonl").read_text().splitlines()]
        assert all(r["retrieved"] == [] and r["tokens"]["memory"] == 0 for r in rows)
        em = out / "eval" / f"elasticmem@{s}" / f"elasticmem@{s}"
        with_memory = [json.loads(line) for line in (em / "predictions.jsonl").read_text().splitlines()]
        assert sum(r["tokens"]["memory"] for r in with_memory) > 0
        # the reading ablation: the same checkpoint retrieves the same rows, read as text
        d = out / "eval" / f"elasticmem_text@{s}" / f"elasticmem_text@{s}"
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        assert cfg["eval"]["system"] == "text_rag"
        assert cfg["eval"]["checkpoint"] == str(out / f"s{s}" / "elasticmem" / "final")
        as_text = {r["id"]: r for r in map(json.loads, (d / "predictions.jsonl").read_text().splitlines())}
        for r in with_memory:
            assert [m["ref"] for m in as_text[r["id"]]["retrieved"]] == [m["ref"] for m in r["retrieved"]]
            assert all(m["budget"] is None for m in as_text[r["id"]]["retrieved"])
    comparison = json.loads((out / "comparison.json").read_text())
    assert "elasticmem@0" in json.dumps(comparison) and (out / "comparison.md").is_file()

    # a rerun finds every output and starts nothing
    again = run(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "start:" not in again.stderr
    assert json.loads((out / "seeds.json").read_text()) == seeds


def test_memgen_from_scratch_with_grpo_alone(tmp_path):
    """MEMGEN_SFT=0: MemGen's GRPO alone from fresh weights, MEMGEN_STEPS steps, no warm-up."""
    out = tmp_path / "compare"
    p = run(out, SYSTEMS="memgen", SEEDS="0", MEMGEN_SFT="0")
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = yaml.safe_load((out / "s0" / "memgen" / "config.yaml").read_text())
    assert cfg["train"]["init_from"] is None and cfg["train"]["lr"] == 1e-3 and not (out / "s0" / "memgen_sft").exists()
    steps = [json.loads(line) for line in (out / "s0" / "memgen" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "loss" in m] == [1, 2, 3]
    assert accuracy(out / "eval" / "memgen@0" / "memgen@0")[1] > 0
