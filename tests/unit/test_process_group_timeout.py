"""The process group's timeout comes from the config: train.dist_timeout_s for training's
Accelerator, eval.dist_timeout_s for evaluate.py's PartialState (PyTorch's NCCL default, 10 minutes,
would abort an evaluation whose other processes wait hours at the final barrier).

    nice -n 15 env OMP_NUM_THREADS=1 python -m pytest tests/unit/test_process_group_timeout.py -q

Each group is created in a fresh one-process gloo launch (a subprocess: accelerate's state is a
per-process singleton) and the timeout read back from the group's backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from elasticmem.utils.common import free_port
from elasticmem.utils.distributed import process_group_kwargs

ROOT = Path(__file__).resolve().parents[2]
READ_TIMEOUT = """
import torch, torch.distributed as dist
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
print("TIMEOUT", backend.options._timeout.total_seconds(), dist.get_backend())
"""


def _group_timeout(code: str, tmp_path: Path) -> float:
    """Run ``code`` as rank 0 of a one-process CPU launch (the environment accelerate launch sets);
    the timeout of the process group it created, in seconds (gloo, as on CPU nodes)."""
    env = dict(os.environ, LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + READ_TIMEOUT], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("TIMEOUT"))
    _, seconds, backend = line.split()
    assert backend == "gloo"
    return float(seconds)


def test_kwargs_carry_the_timeout_and_gloo_only_when_asked():
    assert process_group_kwargs(90.5) == {"timeout": timedelta(seconds=90.5)}
    assert process_group_kwargs(7, gloo=True) == {"timeout": timedelta(seconds=7), "backend": "gloo"}
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="must be > 0"):
            process_group_kwargs(bad)


def test_evaluation_state_gets_the_configured_timeout(tmp_path):
    code = """
    from elasticmem.utils.distributed import process_state
    state = process_state(timeout_s=12345.5)
    assert state.num_processes == 1 and state.distributed_type.value == "MULTI_CPU"
    """
    assert _group_timeout(code, tmp_path) == 12345.5


def test_training_accelerator_gets_train_dist_timeout_s(tmp_path):
    code = f"""
    from elasticmem.config import load_config
    from elasticmem.grpo.run import _accelerator
    acc = _accelerator(load_config(None, ["train.dist_timeout_s=4321", "train.output_dir={tmp_path}/run"]))
    assert acc.num_processes == 1
    """
    assert _group_timeout(code, tmp_path) == 4321.0


def test_evaluate_cli_creates_its_state_with_eval_dist_timeout_s(monkeypatch):
    from elasticmem.apps import evaluate
    from elasticmem.utils import distributed

    asked = []

    class Stop(Exception):
        pass

    def recording(timeout_s=None):
        asked.append(timeout_s)
        raise Stop

    monkeypatch.setattr(distributed, "process_state", recording)
    with pytest.raises(Stop):
        evaluate.main(["--config", str(ROOT / "configs/tiny.yaml"), "eval.dist_timeout_s=77"])
    with pytest.raises(Stop):
        evaluate.main(["--config", str(ROOT / "configs/tiny.yaml")])
    assert asked == [77.0, 86400.0]
