"""Encode a dataset's histories into a latent memory bank (keys + content caches).

    elasticmem-build-bank --config configs/quickstart.yaml [key=value ...]   # or: python build_bank.py ...
    elasticmem-build-bank --help                   # every config key, documented
    accelerate launch --num_processes 2 build_bank.py --config ...   # shards split across processes
    elasticmem-build-bank --config ... bank.part=K/N   # part K of N (a job-array task), then once
    elasticmem-build-bank --config ...                 # without bank.part: the merge (the manifest)
    elasticmem-build-bank --config ... data.dir=NEW --append   # add new groups / sessions to a built bank
    elasticmem-build-bank --config ... data.dir=NEW build.append=true   # the same (every flag is a key too)
    elasticmem-build-bank --config ... bank.kv_dtype=int8 --convert   # re-store a built bank's KV, no encoding

An interrupted build resumes where it stopped when run again with the same
settings. The bank folder layout is documented in DESIGN.md section 3.1.

``--append`` adds the histories of bank.splits in data.dir to the bank at bank.dir (created
empty when missing) through the live append path (``elasticmem.bank.append``): chunks a group
already holds (same text) are skipped, so new sessions of known conversations and new
conversations are added and the rest is left as it is; readers of the bank keep working, and a
crash leaves the bank as it was. The bank's own tokenization, keys and cache settings are used.

``--convert`` stores the bank at bank.dir as this config would build it, without encoding: its
per-layer keys and values as bank.kv_dtype, bank.kv_key_dtype, bank.kv_key_group and
bank.kv_group_size say (``BankConfig.kv_scheme()``: a float16 bank becomes int8 / int4, with key
ranges per chunk or per run of positions, keys maybe at int8 over int4 values; a bank built before
the ragged layout loses its padding) and, when bank.hidden_cache resolves to false for the config's reader, without
the hidden-state cache (``elasticmem.bank.convert``; atomic: a crash leaves the old bank readable).

(``build_bank.py`` at the repository root and the ``elasticmem-build-bank`` console script call
``main``; ``accelerate launch`` takes the root script, as it needs a file.)
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from elasticmem.utils.configuration import ConfigError, print_config, save
from elasticmem.utils.options import Options, command_name, parse_cli


@dataclass
class BuildOptions:
    """The command's own options (not config keys): ``build.KEY=VALUE`` or the flag."""

    append: bool = False
    """Add the data's new chunks to the bank at bank.dir instead of building it."""
    convert: bool = False
    """Re-store the built bank at bank.dir as this config would build it (bank.kv_dtype,
    bank.kv_key_dtype, bank.kv_key_group, bank.kv_group_size, bank.hidden_cache), without encoding
    anything."""


OPTIONS = Options("build", BuildOptions)


def main(argv: list[str] | None = None) -> int:
    from elasticmem.config import Config

    prog = command_name("build_bank.py")
    cfg, args = parse_cli(Config, argv, prog=prog, description=__doc__, options=OPTIONS)
    opts: BuildOptions = args.options
    if opts.append:
        return _append(cfg, prog)
    if opts.convert:
        return _convert(cfg, prog)

    import torch

    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, BankError, build_bank, build_index, resolve_cache_dtype
    from elasticmem.data.schema import SchemaError, load_split
    from elasticmem.utils.distributed import process_state

    state = process_state(timeout_s=cfg.bank.dist_timeout_s)
    if state.is_main_process:
        print_config(cfg, file=sys.stderr)
    try:
        examples = {split: load_split(cfg.data.dir, split) for split in cfg.bank.splits}
        device = state.device if cfg.backbone.device == "auto" else torch.device(cfg.backbone.device)
        backbone = load_backbone(cfg.backbone, device=device)
        cache_dtype = resolve_cache_dtype(cfg.bank.cache_dtype, device)
        result = build_bank(examples, backbone, cfg.chunking, cfg.bank, cache_dtype, state=state, memory=cfg.memory)
        if not state.is_main_process:
            return 0
        if cfg.bank.part:
            print(f"bank {result.bank_dir}: {result.status} done ({result.shards_encoded} shard(s) encoded in "
                  f"{result.seconds:.1f} s); when every part is done, run {prog} without bank.part to "
                  f"write the manifest")
            return 0
        save(cfg, result.bank_dir / "config.yaml")
        bank = Bank.open(result.bank_dir, expect_fingerprint=backbone.fingerprint, verify=cfg.bank.verify)
        if cfg.bank.index.type in ("ivf", "hnsw"):
            # built and saved now, not at first training step (on the CPU: the saved index is the CPU one)
            build_index(bank, dataclasses.replace(cfg.bank.index, gpu=False), cfg.seed)
    except (ConfigError, SchemaError, BankError, FileNotFoundError, ImportError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    lens = [c["n_tokens"] for c in bank.chunks()]
    print(
        f"bank {result.bank_dir} ({result.status}{', verified' if cfg.bank.verify else ''})\n"
        f"  groups {result.num_groups}, chunks {result.num_chunks}, tokens {result.num_tokens} "
        f"(mean {result.num_tokens / max(1, result.num_chunks):.1f}, max {max(lens)} per chunk)\n"
        f"{_storage_lines(bank)}\n"
        f"  encoder {bank.manifest['encoder']['name_or_path']} {bank.fingerprint[:23]}...\n"
        f"  {result.shards_encoded} shard(s) encoded in {result.seconds:.1f} s"
        + (f" ({result.num_chunks / result.seconds:.1f} chunks/s)" if result.status == "built" else "")
    )
    return 0


def _storage_lines(bank) -> str:
    """What the shards hold, their size on disk and the bytes a chunk takes (the manifest's
    ``build.bytes_per_chunk``, absent for banks built before it)."""
    n, d = bank.num_chunks, bank.hidden_size
    cache = (f"cache [{n}, {bank.n_cache}, {d}] {bank.manifest['cache_dtype']}" if bank.hidden_cache
             else "no hidden-state cache")
    kv = f", per-layer KV {bank.kv_format.describe()}" if bank.kv_format else ""
    per = bank.manifest.get("build", {}).get("bytes_per_chunk")
    line = (f"  keys [{n}, {d}] float32, {cache}{kv}\n  {len(bank.shards)} shard(s), "
            f"{bank.nbytes_on_disk() / 1e6:.1f} MB on disk")
    if per:
        parts = ", ".join(f"{k} {v:,}" for k, v in per.items() if k != "total" and v)
        line += f"; bytes per chunk {per['total']:,} ({parts})"
    return line


def _convert(cfg, prog: str) -> int:
    """``--convert``: ``elasticmem.bank.convert.convert_bank`` to the storage a build of ``cfg`` uses."""
    from elasticmem.bank import Bank, BankError
    from elasticmem.bank.convert import convert_bank
    from elasticmem.bank.kv_store import storage_of

    print_config(cfg, file=sys.stderr)
    try:
        hidden, fmt = storage_of(cfg.bank, cfg.memory)
        if fmt is None:
            raise ConfigError("--convert re-stores per-layer keys and values: set bank.kv_cache=true")
        before = Bank.open(cfg.bank.dir)
        bank = convert_bank(cfg.bank.dir, fmt.scheme, hidden_cache=hidden)
        save(cfg, bank.root / "config.yaml")
    except (ConfigError, BankError, FileNotFoundError, OSError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"bank {bank.root} ({'unchanged' if bank.manifest == before.manifest else 'converted'})\n"
          f"{_storage_lines(bank)}")
    return 0


def _append(cfg, prog: str) -> int:
    """``--append``: one append of every session of every group of bank.splits (known chunks skipped)."""
    import time
    from pathlib import Path

    import torch

    from elasticmem.backbone import load_backbone
    from elasticmem.bank import BankError, build_index, resolve_cache_dtype
    from elasticmem.bank.append import SessionAdd, append_sessions, create_bank
    from elasticmem.bank.builder import collect_groups
    from elasticmem.bank.encoding import key_spec
    from elasticmem.bank.store import MANIFEST, Bank
    from elasticmem.data.schema import SchemaError, load_split

    print_config(cfg, file=sys.stderr)
    try:
        t0 = time.perf_counter()
        groups = collect_groups({split: load_split(cfg.data.dir, split) for split in cfg.bank.splits})
        device = torch.device("cuda" if cfg.backbone.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if cfg.backbone.device == "auto" else cfg.backbone.device))
        backbone = load_backbone(cfg.backbone, device=device)
        root = Path(cfg.bank.dir)
        if not (root / MANIFEST).is_file():
            create_bank(root, backbone, cfg.chunking, cfg.bank, resolve_cache_dtype(cfg.bank.cache_dtype, device))
        bank = Bank.open(root, expect_fingerprint=backbone.fingerprint)
        ch = cfg.chunking
        mine = {"n_cache": cfg.bank.n_cache, "key": key_spec(cfg.bank),
                "tokenization": {"add_special_tokens": ch.add_special_tokens, "max_tokens": ch.max_tokens,
                                 "truncation_side": ch.truncation_side}}
        differ = [k for k, v in mine.items() if bank.manifest.get(k) != v]
        if differ:
            print(f"{prog}: note: the config's {', '.join(differ)} differ from the bank's; appending with "
                  f"the bank's own settings", file=sys.stderr)
        items = [SessionAdd(g, turns, s) for g, ex in groups.items() for s, turns in enumerate(ex.history) if turns]
        with torch.inference_mode():
            res = append_sessions(root, items, backbone.model.get_decoder(), backbone.tokenizer, backbone.fingerprint,
                                  batch_size=cfg.bank.batch_size, show_progress=True)
        if cfg.bank.index.type in ("ivf", "hnsw"):  # extend (or rebuild) the saved index now
            build_index(res.bank, dataclasses.replace(cfg.bank.index, gpu=False), cfg.seed)
    except (ConfigError, SchemaError, BankError, FileNotFoundError, ImportError, OSError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    touched = sum(1 for rows in res.rows.values() if rows)
    new_groups = sum(1 for g, rows in res.rows.items() if rows and g not in bank.groups)
    print(f"bank {root} (appended)\n"
          f"  {res.added} chunk(s) added to {touched} group(s) ({new_groups} new), {sum(res.skipped.values())} "
          f"already held, in {time.perf_counter() - t0:.1f} s\n"
          f"  now {res.bank.num_chunks} chunks in {len(res.bank.groups)} groups, {len(res.bank.shards)} shard(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
