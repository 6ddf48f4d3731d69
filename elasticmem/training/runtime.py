"""The training runtime that GRPO (``elasticmem.grpo.trainer``), the reading warm-up
(``elasticmem.warmup.reading``) and map training share: the stop flag, the greedy evaluation
during training, the rules for resuming a run from its checkpoints, the retrieval targets of
the auxiliary retrieval loss, and the JSONL logs. Checkpoint files themselves are
``elasticmem.utils.checkpointing``.

It sits below both trainers (tests/unit/test_import_layers.py), so neither imports the other's
private helpers.

    pytest tests/unit/test_warmup_reading.py tests/unit/test_gradient_checkpointing.py
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from elasticmem.config import Config
from elasticmem.data.schema import Example
from elasticmem.utils import checkpointing as ckpt
from elasticmem.utils.configuration import ConfigError

# --------------------------------------------------------------------------- stopping


class StopFlag:
    """First Ctrl-C / SIGTERM: finish the step, checkpoint, stop. Second Ctrl-C: stop now."""

    def __init__(self) -> None:
        self.set = False
        self._old = {}

    def __enter__(self):
        if threading_main():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.set and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.set = True
        print(f"\n[train] signal {signum}: stopping after this step and writing a checkpoint "
              f"(Ctrl-C again to stop at once)", file=sys.stderr)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def greedy_eval(model, examples: Sequence[Example], reward_fn, batch_size: int, accelerator=None) -> dict[str, Any]:
    """Greedy accuracy, #Tok and B_mem on ``examples`` (shared across processes, gathered once).

    Accuracies carry their n (``num_examples``, ``per_type_counts``) and 95 % Wilson interval
    (``accuracy_ci95``, ``per_type_ci95``), as in evaluate.py's ``results.json``."""
    model.eval()
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    mine = list(range(rank, len(examples), world))
    rows = []
    for i in range(0, len(mine), batch_size):
        batch = [examples[j] for j in mine[i : i + batch_size]]
        traj = model.greedy(batch)
        for k, ex in enumerate(batch):
            rows.append([mine[i + k], reward_fn(traj.answers[k], ex), float(traj.num_tokens[k]),
                         float(traj.memory_tokens[k])])
    t = torch.tensor(rows, dtype=torch.float64).reshape(-1, 4)
    if accelerator is not None and world > 1:
        # pad to equal length: gather needs equal shapes on every process
        n = math.ceil(len(examples) / world)
        t = torch.cat([t, torch.full((n - t.shape[0], 4), -1.0, dtype=torch.float64)])
        t = accelerator.gather(t.to(accelerator.device)).cpu()
        t = t[t[:, 0] >= 0]
    t = t[t[:, 0].argsort()]
    per_type: dict[str, list[float]] = {}
    for idx, r, *_ in t.tolist():
        per_type.setdefault(examples[int(idx)].question_type, []).append(r)
    types = sorted(per_type)

    def ci95(rewards: list[float]) -> list[float] | None:  # Wilson; none for graded (non-0/1) rewards
        from elasticmem.eval.stats import accuracy_with_interval

        return accuracy_with_interval(rewards)[2] if all(r in (0.0, 1.0) for r in rewards) else None

    return {
        "accuracy": float(t[:, 1].mean()) if len(t) else 0.0,
        "accuracy_ci95": ci95(t[:, 1].tolist()),
        "num_examples": int(len(t)),
        "avg_tokens": float(t[:, 2].mean()) if len(t) else 0.0,
        "avg_memory_tokens": float(t[:, 3].mean()) if len(t) else 0.0,
        "per_type": {k: sum(per_type[k]) / len(per_type[k]) for k in types},
        "per_type_counts": {k: len(per_type[k]) for k in types},
        "per_type_ci95": {k: ci95(per_type[k]) for k in types},
    }


# --------------------------------------------------------------------------- resuming

RESUME_MAY_CHANGE: tuple[str, ...] = (
    "train.max_steps", "train.epochs", "train.stop_after_steps", "train.save_every", "train.keep_last",
    "train.log_every", "train.log_rollouts", "train.eval_split", "train.eval_every", "train.eval_limit",
    "train.eval_batch_size", "train.micro_batch_size", "train.gradient_checkpointing", "train.trackers",
    "train.record_rollouts", "train.resume", "backbone.device", "backbone.cache_dir", "bank.dir",
    "bank.verify", "bank.overwrite", "bank.batch_size", "bank.index.save", "eval.", "amem.",
)
"""Config keys (or sections, ending in '.') a resumed run may change: how long to run, how
often to log, save and evaluate, where files are, and how much fits in memory at once
(micro-batches and activation checkpointing change memory, not results). Moving bank.dir is
allowed because the bank's encoder and corpus fingerprints are checked on their own; data.dir
is not: nothing fingerprints the training questions, and the resumed sampler's position
(epoch, offset) only means something in the same split, so another data.dir is refused as
another run (move the data back, or start a new train.output_dir)."""


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """A config dataclass as {dotted key: value}."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out.update(_flat(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else {f"{prefix}{f.name}": v})
    return out


def config_changes(saved: Config, cfg: Config) -> list[str]:
    """Dotted keys whose values differ between ``saved`` and ``cfg``, except ``RESUME_MAY_CHANGE``."""
    a, b = _flat(saved), _flat(cfg)
    free = lambda k: any(k == m or (m.endswith(".") and k.startswith(m)) for m in RESUME_MAY_CHANGE)  # noqa: E731
    return sorted(k for k in a.keys() | b.keys() if not free(k) and a.get(k) != b.get(k))


def resumable_checkpoint(cfg: Config, ckroot: Path) -> Path | None:
    """The checkpoint to resume from, or None to start; refuses to mix two runs in one folder.

    With ``train.resume`` the newest checkpoint is resumed only if it was written with the
    same settings (apart from ``RESUME_MAY_CHANGE``); with resume off, a folder that already
    holds checkpoints is refused rather than overwritten step by step.
    """
    from elasticmem.utils.configuration import load

    last = ckpt.latest_checkpoint(ckroot)
    if last is None:
        return None
    if not cfg.train.resume:
        raise ConfigError(f"train.resume=false but {ckroot} holds checkpoints of an earlier run (newest {last.name}): "
                          f"choose another train.output_dir or delete that folder")
    saved_path = last / "config.yaml"
    if not saved_path.is_file():  # written by a version that kept the config only next to the run
        saved_path = ckroot.parent / "config.yaml"
    if saved_path.is_file():
        changed = config_changes(load(Config, saved_path), cfg)
        if changed:
            raise mixed_runs_error(ckroot.parent, saved_path, changed, "train.output_dir")
    return last


def mixed_runs_error(run: Path, saved: Path, changed: list[str], key: str) -> ConfigError:
    """The error for resuming ``run`` (whose settings are in ``saved``) with ``changed`` keys."""
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    return ConfigError(f"{run} holds a run with other settings ({shown} differ from {saved}); resuming would "
                       f"mix two runs: choose another {key}, or rerun with the saved settings to continue it")


def check_init(path: str | Path, core) -> None:
    """Refuse a ``train.init_from`` model of another backbone or another adapter, policy or projector shape."""
    from elasticmem.model.checkpoint import CONFIG_FILE

    f = Path(path) / CONFIG_FILE
    if not f.is_file():
        raise FileNotFoundError(f"train.init_from={path} is not a saved ElasticMem model ({CONFIG_FILE} missing)")
    meta = json.loads(f.read_text())
    if meta["backbone"]["fingerprint"] != core.fingerprint:
        raise ConfigError(f"train.init_from={path} was trained on {meta['backbone']['name_or_path']!r}, "
                          f"not on this backbone ({core.backbone_name!r})")
    system = "memgen" if hasattr(core, "memgen") else "elasticmem"
    if meta.get("system", "elasticmem") != system:
        raise ConfigError(f"train.init_from={path} holds a {meta.get('system', 'elasticmem')} model, this run trains "
                          f"{system} (train.system)")
    if system == "memgen":
        mine_mg = dataclasses.asdict(core.memgen)
        for key in ("prompt_latents", "inference_latents", "trigger_hidden"):
            if meta["memgen"][key] != mine_mg[key]:
                raise ConfigError(f"train.init_from={path} has memgen.{key}={meta['memgen'][key]}, this run "
                                  f"memgen.{key}={mine_mg[key]}")
    mine = dataclasses.asdict(core.cfg)
    for part in (("lora",) if system == "memgen" else ("lora", "policy", "projector")):
        if meta["memory"][part] != mine[part]:
            raise ConfigError(f"train.init_from={path} has memory.{part}={meta['memory'][part]}, "
                              f"this run memory.{part}={mine[part]}")


# --------------------------------------------------------------------------- retrieval targets


class RetrievalTargets:
    """Candidates (the query's group), their keys and evidence flags, for ``retrieval_loss``.

    ``count``: trajectories with evidence in the whole optimizer batch (summed over processes)."""

    def __init__(self, bank, traj, evidence: dict[str, set[int]], acc) -> None:
        spans = [bank.group_row_ids(g) for g in traj.groups]
        width = max(len(s) for s in spans)
        self.rows = torch.full((len(traj), width), -1, dtype=torch.long)
        for i, s in enumerate(spans):
            self.rows[i, : len(s)] = s
        self.positive = torch.tensor([[int(r) in evidence.get(ex_id, ()) for r in row.tolist()]
                                      for ex_id, row in zip(traj.example_ids, self.rows)], dtype=torch.bool)
        self.positive = self.positive.reshape(len(traj), width)
        self.keys = bank.gather_keys(self.rows)
        local = torch.tensor(float(self.positive.any(-1).sum()), device=acc.device)
        self.count = int(acc.reduce(local, reduction="sum")) if acc.num_processes > 1 else int(local)

    def select(self, ids, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys [n, M, d], candidates [n, M], positive [n, M]) of trajectories ``ids`` on ``device``."""
        i = torch.as_tensor(ids)
        return self.keys[i].to(device), (self.rows[i] >= 0).to(device), self.positive[i].to(device)


class OneProcess:
    """The slice of an Accelerator that ``RetrievalTargets`` reads, for this one-process stage."""

    num_processes = 1
    device = torch.device("cpu")


# --------------------------------------------------------------------------- JSONL logs


def append_jsonl(path: Path, *rows: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop lines logged after ``step`` (a resumed run rewrites them)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))
