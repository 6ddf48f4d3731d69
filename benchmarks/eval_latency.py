"""Evaluation cost: ElasticMem (latent memories) vs text RAG (the same chunks as text) at the same Z.

    python benchmarks/eval_latency.py                               # quickstart preset (SmolLM2), 16 examples
    python benchmarks/eval_latency.py --config configs/tiny.yaml --examples 64
    python benchmarks/eval_latency.py checkpoint=runs/train/quickstart/final memory.top_z=8

Both systems are built from one config on one backbone and bank and answer the same
examples greedily in the same process, in interleaved repeats (these machines are
noisy), through the harness's ``MemorySystem.predict``. Text RAG differs only in
``memory.injection=text``: the same retrieval (same query state, same top-Z rows),
the chunks' tokens instead of b_j projected states, no budget policy. Prints, per
system, the median seconds per example split into retrieval / policy / generation
and the mean ``#Tok`` and memory tokens, then the ratios ElasticMem / text RAG
(latency and #Tok) and the share of retrieval in ElasticMem's latency.

Needs a prepared dataset and its bank (``bash scripts/quickstart.sh`` makes both for
the default preset). Without ``checkpoint=`` the model is the untrained base
(LoRA B = 0, random policy and projector): budgets are then random but the costs
of every part are the real ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--examples", type=int, default=16, help="examples of eval.split to answer")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", help="also write the figures as JSON here")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_intermixed_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from accelerate.utils import set_seed

    from elasticmem.config import Config
    from elasticmem.data.schema import load_split
    from elasticmem.systems import build_system
    from elasticmem.utils.configuration import load

    ov = [f"eval.{o}" if o.split("=", 1)[0] in ("checkpoint", "split") else o for o in args.overrides]
    systems = {}
    for name, extra in (("elasticmem", ["eval.system=elasticmem"]), ("text_rag", ["eval.system=text_rag"])):
        cfg = load(Config, args.config, ov + extra)
        set_seed(cfg.seed)
        systems[name] = build_system(cfg, ov + extra)
    examples = load_split(cfg.data.dir, cfg.eval.split)[: args.examples]
    print(f"{len(examples)} examples of {cfg.data.dir}/{cfg.eval.split}, model {cfg.backbone.name_or_path}, "
          f"Z={cfg.memory.top_z}, B_max={cfg.memory.policy.max_budget}, batch {args.batch}, "
          f"checkpoint {cfg.eval.checkpoint}, threads {torch.get_num_threads()}", file=sys.stderr)

    def run(system) -> dict:
        t0 = time.perf_counter()
        preds = []
        for i in range(0, len(examples), args.batch):
            preds += system.predict(examples[i : i + args.batch])
        wall = (time.perf_counter() - t0) / len(examples)
        stages = {k: sum(pr.latency.get(k, 0.0) for pr in preds) / len(preds)
                  for k in ("retrieval", "policy", "generation")}
        return {"wall_s": wall, **stages,
                "tokens": statistics.mean(pr.total_tokens for pr in preds),
                "memory_tokens": statistics.mean(pr.memory_tokens for pr in preds)}

    for s in systems.values():  # warm-up: first calls pay for lazy loading and allocation
        s.predict(examples[: min(2, len(examples))])
    runs: dict[str, list[dict]] = {n: [] for n in systems}
    for _ in range(args.repeats):
        for n, s in systems.items():
            runs[n].append(run(s))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    for n, m in med.items():
        print(f"{n:10s} {m['wall_s']:.3f} s/example (retrieval {m['retrieval']:.3f}, policy {m['policy']:.3f}, "
              f"generation {m['generation']:.3f}); #Tok {m['tokens']:.1f}, memory tokens {m['memory_tokens']:.1f}")
    e, t = med["elasticmem"], med["text_rag"]
    ratios = {
        "latency_ratio": e["wall_s"] / t["wall_s"],
        "tokens_ratio": e["tokens"] / t["tokens"],
        "retrieval_share_elasticmem": e["retrieval"] / max(e["retrieval"] + e["policy"] + e["generation"], 1e-12),
    }
    print(f"ElasticMem / text RAG: latency {ratios['latency_ratio']:.2f}x, #Tok {ratios['tokens_ratio']:.3f}x; "
          f"retrieval is {100 * ratios['retrieval_share_elasticmem']:.1f}% of ElasticMem's latency")
    if args.out:
        write_json(args.out, {"median": med, "runs": runs, **ratios}, __file__, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
