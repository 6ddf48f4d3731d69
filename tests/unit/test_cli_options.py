"""Every command's own options (not config keys) are dotted ``SECTION.key=value`` arguments and flags.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_cli_options.py

For each command with such options (build_bank ``build.*``, evaluate ``--limit`` = ``eval.limit``,
the ladder ``ladder.*`` and its ``pool`` ``pool.*``, the retrieval map ``map.*``, prepare
``prepare.*``, the server ``serve.*``): the dotted form and the flag form parse to the same
options; an unknown dotted key exits 2 naming it and the valid keys; an option given both ways is
an error; a required one missing is an error that names both forms; ``--help`` lists the dotted
keys with their docstrings. The commands are stopped once their arguments are parsed, before any
model is loaded (``pool`` runs: it only reads folders).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from elasticmem.utils import options as cli_options
from elasticmem.utils.options import Flag, Options, option_keys, parse_options

REPO = Path(__file__).resolve().parents[2]
PRESET = ["--config", str(REPO / "configs/tiny.yaml")]


class Parsed(Exception):
    """Raised where a command stops in these tests: its arguments were parsed."""


def _stop_after_parse(monkeypatch, *modules) -> None:
    """Make ``parse_cli`` (the options module's, and each module's import of it) raise ``Parsed``
    with what it returned, so a command's main stops before any model work."""
    real = cli_options.parse_cli

    def parse_cli(*args, **kwargs):
        raise Parsed(real(*args, **kwargs))

    monkeypatch.setattr(cli_options, "parse_cli", parse_cli)
    for m in modules:
        monkeypatch.setattr(m, "parse_cli", parse_cli)


def _parsed(monkeypatch, main, argv, *modules):
    """(config, namespace) of a parse_cli command's command line."""
    _stop_after_parse(monkeypatch, *modules)
    with pytest.raises(Parsed) as e:
        main(argv)
    return e.value.args[0]


def _exit_message(capsys, call) -> str:
    with pytest.raises(SystemExit) as e:
        call()
    assert e.value.code == 2
    return capsys.readouterr().err


def _help(capsys, call) -> str:
    with pytest.raises(SystemExit) as e:
        call()
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps the help text


# --------------------------------------------------------------------------- build_bank: build.*


def test_build_append_as_flag_or_key(monkeypatch, capsys):
    from elasticmem.bank import cli

    monkeypatch.setattr(cli, "_append", lambda cfg, prog: 42)  # the append itself needs a model
    assert cli.main([*PRESET, "--append"]) == 42
    assert cli.main([*PRESET, "build.append=true"]) == 42
    _, args = _parsed(monkeypatch, cli.main, PRESET, cli)
    assert args.options == cli.BuildOptions(append=False)
    err = _exit_message(capsys, lambda: cli.main([*PRESET, "build.apend=true"]))
    assert "unknown option key 'build.apend'" in err and "did you mean 'build.append'" in err
    err = _exit_message(capsys, lambda: cli.main([*PRESET, "--append", "build.append=false"]))
    assert "'build.append' given twice" in err and "--append" in err
    err = _exit_message(capsys, lambda: cli.main([*PRESET, "build.append=3"]))
    assert "config key 'build.append' must be true or false, got 3" in err  # the config keys' message
    text = _help(capsys, lambda: cli.main(["--help"]))
    assert "build.append (bool, default False): Add the data's new chunks to the bank at bank.dir" in text


# --------------------------------------------------------------------------- evaluate: --limit is eval.limit


def test_eval_limit_flag_is_the_config_key(monkeypatch, capsys):
    from elasticmem.apps import evaluate

    runs = [_parsed(monkeypatch, evaluate.main, [*PRESET, *form], evaluate)
            for form in (["--limit", "7"], ["eval.limit=7"], ["limit=7"])]
    assert {cfg.eval.limit for cfg, _ in runs} == {7}
    assert all("eval.limit=7" in args.overrides for _, args in runs)  # the variants get it too
    err = _exit_message(capsys, lambda: evaluate.main([*PRESET, "--limit", "7", "limit=3"]))
    assert "config key 'eval.limit' given twice" in err
    text = _help(capsys, lambda: evaluate.main(["--help"]))
    assert "--limit INT eval.limit (int, default 0): Evaluate only the first N examples" in text


# --------------------------------------------------------------------------- retrieval map: map.*


MAP_FLAGS = ["--out", "m.safetensors", "--kind", "mlp", "--dim", "8", "--split", "train", "--split", "val",
             "--no-residual", "--lr", "1e-3", "--weight-decay", "0", "--negatives", "all", "--query-batch", "4"]
MAP_KEYS = ["map.out=m.safetensors", "map.kind=mlp", "map.d_out=8", "map.splits=[train,val]", "map.residual=false",
            "map.lr=1e-3", "map.weight_decay=0", "map.negatives=all", "map.query_batch=4"]


def test_retrieval_map_options_as_flags_or_keys(monkeypatch, capsys):
    from elasticmem.warmup import retrieval_map as rm

    by_flag = _parsed(monkeypatch, rm.main, [*PRESET, *MAP_FLAGS])[1].options
    by_key = _parsed(monkeypatch, rm.main, [*PRESET, *MAP_KEYS[:4], "seed=5", *MAP_KEYS[4:]])[1].options
    assert by_flag == by_key
    assert (by_key.kind, by_key.d_out, by_key.splits, by_key.residual, by_key.lr) == ("mlp", 8, ["train", "val"],
                                                                                     False, 1e-3)
    mixed = _parsed(monkeypatch, rm.main, [*PRESET, "map.out=m.safetensors", "--kind", "mlp"])[1].options
    assert (mixed.out, mixed.kind, mixed.splits) == ("m.safetensors", "mlp", ["train"])


def test_retrieval_map_errors(monkeypatch, capsys):
    from elasticmem.warmup import retrieval_map as rm

    _stop_after_parse(monkeypatch)
    for form in ([], ["--kind", "mlp"], ["map.kind=mlp"]):  # the required map.out, in neither form
        err = _exit_message(capsys, lambda: rm.main([*PRESET, *form]))
        assert "option 'map.out' is required: give --out VALUE or map.out=VALUE" in err
    err = _exit_message(capsys, lambda: rm.main([*PRESET, "map.out=x", "map.epoch=3"]))
    assert "unknown option key 'map.epoch'" in err and "did you mean 'map.epochs'" in err and "map.query_batch" in err
    err = _exit_message(capsys, lambda: rm.main([*PRESET, "map.seed=3", "map.out=x"]))  # the config's seed is it
    assert "unknown option key 'map.seed'" in err
    err = _exit_message(capsys, lambda: rm.main([*PRESET, "--out", "x", "map.out=y"]))
    assert "'map.out' given twice, as --out VALUE and as map.out=..." in err
    err = _exit_message(capsys, lambda: rm.main([*PRESET, "map.out=x", "map.kind=cubic"]))
    assert "config key 'map.kind' must be one of ['standardize', 'linear', 'mlp'], got 'cubic'" in err
    err = _exit_message(capsys, lambda: rm.main([*PRESET, "map.out=x", "map.epochs=many"]))
    assert "config key 'map.epochs' must be an integer" in err
    text = _help(capsys, lambda: rm.main(["--help"]))
    assert "--out OUT map.out (str, required): The map file to write (.safetensors)." in text
    assert "--dim INT map.d_out (int, default 256)" in text and "--residual, --no-residual map.residual" in text


# --------------------------------------------------------------------------- ladder: ladder.*; pool: pool.*


def _ladder_call(monkeypatch, argv) -> list[str]:
    """The evaluate.py arguments the ladder passes on (evaluate.py itself is not run)."""
    from elasticmem.apps import evaluate, ladder

    calls = []
    monkeypatch.setattr(evaluate, "main", lambda a: calls.append(a) or 1)  # 1: the ladder stops there
    assert ladder.main(argv) == 1
    return calls[0]


def test_ladder_options_as_flags_or_keys(monkeypatch, capsys):
    from elasticmem.apps import ladder

    common = [*PRESET, "eval.checkpoint=C", "--limit", "3"]
    by_flag = _ladder_call(monkeypatch, [*common, "--caps", "8,16", "--rungs", "no_memory,learned_cap8",
                                         "--text-checkpoint", "T"])
    for keys in (["ladder.caps=8,16", "ladder.rungs=no_memory,learned_cap8", "ladder.text_checkpoint=T"],
                 ["ladder.caps=[8,16]", "ladder.rungs=[no_memory,learned_cap8]", "--text-checkpoint", "T"]):
        assert _ladder_call(monkeypatch, [*common, *keys]) == by_flag
    assert by_flag[:-1] == common  # the rest goes to evaluate.py as it was given
    assert json.loads(by_flag[-1].removeprefix("eval.variants=")) == {
        "no_memory": ["eval.system=no_memory"], "learned_cap8": ["memory.policy.token_cap=8"]}
    err = _exit_message(capsys, lambda: ladder.main([*common, "ladder.cap=8"]))
    assert "unknown option key 'ladder.cap'" in err and "ladder.caps" in err and "ladder.text_checkpoint" in err
    err = _exit_message(capsys, lambda: ladder.main([*common, "--caps", "8", "ladder.caps=16"]))
    assert "'ladder.caps' given twice" in err
    err = _exit_message(capsys, lambda: ladder.main([*common, "ladder.caps=eight"]))
    assert "config key 'ladder.caps[0]' must be an integer" in err
    text = _help(capsys, lambda: ladder.main(["--help"]))
    assert "ladder.caps (list[int], default []): Token caps of the cost dial" in text


def test_pool_options_as_flags_or_keys(tmp_path, capsys):
    from elasticmem.apps import ladder

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    pairs = "latent_uniform:latent_learned,no_memory:latent_learned"
    assert ladder.main(["pool", str(a), str(b), "--pairs", pairs, "--out", str(tmp_path / "flag.md")]) == 0
    assert ladder.main(["pool", f"pool.dirs=[{a},{b}]", f"pool.pairs={pairs}", f"pool.out={tmp_path}/key.md"]) == 0
    assert ladder.main(["pool", str(a), str(b), f"pool.pairs=[{pairs}]", "--out", str(tmp_path / "mix.md")]) == 0
    flag = (tmp_path / "flag.md").read_text()
    assert str(a) in flag and flag == (tmp_path / "key.md").read_text() == (tmp_path / "mix.md").read_text()
    capsys.readouterr()
    for argv in (["pool"], ["pool", "--out", "x.md"], ["pool", "pool.out=x.md"]):
        err = _exit_message(capsys, lambda: ladder.main(argv))
        assert "option 'pool.dirs' is required: give DIR ... or pool.dirs=VALUE" in err
    err = _exit_message(capsys, lambda: ladder.main(["pool", str(a), f"pool.dirs=[{b}]"]))
    assert "'pool.dirs' given twice, as DIR ... and as pool.dirs=..." in err
    err = _exit_message(capsys, lambda: ladder.main(["pool", str(a), "pool.pair=x:y"]))
    assert "unknown option key 'pool.pair'" in err and "did you mean 'pool.pairs'" in err
    text = _help(capsys, lambda: ladder.main(["pool", "--help"]))
    assert "pool.pairs (list[str]" in text and "REFERENCE:SYSTEM folder names of each ladder to compare" in text


# --------------------------------------------------------------------------- prepare: prepare.*


def _prepared(monkeypatch, argv) -> dict:
    """What ``elasticmem-prepare`` would hand the dataset's loader."""
    from elasticmem.data import prepare

    def loader(*args):
        raise Parsed(args)

    monkeypatch.setattr(prepare, "prepare_real", loader)
    with pytest.raises(Parsed) as e:
        prepare.main(argv)
    return e.value.args[0]


def test_prepare_options_as_flags_or_keys(monkeypatch, capsys):
    from elasticmem.data import prepare

    by_flag = _prepared(monkeypatch, ["locomo-qa", "--input", "a.json", "b.json", "--out", "o", "--seed", "1",
                                      "--skip-invalid", "--splits", "s"])
    assert by_flag == ("locomo-qa", ["a.json", "b.json"], "o", 1, True, "s", False)
    assert _prepared(monkeypatch, ["locomo-qa", "--input", "a.json", "--out", "o", "--via-datasets"])[-1] is True
    assert _prepared(monkeypatch, ["locomo-qa", "--input", "a.json", "--out", "o", "prepare.via_datasets=true"])[-1] is True
    assert _prepared(monkeypatch, ["locomo-qa", "prepare.input=[a.json,b.json]", "prepare.out=o", "prepare.seed=1",
                                   "prepare.skip_invalid=true", "prepare.splits=s"]) == by_flag
    # a list flag takes every value after it: the dotted option after --input's paths is still one
    assert _prepared(monkeypatch, ["locomo-qa", "--input", "a.json", "b.json", "prepare.out=o", "--seed", "1",
                                   "--skip-invalid", "prepare.splits=s"]) == by_flag
    for argv in (["locomo-qa", "--out", "o"], ["locomo-qa", "prepare.out=o"]):
        err = _exit_message(capsys, lambda: prepare.main(argv))
        assert "option 'prepare.input' is required: give --input VALUE or prepare.input=VALUE" in err
    err = _exit_message(capsys, lambda: prepare.main(["locomo-qa", "--input", "a", "--out", "o", "prepare.ot=p"]))
    assert "unknown option key 'prepare.ot'" in err and "did you mean 'prepare.out'" in err
    err = _exit_message(capsys, lambda: prepare.main(["locomo-qa", "--input", "a", "--out", "o", "data.dir=p"]))
    assert "unknown option key 'data.dir'" in err  # no config here: only its own options
    err = _exit_message(capsys, lambda: prepare.main(["locomo-qa", "--input", "a", "--out", "o", "prepare.out=p"]))
    assert "'prepare.out' given twice" in err
    text = _help(capsys, lambda: prepare.main(["locomo-qa", "--help"]))
    assert "prepare.skip_invalid (bool, default False): Log and count invalid records" in text


# --------------------------------------------------------------------------- serve: serve.*


def test_serve_options_as_flags_or_keys(capsys):
    from elasticmem.serve.cli import parse_args

    flags = ["--bank", "b", "--port", "8001", "--system", "text_rag", "--max-batch", "4", "--batch-window-ms", "2",
             "--slice-ms", "none", "--no-batching", "--max-queue", "64", "--max-new-tokens-limit", "9",
             "--tenant-max-rows", "none", "--no-access-log", "--log-level", "warning"]
    keys = ["serve.bank=b", "serve.port=8001", "serve.system=text_rag", "serve.batching.max_batch=4",
            "serve.batching.window_ms=2", "serve.batching.slice_ms=null", "serve.no_batching=true",
            "serve.limits.max_queue=64", "serve.limits.max_new_tokens=9", "serve.limits.tenant_max_rows=null",
            "serve.access_log=false", "serve.log_level=warning"]
    by_flag, overrides = parse_args([*flags, "backbone.device=cpu"])
    by_key, key_overrides = parse_args(["backbone.device=cpu", *keys])
    assert by_flag == by_key and overrides == key_overrides == ["backbone.device=cpu"]  # the rest: the model's
    assert (by_key.port, by_key.batching.window_ms, by_key.batching.slice_ms, by_key.limits.max_queue,
            by_key.limits.max_new_tokens, by_key.limits.tenant_max_rows, by_key.access_log) == (8001, 2.0, None, 64,
                                                                                             9, None, False)
    for argv in ([], ["--port", "1"], ["serve.port=1", "backbone.device=cpu"]):
        err = _exit_message(capsys, lambda: parse_args(argv))
        assert "option 'serve.bank' is required: give --bank VALUE or serve.bank=VALUE" in err
    err = _exit_message(capsys, lambda: parse_args(["--bank", "b", "serve.limits.max_qeue=3"]))
    assert "unknown option key 'serve.limits.max_qeue'" in err and "did you mean 'serve.limits.max_queue'" in err
    err = _exit_message(capsys, lambda: parse_args(["--bank", "b", "--port", "1", "serve.port=2"]))
    assert "'serve.port' given twice, as --port VALUE and as serve.port=..." in err
    err = _exit_message(capsys, lambda: parse_args(["--bank", "b", "serve.port=http"]))
    assert "config key 'serve.port' must be an integer, got 'http'" in err
    text = _help(capsys, lambda: parse_args(["--help"]))
    assert "--max-queue INT serve.limits.max_queue (int, default 1024): Most requests waiting for the model" in text
    assert "--port INT serve.port (int, default 8000): The port to listen on." in text


def test_serve_main_checks_ranges_in_either_form(capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from elasticmem.serve.cli import main

    for argv in (["--max-queue", "0"], ["serve.limits.max_queue=0"]):
        assert main(["--bank", "b", *argv]) == 2
        assert "--max-queue (serve.limits.max_queue) must be > 0" in capsys.readouterr().err


# --------------------------------------------------------------------------- the helper itself


def test_every_option_has_a_docstring_and_a_distinct_flag():
    import importlib

    specs = []
    for mod in ("elasticmem.bank.cli", "elasticmem.apps.ladder", "elasticmem.warmup.retrieval_map",
                "elasticmem.data.prepare", "elasticmem.serve.cli"):
        specs += [v for v in vars(importlib.import_module(mod)).values() if isinstance(v, Options)]
    assert {s.section for s in specs} == {"build", "ladder", "pool", "map", "prepare", "serve"}
    for spec in specs:
        undocumented = [o.key for o in cli_options._option_list(spec) if len(o.doc) < 10]
        assert not undocumented, undocumented
        flags = [f for f in option_keys(spec).values() if f]
        assert len(flags) == len(set(flags)), spec.section


def test_list_forms_and_a_default_true_switch():
    from dataclasses import dataclass, field

    @dataclass
    class Demo:
        names: list[str]
        """Names, several after one flag."""
        caps: list[int] = field(default_factory=list)
        """Caps, comma-separated."""
        tags: list[str] = field(default_factory=list)
        """Tags, one per flag."""
        cap: int | None = 4
        """A cap; none = no cap."""
        on: bool = True
        """A switch that is on unless turned off."""

    spec = Options("demo", Demo, flags={"caps": Flag(sep=","), "tags": Flag(repeat=True)})

    def parse(argv):
        return parse_options(argparse.ArgumentParser(prog="demo"), spec, argv)[0]

    by_flag = parse(["--names", "a", "b", "--caps", "1,2", "--tags", "x", "--tags", "y", "--cap", "none", "--no-on"])
    assert by_flag == Demo(["a", "b"], [1, 2], ["x", "y"], None, False)
    assert parse(["demo.names=[a,b]", "demo.caps=1,2", "demo.tags=[x,y]", "demo.cap=null", "demo.on=false"]) == by_flag
    assert parse(["demo.names=[a]", "demo.caps=[1,2]"]).caps == parse(["--names", "a", "demo.caps=1, 2"]).caps == [1, 2]
    assert parse(["demo.names=[a]", "demo.caps=5"]).caps == [5]


def test_a_section_may_not_be_a_config_section():
    from elasticmem.config import Config, DataConfig

    with pytest.raises(ValueError, match="'data' is a config section too"):
        cli_options.parse_cli(Config, [], options=Options("data", DataConfig))


def test_the_help_names_each_key_once_per_flag(capsys):
    """The options' groups in --help: one per (sub)section, each flag under its dotted key."""
    from elasticmem.serve.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    groups = re.findall(r"^options (serve[\w.]*)\.KEY=VALUE", out, re.M)
    assert groups == ["serve", "serve.batching", "serve.limits"]
