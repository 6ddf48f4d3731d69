"""Markdown reports of evaluation results (``results.json`` dicts of :mod:`elasticmem.eval.metrics`).

- :func:`results_markdown`: one evaluation (``report.md``): accuracy, per question type,
  tokens (``#Tok``, ``B_mem``), latency split, budgets, and the free-form answer metrics in
  the layout of the A-Mem paper's Table 1 (F1 and BLEU-1 per LoCoMo category) plus all six of
  its metrics per category.
- :func:`comparison_markdown`: several systems or variants, one row each: accuracy, per-type
  accuracies, ``#Tok``, ``B_mem``, latency (and the A-Mem Table 1 layout when all have
  free-form metrics).

Accuracies and free-form metrics are printed in percent, as both papers do.

Command line::

    python -m elasticmem.eval.report one RESULTS_JSON [--title T] [--out report.md]
    python -m elasticmem.eval.report compare RESULTS_JSON... [--names A B ...] [--out comparison.md]
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticmem.eval.metrics import LATENCY_STAGES, load_results

Results = Mapping[str, Any]

LOCOMO_CATEGORIES = ("multi_hop", "temporal", "open_domain", "single_hop", "adversarial")
"""LoCoMo's categories in the column order of the A-Mem paper's tables (LoCoMo numbers them 1..5
in this order: 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial)."""

LOCOMO_TITLES = {"multi_hop": "Multi Hop", "temporal": "Temporal", "open_domain": "Open Domain",
                 "single_hop": "Single Hop", "adversarial": "Adversarial"}

_LOCOMO_ALIASES = {
    **{str(i + 1): c for i, c in enumerate(LOCOMO_CATEGORIES)},
    "multihop": "multi_hop", "multi_hop": "multi_hop",
    "temporal": "temporal", "temporal_reasoning": "temporal",
    "open_domain": "open_domain", "opendomain": "open_domain", "open_domain_knowledge": "open_domain",
    "single_hop": "single_hop", "singlehop": "single_hop",
    "adversarial": "adversarial", "adversial": "adversarial",
}

FREE_FORM_COLUMNS = (("f1", "F1"), ("bleu1", "BLEU-1"), ("rougeL", "ROUGE-L"), ("rouge2", "ROUGE-2"),
                     ("meteor", "METEOR"), ("sbert", "SBERT"))
"""The A-Mem paper's free-form metrics, in its order."""


def locomo_category(question_type: str) -> str | None:
    """The LoCoMo category of a question type (``"1"``, ``"category_1"``, ``"multi-hop"``...),
    or None when it is not one."""
    t = str(question_type).strip().lower().replace("-", "_").replace(" ", "_")
    return _LOCOMO_ALIASES.get(t.removeprefix("category_"))


def _pct(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{100 * float(x):.{digits}f}"


def _num(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{float(x):.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table (``|`` in cells escaped)."""
    esc = lambda c: str(c).replace("|", "\\|")
    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _primary(results: Results) -> tuple[str, float]:
    if "success_rate" in results:
        return "success rate", float(results["success_rate"])
    return "accuracy", float(results["accuracy"])


def _free_form_categories(ff: Mapping[str, Any]) -> list[tuple[str, str]] | None:
    """``[(question_type, column title)]`` in A-Mem's order when every type is a LoCoMo
    category, else None."""
    types = list(ff.get("per_type", {}))
    cats = {t: locomo_category(t) for t in types}
    if not types or any(c is None for c in cats.values()):
        return None
    order = {c: i for i, c in enumerate(LOCOMO_CATEGORIES)}
    return [(t, LOCOMO_TITLES[cats[t]]) for t in sorted(types, key=lambda t: order[cats[t]])]


def amem_table1(results: Mapping[str, Results]) -> str:
    """A-Mem paper Table 1 layout: one row per system; F1 and BLEU-1 (%) per LoCoMo category
    (Multi Hop, Temporal, Open Domain, Single Hop, Adversarial), overall, and token length.

    Systems whose question types are not LoCoMo categories get their types as columns, as
    they are, in name order.
    """
    ffs = {n: r["free_form"] for n, r in results.items() if "free_form" in r}
    if not ffs:
        raise ValueError("no free-form metrics in these results")
    cols: list[tuple[str, str]] = []
    for ff in ffs.values():
        for t, title in _free_form_categories(ff) or [(t, t) for t in ff["per_type"]]:
            if t not in [c[0] for c in cols]:
                cols.append((t, title))
    header = ["system"] + [f"{title} {m}" for _, title in cols for m in ("F1", "BLEU-1")]
    header += ["Overall F1", "Overall BLEU-1", "Token Length"]
    rows = []
    for name, ff in ffs.items():
        row = [name]
        for t, _ in cols:
            cat = ff["per_type"].get(t, {})
            row += [_pct(cat.get("f1")), _pct(cat.get("bleu1"))]
        row += [_pct(ff["overall"].get("f1")), _pct(ff["overall"].get("bleu1")), _num(results[name].get("avg_tokens"))]
        rows.append(row)
    return _table(header, rows)


def free_form_markdown(ff: Mapping[str, Any]) -> str:
    """All six A-Mem metrics (%) per category and overall, with counts; absent metrics named."""
    cats = _free_form_categories(ff) or [(t, t) for t in ff["per_type"]]
    keys = [(k, title) for k, title in FREE_FORM_COLUMNS if k in ff["overall"]]
    rows = [[title, str(ff["counts"][t])] + [_pct(ff["per_type"][t].get(k)) for k, _ in keys] for t, title in cats]
    rows.append(["**Overall**", str(sum(ff["counts"].values()))] + [_pct(ff["overall"].get(k)) for k, _ in keys])
    out = _table(["category", "n"] + [title for _, title in keys], rows)
    for metric, why in ff.get("absent", {}).items():
        out += f"\n\n{metric} not computed: {why}"
    return out


def results_markdown(results: Results, title: str | None = None) -> str:
    """``report.md`` of one evaluation (see the module docstring)."""
    name, acc = _primary(results)
    title = title or f"Evaluation: {results.get('system', 'system')}"
    parts = [f"# {title}"]
    rows = [[name, f"{_pct(acc)} %"], ["examples", str(results["num_examples"])],
            ["#Tok (tokens per example)", _num(results.get("avg_tokens"))],
            ["memory tokens per example", _num(results.get("avg_memory_tokens"))]]
    if "avg_B_mem" in results:
        rows.append(["B_mem (sum of budgets per example)", _num(results["avg_B_mem"])])
    rows += [["prompt tokens per example", _num(results.get("avg_prompt_tokens"))],
             ["generated tokens per example", _num(results.get("avg_generated_tokens"))],
             ["latency per example (s)", _num(results.get("latency_s_per_example"), 4)]]
    parts.append(_table(["metric", "value"], rows))

    per_type, counts = results.get("per_type", {}), results.get("per_type_counts", {})
    if per_type:
        parts.append(f"## {name.capitalize()} by question type")
        parts.append(_table(["question type", "n", f"{name} (%)"],
                            [[t, str(counts.get(t, "–")), _pct(a)] for t, a in per_type.items()]))

    split = results.get("latency_split_s")
    if split:
        total = sum(split.values())
        parts.append("## Latency per example")
        parts.append(_table(["stage", "seconds", "share (%)"],
                            [[s, _num(v, 4), _pct(v / total if total > 0 else None, 1)] for s, v in split.items()]
                            + [["**total**", _num(total, 4), "100.0" if total > 0 else "–"]]))

    b = results.get("budget_stats")
    if b:
        parts.append("## Budgets")
        parts.append(_table(["mean budget per memory", "dropped (b = 0, %)", "max budget", "B_mem"],
                            [[_num(b["mean_budget"], 2), _pct(b["zero_fraction"], 1), str(b["max_budget"]),
                              _num(b["avg_B_mem"])]]))

    ff = results.get("free_form")
    if ff:
        parts.append("## Free-form answers (A-Mem metrics, %)")
        parts.append("F1 and BLEU-1 by category, A-Mem paper Table 1 layout:")
        parts.append(amem_table1({str(results.get("system", "this system")): results}))
        parts.append("All metrics:")
        parts.append(free_form_markdown(ff))
    return "\n\n".join(parts) + "\n"


def comparison_markdown(results: Mapping[str, Results], title: str = "Comparison") -> str:
    """One row per system or variant: accuracy, per-type accuracies, #Tok, B_mem, latency (and
    the A-Mem Table 1 layout when every system has free-form metrics)."""
    if not results:
        raise ValueError("no results to compare")
    types = sorted({t for r in results.values() for t in r.get("per_type", {})})
    header = ["system", "n", "accuracy (%)"] + [f"{t} (%)" for t in types]
    header += ["#Tok", "B_mem", "memory tokens", "latency (s)"] + [f"{s} (s)" for s in LATENCY_STAGES]
    rows = []
    for name, r in results.items():
        split = r.get("latency_split_s", {})
        rows.append([name, str(r["num_examples"]), _pct(_primary(r)[1])]
                    + [_pct(r.get("per_type", {}).get(t)) for t in types]
                    + [_num(r.get("avg_tokens")), _num(r.get("avg_B_mem")), _num(r.get("avg_memory_tokens")),
                       _num(r.get("latency_s_per_example"), 4)]
                    + [_num(split.get(s), 4) for s in LATENCY_STAGES])
    parts = [f"# {title}", _table(header, rows)]
    if all("free_form" in r for r in results.values()):
        parts += ["## Free-form answers (A-Mem paper Table 1 layout, %)", amem_table1(results)]
    return "\n\n".join(parts) + "\n"


def write_report(results: Results, path: str | Path, title: str | None = None) -> Path:
    """Write :func:`results_markdown` to ``path``; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(results_markdown(results, title), encoding="utf-8")
    return path


def write_comparison(results: Mapping[str, Results], path: str | Path, title: str = "Comparison") -> Path:
    """Write :func:`comparison_markdown` to ``path``; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(comparison_markdown(results, title), encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """The command line of the module docstring."""
    p = argparse.ArgumentParser(prog="python -m elasticmem.eval.report", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    one = sub.add_parser("one", help="report.md of one results.json")
    one.add_argument("results")
    one.add_argument("--title", default=None)
    one.add_argument("--out", default=None, help="default: report.md beside results.json")
    cp = sub.add_parser("compare", help="one table across several results.json")
    cp.add_argument("results", nargs="+")
    cp.add_argument("--names", nargs="*", default=None, help="one label per file (default: 'system' or folder name)")
    cp.add_argument("--title", default="Comparison")
    cp.add_argument("--out", default="comparison.md")
    a = p.parse_args(argv)
    if a.cmd == "one":
        path = Path(a.results)
        print(write_report(load_results(path), a.out or path.with_name("report.md"), a.title))
        return 0
    paths = [Path(r) for r in a.results]
    if a.names and len(a.names) != len(paths):
        p.error("--names needs one name per results file")
    loaded = [load_results(q) for q in paths]
    names = a.names or [str(r.get("system") or q.parent.name) for q, r in zip(paths, loaded)]
    if len(set(names)) != len(names):
        p.error(f"system names collide ({names}); pass --names")
    print(write_comparison(dict(zip(names, loaded)), a.out, a.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
