"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU: 2 processes, same step as plain PyTorch, checkpoints that resume.

    pytest tests/integration/test_deepspeed.py

Skipped when deepspeed is not installed (it is in the ``dev`` extra). The first run
compiles DeepSpeed's small shared-memory communication extension (~1 min), cached in
``~/.cache/elasticmem/torch_extensions`` (scripts/test.sh builds it before the suite).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from elasticmem.utils.common import free_port
from test_train import _env, _metrics, _params, _same_metrics, _train_cli, tiny_setup  # noqa: F401  (fixture)

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e .[dev])")

EXT_CACHE = Path.home() / ".cache" / "elasticmem" / "torch_extensions"


def _launcher(tmp_path: Path, stage: int) -> tuple[str, ...]:
    cfg = tmp_path / f"zero{stage}.yaml"
    # As configs/accelerate/deepspeed_zero*.yaml, sized for 2 CPU processes in fp32.
    cfg.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
        f"deepspeed_config:\n  zero_stage: {stage}\n  gradient_accumulation_steps: 1\n"
        "  gradient_clipping: 1.0\n  offload_optimizer_device: none\n  offload_param_device: none\n"
        "  zero3_init_flag: false\nnum_machines: 1\nnum_processes: 2\nmixed_precision: 'no'\nuse_cpu: false\n"
    )
    # a port of its own: the default, 29500, may be taken by a launch on the other xdist worker
    return (sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
            "--main_process_port", str(free_port()))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_step_equals_single_process_and_resumes(tiny_setup, tmp_path, stage):  # noqa: F811
    """Same recorded rollouts: ZeRO-{2,3} on 2 processes x batch 4 == 1 plain process x batch 8
    (weights, loss, gradient norm and every metric); a ZeRO run stopped and resumed equals one
    that ran straight through.

    Two memories per query, so that every weight of the budget policy's attention has a real
    gradient: with one, its query and key gradients are zero in exact arithmetic and each path
    leaves different float noise there, which Adam's first step turns into +-lr (see
    ``_params(defined_only=True)`` for the one weight that never has a gradient)."""
    common = ("train.group_size=4", "train.micro_batch_size=6", "train.warmup_steps=0", "train.eval_split=val",
              "train.save_every=1", "train.eval_batch_size=16", "memory.top_z=2")
    _train_cli(tiny_setup, tmp_path / "one", "train.max_steps=2", *common, "train.batch_size=8",
               f"train.record_rollouts={tmp_path}/rec")
    env = _env(TORCH_EXTENSIONS_DIR=str(EXT_CACHE))
    launcher = _launcher(tmp_path, stage)
    two = ("train.max_steps=2", *common, "train.batch_size=4", f"train.replay_rollouts={tmp_path}/rec")
    _train_cli(tiny_setup, tmp_path / "ds1", *two, "train.stop_after_steps=1", env=env, launcher=launcher)
    (m1, _), (m2,) = [r for r in _metrics(tmp_path / "one") if "eval" not in r], \
        [r for r in _metrics(tmp_path / "ds1") if "eval" not in r]
    assert m2["step"] == 1 and m2["processes"] == 2 and m2["distributed_type"] == "DEEPSPEED"
    for key, value in m1.items():
        if not key.startswith(("time/", "processes", "distributed_type")):
            assert m2[key] == (pytest.approx(value, rel=1e-5, abs=1e-7) if isinstance(value, float) else value), key
    one = _params(tmp_path / "one" / "checkpoints" / "step_000001", defined_only=True)
    ds = _params(tmp_path / "ds1" / "checkpoints" / "step_000001", defined_only=True)
    assert set(one) == set(ds)
    for name in one:
        assert ds[name].shape == one[name].shape, name  # ZeRO-3 shards must be gathered for saving
        assert torch.allclose(one[name], ds[name], atol=1e-5), name
    assert any(v.abs().max() > 0 for k, v in ds.items() if "lora_B" in k), "the step must move the adapter"

    # Exact resume: ZeRO stopped after 1 of 2 steps and resumed == ZeRO 2 steps straight through
    # (the sharded AdamW moments and fp32 master weights are in the checkpoint).
    p = _train_cli(tiny_setup, tmp_path / "ds1", *two, env=env, launcher=launcher)
    assert "resumed from" in p.stderr
    _train_cli(tiny_setup, tmp_path / "ds2", *two, env=env, launcher=launcher)
    resumed, straight = _params(tmp_path / "ds1" / "final"), _params(tmp_path / "ds2" / "final")
    for name in straight:
        assert torch.allclose(resumed[name], straight[name], atol=1e-6), name
    assert any(not torch.equal(resumed[k], ds[k]) for k in ds), "the second step must move the weights"
    _same_metrics([r for r in _metrics(tmp_path / "ds1") if "eval" not in r],
                  [r for r in _metrics(tmp_path / "ds2") if "eval" not in r])
