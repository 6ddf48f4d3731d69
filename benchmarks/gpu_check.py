"""The GPU check: the ``gpu`` tests and the GPU benchmarks in one run, one JSON of figures.

    bash scripts/gpu_check.sh                           # a CUDA machine, no network: < 10 min on one GPU
    bash scripts/gpu_check.sh --dry-run                 # anywhere: the same stages on the CPU at tiny sizes
    python benchmarks/gpu_check.py --out runs/gpu_check/gpu_check.json [--dry-run] [--device cuda:1]

Stages, each in its own process with a time limit (``LIMITS``: 10 minutes in all on a GPU; a
stage that fails or runs out of time is recorded as such and the next one runs; the exit status
is 1 when any stage failed):

0. **preflight**: CUDA visible, and the packages the stages need importable: bitsandbytes (4-bit),
   trl (the GRPO comparison), faiss with GPU support (faiss-gpu), pytest. On a GPU run a missing
   one stops the check at once with the package's name and how to install it (exit 2); the dry
   run lists what a GPU run would miss and goes on.
1. **tests**: ``pytest -m gpu tests/gpu`` (bf16 against fp32 rollouts, scores and training steps;
   4-bit base weights; faiss-gpu against CPU flat search; a bank built on the GPU against a CPU
   one). The dry run runs them on the CPU (``ELASTICMEM_GPU_TEST_DEVICE=cpu``; the CUDA-only ones
   skip).
2. **rollout**: ``benchmarks/rollout.py`` at ``qwen2.5-3b-random`` (random weights in Qwen2.5-3B's
   decoder shape, the tiny tokenizer): batched trajectories/s against the one-at-a-time loop
   (goal >= 10x on a GPU), rollout time / compute floor, peak GPU memory.
3. **grpo_step**: ``benchmarks/grpo_step.py`` at the same shape: our GRPO step against TRL's
   GRPOTrainer on the same work (both bf16 on the GPU), peak GPU memory per system.
4. **bank_build**: ``benchmarks/bank_build.py --skip-search`` at the same shape: builder chunks/s
   against a bare batched forward over the same batches, bank bytes, peak GPU memory.

The dry run uses the tiny model on the CPU with one or two repeats: it checks that every stage
runs and that the JSON has every figure, not the figures themselves. The JSON (``--out``) holds
the environment, the preflight, each stage's status, seconds and log tail, the test outcomes, the
headline figures of each benchmark and the path of its full JSON (kept next to ``--out``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ROLLOUT_GOAL = 10.0
# Seconds per stage. On a GPU they sum to 10 minutes, the check's budget (a stage that needs more
# is recorded as timed out, and --limit-scale gives a slow machine more); the dry run on 2 CPU
# cores takes 10-45 s per stage.
LIMITS = {"tests": 180, "rollout": 120, "grpo_step": 180, "bank_build": 120}

INSTALL = {
    "bitsandbytes": "pip install 'elasticmem[gpu]'",
    "trl": "pip install 'elasticmem[dev]'",
    "pytest": "pip install 'elasticmem[dev]'",
    "faiss-gpu": "pip uninstall -y faiss-cpu && pip install 'elasticmem[gpu]'",
}


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def preflight(device: str) -> dict[str, Any]:
    """What the stages need: {name: ok (bool)} plus details, and the list of what is missing."""
    import torch

    found: dict[str, Any] = {"cuda": torch.cuda.is_available()}
    if found["cuda"]:
        found["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        found["cuda_version"] = torch.version.cuda
    for mod in ("bitsandbytes", "trl", "pytest"):
        try:
            found[mod] = getattr(importlib.import_module(mod), "__version__", "installed")
        except Exception as e:  # a broken install (e.g. bitsandbytes without its CUDA library) counts as missing
            found[mod] = None
            found[f"{mod}_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        import faiss

        found["faiss"] = faiss.__version__
        found["faiss-gpu"] = faiss.get_num_gpus() if hasattr(faiss, "StandardGpuResources") else 0
    except ImportError:
        found["faiss"], found["faiss-gpu"] = None, 0
    missing = [m for m in ("bitsandbytes", "trl", "pytest") if not found[m]]
    if not found["faiss-gpu"]:
        missing.append("faiss-gpu")
    if device.startswith("cuda") and not found["cuda"]:
        missing.insert(0, "cuda")
    return {"found": found, "missing": missing}


def run_stage(name: str, cmd: list[str], timeout: float, env: dict[str, str], logs: Path) -> dict[str, Any]:
    """One stage in a subprocess: status (ok / failed / timeout), seconds, exit code, log tail."""
    log(f"{name}: {' '.join(cmd)}  (limit {timeout:.0f} s)")
    path = logs / f"{name}.log"
    t0 = time.perf_counter()
    with open(path, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc, status = None, "timeout"
    seconds = time.perf_counter() - t0
    tail = path.read_text(errors="replace")[-4000:]
    log(f"{name}: {status} in {seconds:.0f} s (log {path})")
    if status != "ok":
        print(tail[-1500:], flush=True)
    return {"status": status, "returncode": rc, "seconds": seconds, "log": str(path), "log_tail": tail}


def junit_outcomes(junit: Path) -> dict[str, Any]:
    """Counts and per-test outcomes from pytest's JUnit XML (skip reasons included)."""
    if not junit.is_file():
        return {"error": f"no {junit}"}
    out: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "tests": {}}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, detail = "passed", None
        for tag, what in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                outcome, detail = what, (el.get("message") or "")[:500]
                break
        out[outcome] += 1
        out["tests"][name] = {"outcome": outcome, "seconds": float(case.get("time", 0)), **({"detail": detail}
                                                                                          if detail else {})}
    return out


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rollout_figures(report: dict[str, Any] | None, goal: float) -> dict[str, Any] | None:
    if not report or not report.get("results"):
        return None
    r = report["results"][0]
    return {"model": r["model"], "device": r["device"], "dtype": r["dtype"], "B": r["B"], "G": r["G"],
            "batched_traj_per_s": r["batched"]["traj_per_s"], "one_at_a_time_traj_per_s": r["baseline"]["traj_per_s"],
            "ratio": r["ratio"], "goal": goal, "meets_goal": r["ratio"] >= goal, "floor_ratio": r["floor_ratio"],
            "peak_gpu_mb": r.get("peak_gpu_mb"), "peak_rss_mb": r.get("peak_rss_mb"),
            "model_build_s": r.get("load_seconds")}


def grpo_figures(report: dict[str, Any] | None) -> dict[str, Any] | None:
    if not report or not report.get("results"):
        return None
    r = report["results"][0]
    systems = {k: {"s_per_step": v["s_per_step"], "peak_gpu_mb": v.get("peak_gpu_mb")}
               for k, v in r["systems"].items()}
    return {"model": r["model"], "device": r.get("device_name") or r.get("device"), "dtype": r.get("dtype"),
            "systems": systems, "ours_text_over_trl": r["ratio"], "ours_default_over_trl": r.get("ratio_default")}


def bank_figures(report: dict[str, Any] | None) -> dict[str, Any] | None:
    builds = [b for b in (report or {}).get("builder", []) if b and not b.get("skipped")]
    if not builds:
        return None
    b = builds[0]
    return {"model": b["model"], "device": b["device"], "chunks": b["num_chunks"],
            "builder_chunks_per_s": b["builder_chunks_per_s"], "bare_forward_chunks_per_s": b["ceiling_chunks_per_s"],
            "builder_over_bare_forward": b["ratio_builder_over_ceiling"], "peak_gpu_mb": b.get("peak_gpu_mb"),
            "bytes_ratio": {k: v["ratio"] for k, v in b["bytes"].items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "runs" / "gpu_check" / "gpu_check.json"), help="the JSON of figures")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, tiny model, fewest repeats")
    p.add_argument("--device", default="cuda", help="the GPU to check (cuda, cuda:1, ...)")
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiply every stage's time limit")
    p.add_argument("--shape", default="qwen2.5-3b", help="RANDOM_SHAPES key of the benchmark model")
    p.add_argument("--stages", nargs="+", default=["tests", "rollout", "grpo_step", "bank_build"],
                   choices=["tests", "rollout", "grpo_step", "bank_build"])
    args = p.parse_args(argv)

    import torch

    out = Path(args.out)
    work = out.with_suffix("")  # the stages' JSON and logs: <out without .json>/
    work.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.dry_run else args.device
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if args.dry_run:
        env["ACCELERATE_USE_CPU"] = "1"
    report: dict[str, Any] = {
        "dry_run": args.dry_run, "device": device, "shape": None if args.dry_run else args.shape,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "python": platform.python_version(),
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "stages": {},
    }

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))

    pre = preflight(device)
    report["preflight"] = pre
    if pre["missing"]:
        how = "; ".join(f"{m}: {INSTALL.get(m, 'a CUDA build of torch and a visible GPU')}" for m in pre["missing"])
        if not args.dry_run:
            log(f"missing: {', '.join(pre['missing'])}. Install: {how}")
            report["stopped"] = f"missing {', '.join(pre['missing'])}"
            save()
            return 2
        log(f"dry run: a GPU run would stop here for want of {', '.join(pre['missing'])}")
    save()

    py = sys.executable

    def limit(stage: str) -> float:
        return LIMITS[stage] * args.limit_scale * (2 if args.dry_run else 1)  # 2 CPU cores may be shared
    model = "tiny" if args.dry_run else f"{args.shape}-random"
    t_start = time.perf_counter()
    failed = False
    for stage in args.stages:
        if stage == "tests":
            junit = work / "tests.xml"
            tenv = {**env, "ELASTICMEM_GPU_TEST_DEVICE": device}
            res = run_stage(stage, [py, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider",
                                    f"--junitxml={junit}", "-ra"], limit(stage), tenv, work)
            res["outcomes"] = junit_outcomes(junit)
        elif stage == "rollout":
            js = work / "rollout.json"
            cmd = [py, "benchmarks/rollout.py", "--models", model, "--device", device, "--out", str(js),
                   "--goal", str(ROLLOUT_GOAL)]
            cmd += ["--tiny-repeats", "1", "--check", "1"] if args.dry_run else ["--repeats", "3", "--threads", "0"]
            res = run_stage(stage, cmd, limit(stage), env, work)
            res["figures"] = rollout_figures(_load(js), ROLLOUT_GOAL)
            res["json"] = str(js)
        elif stage == "grpo_step":
            js = work / "grpo_step.json"
            cmd = [py, "benchmarks/grpo_step.py", "--models", model, "--device", device, "--out", str(js)]
            cmd += ["--tiny-steps", "2"] if args.dry_run else ["--steps", "3"]
            res = run_stage(stage, cmd, limit(stage), env, work)
            res["figures"] = grpo_figures(_load(js))
            res["json"] = str(js)
        else:
            js = work / "bank_build.json"
            cmd = [py, "benchmarks/bank_build.py", "--skip-search", "--models", model, "--device", device,
                   "--out", str(js), "--quiet-wait", "0"]
            cmd += ["--max-chunks", "40", "--repeats", "1", "--min-cpu-share", "0"] if args.dry_run else \
                   ["--max-chunks", "400", "--repeats", "2"]
            res = run_stage(stage, cmd, limit(stage), env, work)
            res["figures"] = bank_figures(_load(js))
            res["json"] = str(js)
        if res["status"] == "ok" and stage != "tests" and res["figures"] is None:
            res["status"] = "failed"
            res["why"] = "the benchmark wrote no figures"
        if stage == "tests" and res["outcomes"].get("failed"):
            res["status"] = "failed"
        failed |= res["status"] != "ok"
        report["stages"][stage] = res
        save()
    report["total_s"] = time.perf_counter() - t_start
    report["ok"] = not failed
    save()
    log(f"{'all stages passed' if not failed else 'some stages FAILED'} in {report['total_s']:.0f} s; wrote {out}")
    for stage, res in report["stages"].items():
        figs = res.get("figures") or res.get("outcomes", {})
        brief = {k: v for k, v in figs.items() if not isinstance(v, dict)} if isinstance(figs, dict) else figs
        log(f"  {stage}: {res['status']} ({res['seconds']:.0f} s) {json.dumps(brief, default=str)[:400]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
