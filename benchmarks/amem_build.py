"""A-Mem memory construction with the local model: one decoding optimisation on vs off.

    python -m elasticmem.backbone fetch smollm2          # once
    OMP_NUM_THREADS=1 python benchmarks/amem_build.py --out runs/bench/amem_build.json   # ~5 min, 1 core
    OMP_NUM_THREADS=1 python benchmarks/amem_build.py --compare drop_closed              # finished rows
    python benchmarks/amem_build.py --conversations 2 --turns 4                         # a quick look

Builds the memories of the first ``--conversations`` conversations of the synthetic persona task
(``configs/quickstart.yaml``'s data settings, ``--turns`` turns each) in lockstep, as
``AMemSystem.build`` does (note construction batched over a window, link/evolution decisions
batched across conversations), once with the ``TransformersBackend`` option named by ``--compare``
off and once with the default (on), alternating ``--repeats`` times in this process:
``share_prefix`` (off: every prompt prefilled whole; on: the batch's common instructions prefilled
once) or ``drop_closed`` (off: finished rows stay in the batch, fed padding, until its longest row
ends; on: they leave it). Prints seconds per note of each, the ratio, and whether both built the
same notes (keywords, context, tags, links): both settings must give the same greedy tokens.
``--out`` writes it as JSON.

Results: benchmarks/README.md, section ``amem_build.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import write_json  # noqa: E402


def build_once(examples, backbone, options: dict[str, bool], batch_size: int) -> tuple[float, int, list]:
    from elasticmem.baselines.amem.config import AMemConfig
    from elasticmem.baselines.amem.embed import load_embedder
    from elasticmem.llm.client import StructuredLLM, TransformersBackend
    from elasticmem.baselines.amem.system import AMemSystem

    cfg = AMemConfig()
    llm = StructuredLLM(TransformersBackend(backbone.model, backbone.tokenizer, batch_size, **options),
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
    ap.add_argument("--compare", choices=["share_prefix", "drop_closed"], default="share_prefix",
                    help="the TransformersBackend option to time off vs on")
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
    backbone = load_backbone(cfg.backbone)
    print(f"{len(firsts)} conversations x {args.turns} turns, {cfg.backbone.name_or_path}, "
          f"{torch.get_num_threads()} thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    off, on = f"{args.compare}=off", f"{args.compare}=on"
    times: dict[str, list[float]] = {off: [], on: []}
    built: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, flag in ((off, False), (on, True)):
            seconds, n, notes = build_once(firsts, backbone, {args.compare: flag}, args.batch_size)
            times[name].append(seconds / n)
            built.setdefault(name, notes)
            print(f"  {name:18s} {seconds / n:6.2f} s/note ({n} notes)")
    same = built[off] == built[on]
    ratio = statistics.median(times[off]) / statistics.median(times[on])
    print(f"median s/note: {off} {statistics.median(times[off]):.2f}, {on} {statistics.median(times[on]):.2f}; "
          f"off / on = {ratio:.2f}x; same notes: {same}")
    if args.out:
        write_json(args.out, {"compare": args.compare, "seconds_per_note": times, "ratio": ratio, "same_notes": same,
                              "conversations": len(firsts), "turns": args.turns}, __file__, argv)


if __name__ == "__main__":
    main()
