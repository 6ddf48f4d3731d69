"""The GRPO training loop, ``train(cfg)``: ``setup`` (``grpo/run.py``), then per step
``rollout``, ``optimise``, ``log_step``, ``evaluate`` and ``save_checkpoint``.

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
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elasticmem.config import Config
from elasticmem.data.schema import Example
from elasticmem.grpo.collectives import all_finite, grad_norm, reduce_normalizer, sum_gradients
from elasticmem.grpo.loss import (
    Normalizer,
    PartLogProbs,
    PartMasks,
    elasticmem_loss,
    group_advantages,
    retrieval_loss,
    uniform_groups,
)
from elasticmem.grpo.metrics import LossLog, step_metrics
from elasticmem.grpo.rollouts import load_rollout, sample_rollouts, save_rollout, token_cost
from elasticmem.grpo.run import Run, eval_examples, setup
from elasticmem.grpo.trackers import close_trackers
from elasticmem.training.runtime import RetrievalTargets, StopFlag, append_jsonl, greedy_eval
from elasticmem.utils import checkpointing as ckpt
from elasticmem.utils.configuration import save as save_config
from elasticmem.utils.distributed import full_parameters, gathered


# --------------------------------------------------------------------------- rollout


@dataclass
class Rollout:
    """One process's rollout batch: B queries and G trajectories each (N = B * G)."""

    batch: list[Example]
    traj: Any  # Trajectories [N]
    rewards: torch.Tensor  # [N] task rewards
    shaped: torch.Tensor  # [N] rewards less the memory token cost: what the advantages see


def rollout(run: Run, step: int) -> Rollout:
    """Draw this process's queries and sample (or replay) their trajectories: eval mode, no gradients."""
    t, acc = run.cfg.train, run.acc
    batch = [run.examples[i] for i in run.sampler.next()]
    run.model.eval()
    if t.replay_rollouts:
        traj = load_rollout(Path(t.replay_rollouts), step, acc.process_index, acc.num_processes, batch)
    else:
        with full_parameters(acc, run.model):
            traj = run.core.sample(batch, t.group_size, t.temperature)
    if t.record_rollouts:
        save_rollout(Path(t.record_rollouts), step, acc.process_index, traj)
    rewards = torch.tensor([run.reward_fn(a, batch[q]) for a, q in zip(traj.answers, traj.query_index.tolist())])
    return Rollout(batch, traj, rewards, token_cost(rewards, traj.memory_tokens, t.memory_token_cost))


# --------------------------------------------------------------------------- optimisation


@dataclass
class LossInputs:
    """What every scoring pass of one rollout step shares (N trajectories)."""

    adv: torch.Tensor  # [N] group-relative advantages
    keep: torch.Tensor | None  # [N] bool, False in uniform groups (train.loss.skip_uniform_groups), or None
    masks: PartMasks
    norm: Normalizer  # counts of the whole optimizer batch, over processes
    aux: RetrievalTargets | None  # the retrieval loss's evidence targets (train.loss.retrieval_weight > 0)
    ref: PartLogProbs | None  # the adapter-disabled model's log-probs (train.loss.kl_beta > 0)


def loss_inputs(run: Run, ro: Rollout) -> LossInputs:
    """Advantages, masks and normalisers of the rollout batch (collectives on several processes)."""
    t, core = run.cfg.train, run.core
    G = t.group_size
    adv = group_advantages(ro.shaped.view(-1, G), t.loss).view(-1)
    keep = ~uniform_groups(ro.shaped.view(-1, G)).repeat_interleave(G) if t.loss.skip_uniform_groups else None
    masks = PartMasks.of(ro.traj)
    norm = Normalizer.from_masks(masks, core.cfg.max_new_tokens, keep, with_control=core.cfg.retrieval == "control")
    norm = reduce_normalizer(norm, run.acc)
    aux = RetrievalTargets(core.bank, ro.traj, run.evidence, run.acc) if t.loss.retrieval_weight > 0 else None
    ref = None
    if t.loss.kl_beta > 0:
        with full_parameters(run.acc, run.model):
            ref = _reference_logps(core, ro.traj)
    return LossInputs(adv, keep, masks, norm, aux, ref)


@dataclass
class Update:
    """What a rollout step's optimizer steps leave to log."""

    losses: LossLog
    grad_norm: float = float("nan")  # of the last inner iteration (nan: skipped before clipping)
    score_s: float = 0.0  # seconds in forward passes and losses
    backward_s: float = 0.0


def optimise(run: Run, ro: Rollout) -> Update:
    """``train.num_iterations`` optimizer steps on the rollout batch, scored in micro-batches (train mode)."""
    t, acc = run.cfg.train, run.acc
    inputs = loss_inputs(run, ro)
    run.model.train()
    n = len(ro.traj)
    micro = [list(range(i, min(i + t.micro_batch_size, n))) for i in range(0, n, t.micro_batch_size)]
    # one dropout mask per micro-batch for the whole step (see the module docstring)
    seeds = torch.randint(0, 2**62, (len(micro),)).tolist()
    old: list[PartLogProbs] = []
    upd = Update(LossLog(t.num_iterations))
    for it in range(t.num_iterations):
        local_ok = True
        for mi, ids in enumerate(micro):
            # DDP: no gradient collective inside the loop (gradients are summed in _optimizer_step,
            # once every process knows the others' losses were finite)
            with acc.no_sync(run.model) if not run.deepspeed else contextlib.nullcontext():
                ts = time.perf_counter()
                loss, m, first = _micro_batch_loss(run, ro.traj, inputs, ids, seeds[mi], old[mi] if it else None)
                if it == 0:
                    old.append(first)
                tb = time.perf_counter()
                local_ok &= bool(torch.isfinite(loss))
                _backward(run, loss, boundary=mi == len(micro) - 1, ok=local_ok)
                upd.score_s += tb - ts
                upd.backward_s += time.perf_counter() - tb
            upd.losses.add(loss, m)
        upd.grad_norm = _optimizer_step(run, local_ok)
    return upd


def _micro_batch_loss(run: Run, traj, inputs: LossInputs, ids: list[int], seed: int,
                      old: PartLogProbs | None) -> tuple[torch.Tensor, dict[str, torch.Tensor], PartLogProbs]:
    """Score the trajectories ``ids`` under their dropout ``seed``; their loss, its metrics and the
    old log-probs (``old``, or at the first pass this pass's own, detached: the ratio starts at 1)."""
    t, acc = run.cfg.train, run.acc
    sub, sel = traj.select(ids), torch.as_tensor(ids)
    with same_dropout(seed, acc.device), acc.autocast():
        o = run.model(sub)
    new = PartLogProbs.of(o)
    if old is None:
        old = PartLogProbs(new.control.detach(), new.budget.detach(), new.answer.detach())
    dev = new.control.device
    loss, m = elasticmem_loss(
        new, old, inputs.adv[sel].to(dev), _to(inputs.masks.select(sel), dev), t.loss, inputs.norm,
        ref=None if inputs.ref is None else _to(inputs.ref.select(sel), dev),
        keep=None if inputs.keep is None else inputs.keep[sel].to(dev),
    )
    if inputs.aux is not None:
        r_loss, r_m = retrieval_loss(o.query_state, *inputs.aux.select(ids, dev), t.loss.retrieval_temperature,
                                     inputs.aux.count)
        loss = loss + t.loss.retrieval_weight * r_loss
        m.update(r_m)
    return loss, m, old


def _backward(run: Run, loss: torch.Tensor, boundary: bool, ok: bool) -> None:
    """Accumulate ``loss``'s gradients; ``boundary``: the step's last micro-batch, ``ok``: every
    loss of this iteration on this process was finite so far."""
    if run.deepspeed:
        # DeepSpeed owns accumulation: the last micro-batch is the boundary where it reduces
        # gradients (an average over processes, hence * world). The loss is already normalised
        # over the whole batch, hence no 1/accumulation scaling; a non-finite gradient makes
        # DeepSpeed skip its step (checked in _optimizer_step).
        run.model.set_gradient_accumulation_boundary(boundary)
        run.model.backward(loss * run.acc.num_processes, scale_wrt_gas=False)
    elif ok:
        run.acc.backward(loss)


def _optimizer_step(run: Run, local_ok: bool) -> float:
    """Step (or skip, on every process, when any loss or the gradient is non-finite), advance the
    schedule and the counters; returns the gradient norm before clipping."""
    t, acc, model = run.cfg.train, run.acc, run.model
    if run.deepspeed:
        skipped_before = model.skipped_steps
        model.step()  # clips, steps (or skips on a non-finite gradient), zeroes gradients
        norm = float(model.get_global_grad_norm() or 0.0)
        stepped = model.skipped_steps == skipped_before
    else:
        stepped = all_finite(local_ok, acc)
        norm = float("nan")
        if stepped:
            sum_gradients(run.trainable, acc)
            # the same summed gradients on every process: they all agree on this too
            norm = grad_norm(run.trainable, acc, t.max_grad_norm)
            stepped = math.isfinite(norm)
        if stepped:
            run.optimizer.step()
    if stepped:
        run.scheduler.step()
        run.state["optimizer_steps"] += 1
    else:
        run.state["skipped_steps"] += 1
        if run.main:
            print(f"[train] step {run.state['step'] + 1}: non-finite loss or gradient, update skipped "
                  f"({run.state['skipped_steps']} so far)", file=sys.stderr)
    run.optimizer.zero_grad(set_to_none=True)
    return norm


# --------------------------------------------------------------------------- log, evaluate, save


def log_step(run: Run, step: int, ro: Rollout, upd: Update, times: dict[str, float], bar) -> dict[str, Any]:
    """The step's metrics row (a collective); the main process appends it and a sample of the
    rollouts to the logs, sends it to the trackers and shows it on the progress bar."""
    t = run.cfg.train
    row = step_metrics(step, ro.traj, ro.rewards, upd.losses.reduce(run.acc), run.acc, run.core, upd.grad_norm,
                       run.scheduler, run.state, run.evidence, times, t.memory_token_cost)
    if run.main:
        append_jsonl(run.metrics_path, row)
        append_jsonl(run.out / "rollouts.jsonl", *sample_rollouts(step, ro.traj, ro.batch, ro.rewards, run.core, t))
        if t.trackers:
            run.acc.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        bar.set_postfix(reward=f"{row['reward/mean']:.3f}", loss=f"{row['loss']:.4f}")
    return row


def evaluate(run: Run) -> dict[str, Any]:
    """Greedy evaluation on ``train.eval_split`` (every process takes part)."""
    t = run.cfg.train
    with full_parameters(run.acc, run.model):
        return greedy_eval(run.core, eval_examples(run.cfg), run.reward_fn, t.eval_batch_size, run.acc)


def _stop_now(run: Run, stop: StopFlag, step: int, first_step: int) -> bool:
    """Stop after this step: a signal on any process, or ``train.stop_after_steps`` done (a collective)."""
    t, acc = run.cfg.train, run.acc
    stop_now = bool(acc.reduce(torch.tensor(float(stop.set), device=acc.device), reduction="sum") > 0)
    return stop_now | (t.stop_after_steps > 0 and step - first_step >= t.stop_after_steps and step < run.total)


def save_checkpoint(run: Run) -> None:
    """Write the step's checkpoint into a temporary directory and rename it into place (every process)."""
    from elasticmem.model.card import write_run_card

    acc, main, step, ckroot = run.acc, run.main, run.state["step"], run.ckroot
    tmp = ckpt.tmp_dir(ckroot, step)
    if main:
        ckroot.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
    with gathered(acc, run.trainable):
        if main:
            run.core.save_pretrained(tmp)
    if main:
        save_config(run.cfg, tmp / "config.yaml")
        final = ckpt.step_dir(ckroot, step)  # where tmp is renamed to: the card names it
        write_run_card(tmp, run.cfg, step, run.metrics_path, load_path=final, config_path=final / "config.yaml")
        ckpt.write_trainer_state(tmp, run.optimizer, run.scheduler, {**run.state, "sampler": run.sampler.state()},
                                 with_optimizer=not run.deepspeed)
    acc.wait_for_everyone()
    ckpt.save_rng(tmp, acc.process_index)
    if run.deepspeed:
        ckpt.save_sharded_optimizer(tmp, acc.process_index, run.model.optimizer)
    acc.wait_for_everyone()
    if main:
        ckpt.finalize(ckroot, step, run.cfg.train.keep_last)
    acc.wait_for_everyone()


def finish(run: Run, history: list[dict[str, Any]]) -> dict[str, Any]:
    """Save the final weights and evaluate them; ends the accelerator (and its process group)."""
    from elasticmem.model.card import write_run_card

    t, out = run.cfg.train, run.out
    result: dict[str, Any] = {"steps": run.state["step"], "skipped_steps": run.state["skipped_steps"],
                              "history": history}
    with gathered(run.acc, run.trainable):
        if run.main:
            run.core.save_pretrained(out / "final")
            write_run_card(out / "final", run.cfg, run.state["step"], run.metrics_path, config_path=out / "config.yaml")
    if t.eval_split:
        ev = evaluate(run)
        result["eval"] = ev
        if run.main:
            (out / f"eval_{t.eval_split}.json").write_text(json.dumps(ev, indent=1))
    run.acc.wait_for_everyone()
    end(run)
    return result


def end(run: Run) -> None:
    """End the trackers (their files complete) and the process group: after the last step, or a stop."""
    # always: end_training also destroys the process group, whose threads otherwise can abort a rank
    # at exit ("terminate called without an active exception", about 1 launch in 6 on 2 CPU processes)
    run.acc.end_training()
    close_trackers(run.cfg.train.trackers)


# --------------------------------------------------------------------------- the loop


def train(cfg: Config) -> dict[str, Any]:
    """Run GRPO training as configured; returns the final metrics (and evaluation, if any)."""
    from tqdm.auto import tqdm

    t = cfg.train
    run = setup(cfg)
    first_step = run.state["step"]
    bar = tqdm(total=run.total, initial=first_step, desc="GRPO", unit="step", disable=not run.main,
               file=sys.stderr, dynamic_ncols=True)
    history: list[dict[str, Any]] = []
    with StopFlag() as stop:
        while run.state["step"] < run.total:
            step = run.state["step"] + 1
            t0 = time.perf_counter()
            ro = rollout(run, step)
            t1 = time.perf_counter()
            upd = optimise(run, ro)
            t2 = time.perf_counter()
            run.state["step"] = step
            run.state["sampler"] = run.sampler.state()
            if step % t.log_every == 0 or step == run.total:
                times = {"rollout": t1 - t0, "score": upd.score_s, "backward": upd.backward_s, "total": t2 - t0}
                history.append(log_step(run, step, ro, upd, times, bar))
            bar.update(1)
            if t.eval_every and step % t.eval_every == 0 and t.eval_split:
                ev = evaluate(run)
                if run.main:
                    append_jsonl(run.metrics_path, {"step": step, "eval": ev})
            stop_now = _stop_now(run, stop, step, first_step)
            if (t.save_every and step % t.save_every == 0) or step == run.total or stop_now:
                save_checkpoint(run)
            if stop_now:
                bar.close()
                end(run)
                return {"stopped_at": step, "history": history}
    bar.close()
    return finish(run, history)


# --------------------------------------------------------------------------- helpers of the loop


def _to(parts, dev):
    """A PartMasks / PartLogProbs with every tensor moved to ``dev``."""
    return type(parts)(*(None if v is None else v.to(dev) for v in vars(parts).values()))


@torch.no_grad()
def _reference_logps(core, traj) -> PartLogProbs:
    """Log-probs of the adapter-disabled model (for the optional k3 KL term).

    Looked up through this module at each step: tests wrap it to see what the loss gets."""
    with core.lm.disable_adapter():
        o = core.score(traj)
    return PartLogProbs(o.logp_control.cpu(), o.logp_budget.cpu(), o.logp_answer.cpu(), None)


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
