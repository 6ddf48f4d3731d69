"""Retrieval quality: recall@k of each question's evidence chunks, per retrieval mode.

    # synthetic persona task (quickstart preset, SmolLM2), data and bank in a temp dir
    python -m elasticmem.data.prepare synthetic --config configs/quickstart.yaml data.dir=/tmp/q/data
    python build_bank.py --config configs/quickstart.yaml data.dir=/tmp/q/data bank.dir=/tmp/q/bank
    OMP_NUM_THREADS=1 python benchmarks/retrieval.py --config configs/quickstart.yaml \\
        data.dir=/tmp/q/data bank.dir=/tmp/q/bank --splits train val test --out runs/bench/retrieval_synth.json

    # real LoCoMo, test split (2 conversations), bank of the test split only
    python -m elasticmem.data.prepare locomo-mc10 --input PATH/locomo10.json --out /tmp/l/data
    python build_bank.py --config configs/locomo_mc10.yaml data.dir=/tmp/l/data bank.dir=/tmp/l/bank \\
        'bank.splits=[test]'
    OMP_NUM_THREADS=1 python benchmarks/retrieval.py --config configs/locomo_mc10.yaml \\
        data.dir=/tmp/l/data bank.dir=/tmp/l/bank --out runs/bench/retrieval_locomo.json

    # also a trained model's control-token (and query-only) retrieval
    python benchmarks/retrieval.py --config configs/quickstart.yaml --checkpoint runs/train/quickstart/final

    # a bank with other keys (departures from the paper): its own query mode, with learned maps
    python build_bank.py --config configs/locomo_mc10.yaml data.dir=/tmp/l/data bank.dir=/tmp/l/bank_lm \
        'bank.splits=[test]' bank.key=layer_mean
    OMP_NUM_THREADS=1 python benchmarks/retrieval.py --config configs/locomo_mc10.yaml \
        data.dir=/tmp/l/data bank.dir=/tmp/l/bank_lm --map runs/maps/layer_mean_linear.safetensors

For every question of ``--splits`` whose evidence (``extra["evidence"]``, [session, turn]
pairs) lies in some chunk of its bank group, the retrieval of the project's own
``ElasticMem`` (``model.retrieve``: query state and cosine top-Z, no budgets, no
generation; Z = max of ``--ks``) is scored against the evidence chunks
(``elasticmem.eval.retrieval``). Modes (DESIGN.md section 1 item 2):

- ``random``: the exact expectation for a uniformly random top k of the group's chunks;
- ``frozen``: last prompt token's state, adapter off;
- ``query_only``: the same with the adapter on (untrained: LoRA B = 0, identical to ``frozen``);
- ``control``: the state at the greedy (argmax) retrieval-control token, untrained adapter;
- ``semantic``: MiniLM (all-MiniLM-L6-v2) on the question against MiniLM chunk embeddings (the
  hybrid: MiniLM finds the memories, the latent caches carry them);
- ``mean``, ``layer_mean``, ``prompt`` (departures from the paper): the bank's key function of the
  same name applied to the question, adapter off; each needs a bank built with that ``bank.key``;
- ``query_only+ckpt``, ``control+ckpt``: with ``--checkpoint`` (its adapter and memory settings);
- ``MODE+map[NAME]``: with ``--map PATH`` (repeatable), the learned query/key map in PATH
  (``memory.retrieval_map``; MODE is the retrieval mode it was trained for, NAME the file stem).

Default ``--modes``: random, frozen, query_only, control, semantic on a bank with the paper's
keys; random, the bank's own mode and semantic on a bank with other keys (the paper's modes
refuse it).

Prints, per mode, n (questions with evidence), ``recall_any@k`` (fraction of questions with
any evidence chunk in the top k) with its 95 % Wilson interval, ``recall_frac@k`` (mean
fraction of a question's evidence chunks in the top k), and the seconds the mode took
(model load + retrieval); then the total wall time. ``--out`` writes all of it as JSON.
Questions without evidence (or whose evidence names no turn of the history) are counted and
left out.

Results: benchmarks/README.md, section ``retrieval.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import write_json  # noqa: E402

MODES = ("random", "frozen", "query_only", "control", "semantic")
"""The modes of a bank with the paper's keys."""
KEY_MODES = ("mean", "layer_mean", "prompt")
"""Modes for banks with other keys (bank.key of the same name; departures from the paper)."""
CKPT_MODES = ("query_only", "control")


def default_modes(bank_dir: str) -> list[str]:
    """The modes that fit the bank's keys (see the module docstring)."""
    from elasticmem.bank import Bank

    variant = Bank.open(bank_dir).key_variant
    return list(MODES) if variant == "last" else ["random", variant, "semantic"]


def wilson(hits: int, n: int) -> tuple[float, float]:
    """95 % Wilson interval of hits / n."""
    from scipy.stats import binomtest

    ci = binomtest(int(hits), int(n)).proportion_ci(confidence_level=0.95, method="wilson")
    return float(ci.low), float(ci.high)


def _model(cfg, mode: str, top_z: int, checkpoint: str | None, retrieval_map: str | None = None):
    """The project's ElasticMem on a fresh backbone (peft mutates it) with retrieval ``mode``
    (and the learned map ``retrieval_map``)."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, build_index
    from elasticmem.systems import memory_config
    from elasticmem.model.elasticmem import ElasticMem

    backbone = load_backbone(cfg.backbone)
    bank = Bank.open(cfg.bank.dir, expect_fingerprint=backbone.fingerprint)
    run_cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, system="elasticmem", checkpoint=checkpoint))
    mem = memory_config(run_cfg, [f"memory.retrieval={mode}", f"memory.top_z={top_z}"]
                        + ([f"memory.retrieval_map={retrieval_map}"] if retrieval_map else []))
    model = ElasticMem(backbone, mem, bank, build_index(bank, cfg.bank.index, cfg.seed))
    if checkpoint:
        model.load_weights(checkpoint)
    return model.eval()


def measure(cfg, examples: Sequence, modes: Sequence[str] = MODES, ks: Sequence[int] = (1, 5, 20),
            checkpoint: str | None = None, batch_size: int = 16, log=print,
            maps: Sequence[str] = ()) -> dict[str, Any]:
    """Recall of evidence chunks per retrieval mode on ``examples`` (cfg: model, bank, memory).

    Returns ``{"n_examples", "n_no_evidence", "n_unmapped", "group_sizes", "modes": {mode:
    {n, n_no_evidence, recall_any@k, hits_any@k, ci_any@k ([low, high] or None for random),
    recall_frac@k, seconds}}}``; with ``checkpoint`` also the ``CKPT_MODES`` as ``MODE+ckpt``;
    per learned map file in ``maps`` its mode as ``MODE+map[STEM]`` (with ``"map": path``).
    """
    from elasticmem.bank import Bank
    from elasticmem.eval.retrieval import evidence_rows, random_recall, recall_at_k

    ks = sorted({int(k) for k in ks})
    Z = ks[-1]
    bank = Bank.open(cfg.bank.dir)
    ev_all = [evidence_rows(ex, bank) for ex in examples]
    keep = [i for i, e in enumerate(ev_all) if e]
    exs, ev = [examples[i] for i in keep], [ev_all[i] for i in keep]
    unmapped = sum(1 for ex, e in zip(examples, ev_all) if not e and ex.extra.get("evidence"))
    sizes = [bank.group_size(ex.group) for ex in exs]
    out: dict[str, Any] = {
        "n_examples": len(examples), "n_no_evidence": len(examples) - len(keep), "n_unmapped": unmapped,
        "group_sizes": {"min": min(sizes, default=0), "max": max(sizes, default=0),
                        "mean": sum(sizes) / max(len(sizes), 1)},
        "evidence_chunks_mean": sum(len(e) for e in ev) / max(len(ev), 1), "bank_key": bank.key,
        "ks": ks, "modes": {},
    }
    runs = [(m, None, None) for m in modes] + ([(m, checkpoint, None) for m in CKPT_MODES] if checkpoint else [])
    if maps:
        from pathlib import Path

        from elasticmem.model.retrieval_map import load_retrieval_map

        runs += [(load_retrieval_map(p)[1]["retrieval"], None, p) for p in maps]
    for mode, ckpt, rmap in runs:
        name = f"{mode}+ckpt" if ckpt else f"{mode}+map[{Path(rmap).stem}]" if rmap else mode
        t0 = time.perf_counter()
        if mode == "random":
            res = random_recall(sizes, ev, ks)
        else:
            model = _model(cfg, mode, Z, ckpt, rmap)
            rows = [model.retrieve(exs[i : i + batch_size])[0] for i in range(0, len(exs), batch_size)]
            rows = torch.cat(rows) if rows else torch.zeros(0, Z, dtype=torch.long)
            del model
            res = recall_at_k(rows, ev, ks)
        res = dict(res, n_no_evidence=out["n_no_evidence"])
        for k in ks:
            if f"hits_any@{k}" in res:
                res[f"ci_any@{k}"] = None if mode == "random" else list(wilson(res[f"hits_any@{k}"], res["n"]))
        res["seconds"] = time.perf_counter() - t0
        if rmap:
            res["map"] = str(rmap)
        out["modes"][name] = res
        log(f"  {name}: {res['seconds']:.1f} s")
    return out


def format_table(result: dict[str, Any]) -> str:
    ks = result["ks"]
    w = max([16] + [len(n) for n in result["modes"]])
    head = f"{'mode':{w}s} {'n':>5s} " + " ".join(f"{'R_any@' + str(k) + ' [95% Wilson]':>26s}" for k in ks)
    head += " " + " ".join(f"{'R_frac@' + str(k):>10s}" for k in ks) + f" {'s':>7s}"
    lines = [head]
    for name, r in result["modes"].items():
        cells = []
        for k in ks:
            v, ci = r.get(f"recall_any@{k}"), r.get(f"ci_any@{k}")
            if v is None:
                cells.append(f"{'-':>26s}")
            elif ci is None:
                cells.append(f"{v:.3f} {'(exact)':>20s}".rjust(26))
            else:
                cells.append(f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]".rjust(26))
        fr = [f"{r[f'recall_frac@{k}']:10.3f}" if f"recall_frac@{k}" in r else f"{'-':>10s}" for k in ks]
        lines.append(f"{name:{w}s} {r['n']:5d} " + " ".join(cells) + " " + " ".join(fr) + f" {r['seconds']:7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--splits", nargs="+", default=["test"], help="splits of data.dir whose questions are scored")
    p.add_argument("--ks", nargs="+", type=int, default=[1, 5, 20], help="cut-offs; Z = the largest")
    p.add_argument("--modes", nargs="+", choices=MODES + KEY_MODES,
                   help="default: the modes that fit the bank's keys (see above)")
    p.add_argument("--map", dest="maps", action="append", default=[],
                   help="a learned retrieval map (python -m elasticmem.warmup.retrieval_map); repeatable")
    p.add_argument("--checkpoint", help="a trained model folder (train.output_dir/final): adds its query_only and "
                                        "control retrieval")
    p.add_argument("--limit", type=int, default=0, help="first N questions of each split (0 = all)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", help="also write the results as JSON here")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_intermixed_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from elasticmem.config import Config
    from elasticmem.data.schema import load_split
    from elasticmem.utils.configuration import load

    t0 = time.perf_counter()
    cfg = load(Config, args.config, args.overrides)
    examples = []
    for split in args.splits:
        exs = load_split(cfg.data.dir, split)
        examples += exs[: args.limit] if args.limit else exs
    print(f"{len(examples)} questions of {cfg.data.dir}/{'+'.join(args.splits)}, bank {cfg.bank.dir}, "
          f"model {cfg.backbone.name_or_path}, ks {args.ks}, checkpoint {args.checkpoint}, "
          f"threads {torch.get_num_threads()}, maps {args.maps}", file=sys.stderr)
    modes = args.modes or default_modes(cfg.bank.dir)
    result = measure(cfg, examples, modes, args.ks, args.checkpoint, args.batch,
                     log=lambda s: print(s, file=sys.stderr), maps=args.maps)
    wall = time.perf_counter() - t0
    g = result["group_sizes"]
    print(f"questions: {result['n_examples']}, with evidence: {result['n_examples'] - result['n_no_evidence']} "
          f"(without: {result['n_no_evidence']}, of which evidence naming no chunk: {result['n_unmapped']}); "
          f"chunks per group {g['min']}-{g['max']} (mean {g['mean']:.1f}); "
          f"evidence chunks per question {result['evidence_chunks_mean']:.2f}")
    print(format_table(result))
    print(f"wall time {wall:.1f} s")
    if args.out:
        meta = {"config": args.config, "overrides": args.overrides, "data_dir": cfg.data.dir, "bank_dir": cfg.bank.dir,
                "model": cfg.backbone.name_or_path, "splits": args.splits, "checkpoint": args.checkpoint,
                "maps": args.maps, "bank_key": result.get("bank_key"),
                "limit": args.limit, "wall_s": wall}
        write_json(args.out, {**meta, **result}, __file__, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
