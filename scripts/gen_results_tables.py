"""Published results tables, generated from the results files committed under docs/results/.

    python scripts/gen_results_tables.py           # rewrite every marked table in README.md, docs/, benchmarks/README.md
    python scripts/gen_results_tables.py --check   # exit 1 naming each marked table that differs from its file
    python scripts/gen_results_tables.py --print NAME   # the table NAME would get, to paste between new markers
    python scripts/gen_results_tables.py --verify FILE.json ...   # re-score the predictions these files name

A table is marked in the Markdown by the results file it comes from (NAME = its path under
docs/results/ without ``.json``)::

    <!-- results:quickstart/comparison -->
    | ... generated ... |
    <!-- /results -->

A results file holds ``command`` and ``commit`` (what made the numbers), ``provenance`` (where
the values come from), ``data`` (the values: a trimmed copy of the run's own output, or the
published values where the raw output was not kept) and ``table``: ``header`` (cells) and ``rows``
(cells). Every cell is a ``str.format`` template over ``data`` (``{systems[elasticmem][accuracy]:.3f}``),
with extra format prefixes: ``pct`` multiplies by 100 and ``npct`` by -100 (a fraction as points,
or the difference the other way round), e.g. ``{paired[x][difference]:npct+.1f}``, and ``ms`` by
1000 (seconds as milliseconds); and the format ``met`` writes a boolean acceptance as ``met`` or
``**missed**`` (``{acceptance[append_ratio][met]:met}``), so that a verdict follows its numbers.
A numeric key of a JSON object reads as the string it is (``{refused[429]}``).

Re-scored figures: a results file may name the predictions a figure comes from, ``predictions``:
``{LABEL: {"path", "sha256", "accuracy", "num_options", "scorer", "figure"}}`` (the path relative
to the repository or absolute; ``accuracy`` the published figure, unrounded; ``figure`` optionally
the dotted path in ``data`` that shows it). Every time a table is rendered, checked or printed,
each such file is re-scored from its answers' text with the project's own parser
(``elasticmem.eval.rescore``: ``parse_option_letter`` against the gold letter, or exact match),
and the generator refuses (exit 2, naming the file and both figures) when the sha256 or the
re-scored accuracy differs. ``elasticmem.eval.rescore.check_predictions`` is the same check from
Python. A figure that changed may say so in an optional ``changed`` list of ``{"figure", "was",
"now", "why"}`` (checked for its shape, rendered nowhere: say it in the page's text too).
"""

from __future__ import annotations

import _string
import argparse
import json
import re
import string
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"

MARKED = re.compile(r"(<!-- results:(?P<name>[\w./-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def published_files() -> list[Path]:
    """The Markdown files whose tables are published: the README, docs/ (outside docs/results/,
    which holds the runs' own reports) and benchmarks/README.md."""
    docs = [p for p in sorted((REPO / "docs").rglob("*.md")) if RESULTS not in p.parents]
    return [REPO / "README.md", REPO / "benchmarks" / "README.md", *docs]


class _Formatter(string.Formatter):
    def get_field(self, field_name, args, kwargs):
        # str.format reads ``[429]`` as the integer 429; a JSON object's keys are strings
        first, rest = _string.formatter_field_name_split(field_name)
        obj = self.get_value(first, args, kwargs)
        for is_attr, key in rest:
            if is_attr:
                obj = getattr(obj, key)
            elif isinstance(obj, dict) and key not in obj and str(key) in obj:
                obj = obj[str(key)]
            else:
                obj = obj[key]
        return obj, first

    def format_field(self, value, format_spec):
        if format_spec == "met":
            if not isinstance(value, bool):
                raise ValueError(f"the format 'met' takes a boolean, got {value!r}")
            return "met" if value else "**missed**"
        for prefix, scale in (("npct", -100.0), ("pct", 100.0), ("ms", 1000.0)):
            if format_spec.startswith(prefix):
                return format(value * scale, format_spec[len(prefix):])
        return format(value, format_spec)


def load(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no results file {path.relative_to(REPO)} for the table marked '{name}'")
    spec = json.loads(path.read_text())
    for key in ("command", "commit", "provenance", "data", "table"):
        if key not in spec:
            raise ValueError(f"{path.relative_to(REPO)}: missing '{key}'")
    verify(spec, path)
    return spec


def verify(spec: dict, path: Path) -> list[dict]:
    """Re-score the predictions ``spec`` names and check its ``changed`` list (nothing to do for a
    file without them); raises ``elasticmem.eval.rescore.RescoreError`` naming ``path`` and both figures."""
    if "predictions" not in spec and "changed" not in spec:
        return []
    from elasticmem.eval.rescore import check_predictions

    try:
        where = str(path.resolve().relative_to(REPO))
    except ValueError:
        where = str(path)
    return check_predictions(spec, REPO, where=where)


def render(spec: dict) -> str:
    """The Markdown table of one results file."""
    fmt = _Formatter()
    table = spec["table"]
    width = len(table["header"])

    def line(cells: list[str]) -> str:
        if len(cells) != width:
            raise ValueError(f"a row has {len(cells)} cells, the header {width}: {cells}")
        text = [fmt.format(c, **spec["data"]) for c in cells]
        return "|" + "|".join(f" {t} " if t else " " for t in text) + "|"

    out = [line(table["header"]), "|" + "---|" * width]
    out += [line(row) for row in table["rows"]]
    return "\n".join(out) + "\n"


def regenerate(text: str) -> str:
    """``text`` with every marked table replaced by what its results file gives."""
    return MARKED.sub(lambda m: m.group(1) + render(load(m.group("name"))) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare, write nothing")
    ap.add_argument("--print", metavar="NAME", help="print the table of docs/results/NAME.json")
    ap.add_argument("--verify", metavar="FILE", nargs="+", help="re-score the predictions these results files name")
    args = ap.parse_args(argv)
    from elasticmem.eval.rescore import RescoreError

    try:
        if args.verify:
            for f in args.verify:
                for c in verify(json.loads(Path(f).read_text()), Path(f)):
                    print(f"{f}: {c['label']}: {c['path']} re-scores to {c['rescored']!r} (n = {c['n']}), "
                          "as published")
            return 0
        if args.print:
            sys.stdout.write(render(load(args.print)))
            return 0
        return _regenerate_all(args.check)
    except RescoreError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2


def _regenerate_all(check: bool) -> int:
    stale = []
    for path in published_files():
        text = path.read_text()
        new = regenerate(text)
        if new != text:
            stale.append(path)
            if not check:
                path.write_text(new)
    for path in stale:
        verb = "differs from its results files" if check else "rewritten"
        print(f"{path.relative_to(REPO)}: {verb}", file=sys.stderr if check else sys.stdout)
    return 1 if (check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
