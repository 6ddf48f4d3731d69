"""train.trackers=[wandb] logs the run to Weights & Biases, offline when no API key is known (or
WANDB_MODE=offline): the offline run's history holds metrics.jsonl's values at every step, and its
config is the run's.

    OMP_NUM_THREADS=1 python -m pytest tests/integration/test_wandb_tracker.py -q

The offline run is read back from its ``run-*.wandb`` file (wandb's record log: leveldb's log
format of 32 KiB blocks after a 7-byte ``:W&B`` header, each record a ``wandb_internal_pb2.Record``
protobuf); wandb 0.31 writes no wandb-summary.json offline and has no reader for it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from conftest import live_children
from test_train import _cfg, _metrics, tiny_setup  # noqa: F401  (fixture)

from elasticmem.grpo.trackers import tracker_init_kwargs, wandb_logged_in

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> list:
    """Every record of a ``.wandb`` file, parsed."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, pos, buf = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk, pos = data[pos + _HEADER:pos + _HEADER + length], pos + _HEADER + length
        if kind in (_FULL, _LAST):
            rec = pb.Record()
            rec.ParseFromString(buf + chunk if kind == _LAST else chunk)
            out.append(rec)
            buf = b""
        else:
            buf = chunk if kind == _FIRST else buf + chunk
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _offline_run(root: Path) -> tuple[dict[int, dict], dict]:
    """(history by step, config) of the one offline run under ``root/wandb``."""
    (run_file,) = (root / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for rec in _records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history[rec.history.step.num] = {_key(i): json.loads(i.value_json) for i in rec.history.item}
        elif kind == "run":
            config = {_key(i): json.loads(i.value_json) for i in rec.run.config.update}
    return history, config


@pytest.mark.parametrize("mode", ["WANDB_MODE=offline", "no API key"])
def test_wandb_tracker_logs_the_metrics_offline(tiny_setup, tmp_path, monkeypatch, mode):
    """Every logged step's numbers reach the W&B run; the run is offline and lands in WANDB_DIR,
    else beside metrics.jsonl."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[dev]' or '.[tracking]')")
    from elasticmem.grpo import trainer
    from elasticmem.utils.configuration import to_dict

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login, no user settings
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    if mode == "WANDB_MODE=offline":
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    cfg = _cfg(tiny_setup, out, "train.max_steps=2", "train.eval_split=", "train.trackers=[wandb]")
    trainer.train(cfg)
    # wandb's writer has exited, so the run file is whole: Run.finish alone returns before its
    # service process flushes it (CI once read a run file that failed to parse)
    assert not [n for n in live_children(os.getpid()).values() if n.startswith("wandb")], live_children(os.getpid())
    history, config = _offline_run(tmp_path / "wb" if mode == "WANDB_MODE=offline" else out)
    rows = _metrics(out)
    assert sorted(history) == [r["step"] for r in rows] == [1, 2]
    for r in rows:
        logged = history[r["step"]]
        for key, value in r.items():
            if isinstance(value, (int, float)) and key != "step":
                assert logged[key] == pytest.approx(value, rel=1e-12, abs=0, nan_ok=True), (key, r["step"])
    assert history[2]["reward/mean"] == rows[-1]["reward/mean"] and history[2]["loss"] == rows[-1]["loss"]
    # the run's config is the training config (wandb stores each top-level key with its value)
    assert {k: v for k, v in config.items() if not k.startswith("_")} == json.loads(json.dumps(to_dict(cfg)))


def test_wandb_mode_follows_the_environment_and_the_login(tmp_path):
    cfg = _cfg(tmp_path, tmp_path / "run", "train.trackers=[tensorboard, wandb]")
    home = tmp_path / "home"
    home.mkdir()
    netrc = home / ".netrc"

    def kw(**env):
        return tracker_init_kwargs(cfg, {"NETRC": str(netrc), **env})["wandb"]

    assert kw()["mode"] == "offline" and kw()["dir"] == str(tmp_path / "run")
    assert "mode" not in kw(WANDB_MODE="online") and "mode" not in kw(WANDB_API_KEY="k")
    assert "dir" not in kw(WANDB_DIR="/somewhere")
    netrc.write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert wandb_logged_in({"NETRC": str(netrc)}) and "mode" not in kw()
    assert kw(WANDB_BASE_URL="https://wandb.example.org")["mode"] == "offline"  # a login for another host
    netrc.write_text("machine api.wandb.ai login user\n")  # no password: no key
    assert kw()["mode"] == "offline"
    assert tracker_init_kwargs(_cfg(tmp_path, tmp_path / "run", "train.trackers=[tensorboard]"), {}) == {}


def test_a_resumed_run_continues_the_same_wandb_run(tiny_setup, tmp_path, monkeypatch):
    """A 4-step run stopped after 2 (train.stop_after_steps), then resumed: both starts log to one W&B
    run id (the one kept in train.output_dir); the stopped start closed its run file whole, with
    steps 1 and 2, and the resumed part holds steps 3 and 4, equal to metrics.jsonl."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[dev]' or '.[tracking]')")
    from elasticmem.grpo import trainer
    from elasticmem.grpo.trackers import RUN_ID_FILE

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    for part in ("train.stop_after_steps=2", "train.stop_after_steps=0"):
        trainer.train(_cfg(tiny_setup, out, "train.max_steps=4", part, "train.save_every=4", "train.eval_split=",
                           "train.trackers=[wandb]"))
        assert not [n for n in live_children(os.getpid()).values() if n.startswith("wandb")], part
    run_id = (out / RUN_ID_FILE).read_text().strip()
    # offline-run-<time>-<id>, with "-1" appended when both starts fall in the same second
    runs = sorted((out / "wandb").glob("offline-run-*"), key=lambda r: (r.name.split("-")[2], len(r.name)))
    assert len(runs) == 2 and all(r.name.split("-")[3] == run_id for r in runs), (run_id, [r.name for r in runs])
    rows = {r["step"]: r for r in _metrics(out)}
    assert sorted(rows) == [1, 2, 3, 4]
    for run, steps in zip(runs, ([1, 2], [3, 4])):
        history = {}
        for rec in _records(next(run.glob("run-*.wandb"))):
            if rec.WhichOneof("record_type") == "history":
                history[rec.history.step.num] = {_key(i): json.loads(i.value_json) for i in rec.history.item}
        assert sorted(history) == steps, run.name
        for step in steps:
            assert history[step]["loss"] == pytest.approx(rows[step]["loss"], rel=1e-12, abs=0), step
