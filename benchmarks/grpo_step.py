"""GRPO step benchmark: our trainer's time per step vs TRL's GRPOTrainer on the same work.

    python benchmarks/grpo_step.py --models qwen2.5-3b-random --device cuda --steps 3 --out /tmp/grpo_3b.json  # GPU
    python benchmarks/grpo_step.py --models tiny --device cpu --tiny-steps 2 --out /tmp/x.json  # CPU dry run (~15 s)
    python benchmarks/grpo_step.py                                   # tiny + smollm2, B=4 x G=4 (~10-13 min, 2 cores)
    python benchmarks/grpo_step.py --models tiny --tiny-steps 10     # quick (under a minute)
    python benchmarks/grpo_step.py --steps 3 --out /tmp/grpo_step.json

Both systems run the same GRPO steps in this process, one after the other: the same model, B
queries x G trajectories, LoRA, and queries in the same order. Prints, per model, the median
seconds per step (the first step dropped), split into rollout / score / backward / other, of

* **trl**: ``trl.GRPOTrainer`` on a text-memory prompt (the top-Z retrieved chunks as text);
* **ours (text-equiv)**: our trainer with every retrieved memory injecting as many soft tokens
  as its chunk has text tokens: the same work up to text vs soft tokens;
* **ours (default)**: the preset's ElasticMem, for reference;

and the ratio ours (text-equiv) / TRL (``--goal``, 1.0 by default). ``--out`` writes it all as JSON.

Why one file (about 700 lines): TRL's steps and ours are set up here from the same model, bank,
batches and device, in one process, so that their ratio compares the same work.

Method and results: benchmarks/README.md, section ``grpo_step.py``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import REPO, cpu_name, log, med, write_json  # noqa: E402

import torch  # noqa: E402

import elasticmem.backbone.load as backbone_load  # where load_backbone looks build_tiny_model up
from elasticmem.backbone import RANDOM_MODELS, load_backbone, random_shape
from elasticmem.bank import Bank, build_bank
from elasticmem.bank.index import TorchIndex
from elasticmem.config import Config, TinyModelConfig, load_config
from elasticmem.data.schema import Example, load_split
from elasticmem.data.synthetic import write_synthetic
from elasticmem.data.rewards import mc_letter_reward
from elasticmem.grpo.run import QuerySampler
from elasticmem.model.prompt import format_options

TINY_PRESET = REPO / "configs" / "tiny.yaml"
# RANDOM_MODELS: the tiny preset's model with another shape (elasticmem.backbone.RANDOM_SHAPES)
PRESETS = {"tiny": TINY_PRESET, "smollm2": REPO / "configs" / "quickstart.yaml",
           **dict.fromkeys(RANDOM_MODELS, TINY_PRESET)}
PARTS = ("rollout", "score", "backward", "other")


def mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


# =========================================================================== device


def select_device(spec: str) -> str:
    """'cpu' or 'cuda' for ``--device``. Must run before anything starts CUDA: on CUDA it makes the
    chosen GPU the only visible one (TRL's Trainer always takes cuda:0 and refuses several visible
    GPUs, our trainer's accelerator takes the current one), on CPU it hides the GPUs (our trainer
    would otherwise take one: it follows torch.cuda.is_available(), not backbone.device)."""
    if spec == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["ACCELERATE_USE_CPU"] = "true"  # also honoured by our trainer and TRL, should CUDA be up already
        return "cpu"
    if spec != "auto" and spec != "cuda" and not (spec.startswith("cuda:") and spec[5:].isdigit()):
        raise SystemExit(f"--device {spec!r}: use cpu, cuda, cuda:N or auto")
    index = int(spec[5:]) if spec.startswith("cuda:") else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_initialized():
        raise SystemExit("CUDA was started before --device was applied; set CUDA_VISIBLE_DEVICES yourself")
    if visible is None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    else:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
        if index < len(ids):
            os.environ["CUDA_VISIBLE_DEVICES"] = ids[index]
        elif spec != "auto":
            raise SystemExit(f"--device {spec}: CUDA_VISIBLE_DEVICES={visible!r} has no GPU {index}")
    if not torch.cuda.is_available():
        if spec == "auto":
            return select_device("cpu")
        raise SystemExit(f"--device {spec}: CUDA is not available")
    if torch.cuda.device_count() != 1:  # CUDA_VISIBLE_DEVICES came too late (something queried CUDA before)
        raise SystemExit(f"--device {spec}: {torch.cuda.device_count()} GPUs visible; run with "
                         f"CUDA_VISIBLE_DEVICES=<the one GPU> --device cuda")
    return "cuda"


class Device:
    """Synchronisation and per-system GPU memory accounting (no-ops on the CPU)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.cuda = kind == "cuda"
        self.name = torch.cuda.get_device_name(0) if self.cuda else "cpu"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def release(self) -> None:
        """Free what is no longer referenced (a previous system's model) and hand cached blocks back."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def start(self) -> None:
        """Before a system runs: release the previous one, reset the peak statistics."""
        self.release()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> dict[str, float | None]:
        """After a system ran: its peak GPU memory (MB) since ``start``."""
        if not self.cuda:
            return {"peak_gpu_mb": None, "peak_gpu_reserved_mb": None}
        return {"peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20,
                "peak_gpu_reserved_mb": torch.cuda.max_memory_reserved() / 2**20}

    def allocated_mb(self) -> float | None:
        return torch.cuda.memory_allocated() / 2**20 if self.cuda else None


class BuildOnce:
    """While active, ``build_tiny_model`` (as ``elasticmem.backbone.load`` looks it up) builds each (shape,
    tokenizer) once (the random initialisation, with all CPU cores) and hands out a deep copy of that CPU
    model per call, so ``load_backbone`` (ours and the script's) gets exactly what a rebuild with the same
    seed gives and moves it to its device and dtype as usual. Keeps weak references to the copies it handed out, to
    check that a finished system's model was released."""

    def __init__(self) -> None:
        self.pristine: dict[tuple, torch.nn.Module] = {}
        self.handed: list[weakref.ref] = []
        self.builds = self.copies = 0
        self.build_s = 0.0

    def __enter__(self) -> BuildOnce:
        self.orig = backbone_load.build_tiny_model
        backbone_load.build_tiny_model = self.build
        return self

    def __exit__(self, *exc) -> None:
        backbone_load.build_tiny_model = self.orig
        self.pristine.clear()

    def build(self, cfg, tokenizer) -> torch.nn.Module:
        key = (repr(cfg), len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
        if key not in self.pristine:
            threads = torch.get_num_threads()
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            build_threads = max(threads, min(cores, 32))
            torch.set_num_threads(build_threads)  # the same weights with any thread count
            t = time.perf_counter()
            try:
                self.pristine[key] = self.orig(cfg, tokenizer)
            finally:
                torch.set_num_threads(threads)
            self.build_s += time.perf_counter() - t
            self.builds += 1
            n = sum(p.numel() for p in self.pristine[key].parameters())
            log(f"  random model built: {n / 1e6:.1f}M params in {time.perf_counter() - t:.1f} s "
                f"({build_threads} threads); every load gets a copy")
        model = copy.deepcopy(self.pristine[key])
        self.copies += 1
        self.handed.append(weakref.ref(model))
        return model

    def alive(self) -> int:
        """How many handed-out models are still referenced."""
        return sum(r() is not None for r in self.handed)


# =========================================================================== setup


def drawn_batches(train: list[Example], B: int, steps: int, seed: int) -> list[list[Example]]:
    """The B queries of each of ``steps`` steps, as the trainer's QuerySampler draws them (1 process)."""
    sampler = QuerySampler(len(train), B, 1, 0, seed)
    return [[train[i] for i in sampler.next()] for _ in range(steps)]


def make_bank(backbone, cfg: Config, members: list[Example], root: Path, n_cache: int) -> Path:
    bank_cfg = dataclasses.replace(cfg.bank, dir=str(root), n_cache=n_cache, overwrite=True, verify=False)
    t = time.perf_counter()
    res = build_bank({"train": members}, backbone, cfg.chunking, bank_cfg, torch.float32, show_progress=False)
    log(f"  bank n_cache={n_cache}: {res.num_chunks} chunks in {res.num_groups} histories, "
        f"{res.num_tokens} tokens, built in {time.perf_counter() - t:.1f} s")
    return root


def prompt_texts(tok, cfg: Config, ex: Example) -> tuple[str, str, list[int]]:
    """(head, tail, prompt ids) of ElasticMem's layout for ``ex``, as ``ElasticMem.encode_texts`` builds them:
    raw: ("", question, suffix); chat: the chat template cut around the user turn, so head ends
    with the question and tail is suffix + the assistant prompt. The prompt ids (the frozen
    retrieval state reads their last position) are encode_texts' prompt(q)."""
    m = cfg.memory
    suffix = m.suffix_template.format(options=format_options(ex.choices), question=ex.question)
    if m.prompt_template == "raw":
        return ex.question, suffix, tok(ex.question)["input_ids"]
    marker = "\u0000"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    before, after = text.split(marker)
    return before + ex.question, suffix + after, tok(before + ex.question, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def text_prompts(backbone, cfg: Config, bank_dir: Path, queries: list[Example], Z: int) -> list[dict[str, Any]]:
    """TRL's prompts: top-Z chunk texts (exact index, frozen state at the last prompt token) + question + suffix,
    inside the preset's prompt template (chat: all of it in the user turn)."""
    tok = backbone.tokenizer
    bank = Bank.open(bank_dir)
    index = TorchIndex(bank)
    decoder = backbone.model.get_decoder()
    out = []
    for ex in queries:
        head, tail, ids = prompt_texts(tok, cfg, ex)
        h = decoder(input_ids=torch.tensor([ids], device=backbone.device)).last_hidden_state[:, -1].float()
        res = index.search(h, Z, [ex.group])
        rows = [int(r) for r in res.rows[0] if r >= 0]
        chunks = [bank.chunk(r)["text"] for r in rows]
        memory = "".join(c + "\n" for c in chunks)
        # chunks before the question (raw: at the start; chat: at the start of the user turn)
        if cfg.memory.prompt_template == "raw":
            prompt = memory + head + tail
        else:
            before = head[: len(head) - len(ex.question)]
            prompt = before + memory + ex.question + tail
        out.append({
            "prompt": prompt, "ex_id": ex.id, "rows": rows,
            "prompt_tokens": len(tok(prompt)["input_ids"]),  # TRL tokenizes a plain-text prompt this way
            "memory_tokens": sum(len(tok(c, add_special_tokens=False)["input_ids"]) for c in chunks),
            "bank_chunk_tokens": sum(int(bank.chunk(r)["n_tokens"]) for r in rows),
        })
    return out


# =========================================================================== TRL


def lora_targets(cfg: Config) -> list[str]:
    """The preset's LoRA targets without lm_head: TRL refuses an adapter on lm_head (it computes
    log-probs from ``lm_head.weight`` directly), so neither system gets one (tiny preset)."""
    return [x for x in cfg.memory.lora.target_modules if x != "lm_head"]


def run_trl(backbone, cfg: Config, prompts: list[dict[str, Any]], examples: dict[str, Example], dev: Device,
            B: int, G: int, steps: int, out_dir: Path) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    completion_lengths: list[int] = []
    first = next(backbone.model.parameters())
    dtype = first.dtype
    if first.device.type != dev.kind:
        raise RuntimeError(f"TRL's model is on {first.device}, not {dev.kind}")

    def reward(prompts, completions, ex_id, completion_ids=None, **kw):  # TRL's reward signature
        if completion_ids is not None:
            completion_lengths.extend(len(c) for c in completion_ids)
        return [mc_letter_reward(c.strip(), examples[i]) for c, i in zip(completions, ex_id)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.cur: dict[str, float] = {}
            self.t0 = self.c0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.cur = dict.fromkeys(("rollout", "score", "backward"), 0.0)
            dev.sync()
            self.c0 = time.process_time()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            dev.sync()
            self.cur["total"] = time.perf_counter() - self.t0
            self.cur["cpu"] = time.process_time() - self.c0
            self.steps.append(self.cur)

    timer = StepTimer()

    def timed(fn, part):
        def wrapper(*a, **k):
            dev.sync()
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dev.sync()
                if timer.cur:
                    timer.cur[part] += time.perf_counter() - t
        return wrapper

    m, t = cfg.memory, cfg.train
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    # transformers 5 renamed gradient_checkpointing (TRL's default: True) to activation_checkpointing
    no_checkpointing = ({"activation_checkpointing": False} if "activation_checkpointing" in names
                        else {"gradient_checkpointing": False})
    conf = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=B * G, num_generations=G,
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=m.max_new_tokens,
        temperature=1.0, top_k=0, top_p=1.0, beta=0.0, loss_type="grpo", epsilon=t.loss.clip_eps,
        scale_rewards="group", learning_rate=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
        lr_scheduler_type="cosine", use_cpu=not dev.cuda, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, **no_checkpointing,
        report_to=[], logging_steps=10**6, save_strategy="no", shuffle_dataset=False, seed=cfg.seed,
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
    )
    lora = LoraConfig(r=m.lora.r, lora_alpha=m.lora.alpha, lora_dropout=m.lora.dropout,
                      target_modules=lora_targets(cfg), task_type="CAUSAL_LM")
    data = Dataset.from_list([{"prompt": p["prompt"], "ex_id": p["ex_id"]} for p in prompts])
    trainer = GRPOTrainer(model=backbone.model, reward_funcs=reward, args=conf, train_dataset=data,
                          processing_class=backbone.tokenizer, callbacks=[timer], peft_config=lora)
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "rollout")
    trainer.compute_loss = timed(trainer.compute_loss, "score")
    trainer.accelerator.backward = timed(trainer.accelerator.backward, "backward")
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rows = timer.steps
    for i, r in enumerate(rows):
        log(f"  trl step {i + 1}: {r['total']:.3f} s (rollout {r['rollout']:.3f}, score {r['score']:.3f}, "
            f"backward {r['backward']:.3f}; CPU {r['cpu']:.3f} s)")
    timed_rows = rows[1:]
    n_prompts = len(prompts)
    used = prompts[B: min(n_prompts, B * steps)]  # the prompts of the measured steps
    return {
        **summarise(timed_rows),
        "steps_run": len(rows), "wall_s": wall, "trainable_params": trainable,
        "memory_tokens_per_traj": mean([p["memory_tokens"] for p in used]),
        "bank_chunk_tokens_per_traj": mean([p["bank_chunk_tokens"] for p in used]),
        "prompt_tokens_per_traj": mean([p["prompt_tokens"] for p in used]),
        "completion_tokens_per_traj": mean(completion_lengths[B * G:]),
        "tokens_per_traj": mean([p["prompt_tokens"] for p in used]) + mean(completion_lengths[B * G:]),
        "bf16": conf.bf16, "use_cpu": conf.use_cpu,
    }


# =========================================================================== ours


class _Clock:
    """Stands in for the ``time`` module inside the trainer: the same ``perf_counter`` values, each
    call also recording the process CPU time, so a step's CPU time can be found from the wall
    stamps that bound it (the trainer's ``time/total`` is the difference of two of them). On CUDA
    every stamp first synchronizes."""

    def __init__(self, dev: Device) -> None:
        self.stamps: list[tuple[float, float]] = []
        self.dev = dev

    def perf_counter(self) -> float:
        self.dev.sync()  # on CUDA: the stamp comes after the work queued before it
        wall = time.perf_counter()
        self.stamps.append((wall, time.process_time()))
        return wall

    def __getattr__(self, name: str):
        return getattr(time, name)

    def cpu_between(self, wall_span: float) -> float:
        """CPU seconds between the two recorded stamps exactly ``wall_span`` apart (nan if none)."""
        for j in range(len(self.stamps)):
            for i in range(j - 1, -1, -1):
                if self.stamps[j][0] - self.stamps[i][0] == wall_span:
                    return self.stamps[j][1] - self.stamps[i][1]
        return float("nan")


def run_ours(preset: Path, overrides: list[str], label: str, dev: Device) -> dict[str, Any]:
    import elasticmem.grpo.trainer as trainer_mod

    cfg = load_config(str(preset), overrides)
    clock = _Clock(dev)
    t0 = time.perf_counter()
    trainer_mod.time = clock
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            trainer_mod.train(cfg)
    finally:
        trainer_mod.time = time
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/total" in r]
    steps = []
    for r in rows:
        s = {k: r[f"time/{k}"] for k in ("rollout", "score", "backward", "total")}
        s["cpu"] = clock.cpu_between(s["total"])
        steps.append(s)
        log(f"  {label} step {r['step']}: {s['total']:.3f} s (rollout {s['rollout']:.3f}, score {s['score']:.3f}, "
            f"backward {s['backward']:.3f}; CPU {s['cpu']:.3f} s); soft tokens/traj {r['budget/mean_B_mem']:.1f}, "
            f"#Tok/traj {r['tokens/per_trajectory']:.1f}, reward {r['reward/mean']:.2f}")
    measured = rows[1:]
    return {
        **summarise(steps[1:]),
        "steps_run": len(rows), "wall_s": wall,
        "memory_tokens_per_traj": mean([r["budget/mean_B_mem"] for r in measured]),
        "tokens_per_traj": mean([r["tokens/per_trajectory"] for r in measured]),
        "overrides": overrides,
    }


def summarise(rows: list[dict[str, float]]) -> dict[str, Any]:
    for r in rows:
        r["other"] = r["total"] - r["rollout"] - r["score"] - r["backward"]
    return {
        "s_per_step": med([r["total"] for r in rows]),
        "s_per_step_all": [r["total"] for r in rows],
        "cpu_s_per_step": med([r["cpu"] for r in rows]),
        "cpu_s_per_step_all": [r["cpu"] for r in rows],
        "split": {p: med([r[p] for r in rows]) for p in PARTS},
        "steps_timed": len(rows),
    }


# =========================================================================== one model


# The paper's memory (last-state keys, control-token retrieval, hidden states through the
# projector): TRL's text prompts are retrieved with the same keys, and the figures on record are
# for it. The SmolLM2 preset reads per-layer KV with layer-mean keys and a trained map (a file
# this benchmark does not have).
PAPER_MEMORY = ["bank.key=last", "bank.kv_cache=false", "memory.retrieval=control", "memory.retrieval_map=null",
                "memory.content=hidden", "memory.policy.features=paper"]


def tiny_overrides(preset: TinyModelConfig, shape: TinyModelConfig) -> list[str]:
    """``backbone.tiny.*`` overrides that turn the preset's tiny model into ``shape``."""
    out = []
    for f in dataclasses.fields(shape):
        v = getattr(shape, f.name)
        if v != getattr(preset, f.name):
            out.append(f"backbone.tiny.{f.name}={v if isinstance(v, str) else json.dumps(v)}")
    return out


def release_check(builds: BuildOnce, dev: Device, label: str) -> float | None:
    """After a system: free its model; warn if a model handed out for it is still referenced."""
    dev.release()
    if builds.alive():
        log(f"  WARNING: {builds.alive()} model(s) still referenced after {label}: not freed")
    after = dev.allocated_mb()
    if after is not None:
        log(f"  GPU memory still allocated after {label}: {after:.0f} MB")
    return after


def bench_model(name: str, args, workdir: Path, dev: Device) -> dict[str, Any] | None:
    with BuildOnce() as builds:
        return _bench_model(name, args, workdir, dev, builds)


def _bench_model(name: str, args, workdir: Path, dev: Device, builds: BuildOnce) -> dict[str, Any] | None:
    preset = PRESETS[name]
    cfg = load_config(str(preset), PAPER_MEMORY)
    shape_overrides: list[str] = []
    if name in RANDOM_MODELS:
        # the preset's tiny model (tokenizer settings, seed) with a released model's decoder shape
        tiny = dataclasses.replace(random_shape(name.removesuffix("-random"), seed=cfg.backbone.tiny.seed),
                                   char_fallback=cfg.backbone.tiny.char_fallback, vocabulary=cfg.backbone.tiny.vocabulary)
        shape_overrides = tiny_overrides(cfg.backbone.tiny, tiny)
        cfg = dataclasses.replace(cfg, backbone=dataclasses.replace(cfg.backbone, tiny=tiny))
        assert load_config(str(preset), shape_overrides).model.tiny == tiny, shape_overrides
    B, G = args.batch, args.group
    steps = args.tiny_steps if name == "tiny" else args.steps
    if steps < 2:
        raise SystemExit("need at least 2 steps (the first is a warm-up)")
    Z = args.top_z if args.top_z is not None else (cfg.memory.top_z if preset == TINY_PRESET else 4)
    micro = args.micro_batch or B * G
    root = workdir / name
    t_load = time.perf_counter()
    try:
        backbone = load_backbone(dataclasses.replace(cfg.backbone, device=dev.kind))
    except FileNotFoundError as e:
        log(f"[{name}] skipped: {e}")
        return None
    t_load = time.perf_counter() - t_load
    n_params = sum(p.numel() for p in backbone.model.parameters())
    dtype = next(backbone.model.parameters()).dtype
    dtype_name = str(dtype).removeprefix("torch.")
    shaped = f" + {' '.join(shape_overrides)}" if shape_overrides else ""
    log(f"[{name}] {n_params / 1e6:.2f}M params; preset {preset.name}{shaped}; "
        f"B={B}, G={G}, Z={Z}, max_new_tokens={cfg.memory.max_new_tokens}, LoRA r={cfg.memory.lora.r} on "
        f"{lora_targets(cfg)}, {steps} steps per system (first dropped), micro-batch {micro}; "
        f"{dev.name}, {dtype_name}; loaded in {t_load:.1f} s")
    data_dir = root / "data"
    write_synthetic(cfg.data.synthetic, cfg.seed, data_dir)
    train_split = load_split(data_dir, "train")
    batches = drawn_batches(train_split, B, steps, cfg.seed)
    queries = [ex for b in batches for ex in b]
    n_full = cfg.chunking.max_tokens
    # every training history: our trainer checks that each example of its split has its history in the bank
    bank_full = make_bank(backbone, cfg, train_split, root / "bank-full", n_full)
    bank_default = make_bank(backbone, cfg, train_split, root / "bank-default", cfg.bank.n_cache)
    t = time.perf_counter()
    prompts = text_prompts(backbone, cfg, bank_full, queries, Z)
    log(f"  text prompts for TRL: {len(prompts)} queries, retrieval {time.perf_counter() - t:.1f} s; "
        f"mean {mean([p['prompt_tokens'] for p in prompts]):.1f} prompt tokens, "
        f"{mean([p['memory_tokens'] for p in prompts]):.1f} of them chunk text")

    common = [
        f"seed={cfg.seed}", f"backbone.device={dev.kind}", *shape_overrides, f"data.dir={data_dir}",
        f"memory.top_z={Z}", f"train.max_steps={steps}", f"train.batch_size={B}", f"train.group_size={G}",
        *PAPER_MEMORY,
        f"train.micro_batch_size={micro}", "train.num_iterations=1", "train.temperature=1.0",
        "train.eval_split=", "train.save_every=1000000", "train.resume=false", "train.trackers=[]",
        f"memory.lora.target_modules={json.dumps(lora_targets(cfg))}",
    ]
    results: dict[str, Any] = {}
    examples = {ex.id: ex for ex in queries}
    order = ["trl", "ours_text", "ours_default"]
    for system in order:
        log(f"[{name}] {system} ...")
        reset_accelerate_state()
        dev.start()
        if system == "trl":
            results[system] = run_trl(backbone, cfg, prompts, examples, dev, B, G, steps, root / "trl")
            results[system].update(dev.peak())
            del backbone  # TRL wrapped it with peft; ours loads its own
        elif system == "ours_text":
            results[system] = run_ours(preset, common + [
                f"bank.dir={bank_full}", f"train.output_dir={root / 'ours-text'}",
                "memory.policy.variant=uniform", f"memory.policy.max_budget={n_full}",
                f"memory.policy.uniform_budget={n_full}",
            ], "ours(text-equiv)", dev)
            results[system].update(dev.peak())
        else:
            results[system] = run_ours(preset, common + [
                f"bank.dir={bank_default}", f"train.output_dir={root / 'ours-default'}",
            ], "ours(default)", dev)
            results[system].update(dev.peak())
        if dev.cuda:
            log(f"  {system}: peak GPU memory {results[system]['peak_gpu_mb']:.0f} MB allocated, "
                f"{results[system]['peak_gpu_reserved_mb']:.0f} MB reserved")
        results[system]["gpu_mb_after"] = release_check(builds, dev, system)
    trl_s = results["trl"]["s_per_step"]
    d = cfg.memory
    return {
        "model": name, "params_M": n_params / 1e6, "B": B, "G": G, "top_z": Z, "steps": steps,
        "micro_batch_size": micro, "device": dev.kind, "device_name": dev.name, "dtype": dtype_name,
        "model_builds": builds.builds, "model_copies": builds.copies, "model_build_s": builds.build_s,
        "shape": dataclasses.asdict(cfg.backbone.tiny) if cfg.backbone.name_or_path == "tiny" else None,
        "settings": {"max_new_tokens": d.max_new_tokens,
                     "lora": {**dataclasses.asdict(d.lora), "target_modules": lora_targets(cfg)},
                     "retrieval": d.retrieval, "default_policy": d.policy.variant,
                     "default_max_budget": d.policy.max_budget, "default_n_cache": cfg.bank.n_cache,
                     "text_equiv_budget": n_full, "lr": cfg.train.lr},
        "systems": results,
        "ratio": results["ours_text"]["s_per_step"] / trl_s,
        "ratio_default": results["ours_default"]["s_per_step"] / trl_s,
        "cpu_ratio": results["ours_text"]["cpu_s_per_step"] / results["trl"]["cpu_s_per_step"],
    }


def reset_accelerate_state() -> None:
    """Each system starts from a fresh accelerate state (a process-wide singleton that refuses a
    second Accelerator with other settings); TRL's TrainingArguments resets it the same way."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


# =========================================================================== report


LABELS = {"trl": "TRL GRPOTrainer", "ours_text": "ours (text-equiv)", "ours_default": "ours (default)"}


def print_table(results: list[dict[str, Any]], goal: float) -> None:
    if not results:
        log("no results")
        return
    w = 170
    log("")
    log("=" * w)
    log(f"{'model':<17} {'system':<18} {'s/step':>8} {'ours/TRL':>9} {'rollout':>8} {'score':>8} {'backward':>9} "
        f"{'other':>7}  {'CPU s/step':>10} {'CPU ratio':>9}  {'mem tok/traj':>12} {'tok/traj':>9}  {'steps':>5}  "
        f"{'peak GPU MB':>11}")
    log("-" * w)
    for r in results:
        for key in ("trl", "ours_text", "ours_default"):
            x = r["systems"][key]
            sp = x["split"]
            ratio = "" if key == "trl" else f"{x['s_per_step'] / r['systems']['trl']['s_per_step']:.2f}x"
            cpu_ratio = "" if key == "trl" else f"{x['cpu_s_per_step'] / r['systems']['trl']['cpu_s_per_step']:.2f}x"
            peak = "-" if x.get("peak_gpu_mb") is None else f"{x['peak_gpu_mb']:.0f}"
            log(f"{r['model']:<17} {LABELS[key]:<18} {x['s_per_step']:>8.3f} {ratio:>9} {sp['rollout']:>8.3f} "
                f"{sp['score']:>8.3f} {sp['backward']:>9.3f} {sp['other']:>7.3f}  "
                f"{x['cpu_s_per_step']:>10.3f} {cpu_ratio:>9}  {x['memory_tokens_per_traj']:>12.1f} "
                f"{x['tokens_per_traj']:>9.1f}  {x['steps_timed']:>5}  {peak:>11}")
    log("-" * w)
    for r in results:
        ok = "meets" if r["ratio"] <= goal else "misses"
        log(f"{r['model']}: ours (text-equiv) / TRL = {r['ratio']:.2f}x per step ({ok} the <= {goal:g}x goal); "
            f"ours (default) / TRL = {r['ratio_default']:.2f}x; B={r['B']}, G={r['G']}, Z={r['top_z']}, "
            f"medians of {r['steps'] - 1} steps after a warm-up; in CPU time {r['cpu_ratio']:.2f}x; "
            f"{r['device_name']}, {r['dtype']}")
    log("split (s, medians per part): rollout = sampling + rewards (TRL: _generate_and_score_completions, also "
        "advantages); score = the training forward + loss (TRL: compute_loss); backward; other = the rest of the "
        "step (advantages, clip, AdamW, scheduler)")
    log("CPU s/step: process CPU time of the step (1 intra-op thread: close to the wall time on an idle machine, "
        "and less sensitive to other jobs than s/step, which is the measure)")
    log("mem tok/traj: TRL = text tokens of the retrieved chunks in the prompt; ours = injected soft tokens "
        "(B_mem). tok/traj: TRL = prompt + completion tokens; ours = #Tok (task text + soft tokens + separators "
        "+ answer)")
    log("peak GPU MB: torch.cuda.max_memory_allocated during the system's run (TRL: with the model it is given; "
        "ours: with the model its trainer loads); '-' on the CPU")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=list(PRESETS))
    p.add_argument("--device", default="cpu",
                   help="cpu (default), cuda, cuda:N or auto (CUDA if available); both systems run on it")
    p.add_argument("--steps", type=int, default=3,
                   help="GRPO steps per system for smollm2 and qwen2.5-3b-random (first is dropped)")
    p.add_argument("--tiny-steps", type=int, default=10, help="GRPO steps per system for the tiny model")
    p.add_argument("--batch", type=int, default=4, help="B: queries per step")
    p.add_argument("--group", type=int, default=4, help="G: trajectories per query")
    p.add_argument("--top-z", type=int, default=None,
                   help="Z: retrieved memories (default: tiny preset's top_z, 4 for SmolLM2)")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="our train.micro_batch_size (0 = B*G: one scoring pass per step, like TRL)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 = torch's choice")
    p.add_argument("--goal", type=float, default=1.0)
    p.add_argument("--workdir", default=None, help="temp folder (default: a new one, deleted at the end)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    dev = Device(select_device(args.device))  # before anything starts CUDA
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    import trl

    log(f"GRPO step benchmark: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"{cpu_name()}, load avg {os.getloadavg()[0]:.2f}; device {dev.name}"
        + (f" (CUDA {torch.version.cuda})" if dev.cuda else ""))
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="elasticmem-grpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    loads = [os.getloadavg()[0]]
    try:
        for name in args.models:
            r = bench_model(name, args, workdir, dev)
            loads.append(os.getloadavg()[0])
            if r is not None:
                results.append(r)
                log(f"[{name}] ours (text-equiv) / TRL = {r['ratio']:.2f}x; threads now {torch.get_num_threads()}")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(results, args.goal)
    log(f"load average (1 min) at start and after each model: {', '.join(f'{x:.2f}' for x in loads)}")
    if args.out:
        meta = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "argv": sys.argv[1:],
                "load_avg": loads, "device": dev.kind, "device_name": dev.name,
                "cuda": torch.version.cuda if dev.cuda else None}
        write_json(args.out, {"meta": meta, "results": results}, __file__, argv)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
