"""Markdown reports of evaluation results (``results.json`` dicts of :mod:`elasticmem.eval.metrics`).

- :func:`results_markdown`: one evaluation (``report.md``): accuracy, per question type,
  tokens (``#Tok``, ``B_mem``), latency split, budgets, and the free-form answer metrics in
  the layout of the A-Mem paper's Table 1 (F1 and BLEU-1 per LoCoMo category) plus all six of
  its metrics per category.
- :func:`comparison_markdown`: several systems or variants, one row each: accuracy, ``#Tok``,
  ``B_mem``, latency; each system against the first on the same questions (paired: exact
  McNemar test, accuracy difference with its 95 % interval, discordant counts, n); per-type
  accuracies (and the A-Mem Table 1 layout when all have free-form metrics).
  :func:`write_comparison` writes it with :func:`comparison_data` beside it as JSON.
- :func:`seeds_markdown`: systems trained with several seeds (variants named ``system@seed``):
  accuracy as the mean over seeds with a t interval over seeds, and each system against the
  first paired by seed (``seeds.md``, :func:`write_seeds`).

Accuracies and free-form metrics are printed in percent, as both papers do; every accuracy
with its 95 % Wilson interval and n (``61.5 % [55.2, 67.4] (n = 240)``), and a flag when
n < 200 (:data:`elasticmem.eval.stats.HEADLINE_MIN_N`). The statistics are in
:mod:`elasticmem.eval.stats`.

Command line::

    python -m elasticmem.eval.report one RESULTS_JSON [--title T] [--out report.md]
    python -m elasticmem.eval.report compare RESULTS_JSON... [--names A B ...] [--out comparison.md]
    python -m elasticmem.eval.report seeds NAME=RESULTS_JSON[,RESULTS_JSON...]... [--out seeds.md]

``compare`` pairs the systems by the ``predictions.jsonl`` beside each ``results.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticmem.eval import stats
from elasticmem.eval.metrics import LATENCY_STAGES, load_records, load_results

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


def _construction_cell(tokens_per_example: float | None, unmeasured: float | None) -> str:
    """Construction tokens per example, saying how many notes it leaves out where a resumed
    memory store was begun before its journal kept costs."""
    if unmeasured and not tokens_per_example:
        return f"not recorded ({int(unmeasured):,} notes built before costs were kept)"
    cell = _num(tokens_per_example)
    if unmeasured:
        cell += f" (without the {int(unmeasured):,} notes built before costs were kept)"
    return cell


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


def headline(results: Results) -> tuple[str, float, int, tuple[float, float]]:
    """``(name, value, n, (lo, hi))`` of the primary metric (accuracy or success rate); the
    interval as stored, else (a results.json written before intervals were) the Wilson
    interval of ``value`` on n 0/1 outcomes."""
    name, p = _primary(results)
    n = int(results["num_examples"])
    ci = results.get(f"{name.replace(' ', '_')}_ci95", results.get("accuracy_ci95"))
    return name, p, n, (float(ci[0]), float(ci[1])) if ci is not None else stats.wilson_interval(round(p * n), n)


def per_type_intervals(results: Results) -> dict[str, tuple[float, int | None, tuple[float, float] | None]]:
    """``{question_type: (accuracy, n, (lo, hi))}`` (n and interval None when not known)."""
    counts, cis = results.get("per_type_counts", {}), results.get("per_type_ci95", {})
    out: dict[str, tuple[float, int | None, tuple[float, float] | None]] = {}
    for t, a in results.get("per_type", {}).items():
        n, ci = counts.get(t), cis.get(t)
        if ci is None and n is not None:  # written before intervals were
            ci = stats.wilson_interval(round(float(a) * int(n)), int(n))
        out[t] = (float(a), n, None if ci is None else (float(ci[0]), float(ci[1])))
    return out


def format_accuracy(p: float, ci: Sequence[float] | None, n: int | None = None, unit: str = " %") -> str:
    """``61.5 % [55.2, 67.4] (n = 240)``: an accuracy in percent with its 95 % interval and n
    (each left out when None; ``unit=""`` in table cells whose header says %)."""
    return (f"{_pct(p, 1)}{unit}" + ("" if ci is None else f" [{_pct(ci[0], 1)}, {_pct(ci[1], 1)}]")
            + ("" if n is None else f" (n = {n})"))


_WILSON_NOTE = f"Intervals: {100 * stats.LEVEL:g} % Wilson score intervals, in percent."


def _p_value(p: float) -> str:
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def _points(d: float) -> str:
    return f"{100 * d:+.1f}"


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


_EVIDENCE_HEADER = ["system", "n with evidence", "evidence recall (%) [95 % CI]", "chance (%)", "rows retrieved",
                    "accuracy if found (%) [95 % CI] (n)", "accuracy if not found (%) [95 % CI] (n)"]
_EVIDENCE_NOTE = ("Evidence recall: share of the questions with evidence whose retrieved bank rows (A-Mem: notes) "
                  "include an evidence row (Wilson interval); chance: its exact expectation for as many rows drawn "
                  "at random from the question's conversation.")


def _evidence_row(name: str, e: Mapping[str, Any]) -> list[str]:
    def given(which: str) -> str:
        k = e[f"n_{which}"]
        acc = format_accuracy(e[f"accuracy_given_{which}"], e[f"accuracy_given_{which}_ci95"], unit="")
        return "–" if not k else f"{acc} ({k})"

    return [name, str(e["n"]), format_accuracy(e["recall_any"], e["recall_any_ci95"], unit=""),
            _pct(e["random_recall_any"], 1), _num(e["mean_retrieved"]), given("hit"), given("miss")]


def evidence_markdown(results: Mapping[str, Results]) -> str | None:
    """The evidence-retrieval table (``results.json`` ``evidence_retrieval``) of the systems that have one."""
    rows = [_evidence_row(name, r["evidence_retrieval"]) for name, r in results.items() if r.get("evidence_retrieval")]
    if not rows:
        return None
    return "\n\n".join(["## Evidence retrieval", _table(_EVIDENCE_HEADER, rows), _EVIDENCE_NOTE])


def results_markdown(results: Results, title: str | None = None) -> str:
    """``report.md`` of one evaluation (see the module docstring)."""
    name, acc, n, ci = headline(results)
    title = title or f"Evaluation: {results.get('system', 'system')}"
    parts = [f"# {title}"]
    if n < stats.HEADLINE_MIN_N:
        parts.append(f"**{stats.TOO_FEW_FOR_HEADLINE}** (n = {n})")
    rows = [[name, format_accuracy(acc, ci, n)], ["examples", str(n)],
            ["#Tok (tokens per example)", _num(results.get("avg_tokens"))],
            ["memory tokens per example", _num(results.get("avg_memory_tokens"))]]
    if "avg_B_mem" in results:
        rows.append(["B_mem (sum of budgets per example)", _num(results["avg_B_mem"])])
    rows += [["prompt tokens per example", _num(results.get("avg_prompt_tokens"))],
             ["generated tokens per example", _num(results.get("avg_generated_tokens"))],
             ["latency per example (s)", _num(results.get("latency_s_per_example"), 4)]]
    parts.append(_table(["metric", "value"], rows))
    parts.append(_WILSON_NOTE)

    per_type = per_type_intervals(results)
    if per_type:
        parts.append(f"## {name.capitalize()} by question type")
        parts.append(_table(["question type", "n", f"{name} (%) [95 % CI]"],
                            [[t, "–" if k is None else str(k), format_accuracy(a, c, unit="")]
                             for t, (a, k, c) in per_type.items()]))

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

    evidence = evidence_markdown({str(results.get("system", "this system")): results})
    if evidence:
        parts.append(evidence)

    ff = results.get("free_form")
    if ff:
        parts.append("## Free-form answers (A-Mem metrics, %)")
        parts.append("F1 and BLEU-1 by category, A-Mem paper Table 1 layout:")
        parts.append(amem_table1({str(results.get("system", "this system")): results}))
        parts.append("All metrics:")
        parts.append(free_form_markdown(ff))
    return "\n\n".join(parts) + "\n"


def load_correct(path: str | Path) -> dict[str, bool]:
    """``{id: correct}`` of a ``predictions.jsonl``; refuses an id that occurs twice."""
    out: dict[str, bool] = {}
    for r in load_records(path):
        i = str(r["id"])
        if i in out:
            raise ValueError(f"{path}: id {i!r} occurs twice")
        out[i] = bool(r["correct"])
    return out


def paired_against_first(names: Sequence[str],
                         correct: Mapping[str, Mapping[str, bool] | None] | None) -> dict[str, dict[str, Any]]:
    """Each system but the first against the first, on the same questions.

    ``correct`` maps a system to its ``{id: correct}`` (:func:`load_correct`). Returns
    ``{system: entry}``: ``entry`` is :meth:`elasticmem.eval.stats.PairedComparison.as_dict`
    plus ``reference`` (the first system), or ``{"reference", "not_paired": reason}`` when a
    system has no per-example outcomes or answered other questions than the first.
    """
    if not names:
        return {}
    ref, correct = names[0], correct or {}
    out: dict[str, dict[str, Any]] = {}
    for name in names[1:]:
        a, b = correct.get(ref), correct.get(name)
        if a is None or b is None:
            out[name] = {"reference": ref, "not_paired": f"no per-example outcomes of {ref if a is None else name}"}
            continue
        try:
            ca, cb = stats.pair_by_id(a, b)
        except stats.PairingError as e:
            out[name] = {"reference": ref, "not_paired": str(e)}
            continue
        if not ca:
            out[name] = {"reference": ref, "not_paired": "no questions"}
            continue
        out[name] = {"reference": ref, **stats.paired_comparison(ca, cb).as_dict()}
    return out


def paired_line(name: str, entry: Mapping[str, Any]) -> str:
    """One line of a paired comparison, e.g. ``text_rag - elasticmem: -12.5 points [-20.1, -4.0],
    exact McNemar p = 0.003 (only text_rag right 4, only elasticmem right 34, n = 240)``."""
    ref = entry["reference"]
    if "not_paired" in entry:
        return f"{name} vs {ref}: not paired ({entry['not_paired']})"
    lo, hi = entry["difference_ci"]
    line = (f"{name} - {ref}: {_points(entry['difference'])} points [{_points(lo)}, {_points(hi)}], "
            f"exact McNemar p = {_p_value(entry['p_value'])} (only {name} right {entry['only_b_correct']}, "
            f"only {ref} right {entry['only_a_correct']}, n = {entry['n']})")
    return line + (f"; {stats.TOO_FEW_FOR_HEADLINE}" if entry["too_few_for_headline"] else "")


def comparison_data(results: Mapping[str, Results], correct: Mapping[str, Mapping[str, bool] | None] | None = None,
                    title: str = "Comparison") -> dict[str, Any]:
    """``comparison.json``: ``systems`` {name: results.json dict}, ``reference`` (the first
    system), ``paired`` {name: :func:`paired_against_first` entry}, ``level``, ``headline_min_n``
    and ``too_few_for_headline`` (the systems evaluated on fewer questions)."""
    names = list(results)
    return {"title": title, "reference": names[0] if names else None, "level": stats.LEVEL,
            "headline_min_n": stats.HEADLINE_MIN_N,
            "too_few_for_headline": [n for n, r in results.items() if int(r["num_examples"]) < stats.HEADLINE_MIN_N],
            "paired": paired_against_first(names, correct), "systems": dict(results)}


def comparison_markdown(results: Mapping[str, Results], title: str = "Comparison",
                        correct: Mapping[str, Mapping[str, bool] | None] | None = None,
                        paired: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """One row per system or variant: accuracy with its 95 % interval, #Tok, B_mem, latency (and
    construction tokens per example where a system builds its memory with an LLM);
    each system against the first on the same questions (exact McNemar test, difference with
    its 95 % Tango interval, discordant counts, n; from ``correct``, {system: {id: correct}},
    or ready-made ``paired`` entries of :func:`paired_against_first`); per-type accuracies; and
    the A-Mem Table 1 layout when every system has free-form metrics."""
    if not results:
        raise ValueError("no results to compare")
    names = list(results)
    paired = paired_against_first(names, correct) if paired is None else paired
    header = ["system", "n", f"{_primary(next(iter(results.values())))[0]} (%) [95 % CI]"]
    header += ["#Tok", "B_mem", "memory tokens", "latency (s)"] + [f"{s} (s)" for s in LATENCY_STAGES]
    built = any("construction" in r for r in results.values())
    if built:  # LLM-built memories: their construction tokens, apart from answering's #Tok
        header.append("construction tokens per example")
    rows = []
    for name, r in results.items():
        split = r.get("latency_split_s", {})
        _, acc, n, ci = headline(r)
        rows.append([name, str(n), format_accuracy(acc, ci, unit="")]
                    + [_num(r.get("avg_tokens")), _num(r.get("avg_B_mem")), _num(r.get("avg_memory_tokens")),
                       _num(r.get("latency_s_per_example"), 4)]
                    + [_num(split.get(s), 4) for s in LATENCY_STAGES]
                    + ([_construction_cell(r.get("construction", {}).get("tokens_per_example"),
                                           r.get("construction", {}).get("notes_unmeasured"))] if built else []))
    parts = [f"# {title}"]
    few = [n for n, r in results.items() if int(r["num_examples"]) < stats.HEADLINE_MIN_N]
    if few:
        parts.append(f"**{stats.TOO_FEW_FOR_HEADLINE}**: {', '.join(few)}")
    parts += [_table(header, rows), _WILSON_NOTE]

    ref = names[0]
    parts.append(f"## Paired against {ref}")
    parts.append(f"Each system minus {ref} on the same questions (paired by id): accuracy difference in points "
                 f"with its {100 * stats.LEVEL:g} % Tango score interval, exact McNemar test on the discordant "
                 f"questions (those exactly one of the two got right).")
    prow = []
    for name in names[1:]:
        e = paired.get(name, {"not_paired": "not compared"})
        if "not_paired" in e:
            prow.append([name, "–", "–", "–", "–", "–", f"not paired: {e['not_paired']}"])
            continue
        lo, hi = e["difference_ci"]
        prow.append([name, str(e["n"]), f"{_points(e['difference'])} [{_points(lo)}, {_points(hi)}]",
                     str(e["only_b_correct"]), str(e["only_a_correct"]), _p_value(e["p_value"]),
                     stats.TOO_FEW_FOR_HEADLINE if e["too_few_for_headline"] else ""])
    parts.append(_table(["system", "n", f"Δ accuracy vs {ref} (points) [95 % CI]", "only system right",
                         f"only {ref} right", "McNemar exact p", "note"], prow) if prow else "(one system only)")

    types = sorted({t for r in results.values() for t in r.get("per_type", {})})
    if types:
        parts.append(f"## {_primary(next(iter(results.values())))[0].capitalize()} by question type (%) [95 % CI]")
        trow = []
        for name, r in results.items():
            per = per_type_intervals(r)
            trow.append([name] + ["–" if t not in per else format_accuracy(per[t][0], per[t][2], per[t][1], unit="")
                                  for t in types])
        parts.append(_table(["system"] + types, trow))
    evidence = evidence_markdown(results)
    if evidence:
        parts.append(evidence)
    if all("free_form" in r for r in results.values()):
        parts += ["## Free-form answers (A-Mem paper Table 1 layout, %)", amem_table1(results)]
    return "\n\n".join(parts) + "\n"


SEED_SEPARATOR = "@"
"""Variant names ``system@seed`` (e.g. ``memgen@1``) are runs of one system trained with other seeds."""


def seed_groups(names: Sequence[str]) -> dict[str, list[str]]:
    """{system: [variant names]} of the names written ``system@seed``, in order; {} when no name is."""
    groups: dict[str, list[str]] = {}
    for n in names:
        if SEED_SEPARATOR in n:
            groups.setdefault(n.rsplit(SEED_SEPARATOR, 1)[0], []).append(n)
    return groups


def seeds_data(groups: Mapping[str, Sequence[Results]], title: str = "Across training seeds") -> dict[str, Any]:
    """``seeds.json``: per system (one ``results.json`` dict per training seed, the first system the
    reference): the mean accuracy over seeds with its t interval, the per-seed accuracies and n,
    mean #Tok, memory tokens, latency, (LLM-built memories) construction tokens per example and
    (systems retrieving bank rows, every seed scored) the mean evidence recall;
    each system minus the reference, paired by seed
    (the i-th results of each: the same seed) with a paired t-test."""
    if not groups:
        raise ValueError("no results to aggregate")
    systems: dict[str, Any] = {}
    for name, runs in groups.items():
        accs = [headline(r)[1] for r in runs]
        mean, ci = stats.seed_interval(accs)
        systems[name] = {
            "metric": headline(runs[0])[0], "seeds": len(runs), "mean": mean, "ci": None if ci is None else list(ci),
            "per_seed": accs, "n_per_seed": [headline(r)[2] for r in runs],
            **{k: sum(float(r.get(k) or 0.0) for r in runs) / len(runs)
               for k in ("avg_tokens", "avg_memory_tokens", "latency_s_per_example")},
        }
        if any("construction" in r for r in runs):
            systems[name]["construction_tokens_per_example"] = sum(
                float(r.get("construction", {}).get("tokens_per_example", 0.0)) for r in runs) / len(runs)
            unmeasured = max(int(r.get("construction", {}).get("notes_unmeasured", 0)) for r in runs)
            if unmeasured:
                systems[name]["construction_notes_unmeasured"] = unmeasured
        if all(r.get("evidence_retrieval") for r in runs):
            systems[name]["evidence_recall"] = sum(r["evidence_retrieval"]["recall_any"] for r in runs) / len(runs)
    ref = next(iter(groups))
    paired = {}
    for name in list(groups)[1:]:
        a, b = systems[ref]["per_seed"], systems[name]["per_seed"]
        paired[name] = (stats.seed_paired(a, b) if len(a) == len(b)
                        else {"not_paired": f"{len(b)} seeds against {len(a)} for {ref}"})
    return {"title": title, "reference": ref, "level": stats.LEVEL, "systems": systems, "paired": paired}


def seeds_markdown(data: Mapping[str, Any]) -> str:
    """The table of :func:`seeds_data`: accuracy as mean over seeds [95 % t interval over seeds]."""
    ref = data["reference"]
    rows = []
    for name, e in data["systems"].items():
        ci = "–" if e["ci"] is None else f"[{100 * e['ci'][0]:.1f}, {100 * e['ci'][1]:.1f}]"
        rows.append([name, str(e["seeds"]), f"{100 * e['mean']:.1f} {ci}",
                     ", ".join(f"{100 * a:.1f}" for a in e["per_seed"]), ", ".join(map(str, e["n_per_seed"])),
                     _num(e["avg_tokens"]), _num(e["avg_memory_tokens"]), _num(e["latency_s_per_example"], 4)])
    built = any("construction_tokens_per_example" in e for e in data["systems"].values())
    if built:
        for row, e in zip(rows, data["systems"].values()):
            row.append(_construction_cell(e.get("construction_tokens_per_example"),
                                          e.get("construction_notes_unmeasured")))
    found = any("evidence_recall" in e for e in data["systems"].values())
    if found:
        for row, e in zip(rows, data["systems"].values()):
            row.append(_pct(e.get("evidence_recall"), 1))
    metric = next(iter(data["systems"].values()))["metric"]
    parts = [f"# {data['title']}",
             _table(["system", "seeds", f"{metric} (%) mean [95 % CI over seeds]", "per seed (%)", "n per seed",
                     "#Tok", "memory tokens", "latency (s)"] + (["construction tokens per example"] if built else [])
                    + (["evidence recall (%), mean over seeds"] if found else []),
                    rows),
             "The interval is Student's t over the seeds' results (how much another training run may differ); "
             "each seed's own question-level interval is in its comparison.md. One seed has no interval."]
    if data["paired"]:
        parts.append(f"## Paired by seed against {ref}")
        prow = []
        for name, e in data["paired"].items():
            if "not_paired" in e:
                prow.append([name, "–", f"not paired: {e['not_paired']}", "–"])
                continue
            d_ci = e["difference_ci"]
            ci = "–" if d_ci is None else f"[{_points(d_ci[0])}, {_points(d_ci[1])}]"
            prow.append([name, str(e["seeds"]), f"{_points(e['difference'])} {ci}",
                         "–" if e["p_value"] is None else _p_value(e["p_value"])])
        parts.append(_table(["system", "seeds", f"Δ vs {ref} (points) [95 % CI over seeds]", "paired t-test p"], prow))
    return "\n\n".join(parts) + "\n"


def write_seeds(groups: Mapping[str, Sequence[Results]], path: str | Path,
                title: str = "Across training seeds") -> Path:
    """Write :func:`seeds_markdown` to ``path`` (``seeds.md``) and :func:`seeds_data` beside it as JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = seeds_data(groups, title)
    path.write_text(seeds_markdown(data), encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    return path


def write_report(results: Results, path: str | Path, title: str | None = None) -> Path:
    """Write :func:`results_markdown` to ``path``; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(results_markdown(results, title), encoding="utf-8")
    return path


def write_comparison(results: Mapping[str, Results], path: str | Path, title: str = "Comparison",
                     correct: Mapping[str, Mapping[str, bool] | None] | None = None) -> Path:
    """Write :func:`comparison_markdown` to ``path`` (``comparison.md``) and :func:`comparison_data`
    beside it (``comparison.json``); ``correct``: {system: {id: correct}} for the paired
    comparisons (:func:`load_correct` of each ``predictions.jsonl``). Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = comparison_data(results, correct, title)
    path.write_text(comparison_markdown(results, title, paired=data["paired"]), encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(data, indent=1), encoding="utf-8")
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
    sp = sub.add_parser("seeds", help="mean and interval over training seeds, per system")
    sp.add_argument("runs", nargs="+", metavar="NAME=RESULTS_JSON[,RESULTS_JSON...]",
                    help="one system's results.json per seed, the same seed order for every system; the first "
                         "system is the reference")
    sp.add_argument("--title", default="Across training seeds")
    sp.add_argument("--out", default="seeds.md")
    a = p.parse_args(argv)
    if a.cmd == "seeds":
        groups = {}
        for spec in a.runs:
            name, sep, files = spec.partition("=")
            if not sep or not files:
                p.error(f"{spec!r}: write NAME=RESULTS_JSON[,RESULTS_JSON...]")
            groups[name] = [load_results(Path(f)) for f in files.split(",")]
        print(write_seeds(groups, a.out, a.title))
        return 0
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
    correct = {n: load_correct(q.with_name("predictions.jsonl")) if q.with_name("predictions.jsonl").is_file()
               else None for n, q in zip(names, paths)}
    print(write_comparison(dict(zip(names, loaded)), a.out, a.title, correct))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
