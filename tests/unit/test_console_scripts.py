"""The console scripts of pyproject.toml's [project.scripts]: each target imports, each installed
script answers ``--help`` naming itself, and ``elasticmem-prepare`` writes the tiny data set.

    OMP_NUM_THREADS=1 python -m pytest tests/unit/test_console_scripts.py -q

The installed scripts sit next to the interpreter (``pip install -e .`` puts them there); an
install older than [project.scripts] has none, and those checks skip with the reason.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
STAGES = ("prepare", "build-bank", "warmup", "train", "eval", "serve")


def _installed(name: str) -> Path:
    exe = Path(sys.executable).parent / name
    if not exe.is_file():
        pytest.skip(f"{name} is not installed next to {sys.executable} (an install older than "
                    f"[project.scripts]: pip install -e '.[dev,serve]')")
    return exe


def _env() -> dict[str, str]:
    # the checkout's package, not a copy that another install may have put first on the path
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def test_every_pipeline_stage_has_a_script():
    assert sorted(SCRIPTS) == sorted(f"elasticmem-{s}" for s in STAGES)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_target_is_a_main_taking_argv(name):
    module, _, func = SCRIPTS[name].partition(":")
    target = getattr(importlib.import_module(module), func)
    assert callable(target)
    assert list(inspect.signature(target).parameters) == ["argv"], SCRIPTS[name]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_installed_script_answers_help_naming_itself(name):
    if name == "elasticmem-serve":
        pytest.importorskip("fastapi", reason="elasticmem-serve needs the serve extra")
    res = subprocess.run([str(_installed(name)), "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(f"usage: {name} "), res.stdout[:300]


def test_prepare_writes_the_tiny_data_set(tmp_path):
    out = tmp_path / "data"
    res = subprocess.run([str(_installed("elasticmem-prepare")), "synthetic", "--config", "configs/tiny.yaml",
                          f"data.dir={out}"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["stats.json", "test.jsonl", "train.jsonl", "val.jsonl"]
    stats = json.loads((out / "stats.json").read_text())
    for split in ("train", "val", "test"):
        rows = [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
        assert len(rows) == stats["splits"][split]["examples"] > 0, split
        assert f"{split:5s} {len(rows):5d} questions" in res.stdout
    # 200 tiny histories split 160 / 20 / 20 (configs/tiny.yaml data.synthetic.num_histories)
    assert [stats["splits"][s]["histories"] for s in ("train", "val", "test")] == [160, 20, 20]
