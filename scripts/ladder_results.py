"""Reading ladders' published tables (docs/recipe.md), re-scored from their predictions' text.

    python scripts/ladder_results.py RUN/ladder --extra RUN/ladder_extra --name recipe/x --title "..." \\
        --command "..."                                   # one ladder
    python scripts/ladder_results.py OUT/s0/ladder OUT/s1/ladder OUT/s2/ladder --name recipe/y --title "..."
                                                          # seeds of one recipe: per seed and pooled per question
    python scripts/gen_results_tables.py                  # then the marked tables follow the files

Reads each rung folder of the ladder(s) (and of ``--extra`` folders: trained controls, attempts;
with several ladders, one ``--extra`` folder per ladder, in the same order), keeps a trimmed copy of each rung's predictions
under ``docs/results/NAME/`` (id, question type, answer text, gold letter, memory tokens, and
the learned rung's budgets by rank: what the figures need), and writes ``docs/results/NAME.json``.

One ladder: each rung's accuracy re-scored from the answer text with n and its Wilson interval,
its memory tokens, and ElasticMem (``latent_learned``) against it paired by question (Tango
interval, exact McNemar p); ``NAME_budgets.json``: the learned budget vectors' distribution.
Several ladders (seeds sharing their questions): each rung per seed, pooled per question (each
question's mean over the seeds, a bootstrap over questions: ``stats.pooled_per_question``) and
ElasticMem against it pooled per question (``stats.pooled_paired_per_question``); never
n = seeds x questions. Every file names its predictions (path, sha256, figure), so that
``gen_results_tables.py`` refuses it once a figure no longer follows from the text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elasticmem.apps.ladder import RUNGS  # noqa: E402
from elasticmem.eval import stats  # noqa: E402
from elasticmem.eval.budget_rules import budget_vectors  # noqa: E402
from elasticmem.eval.metrics import load_records  # noqa: E402
from elasticmem.eval.provenance import git_state  # noqa: E402
from elasticmem.eval.rescore import predictions_entry, rescore_file  # noqa: E402

SYSTEM = "latent_learned"
EXTRA_LABELS = {"no_memory_trained": "the no-memory reasoner, same recipe (control)",
                "base_no_memory": "the base reasoner, no memory, untrained", "text_trained": "text memory, same recipe"}


def trim(src: Path, dst: Path, budgets: bool, question_type: str | None = None) -> None:
    """The fields the tables need, one record a line, in id order (only ``question_type``'s, if given)."""
    recs = sorted((r for r in load_records(src) if question_type in (None, r.get("question_type"))),
                  key=lambda r: str(r["id"]))
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "w", encoding="utf-8") as f:
        for r in recs:
            row = {"id": r["id"], "question_type": r.get("question_type"), "prediction": r["prediction"],
                   "gold": r["gold"], "memory_tokens": (r.get("tokens") or {}).get("memory", 0)}
            if budgets:
                mems = sorted(r.get("retrieved") or [], key=lambda m: m.get("rank", 0))
                row["retrieved"] = [{"rank": m.get("rank"), "budget": m.get("budget")} for m in mems]
            f.write(json.dumps(row) + "\n")


def rung_folders(roots: list[Path]) -> dict[str, Path]:
    """{rung: folder} of the finished rung folders under ``roots`` (the first root wins)."""
    folders: dict[str, Path] = {}
    for root in roots:
        for d in sorted(root.iterdir()):
            if (d / "predictions.jsonl").is_file() and (d / "results.json").is_file():
                folders.setdefault(d.name, d)
    return folders


def code_of(folder: Path) -> tuple[str, bool | None]:
    """The commit (12 hex digits) and dirty flag of the code that evaluated ``folder``."""
    ran = json.loads((folder / "results.json").read_text()).get("provenance", {}).get("code") or {}
    return (ran.get("commit") or "unknown")[:12], ran.get("dirty")


def _acc(key: str) -> str:
    return f"{{{key}[accuracy]:.3f}} [{{{key}[ci95][0]:.3f}}, {{{key}[ci95][1]:.3f}}]"


def _diff(key: str) -> str:
    return (f"{{{key}[difference]:pct+.1f}} [{{{key}[difference_ci][0]:pct+.1f}}, "
            f"{{{key}[difference_ci][1]:pct+.1f}}], p = {{{key}[p_value]:.2g}}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ladders", nargs="+", help="the ladders' eval.output_dir (several: one per seed)")
    ap.add_argument("--extra", nargs="*", default=[],
                    help="folders holding more rung folders; with several ladders, one per ladder in order")
    ap.add_argument("--name", required=True, help="results name under docs/results/ (e.g. recipe/shift_s0)")
    ap.add_argument("--title", required=True, help="what the ladder ran on, for the table's first column")
    ap.add_argument("--command", default="", help="the command that made the ladder")
    ap.add_argument("--label", action="append", default=[], metavar="FOLDER=TEXT",
                    help="what an --extra folder is, for its row (repeatable); such folders are rows too")
    ap.add_argument("--question-type", help="only the questions of this type (e.g. multi_hop): the ladder on them")
    ap.add_argument("--num-options", type=int, default=4)
    ap.add_argument("--results", default=str(REPO / "docs" / "results"))
    args = ap.parse_args(argv)

    ladders = [Path(d) for d in args.ladders]
    seeds = len(ladders)
    if seeds > 1 and args.extra and len(args.extra) != seeds:
        ap.error(f"with {seeds} ladders give one --extra folder per ladder, got {len(args.extra)}")
    if seeds == 1:
        extras = [[Path(e) for e in args.extra]]
    else:
        extras = [[Path(e)] for e in args.extra] if args.extra else [[] for _ in ladders]
    per_seed = [rung_folders([lad, *ex]) for lad, ex in zip(ladders, extras)]
    labels = EXTRA_LABELS | dict(item.split("=", 1) for item in args.label)
    common = set.intersection(*(set(f) for f in per_seed))
    order = [r.name for r in RUNGS if r.name in common] + [n for n in labels if n in common]
    if SYSTEM not in common:
        print(f"no {SYSTEM} rung in every ladder of {args.ladders}", file=sys.stderr)
        return 2
    out = Path(args.results) / args.name
    reads = {r.name: r.reads for r in RUNGS} | labels
    preds: dict[str, dict] = {}
    correct: dict[str, list[dict[str, bool]]] = {n: [] for n in order}
    tokens: dict[str, list[float]] = {n: [] for n in order}
    for s, folders in enumerate(per_seed):
        for name in order:
            tag = name if seeds == 1 else f"s{s}/{name}"
            path = out / f"{tag}.predictions.jsonl"
            trim(folders[name] / "predictions.jsonl", path, budgets=name == SYSTEM, question_type=args.question_type)
            correct[name].append(rescore_file(path, args.num_options))
            recs = load_records(path)
            tokens[name].append(sum(r["memory_tokens"] for r in recs) / len(recs))
            preds[tag] = predictions_entry(path, REPO, args.num_options,
                                           figure=f"rungs.{name}.accuracy" if seeds == 1 else
                                           f"rungs.{name}.per_seed.{s}.accuracy")
    data: dict = {"rungs": {}, "paired": {}}
    rows = []
    for name in order:
        per = []
        for s in range(seeds):
            k, n = sum(correct[name][s].values()), len(correct[name][s])
            per.append({"accuracy": k / n, "n": n, "ci95": list(stats.wilson_interval(k, n)),
                        "memory_tokens": tokens[name][s]})
        if seeds == 1:
            data["rungs"][name] = per[0]
        else:
            ids = sorted(correct[name][0])
            if any(sorted(c) != ids for c in correct[name] + correct[SYSTEM]):
                raise SystemExit(f"{name}: the seeds' ladders answered different questions")
            matrix = [[c[i] for i in ids] for c in correct[name]]
            data["rungs"][name] = {"per_seed": per, "pooled": stats.pooled_per_question(matrix),
                                   "memory_tokens": sum(tokens[name]) / seeds}
        if name != SYSTEM:
            if seeds == 1:
                data["paired"][name] = stats.paired_comparison(
                    *stats.pair_by_id(correct[name][0], correct[SYSTEM][0])).as_dict()
            else:
                ids = sorted(correct[name][0])
                data["paired"][name] = stats.pooled_paired_per_question(
                    [[c[i] for i in ids] for c in correct[name]], [[c[i] for i in ids] for c in correct[SYSTEM]])
        label = f"**{name}**" if name == SYSTEM else name
        vs = "" if name == SYSTEM else _diff(f"paired[{name}]")
        if seeds == 1:
            rows.append([label, reads[name], _acc(f"rungs[{name}]") + f", n = {{rungs[{name}][n]}}",
                         f"{{rungs[{name}][memory_tokens]:.1f}}", vs])
        else:
            rows.append([label, reads[name], *(_acc(f"rungs[{name}][per_seed][{s}]") for s in range(seeds)),
                         _acc(f"rungs[{name}][pooled]"), f"{{rungs[{name}][memory_tokens]:.1f}}", vs])
    commit, dirty = code_of(per_seed[0][SYSTEM])
    n_q = len(correct[SYSTEM][0])
    header = ([f"rung ({args.title})", "reads", "accuracy [95 % Wilson], n", "memory tokens",
               "ElasticMem - rung (paired, points [95 %], McNemar p)"] if seeds == 1 else
              [f"rung ({args.title})", "reads", *(f"seed {s}" for s in range(seeds)),
               f"pooled per question (n = {n_q}, {seeds} seeds; bootstrap)", "memory tokens",
               "ElasticMem - rung, pooled per question (points [95 % bootstrap], sign-flip p)"])
    spec = {"command": args.command, "commit": commit, "code_dirty": dirty, "tables_written_at": git_state()["commit"],
            "provenance": f"re-scored from the answers' text of {', '.join(args.ladders)} (trimmed copies under "
                          f"docs/results/{args.name}/); written by scripts/ladder_results.py",
            "predictions": preds, "data": data, "table": {"header": header, "rows": rows}}
    if args.question_type:
        spec["question_type"] = args.question_type
    if seeds > 1:
        spec["pooling"] = data["paired"][next(n for n in order if n != SYSTEM)]["pooling"] if len(order) > 1 else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(spec, indent=1) + "\n")
    if args.question_type:  # the budget vectors are the whole ladder's (its own results file)
        print(f"wrote {out.with_suffix('.json')}", file=sys.stderr)
        return 0
    vec = budget_vectors([r for s in range(seeds) for r in load_records(
        out / (f"{SYSTEM}.predictions.jsonl" if seeds == 1 else f"s{s}/{SYSTEM}.predictions.jsonl"))], top=6)
    vspec = {"command": args.command, "commit": commit, "code_dirty": dirty,
             "provenance": f"the budgets of {SYSTEM}'s predictions (docs/results/{args.name}/)", "data": vec,
             "table": {"header": ["learned budgets by rank", f"share of the {vec['n']} answers"
                                  + (f" ({seeds} seeds)" if seeds > 1 else "")],
                       "rows": [[str(tuple(v["budgets"])), f"{{most_common[{i}][share]:.3f}}"]
                                for i, v in enumerate(vec["most_common"])]}}
    Path(str(out) + "_budgets.json").write_text(json.dumps(vspec, indent=1) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out}_budgets.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
