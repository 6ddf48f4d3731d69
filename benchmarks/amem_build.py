"""A-Mem memory construction with the local model: shared-prefix prefill on vs off.

    python -m elasticmem.backbone fetch smollm2          # once
    OMP_NUM_THREADS=1 python benchmarks/amem_build.py --out runs/bench/amem_build.json   # ~5 min, 1 core
    python benchmarks/amem_build.py --conversations 2 --turns 4                         # a quick look

Builds the memories of the first ``--conversations`` conversations of the synthetic persona task
(``configs/quickstart.yaml``'s data settings, ``--turns`` turns each) in lockstep, as
``AMemSystem.build`` does (note construction batched over a window, link/evolution decisions
batched across conversations), once with ``TransformersBackend(share_prefix=False)`` (every prompt
prefilled whole) and once with the default (the batch's common instructions prefilled once),
alternating ``--repeats`` times in this process. Prints seconds per note of each, the ratio, and
whether both built the same notes (keywords, context, tags, links): the two prefills must give the
same greedy tokens. ``--out`` writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def build_once(examples, backbone, share_prefix: bool, batch_size: int) -> tuple[float, int, list]:
    from elasticmem.baselines.amem.config import AMemConfig
    from elasticmem.baselines.amem.embed import load_embedder
    from elasticmem.baselines.amem.llm import StructuredLLM, TransformersBackend
    from elasticmem.baselines.amem.system import AMemSystem

    cfg = AMemConfig()
    llm = StructuredLLM(TransformersBackend(backbone.model, backbone.tokenizer, batch_size, share_prefix=share_prefix),
                        cfg.llm.json_retries, cfg.llm.retry_temperature)
    system = AMemSystem(cfg, llm=llm, embedder=load_embedder(cfg.embedder))
    t0 = time.perf_counter()
    system.build(examples)
    seconds = time.perf_counter() - t0
    notes = [[(n.keywords, n.context, n.tags, n.links) for n in system.memories[g].notes.values()]
             for g in sorted(system.memories)]
    return seconds, sum(len(m) for m in system.memories.values()), notes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8, help="history turns per conversation (notes)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import dataclasses

    import torch

    from elasticmem.backbone import load_backbone
    from elasticmem.config import Config
    from elasticmem.data.synthetic import generate
    from elasticmem.utils.configuration import load

    cfg = load(Config, args.config, [])
    data = generate(cfg.data.synthetic, seed=cfg.seed)
    firsts, seen = [], set()
    for ex in data["test"]:
        if ex.group not in seen:
            seen.add(ex.group)
            turns = [t for s in ex.history for t in s][: args.turns]
            firsts.append(dataclasses.replace(ex, history=[turns]))
        if len(firsts) == args.conversations:
            break
    backbone = load_backbone(cfg.model)
    print(f"{len(firsts)} conversations x {args.turns} turns, {cfg.model.name_or_path}, "
          f"{torch.get_num_threads()} thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    times: dict[str, list[float]] = {"plain": [], "shared_prefix": []}
    built: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, share in (("plain", False), ("shared_prefix", True)):
            seconds, n, notes = build_once(firsts, backbone, share, args.batch_size)
            times[name].append(seconds / n)
            built.setdefault(name, notes)
            print(f"  {name:14s} {seconds / n:6.2f} s/note ({n} notes)")
    same = built["plain"] == built["shared_prefix"]
    ratio = statistics.median(times["plain"]) / statistics.median(times["shared_prefix"])
    print(f"median s/note: plain {statistics.median(times['plain']):.2f}, shared prefix "
          f"{statistics.median(times['shared_prefix']):.2f}; plain / shared = {ratio:.2f}x; same notes: {same}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"seconds_per_note": times, "ratio": ratio, "same_notes": same,
                                              "conversations": len(firsts), "turns": args.turns}, indent=2))


if __name__ == "__main__":
    main()
