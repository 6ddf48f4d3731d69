"""Run A-Mem on LoCoMo and write the paper's per-category tables (free-form metrics and MC-10 accuracy).

    python -m elasticmem.baselines.amem.run_locomo --config configs/amem/locomo_smollm2.yaml
    python -m elasticmem.baselines.amem.run_locomo split=test amem.llm.backend=openai \\
        amem.llm.model=Qwen/Qwen2.5-7B-Instruct amem.llm.api_base=http://localhost:8000/v1
    python -m elasticmem.baselines.amem.run_locomo --help      # every key

One A-Mem is built per conversation from its turns (timestamped with the session dates) and
shared by the free-form questions (scored with token F1, BLEU-1, ROUGE-L, ROUGE-2, METEOR and
SBERT similarity per category, as in the A-Mem paper's Table 1) and by their MC-10 version
(accuracy per category, as ElasticMem reports). Adversarial questions are scored against the
correct behaviour, "Not mentioned in the conversation" (``elasticmem.data.locomo``), never
against the trap answer; MC-10 leaves them out (they have no gold option).

With ``amem.max_sessions`` / ``amem.max_turns`` only the first part of each conversation is
remembered; questions whose evidence lies outside it (or that list no evidence) are skipped
and counted. Memories persist in ``OUT_DIR/store`` (or ``amem.store_dir``): a rerun loads them,
an interrupted build resumes.

Writes ``OUT_DIR/``: ``config.yaml``, ``predictions_qa.jsonl``, ``predictions_mc10.jsonl``
(``elasticmem.eval.metrics`` records, plus A-Mem details), ``results.json`` and ``table.md``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from elasticmem.baselines.amem.config import AMemConfig
from elasticmem.data.schema import Example

logger = logging.getLogger("elasticmem.baselines.amem.run_locomo")

CATEGORY_ORDER = ("multi_hop", "temporal", "open_domain", "single_hop", "adversarial")
"""The A-Mem paper's column order (Table 1)."""
CATEGORY_TITLES = {"multi_hop": "Multi Hop", "temporal": "Temporal", "open_domain": "Open Domain",
                   "single_hop": "Single Hop", "adversarial": "Adversarial"}
METRIC_TITLES = {"f1": "F1", "bleu1": "BLEU-1", "rougeL": "ROUGE-L", "rouge2": "ROUGE-2", "meteor": "METEOR",
                 "sbert": "SBERT"}


@dataclass
class LoCoMoRunConfig:
    """A-Mem on (a subset of) LoCoMo."""

    input: str = "../shared/data/locomo10.json"
    """The original locomo10.json (relative paths are taken from the current directory)."""
    out_dir: str = "runs/amem_locomo"
    """Where results, predictions and (by default) the memories go."""
    split: Literal["all", "train", "val", "test"] = "test"
    """Conversations of this split (6/2/2 by sorted id, as elasticmem.data.locomo), unless
    `conversations` names them."""
    conversations: list[str] = field(default_factory=list)
    """Sample ids (e.g. [conv-26]); empty = every conversation of `split`."""
    formats: list[str] = field(default_factory=lambda: ["qa", "mc10"])
    """qa = free-form answers with A-Mem's metrics; mc10 = the 10-option version (accuracy)."""
    max_questions: int = 0
    """Per conversation and format, at most this many questions, taken round-robin over the
    categories in file order (0 = all answerable ones)."""
    seed: int = 42
    """Seed of the MC-10 distractors (as `prepare locomo-mc10`)."""
    with_meteor: bool = True
    """Score METEOR (needs WordNet, see elasticmem.eval.nltk_data)."""
    with_sbert: bool = True
    """Score SBERT similarity (all-MiniLM-L6-v2)."""
    batch_questions: int = 64
    """Questions handed to the system per predict call."""
    amem: AMemConfig = field(default_factory=AMemConfig)
    """The A-Mem settings."""


# --------------------------------------------------------------------------- data


def load_examples(cfg: LoCoMoRunConfig) -> tuple[dict[str, list[Example]], dict[str, Any]]:
    """{format: examples} of the chosen conversations, restricted to what the memory will hold."""
    from elasticmem.data.locomo import SPLIT_FRACTIONS, mc10_examples, qa_example, read_locomo
    from elasticmem.data.sources import SkipLog, split_sorted

    skips = SkipLog()
    convs = read_locomo(cfg.input, skips)
    ids = [c.sample_id for c in convs]
    if cfg.conversations:
        unknown = sorted(set(cfg.conversations) - set(ids))
        if unknown:
            raise SystemExit(f"unknown conversations {unknown}; the file has {ids}")
        chosen = set(cfg.conversations)
    elif cfg.split == "all":
        chosen = set(ids)
    else:
        chosen = set(split_sorted(ids, SPLIT_FRACTIONS)[cfg.split])
    counts: dict[str, Any] = {}
    # Distractors come from every conversation's answers (as `prepare locomo-mc10`), then we keep ours.
    by_format = {
        "qa": [qa_example(c, q) for c in convs if c.sample_id in chosen for q in c.qa],
        "mc10": [ex for ex in mc10_examples(convs, cfg.seed, counts) if ex.group in chosen],
    }
    info: dict[str, Any] = {"conversations": sorted(chosen), "skipped_outside_memory": {}, "mc10": counts}
    out = {}
    for fmt in cfg.formats:
        if fmt not in by_format:
            raise SystemExit(f"unknown format {fmt!r}; use qa and/or mc10")
        kept, skipped = [], 0
        for ex in by_format[fmt]:
            if answerable(ex, cfg.amem):
                kept.append(ex)
            else:
                skipped += 1
        info["skipped_outside_memory"][fmt] = skipped
        out[fmt] = subsample(kept, cfg.max_questions)
    return out, info


def answerable(ex: Example, amem: AMemConfig) -> bool:
    """Whether the evidence of ``ex`` lies inside the part of the history the memory holds."""
    if amem.max_sessions <= 0 and amem.max_turns <= 0:
        return True
    evidence = ex.extra.get("evidence") or []
    if not evidence:
        return False
    flat = [len(s) for s in ex.history]
    for session, turn in evidence:
        if amem.max_sessions > 0 and session >= amem.max_sessions:
            return False
        if amem.max_turns > 0 and sum(flat[:session]) + turn >= amem.max_turns:
            return False
    return True


def subsample(examples: Sequence[Example], per_group: int) -> list[Example]:
    """At most ``per_group`` examples per conversation, round-robin over categories (file order)."""
    if per_group <= 0:
        return list(examples)
    out = []
    groups: dict[str, dict[str, list[Example]]] = defaultdict(lambda: defaultdict(list))
    for ex in examples:
        groups[ex.group][ex.question_type].append(ex)
    for by_cat in groups.values():
        queues = [list(v) for v in by_cat.values()]
        taken = 0
        while taken < per_group and any(queues):
            for q in queues:
                if q and taken < per_group:
                    out.append(q.pop(0))
                    taken += 1
    order = {ex.id: i for i, ex in enumerate(examples)}
    return sorted(out, key=lambda ex: order[ex.id])


# --------------------------------------------------------------------------- scoring and tables


def records_for(examples: Sequence[Example], preds: Sequence[Any]) -> list[dict[str, Any]]:
    from elasticmem.eval.metrics import make_record
    from elasticmem.eval.runner import gold_and_correct

    out = []
    for ex, p in zip(examples, preds):
        gold, correct = gold_and_correct(p, ex)  # the format follows the example (free-form or MC)
        rec = dict(make_record(p, question_type=ex.question_type, gold=gold, correct=correct))
        rec["amem"] = p.extra.get("amem", {})
        out.append(rec)
    return out


def _fmt(x: float | None, scale: float = 100.0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:.2f}"


def qa_table(free_form: dict[str, Any]) -> str:
    """Rows = metrics, columns = the paper's categories (scores in %), with counts."""
    per = free_form["per_type"]
    cats = [c for c in CATEGORY_ORDER if c in per] + [c for c in per if c not in CATEGORY_ORDER]
    head = "| metric | " + " | ".join(CATEGORY_TITLES.get(c, c) for c in cats) + " | overall |"
    lines = [head, "|" + "---|" * (len(cats) + 2)]
    for m, title in METRIC_TITLES.items():
        if m not in free_form["overall"]:
            continue
        lines.append(f"| {title} | " + " | ".join(_fmt(per[c].get(m)) for c in cats)
                     + f" | {_fmt(free_form['overall'][m])} |")
    counts = free_form["counts"]
    lines.append("| n | " + " | ".join(str(counts[c]) for c in cats) + f" | {sum(counts.values())} |")
    return "\n".join(lines)


def mc_table(results: dict[str, Any]) -> str:
    per = results["per_type"]
    cats = [c for c in CATEGORY_ORDER if c in per] + [c for c in per if c not in CATEGORY_ORDER]
    lines = ["| | " + " | ".join(CATEGORY_TITLES.get(c, c) for c in cats) + " | overall |",
             "|" + "---|" * (len(cats) + 2),
             "| accuracy | " + " | ".join(_fmt(per[c]) for c in cats) + f" | {_fmt(results['accuracy'])} |",
             "| n | " + " | ".join(str(results["per_type_counts"][c]) for c in cats)
             + f" | {results['num_examples']} |"]
    return "\n".join(lines)


def cost_lines(stats: dict[str, Any], results: dict[str, dict[str, Any]]) -> list[str]:
    b, llm = stats["build"], stats["llm"]
    lines = [
        (f"- notes added: {int(b.get('notes_added', 0))}; LLM tokens per added note: {b['tokens_per_note']:.0f}; "
         f"seconds per added note: {b['seconds_per_note']:.2f}; links: {int(b.get('links_added', 0))}; "
         f"neighbours evolved: {int(b.get('neighbours_evolved', 0))}"),
        (f"- valid-JSON rate (JSON generations that parsed and validated, retries included): "
         f"{llm['valid_json_rate']:.3f}; valid at the first attempt: {llm['json_valid_first_rate']:.3f}; "
         f"fallbacks: {llm['json_fallbacks']}"),
    ]
    for fmt, r in results.items():
        lines.append(f"- {fmt}: tokens per question (prompt + memory + generated): {r['avg_tokens']:.0f} "
                     f"(memory {r['avg_memory_tokens']:.0f}); seconds per question: {r['latency_s_per_example']:.2f}")
    return lines


# --------------------------------------------------------------------------- main


def run(cfg: LoCoMoRunConfig, system=None) -> dict[str, Any]:
    """Build, answer, score, write; returns the results dict. ``system`` overrides the A-Mem system
    built from ``cfg.amem`` (tests pass one with a scripted LLM)."""
    from elasticmem.baselines.amem.system import AMemSystem
    from elasticmem.eval.metrics import build_results
    from elasticmem.utils import configuration

    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.amem.store_dir is None:
        cfg.amem.store_dir = str(out_dir / "store")
    configuration.save(cfg, out_dir / "config.yaml")
    by_format, info = load_examples(cfg)
    for fmt, exs in by_format.items():
        logger.info("%s: %d questions from %s (%d skipped: evidence outside the remembered part)", fmt, len(exs),
                    info["conversations"], info["skipped_outside_memory"][fmt])
    if system is None:
        system = AMemSystem(cfg.amem)
    t0 = time.perf_counter()
    all_examples = [ex for exs in by_format.values() for ex in exs]
    system.build(all_examples, progress=True)
    build_s = time.perf_counter() - t0
    results: dict[str, dict[str, Any]] = {}
    for fmt, exs in by_format.items():
        if not exs:
            continue
        preds = []
        for i in range(0, len(exs), cfg.batch_questions):
            preds += system.predict(exs[i : i + cfg.batch_questions])
            logger.info("%s: answered %d/%d", fmt, len(preds), len(exs))
        recs = records_for(exs, preds)
        with open(out_dir / f"predictions_{fmt}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
        results[fmt] = build_results(recs, free_form=(fmt == "qa"), system=system.name,
                                     with_meteor=cfg.with_meteor, with_sbert=cfg.with_sbert)
    stats = system.stats()
    summary = {"system": system.name, "data": info, "build_seconds": build_s, "amem": stats, **results}
    from elasticmem.eval.provenance import evaluation_provenance, file_entry, file_sha256

    # A-Mem reads no bank, map or checkpoint: the code, the config and the LoCoMo file it read
    summary["provenance"] = {**evaluation_provenance(cfg), "input": file_entry(cfg.input),
                             "predictions_sha256": {fmt: file_sha256(out_dir / f"predictions_{fmt}.jsonl")
                                                    for fmt in results}}
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2, default=float))
    setting = (f"LLM: {cfg.amem.llm.backend}:{cfg.amem.llm.model}; ablation: {cfg.amem.ablation}; sessions: "
               f"{cfg.amem.max_sessions or 'all'}; turns: {cfg.amem.max_turns or 'all'}")
    table = [f"# {system.name} on LoCoMo ({', '.join(info['conversations'])})", "", setting, ""]
    if "qa" in results:
        table += ["## Free-form QA (%, A-Mem Table 1 layout)", "", qa_table(results["qa"]["free_form"]), ""]
    if "mc10" in results:
        table += ["## MC-10 accuracy (%)", "", mc_table(results["mc10"]), ""]
    table += ["## Cost", ""] + cost_lines(stats, results)
    (out_dir / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return summary


def main(argv: list[str] | None = None) -> None:
    from elasticmem.utils.configuration import print_config
    from elasticmem.utils.options import parse_cli

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    cfg, _ = parse_cli(LoCoMoRunConfig, argv, prog="python -m elasticmem.baselines.amem.run_locomo",
                       description=__doc__.split("\n\n")[0])
    print_config(cfg, file=sys.stderr)
    run(cfg)


if __name__ == "__main__":
    main()
