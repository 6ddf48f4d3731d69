"""The persona recipe's published tables (docs/recipe.md), written from its runs as results files.

    python scripts/persona_results.py ~/runs/persona_recipe --commit $(git rev-parse --short HEAD)
    python scripts/gen_results_tables.py          # then the marked tables in docs/ follow the files

Reads ``OUT/s*/ladder`` (each seed's reading ladder, with ``no_memory_trained/`` and
``text_trained/`` beside its rungs, as ``scripts/persona_recipe.sh`` leaves them), re-scores
every answer from its text (``elasticmem.eval.rescore.rescore_file``: the option letter parsed
with the evaluation's own rule against the gold letter, ``--num-options`` options; the stored
``correct`` flags are not read), pools the seeds per question with ``elasticmem.apps.ladder.pool``
(each question's mean over the seeds, n = the questions, bootstrap intervals over questions; the
cells say "n = 336 questions x 3 seeds"), recounts each seed's losses and cost dial with
``elasticmem.apps.ladder.ladder_data`` from the same re-scored outcomes, and writes four files
under ``docs/results/recipe/``
(``--results`` elsewhere): ``persona_rungs`` (each rung and control per seed and pooled),
``persona_comparisons`` (ElasticMem against each, paired per seed, pooled and over seeds),
``persona_losses`` (where accuracy is lost, per seed) and ``persona_cost_dial``. A seed that lacks
a control (still running) reads "not run" in its cell and is left out of that row's pooling.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

ROWS = (  # (folder, label): the rungs of the ladder, then the two controls trained with the recipe
    ("no_memory", "nothing retrieved (the same checkpoint)"),
    ("text_evidence", "the evidence alone, as text"),
    ("latent_evidence", "the evidence alone, latent (64 tokens)"),
    ("latent_uniform", "top 8, latent, uniform budgets (64 each)"),
    ("latent_oracle", "top 8, latent, oracle budgets"),
    ("latent_learned", "**top 8, latent, learned budgets (ElasticMem)**"),
    ("text_topz", "top 8, as text (the same checkpoint)"),
    ("no_memory_trained", "no-memory reasoner, same recipe (control)"),
    ("text_trained", "text memory, same recipe (control)"),
)
NUM_OPTIONS = 4
"""Options per question of the persona task (configs/persona_recipe.yaml data.synthetic.num_options):
the re-scoring parses only these option letters, as the evaluation did."""

AGAINST = (("latent_uniform", "the same checkpoint, uniform budgets"),
           ("no_memory", "the same checkpoint, nothing retrieved"),
           ("latent_oracle", "the same checkpoint, oracle budgets"),
           ("no_memory_trained", "the no-memory reasoner, same recipe"), ("text_trained", "text memory, same recipe"))


def pooling_text() -> str:
    """How every pooled figure of the four files was pooled (their ``pooling`` field)."""
    from elasticmem.eval.stats import BOOTSTRAP_SEED, RESAMPLES

    return ("per question: each question's mean correctness over the seeds (its mean difference, paired), "
            f"n = the questions; 95 % percentile bootstrap over questions ({RESAMPLES} resamples, seed "
            f"{BOOTSTRAP_SEED}), paired for differences; p: sign-flip permutation test over questions; every "
            "outcome re-scored from the answer text")


def _clean(x: Any) -> Any:
    """JSON without NaN / inf (written as null)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _acc(path: str) -> str:
    return f"{{{path}[accuracy]:.3f}} [{{{path}[ci95][0]:.3f}}, {{{path}[ci95][1]:.3f}}]"


def _diff(path: str, p: bool = True) -> str:
    ci = f"[{{{path}[difference_ci][0]:pct+.1f}}, {{{path}[difference_ci][1]:pct+.1f}}]"
    cell = f"{{{path}[difference]:pct+.1f}} {ci}"
    return cell + (f", p = {{{path}[p_value]:.2g}}" if p else "")


def _size(path: str, seeds: int) -> str:
    """How a pooled cell was pooled: its questions and seeds (``seeds``: for the plural only)."""
    return f"n = {{{path}[n]}} questions x {{{path}[seeds]}} seed" + ("s" if seeds != 1 else "")


def rung_folders(ladder: Path) -> list[str]:
    """The folders of a ladder holding a finished evaluation (rungs, cost dial, controls)."""
    return sorted(p.name for p in ladder.iterdir()
                  if (p / "results.json").is_file() and (p / "predictions.jsonl").is_file())


def tables(out: Path, seeds: list[str], num_options: int = NUM_OPTIONS) -> dict[str, dict[str, Any]]:
    """``{name: (data, table)}`` of the four results files, from ``out/s{seed}/ladder``, every
    outcome re-scored from the answer text with ``num_options`` options."""
    from elasticmem.apps.ladder import ladder_data, pool
    from elasticmem.eval.rescore import rescore_file

    def rescored(path: Path) -> dict[str, bool]:
        return rescore_file(path, num_options, "mc_letter")

    dirs = [out / f"s{s}" / "ladder" for s in seeds]
    pooled = pool([str(d) for d in dirs], [(a, "latent_learned") for a, _ in AGAINST], correct_of=rescored)
    ladders = {str(d): ladder_data(d, rung_folders(d), correct_of=rescored) for d in dirs}

    def seed_cells(entry: dict[str, Any], key: str, cell) -> list[str]:
        have = {d: i for i, d in enumerate(entry["dirs"])}
        return [cell(f"{key}[per_seed][{have[str(d)]}]") if str(d) in have else "not run" for d in dirs]

    # every template reads ``data``; names with spaces cannot be format fields, so rename
    comparisons = {f"vs_{a}": pooled["comparisons"][f"latent_learned - {a}"]
                   for a, _ in AGAINST if f"latent_learned - {a}" in pooled["comparisons"]}
    rungs = {n: pooled["rungs"][n] for n, _ in ROWS if n in pooled["rungs"]}
    header = ["", *[f"seed {s}" for s in seeds]]

    rung_rows = [[label, *seed_cells(rungs[n], f"rungs[{n}]", _acc),
                  _acc(f"rungs[{n}][pooled]") + ", " + _size(f"rungs[{n}][pooled]", rungs[n]["pooled"]["seeds"]),
                  f"{{rungs[{n}][pooled][memory_tokens]:.1f}}"] for n, label in ROWS if n in rungs]
    cmp_rows = [[label, *seed_cells(comparisons[f"vs_{a}"], f"comparisons[vs_{a}]", _diff),
                 _diff(f"comparisons[vs_{a}][pooled]") + ", "
                 + _size(f"comparisons[vs_{a}][pooled]", comparisons[f"vs_{a}"]["pooled"]["seeds"]),
                 (_diff(f"comparisons[vs_{a}][by_seed]", p=False)
                  if comparisons[f"vs_{a}"]["by_seed"]["difference_ci"] else "one seed")]
                for a, label in AGAINST if f"vs_{a}" in comparisons]
    losses = {f"s{s}": ladders[str(d)]["losses"] for s, d in zip(seeds, dirs)}
    what = list(next(iter(losses.values())))
    first = ladders[str(dirs[0])]["losses"]
    loss_rows = [[f"{w} ({first[w]['with']} - {first[w]['without']})", *[_diff(f"losses[s{s}][{w}]") for s in seeds]]
                 for w in what]
    dial_seeds = [(s, d) for s, d in zip(seeds, dirs) if ladders[str(d)]["cost_dial"]]
    dial = {f"s{s}": {f"cap{c['cap']}": c for c in ladders[str(d)]["cost_dial"]} for s, d in dial_seeds}
    caps = sorted({int(c[3:]) for v in dial.values() for c in v})
    dial_rows = [[str(c), _acc(f"rungs[learned_cap{c}][pooled]"),
                  f"{{rungs[learned_cap{c}][pooled][memory_tokens]:.1f}}", _acc(f"rungs[uniform_cap{c}][pooled]"),
                  *[_diff(f"dial[s{s}][cap{c}][paired]") if f"cap{c}" in dial[f"s{s}"] else "not run"
                    for s, _ in dial_seeds]]
                 for c in caps]
    dial_rungs = {n: pooled["rungs"][n] for c in caps for n in (f"learned_cap{c}", f"uniform_cap{c}")}
    seeds_word = "seeds " + ", ".join(s for s, _ in dial_seeds)
    return {
        "persona_rungs": {"data": {"rungs": rungs},
                          "table": {"header": ["rung (after GRPO)", *header[1:],
                                               f"pooled per question over {len(seeds)} seeds",
                                               "memory tokens"], "rows": rung_rows}},
        "persona_comparisons": {"data": {"comparisons": comparisons},
                                "table": {"header": ["ElasticMem against", *header[1:], "pooled per question",
                                                     "mean over seeds [t interval]"], "rows": cmp_rows}},
        "persona_losses": {"data": {"losses": losses},
                           "table": {"header": ["where accuracy is lost", *header[1:]], "rows": loss_rows}},
        "persona_cost_dial": {"data": {"rungs": dial_rungs, "dial": dial},
                              "table": {"header": ["cap (tokens a question)",
                                                   f"learned ({seeds_word} pooled per question)",
                                                   "learned: memory tokens",
                                                   f"uniform ({seeds_word} pooled per question)",
                                                   *[f"learned - uniform, seed {s}" for s, _ in dial_seeds]],
                                        "rows": dial_rows}},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the recipe's OUT folder (holding s0/, s1/, ...)")
    ap.add_argument("--seeds", default=None, help="comma-separated (default: every OUT/s*/ladder/ladder.json)")
    ap.add_argument("--commit", required=True, help="the commit the runs were made with")
    ap.add_argument("--results", type=Path, default=REPO / "docs" / "results" / "recipe", help="where to write")
    ap.add_argument("--num-options", type=int, default=NUM_OPTIONS,
                    help=f"options per question, for re-scoring the answers' text (default {NUM_OPTIONS})")
    args = ap.parse_args(argv)
    seeds = (args.seeds.split(",") if args.seeds else
             sorted(p.parent.parent.name[1:] for p in args.out.glob("s*/ladder/ladder.json")))
    if not seeds:
        ap.error(f"no OUT/s*/ladder/ladder.json under {args.out}")
    command = (f"OUT={args.out} SEEDS=\"{' '.join(seeds)}\" bash scripts/persona_recipe.sh; "
               f"python scripts/persona_results.py {args.out} --commit {args.commit}")
    args.results.mkdir(parents=True, exist_ok=True)
    from elasticmem.eval.provenance import file_sha256

    inputs = {str(p.relative_to(args.out)): file_sha256(p) for s in seeds
              for p in sorted((args.out / f"s{s}" / "ladder").glob("*/predictions.jsonl"))}
    for name, spec in tables(args.out, seeds, args.num_options).items():
        spec = {"command": command, "commit": args.commit,
                "provenance": f"{args.out}/s{{{','.join(seeds)}}}/ladder (answers re-scored from their text, "
                              f"{args.num_options} options; pooled per question by elasticmem.apps.ladder.pool; "
                              "NaN written as null)",
                "pooling": pooling_text(), "inputs": inputs, "data": _clean(spec["data"]), "table": spec["table"]}
        (args.results / f"{name}.json").write_text(json.dumps(spec, indent=1) + "\n")
        print(f"wrote {args.results / name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
