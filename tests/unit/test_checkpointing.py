"""No-pickle serialisation of nested optimizer states (DeepSpeed ZeRO shards).

    pytest tests/unit/test_checkpointing.py
"""

from __future__ import annotations

import enum
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from elasticmem.utils.checkpointing import nested_from_files, nested_to_files


class _Stage(enum.Enum):
    gradients = 2


class _Scaler:
    def __init__(self, scale: float):
        self.cur_scale, self.dynamic, self.hook = scale, False, lambda: None


def test_nested_state_round_trips_through_safetensors_and_json(tmp_path):
    saved = {
        "loss_scaler": _Scaler(1024.0), "zero_stage": _Stage.gradients, "overflow": False, "clip": 1.0,
        "base": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5)}},
                 "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "fused": None}]},
        "fp32": [torch.randn(5), torch.randn(2)],
    }
    tensors, meta = nested_to_files(saved)
    save_file(tensors, tmp_path / "t.safetensors")
    (tmp_path / "m.json").write_text(json.dumps(meta))
    live = {"loss_scaler": _Scaler(1.0), "zero_stage": _Stage.gradients, "base": {"state": {}}}
    back = nested_from_files(load_file(tmp_path / "t.safetensors"), json.loads((tmp_path / "m.json").read_text()), live)

    assert back["loss_scaler"] is live["loss_scaler"] and back["loss_scaler"].cur_scale == 1024.0
    assert back["zero_stage"] is _Stage.gradients and back["overflow"] is False and back["clip"] == 1.0
    assert list(back["base"]["state"]) == [0]  # int keys stay ints
    assert torch.equal(back["base"]["state"][0]["exp_avg"], saved["base"]["state"][0]["exp_avg"])
    assert back["base"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert all(torch.equal(a, b) for a, b in zip(back["fp32"], saved["fp32"]))


def test_an_object_without_a_live_counterpart_is_refused():
    tensors, meta = nested_to_files({"loss_scaler": _Scaler(2.0)})
    with pytest.raises(ValueError, match="_Scaler"):
        nested_from_files(tensors, meta, {})
