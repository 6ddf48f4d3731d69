"""The GPU check: the ``gpu`` tests and the GPU benchmarks in one run, one JSON of figures.

    bash scripts/gpu_check.sh                           # a CUDA machine, no network: < 10 min on one GPU
    bash scripts/gpu_check.sh --dry-run                 # anywhere: the same stages on the CPU at tiny sizes
    python benchmarks/gpu_check.py --out runs/gpu_check/gpu_check.json [--dry-run] [--device cuda:1]
    python benchmarks/gpu_check.py --stages search activation_memory      # some stages only

Every stage runs in its own process group with its own time limit (``LIMITS``: 10 minutes in all
on a GPU, preflight included). A stage that fails or runs out of time is recorded as such, with
the tail of what it printed and whatever figures it had written, and the next one runs; the JSON
is rewritten after every stage, so a check killed half-way still leaves the stages it finished.
A timed-out stage is interrupted (SIGINT) before it is killed, so that pytest writes its JUnit
results; the tests stage also runs verbose, and its log names each test's outcome as it ends.
The exit status is 1 when any stage failed or timed out, 2 when a GPU run finds no CUDA.

0. **preflight**: CUDA visible, and the optional pieces importable: faiss with GPU support
   (faiss-gpu), bitsandbytes (4-bit), trl (the GRPO comparison), deepspeed, pytest. What is
   missing is listed in the JSON with how to install it; the check goes on, and a stage that needs
   a missing piece is recorded as ``skipped`` with the reason (the 4-bit and faiss-gpu tests skip
   themselves). Only a GPU run without CUDA stops here.
1. **tests**: ``pytest -m gpu tests/gpu`` (bf16 against fp32 scores, gradients and training
   steps; 4-bit base weights; faiss-gpu; a bank built on the GPU against a CPU one; training,
   warm-up and evaluation searching on the model's device). The dry run runs them on the CPU
   (``ELASTICMEM_GPU_TEST_DEVICE=cpu``; the CUDA-only ones skip).
2. **deepspeed**: ``accelerate launch`` with ``configs/accelerate/deepspeed_zero2.yaml`` (one
   process, ``mixed_precision: bf16``: DeepSpeed casts the whole module to bf16) running
   ``train.py`` for a few GRPO steps with ``train.gradient_checkpointing=true``, on a random model
   of Qwen2.5-0.5B's decoder shape (the tiny preset's model in the dry run) and a bank it built:
   steps, loss, gradient norm, seconds per step.
3. **activation_memory**: ``benchmarks/activation_memory.py``: a random model with Qwen2.5's
   vocabulary (151936) and LoCoMo-length scoring sequences (600 tokens, micro-batch 8); peak memory
   of one scoring step with and without gradient checkpointing and their ratio (the issue's goal:
   growth with checkpointing <= 0.5x without). Tiny sizes in the dry run.
4. **search**: group-restricted exact key search (``TorchIndex``; the same ``exact_search`` serves
   restricted queries of the FAISS indexes) on the device and on the CPU over the same keys:
   equal rows, scores within 1e-4, the seconds of each; LoCoMo-sized groups and one large group.
5. **warmup**: the reading warm-up (``elasticmem.warmup``) for a few steps with the model on the
   device: steps, loss, seconds per step, peak GPU memory.
6. **amem_local**: A-Mem's local LLM backend (``TransformersBackend``: constrained JSON notes
   and free-text answers) with the model on the device: calls, valid JSON, seconds per call.
7. **rollout**: ``benchmarks/rollout.py`` at ``qwen2.5-3b-random`` (random weights in Qwen2.5-3B's
   decoder shape, the tiny tokenizer): batched trajectories/s against the one-at-a-time loop
   (goal >= 10x on a GPU), rollout time / compute floor, peak GPU memory.
8. **grpo_step**: ``benchmarks/grpo_step.py`` at the same shape: our GRPO step against TRL's
   GRPOTrainer on the same work (both bf16 on the GPU), peak GPU memory per system.
9. **bank_build**: ``benchmarks/bank_build.py --skip-search`` at the same shape: builder chunks/s
   against a bare batched forward over the same batches, bank bytes, peak GPU memory.

The dry run uses tiny models on the CPU with the fewest steps: it checks that every stage runs
and that the JSON has every figure, not the figures themselves. The JSON (``--out``) holds the
environment, the preflight, each stage's status (ok / failed / timeout / skipped), seconds, log
tail and figures, the test outcomes, and the path of each benchmark's full JSON (kept with the
logs in ``<out without .json>/``). docs/cluster.md says how to read it.

Why one file (about 650 lines): each stage's entry in its child process and the parent that runs,
times and reports them are one command, meant to run on a bare GPU machine as one script.

Summary: benchmarks/README.md, section ``gpu_check.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import REPO, log as _log  # noqa: E402

from elasticmem.utils.common import free_port  # noqa: E402

ROLLOUT_GOAL = 10.0
ACTIVATION_GOAL = 0.5  # peak growth with checkpointing / without (issue 39's acceptance)
# Seconds per stage. On a GPU they sum to 10 minutes, the check's budget (a stage that needs more
# is recorded as timed out, and --limit-scale gives a slow machine more); the dry run doubles
# them (2 CPU cores, maybe shared).
LIMITS = {"preflight": 30, "tests": 120, "deepspeed": 60, "activation_memory": 75, "search": 20, "warmup": 30,
          "amem_local": 25, "rollout": 70, "grpo_step": 115, "bank_build": 55}
STAGES = ["tests", "deepspeed", "activation_memory", "search", "warmup", "amem_local", "rollout", "grpo_step",
          "bank_build"]
NEEDS = {"tests": "pytest", "deepspeed": "deepspeed", "grpo_step": "trl"}  # a stage skips without its package
GRACE_S = 20  # after SIGINT, before SIGKILL: pytest writes its JUnit XML, train.py its checkpoint

INSTALL = {
    "bitsandbytes": "pip install 'elasticmem[gpu]'",
    "deepspeed": "pip install 'elasticmem[gpu]'",
    "trl": "pip install 'elasticmem[dev]'",
    "pytest": "pip install 'elasticmem[dev]'",
    "faiss-gpu": "pip uninstall -y faiss-cpu && pip install 'elasticmem[gpu]'",
}
INSTALL_CUDA = "a CUDA build of torch (docs/installation.md) and a visible GPU"
OPTIONAL = ("bitsandbytes", "trl", "deepspeed", "pytest")


def log(msg: str) -> None:
    _log(f"[gpu_check] {msg}")  # tagged: the failed stages' log tails are printed between these lines


# =========================================================================== stages in their own process


def stage_preflight(args: argparse.Namespace) -> dict[str, Any]:
    """What the stages need: {name: version or None} plus details, and the list of what is missing."""
    import torch

    found: dict[str, Any] = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if found["cuda"]:
        found["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        found["cuda_version"] = torch.version.cuda
    no_cuda = ["cuda"] if args.device.startswith("cuda") and not found["cuda"] else []
    # CUDA first, on its own: should the imports below hang past the limit, the check still knows
    Path(args.stage_out).write_text(json.dumps({"found": dict(found), "missing": no_cuda, "partial": True}))
    for mod in OPTIONAL:
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
    missing = no_cuda + [m for m in OPTIONAL if not found[m]]
    if not found["faiss-gpu"]:
        missing.append("faiss-gpu")
    return {"found": found, "missing": missing, "install": {m: INSTALL[m] for m in missing if m in INSTALL}}


def _task_config(args: argparse.Namespace, work: Path):
    """The config (and its overrides of the tiny preset) of the deepspeed, warmup and amem_local
    stages: the tiny preset's task with 24 histories; on a GPU a random model of Qwen2.5-0.5B's
    decoder shape (the tiny tokenizer), in the dry run the tiny preset's model."""
    from activation_memory import QWEN25_05B

    from elasticmem.config import load_config

    root = work / "task"
    over = [f"data.dir={root}/data", f"bank.dir={root}/bank", f"backbone.device={args.device}",
            "data.synthetic.num_histories=24"]
    if not args.dry_run:
        over += [f"backbone.tiny.{k}={v}" for k, v in QWEN25_05B.items()]
    return load_config(REPO / "configs/tiny.yaml", over), over


def _task(args: argparse.Namespace, work: Path):
    """``_task_config`` with its data and a bank built by its model, made by the first stage that
    needs them (a later build confirms or resumes it)."""
    import torch

    from elasticmem.backbone import load_backbone
    from elasticmem.bank import build_bank, resolve_cache_dtype
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic

    cfg, over = _task_config(args, work)
    root = work / "task"
    if not (root / "data" / "test.jsonl").is_file():
        write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    examples = {s: load_split(cfg.data.dir, s) for s in cfg.bank.splits}
    backbone = load_backbone(cfg.backbone)
    build_bank(examples, backbone, cfg.chunking, cfg.bank, resolve_cache_dtype(cfg.bank.cache_dtype,
                                                                               backbone.device), show_progress=False)
    del backbone
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return cfg, over


def stage_deepspeed(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A few GRPO steps under DeepSpeed ZeRO-2 in bf16 with gradient checkpointing, launched as users do."""
    import yaml

    _, over = _task(args, work)
    acc = yaml.safe_load((REPO / "configs/accelerate/deepspeed_zero2.yaml").read_text())
    acc.update(num_processes=1, num_machines=1)  # one GPU; the repository's file otherwise
    launch_cfg = work / "deepspeed" / "zero2.yaml"
    launch_cfg.parent.mkdir(parents=True, exist_ok=True)
    launch_cfg.write_text(yaml.safe_dump(acc))
    out = work / "deepspeed" / "run"
    shutil.rmtree(out, ignore_errors=True)
    steps = 2 if args.dry_run else 3
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "elasticmem" / "torch_extensions")}
    env.pop("ACCELERATE_USE_CPU", None)  # DeepSpeed picks its CPU accelerator itself where there is no GPU
    if args.device.startswith("cuda:"):  # the launched process takes the first visible GPU: make it the chosen one
        visible = [x for x in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
        n = int(args.device[5:])
        env["CUDA_VISIBLE_DEVICES"] = visible[n] if n < len(visible) else str(n)
        over = [o if not o.startswith("backbone.device=") else "backbone.device=cuda" for o in over]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launch_cfg),
           "--main_process_port", str(free_port()), "train.py", "--config", "configs/tiny.yaml", *over,
           f"train.output_dir={out}", f"train.max_steps={steps}", "train.batch_size=4", "train.group_size=4",
           "train.micro_batch_size=8", "train.eval_split=", "train.save_every=0", "train.resume=false",
           "train.gradient_checkpointing=true", "train.mixed_precision=bf16"]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "eval" not in r]
    if len(rows) != steps or any(r["distributed_type"] != "DEEPSPEED" for r in rows):
        raise RuntimeError(f"expected {steps} DeepSpeed steps in {out}/metrics.jsonl, got {rows}")
    bad = [r["step"] for r in rows if not (_finite(r["loss"]) and _finite(r["grad_norm"]) and r["grad_norm"] > 0)]
    if bad:
        raise RuntimeError(f"non-finite loss or zero gradient at steps {bad}")
    step_s = [r["time/total"] for r in rows]
    return {"model": "tiny" if args.dry_run else "qwen2.5-0.5b-shape-random", "device": args.device,
            "zero_stage": acc["deepspeed_config"]["zero_stage"], "mixed_precision": acc["mixed_precision"],
            "gradient_checkpointing": True, "steps": len(rows), "loss": [r["loss"] for r in rows],
            "grad_norm": [r["grad_norm"] for r in rows], "s_per_step": statistics.median(step_s[1:] or step_s),
            "skipped_steps": rows[-1].get("skipped_steps"), "wall_s": time.perf_counter() - t0}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


class _KeyTable:
    """What an index reads of a bank (``Bank.keys(start, end)``, ``group_segments``): unit-norm
    random keys on the host, as the memory-mapped shards hand them over, in groups of rows."""

    def __init__(self, rows: int, dim: int, groups: dict[str, tuple[tuple[int, int], ...]], seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self._k = torch.nn.functional.normalize(torch.randn(rows, dim, generator=g), dim=-1)
        self.groups = groups
        self.num_chunks, self.hidden_size = rows, dim

    def keys(self, start: int = 0, end: int | None = None):
        return self._k[start : self.num_chunks if end is None else end]

    def group_segments(self, g: str) -> tuple[tuple[int, int], ...]:
        return self.groups[g]


def stage_search(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Group-restricted search on the device against the CPU: equal results, the seconds of each."""
    import torch

    from elasticmem.bank.index import build_index
    from elasticmem.config import IndexConfig

    # A bank of LoCoMo-sized groups (~600 chunks each: a conversation) and one large shared group
    # (a user's whole history, or a corpus searched group by group), at the model's width.
    dim, group, big, n_groups = (64, 96, 2048, 8) if args.dry_run else (2048, 600, 131072, 64)
    groups = {f"g{i}": ((i * group, (i + 1) * group),) for i in range(n_groups)}
    groups["big"] = ((n_groups * group, n_groups * group + big),)
    table = _KeyTable(n_groups * group + big, dim, groups)
    # a training batch: 16 questions x 4 from different groups; then 16 queries into the big group
    cases = {"groups": [f"g{i % n_groups}" for i in range(64)], "big_group": ["big"] * 16}
    indexes = {w: build_index(table, IndexConfig(type="torch"), device=d) for w, d in (("cpu", "cpu"),
                                                                                 ("device", args.device))}
    repeats = 2 if args.dry_run else 5
    out: dict[str, Any] = {"device": args.device, "rows": table.num_chunks, "dim": dim, "group_rows": group,
                           "big_group_rows": big, "k": 20, "cases": {}}
    g = torch.Generator().manual_seed(1)
    for name, gs in cases.items():
        q = torch.randn(len(gs), dim, generator=g)
        res, secs = {}, {}
        for d, index in indexes.items():
            index.search(q, 20, gs)  # warm (CUDA context, kernels)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                res[d] = index.search(q, 20, gs)  # results come back on the host: the device has finished
                times.append(time.perf_counter() - t0)
            secs[d] = statistics.median(times)
        a, b = res["cpu"], res["device"]
        equal = bool(torch.equal(a.rows, b.rows))
        diff = float((a.scores - b.scores).abs().max())
        out["cases"][name] = {"queries": len(gs), "cpu_s": secs["cpu"], "device_s": secs["device"],
                              "cpu_over_device": secs["cpu"] / max(secs["device"], 1e-9), "rows_equal": equal,
                              "max_score_diff": diff}
        if not equal or diff > 1e-4:
            raise RuntimeError(f"{name}: the device's restricted search differs from the CPU's "
                               f"(rows equal {equal}, max score difference {diff:.2e})")
    return out


def _peak_mb(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None


def stage_warmup(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A few steps of the reading warm-up with the model on the device."""
    import torch

    from elasticmem.config import load_config
    from elasticmem.warmup.reading import warmup

    _, over = _task(args, work)
    steps = 2 if args.dry_run else 4
    out = work / "warmup" / "run"
    shutil.rmtree(out, ignore_errors=True)  # a finished warm-up (final/) would not run again
    cfg = load_config(REPO / "configs/tiny.yaml", [*over, f"warmup.output_dir={out}", f"warmup.steps={steps}",
                                                   "warmup.batch_size=4", "warmup.eval_split=",
                                                   "train.gradient_checkpointing=true"])
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = warmup(cfg)
    seconds = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    losses = [r["loss"] for r in rows if "loss" in r]
    if not losses or not all(_finite(x) for x in losses):
        raise RuntimeError(f"the warm-up logged no finite loss: {rows or result}")
    return {"device": args.device, "steps": steps, "gradient_checkpointing": True, "loss": losses,
            "s_per_step": seconds / steps, "peak_gpu_mb": _peak_mb(args.device)}


def stage_amem_local(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A-Mem's local backend with the model on the device: constrained JSON notes and free answers."""
    import torch

    from elasticmem.backbone import load_backbone
    from elasticmem.baselines.amem import prompts
    from elasticmem.baselines.amem.config import AMemConfig
    from elasticmem.llm.client import GenRequest, StructuredLLM, TransformersBackend

    cfg, _ = _task_config(args, work)
    # any text tokenizes (the tiny preset's word-only vocabulary cannot spell the notes' JSON)
    backbone = load_backbone(dataclasses.replace(cfg.backbone, tiny=dataclasses.replace(cfg.backbone.tiny,
                                                                                     char_fallback=True)))
    backend = TransformersBackend(backbone.model, backbone.tokenizer, batch_size=4)
    llm = StructuredLLM(backend)
    acfg = AMemConfig(embedder="hashing", max_item_chars=8, max_context_chars=24, max_keywords=3, max_tags=2)
    turns = ["cat dog", "a much longer turn about the garden and the weather", "x y", "zebra"]
    notes = [GenRequest(prompts.note_messages(t, "today"), 400, prompts.note_schema(acfg), kind="note") for t in turns]
    answers = [GenRequest(prompts.note_messages(t, "today"), 24, None, kind="answer") for t in turns[:2]]
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    res = llm.json(notes, [lambda: None] * len(notes))
    t_json = time.perf_counter() - t0
    t0 = time.perf_counter()
    free = llm.text(answers)
    t_text = time.perf_counter() - t0
    valid = sum(r.ok and not r.fallback for r in res)
    if valid != len(notes) or not all(r.text for r in free):
        raise RuntimeError(f"constrained JSON valid {valid}/{len(notes)} (errors {[r.errors for r in res]}); "
                           f"free answers {[r.text for r in free]}")
    return {"device": str(backbone.device), "json_calls": len(notes), "valid_json": valid, "text_calls": len(free),
            "json_s_per_call": t_json / len(notes), "text_s_per_call": t_text / len(free),
            "completion_tokens": sum(r.tokens for r in [*res, *free]), "peak_gpu_mb": _peak_mb(args.device)}


CHILD = {"preflight": stage_preflight, "deepspeed": stage_deepspeed, "search": stage_search,
         "warmup": stage_warmup, "amem_local": stage_amem_local}


def child_main(args: argparse.Namespace) -> int:
    """``--stage NAME --stage-out F``: run one stage here and write its figures to F."""
    work = Path(args.stage_out).parent
    fn = CHILD[args.stage]
    figures = fn(args) if args.stage == "preflight" else fn(args, work)
    Path(args.stage_out).write_text(json.dumps(figures, indent=1, default=str))
    return 0


# =========================================================================== the parent


def run_stage(name: str, cmd: list[str], timeout: float, env: dict[str, str], logs: Path) -> dict[str, Any]:
    """One stage in its own process group: status (ok / failed / timeout), seconds, exit code, log
    tail. On the time limit the group gets SIGINT (pytest writes its results, train.py saves), then
    SIGKILL after ``GRACE_S``."""
    log(f"{name}: {' '.join(cmd)}  (limit {timeout:.0f} s)")
    path = logs / f"{name}.log"
    t0 = time.perf_counter()
    with open(path, "w") as f:
        # SIGINT back to its default: a check started in the background (`&`, nohup) ignores it,
        # and so would every stage, which could then only be killed, its results unwritten
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
            for sig, wait in ((signal.SIGINT, GRACE_S), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode
            try:  # whatever it started in the group and left behind
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    seconds = time.perf_counter() - t0
    tail = path.read_text(errors="replace")[-4000:]
    log(f"{name}: {status} in {seconds:.0f} s (log {path})")
    if status != "ok":
        print(tail[-1500:], flush=True)
    return {"status": status, "returncode": rc, "seconds": seconds, "log": str(path), "log_tail": tail}


VERBOSE_LINE = re.compile(r"^(\S+?::\S+?)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.MULTILINE)


def junit_outcomes(junit: Path, log_path: Path | None = None) -> dict[str, Any]:
    """Counts and per-test outcomes from pytest's JUnit XML (skip reasons included); without the
    XML (pytest killed), from the verbose log's per-test lines (``from_log``)."""
    out: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "tests": {}}
    if not junit.is_file():
        text = log_path.read_text(errors="replace") if log_path and log_path.is_file() else ""
        for test, word in VERBOSE_LINE.findall(text):
            outcome = {"PASSED": "passed", "XPASS": "passed", "SKIPPED": "skipped", "XFAIL": "skipped"}.get(
                word, "failed")
            out[outcome] += 1
            mod, _, fn = test.partition("::")
            out["tests"][f"{Path(mod).stem}::{fn}"] = {"outcome": outcome}
        return {**out, "from_log": True, "error": f"no {junit}"}
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


def activation_figures(report: dict[str, Any] | None) -> dict[str, Any] | None:
    if not report or "off" not in report or "on" not in report:
        return None
    a = report["args"]
    return {"device": a["device"], "layers": a["layers"], "vocab": a["vocab"], "micro_batch": a["batch"],
            "seq": a["seq"], "answer_tokens": a["answer"],
            **{f"checkpointing_{k}": {"peak_mb": report[k]["peak_mb"], "growth_mb": report[k]["growth_mb"]}
               for k in ("off", "on")},
            "growth_ratio": report["growth_ratio"], "peak_ratio": report["peak_ratio"], "goal": ACTIVATION_GOAL,
            "meets_goal": report["growth_ratio"] <= ACTIVATION_GOAL}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "runs" / "gpu_check" / "gpu_check.json"), help="the JSON of figures")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, tiny models, fewest steps")
    p.add_argument("--device", default="cuda", help="the GPU to check (cuda, cuda:1, ...)")
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiply every stage's time limit")
    p.add_argument("--shape", default="qwen2.5-3b", help="RANDOM_SHAPES key of the benchmark model")
    p.add_argument("--stages", nargs="+", default=STAGES, choices=STAGES)
    p.add_argument("--stage", choices=sorted(CHILD), help=argparse.SUPPRESS)
    p.add_argument("--stage-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    if args.stage:
        return child_main(args)

    out = Path(args.out)
    work = out.with_suffix("")  # the stages' JSON and logs: <out without .json>/
    work.mkdir(parents=True, exist_ok=True)
    device = args.device
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(x for x in (str(REPO), str(REPO / "benchmarks"),
                                                     os.environ.get("PYTHONPATH")) if x)}
    if args.dry_run:
        env["ACCELERATE_USE_CPU"] = "1"
    report: dict[str, Any] = {
        "dry_run": args.dry_run, "device": device, "shape": None if args.dry_run else args.shape,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "stages": {},
    }

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))

    py = sys.executable
    me = [py, str(Path(__file__).resolve())] + (["--dry-run"] if args.dry_run else ["--device", device])

    def limit(stage: str) -> float:
        return LIMITS[stage] * args.limit_scale * (2 if args.dry_run else 1)  # 2 CPU cores may be shared

    def child(stage: str) -> tuple[dict[str, Any], Path]:
        js = work / f"{stage}.json"
        js.unlink(missing_ok=True)
        res = run_stage(stage, [*me, "--stage", stage, "--stage-out", str(js)], limit(stage), env, work)
        return res, js

    if not args.dry_run:
        import torch  # here, with no time limit: without CUDA nothing else is worth running

        if not torch.cuda.is_available():
            report["preflight"] = {"found": {"cuda": False, "torch": torch.__version__}, "missing": ["cuda"]}
            report["stopped"] = "missing cuda"
            log(f"missing: cuda. Install: {INSTALL_CUDA}")
            save()
            return 2
    res, js = child("preflight")
    pre = _load(js) or {"missing": [], "error": "the preflight wrote nothing"}
    report["preflight"] = {**pre, **{k: res[k] for k in ("status", "seconds", "log")}}
    if res["status"] != "ok":
        report["preflight"]["log_tail"] = res["log_tail"]
    missing = pre.get("missing", [])
    if missing:
        how = "; ".join(f"{m}: {INSTALL.get(m, INSTALL_CUDA)}" for m in missing)
        log(f"missing: {', '.join(missing)}. Install: {how}")
        if "cuda" in missing:
            report["stopped"] = f"missing {', '.join(missing)}"
            save()
            return 2
        log("the check goes on without them (stages that need one are skipped)")
    save()

    model = "tiny" if args.dry_run else f"{args.shape}-random"
    t_start = time.perf_counter()
    for stage in args.stages:
        need = NEEDS.get(stage)
        if need and need in missing:
            res = {"status": "skipped", "seconds": 0.0, "why": f"needs {need} ({INSTALL[need]})"}
            log(f"{stage}: skipped, {res['why']}")
        elif stage in CHILD:
            res, js = child(stage)
            res["figures"] = _load(js)
        elif stage == "tests":
            junit = work / "tests.xml"
            junit.unlink(missing_ok=True)
            tenv = {**env, "ELASTICMEM_GPU_TEST_DEVICE": device}
            res = run_stage(stage, [py, "-m", "pytest", "-v", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider",
                                    f"--junitxml={junit}", "-ra"], limit(stage), tenv, work)
            res["outcomes"] = junit_outcomes(junit, Path(res["log"]))
        elif stage == "activation_memory":
            js = work / "activation_memory.json"
            js.unlink(missing_ok=True)
            cmd = [py, "benchmarks/activation_memory.py", "--device", device, "--out", str(js)]
            if args.dry_run:  # Qwen2.5-0.5B's width, one layer, a small vocabulary, short sequences
                cmd += ["--layers", "1", "--seq", "128", "--batch", "2", "--answer", "4", "--vocab", "4096",
                        "--threads", "1"]
            res = run_stage(stage, cmd, limit(stage), env, work)
            res["figures"] = activation_figures(_load(js))
            res["json"] = str(js)
        elif stage == "rollout":
            js = work / "rollout.json"
            cmd = [py, "benchmarks/rollout.py", "--models", model, "--device", device, "--out", str(js),
                   "--goal", str(ROLLOUT_GOAL)]
            cmd += ["--tiny-repeats", "1", "--check", "1"] if args.dry_run else ["--repeats", "2", "--threads", "0"]
            res = run_stage(stage, cmd, limit(stage), env, work)
            res["figures"] = rollout_figures(_load(js), ROLLOUT_GOAL)
            res["json"] = str(js)
        elif stage == "grpo_step":
            js = work / "grpo_step.json"
            cmd = [py, "benchmarks/grpo_step.py", "--models", model, "--device", device, "--out", str(js)]
            cmd += ["--tiny-steps", "2"] if args.dry_run else ["--steps", "2"]
            res = run_stage(stage, cmd, limit(stage), env, work)
            res["figures"] = grpo_figures(_load(js))
            res["json"] = str(js)
        else:
            js = work / "bank_build.json"
            cmd = [py, "benchmarks/bank_build.py", "--skip-search", "--models", model, "--device", device,
                   "--out", str(js), "--quiet-wait", "0"]
            cmd += ["--max-chunks", "24", "--repeats", "1", "--min-cpu-share", "0"] if args.dry_run else \
                   ["--max-chunks", "400", "--repeats", "1"]
            res = run_stage(stage, cmd, limit(stage), env, work)
            res["figures"] = bank_figures(_load(js))
            res["json"] = str(js)
        if res["status"] == "ok" and stage != "tests" and res.get("figures") is None:
            res["status"] = "failed"
            res["why"] = "the stage wrote no figures"
        if stage == "tests" and res["status"] == "ok" and res["outcomes"].get("failed"):
            res["status"] = "failed"
        report["stages"][stage] = res
        save()
    report["total_s"] = time.perf_counter() - t_start
    failed = [s for s, r in report["stages"].items() if r["status"] in ("failed", "timeout")]
    skipped = [s for s, r in report["stages"].items() if r["status"] == "skipped"]
    report["ok"], report["failed"], report["skipped"] = not failed, failed, skipped
    save()
    log(f"{'all stages passed' if not failed else 'FAILED: ' + ', '.join(failed)}"
        f"{'; skipped: ' + ', '.join(skipped) if skipped else ''} in {report['total_s']:.0f} s; wrote {out}")
    for stage, res in report["stages"].items():
        figs = res.get("figures") or res.get("outcomes", {})
        brief = {k: v for k, v in figs.items() if not isinstance(v, dict)} if isinstance(figs, dict) else figs
        log(f"  {stage}: {res['status']} ({res['seconds']:.0f} s) {json.dumps(brief, default=str)[:400]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
