"""Every command in README.md and docs/ runs as written, up to the work it would do (a dry run).

    nice -n 15 env OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_doc_commands.py

``test_docs.py`` checks the commands' words (the scripts, flags and keys exist); this runs them. Each
``python`` command of this repository (``python X.py``, ``python -m elasticmem.X``, ``accelerate
launch ... X.py``, the ``elasticmem-*`` console scripts) is called in this process, from the
repository root, with its documented arguments, and stopped once they are understood:

- an entry point built on ``parse_cli`` (``--config PRESET key=value ...``) is stopped after its
  config is resolved, so the preset file must exist and every override must name a key with a value
  of the right type, exactly as the command would resolve them;
- any other ``argparse`` entry point (subcommands included) is stopped once its arguments parse;
  its ``key=value`` overrides, where it takes them, are resolved against the config too.

An entry point that got past its arguments without parsing them (so that nothing was checked), or
exited with an error, fails the test. ``bash`` scripts are checked with ``bash -n`` (their
``key=value`` arguments go to the python stages above, whose keys ``test_docs.py`` checks).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import subprocess
import threading
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


docs = _load(Path(__file__).with_name("test_docs.py"), "_test_docs_commands")
CONSOLE = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


class Understood(Exception):
    """Raised where a dry run stops: the command's arguments (and config) were resolved."""


def _console_commands(text: str) -> list[str]:
    """``elasticmem-*`` console-script commands in code blocks and code spans."""
    names = "|".join(map(re.escape, sorted(CONSOLE, key=len, reverse=True)))
    cmds = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").split("\n"):
            line = line.split(" #")[0].strip()
            if re.match(rf"(?:[A-Z_]+=\S+\s+)*(?:{names})(\s|$)", line):
                cmds.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    cmds += re.findall(rf"`((?:{names})(?: [^`]+)?)`", prose)
    return cmds


def _strip_launcher(tokens: list[str]) -> list[str]:
    """``accelerate launch [its flags] X.py args`` -> ``python X.py args`` (its config file must exist)."""
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
        tokens = tokens[1:]
    if tokens[:2] != ["accelerate", "launch"]:
        return tokens
    rest = tokens[2:]
    for i, t in enumerate(rest):
        if t == "--config_file":
            assert (REPO / rest[i + 1]).is_file(), f"accelerate config {rest[i + 1]} does not exist"
        if t.endswith(".py") or t == "-m":
            return ["python", *rest[i:]]
    return []  # the launcher's flags named in prose, with no script: nothing to run


def _entry_point(tokens: list[str]):
    """(callable taking argv, argv) of a command, or None when it is not a python entry point of the repo."""
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
        tokens = tokens[1:]
    if tokens and tokens[0] in CONSOLE:
        module, func = CONSOLE[tokens[0]].split(":")
        return getattr(importlib.import_module(module), func), tokens[1:]
    tokens = _strip_launcher(tokens)
    if not tokens or tokens[0] != "python":
        return None
    if tokens[1] == "-m":
        if not tokens[2].startswith("elasticmem"):
            return None
        name, argv = tokens[2], tokens[3:]
        mod = importlib.import_module(name)
        main = getattr(mod, "main", None)
        if main is None:  # run by a __main__ (never imported here: it would run) that calls another module's main
            path = Path(mod.__file__)
            src = (path.parent / "__main__.py" if path.name == "__init__.py" else path).read_text()
            inner = re.search(r"from (elasticmem[\w.]*) import main", src)
            assert inner, f"{name}: no main() to call"
            main = importlib.import_module(inner.group(1)).main
        return main, argv
    script = REPO / tokens[1]
    if script.suffix != ".py" or not script.is_file():
        return None
    mod = _load(script, "_doc_cmd_" + re.sub(r"\W", "_", tokens[1]))
    assert hasattr(mod, "main"), f"{tokens[1]}: no main(argv) to call"
    return mod.main, tokens[2:]


class DryRun:
    """Patches argparse and the config loader so that an entry point stops once its input is understood."""

    def __init__(self, monkeypatch):
        from elasticmem.config import Config
        from elasticmem.utils import configuration

        self.parsed = self.resolved = False
        self._depth = threading.local()
        real_load = configuration.load

        def load(cls, path=None, overrides=None, *a, **kw):
            cfg = real_load(cls, path, overrides, *a, **kw)
            self.resolved = True
            raise Understood(cfg)

        monkeypatch.setattr(configuration, "load", load)
        for name in ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args"):
            monkeypatch.setattr(argparse.ArgumentParser, name, self._wrap(getattr(argparse.ArgumentParser, name)))
        self._config_cls = Config
        self._real_load = real_load

    def _wrap(self, real):
        dry = self

        def parse(parser, *args, **kwargs):
            depth = getattr(dry._depth, "n", 0)
            dry._depth.n = depth + 1
            try:
                out = real(parser, *args, **kwargs)
            finally:
                dry._depth.n = depth
            if depth:  # argparse's own inner calls (subparsers, intermixed parsing)
                return out
            dry.parsed = True
            ns = out[0] if isinstance(out, tuple) else out
            dests = {a.dest for a in parser._actions}
            if {"config", "overrides"} <= dests and parser.epilog and "config keys" in parser.epilog:
                return out  # parse_cli's parser: the config is resolved next, and load() stops there
            overrides = getattr(ns, "overrides", None)
            if overrides:  # an entry point with key=value overrides of its own parsing: resolve them too
                dry._real_load(dry._config_cls, getattr(ns, "config", None), list(overrides))
                dry.resolved = True
            raise Understood(ns)

        return parse


def _documented() -> list[tuple[str, str]]:
    out = []
    for page in docs._doc_pages():
        text = page.read_text()
        rel = str(page.relative_to(REPO))
        out += [(rel, c) for c in docs._commands(text) + _console_commands(text)]
    return out


# Placeholders the docs use for "your preset": the dry run puts a real one in their place.
STAND_INS = {"CONFIG": "configs/tiny.yaml"}


def _python_commands() -> list[tuple[str, str]]:
    """The documented commands to run: placeholders filled in where a stand-in exists, else left out."""
    keep = []
    for page, cmd in _documented():
        for word, value in STAND_INS.items():
            cmd = re.sub(rf"(?<![\w.=-]){word}(?![\w.-])", value, cmd)
        body = re.sub(r"^(?:[A-Z_]+=\S*\s+)*", "", cmd)
        if "..." in body or "<" in body or re.search(r"(?<![\w.-])[A-Z][A-Z_]*(?![\w.-])", body):
            continue  # a placeholder (X, DATASET, NAME=...): not a command to run as written
        keep.append((page, cmd))
    return keep


def test_documented_python_commands_resolve(monkeypatch):
    monkeypatch.chdir(REPO)
    problems, ran = [], 0
    for page, cmd in _python_commands():
        try:
            tokens = shlex.split(cmd)
        except ValueError as e:
            problems.append(f"{page}: {cmd[:100]}: cannot be split as a shell line ({e})")
            continue
        try:
            entry = _entry_point(tokens)
        except AssertionError as e:
            problems.append(f"{page}: {cmd[:100]}: {e}")
            continue
        if entry is None:
            continue
        main, argv = entry
        if not argv:  # the tool named in prose ("`elasticmem-serve`"): it exists, nothing to run
            continue
        with monkeypatch.context() as m:
            dry = DryRun(m)
            try:
                main(argv)
                problems.append(f"{page}: {cmd[:100]}: ran past its arguments without a check")
            except Understood:
                ran += 1
            except SystemExit as e:  # argparse's error exit, or --help
                helped = bool({"-h", "--help"} & set(argv))
                if e.code not in (0, None) or not (dry.parsed or helped):
                    problems.append(f"{page}: {cmd[:100]}: exit {e.code}")
                else:
                    ran += 1
            except Exception as e:  # noqa: BLE001 -- a config error names the bad key; report every command
                problems.append(f"{page}: {cmd[:100]}: {type(e).__name__}: {str(e)[:200]}")
    assert not problems, "\n".join(problems)
    assert ran >= 30, f"only {ran} documented commands were run"


def test_documented_bash_scripts_parse():
    scripts = set()
    for _, cmd in _documented():
        tokens = cmd.split()
        while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
            tokens = tokens[1:]
        if tokens[:1] == ["bash"] and len(tokens) > 1 and tokens[1].endswith(".sh"):
            scripts.add(tokens[1])
    assert len(scripts) >= 5
    for s in sorted(scripts):
        assert (REPO / s).is_file(), f"{s} is documented but does not exist"
        r = subprocess.run(["bash", "-n", str(REPO / s)], capture_output=True, text=True)
        assert r.returncode == 0, f"{s}: {r.stderr}"


def test_dry_run_catches_a_bad_override_and_a_missing_preset(monkeypatch):
    """The checker is not blind: a wrong key, a wrong type and a missing preset are errors."""
    monkeypatch.chdir(REPO)
    for cmd in ("python train.py --config configs/tiny.yaml train.lrr=1",
                "python train.py --config configs/tiny.yaml train.lr=fast",
                "python -m elasticmem.warmup.reading --config configs/no_such_preset.yaml",
                "elasticmem-eval --config configs/tiny.yaml eval.no_such=1"):
        main, argv = _entry_point(shlex.split(cmd))
        with monkeypatch.context() as m:
            DryRun(m)
            with pytest.raises((SystemExit, Exception)) as e:
                main(argv)
            assert not isinstance(e.value, Understood), cmd
            if isinstance(e.value, SystemExit):
                assert e.value.code not in (0, None), cmd
    main, argv = _entry_point(shlex.split("accelerate launch --num_processes 2 train.py --config configs/tiny.yaml"))
    with monkeypatch.context() as m:
        dry = DryRun(m)
        with pytest.raises(Understood):
            main(argv)
        assert dry.resolved
