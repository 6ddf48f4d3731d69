"""scripts/gpu_check.sh cannot rot: its dry run passes on the CPU and writes every stage's figures.

    pytest tests/integration/test_gpu_check.py

The dry run (``--dry-run``) runs every stage of the GPU check on the CPU at tiny sizes; the
test reads its JSON: every stage present with a status, and each stage's figures. A stage that
times out is recorded with what it printed (``run_stage``), and a killed pytest still leaves its
per-test outcomes (the verbose log): checked here on small commands, in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine run the real check")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_runs_every_stage_and_writes_the_figures(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=850, check=False,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["dry_run"] and rep["ok"] and rep["device"] == "cpu" and rep["failed"] == []
    assert rep["preflight"]["status"] == "ok" and "faiss-gpu" in rep["preflight"]["found"]
    assert set(rep["stages"]) == set(gpu_check.STAGES)
    assert all(s["status"] == "ok" and s["seconds"] > 0 for s in rep["stages"].values()), \
        {k: (s["status"], s.get("log_tail", "")[-500:]) for k, s in rep["stages"].items()}
    tests = rep["stages"]["tests"]["outcomes"]["tests"]
    ran = {n for n, t in tests.items() if t["outcome"] == "passed"}
    assert {"test_gpu::test_bf16_scores_the_same_trajectories_as_fp32",
            "test_gpu::test_bf16_policy_gradient_agrees_with_fp32",
            "test_gpu::test_bf16_training_replays_fp32_rollouts_within_tolerance",
            "test_gpu::test_bank_built_on_the_device_equals_the_cpu_bank",
            "test_gpu::test_training_warmup_and_evaluation_search_on_the_models_device"} <= ran, tests
    skipped = {n: t["detail"] for n, t in tests.items() if t["outcome"] == "skipped"}
    assert skipped and all("CUDA" in why for why in skipped.values()), skipped
    figs = {k: s["figures"] for k, s in rep["stages"].items() if k != "tests"}

    ds = figs["deepspeed"]
    assert ds["zero_stage"] == 2 and ds["gradient_checkpointing"] and ds["steps"] == len(ds["loss"]) == 2
    assert all(g > 0 for g in ds["grad_norm"]) and ds["s_per_step"] > 0
    act = figs["activation_memory"]
    assert act["vocab"] == 4096 and act["micro_batch"] == 2 and act["seq"] == 128
    for k in ("checkpointing_off", "checkpointing_on"):
        assert act[k]["peak_mb"] > act[k]["growth_mb"] > 0, act
    assert act["growth_ratio"] == pytest.approx(act["checkpointing_on"]["growth_mb"]
                                                / act["checkpointing_off"]["growth_mb"])
    search = figs["search"]
    assert set(search["cases"]) == {"groups", "big_group"}
    assert all(c["rows_equal"] and c["max_score_diff"] <= 1e-4 and c["cpu_s"] > 0 and c["device_s"] > 0
               for c in search["cases"].values()), search
    warm = figs["warmup"]
    assert warm["device"] == "cpu" and len(warm["loss"]) >= warm["steps"] == 2 and warm["s_per_step"] > 0
    amem = figs["amem_local"]
    assert amem["device"] == "cpu" and amem["valid_json"] == amem["json_calls"] == 4 and amem["text_calls"] == 2

    roll = figs["rollout"]
    assert roll["goal"] == 10.0 and roll["batched_traj_per_s"] > 0 and roll["one_at_a_time_traj_per_s"] > 0
    assert roll["ratio"] == pytest.approx(roll["batched_traj_per_s"] / roll["one_at_a_time_traj_per_s"])
    grpo = figs["grpo_step"]
    assert {"trl", "ours_text", "ours_default"} <= set(grpo["systems"])
    assert all(s["s_per_step"] > 0 for s in grpo["systems"].values())
    bank = figs["bank_build"]
    assert bank["builder_chunks_per_s"] > 0 and bank["bare_forward_chunks_per_s"] > 0
    for stage in ("activation_memory", "rollout", "grpo_step", "bank_build"):  # each benchmark's full JSON is kept
        assert json.loads(Path(rep["stages"][stage]["json"]).read_text())


def test_a_gpu_run_without_cuda_stops_naming_what_is_missing(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["preflight"]["missing"][0] == "cuda" and rep["stopped"].startswith("missing cuda")
    assert "missing: cuda" in r.stdout
    assert rep["stages"] == {}, "nothing runs without CUDA"


def test_a_stage_past_its_limit_is_interrupted_and_recorded_with_its_output(tmp_path):
    """SIGINT first (pytest writes its results, a KeyboardInterrupt handler runs), the output kept."""
    code = ("import time\nprint('started', flush=True)\ntry:\n    time.sleep(60)\n"
            "except KeyboardInterrupt:\n    print('interrupted, cleaning up', flush=True)\n    raise")
    res = gpu_check.run_stage("sleeper", [sys.executable, "-c", code], 3, dict(os.environ), tmp_path)
    assert res["status"] == "timeout" and res["seconds"] < 30
    assert "started" in res["log_tail"] and "interrupted, cleaning up" in res["log_tail"]
    ok = gpu_check.run_stage("quick", [sys.executable, "-c", "print('done')"], 30, dict(os.environ), tmp_path)
    assert ok["status"] == "ok" and ok["returncode"] == 0 and "done" in ok["log_tail"]


def test_pytest_killed_before_its_junit_xml_still_leaves_per_test_outcomes(tmp_path):
    (tmp_path / "test_x.py").write_text("import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    assert 0\n\n"
                                        "@pytest.mark.skip(reason='no CUDA')\ndef test_c():\n    pass\n")
    log = tmp_path / "tests.log"
    log.write_text(subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "test_x.py"],
                                  cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False).stdout)
    got = gpu_check.junit_outcomes(tmp_path / "absent.xml", log)
    assert got["from_log"] and (got["passed"], got["failed"], got["skipped"]) == (1, 1, 1)
    assert got["tests"] == {"test_x::test_a": {"outcome": "passed"}, "test_x::test_b": {"outcome": "failed"},
                            "test_x::test_c": {"outcome": "skipped"}}
