"""A reading ladder's published tables (docs/recipe.md), re-scored from its predictions' text.

    python scripts/ladder_results.py ~/runs/shift/ladder --extra ~/runs/shift/ladder_extra \\
        --name recipe/shift_s0 --title "persona_shift, seed 0" --command "bash scripts/..."
    python scripts/gen_results_tables.py        # then the marked tables follow the files

Reads each rung folder of the ladder (and of ``--extra`` folders, e.g. the trained no-memory
reasoner), keeps a trimmed copy of each rung's predictions under ``docs/results/NAME/`` (id,
question type, answer text, gold letter, budgets by rank, memory tokens: what the figures need),
and writes ``docs/results/NAME.json``: each rung's accuracy re-scored from the answer text, with
n and its Wilson interval, its memory tokens, and ElasticMem (``latent_learned``) against it,
paired by question (Tango interval, exact McNemar p); and ``NAME_budgets.json``: the learned
budget vectors' distribution. Both name their predictions (path, sha256, figure), so that
``gen_results_tables.py`` refuses them once a figure no longer follows from the text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elasticmem.eval import stats  # noqa: E402
from elasticmem.eval.budget_rules import budget_vectors  # noqa: E402
from elasticmem.eval.ladder import RUNGS  # noqa: E402
from elasticmem.eval.metrics import load_records  # noqa: E402
from elasticmem.eval.provenance import git_state  # noqa: E402
from elasticmem.eval.rescore import predictions_entry, rescore_file  # noqa: E402

SYSTEM = "latent_learned"
EXTRA_LABELS = {"no_memory_trained": "the no-memory reasoner, same recipe (control)",
                "base_no_memory": "the base reasoner, no memory, untrained", "text_trained": "text memory, same recipe"}


def trim(src: Path, dst: Path) -> None:
    """The fields the tables need, one record a line, in id order."""
    recs = sorted(load_records(src), key=lambda r: str(r["id"]))
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "w", encoding="utf-8") as f:
        for r in recs:
            mems = sorted(r.get("retrieved") or [], key=lambda m: m.get("rank", 0))
            f.write(json.dumps({"id": r["id"], "question_type": r.get("question_type"), "prediction": r["prediction"],
                                "gold": r["gold"], "memory_tokens": (r.get("tokens") or {}).get("memory", 0),
                                "retrieved": [{"rank": m.get("rank"), "budget": m.get("budget")} for m in mems]})
                    + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ladder", help="the ladder's eval.output_dir")
    ap.add_argument("--extra", nargs="*", default=[], help="folders holding more rung folders (trained controls)")
    ap.add_argument("--name", required=True, help="results name under docs/results/ (e.g. recipe/shift_s0)")
    ap.add_argument("--title", required=True, help="what the ladder ran on, for the table's first column")
    ap.add_argument("--command", default="", help="the command that made the ladder")
    ap.add_argument("--label", action="append", default=[], metavar="FOLDER=TEXT",
                    help="what an --extra folder is, for its row (repeatable); such folders are rows too")
    ap.add_argument("--num-options", type=int, default=4)
    ap.add_argument("--results", default=str(REPO / "docs" / "results"))
    args = ap.parse_args(argv)

    folders: dict[str, Path] = {}
    for root in [Path(args.ladder), *map(Path, args.extra)]:
        for d in sorted(root.iterdir()):
            if (d / "predictions.jsonl").is_file() and (d / "results.json").is_file():
                folders.setdefault(d.name, d)
    labels = EXTRA_LABELS | dict(item.split("=", 1) for item in args.label)
    order = [r.name for r in RUNGS if r.name in folders] + [n for n in labels if n in folders]
    if SYSTEM not in folders:
        print(f"no {SYSTEM} rung under {args.ladder}", file=sys.stderr)
        return 2
    out = Path(args.results) / args.name
    base = REPO
    reads = {r.name: r.reads for r in RUNGS} | labels
    rows, preds, data = [], {}, {"rungs": {}, "paired": {}}
    correct: dict[str, dict[str, bool]] = {}
    for name in order:
        path = out / f"{name}.predictions.jsonl"
        trim(folders[name] / "predictions.jsonl", path)
        correct[name] = rescore_file(path, args.num_options)
        k, n = sum(correct[name].values()), len(correct[name])
        recs = load_records(path)
        data["rungs"][name] = {"accuracy": k / n, "n": n, "ci95": list(stats.wilson_interval(k, n)),
                               "memory_tokens": sum(r["memory_tokens"] for r in recs) / n}
        preds[name] = predictions_entry(path, base, args.num_options, figure=f"rungs.{name}.accuracy")
    for name in order:
        if name != SYSTEM:
            pc = stats.paired_comparison(*stats.pair_by_id(correct[name], correct[SYSTEM]))
            data["paired"][name] = pc.as_dict()
    for name in order:
        acc = (f"{{rungs[{name}][accuracy]:.3f}} [{{rungs[{name}][ci95][0]:.3f}}, {{rungs[{name}][ci95][1]:.3f}}], "
               f"n = {{rungs[{name}][n]}}")
        vs = ("" if name == SYSTEM else
              f"{{paired[{name}][difference]:pct+.1f}} [{{paired[{name}][difference_ci][0]:pct+.1f}}, "
              f"{{paired[{name}][difference_ci][1]:pct+.1f}}], p = {{paired[{name}][p_value]:.2g}}")
        label = f"**{name}**" if name == SYSTEM else name
        rows.append([label, reads[name], acc, f"{{rungs[{name}][memory_tokens]:.1f}}", vs])
    # the code that ran the ElasticMem rung (its results.json's provenance), not this script's
    ran = json.loads((folders[SYSTEM] / "results.json").read_text()).get("provenance", {}).get("code") or {}
    commit = (ran.get("commit") or "unknown")[:12]
    spec = {"command": args.command, "commit": commit, "code_dirty": ran.get("dirty"),
            "tables_written_at": git_state().get("commit"),
            "provenance": f"re-scored from the answers' text of the ladder in {args.ladder} "
                          f"(trimmed copies under docs/results/{args.name}/); written by scripts/ladder_results.py",
            "predictions": preds, "data": data,
            "table": {"header": [f"rung ({args.title})", "reads", "accuracy [95 % Wilson], n", "memory tokens",
                                 "ElasticMem - rung (paired, points [95 %], McNemar p)"], "rows": rows}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(spec, indent=1) + "\n")
    vec = budget_vectors(load_records(out / f"{SYSTEM}.predictions.jsonl"), top=6)
    vspec = {"command": args.command, "commit": commit, "code_dirty": ran.get("dirty"),
             "provenance": f"the budgets of {SYSTEM}'s predictions (docs/results/{args.name}/{SYSTEM}.predictions.jsonl)",
             "data": vec,
             "table": {"header": ["learned budgets by rank", f"share of the {vec['n']} questions"],
                       "rows": [[str(tuple(v["budgets"])), f"{{most_common[{i}][share]:.3f}}"]
                                for i, v in enumerate(vec["most_common"])]}}
    Path(str(out) + "_budgets.json").write_text(json.dumps(vspec, indent=1) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out}_budgets.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
