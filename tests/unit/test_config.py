"""Config system: presets, dotted overrides, type checks, unknown keys, docs for every key.

    pytest tests/unit/test_config.py
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from elasticmem.config import Config, load_config
from elasticmem.utils.configuration import ConfigError, describe, field_docs, to_yaml
from elasticmem.utils.options import parse_cli

ROOT = Path(__file__).resolve().parents[2]


def _dataclasses(cls, seen=None):
    seen = seen if seen is not None else []
    seen.append(cls)
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp) and tp not in seen:
            _dataclasses(tp, seen)
    return seen


def test_every_key_is_documented():
    for cls in _dataclasses(Config):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_presets_load(preset):
    cfg = load_config(ROOT / "configs" / preset)
    assert isinstance(cfg, Config)


def test_override_types_and_nesting():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["bank.n_cache=12", "bank.index.type=hnsw",
                                                  "bank.splits=[train]", "backbone.tiny.seed=3", "seed=7"])
    assert cfg.bank.n_cache == 12 and cfg.bank.index.type == "hnsw"
    assert cfg.bank.splits == ["train"] and cfg.backbone.tiny.seed == 3 and cfg.seed == 7
    # The preset's values survive where not overridden.
    assert cfg.backbone.name_or_path == "tiny" and cfg.chunking.max_tokens == 64


def test_yaml_words_read_as_booleans_are_kept_as_string_choices(tmp_path):
    """YAML 1.1 reads ``no`` as False; a key whose choices are strings gets the word back."""
    cfg = load_config(ROOT / "configs/tiny.yaml", ["train.mixed_precision=no"])
    assert cfg.train.mixed_precision == "no"
    (tmp_path / "p.yaml").write_text("train:\n  mixed_precision: no\n")
    assert load_config(tmp_path / "p.yaml").train.mixed_precision == "no"
    with pytest.raises(ConfigError, match="mixed_precision"):  # True has no word among the choices
        load_config(ROOT / "configs/tiny.yaml", ["train.mixed_precision=yes"])


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'bank\.n_cahce'.*did you mean 'bank\.n_cache'"):
        load_config(None, ["bank.n_cahce=3"])
    with pytest.raises(ConfigError, match=r"'bank\.index\.nprob'.*'bank\.index\.nprobe'"):
        load_config(None, ["bank.index.nprob=3"])


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("bank:\n  batchsize: 3\n")
    with pytest.raises(ConfigError, match=r"'bank\.batchsize'.*'bank\.batch_size'"):
        load_config(p)


@pytest.mark.parametrize(
    "override, message",
    [
        ("bank.n_cache=abc", "must be an integer"),
        ("bank.index.type=annoy", "must be one of"),
        ("bank.overwrite=3", "true or false"),
        ("bank.splits=train", "must be a list"),
        ("bank", "key=value"),
        ("bank.n_cache.x=1", "not a section"),
    ],
)
def test_bad_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_roundtrip_yaml(tmp_path):
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["bank.batch_size=3"])
    p = tmp_path / "saved.yaml"
    p.write_text(to_yaml(cfg))
    assert load_config(p) == cfg


def test_cli_help_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        parse_cli(Config, ["--help"], prog="x")
    out = capsys.readouterr().out
    for key, *_ in describe(Config):
        assert key in out


def test_cli_bad_key_exits_with_message(capsys):
    with pytest.raises(SystemExit) as e:
        parse_cli(Config, ["bank.dirr=/tmp/x"], prog="x")
    assert e.value.code == 2
    assert "did you mean 'bank.dir'" in capsys.readouterr().err


def test_system_memory_settings_layer_checkpoint_preset_and_overrides(tmp_path):
    """memory.* overrides of the command line or a variant apply on top of the checkpoint's (or
    config's) memory settings, and the eval.system preset last: an override of a key the preset
    sets is ignored with a warning (a comparison's memory.top_z must not give no_memory memories)."""
    import json

    from elasticmem.systems import memory_config

    cfg = load_config(ROOT / "configs/tiny.yaml", ["eval.system=no_memory", "memory.top_z=3"])
    assert cfg.memory.top_z == 3
    with pytest.warns(UserWarning, match="ignoring memory.top_z=3"):
        m = memory_config(cfg, ["memory.top_z=3", "memory.max_new_tokens=2"])
    assert (m.top_z, m.max_new_tokens) == (0, 2)
    cfg = load_config(ROOT / "configs/tiny.yaml", ["eval.system=text_rag"])
    m = memory_config(cfg, ["memory.top_z=3", "train.lr=1"])
    assert (m.injection, m.top_z, m.retrieval) == ("text", 3, cfg.memory.retrieval)
    saved = dataclasses.asdict(dataclasses.replace(cfg.memory, top_z=7, separator="|"))
    (tmp_path / "elasticmem_config.json").write_text(json.dumps({"memory": saved}))
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"eval.checkpoint={tmp_path}", "eval.system=full_context"])
    with pytest.warns(UserWarning, match="ignoring memory.retrieval=frozen"):
        m = memory_config(cfg, ["memory.policy.clip_budget=2", "memory.retrieval=frozen"])
    assert m.separator == "|" and m.retrieval == "recent" and m.injection == "text"
    assert m.policy.clip_budget == 2
    with pytest.raises(FileNotFoundError, match="not a saved ElasticMem model"):
        memory_config(load_config(ROOT / "configs/tiny.yaml", [f"eval.checkpoint={tmp_path}/nope"]), [])


def test_config_does_not_import_the_training_layers():
    """elasticmem.config is the bottom layer: importing it must not pull in grpo (which imports config)."""
    import subprocess
    import sys

    code = ("import sys, elasticmem.config; bad = sorted(m for m in sys.modules if m.startswith('elasticmem.grpo')); "
            "assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize("text,value", [("1e-3", 1e-3), ("2E-5", 2e-5), ("3", 3.0), ("-1.5e+2", -150.0)])
def test_float_keys_take_exponent_notation(text, value):
    """YAML 1.1 reads `1e-3` (no dot) as a string; `train.lr=1e-3` must still be the number."""
    assert load_config(None, [f"train.lr={text}"]).train.lr == value
    with pytest.raises(ConfigError, match="must be a number"):
        load_config(None, ["train.lr=fast"])


def test_the_old_model_section_still_loads_as_backbone_with_a_warning(tmp_path):
    """``model.*`` (the section's name up to 0.1) is read as ``backbone.*``, in a preset, a saved
    checkpoint's config and an override, each with a FutureWarning naming the new key."""
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  name_or_path: smollm2\n  device: cpu\nmemory:\n  top_z: 3\n")
    with pytest.warns(FutureWarning, match=r"'model' is now 'backbone'"):
        cfg = load_config(str(old))
    assert (cfg.backbone.name_or_path, cfg.backbone.device, cfg.memory.top_z) == ("smollm2", "cpu", 3)
    with pytest.warns(FutureWarning, match=r"'model.dtype' is now 'backbone.dtype'"):
        cfg = load_config(str(old), ["model.dtype=float32"])
    assert cfg.backbone.dtype == "float32" and cfg.backbone.name_or_path == "smollm2"
    saved = tmp_path / "saved.yaml"  # what a checkpoint saves now: the new name, read without a warning
    saved.write_text(to_yaml(cfg))
    assert "backbone:" in saved.read_text() and "\nmodel:" not in saved.read_text()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(str(saved)) == cfg
    both = tmp_path / "both.yaml"
    both.write_text("model:\n  device: cpu\nbackbone:\n  device: cuda\n")
    with pytest.raises(ConfigError, match="same section"):
        load_config(str(both))
    with pytest.raises(ConfigError, match="backbone.no_such"):
        with pytest.warns(FutureWarning):
            load_config(None, ["model.no_such=1"])


def test_no_memory_is_spelled_memory_top_z_0_and_the_old_train_key_is_read_as_it():
    """``train.use_memory=false`` (0.1) is ``memory.top_z=0``, with a warning: one config, whichever was written."""
    with pytest.warns(FutureWarning, match=r"train.use_memory=false is memory.top_z=0"):
        old = load_config("configs/tiny.yaml", ["train.use_memory=false"])
    new = load_config("configs/tiny.yaml", ["memory.top_z=0"])
    assert old == new and old.memory.top_z == 0 and old.train.use_memory
    assert load_config("configs/tiny.yaml").memory.top_z > 0
