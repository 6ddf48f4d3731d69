"""Prepare a dataset in the shared example schema (train/val/test JSONL + stats.json).

    python -m elasticmem.data.prepare synthetic --config configs/quickstart.yaml [key=value ...]

``synthetic`` writes the generated task (knobs under ``data.synthetic``) to
``data.dir``; it needs no download and is deterministic by ``seed``.
"""

from __future__ import annotations

import sys

from elasticmem.utils.configuration import parse_cli


def main(argv: list[str] | None = None) -> int:
    from elasticmem.config import Config

    argv = list(sys.argv[1:] if argv is None else argv)
    datasets = ("synthetic",)
    if not argv or argv[0] not in datasets:
        print(f"usage: python -m elasticmem.data.prepare {{{','.join(datasets)}}} --config PATH [key=value ...]",
              file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    cfg, _ = parse_cli(Config, rest, prog=f"python -m elasticmem.data.prepare {name}", description=__doc__)
    from elasticmem.data.synthetic import write_synthetic

    stats = write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    print(f"prepared {name} ({cfg.data.synthetic.variant}, seed {cfg.seed}) in {cfg.data.dir}:")
    for split in ("train", "val", "test"):
        s = stats["splits"][split]
        types = ", ".join(f"{k} {v}" for k, v in sorted(s["question_types"].items()))
        print(f"  {split:5s} {s['examples']:5d} questions, {s['histories']:4d} histories, "
              f"{s['chunks']:6d} chunks ({types})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
