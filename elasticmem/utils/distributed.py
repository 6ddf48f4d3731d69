"""Process state for single- and multi-process runs (``accelerate launch``, torchrun, SLURM).

On a machine without CUDA the processes must be told to use the CPU, or accelerate
leaves each of them alone and unsynchronised (every such wrong launch still exits 0;
DESIGN.md section 4). ``process_state`` does that and refuses a launch whose
processes did not join one group.
"""

from __future__ import annotations

import os

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
