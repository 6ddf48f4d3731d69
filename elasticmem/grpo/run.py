"""A GRPO run's shared state and its setup: accelerator, model, data checks, optimizer, schedule, resume.

``setup(cfg)`` builds a ``Run`` that the training loop (``elasticmem.grpo.trainer``) reads:
it refuses another run's output directory and bad data before the first step, and
restores weights, optimizer, schedule, counters, sampler position and RNG from the
last checkpoint.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from elasticmem.config import Config
from elasticmem.data.rewards import get_reward
from elasticmem.data.schema import Example
from elasticmem.training.runtime import check_init, resumable_checkpoint, truncate_jsonl
from elasticmem.utils import checkpointing as ckpt
from elasticmem.utils.configuration import ConfigError
from elasticmem.utils.configuration import save as save_config
from elasticmem.utils.distributed import gathered, process_group_kwargs

# --------------------------------------------------------------------------- data order


@dataclass
class QuerySampler:
    """Deterministic query order: a seeded permutation per epoch, read in global batches.

    Process ``rank`` takes the ``rank``-th slice of each global batch of ``B * world``
    queries; an incomplete global batch at the end of an epoch is dropped.
    """

    num_examples: int
    batch_size: int
    world: int
    rank: int
    seed: int
    epoch: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        if self.num_examples < self.batch_size * self.world:
            raise ValueError(
                f"{self.num_examples} training queries cannot fill one global batch of "
                f"{self.batch_size} x {self.world} processes; lower train.batch_size"
            )

    def _perm(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_examples, generator=g)

    def next(self) -> list[int]:
        span = self.batch_size * self.world
        if self.offset + span > self.num_examples:
            self.epoch, self.offset = self.epoch + 1, 0
        perm = self._perm()
        start = self.offset + self.rank * self.batch_size
        self.offset += span
        return perm[start : start + self.batch_size].tolist()

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}


# --------------------------------------------------------------------------- accelerator, optimizer, schedule


def _accelerator(cfg: Config):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, parse_flag_from_env

    cuda = torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")
    mp = cfg.train.mixed_precision
    mp = ("bf16" if cuda else "no") if mp == "auto" else mp
    world = int(os.environ.get("WORLD_SIZE", "1"))
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)]  # e.g. projector when all budgets are 0
    gloo = not cuda and world > 1  # DeepSpeed on CPU needs gloo (DESIGN.md section 4)
    handlers.append(InitProcessGroupKwargs(**process_group_kwargs(cfg.train.dist_timeout_s, gloo)))
    deepspeed = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")  # set by accelerate launch for DeepSpeed configs
    acc = Accelerator(cpu=not cuda and not deepspeed, mixed_precision=mp, kwargs_handlers=handlers,
                      log_with=list(cfg.train.trackers) or None, project_dir=cfg.train.output_dir)
    plugin = acc.state.deepspeed_plugin
    if plugin is not None:
        # DeepSpeed wants a micro-batch size and owns accumulation: it applies the optimizer
        # only at the boundary after this many backward calls (one per scoring micro-batch).
        t = cfg.train
        ds = plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
        ds["gradient_accumulation_steps"] = math.ceil(t.batch_size * t.group_size / t.micro_batch_size)
        ds["gradient_clipping"] = t.max_grad_norm
        ds.pop("train_batch_size", None)
    if world > 1 and acc.num_processes != world:
        raise RuntimeError(f"launched {world} processes but accelerate sees {acc.num_processes}: on CPU use "
                           f"ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {world}")
    return acc


def _optimizer(model, cfg: Config) -> torch.optim.Optimizer:
    t = cfg.train
    groups: dict[str, list] = {"lm": [], "policy": [], "projector": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups[name.split(".", 1)[0] if name.startswith(("policy.", "projector.")) else "lm"].append(p)
    lrs = {"lm": t.lr, "policy": t.lr_policy or t.lr, "projector": t.lr_projector or t.lr}
    return torch.optim.AdamW([{"params": ps, "lr": lrs[k], "name": k} for k, ps in groups.items() if ps],
                             weight_decay=t.weight_decay)


def _scheduler(optimizer, total: int, cfg: Config):
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=cfg.train.warmup_steps, num_training_steps=max(1, total),
        min_lr_rate=cfg.train.min_lr_ratio,
    )


# --------------------------------------------------------------------------- the run and its setup


@dataclass
class Run:
    """What the loop's parts share, built once by ``setup``.

    ``model`` is what ``acc.prepare`` returned (the model itself, its DDP wrapper or a
    DeepSpeed engine); ``core`` is the unwrapped ElasticMem or MemGen whose ``sample``,
    ``score`` and ``save_pretrained`` the loop calls. ``state`` is what a checkpoint's
    trainer state holds: ``step``, ``optimizer_steps``, ``skipped_steps``, ``sampler``.
    """

    cfg: Config
    acc: Any
    model: torch.nn.Module
    core: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: QuerySampler
    examples: list[Example]
    evidence: dict[str, set[int]]  # bank rows holding each query's evidence (empty: none recorded or used)
    reward_fn: Callable[[str, Example], float]
    trainable: list[torch.nn.Parameter]  # what checkpoints hold
    total: int  # rollout steps of the whole run
    state: dict[str, Any]

    @property
    def main(self) -> bool:
        return self.acc.is_main_process

    @property
    def deepspeed(self) -> bool:
        return self.acc.state.deepspeed_plugin is not None

    @property
    def out(self) -> Path:
        return Path(self.cfg.train.output_dir)

    @property
    def ckroot(self) -> Path:
        return self.out / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"


def setup(cfg: Config) -> Run:
    """Everything a run needs, checked before the first step and restored from the last checkpoint.

    The last checkpoint is looked up before anything is written, so that another run's
    output directory is refused untouched; the logs are then cut back to its step.
    """
    from accelerate.utils import set_seed

    from elasticmem.data.schema import load_split

    t = cfg.train
    acc = _accelerator(cfg)
    rank, world = acc.process_index, acc.num_processes
    out = Path(t.output_dir)
    last = resumable_checkpoint(cfg, out / "checkpoints")  # before anything is written: refuses a different run
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    set_seed(cfg.seed + rank)  # different processes sample differently; resume restores each process's RNG
    model, bank, mem_cfg = _build_model(cfg, acc)
    examples = load_split(cfg.data.dir, t.split)
    reward_fn, evidence = _check_run(cfg, examples, bank, mem_cfg)
    sampler = QuerySampler(len(examples), t.batch_size, world, rank, cfg.seed)
    total = t.max_steps or max(1, math.floor(t.epochs * len(examples) / (t.batch_size * world)))
    optimizer = _optimizer(model, cfg)
    scheduler = _scheduler(optimizer, total * t.num_iterations, cfg)
    wrapped, optimizer = acc.prepare(model, optimizer)
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    state = {"step": 0, "optimizer_steps": 0, "skipped_steps": 0, "sampler": sampler.state()}
    run = Run(cfg, acc, wrapped, acc.unwrap_model(wrapped), optimizer, scheduler, sampler, examples, evidence,
              reward_fn, trainable, total, state)
    _restore(run, last)
    if run.main:
        truncate_jsonl(run.metrics_path, run.state["step"])
        truncate_jsonl(out / "rollouts.jsonl", run.state["step"])
        if t.trackers:
            from elasticmem.grpo.trackers import tracker_init_kwargs

            acc.init_trackers("elasticmem", init_kwargs=tracker_init_kwargs(cfg))
    return run


def _build_model(cfg: Config, acc) -> tuple[torch.nn.Module, Any, Any]:
    """The trained system on the frozen backbone, with its bank; and its memory config
    (``cfg.memory``: ``memory.top_z=0`` trains the no-memory control)."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, build_index
    from elasticmem.model.elasticmem import ElasticMem

    t = cfg.train
    backbone = load_backbone(cfg.backbone, device=acc.device)
    bank = Bank.open(cfg.bank.dir, expect_fingerprint=backbone.fingerprint, expect_kv=cfg.kv_scheme_read)
    mem_cfg = cfg.memory
    index = build_index(bank, cfg.bank.index, cfg.seed, backbone.device.index or 0, device=backbone.device)
    if t.system == "memgen":
        from elasticmem.baselines.memgen import MemGen

        model = MemGen(backbone, mem_cfg, cfg.memgen, bank, index)
    else:
        model = ElasticMem(backbone, mem_cfg, bank, index)
    if t.gradient_checkpointing:
        plugin = acc.state.deepspeed_plugin
        model.enable_activation_checkpointing(reentrant=plugin is not None and plugin.zero_stage == 3)
    return model, bank, mem_cfg


def _check_run(cfg: Config, examples: list[Example], bank, mem_cfg) -> tuple[Callable, dict[str, set[int]]]:
    """Refuse now everything that would otherwise fail at some batch hours in (the evaluation
    split too); return the reward function and the bank rows holding each query's evidence."""
    from elasticmem.data.validate import validate_examples
    from elasticmem.eval.retrieval import evidence_rows

    t = cfg.train
    for split, exs in [(t.split, examples)] + ([(t.eval_split, eval_examples(cfg))] if t.eval_split else []):
        validate_examples(exs, bank, reward=t.reward, chunking=cfg.chunking, top_z=mem_cfg.top_z,
                          split_name=f"{cfg.data.dir}/{split}.jsonl")
    reward_fn = get_reward(t.reward)
    if t.loss.retrieval_weight > 0 and (mem_cfg.retrieval not in ("control", "query_only") or t.system != "elasticmem"):
        raise ConfigError(f"train.loss.retrieval_weight > 0 trains ElasticMem's query state: it needs "
                          f"train.system=elasticmem and memory.retrieval control or query_only, not "
                          f"{t.system} with {mem_cfg.retrieval!r}")
    if t.system != "elasticmem" and (t.replay_rollouts or t.loss.kl_beta > 0):
        raise ConfigError("train.replay_rollouts and train.loss.kl_beta (a KL to the adapter-disabled reasoner) are "
                          "ElasticMem's; MemGen's reasoner is frozen already and its rollouts are not replayable")
    # bank rows holding each query's evidence (datasets that record it): logged recall, auxiliary loss
    # (MemGen's Z slots are its trigger's decisions, not retrieved memories: nothing to compare)
    evidence = {ex.id: evidence_rows(ex, bank) for ex in examples} if mem_cfg.top_z > 0 and t.system != "memgen" else {}
    if t.loss.retrieval_weight > 0 and not any(evidence.values()):
        raise ConfigError(f"train.loss.retrieval_weight > 0 needs examples with evidence; "
                          f"{cfg.data.dir}/{t.split}.jsonl records none (extra.evidence)")
    return reward_fn, evidence


def _restore(run: Run, last: Path | None) -> None:
    """Resume from ``last`` (weights, optimizer, schedule, counters, sampler position, each
    process's RNG), else start from ``train.init_from``'s weights, else leave the fresh run."""
    t, acc, core = run.cfg.train, run.acc, run.core
    if last is not None:
        with gathered(acc, run.trainable, modifier_rank=0):
            core.load_weights(last)
        run.state = ckpt.read_trainer_state(last, run.optimizer, run.scheduler)
        if run.deepspeed:
            ckpt.load_sharded_optimizer(last, acc.process_index, acc.num_processes, run.model.optimizer)
        ckpt.load_rng(last, acc.process_index)
        run.sampler.epoch, run.sampler.offset = run.state["sampler"]["epoch"], run.state["sampler"]["offset"]
        if run.main:
            print(f"[train] resumed from {last} (step {run.state['step']})", file=sys.stderr)
    elif t.init_from:
        check_init(t.init_from, core)
        with gathered(acc, run.trainable, modifier_rank=0):
            core.load_weights(t.init_from)
        if run.main:
            print(f"[train] initialised from {t.init_from}", file=sys.stderr)


def eval_examples(cfg: Config) -> list[Example]:
    """The evaluation split, cut to ``train.eval_limit`` examples when that is set."""
    from elasticmem.data.schema import load_split

    ex = load_split(cfg.data.dir, cfg.train.eval_split)
    return ex[: cfg.train.eval_limit] if cfg.train.eval_limit else ex
