"""Published results tables, generated from the results files committed under docs/results/.

    python scripts/gen_results_tables.py           # rewrite every marked table in README.md, docs/, benchmarks/README.md
    python scripts/gen_results_tables.py --check   # exit 1 naming each marked table that differs from its file
    python scripts/gen_results_tables.py --print NAME   # the table NAME would get, to paste between new markers

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
    return spec


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
    args = ap.parse_args(argv)
    if args.print:
        sys.stdout.write(render(load(args.print)))
        return 0
    stale = []
    for path in published_files():
        text = path.read_text()
        new = regenerate(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale:
        verb = "differs from its results files" if args.check else "rewritten"
        print(f"{path.relative_to(REPO)}: {verb}", file=sys.stderr if args.check else sys.stdout)
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
