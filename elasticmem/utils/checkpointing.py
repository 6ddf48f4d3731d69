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


# --------------------------------------------------------------------------- nested states (DeepSpeed)


def nested_to_files(obj: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state (dicts, lists, tensors, scalars, a few objects) into tensors and JSON.

    DeepSpeed's ZeRO optimizers keep a per-process state dict that mixes tensors with
    objects (its loss scaler, an enum); ``torch.save`` would pickle those. Here tensors go to
    safetensors by path, containers and scalars to JSON, enums by name and other objects as
    their JSON-able attributes; ``nested_from_files`` rebuilds the state on top of a live
    one, which provides the objects.
    """
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors[path] = x.detach().cpu().contiguous()
            return {"__tensor__": path}
        if isinstance(x, dict):
            return {"__dict__": [[k, enc(v, f"{path}.{k}")] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"__list__" if isinstance(x, list) else "__tuple__": [enc(v, f"{path}.{i}") for i, v in enumerate(x)]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        import enum

        if isinstance(x, enum.Enum):
            return {"__enum__": x.name}
        attrs = {k: v for k, v in vars(x).items() if v is None or isinstance(v, (bool, int, float, str))}
        return {"__object__": type(x).__name__, "attrs": attrs}

    return tensors, enc(obj, "s")


def nested_from_files(tensors: dict[str, torch.Tensor], meta: Any, live: Any) -> Any:
    """Inverse of ``nested_to_files``; ``live`` (the same kind of state, freshly made) supplies
    the objects, whose saved attributes are set back."""

    def dec(m: Any, cur: Any) -> Any:
        if not isinstance(m, dict):
            return m
        if "__tensor__" in m:
            return tensors[m["__tensor__"]]
        if "__dict__" in m:
            cur = cur if isinstance(cur, dict) else {}
            return {k: dec(v, cur.get(k)) for k, v in m["__dict__"]}
        for kind, typ in (("__list__", list), ("__tuple__", tuple)):
            if kind in m:
                cur = cur if isinstance(cur, (list, tuple)) else []
                return typ(dec(v, cur[i] if i < len(cur) else None) for i, v in enumerate(m[kind]))
        if cur is None:
            raise ValueError(f"cannot rebuild a saved {m.get('__object__') or m.get('__enum__')!r}: "
                             f"the live state has nothing at its place")
        for k, v in m.get("attrs", {}).items():
            setattr(cur, k, v)
        return cur

    return dec(meta, live)


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
    """``with_optimizer=False`` under DeepSpeed ZeRO, whose optimizer state is sharded: every
    process writes its own shard with ``save_sharded_optimizer``."""
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
    elif not list(ts.glob("optimizer_rank*.safetensors")):
        warnings.warn(f"{ckpt} holds no optimizer state: AdamW restarts its moments")
    sd = scheduler.state_dict()
    sd.update(json.loads((ts / "scheduler.json").read_text()))
    scheduler.load_state_dict(sd)
    return json.loads((ts / "state.json").read_text())


def save_sharded_optimizer(dir_: Path, rank: int, zero_optimizer) -> None:
    """This process's shard of a DeepSpeed ZeRO optimizer (AdamW moments and fp32 master weights)."""
    ts = dir_ / "trainer_state"
    ts.mkdir(parents=True, exist_ok=True)
    tensors, meta = nested_to_files(zero_optimizer.state_dict())
    save_file({k: v.clone() for k, v in tensors.items()}, ts / f"optimizer_rank{rank}.safetensors")
    _write_json(ts / f"optimizer_rank{rank}.json", meta)


def load_sharded_optimizer(ckpt: Path, rank: int, world: int, zero_optimizer) -> None:
    """Restore this process's ZeRO shard; the checkpoint must come from as many processes."""
    ts = ckpt / "trainer_state"
    path = ts / f"optimizer_rank{rank}.safetensors"
    written = len(list(ts.glob("optimizer_rank*.safetensors")))
    if not path.is_file() or written != world:
        raise FileNotFoundError(f"{ckpt} holds ZeRO optimizer shards from {written} process(es), this run has "
                                f"{world}: resume with the same number of processes")
    sd = nested_from_files(load_file(str(path)), json.loads((ts / f"optimizer_rank{rank}.json").read_text()),
                           zero_optimizer.state_dict())
    # ZeRO loaders take every process's state and read their own rank's entry.
    shards = [sd if r == rank else None for r in range(world)]
    zero_optimizer.load_state_dict(shards, load_optimizer_states=True, load_from_fp32_weights=True)


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
