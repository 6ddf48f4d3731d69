"""Supervised reading warm-up before GRPO (``warmup.*``; a departure from the paper).

A small reasoner does not read its memories at initialisation: SmolLM2-135M-Instruct with the
gold evidence pasted in as text answers the synthetic persona questions no better than without
it, and almost always with the same letter. GRPO then sees few right answers and nothing that
separates reading from guessing. This stage teaches reading by teacher forcing: for each
training question, the model's own retrieval (plus the evidence chunks, where the data records
them: ``warmup.evidence``) gives memories, they are injected as in a rollout (soft tokens at
``warmup.budgets``, or text under ``memory.injection=text``), and the adapter and the
projector are trained on ``-log p("(b)" + end of turn)`` of the gold option. The budget policy
is not trained here (GRPO trains it); an optional auxiliary retrieval loss
(``warmup.retrieval_weight``) trains the query state. Two optional projector-only stages run
first: token alignment (``warmup.align_steps``: each cached state is mapped to its own token's
input embedding, no LM forward) and xRAG's reconstruction (``warmup.reconstruct_steps``).

With ``train.system=memgen`` the answer steps are the MemGen baseline's weaver SFT (the weaver's
latents placed as ``MemGen.teacher_forced`` places them, the weaver trained on the same target;
no projector stages), so that both systems get the same supervision before GRPO.

    elasticmem-warmup --config configs/quickstart.yaml [key=value ...]   # or: python -m elasticmem.warmup.reading
    python train.py --config configs/quickstart.yaml train.init_from=runs/warmup/quickstart/final

The run folder (``warmup.output_dir``) gets config.yaml, metrics.jsonl (one line per step:
loss, teacher-forced token accuracy, evidence recall of the retrieval before evidence is
added, learning rate) and final/ (a saved model: ``eval.checkpoint`` and ``train.init_from``
read it), written atomically; ``eval.json`` holds the greedy accuracy on ``warmup.eval_split``
with its 95 % interval. One process; a finished run (final/ present) is not repeated. An
interrupted one resumes: ``checkpoints/`` keeps the newest state (every ``warmup.save_every``
answer steps, at the end of the projector-only stages, and on Ctrl-C / SIGTERM), and the same
command continues from it, ending as the uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from elasticmem.config import Config, ConfigError
from elasticmem.data.schema import Example


def option_target(tokenizer, eos_ids: Sequence[int], example: Example, max_new_tokens: int,
                  target: str = "letter") -> list[int]:
    """Token ids of the gold answer as the reward parses it.

    'letter': "(b)" then the end-of-turn token, else "b" then it, whichever first fits in
    ``max_new_tokens``; else "b" cut to fit (no end). 'value_letter': "amber (b)" then the
    end-of-turn token; ValueError when that does not fit. 'answer': the example's
    ``answer_text`` (free-form answers, an expert's action) then the end-of-turn token;
    ValueError when that does not fit."""
    from elasticmem.data.rewards import mc_letter_reward

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos_ids[0]
    if target == "answer":
        if not example.answer_text:
            raise ValueError(f"warmup.target=answer: example {example.id} has no answer_text")
        ids = tokenizer(example.answer_text, add_special_tokens=False)["input_ids"]
        if len(ids) + 1 > max_new_tokens:
            raise ValueError(f"warmup.target=answer: {example.answer_text!r} takes {len(ids) + 1} tokens with the "
                             f"end of turn (example {example.id}); raise memory.max_new_tokens to at least that")
        return ids + [eos]
    letter = chr(ord("a") + example.answer_index)
    if target == "value_letter":
        text = f"{example.choices[example.answer_index]} ({letter})"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) + 1 > max_new_tokens or mc_letter_reward(tokenizer.decode(ids), example) != 1.0:
            raise ValueError(f"warmup.target=value_letter: {text!r} takes {len(ids) + 1} tokens with the end of "
                             f"turn (example {example.id}); raise memory.max_new_tokens to at least that")
        return ids + [eos]
    if target != "letter":
        raise ValueError(f"target must be 'letter', 'value_letter' or 'answer', got {target!r}")
    for text in (f"({letter})", letter):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) + 1 <= max_new_tokens and mc_letter_reward(tokenizer.decode(ids), example) == 1.0:
            return ids + [eos]
    return tokenizer(letter, add_special_tokens=False)["input_ids"][:max_new_tokens]


def lr_lambda(warmup_steps: int, total: int, min_ratio: float = 0.1):
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total`` steps."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def curriculum_z(start: int | None, top_z: int, step: int, steps: int) -> int:
    """Z at answer step ``step`` (1-based) of ``steps``: ``start`` growing linearly to ``top_z``."""
    if start is None or top_z == 0:
        return top_z
    start = min(start, top_z)
    return start + round((top_z - start) * (step - 1) / max(1, steps - 1))


def supervised_loss(logp_answer: torch.Tensor, answer_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the target tokens.

    ``logp_answer``: [N, T] log-probs of the target tokens (0 where ``answer_mask`` is False);
    ``answer_mask``: [N, T] bool. Every target token of the batch weighs the same."""
    mask = answer_mask.to(logp_answer.device)
    return -(logp_answer * mask).sum() / mask.sum().clamp(min=1)


def warmup(cfg: Config) -> dict[str, Any]:
    """Run the reading warm-up as configured; returns the last step's metrics and the evaluation."""
    from accelerate.utils import set_seed
    from safetensors.torch import load_file
    from tqdm.auto import tqdm

    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, build_index
    from elasticmem.data.schema import load_split
    from elasticmem.data.validate import validate_examples
    from elasticmem.eval.retrieval import evidence_rows
    from elasticmem.grpo.loss import retrieval_loss
    from elasticmem.data.rewards import get_reward
    from elasticmem.model.card import write_run_card
    from elasticmem.training.runtime import OneProcess, RetrievalTargets, StopFlag, greedy_eval, truncate_jsonl
    from elasticmem.model.elasticmem import ElasticMem
    from elasticmem.utils import checkpointing as ckpt
    from elasticmem.utils.configuration import save as save_config

    w = cfg.warmup
    out = Path(w.output_dir)
    if (out / "final").is_dir():
        print(f"[warmup] {out}/final exists: nothing to do (delete the folder to run again)", file=sys.stderr)
        return json.loads((out / "eval.json").read_text()) if (out / "eval.json").is_file() else {}
    if w.retrieval_weight > 0 and cfg.memory.retrieval not in ("control", "query_only"):
        raise ConfigError(f"warmup.retrieval_weight > 0 trains the reasoner's query state: it needs "
                          f"memory.retrieval control or query_only, not {cfg.memory.retrieval!r}")
    memgen = cfg.train.system == "memgen"
    if memgen and (w.align_steps or w.reconstruct_steps):
        raise ConfigError("train.system=memgen: MemGen has no projector for warmup.align_steps / "
                          "warmup.reconstruct_steps to train; set both to 0 (its warm-up is the weaver's SFT)")
    resume = _resumable(cfg, out)  # before anything is written: refuses to mix two runs
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    set_seed(cfg.seed)
    backbone = load_backbone(cfg.backbone)
    bank = Bank.open(cfg.bank.dir, expect_fingerprint=backbone.fingerprint, expect_kv=cfg.kv_scheme_read)
    mem_cfg = cfg.memory
    index = build_index(bank, cfg.bank.index, cfg.seed, backbone.device.index or 0, device=backbone.device)
    if memgen:
        from elasticmem.baselines.memgen import MemGen

        model = MemGen(backbone, mem_cfg, cfg.memgen, bank, index)
    else:
        model = ElasticMem(backbone, mem_cfg, bank, index)
    if cfg.train.gradient_checkpointing:  # one process, no DeepSpeed: the non-reentrant variant
        model.enable_activation_checkpointing()
    if w.init_from:
        from elasticmem.training.runtime import check_init

        check_init(w.init_from, model)
        model.load_weights(w.init_from)
    examples = load_split(cfg.data.dir, w.split)
    eval_examples = load_split(cfg.data.dir, w.eval_split) if w.eval_split else []
    if w.eval_limit:
        eval_examples = eval_examples[: w.eval_limit]
    for split, exs in [(w.split, examples)] + ([(w.eval_split, eval_examples)] if eval_examples else []):
        validate_examples(exs, bank, reward=cfg.train.reward, chunking=cfg.chunking, top_z=mem_cfg.top_z,
                          split_name=f"{cfg.data.dir}/{split}.jsonl")
    evidence = {ex.id: evidence_rows(ex, bank) for ex in examples} if mem_cfg.top_z > 0 else {}
    for key, on in (("retrieval_weight > 0", w.retrieval_weight > 0), ("budget_weight > 0", w.budget_weight > 0),
                    ("budgets=oracle", w.budgets == "oracle")):
        if on and not any(evidence.values()):
            raise ConfigError(f"warmup.{key} needs examples with evidence; {cfg.data.dir}/{w.split}.jsonl records "
                              f"none{'' if mem_cfg.top_z else ' (or memory is off: top_z 0)'}")
    if w.budget_weight > 0 and (memgen or mem_cfg.injection != "latent" or mem_cfg.policy.variant not in
                                ("transformer", "autoregressive", "mlp")):
        raise ConfigError("warmup.budget_weight > 0 trains a learned budget policy: it needs train.system=elasticmem, "
                          "memory.injection=latent and memory.policy.variant transformer, autoregressive or mlp")
    try:
        targets = {ex.id: option_target(model.tokenizer, model.eos_ids, ex, mem_cfg.max_new_tokens, w.target)
                   for ex in examples}
    except ValueError as e:
        raise ConfigError(str(e)) from None
    gen = torch.Generator().manual_seed(cfg.seed)
    metrics_path = out / "metrics.jsonl"
    last: dict[str, Any] = {}
    pre = w.align_steps + w.reconstruct_steps  # global step numbers of the answer steps start after these
    if resume is None:
        metrics_path.unlink(missing_ok=True)
        groups = sorted({ex.group for ex in examples})
        chunk_rows = [r for g in groups for r in bank.group_row_ids(g).tolist()]
        latent = bool(mem_cfg.top_z) and mem_cfg.injection == "latent"
        if w.align_steps and latent:
            last = _align(model, w, chunk_rows, gen, metrics_path, cfg.train.max_grad_norm)
        if w.reconstruct_steps and latent:
            last = _reconstruct(model, w, chunk_rows, gen, metrics_path, cfg.train.max_grad_norm)
    else:
        model.load_weights(resume)
    # the adapter and the projector read; the policy is GRPO's to train, unless it gets a supervised start
    params = [p for n, p in model.named_parameters()
              if p.requires_grad and (w.budget_weight > 0 or not n.startswith("policy."))]
    optimizer = torch.optim.AdamW(params, lr=w.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(w.warmup_steps, w.steps))
    state: dict[str, Any] = {"answer_step": 0, "order": []}
    if resume is not None:
        state = ckpt.read_trainer_state(resume, optimizer, scheduler)
        gen.set_state(load_file(str(resume / "generator.safetensors"))["state"])
        ckpt.load_rng(resume, 0)
        truncate_jsonl(metrics_path, pre + state["answer_step"])
        print(f"[warmup] resumed from {resume} (answer step {state['answer_step']} of {w.steps})", file=sys.stderr)
    else:  # the projector-only stages are done: never repeated
        _save_checkpoint(out, model, optimizer, scheduler, state, gen, pre, cfg)
    order: list[int] = state["order"]
    first = state["answer_step"]
    bar = tqdm(range(first + 1, w.steps + 1), desc="warm-up (answers)", unit="step", file=sys.stderr,
               initial=first, total=w.steps)
    with StopFlag() as stop:
        for step in bar:
            if len(order) < w.batch_size:  # epochs of a seeded permutation
                order += torch.randperm(len(examples), generator=gen).tolist()
            batch = [examples[i] for i in order[: w.batch_size]]
            del order[: w.batch_size]
            t0 = time.perf_counter()
            model.eval()  # retrieval and budgets as a rollout makes them
            model.cfg = dataclasses.replace(mem_cfg, top_z=curriculum_z(w.top_z_start, mem_cfg.top_z, step, w.steps))
            include = [evidence.get(ex.id, set()) for ex in batch] if w.evidence and evidence else None
            if w.budgets == "oracle" and include is None:
                include = [evidence.get(ex.id, set()) for ex in batch]  # the oracle reads the evidence rows
            traj = model.teacher_forced(batch, [targets[ex.id] for ex in batch], include, w.budgets, gen)
            recall = _recall_before(model, traj, batch, evidence) if evidence else None
            model.train()
            o = model.score(traj)
            loss = supervised_loss(o.logp_answer, traj.answer_mask)
            m: dict[str, Any] = {"step": pre + step, "stage": "answer",
                                 "top_z": model.cfg.top_z, "loss/answer": float(loss.detach())}
            if w.retrieval_weight > 0:
                aux = RetrievalTargets(bank, traj, evidence, OneProcess())
                r_loss, _ = retrieval_loss(o.query_state, *aux.select(list(range(len(traj))), model.device),
                                           cfg.train.loss.retrieval_temperature, aux.count)
                loss = loss + w.retrieval_weight * r_loss
                m["loss/retrieval"] = float(r_loss.detach())
            if w.budget_weight > 0 and traj.rows.shape[1]:
                b_loss, b_m = _budget_supervision(model, traj, batch, evidence)
                loss = loss + w.budget_weight * b_loss
                m.update(b_m)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm or float("inf"))
            optimizer.step()
            scheduler.step()
            m.update({"loss": float(loss.detach()), "token_accuracy": _token_accuracy(o.logp_answer, traj.answer_mask),
                      "exact": _exact(o.logp_answer, traj.answer_mask),
                      "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
                      "memory_tokens": float(traj.memory_tokens.float().mean()), "time/step": time.perf_counter() - t0})
            if recall is not None:
                m["retrieval/evidence_recall"] = recall
            with metrics_path.open("a") as f:
                f.write(json.dumps(m) + "\n")
            last = m
            state = {"answer_step": step, "order": order}
            stop_now = stop.set or (w.stop_after_steps > 0 and step - first >= w.stop_after_steps and step < w.steps)
            if (w.save_every and step % w.save_every == 0 and step < w.steps) or stop_now:
                model.cfg = mem_cfg
                _save_checkpoint(out, model, optimizer, scheduler, state, gen, pre + step, cfg)
            if stop_now:
                bar.close()
                return {"stopped_at": pre + step, "last_step": last}
    model.eval()
    model.cfg = mem_cfg
    if w.policy_epochs > 0 and mem_cfg.top_z > 0 and mem_cfg.injection == "latent" and not memgen:
        from elasticmem.warmup.budget import fit_model_policy  # the policy alone, on every question's memories

        fit = fit_model_policy(model, cfg, examples, eval_examples, evidence_rows)
        (out / "policy_fit.json").write_text(json.dumps(fit, indent=1))
    tmp = out / "final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    write_run_card(tmp, cfg, pre + w.steps, metrics_path, stage="warmup", load_path=out / "final",
                   config_path=out / "config.yaml")
    tmp.rename(out / "final")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # final/ supersedes them
    result: dict[str, Any] = {"last_step": last}
    if eval_examples:
        result["eval"] = greedy_eval(model, eval_examples, get_reward(cfg.train.reward), cfg.train.eval_batch_size)
        result["eval"]["split"] = w.eval_split
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    return result


WARMUP_MAY_CHANGE = ("warmup.save_every", "warmup.stop_after_steps", "warmup.eval_split", "warmup.eval_limit")
"""Warm-up keys a resumed run may change (with the trainer's ``RESUME_MAY_CHANGE``, and the
GRPO-only ``train.*`` keys, which the warm-up reads only for gradient clipping, evaluation and
activation checkpointing, which changes memory, not results)."""


def _resumable(cfg: Config, out: Path) -> Path | None:
    """The newest checkpoint of an interrupted warm-up in ``out``, or None to start afresh;
    refuses one written with other settings."""
    from elasticmem.training.runtime import config_changes, mixed_runs_error
    from elasticmem.utils import checkpointing as ckpt
    from elasticmem.utils.configuration import load

    last = ckpt.latest_checkpoint(out / "checkpoints")
    if last is None or not (out / "config.yaml").is_file():
        return last
    kept = ("train.max_grad_norm", "train.weight_decay", "train.reward", "train.system",
            "train.loss.retrieval_temperature")  # the train.* keys the answer steps read
    changed = [k for k in config_changes(load(Config, out / "config.yaml"), cfg)
               if k not in WARMUP_MAY_CHANGE and (not k.startswith("train.") or k in kept)]
    if changed:
        raise mixed_runs_error(out, out / "config.yaml", changed, "warmup.output_dir")
    return last


def _save_checkpoint(out: Path, model, optimizer, scheduler, state: dict[str, Any], gen: torch.Generator,
                     step: int, cfg: Config) -> None:
    """Weights, AdamW and schedule, the data order, the sampling generator and the global RNG,
    written atomically as ``checkpoints/step_{step}`` (global step) with its model card; only the
    newest is kept."""
    from safetensors.torch import save_file

    from elasticmem.model.card import write_run_card
    from elasticmem.utils import checkpointing as ckpt

    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt.tmp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    ckpt.write_trainer_state(tmp, optimizer, scheduler, {"answer_step": state["answer_step"],
                                                         "order": list(state["order"])})
    save_file({"state": gen.get_state()}, str(tmp / "generator.safetensors"))
    write_run_card(tmp, cfg, step, out / "metrics.jsonl", stage="warmup", load_path=ckpt.step_dir(root, step),
                   config_path=out / "config.yaml")
    ckpt.save_rng(tmp, 0)
    ckpt.finalize(root, step, keep_last=1)


def cached_token_ids(bank, tokenizer, rows: Sequence[int]) -> list[list[int]]:
    """Per bank row, the ids of the tokens whose states its content cache holds (oldest first).

    The chunk text is tokenized as the bank builder tokenized it (the manifest's settings), and
    the last ``cache_len`` ids are the cached positions.
    """
    from elasticmem.data.chunking import tokenize_chunks

    if not rows:
        return []
    t = bank.manifest["tokenization"]
    ids = tokenize_chunks([bank.chunk(r)["text"] for r in rows], tokenizer, t["max_tokens"],
                          t["truncation_side"], t["add_special_tokens"])
    cache_len = bank.cache_lengths(torch.as_tensor(list(rows), dtype=torch.long))
    return [x[len(x) - int(c):] for x, c in zip(ids, cache_len.tolist())]


def alignment_loss(soft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared L2 distance between soft tokens [S, d] and token embeddings [S, d]."""
    return (soft - target).pow(2).sum(-1).mean()


def _require_projector_parameters(model, key: str) -> None:
    if model.cfg.content == "kv":
        raise ConfigError(f"warmup.{key} trains the projector, which memory.content=kv does not use (the reader "
                          f"attends to the memories' own keys and values): set warmup.{key}=0")
    if next(model.projector.parameters(), None) is None:
        raise ConfigError(f"warmup.{key} trains the projector, and memory.projector.variant="
                          f"{model.projector.cfg.variant} has no parameters: set warmup.{key}=0")


def _align(model, w, chunk_rows: list[int], gen: torch.Generator, metrics_path: Path,
           max_grad_norm: float) -> dict[str, Any]:
    """Token alignment: the projector maps each cached state to its own token's input embedding."""
    from tqdm.auto import tqdm

    from elasticmem.model.projector import select_last_valid

    _require_projector_parameters(model, "align_steps")
    embed = model.base.get_input_embeddings().weight.detach()
    model.projector.match_embedding_scale(embed)  # a fresh projector starts at the embeddings' scale
    params = list(model.projector.parameters())
    optimizer = torch.optim.AdamW(params, lr=w.align_lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(w.warmup_steps, w.align_steps))
    token_ids = dict(zip(chunk_rows, cached_token_ids(model.bank, model.tokenizer, chunk_rows)))
    order: list[int] = []
    m: dict[str, Any] = {}
    model.train()
    for step in tqdm(range(1, w.align_steps + 1), desc="warm-up (token alignment)", unit="step", file=sys.stderr):
        if len(order) < w.align_batch_size:
            order += [chunk_rows[i] for i in torch.randperm(len(chunk_rows), generator=gen).tolist()]
        rows = order[: w.align_batch_size]
        del order[: w.align_batch_size]
        t0 = time.perf_counter()
        cache, cache_len = model.bank.gather(torch.as_tensor(rows))
        states, _ = select_last_valid(cache, cache_len, cache_len.long())
        targets = torch.as_tensor([t for r in rows for t in token_ids[r]], device=embed.device)
        soft = model.projector(states.to(model.device, torch.float32))
        loss = alignment_loss(soft, embed[targets].float())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
        optimizer.step()
        scheduler.step()
        with torch.no_grad():  # on a slice: the [S, V] similarities of a whole batch cost more than the step
            sl = slice(0, 256)
            own = float(((soft[sl].detach() @ embed.T.float()).argmax(-1) == targets[sl]).float().mean())
        m = {"step": step, "stage": "align", "loss/align": float(loss.detach()), "loss": float(loss.detach()),
             "token_accuracy": own, "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
             "memory_tokens": float(len(targets)) / len(rows), "time/step": time.perf_counter() - t0}
        with metrics_path.open("a") as f:
            f.write(json.dumps(m) + "\n")
    return m


def _reconstruct(model, w, chunk_rows: list[int], gen: torch.Generator, metrics_path: Path,
                 max_grad_norm: float) -> dict[str, Any]:
    """xRAG's first stage: the projector alone learns soft tokens the frozen LM can read back."""
    from tqdm.auto import tqdm

    tok = model.tokenizer
    prompt = tok(w.reconstruct_prompt, add_special_tokens=False)["input_ids"]
    suffix = tok(w.reconstruct_suffix, add_special_tokens=False)["input_ids"]
    _require_projector_parameters(model, "reconstruct_steps")
    params = list(model.projector.parameters())
    optimizer = torch.optim.AdamW(params, lr=w.reconstruct_lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(w.warmup_steps, w.reconstruct_steps))
    top = model.cfg.policy.max_budget
    order: list[int] = []
    m: dict[str, Any] = {}
    model.train()
    for step in tqdm(range(1, w.reconstruct_steps + 1), desc="warm-up (reconstruction)", unit="step",
                     file=sys.stderr):
        if len(order) < w.reconstruct_batch_size:
            order += [chunk_rows[i] for i in torch.randperm(len(chunk_rows), generator=gen).tolist()]
        rows = torch.as_tensor(order[: w.reconstruct_batch_size])
        del order[: w.reconstruct_batch_size]
        budgets = (torch.full(rows.shape, top) if w.budgets == "max"
                   else torch.randint(1, top + 1, rows.shape, generator=gen))
        t0 = time.perf_counter()
        logp, mask = model.reconstruction_logps(rows, budgets, prompt, suffix)
        loss = supervised_loss(logp, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
        optimizer.step()
        scheduler.step()
        m = {"step": w.align_steps + step, "stage": "reconstruct", "loss/reconstruct": float(loss.detach()),
             "loss": float(loss.detach()),
             "token_accuracy": _token_accuracy(logp.detach(), mask), "grad_norm": float(grad_norm),
             "lr": scheduler.get_last_lr()[0], "memory_tokens": float(budgets.float().mean()),
             "time/step": time.perf_counter() - t0}
        with metrics_path.open("a") as f:
            f.write(json.dumps(m) + "\n")
    return m


def _budget_supervision(model, traj, batch: Sequence[Example], evidence: dict[str, set[int]]):
    """``budget_supervision_loss`` of the policy on this step's memories (train mode, evidence and
    other memories balanced), and the mean budget the policy's argmax gives evidence and other
    memories (``budget/*``)."""
    from elasticmem.model.budget_policy import budget_supervision_loss

    top, low = model.cfg.policy.max_budget, model.cfg.policy.min_budget
    dev = model.device
    is_ev = torch.tensor([[int(r) in evidence.get(ex.id, ()) for r in row.tolist()]
                          for ex, row in zip(batch, traj.rows)], dtype=torch.bool).reshape(traj.rows.shape)
    mask = traj.mask.to(dev)
    target = torch.where(is_ev, top, low).to(dev)
    h = traj.query_state.to(dev)
    logits = model.policy.logits(h, model._policy_inputs(h, traj.rows), traj.scores.to(dev), mask, target)
    loss = budget_supervision_loss(logits, target, mask, low, positive=is_ev.to(dev))
    with torch.no_grad():
        chosen = logits.argmax(-1) + low
        ev, other = mask & is_ev.to(dev), mask & ~is_ev.to(dev)
        m = {"loss/budget": float(loss.detach()),
             "budget/evidence": float(chosen[ev].float().mean()) if ev.any() else float("nan"),
             "budget/other": float(chosen[other].float().mean()) if other.any() else float("nan")}
    return loss, m


def _token_accuracy(logp_answer: torch.Tensor, answer_mask: torch.Tensor) -> float:
    """Fraction of target tokens with log-prob above log(1/2): certainly the argmax."""
    mask = answer_mask.to(logp_answer.device)
    return float(((logp_answer > math.log(0.5)) & mask).sum() / mask.sum().clamp(min=1))


def _exact(logp_answer: torch.Tensor, answer_mask: torch.Tensor) -> float:
    """Fraction of examples whose every target token has log-prob above log(1/2): greedy
    decoding would say the target (the training accuracy of teacher forcing)."""
    mask = answer_mask.to(logp_answer.device)
    return float((((logp_answer > math.log(0.5)) | ~mask).all(-1)).float().mean())


def _recall_before(model, traj, batch: Sequence[Example], evidence: dict[str, set[int]]) -> float | None:
    """Fraction of questions with evidence whose retrieval (before evidence was added) found any."""
    from elasticmem.eval.retrieval import recall_at_k

    rows = traj.retrieved_rows if traj.retrieved_rows is not None else model.retrieve(batch)[0]
    if rows.shape[1] == 0:
        return None
    r = recall_at_k(rows, [evidence.get(ex.id, set()) for ex in batch], [rows.shape[1]])
    return r.get(f"recall_any@{rows.shape[1]}") if r["n"] else None


def main(argv: list[str] | None = None) -> int:
    from elasticmem.bank import BankError
    from elasticmem.data.schema import SchemaError
    from elasticmem.utils.configuration import print_config
    from elasticmem.utils.options import command_name, parse_cli

    cfg, _ = parse_cli(Config, argv, prog=command_name("python -m elasticmem.warmup.reading"), description=__doc__)
    print_config(cfg, file=sys.stderr)
    try:
        result = warmup(cfg)
    except (ConfigError, SchemaError, BankError, FileNotFoundError) as e:
        print(f"warmup: error: {e}", file=sys.stderr)
        return 2
    if "stopped_at" in result:
        print(f"warmup: {cfg.warmup.output_dir}: stopped at step {result['stopped_at']} with a checkpoint; "
              f"run the same command again to resume")
        return 0
    ev = result.get("eval", {})
    print(f"warmup: {cfg.warmup.output_dir}: " + json.dumps(
        {k: ev.get(k) for k in ("split", "accuracy", "accuracy_ci95", "num_examples", "avg_memory_tokens")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
