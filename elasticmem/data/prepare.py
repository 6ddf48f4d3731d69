"""Prepare a dataset in the shared example schema (train/val/test JSONL + stats.json).

    elasticmem-prepare synthetic --config configs/quickstart.yaml [key=value ...]
    elasticmem-prepare DATASET --input PATH [PATH ...] --out DIR [--seed N] [--skip-invalid] [--splits DIR]
                       [--via-datasets]
    elasticmem-prepare DATASET prepare.input=[PATH] prepare.out=DIR [prepare.seed=N ...]   # the same, dotted

(``elasticmem-prepare`` is the console script; ``python -m elasticmem.data.prepare`` is the same.)

``synthetic`` writes the generated task (knobs under ``data.synthetic``) to
``data.dir``; it needs no download and is deterministic by ``seed``.

The real benchmarks read files you downloaded yourself, or a Hub dataset (below):

    locomo-qa               locomo10.json -> free-form QA with categories (A-Mem-style F1/BLEU)
    locomo-mc10             locomo10.json -> 10-way MC built locally (distractors by seed)
    locomo-mc10-jsonl       published LoCoMo MC-10 JSONL (Percena locomo-mc10), read as is
    longmemeval             longmemeval_{s,m,oracle}.json -> free-form QA, streamed
    longmemeval-mc10-jsonl  published LongMemEval MC-10 JSONL (Percena lme-mc10)
    personamem              questions_{32k,128k}.csv + shared_contexts_{32k,128k}.jsonl -> MC-4

An input PATH is a file, a folder (a dataset saved with ``save_to_disk``, or data files) or a
Hugging Face Hub dataset (``owner/name``, ``hf://datasets/owner/name[@REVISION][/FILE]``, from
the datasets cache or downloaded; only the cache with HF_DATASETS_OFFLINE=1); ``SPEC:SPLIT`` picks
a split. Folders and Hub ids are read through ``datasets``; local files by the loaders' streaming
readers, or with ``--via-datasets`` through ``datasets`` too (the same output). docs/data.md.

Each writes DIR/{train,val,test}.jsonl, DIR/splits/{train,val,test}_ids.txt
(the frozen split: conversation, question or context ids) and DIR/stats.json.
``--splits DIR`` reuses frozen lists instead of drawing the split;
``--skip-invalid`` logs and counts invalid records instead of stopping at the
first. Formats, splits and errors: docs/datasets.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Any

from elasticmem.utils.options import Flag, Options, command_name, parse_cli, parse_options

SYNTHETIC = "synthetic"
REAL = ("locomo-qa", "locomo-mc10", "locomo-mc10-jsonl", "longmemeval", "longmemeval-mc10-jsonl", "personamem")
DATASETS = (SYNTHETIC, *REAL)


@dataclass
class PrepareOptions:
    """A real benchmark's options: ``prepare.KEY=VALUE`` or the flag."""

    input: list[str]
    """Source file(s), folder(s) or Hub dataset id(s) (owner/name, hf://datasets/owner/name/FILE); personamem
    takes the questions CSV and the contexts JSONL."""
    out: str
    """Output folder (the config's data.dir)."""
    seed: int = 42
    """Split seed (LongMemEval, PersonaMem) and distractor seed (locomo-mc10)."""
    skip_invalid: bool = False
    """Log and count invalid records in stats.json instead of stopping at the first."""
    splits: str | None = None
    """Reuse the frozen split lists DIR/{train,val,test}_ids.txt instead of drawing the split."""
    via_datasets: bool = False
    """Read local files through datasets.load_dataset too (folders and Hub ids always are); the same output."""


OPTIONS = Options("prepare", PrepareOptions, flags={"input": Flag(metavar="PATH"), "out": Flag(metavar="DIR"),
                                                    "splits": Flag(metavar="DIR")})


def _prog() -> str:
    return command_name("python -m elasticmem.data.prepare")


def _usage() -> str:
    prog = _prog()
    return (f"usage: {prog} synthetic --config PATH [key=value ...]\n"
            f"       {prog} {{{','.join(REAL)}}} --input PATH [PATH ...] --out DIR "
            f"[--seed N] [--skip-invalid] [--splits DIR] [--via-datasets]\n"
            f"       {prog} DATASET --help")


def prepare_real(name: str, inputs: list[str], out: str, seed: int = 42, skip_invalid: bool = False,
                 splits_dir: str | None = None, via_datasets: bool = False) -> dict[str, Any]:
    """Run one real-benchmark loader; returns what it wrote to OUT/stats.json."""
    kw: dict[str, Any] = {"seed": seed, "skip_invalid": skip_invalid, "splits_dir": splits_dir,
                          "via_datasets": via_datasets}
    if name.startswith("locomo"):
        from elasticmem.data.locomo import prepare_locomo

        return prepare_locomo(name, inputs, out, **kw)
    if name.startswith("longmemeval"):
        from elasticmem.data.longmemeval import prepare_longmemeval

        return prepare_longmemeval(name, inputs, out, **kw)
    if name == "personamem":
        from elasticmem.data.personamem import prepare_personamem

        return prepare_personamem(inputs, out, **kw)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


def _real_main(name: str, rest: list[str]) -> int:
    from elasticmem.data.schema import SchemaError

    p = argparse.ArgumentParser(prog=f"{_prog()} {name}",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    opts, _ = parse_options(p, OPTIONS, rest)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    try:
        stats = prepare_real(name, opts.input, opts.out, opts.seed, opts.skip_invalid, opts.splits, opts.via_datasets)
    except (SchemaError, FileNotFoundError, ValueError, OSError) as e:
        print(f"prepare {name}: error: {e}", file=sys.stderr)
        return 2
    print(f"prepared {name} in {opts.out} (split by {stats['split']['unit']}):")
    for split in ("train", "val", "test"):
        _print_split(split, stats["splits"][split])
    skipped = stats["skipped"]
    if skipped["total"]:
        print(f"  skipped {skipped['total']} invalid record(s): {skipped['by_reason']} (see stats.json)")
    for key in ("excluded",):
        if stats.get(key):
            print(f"  {key}: {stats[key]}")
    return 0


def _print_split(split: str, s: dict[str, Any]) -> None:
    types = ", ".join(f"{k} {v}" for k, v in sorted(s["question_types"].items()))
    print(f"  {split:5s} {s['examples']:6d} questions, {s['groups']:5d} groups, {s['sessions']:6d} sessions, "
          f"{s['turns']:7d} turns, {s['chunks']:7d} chunks ({types})")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):  # the dataset comes first, so argparse never sees a bare --help
        print(f"{_usage()}\n\n{__doc__}")
        return 0
    if not argv or argv[0] not in DATASETS:
        print(_usage(), file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name != SYNTHETIC:
        return _real_main(name, rest)

    from elasticmem.config import Config

    cfg, _ = parse_cli(Config, rest, prog=f"{_prog()} {name}", description=__doc__)
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
