"""The GRPO training loop: one function, ``train(cfg)``.

Per rollout step: each process draws its own B queries and samples G
trajectories per query (rollout, eval mode, no gradients) -> rewards ->
group-relative advantages -> for each of ``num_iterations`` optimizer steps,
score the trajectories in micro-batches (train mode, gradients) and
accumulate the loss -> agree on finiteness -> clip -> AdamW -> cosine
schedule -> log -> checkpoint.

Dropout (LoRA, policy, projector) is off while sampling, so actions come from
the deterministic policy network, and on while scoring. Each micro-batch keeps
one dropout mask for the whole rollout step (its scoring passes run under one
seed), and the old log-probs are the detached log-probs of its first scoring
pass: the ratio is exactly 1 at the first inner iteration and later moves only
because the parameters moved, never because the dropout draw changed.

Distributed: ``accelerate launch`` (DDP, DeepSpeed); a group never spans
processes; the loss uses global normalisers. Under DDP every micro-batch's
backward runs without gradient synchronisation; the processes then agree that
every loss was finite before the one collective that sums the gradients, so a
non-finite loss on one process skips the step on all of them and never leaves
them in different collectives.

Run with::

    python train.py --config configs/tiny.yaml
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from elasticmem.config import Config
from elasticmem.data.schema import Example
from elasticmem.grpo.loss import (
    Normalizer,
    PartLogProbs,
    PartMasks,
    elasticmem_loss,
    group_advantages,
    retrieval_loss,
    uniform_groups,
)
from elasticmem.data.rewards import get_reward
from elasticmem.training.runtime import (
    RetrievalTargets,
    StopFlag,
    append_jsonl,
    check_init,
    greedy_eval,
    resumable_checkpoint,
    truncate_jsonl,
)
from elasticmem.utils import checkpointing as ckpt
from elasticmem.utils.configuration import ConfigError
from elasticmem.utils.configuration import save as save_config
from elasticmem.utils.distributed import full_parameters, gathered, process_group_kwargs

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


# --------------------------------------------------------------------------- setup


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


# --------------------------------------------------------------------------- evaluation


# --------------------------------------------------------------------------- resuming

# --------------------------------------------------------------------------- the loop


def train(cfg: Config) -> dict[str, Any]:
    """Run GRPO training as configured; returns the final metrics (and evaluation, if any)."""
    from accelerate.utils import set_seed

    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, build_index
    from elasticmem.data.schema import load_split
    from elasticmem.data.validate import validate_examples
    from elasticmem.eval.retrieval import evidence_rows
    from elasticmem.model.card import write_run_card
    from elasticmem.model.elasticmem import ElasticMem

    t = cfg.train
    acc = _accelerator(cfg)
    rank, world, main = acc.process_index, acc.num_processes, acc.is_main_process
    out = Path(t.output_dir)
    ckroot = out / "checkpoints"
    last = resumable_checkpoint(cfg, ckroot)  # before anything is written: refuses a different run
    if main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    set_seed(cfg.seed + rank)  # different processes sample differently; resume restores each process's RNG

    backbone = load_backbone(cfg.model, device=acc.device)
    bank = Bank.open(cfg.bank.dir, expect_fingerprint=backbone.fingerprint)
    mem_cfg = cfg.memory if t.use_memory else dataclasses.replace(cfg.memory, top_z=0)
    index = build_index(bank, cfg.bank.index, cfg.seed, backbone.device.index or 0, device=backbone.device)
    if t.system == "memgen":
        from elasticmem.baselines.memgen import MemGen

        model = MemGen(backbone, mem_cfg, cfg.memgen, bank, index)
    else:
        model = ElasticMem(backbone, mem_cfg, bank, index)
    if t.gradient_checkpointing:
        plugin = acc.state.deepspeed_plugin
        model.enable_activation_checkpointing(reentrant=plugin is not None and plugin.zero_stage == 3)
    examples = load_split(cfg.data.dir, t.split)
    # everything that would otherwise fail at some batch hours in (the evaluation split too)
    for split, exs in [(t.split, examples)] + ([(t.eval_split, _eval_examples(cfg))] if t.eval_split else []):
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
    sampler = QuerySampler(len(examples), t.batch_size, world, rank, cfg.seed)
    total = t.max_steps or max(1, math.floor(t.epochs * len(examples) / (t.batch_size * world)))
    optimizer = _optimizer(model, cfg)
    scheduler = _scheduler(optimizer, total * t.num_iterations, cfg)
    model, optimizer = acc.prepare(model, optimizer)
    deepspeed = acc.state.deepspeed_plugin is not None
    trainable = [p for p in model.parameters() if p.requires_grad]  # what checkpoints hold
    core = acc.unwrap_model(model)

    state: dict[str, Any] = {"step": 0, "optimizer_steps": 0, "skipped_steps": 0, "sampler": sampler.state()}
    if last is not None:
        with gathered(acc, trainable, modifier_rank=0):
            core.load_weights(last)
        state = ckpt.read_trainer_state(last, optimizer, scheduler)
        if deepspeed:
            ckpt.load_sharded_optimizer(last, rank, world, model.optimizer)
        ckpt.load_rng(last, rank)
        sampler.epoch, sampler.offset = state["sampler"]["epoch"], state["sampler"]["offset"]
        if main:
            print(f"[train] resumed from {last} (step {state['step']})", file=sys.stderr)
    elif t.init_from:
        check_init(t.init_from, core)
        with gathered(acc, trainable, modifier_rank=0):
            core.load_weights(t.init_from)
        if main:
            print(f"[train] initialised from {t.init_from}", file=sys.stderr)
    metrics_path = out / "metrics.jsonl"
    if main:
        truncate_jsonl(metrics_path, state["step"])
        truncate_jsonl(out / "rollouts.jsonl", state["step"])
        if t.trackers:
            from elasticmem.grpo.trackers import tracker_init_kwargs

            acc.init_trackers("elasticmem", init_kwargs=tracker_init_kwargs(cfg))

    def save_checkpoint() -> None:
        tmp = ckpt.tmp_dir(ckroot, state["step"])
        if main:
            ckroot.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
        with gathered(acc, trainable):
            if main:
                core.save_pretrained(tmp)
        if main:
            save_config(cfg, tmp / "config.yaml")
            final = ckpt.step_dir(ckroot, state["step"])  # where tmp is renamed to: the card names it
            write_run_card(tmp, cfg, state["step"], metrics_path, load_path=final, config_path=final / "config.yaml")
            ckpt.write_trainer_state(tmp, optimizer, scheduler, {**state, "sampler": sampler.state()},
                                     with_optimizer=not deepspeed)
        acc.wait_for_everyone()
        ckpt.save_rng(tmp, rank)
        if deepspeed:
            ckpt.save_sharded_optimizer(tmp, rank, model.optimizer)
        acc.wait_for_everyone()
        if main:
            ckpt.finalize(ckroot, state["step"], t.keep_last)
        acc.wait_for_everyone()

    first_step = state["step"]
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=state["step"], desc="GRPO", unit="step", disable=not main, file=sys.stderr,
               dynamic_ncols=True)
    history: list[dict[str, Any]] = []
    with StopFlag() as stop:
        while state["step"] < total:
            step = state["step"] + 1
            t0 = time.perf_counter()
            # ---- rollout
            idx = sampler.next()
            batch = [examples[i] for i in idx]
            model.eval()
            if t.replay_rollouts:
                traj = _load_rollout(Path(t.replay_rollouts), step, rank, world, batch)
            else:
                with full_parameters(acc, model):
                    traj = core.sample(batch, t.group_size, t.temperature)
            if t.record_rollouts:
                _save_rollout(Path(t.record_rollouts), step, rank, traj)
            rewards = torch.tensor([reward_fn(a, batch[q]) for a, q in zip(traj.answers, traj.query_index.tolist())])
            shaped = _token_cost(rewards, traj.memory_tokens, t.memory_token_cost)
            t1 = time.perf_counter()
            # ---- advantages and normalisers
            G = t.group_size
            adv = group_advantages(shaped.view(-1, G), t.loss).view(-1)
            keep = ~uniform_groups(shaped.view(-1, G)).repeat_interleave(G) if t.loss.skip_uniform_groups else None
            masks = PartMasks.of(traj)
            norm = Normalizer.from_masks(masks, core.cfg.max_new_tokens, keep,
                                         with_control=core.cfg.retrieval == "control")
            norm = _reduce_normalizer(norm, acc)
            aux = RetrievalTargets(core.bank, traj, evidence, acc) if t.loss.retrieval_weight > 0 else None
            ref = None
            if t.loss.kl_beta > 0:
                with full_parameters(acc, model):
                    ref = _reference_logps(core, traj)
            # ---- optimisation
            model.train()
            micro = [list(range(i, min(i + t.micro_batch_size, len(traj))))
                     for i in range(0, len(traj), t.micro_batch_size)]
            # one dropout mask per micro-batch for the whole step (see the module docstring)
            seeds = torch.randint(0, 2**62, (len(micro),)).tolist()
            old: list[PartLogProbs] = []
            losses = LossLog(t.num_iterations)
            t_score = t_back = 0.0
            for it in range(t.num_iterations):
                local_ok = True
                for mi, ids in enumerate(micro):
                    sub, sel = traj.select(ids), torch.as_tensor(ids)
                    # DDP: no gradient collective inside the loop (gradients are summed below,
                    # once every process knows the others' losses were finite)
                    sync = acc.no_sync(model) if not deepspeed else contextlib.nullcontext()
                    with sync:
                        ts = time.perf_counter()
                        with same_dropout(seeds[mi], acc.device), acc.autocast():
                            o = model(sub)
                        new = PartLogProbs.of(o)
                        if it == 0:
                            old.append(PartLogProbs(new.control.detach(), new.budget.detach(), new.answer.detach()))
                        dev = new.control.device
                        loss, m = elasticmem_loss(
                            new, old[mi], adv[sel].to(dev), _to(masks.select(sel), dev), t.loss, norm,
                            ref=None if ref is None else _to(ref.select(sel), dev),
                            keep=None if keep is None else keep[sel].to(dev),
                        )
                        if aux is not None:
                            r_loss, r_m = retrieval_loss(o.query_state, *aux.select(ids, dev),
                                                         t.loss.retrieval_temperature, aux.count)
                            loss = loss + t.loss.retrieval_weight * r_loss
                            m.update(r_m)
                        tb = time.perf_counter()
                        local_ok &= bool(torch.isfinite(loss))
                        if deepspeed:
                            # DeepSpeed owns accumulation: the last micro-batch is the boundary
                            # where it reduces gradients (an average over processes, hence
                            # * world). The loss is already normalised over the whole batch,
                            # hence no 1/accumulation scaling; a non-finite gradient makes
                            # DeepSpeed skip its step (checked below).
                            model.set_gradient_accumulation_boundary(mi == len(micro) - 1)
                            model.backward(loss * world, scale_wrt_gas=False)
                        elif local_ok:
                            acc.backward(loss)
                        t_score += tb - ts
                        t_back += time.perf_counter() - tb
                    losses.add(loss, m)
                if deepspeed:
                    skipped_before = model.skipped_steps
                    model.step()  # clips, steps (or skips on a non-finite gradient), zeroes gradients
                    grad_norm = float(model.get_global_grad_norm() or 0.0)
                    stepped = model.skipped_steps == skipped_before
                else:
                    stepped = _all_finite(local_ok, acc)
                    grad_norm = float("nan")
                    if stepped:
                        _sum_gradients(trainable, acc)
                        # the same summed gradients on every process: they all agree on this too
                        grad_norm = _grad_norm(trainable, acc, t.max_grad_norm)
                        stepped = math.isfinite(grad_norm)
                    if stepped:
                        optimizer.step()
                if stepped:
                    scheduler.step()
                    state["optimizer_steps"] += 1
                else:
                    state["skipped_steps"] += 1
                    if main:
                        print(f"[train] step {step}: non-finite loss or gradient, update skipped "
                              f"({state['skipped_steps']} so far)", file=sys.stderr)
                optimizer.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            state["step"] = step
            state["sampler"] = sampler.state()
            # ---- log
            if step % t.log_every == 0 or step == total:
                row = _step_metrics(step, traj, rewards, losses.reduce(acc), acc, core, grad_norm, scheduler, state,
                                    evidence,
                                    {"rollout": t1 - t0, "score": t_score, "backward": t_back, "total": t2 - t0},
                                    t.memory_token_cost)
                if main:
                    append_jsonl(metrics_path, row)
                    append_jsonl(out / "rollouts.jsonl", *_sample_rollouts(step, traj, batch, rewards, core, t))
                    if t.trackers:
                        acc.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
                    bar.set_postfix(reward=f"{row['reward/mean']:.3f}", loss=f"{row['loss']:.4f}")
                history.append(row)
            bar.update(1)
            if t.eval_every and step % t.eval_every == 0 and t.eval_split:
                with full_parameters(acc, model):
                    ev = greedy_eval(core, _eval_examples(cfg), reward_fn, t.eval_batch_size, acc)
                if main:
                    append_jsonl(metrics_path, {"step": step, "eval": ev})
            stop_now = bool(acc.reduce(torch.tensor(float(stop.set), device=acc.device), reduction="sum") > 0)
            stop_now |= t.stop_after_steps > 0 and step - first_step >= t.stop_after_steps and step < total
            if (t.save_every and step % t.save_every == 0) or step == total or stop_now:
                save_checkpoint()
            if stop_now:
                bar.close()
                return {"stopped_at": step, "history": history}
    bar.close()
    result: dict[str, Any] = {"steps": state["step"], "skipped_steps": state["skipped_steps"], "history": history}
    with gathered(acc, trainable):
        if main:
            core.save_pretrained(out / "final")
            write_run_card(out / "final", cfg, state["step"], metrics_path, config_path=out / "config.yaml")
    if t.eval_split:
        with full_parameters(acc, model):
            ev = greedy_eval(core, _eval_examples(cfg), reward_fn, t.eval_batch_size, acc)
        result["eval"] = ev
        if main:
            (out / f"eval_{t.eval_split}.json").write_text(json.dumps(ev, indent=1))
    acc.wait_for_everyone()
    # always: it also destroys the process group, whose threads otherwise can abort a rank at exit
    # ("terminate called without an active exception", about 1 launch in 6 on 2 CPU processes)
    acc.end_training()
    return result


# --------------------------------------------------------------------------- helpers of the loop


def _eval_examples(cfg: Config) -> list[Example]:
    from elasticmem.data.schema import load_split

    ex = load_split(cfg.data.dir, cfg.train.eval_split)
    return ex[: cfg.train.eval_limit] if cfg.train.eval_limit else ex


def _to(parts, dev):
    """A PartMasks / PartLogProbs with every tensor moved to ``dev``."""
    return type(parts)(*(None if v is None else v.to(dev) for v in vars(parts).values()))


@torch.no_grad()
def _reference_logps(core, traj) -> PartLogProbs:
    """Log-probs of the adapter-disabled model (for the optional k3 KL term)."""
    with core.lm.disable_adapter():
        o = core.score(traj)
    return PartLogProbs(o.logp_control.cpu(), o.logp_budget.cpu(), o.logp_answer.cpu(), None)


def _reduce_normalizer(norm: Normalizer, acc) -> Normalizer:
    """Counts of the whole optimizer batch over all processes."""
    if acc.num_processes == 1:
        return norm
    counts = torch.tensor([norm.num_trajectories, norm.lm_units, norm.budget_units], device=acc.device)
    parts = acc.gather(counts).reshape(acc.num_processes, 3).tolist()
    return Normalizer.combine([dataclasses.replace(norm, num_trajectories=a, lm_units=b, budget_units=c)
                               for a, b, c in parts])


@contextlib.contextmanager
def same_dropout(seed: int, device: torch.device):
    """Run the block with the torch RNG seeded by ``seed`` and restore the RNG afterwards.

    Every scoring pass of one micro-batch runs under its step's seed, so all its passes
    draw the same dropout masks (the ratio reflects parameter updates only) while the
    rollout RNG stream is left as it was.
    """
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _all_finite(local_ok: bool, acc) -> bool:
    """True on every process when every process's losses were finite (one collective)."""
    if acc.num_processes == 1:
        return local_ok
    ok = torch.tensor(float(local_ok), device=acc.device)
    return bool(acc.reduce(ok, reduction="sum") == acc.num_processes)


def _sum_gradients(params: Sequence[torch.nn.Parameter], acc) -> None:
    """Sum the gradients of ``params`` over processes, in one flat all-reduce.

    Written out instead of DDP's bucketed hooks so that no gradient collective starts
    before the processes agree to step; the trainable parameters are LoRA, policy and
    projector, small enough that losing the overlap with backward costs little. A
    parameter without a gradient here (e.g. the projector when every budget was 0)
    contributes zeros, as it may have one on another process.
    """
    if acc.num_processes == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = acc.reduce(torch.cat([g.reshape(-1) for g in grads]), reduction="sum")
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p).clone()


def _grad_norm(params: Sequence[torch.nn.Parameter], acc, max_norm: float) -> float:
    """Global gradient norm before clipping (and clip to ``max_norm`` when > 0)."""
    if max_norm > 0:
        return float(acc.clip_grad_norm_(params, max_norm))
    grads = [p.grad.detach().norm() for p in params if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


class LossLog:
    """Loss metrics of one rollout step, over micro-batches, processes and inner iterations.

    ``elasticmem_loss`` returns, per micro-batch, additive values (the normalised loss terms
    ``loss``, ``loss/lm``, ``loss/budget`` and the unit counts ``units/*``: they add up to
    the full batch's) and unit means (``objective/*``, ``clip_frac/*``, ``ratio/*``,
    ``entropy/budget``, ``kl``). Additive values are summed, means are weighted by their
    units (budget units for ``*/budget``, LM units otherwise); both are summed over
    processes and averaged over the inner iterations.
    """

    ADDITIVE = ("loss", "loss/lm", "loss/budget", "loss/retrieval", "units/lm", "units/budget", "units/retrieval")

    def __init__(self, num_iterations: int) -> None:
        self.n = num_iterations
        self.sums: Counter = Counter()

    @staticmethod
    def _units_key(key: str) -> str:
        return "units/budget" if key.endswith("/budget") else "units/lm"

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        values["loss"] = float(loss.detach())
        for k, v in values.items():
            weight = 1.0 if k in self.ADDITIVE else values[self._units_key(k)]
            self.sums[k] += v * weight / self.n

    def reduce(self, acc) -> dict[str, float]:
        """The step's metrics (a collective when there are several processes)."""
        keys = sorted(self.sums)
        vals = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64)
        if acc.num_processes > 1:
            vals = acc.reduce(vals.to(acc.device), reduction="sum").cpu()
        tot = dict(zip(keys, vals.tolist()))
        return {k: v if k in self.ADDITIVE else v / max(tot[self._units_key(k)], 1.0) for k, v in tot.items()}


def _step_metrics(step, traj, rewards, m, acc, core, grad_norm, scheduler, state, evidence, times,
                  token_cost: float = 0.0) -> dict[str, Any]:
    """Per-step metrics, reduced over processes (per-trajectory values are gathered)."""
    dev = acc.device
    ev = _evidence_stats(traj, evidence)  # [N, 6]
    per_traj = torch.cat([torch.stack([rewards.float(), traj.memory_tokens.float(), traj.num_tokens.float()], 1),
                          ev], 1).to(dev)
    allv = acc.gather(per_traj).cpu() if acc.num_processes > 1 else per_traj.cpu()
    bmax = core.budget_levels
    hist = torch.bincount(traj.budgets[traj.mask].clamp(0, bmax), minlength=bmax + 1).to(dev)
    if acc.num_processes > 1:
        hist = acc.reduce(hist, reduction="sum")
    r = allv[:, 0]
    row = {
        "step": step,
        "reward/mean": float(r.mean()),
        "reward/std": float(r.std()) if len(r) > 1 else 0.0,
        "accuracy": float((r > 0.5).float().mean()),
        "loss": float(m.get("loss", 0.0)),
        **{k: float(v) for k, v in sorted(m.items()) if k != "loss"},
        "grad_norm": grad_norm,
        "lr": float(scheduler.get_last_lr()[0]),
        "budget/mean_B_mem": float(allv[:, 1].mean()),
        "budget/histogram": hist.cpu().tolist(),
        "tokens/per_trajectory": float(allv[:, 2].mean()),
        **_evidence_metrics(allv[:, 3:], traj.rows.shape[1]),
        **({"reward/shaped": float(_token_cost(r, allv[:, 1], token_cost).mean())} if token_cost else {}),
        "skipped_steps": state["skipped_steps"],
        "processes": acc.num_processes,
        "distributed_type": str(acc.distributed_type.value),
        **{f"time/{k}": v for k, v in times.items()},
    }
    return row


def _token_cost(rewards: torch.Tensor, memory_tokens: torch.Tensor, cost: float) -> torch.Tensor:
    """Rewards [N] minus ``cost`` per injected soft token where the reward is positive.

    Only rewarded trajectories pay: while no answer is right yet, memory is not made to look
    worse than none (which would teach the policy to drop everything before the reasoner has
    learned to read); once answers are right, the same answer with fewer tokens is better.
    """
    if not cost:
        return rewards
    return rewards - cost * memory_tokens.to(rewards) * (rewards > 0)


def _evidence_stats(traj, evidence: dict[str, set[int]]) -> torch.Tensor:
    """Per trajectory [N, 6]: has evidence, evidence retrieved (any, in the top Z), budget given to
    evidence memories, evidence memories retrieved, budget given to the other memories, other
    memories retrieved."""
    out = torch.zeros(len(traj), 6)
    for i, ex_id in enumerate(traj.example_ids):
        ev = evidence.get(ex_id)
        if not ev:
            continue
        rows, present = traj.rows[i], traj.mask[i].bool()
        is_ev = torch.tensor([int(r) in ev for r in rows.tolist()], dtype=torch.bool) & present
        b = traj.budgets[i].float()
        other = present & ~is_ev
        out[i] = torch.tensor([1.0, float(is_ev.any()), float(b[is_ev].sum()), float(is_ev.sum()),
                               float(b[other].sum()), float(other.sum())])
    return out


def _evidence_metrics(stats: torch.Tensor, z: int) -> dict[str, float]:
    """``retrieval/recall@Z`` (any evidence chunk among the retrieved) and the mean budget of
    evidence and other retrieved memories, over trajectories whose query has evidence."""
    has = stats[:, 0] > 0
    if not bool(has.any()) or z == 0:
        return {}
    s = stats[has]
    return {f"retrieval/recall@{z}": float(s[:, 1].mean()),
            "budget/evidence": float(s[:, 2].sum() / s[:, 3].sum().clamp(min=1)),
            "budget/other": float(s[:, 4].sum() / s[:, 5].sum().clamp(min=1))}


def _sample_rollouts(step, traj, batch, rewards, core, t) -> list[dict[str, Any]]:
    out = []
    for i in range(min(t.log_rollouts, len(traj))):
        ex = batch[int(traj.query_index[i])]
        out.append({
            "step": step, "id": ex.id, "question": ex.question, "gold": ex.answer_letter,
            "answer": traj.answers[i], "reward": float(rewards[i]),
            "control": core.tokenizer.decode([int(traj.control[i])]) if traj.control[i] >= 0 else None,
            "rows": traj.rows[i].tolist(), "budgets": traj.budgets[i].tolist(),
        })
    return out


def _save_rollout(root: Path, step: int, rank: int, traj) -> None:
    """Record one process's rollout batch (tensors as safetensors, the rest as JSON)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    items = vars(traj).items()
    save_file({k: v.contiguous() for k, v in items if isinstance(v, torch.Tensor)},
              root / f"step{step:06d}_rank{rank}.safetensors")
    (root / f"step{step:06d}_rank{rank}.json").write_text(
        json.dumps({k: v for k, v in items if not isinstance(v, torch.Tensor)}))


def _load_rollout(root: Path, step: int, rank: int, world: int, batch: Sequence[Example]):
    """This process's share of a recorded rollout batch, whatever the number of processes that recorded it.

    The recorded files of the step are joined in process order; queries are then dealt
    out in the same global order the sampler uses, so ``world`` processes with batch B
    replay what one process with batch ``world * B`` recorded (and vice versa).
    """
    from safetensors.torch import load_file

    from elasticmem.model.elasticmem import Trajectories

    files = sorted(root.glob(f"step{step:06d}_rank*.safetensors"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    if not files:
        raise FileNotFoundError(f"no recorded rollout for step {step} in {root}")
    parts = [Trajectories(**load_file(str(p)), **json.loads(p.with_suffix(".json").read_text())) for p in files]
    allt = Trajectories.concat(parts)
    B = len(batch)
    ids = (allt.query_index >= rank * B) & (allt.query_index < (rank + 1) * B)
    mine = allt.select(ids.nonzero().reshape(-1))
    mine.query_index = mine.query_index - rank * B
    got = [mine.example_ids[i] for i in range(0, len(mine), max(1, len(mine) // B))]
    if got != [ex.id for ex in batch]:
        raise ValueError(f"recorded rollout of step {step} is for other queries ({got[:2]}...) than "
                         f"this run draws ({[ex.id for ex in batch][:2]}...): seed or batch size differ")
    return mine
