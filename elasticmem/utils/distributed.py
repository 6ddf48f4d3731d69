"""Process state for single- and multi-process runs (``accelerate launch``, torchrun, SLURM).

On a machine without CUDA the processes must be told to use the CPU, or accelerate
leaves each of them alone and unsynchronised (every such wrong launch still exits 0;
DESIGN.md section 4). ``process_state`` does that and refuses a launch whose
processes did not join one group.

The process group's timeout is how long a collective (a barrier) waits for the slowest
process before the job is torn down: PyTorch's default is 10 minutes under NCCL (30 under
gloo). Training and evaluation set it from their config (``train.dist_timeout_s``,
``eval.dist_timeout_s``; ``process_group_kwargs``).
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Iterator

import torch


def process_group_kwargs(timeout_s: float, gloo: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``init_process_group`` (as accelerate's ``InitProcessGroupKwargs`` or
    ``PartialState`` take them): the timeout of every collective, and the gloo backend when asked
    (CPU processes; otherwise accelerate picks the backend)."""
    if not timeout_s > 0:
        raise ValueError(f"the process-group timeout must be > 0 seconds, got {timeout_s}")
    return {"timeout": timedelta(seconds=timeout_s), **({"backend": "gloo"} if gloo else {})}


def process_state(timeout_s: float | None = None):
    """The ``accelerate.PartialState`` of this process, distributed over gloo on CPU-only machines.

    ``timeout_s``: the process group's timeout (None: PyTorch's default). It only applies to the
    first call in a process, which creates the group; later calls return the same state."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    state = PartialState(cpu=cpu, **(process_group_kwargs(timeout_s) if timeout_s is not None else {}))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and state.num_processes != world:
        raise RuntimeError(
            f"launched with WORLD_SIZE={world} but this process sees {state.num_processes} process(es): "
            f"the processes are not connected (on CPU use: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
            f"--num_processes {world} ...)"
        )
    return state


def is_zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


@contextlib.contextmanager
def gathered(accelerator, params, modifier_rank: int | None = None) -> Iterator[None]:
    """Make ``params`` whole on every process while the block runs (a no-op but under ZeRO-3),
    to read or write weights without running the model (saving, loading).

    ZeRO-3 keeps only a shard of each parameter per process. ``modifier_rank`` (e.g. 0 when
    loading weights) broadcasts that process's changes on exit. A collective: call it on
    every process.
    """
    if not is_zero3(accelerator):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank):
        yield


@contextlib.contextmanager
def full_parameters(accelerator, model) -> Iterator[None]:
    """Run the unwrapped model outside DeepSpeed's forward (a no-op but under ZeRO-3).

    ZeRO-3 gathers a parameter only inside the engine's forward. Sampling, greedy evaluation
    and the reference forward run the unwrapped model, so they gather everything first and
    take the engine's hooks off meanwhile (the hooks would re-partition the weights after
    each submodule), as TRL's ``unwrap_model_for_generation`` does. A collective.

    So every rollout moves the whole frozen base to every process and holds it there: with LoRA
    (a few tens of millions of trainable parameters) ZeRO-3 costs traffic and saves no peak
    memory; docs/cluster.md ("DDP, ZeRO-2 or ZeRO-3") has the figures.
    """
    if not is_zero3(accelerator):
        yield
        return
    offload = getattr(model, "optimizer", None)
    offload = getattr(offload, "parameter_offload", offload)
    with gathered(accelerator, model.parameters()):
        hooked = offload is not None and hasattr(offload, "forward_hooks")
        if hooked:
            for p in model.parameters():
                getattr(p, "ds_active_sub_modules", set()).clear()
            for h in offload.forward_hooks + offload.backward_hooks:
                h.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            if hooked:
                coordinator = getattr(offload, "param_coordinator", None)
                if coordinator is not None and not coordinator.is_invalid_trace():
                    coordinator._invalidate_trace()
                offload._register_deepspeed_module(offload.module)
