"""How well a checkpoint reads its memories when retrieval is perfect.

Each question's evidence chunk (the last one where the data records several: the newest
fact) is injected as the only memory, at ``memory.policy.max_budget`` soft tokens (or as text
under ``memory.injection=text``), after the reasoner's own greedy control token; the answer is
greedy. Reading is then measured apart from retrieval and budgets. Prints accuracy with n and
its 95 % interval, the fraction of answers that contain the gold option's text, and, with
``--against``, the paired difference and exact McNemar test between two runs on the same
questions. Used for the token-alignment figures of README "Training recipe".

    python benchmarks/evidence_reading.py --run runs/warmup/persona_recipe [--against OTHER_RUN]
        [--split val] [--limit 0] [--threads 1] [--out results.json]

A run is a folder with ``config.yaml`` and ``final/`` (what the reading warm-up and train.py
write). Questions without recorded evidence are skipped (and counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch


@torch.no_grad()
def evidence_answers(run: str | Path, split: str, limit: int, batch_size: int = 16) -> dict[str, dict]:
    """Per example id: {"correct", "names_value", "answer"} with the evidence alone injected."""
    from tqdm.auto import tqdm

    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.eval.retrieval import evidence_rows
    from elasticmem.grpo.rewards import mc_letter_reward
    from elasticmem.model.elasticmem import ElasticMem

    run = Path(run)
    cfg = load_config(str(run / "config.yaml"))
    backbone = load_backbone(cfg.model)
    bank = Bank.open(cfg.bank.dir, expect_fingerprint=backbone.fingerprint)
    model = ElasticMem(backbone, dataclasses.replace(cfg.memory, top_z=1), bank)
    model.load_weights(run / "final")
    model.eval()
    examples = load_split(cfg.data.dir, split)
    examples = examples[:limit] if limit else examples
    rows_of = {ex.id: sorted(evidence_rows(ex, bank)) for ex in examples}
    examples = [ex for ex in examples if rows_of[ex.id]]
    out: dict[str, dict] = {}
    for s in tqdm(range(0, len(examples), batch_size), desc=f"evidence reading ({run.name})", file=sys.stderr):
        batch = examples[s : s + batch_size]
        traj = model.greedy(batch, include_rows=[{rows_of[ex.id][-1]} for ex in batch], budgets="max")
        for ex, answer in zip(batch, traj.answers):
            out[ex.id] = {"correct": mc_letter_reward(answer, ex) == 1.0,
                          "names_value": ex.choices[ex.answer_index].lower() in answer.lower(), "answer": answer}
    return out


def main(argv: list[str] | None = None) -> int:
    from elasticmem.eval.stats import accuracy_with_interval, pair_by_id, paired_comparison

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="run folder with config.yaml and final/")
    ap.add_argument("--against", help="a second run, compared on the same questions")
    ap.add_argument("--split", default="val")
    ap.add_argument("--limit", type=int, default=0, help="first N examples of the split (0 = all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write every answer and the figures as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {r: evidence_answers(r, args.split, args.limit) for r in [args.run, args.against] if r}
    report: dict[str, dict] = {}
    for r, res in results.items():
        acc, n, ci = accuracy_with_interval([v["correct"] for v in res.values()])
        value = sum(v["names_value"] for v in res.values()) / max(1, n)
        report[r] = {"accuracy": acc, "n": n, "ci95": ci, "names_value": value}
        print(f"{r}: accuracy {acc:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] n={n}; answers naming the gold option {value:.3f}")
    if args.against:
        a, b = pair_by_id(*[{k: v["correct"] for k, v in results[r].items()} for r in (args.run, args.against)])
        pc = paired_comparison(a, b)
        report["paired"] = dataclasses.asdict(pc)
        lo, hi = pc.difference_ci
        print(f"{args.against} - {args.run}: {pc.difference:+.3f} [{lo:+.3f}, {hi:+.3f}], "
              f"only {args.run} right {pc.only_a_correct}, only {args.against} right {pc.only_b_correct}, "
              f"exact McNemar p = {pc.p_value:.3g} (n = {pc.n})")
    if args.out:
        Path(args.out).write_text(json.dumps({"report": report, "answers": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
