"""scripts/gpu_check.sh cannot rot: its dry run passes on the CPU and writes every figure.

    pytest tests/integration/test_gpu_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine run the real check")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_runs_every_stage_and_writes_the_figures(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=850,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["dry_run"] and rep["ok"] and rep["device"] == "cpu"
    assert set(rep["stages"]) == {"tests", "rollout", "grpo_step", "bank_build"}
    assert all(s["status"] == "ok" for s in rep["stages"].values())
    tests = rep["stages"]["tests"]["outcomes"]["tests"]
    ran = {n for n, t in tests.items() if t["outcome"] == "passed"}
    assert {"test_gpu::test_bf16_scores_the_same_trajectories_as_fp32",
            "test_gpu::test_bf16_training_replays_fp32_rollouts_within_tolerance",
            "test_gpu::test_bank_built_on_the_device_equals_the_cpu_bank"} <= ran, tests
    skipped = {n: t["detail"] for n, t in tests.items() if t["outcome"] == "skipped"}
    assert skipped and all("CUDA" in why for why in skipped.values()), skipped
    roll = rep["stages"]["rollout"]["figures"]
    assert roll["goal"] == 10.0 and roll["batched_traj_per_s"] > 0 and roll["one_at_a_time_traj_per_s"] > 0
    assert roll["ratio"] == pytest.approx(roll["batched_traj_per_s"] / roll["one_at_a_time_traj_per_s"])
    grpo = rep["stages"]["grpo_step"]["figures"]
    assert {"trl", "ours_text", "ours_default"} <= set(grpo["systems"])
    assert all(s["s_per_step"] > 0 for s in grpo["systems"].values())
    bank = rep["stages"]["bank_build"]["figures"]
    assert bank["builder_chunks_per_s"] > 0 and bank["bare_forward_chunks_per_s"] > 0
    for stage in ("rollout", "grpo_step", "bank_build"):  # the full JSON of each benchmark is kept
        assert json.loads(open(rep["stages"][stage]["json"]).read())


def test_a_gpu_run_without_cuda_stops_naming_what_is_missing(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["preflight"]["missing"][0] == "cuda" and rep["stopped"].startswith("missing cuda")
    assert "missing: cuda" in r.stdout and "pip install" in r.stdout
    assert rep["stages"] == {}, "nothing runs without what the stages need"
