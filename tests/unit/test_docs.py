"""The documentation cannot drift: generated pages and tables equal their generators, commands exist, the site builds.

    nice -n 15 env OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_docs.py

- docs/configuration.md equals scripts/gen_config_docs.py's output and lists every config key;
- every results table in README.md, docs/ and benchmarks/README.md is marked with the results file it
  comes from (docs/results/NAME.json) and equals what scripts/gen_results_tables.py makes of it;
- the commands in README.md and docs/ name scripts, modules, flags and config keys that exist;
- ``mkdocs build --strict`` passes (a broken link or a page missing from the nav fails it). Skipped
  when mkdocs is not installed, unless ELASTICMEM_REQUIRE_DOCS=1 (CI sets it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen_config = _script("gen_config_docs")
gen_results = _script("gen_results_tables")


# ---------------------------------------------------------------- configuration page

def test_configuration_page_is_generated_and_lists_every_key():
    from elasticmem.config import Config
    from elasticmem.utils.configuration import _dotted_keys

    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == gen_config.render(), "docs/configuration.md is stale: run python scripts/gen_config_docs.py"
    missing = [k for k in _dotted_keys(Config) if f"`{k}`" not in page]
    assert not missing, f"config keys missing from docs/configuration.md: {missing}"


# ---------------------------------------------------------------- results tables

# A results table: its header or first column names a measured quantity, or a cell holds a value
# with its interval ("0.553 [0.485, 0.619]").
_MEASURE = re.compile(r"accuracy|recall|R@\d|R_any|\bF1\b|BLEU|req/s|\bp50\b|latency", re.I)
_INTERVAL = re.compile(r"[-+]?\d+(\.\d+)?\s*\[[-+]?\d")

# docs/recipe.md is being edited elsewhere; its tables' results files exist (docs/results/recipe/)
# and their markers are still to be inserted. Remove this entry once they are.
_MARKERS_PENDING: set[str] = set()


def _tables(text: str):
    """(first line number, lines) of every Markdown table, with whether it sits inside markers."""
    lines = text.split("\n")
    out, i, marked = [], 0, False
    while i < len(lines):
        s = lines[i].strip()
        if s.startswith("<!-- results:"):
            marked = True
        elif s == "<!-- /results -->":
            marked = False
        if s.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            j = i
            while j < len(lines) and lines[j].strip().startswith("|"):
                j += 1
            out.append((i + 1, [ln.strip() for ln in lines[i:j]], marked))
            i = j
            continue
        i += 1
    return out


_NUMBER = re.compile(r"\**[-+]?\d")

# Numeric tables that are not measurements (first header cells, why).
_NOT_RESULTS = {
    "| | 0.5B | 3B | 7B |": "docs/cluster.md: memory sizes computed from formulas, not measured",
}


def _is_results_table(rows: list[str]) -> bool:
    """A table of measured values: its header or first column names a measure, a cell holds a value
    with its interval, or at least half the cells right of the first column are numbers."""
    if rows[0] in _NOT_RESULTS:
        return False
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    names = " ".join(cells[0]) + " " + " ".join(c[0] for c in cells[2:])
    values = [c for r in cells[2:] for c in r[1:] if c]
    numeric = sum(bool(_NUMBER.match(c)) for c in values)
    return (bool(_MEASURE.search(names)) or any(_INTERVAL.search(c) for r in cells[2:] for c in r)
            or (bool(values) and 2 * numeric >= len(values)))


def test_results_table_detector():
    assert _is_results_table(["| system | accuracy |", "|---|---|", "| a | 0.5 |"])
    assert _is_results_table(["| model | seed 0 |", "|---|---|", "| x | 0.12 [0.06, 0.24] |"])
    assert _is_results_table(["| | F |", "|---|---|", "| F1 | 8.70 |"])
    assert _is_results_table(["| keys | `ivf` nprobe 16 |", "|---|---|", "| 100k | 0.826 |"])
    assert not _is_results_table(["| value | what |", "|---|---|", "| `tiny` | random Qwen2 |"])
    assert not _is_results_table(["| | 0.5B | 3B | 7B |", "|---|---|---|---|", "| base parameters P | 0.494 B | 3.09 B | 7.62 B |"])


def test_formatter_scales_and_negates():
    spec = {"command": "c", "commit": "x", "provenance": "p", "data": {"d": {"v": -0.2836, "ci": [-0.3639, -0.2009]}},
            "table": {"header": ["a", "b"], "rows": [["{d[v]:npct+.1f} [{d[ci][1]:npct+.1f}, {d[ci][0]:npct+.1f}]",
                                                     "{d[v]:pct.2f}"]]}}
    assert gen_results.render(spec) == "| a | b |\n|---|---|\n| +28.4 [+20.1, +36.4] | -28.36 |\n"


def test_formatter_writes_milliseconds_and_verdicts():
    spec = {"command": "c", "commit": "x", "provenance": "p",
            "data": {"s": 0.01966, "acc": {"a": {"met": True}, "b": {"met": False}}, "by": {"429": 7}, "xs": [3, 4]},
            "table": {"header": ["t", "a", "b", "c"], "rows": [["{s:ms.1f} ms", "{acc[a][met]:met}", "{acc[b][met]:met}",
                                                             "{by[429]} {xs[1]}"]]}}
    assert gen_results.render(spec) == "| t | a | b | c |\n|---|---|---|---|\n| 19.7 ms | met | **missed** | 7 4 |\n"
    spec["data"]["acc"]["a"]["met"] = 1.0  # a number is not a verdict
    with pytest.raises(ValueError, match="takes a boolean"):
        gen_results.render(spec)


def test_marked_tables_equal_their_results_files():
    stale = []
    for path in gen_results.published_files():
        text = path.read_text()
        for m in gen_results.MARKED.finditer(text):
            want = gen_results.render(gen_results.load(m.group("name")))
            if m.group("body") != want:
                stale.append(f"{path.relative_to(REPO)}: {m.group('name')}")
    assert not stale, f"tables differ from their results files (python scripts/gen_results_tables.py): {stale}"


def test_every_results_table_is_marked():
    unmarked = []
    for path in gen_results.published_files():
        rel = str(path.relative_to(REPO))
        if rel in _MARKERS_PENDING:
            continue
        for line, rows, marked in _tables(path.read_text()):
            if not marked and _is_results_table(rows):
                unmarked.append(f"{rel}:{line}: {rows[0][:80]}")
    assert not unmarked, f"results tables without <!-- results:NAME --> markers: {unmarked}"


def test_results_files_say_where_they_come_from():
    files = sorted(gen_results.RESULTS.rglob("*.json"))
    assert files
    used = set()
    for path in gen_results.published_files():
        used |= {m.group("name") for m in gen_results.MARKED.finditer(path.read_text())}
    for f in files:
        spec = json.loads(f.read_text())
        name = str(f.relative_to(gen_results.RESULTS).with_suffix(""))
        assert spec["command"] and spec["provenance"], name
        assert re.fullmatch(r"[0-9a-f]{7,40}", spec["commit"] or ""), f"{name}: commit {spec['commit']!r}"
        gen_results.render(spec)  # every template resolves against its data
        pending = "docs/recipe.md" in _MARKERS_PENDING and name.startswith("recipe/")
        assert name in used or pending, f"{name}.json is not used by any marked table"


# ---------------------------------------------------------------- commands

def _option_specs() -> list:
    """Every command's own options: the ``elasticmem.utils.options.Options`` of each module that defines one."""
    import importlib

    from elasticmem.utils.options import Options

    specs = []
    for path in sorted((REPO / "elasticmem").rglob("*.py")):
        if "= Options(" in path.read_text():
            mod = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
            specs += [v for v in vars(mod).values() if isinstance(v, Options)]
    return specs


def _config_keys() -> set[str]:
    """The config keys and the commands' dotted options (``serve.port``)."""
    from elasticmem.config import Config
    from elasticmem.utils.configuration import _dotted_keys
    from elasticmem.utils.options import option_keys

    return set(_dotted_keys(Config)).union(*(option_keys(s) for s in _option_specs()))


def _option_flags() -> set[str]:
    """The flags the commands' options make (``--no-access-log`` too)."""
    import argparse

    from elasticmem.utils.options import add_options

    flags: set[str] = set()
    for spec in _option_specs():
        parser = argparse.ArgumentParser(add_help=False)
        add_options(parser, spec)
        flags |= set(parser._option_string_actions)
    return flags


def _open_quote(line: str) -> bool:
    """Whether a shell line ends inside a quoted string (its command goes on on the next line)."""
    try:
        shlex.split(line)
    except ValueError:
        return True
    return False


def _commands(text: str) -> list[str]:
    """``python ...``, ``bash ...`` and ``accelerate launch ...`` commands in code blocks and code spans."""
    cmds = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        pending = ""
        for line in block.replace("\\\n", " ").split("\n"):
            if not pending:
                line = line.split(" #")[0]
            pending = f"{pending} {line.strip()}".strip()
            if pending and not _open_quote(pending):  # a quoted argument may span lines
                cmds.append(pending)
                pending = ""
        if pending:
            cmds.append(pending)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    cmds += re.findall(r"`((?:[A-Z_]+=\S+ )*(?:python|bash|accelerate launch) [^`]+)`", prose)
    return [c for c in cmds if re.match(r"(?:[A-Z_]+=\S+\s+)*(?:python|bash|accelerate launch)\s", c)]


def _target(tokens: list[str]) -> tuple[Path | None, list[str]]:
    """The file a command runs and its arguments (None when it is not a file of this repository)."""
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
        tokens = tokens[1:]
    if tokens[0] == "python" and len(tokens) > 2 and tokens[1] == "-m":
        mod = REPO / tokens[2].replace(".", "/")
        if not tokens[2].startswith("elasticmem"):
            return None, []
        for cand in (mod.with_suffix(".py"), mod / "__main__.py"):
            if cand.is_file():
                return cand, tokens[3:]
        return mod.with_suffix(".py"), tokens[3:]
    scripts = [i for i, t in enumerate(tokens) if t.endswith((".py", ".sh"))]
    if not scripts:
        return None, []
    return REPO / tokens[scripts[0]], tokens[scripts[0] + 1:]


def _doc_pages() -> list[Path]:
    docs = [p for p in sorted((REPO / "docs").rglob("*.md")) if gen_results.RESULTS not in p.parents]
    return [REPO / "README.md", *docs]


def test_commands_in_readme_and_docs_exist():
    keys, option_flags = _config_keys(), _option_flags()
    sources = "\n".join(p.read_text() for p in (REPO / "elasticmem").rglob("*.py"))
    problems = []
    for page in _doc_pages():
        for cmd in _commands(page.read_text()):
            try:
                tokens = shlex.split(cmd)
            except ValueError:
                continue
            target, args = _target(tokens)
            if target is None or "..." in cmd or "<" in cmd:
                continue
            where = f"{page.relative_to(REPO)}: {cmd[:90]}"
            if not target.is_file():
                problems.append(f"{where}: no file {target.relative_to(REPO)}")
                continue
            own = target.read_text()
            for a in args:
                if a.startswith("--") and a != "--help":
                    flag = a.split("=")[0]
                    if (f'"{flag}"' not in own and f'"{flag}"' not in sources and f"{flag}" not in own
                            and flag not in option_flags):
                        problems.append(f"{where}: unknown flag {flag}")
                elif re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+=.*", a, re.S):
                    key = a.split("=", 1)[0]
                    if key not in keys:
                        problems.append(f"{where}: unknown config key {key}")
    assert not problems, "\n".join(problems)


def test_links_in_readme_point_at_files():
    text = (REPO / "README.md").read_text()
    missing = [u for u in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
               if not u.startswith(("http://", "https://", "mailto:")) and not (REPO / u).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_command_checker_catches_a_wrong_key_and_a_missing_script():
    keys = _config_keys()
    assert "train.lr" in keys and "train.lrr" not in keys
    target, args = _target(shlex.split("python -m elasticmem.warmup.reading --config c.yaml warmup.steps=3"))
    assert target == REPO / "elasticmem" / "warmup" / "reading.py" and args[-1] == "warmup.steps=3"
    target, _ = _target(shlex.split("ELASTICMEM_VENV=x bash scripts/no_such_script.sh"))
    assert not target.is_file()
    assert _commands("```bash\npython train.py --config X \\\n  train.lr=1 # note\n```\n") == [
        "python train.py --config X    train.lr=1"]


# ---------------------------------------------------------------- the site

def test_mkdocs_build_strict(tmp_path):
    have = all(importlib.util.find_spec(m) is not None for m in ("mkdocs", "material", "mkdocstrings"))
    if not have:
        if os.environ.get("ELASTICMEM_REQUIRE_DOCS") == "1":
            pytest.fail("ELASTICMEM_REQUIRE_DOCS=1 but mkdocs / mkdocs-material / mkdocstrings are not installed (the dev extra)")
        pytest.skip("mkdocs, mkdocs-material and mkdocstrings are not installed (pip install -e '.[dev]'); the site is not built")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life banner
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
    # the API reference is rendered from the docstrings, not left as ':::' lines
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert 'id="elasticmem.live.LiveMemory.forget"' in api and ":::" not in api
