"""Process state for single- and multi-process runs (``accelerate launch``, torchrun, SLURM).

On a machine without CUDA the processes must be told to use the CPU, or accelerate
leaves each of them alone and unsynchronised (every such wrong launch still exits 0;
DESIGN.md section 4). ``process_state`` does that and refuses a launch whose
processes did not join one group.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch


def process_state():
    """The ``accelerate.PartialState`` of this process, distributed over gloo on CPU-only machines."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
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
