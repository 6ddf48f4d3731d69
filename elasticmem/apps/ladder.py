"""The reading ladder: where a checkpoint's accuracy is lost (reading, distraction, allocation).

One trained reader, one set of questions, each rung a variant of ``evaluate.py`` (so each is
resumable and keeps its predictions), from no memory up to the text reading of the same
memories:

==================  ===========================================================================
rung                what the reader reads
==================  ===========================================================================
no_memory           nothing (the same checkpoint, top_z 0)
text_evidence       the question's evidence chunks alone, as text
latent_evidence     the evidence chunks alone, latent, max_budget each
latent_uniform      its own top-Z retrieval, latent, max_budget each (uniform budgets)
latent_oracle       the same top-Z, max_budget for the evidence chunks and 0 for the others
latent_learned      the same top-Z at the learned policy's budgets: ElasticMem
rule_top1, 2, 4     the same top-Z, max_budget for the K best-ranked, 0 for the others (K < Z)
rule_gap            the same top-Z, max_budget for each memory whose score is within the gap of
                    the best; the gap chosen on the validation split (``ladder.gaps``)
rule_spread         the same top-Z, the learned rung's mean memory tokens shared out evenly
text_topz           the same top-Z as text
text_top1, 2, 4, 8  the same retrieval's top 1, 2, 4 and 8 as text (K != Z)
==================  ===========================================================================

Each row gives accuracy with n and its 95 % Wilson interval, memory tokens, the paired difference
against the rung above it (Tango's interval, exact McNemar) and, for latent rungs, the mean
budget of evidence and other memories. Where accuracy is lost: reading (text_evidence -
latent_evidence), distraction (latent_evidence - latent_uniform), retrieval and allocation
(latent_oracle is what a perfect allocator gets from these memories; latent_learned - latent_oracle
what the policy loses). With ``--caps``, the cost dial: the learned policy under
``memory.policy.token_cap`` (its lowest-value memories cut first) against uniform budgets at the
same cap (the cap shared out evenly), at each cap, and (``ladder.rules_at_caps``) the other rules
under each cap. ``ladder.md`` ends with the learned budgets against the best rule at equal or fewer
memory tokens and the best rule under each cap (paired), and the distribution of the learned
budget vectors (``elasticmem.eval.budget_rules``). With ``--text-checkpoint`` (the recipe's text
arm) the text rungs are read by a reader trained on text.

    python -m elasticmem.apps.ladder --config configs/persona_recipe.yaml eval.checkpoint=RUN/final \\
        eval.output_dir=RUN/ladder [--text-checkpoint TEXT_RUN/final] [--caps 8,16,32,64] [key=value ...]
    python -m elasticmem.apps.ladder pool RUN_0/ladder RUN_1/ladder RUN_2/ladder    # seeds pooled

Each flag of the ladder is also a ``ladder.KEY=VALUE`` argument (``ladder.caps=8,16,32,64``), each
of ``pool`` a ``pool.KEY=VALUE`` one (``pool.out=FILE``); ``--help`` lists them.

Writes ``ladder.md`` and ``ladder.json`` in ``eval.output_dir``. ``pool`` compares rungs over
several seeds' ladders: per seed, pooled per question (each question's mean over the seeds, n =
questions, a bootstrap interval over questions), and the mean over seeds with its t interval,
paired by seed. ``ladder.json`` records its ``provenance`` (``elasticmem.eval.provenance``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from elasticmem.utils.options import Flag, Options


@dataclass(frozen=True)
class Rung:
    name: str
    overrides: tuple[str, ...]
    reads: str
    text: bool = False
    """A text rung: evaluated with ``--text-checkpoint`` when one is given."""
    derived: bool = False
    """Its settings come from other rungs (the gap chosen on validation, the learned policy's
    mean total): evaluated after them (``elasticmem.eval.budget_rules``)."""


RUNGS: tuple[Rung, ...] = (
    Rung("no_memory", ("eval.system=no_memory",), "nothing"),
    Rung("text_evidence", ("eval.system=text_rag", "eval.memories=evidence"), "the evidence alone, as text", True),
    Rung("latent_evidence", ("eval.memories=evidence", "eval.budgets=max"), "the evidence alone, latent, B_max each"),
    Rung("latent_uniform", ("eval.budgets=max",), "top-Z, latent, B_max each"),
    Rung("latent_oracle", ("eval.budgets=oracle",), "top-Z, latent, B_max for evidence, 0 for others"),
    Rung("latent_learned", (), "top-Z, latent, the learned budgets (ElasticMem)"),
    # the simple rules the learned budgets have to beat, each at its own cost (top-K for K < Z)
    *(Rung(f"rule_top{k}", (f"eval.budgets=top{k}",), f"top-Z, latent, B_max for the top {k}, 0 for the others")
      for k in (1, 2, 4)),
    Rung("rule_gap", ("eval.budgets=gap",), "top-Z, latent, B_max for each memory within the score gap "
         "(chosen on validation) of the best", derived=True),
    Rung("rule_spread", ("eval.budgets=max",), "top-Z, latent, the learned budgets' mean total shared out evenly",
         derived=True),
    Rung("text_topz", ("eval.system=text_rag",), "top-Z, as text", True),
    # text reading at other depths of the same retrieval (for K != Z), read by ladder.text_checkpoint
    *(Rung(f"text_top{k}", ("eval.system=text_rag", f"memory.top_z={k}"), f"top-{k}, as text", True)
      for k in (1, 2, 4, 8)),
)
LOSSES = (("reading", "text_evidence", "latent_evidence"), ("distraction", "latent_evidence", "latent_uniform"),
          ("retrieval", "latent_evidence", "latent_oracle"), ("allocation", "latent_oracle", "latent_learned"))
"""(what is lost, the rung with it, the rung without it): accuracy(with) - accuracy(without)."""


@dataclass
class LadderOptions:
    """The ladder's own options (not config keys): ``ladder.KEY=VALUE`` or the flag; the other
    arguments (``--config``, ``key=value``) go to evaluate.py."""

    text_checkpoint: str | None = None
    """The checkpoint the text rungs read with (null = eval.checkpoint)."""
    caps: list[int] = field(default_factory=list)
    """Token caps of the cost dial (e.g. 8,16,32,64); none = no dial."""
    rungs: list[str] = field(default_factory=list)
    """Only these rungs (and cost-dial variants); none = all."""
    gaps: list[float] = field(default_factory=lambda: [0.0, 0.02, 0.05, 0.1, 0.2, 0.5])
    """The score gaps rule_gap tries on the validation split (eval.split is the test's); the most
    accurate there is evaluated on the test split. Empty = no rule_gap."""
    val_split: str = "val"
    """The split the score gap is chosen on."""
    text_rungs: bool = True
    """Evaluate the text rungs (false: latent rungs only, e.g. when no reader trained on text is
    at hand: the latent reader's text reading is not what text memory would give)."""
    rules_at_caps: bool = True
    """With caps: also each simple rule (top-1, top-2, the gap) under every cap, so that the cost
    dial compares the learned policy with the best rule at each cap."""


@dataclass
class PoolOptions:
    """``pool``'s options: ``pool.KEY=VALUE`` or the flag (the folders: also the positional arguments)."""

    dirs: list[str]
    """Ladder output folders (eval.output_dir of each seed's ladder)."""
    pairs: list[str] = field(default_factory=lambda: ["latent_uniform:latent_learned", "no_memory:latent_learned",
                                                      "latent_oracle:latent_learned"])
    """REFERENCE:SYSTEM folder names of each ladder to compare."""
    out: str | None = None
    """Write the table here (and .json next to it); null = print it only."""


OPTIONS = Options("ladder", LadderOptions, flags={"caps": Flag(sep=","), "rungs": Flag(sep=","),
                                                   "gaps": Flag(sep=",")})
POOL_OPTIONS = Options("pool", PoolOptions, flags={"dirs": Flag(positional=True, metavar="DIR"),
                                                   "pairs": Flag(sep=",")})


def _applies(rung: Rung, top_z: int | None) -> bool:
    """False for a top-K rung that repeats another at this Z (rule_top{Z} is latent_uniform,
    text_top{Z} is text_topz) or reads more memories than Z."""
    k = rung.name.removeprefix("rule_top").removeprefix("text_top")
    if top_z is None or not k.isdigit():
        return True
    return int(k) != top_z and (rung.text or int(k) < top_z)


def variants(caps: Sequence[int] = (), text_checkpoint: str | None = None,
             top_z: int | None = None) -> dict[str, list[str]]:
    """The ladder's rungs (those not derived from others) as ``eval.variants``, then the learned
    and uniform budgets at each cap. ``top_z``: the preset's Z (None: every top-K rung)."""
    out: dict[str, list[str]] = {}
    for r in RUNGS:
        if r.derived or not _applies(r, top_z):
            continue
        extra = [f"eval.checkpoint={text_checkpoint}"] if r.text and text_checkpoint else []
        out[r.name] = [*r.overrides, *extra]
    for c in caps:
        out[f"learned_cap{c}"] = [f"memory.policy.token_cap={c}"]
        out[f"uniform_cap{c}"] = ["eval.budgets=max", f"memory.policy.token_cap={c}"]
    return out


def budget_split(records: Sequence[Mapping[str, Any]]) -> dict[str, float | int] | None:
    """Mean budget of the retrieved evidence memories and of the other retrieved memories, over the
    records that name their evidence rows (``extra.evidence.rows``); None without budgets."""
    ev_sum = ev_n = other_sum = other_n = 0
    for r in records:
        rows = set((r.get("extra") or {}).get("evidence", {}).get("rows") or [])
        if not rows:
            continue
        for m in r.get("retrieved") or []:
            if m.get("budget") is None or not str(m.get("ref", "")).startswith("row:"):
                continue
            if int(m["ref"].split(":", 1)[1]) in rows:
                ev_sum, ev_n = ev_sum + m["budget"], ev_n + 1
            else:
                other_sum, other_n = other_sum + m["budget"], other_n + 1
    if ev_n + other_n == 0:
        return None
    ev = ev_sum / ev_n if ev_n else float("nan")
    other = other_sum / other_n if other_n else float("nan")
    return {"evidence": ev, "other": other, "evidence_memories": ev_n, "other_memories": other_n,
            "ratio": ev / other if other_n and other > 0 else float("inf") if ev_n and ev > 0 else float("nan")}


def ladder_data(out_root: Path, names: Sequence[str],
                correct_of: Callable[[Path], Mapping[str, bool]] | None = None) -> dict[str, Any]:
    """``ladder.json`` from the rungs' folders: per rung its results and budgets, each rung against
    the one above it, the losses, the cost dial, and its ``provenance``.

    ``correct_of``: ``{id: correct}`` of a ``predictions.jsonl`` (None = the stored ``correct``
    flags, ``report.load_correct``; ``elasticmem.eval.rescore.rescore_file`` re-scores the text);
    with one, each rung's accuracy and interval are recounted from it rather than read from its
    ``results.json``. ``provenance``: the code that pooled (``provenance.git_state``), whether the
    flags were re-scored, and per rung the sha256 of the ``results.json`` and ``predictions.jsonl``
    read and the provenance its ``results.json`` records (commit, config hash, bank manifest,
    retrieval map and checkpoint hashes; null for a folder written before it did)."""
    from elasticmem.eval import stats
    from elasticmem.eval.metrics import load_records, load_results
    from elasticmem.eval.provenance import file_sha256, git_state
    from elasticmem.eval.report import load_correct

    read = correct_of or load_correct
    rows: dict[str, Any] = {}
    correct: dict[str, Mapping[str, bool]] = {}
    inputs: dict[str, Any] = {}
    for name in names:
        res = load_results(out_root / name / "results.json")
        correct[name] = read(out_root / name / "predictions.jsonl")
        rows[name] = {"accuracy": res["accuracy"], "n": res["num_examples"], "ci95": res["accuracy_ci95"],
                      "memory_tokens": res["avg_memory_tokens"], "tokens": res["avg_tokens"],
                      "budgets": budget_split(load_records(out_root / name / "predictions.jsonl"))}
        if correct_of is not None:  # the figures follow the re-scored outcomes, not results.json's
            acc, n, ci = stats.accuracy_with_interval(list(correct[name].values()))
            rows[name].update(accuracy=acc, n=n, ci95=ci)
        inputs[name] = {"results_sha256": file_sha256(out_root / name / "results.json"),
                        "predictions_sha256": file_sha256(out_root / name / "predictions.jsonl"),
                        "run": res.get("provenance")}

    def paired(a: str, b: str) -> dict[str, Any]:
        ca, cb = stats.pair_by_id(correct[a], correct[b])
        return {"reference": a, **stats.paired_comparison(ca, cb).as_dict()}

    rungs = [r.name for r in RUNGS if r.name in rows]
    for above, name in zip(rungs, rungs[1:]):
        rows[name]["vs_above"] = paired(above, name)
    losses = {what: {"with": a, "without": b, **paired(b, a)} for what, a, b in LOSSES if a in rows and b in rows}
    caps = sorted({int(n.rsplit("cap", 1)[1]) for n in rows if n.startswith(("learned_cap", "uniform_cap"))})
    dial = [{"cap": c, "learned": rows[f"learned_cap{c}"], "uniform": rows[f"uniform_cap{c}"],
             "paired": paired(f"uniform_cap{c}", f"learned_cap{c}")}
            for c in caps if f"learned_cap{c}" in rows and f"uniform_cap{c}" in rows]
    provenance = {"code": git_state(), "rescored": correct_of is not None, "rungs": inputs}
    return {"rungs": {n: rows[n] for n in rungs}, "losses": losses, "cost_dial": dial,
            "reads": {r.name: r.reads for r in RUNGS}, "provenance": provenance}


def _acc(row: Mapping[str, Any]) -> str:
    lo, hi = row["ci95"]
    return f"{row['accuracy']:.3f} [{lo:.3f}, {hi:.3f}]"


def _diff(p: Mapping[str, Any]) -> str:
    lo, hi = p["difference_ci"]
    return f"{100 * p['difference']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}], p = {p['p_value']:.3g}"


def _budgets(b: Mapping[str, Any] | None) -> str:
    if not b:
        return ""
    return f"{b['evidence']:.1f} / {b['other']:.1f}"


def ladder_markdown(data: Mapping[str, Any], title: str = "Reading ladder") -> str:
    n = next(iter(data["rungs"].values()))["n"] if data["rungs"] else 0
    lines = [f"# {title}", "",
             f"n = {n} questions each; accuracy [95 % Wilson interval]; differences in points against the rung "
             "above [95 % Tango interval], exact McNemar p; budgets: mean budget of evidence / other memories.", "",
             "| rung | reads | accuracy | memory tokens | vs the rung above | budgets (evidence / other) |",
             "|---|---|---|---|---|---|"]
    for name, row in data["rungs"].items():
        vs = _diff(row["vs_above"]) if "vs_above" in row else ""
        lines.append(f"| {name} | {data['reads'][name]} | {_acc(row)} | {row['memory_tokens']:.1f} | {vs} | "
                     f"{_budgets(row['budgets'])} |")
    if data["losses"]:
        lines += ["", "Where accuracy is lost (the rung with it minus the rung without it, paired):", ""]
        for what, p in data["losses"].items():
            lines.append(f"- {what}: {p['with']} - {p['without']} = {_diff(p)}")
    if data["cost_dial"]:
        lines += ["", "## Cost dial (memory.policy.token_cap)", "",
                  "| cap | learned: accuracy | learned: memory tokens | uniform: accuracy | uniform: memory tokens "
                  "| learned - uniform |", "|---|---|---|---|---|---|"]
        for d in data["cost_dial"]:
            lines.append(f"| {d['cap']} | {_acc(d['learned'])} | {d['learned']['memory_tokens']:.1f} | "
                         f"{_acc(d['uniform'])} | {d['uniform']['memory_tokens']:.1f} | {_diff(d['paired'])} |")
    return "\n".join(lines) + "\n"


def pool(dirs: Sequence[str | Path], pairs: Sequence[tuple[str, str]] = (("latent_uniform", "latent_learned"),
                                                                          ("no_memory", "latent_learned"),
                                                                          ("latent_oracle", "latent_learned")),
         correct_of: Callable[[Path], Mapping[str, bool]] | None = None) -> dict[str, Any]:
    """Several seeds' ladders side by side.

    ``comparisons``: each rung pair (reference, system) per seed (Tango's interval, exact
    McNemar), ``pooled`` per question over the seeds (``stats.pooled_paired_per_question``: each
    question's mean difference over the seeds, n = questions, a paired bootstrap interval over
    questions and a sign-flip permutation p), and ``by_seed`` the mean of the seeds' own
    differences with its t interval (``stats.seed_paired``). ``rungs``: each rung's (and each
    extra folder's, e.g. a trained control's) accuracy per seed (Wilson interval) and pooled per
    question (``stats.pooled_per_question``). The seeds share their questions, so pooling their
    (seed, question) pairs as independent would overstate n; each pooled figure's ``pooling``
    says how it was pooled. A pair or rung some seeds lack is compared over the seeds that have
    it (its ``dirs`` say which), so a control still running on one seed does not hold up the
    others; seeds that answered other questions are refused (``stats.PairingError``).
    ``correct_of``: ``{id: correct}`` of a ``predictions.jsonl`` (None = the stored flags;
    ``elasticmem.eval.rescore.rescore_file`` re-scores the text).
    """
    from elasticmem.eval import stats
    from elasticmem.eval.report import load_correct

    read = correct_of or load_correct

    def has(d: str | Path, name: str) -> bool:
        return (Path(d) / name / "predictions.jsonl").is_file()

    comparisons: dict[str, Any] = {}
    for a, b in pairs:
        seeds = [d for d in dirs if has(d, a) and has(d, b)]
        if not seeds:
            continue
        per_seed, acc_a, acc_b, out_a, out_b = [], [], [], [], []
        for d in seeds:
            oa, ob = read(Path(d) / a / "predictions.jsonl"), read(Path(d) / b / "predictions.jsonl")
            ca, cb = stats.pair_by_id(oa, ob)
            per_seed.append({"dir": str(d), **stats.paired_comparison(ca, cb).as_dict()})
            out_a.append(oa)
            out_b.append(ob)
            acc_a.append(sum(ca) / len(ca))
            acc_b.append(sum(cb) / len(cb))
        _, ma = stats.outcome_matrix(out_a)  # (seeds, questions), questions in sorted id order
        _, mb = stats.outcome_matrix(out_b)  # the same ids: pair_by_id checked each seed's a against b
        comparisons[f"{b} - {a}"] = {"dirs": [str(d) for d in seeds], "per_seed": per_seed,
                                     "pooled": stats.pooled_paired_per_question(ma, mb),
                                     "by_seed": stats.seed_paired(acc_a, acc_b)}
    names = [r.name for r in RUNGS]
    names += sorted({p.name for d in dirs for p in Path(d).iterdir() if p.is_dir() and has(d, p.name)} - set(names))
    rungs: dict[str, Any] = {}
    for name in names:
        seeds = [d for d in dirs if has(d, name)]
        if not seeds:
            continue
        per_seed, outcomes, tokens = [], [], []
        for d in seeds:
            got = read(Path(d) / name / "predictions.jsonl")
            acc, n, ci = stats.accuracy_with_interval(list(got.values()))
            res = json.loads((Path(d) / name / "results.json").read_text())
            per_seed.append({"dir": str(d), "accuracy": acc, "n": n, "ci95": ci,
                             "memory_tokens": res.get("avg_memory_tokens")})
            outcomes.append(got)
            tokens.append(res.get("avg_memory_tokens") or 0.0)
        _, m = stats.outcome_matrix(outcomes)
        # every seed answered the same questions: the mean over seeds is the per-question mean
        rungs[name] = {"dirs": [str(d) for d in seeds], "per_seed": per_seed,
                       "pooled": {**stats.pooled_per_question(m), "memory_tokens": sum(tokens) / len(tokens)}}
    return {"comparisons": comparisons, "rungs": rungs}


def pool_markdown(data: Mapping[str, Any], dirs: Sequence[str | Path]) -> str:
    """The seeds' comparison table and rung table; every pooled cell says its questions and seeds."""
    from elasticmem.eval.stats import BOOTSTRAP_SEED, RESAMPLES

    def seeds_of(d: Mapping[str, Any]) -> str:
        if len(d["dirs"]) == len(dirs):
            return ""
        return " (" + ", ".join(Path(x).parent.name or x for x in d["dirs"]) + ")"

    def size(pooled: Mapping[str, Any]) -> str:
        return f"n = {pooled['n']} questions x {pooled['seeds']} seed{'s' if pooled['seeds'] != 1 else ''}"

    lines = ["# Reading ladder over seeds", "", "Ladders: " + ", ".join(str(d) for d in dirs), "",
             "Pooled per question: the seeds share their questions, so each question counts once, with its "
             "mean correctness over the seeds (its mean difference, paired); n = the questions; 95 % interval: "
             f"percentile bootstrap over questions ({RESAMPLES} resamples, seed {BOOTSTRAP_SEED}), paired for "
             "differences; p: sign-flip permutation test over questions. Per seed: Wilson / Tango intervals, "
             "exact McNemar p. Mean over seeds: t interval over the seeds' own differences. A row some seeds "
             "lack names the seeds it has.", "",
             "| comparison | per seed (points [95 %], p) | pooled per question (points [95 %], p, n) "
             "| mean over seeds [t interval] |", "|---|---|---|---|"]
    for name, d in data["comparisons"].items():
        per = "; ".join(_diff(s) for s in d["per_seed"])
        pooled = d["pooled"]
        bs = d["by_seed"]
        ci = bs["difference_ci"]
        by = f"{100 * bs['difference']:+.1f}" + (f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else "")
        by += f", p = {bs['p_value']:.3g}" if bs["p_value"] is not None else ""
        lines.append(f"| {name}{seeds_of(d)} | {per} | {_diff(pooled)}, {size(pooled)} | {by} |")
    lines += ["", "| rung | per seed (accuracy [95 %]) | pooled per question (accuracy [95 %], n) | memory tokens |",
              "|---|---|---|---|"]
    for name, d in data["rungs"].items():
        per = "; ".join(_acc(s) for s in d["per_seed"])
        pooled = d["pooled"]
        lines.append(f"| {name}{seeds_of(d)} | {per} | {_acc(pooled)}, {size(pooled)} | "
                     f"{pooled['memory_tokens']:.1f} |")
    return "\n".join(lines) + "\n"


def _pool_main(argv: list[str]) -> int:
    """``pool DIR ... [--pairs A:B,...] [--out FILE]``: the seeds' ladders compared."""
    import argparse

    from elasticmem.utils.options import parse_options

    ap = argparse.ArgumentParser(prog="python -m elasticmem.apps.ladder pool",
                                 description="Compare ladder rungs over several seeds' ladders.")
    opts, _ = parse_options(ap, POOL_OPTIONS, argv, metavar="DIR | pool.KEY=VALUE",
                            help="the ladders' folders, and pool.KEY=VALUE options")
    pairs = [tuple(p.split(":", 1)) for p in opts.pairs]
    if any(len(p) != 2 for p in pairs):
        ap.error(f"--pairs (pool.pairs) takes REFERENCE:SYSTEM items, got {opts.pairs!r}")
    data = pool(opts.dirs, pairs)
    md = pool_markdown(data, opts.dirs)
    for d in opts.dirs:  # each seed's own ladder after the comparison over seeds
        if (Path(d) / "ladder.md").is_file():
            md += "\n" + (Path(d) / "ladder.md").read_text().replace("# Reading ladder", "## Reading ladder", 1)
    print(md)
    if opts.out:
        Path(opts.out).write_text(md)
        Path(opts.out).with_suffix(".json").write_text(json.dumps(data, indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "pool":
        return _pool_main(argv[1:])
    import argparse

    from elasticmem.apps import evaluate
    from elasticmem.config import load_config
    from elasticmem.eval import budget_rules
    from elasticmem.utils.options import add_options, resolve_options, split_options

    ap = argparse.ArgumentParser(prog="python -m elasticmem.apps.ladder", description=__doc__.split("\n\n")[0],
                                 epilog="Other arguments (--config, --limit, key=value overrides) go to evaluate.py.")
    add_options(ap, OPTIONS)
    known, rest = ap.parse_known_args(argv)
    dotted, rest = split_options(rest, OPTIONS)  # the rest is evaluate.py's
    opts = resolve_options(ap, OPTIONS, known, dotted)
    config = rest[rest.index("--config") + 1] if "--config" in rest else None
    cfg = load_config(config, evaluate._expand([o for o in rest if "=" in o and not o.startswith("-")]))
    out_root = Path(cfg.eval.output_dir)
    top_z = cfg.memory.top_z

    def wanted(var: dict[str, list[str]]) -> dict[str, list[str]]:
        return {k: v for k, v in var.items() if not opts.rungs or k in opts.rungs}

    var = variants(opts.caps, opts.text_checkpoint, top_z)
    if not opts.text_rungs:
        text = {r.name for r in RUNGS if r.text}
        var = {k: v for k, v in var.items() if k not in text}
    if opts.rungs:
        known_names = set(var) | set(budget_rules.derived_variants(0.0, 1.0, opts.caps, top_z, opts.rules_at_caps))
        unknown = set(opts.rungs) - known_names
        if unknown:
            ap.error(f"unknown rungs {sorted(unknown)}; the ladder's are {sorted(known_names)}")
    code = evaluate.main([*rest, "eval.variants=" + json.dumps(wanted(var))])
    if code != 0:
        return code
    # the rungs whose settings come from the others: the gap chosen on validation, the spread at
    # the learned policy's mean total, every rule under each cap
    gap = spread = None
    if opts.gaps and (not opts.rungs or "rule_gap" in opts.rungs):
        val_root = out_root / f"gap_{opts.val_split}"
        code = evaluate.main([*rest, f"eval.split={opts.val_split}", f"eval.output_dir={val_root}",
                              "eval.variants=" + json.dumps(budget_rules.gap_variants(opts.gaps))])
        if code != 0:
            return code
        val = {g: json.loads((val_root / f"gap_{g:g}" / "results.json").read_text()) for g in opts.gaps}
        gap = budget_rules.choose_gap({g: {"accuracy": r["accuracy"], "memory_tokens": r["avg_memory_tokens"]}
                                       for g, r in val.items()})
    learned = out_root / "latent_learned" / "results.json"
    if learned.is_file() and (not opts.rungs or "rule_spread" in opts.rungs):
        spread = json.loads(learned.read_text())["avg_memory_tokens"]
    derived = wanted(budget_rules.derived_variants(gap, spread, opts.caps, top_z, opts.rules_at_caps))
    if derived:
        code = evaluate.main([*rest, "eval.variants=" + json.dumps(derived)])
        if code != 0:
            return code
    names = [*var, *derived]
    data = ladder_data(out_root, [n for n in names if (out_root / n / "results.json").is_file()])
    data["rules"] = budget_rules.best_rule(out_root, opts.caps)
    data["score_gap"] = gap
    if learned.is_file():
        from elasticmem.eval.metrics import load_records

        data["budget_vectors"] = budget_rules.budget_vectors(load_records(learned.with_name("predictions.jsonl")))
    md = ladder_markdown(data, title=f"Reading ladder: {cfg.eval.checkpoint} on {Path(cfg.data.dir).name} / "
                                     f"{cfg.eval.split}")
    md += budget_rules.rules_markdown(data["rules"], data.get("budget_vectors"), gap)
    (out_root / "ladder.md").write_text(md)
    (out_root / "ladder.json").write_text(json.dumps(data, indent=1))
    print(md)
    print(f"ladder -> {out_root / 'ladder.md'} and {out_root / 'ladder.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
