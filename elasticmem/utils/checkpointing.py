"""Training checkpoints without pickle: tensors in safetensors, everything else in JSON.

``checkpoints/step_XXXXXX/`` holds the model (``ElasticMem.save_pretrained``:
adapter, ``budget_policy.safetensors``, ``projector.safetensors``, config JSON)
and ``trainer_state/``: optimizer tensors and structure, scheduler state, the
RNG states of every process, and the trainer's own state (step, data position,
counters). A checkpoint is written into a temporary folder and renamed, so a
crash mid-write leaves the previous checkpoint intact; only the newest
``keep_last`` are kept.

accelerate's ``save_state`` is not used because it pickles the optimizer and
RNG states; these files load without executing code.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STEP_DIR = re.compile(r"^step_(\d{6,})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first (temporary folders of interrupted writes are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


# --------------------------------------------------------------------------- optimizer / scheduler


def optimizer_to_files(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_files(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def scheduler_to_json(sched) -> dict[str, Any]:
    sd = sched.state_dict()
    sd.pop("lr_lambdas", None)  # functions are rebuilt from the config, not saved
    return sd


# --------------------------------------------------------------------------- RNG


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "python": [version, list(state), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    v, st, g = meta["python"]
    random.setstate((v, tuple(st), g))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


# --------------------------------------------------------------------------- whole checkpoints


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1))


def save_rng(dir_: Path, rank: int) -> None:
    """Each process writes its own RNG state (into the checkpoint's temporary folder)."""
    tensors, meta = rng_state()
    save_file(tensors, dir_ / f"rng_rank{rank}.safetensors")
    _write_json(dir_ / f"rng_rank{rank}.json", meta)


def load_rng(dir_: Path, rank: int) -> None:
    path = dir_ / f"rng_rank{rank}.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: was the checkpoint written by fewer processes?")
    set_rng_state(load_file(str(path)), json.loads((dir_ / f"rng_rank{rank}.json").read_text()))


def write_trainer_state(tmp: Path, optimizer, scheduler, state: dict[str, Any], with_optimizer: bool = True) -> None:
    """``with_optimizer=False`` (DeepSpeed ZeRO, whose sharded optimizer state has another
    layout): the model, scheduler, RNG and data position are saved, the AdamW moments are not."""
    ts = tmp / "trainer_state"
    ts.mkdir(parents=True, exist_ok=True)
    if with_optimizer:
        tensors, meta = optimizer_to_files(optimizer)
        save_file(tensors, ts / "optimizer.safetensors")
        _write_json(ts / "optimizer.json", meta)
    _write_json(ts / "scheduler.json", scheduler_to_json(scheduler))
    _write_json(ts / "state.json", state)


def read_trainer_state(ckpt: Path, optimizer, scheduler) -> dict[str, Any]:
    ts = ckpt / "trainer_state"
    if (ts / "optimizer.safetensors").is_file():
        optimizer_from_files(optimizer, load_file(str(ts / "optimizer.safetensors")),
                             json.loads((ts / "optimizer.json").read_text()))
    else:
        warnings.warn(f"{ckpt} holds no optimizer state (written under DeepSpeed): AdamW restarts its moments")
    sd = scheduler.state_dict()
    sd.update(json.loads((ts / "scheduler.json").read_text()))
    scheduler.load_state_dict(sd)
    return json.loads((ts / "state.json").read_text())


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step_{step:06d}"


def finalize(root: Path, step: int, keep_last: int) -> Path:
    """Rename the finished temporary folder into place and prune old checkpoints (main process)."""
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    with open(tmp / "COMPLETE", "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    for debris in root.glob(".tmp-step_*"):
        shutil.rmtree(debris, ignore_errors=True)
    return final
