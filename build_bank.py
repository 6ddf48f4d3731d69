"""Encode a dataset's histories into a latent memory bank (keys + content caches).

    python build_bank.py --config configs/quickstart.yaml [key=value ...]
    python build_bank.py --help                    # every config key, documented
    accelerate launch --num_processes 2 build_bank.py --config ...   # shards split across processes
    python build_bank.py --config ... bank.part=K/N   # part K of N (a job-array task), then once
    python build_bank.py --config ...                  # without bank.part: the merge (the manifest)

An interrupted build resumes where it stopped when run again with the same
settings. The bank folder layout is documented in DESIGN.md section 3.1.
"""

from __future__ import annotations

import dataclasses
import sys

from elasticmem.utils.configuration import ConfigError, parse_cli, print_config, save


def main(argv: list[str] | None = None) -> int:
    from elasticmem.config import Config

    cfg, _ = parse_cli(Config, argv, prog="build_bank.py", description=__doc__)

    import torch

    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, BankError, build_bank, build_index, resolve_cache_dtype
    from elasticmem.data.schema import SchemaError, load_split
    from elasticmem.utils.distributed import process_state

    state = process_state()
    if state.is_main_process:
        print_config(cfg, file=sys.stderr)
    try:
        examples = {split: load_split(cfg.data.dir, split) for split in cfg.bank.splits}
        device = state.device if cfg.model.device == "auto" else torch.device(cfg.model.device)
        backbone = load_backbone(cfg.model, device=device)
        cache_dtype = resolve_cache_dtype(cfg.bank.cache_dtype, device)
        result = build_bank(examples, backbone, cfg.chunking, cfg.bank, cache_dtype, state=state)
        if not state.is_main_process:
            return 0
        if cfg.bank.part:
            print(f"bank {result.bank_dir}: {result.status} done ({result.shards_encoded} shard(s) encoded in "
                  f"{result.seconds:.1f} s); when every part is done, run build_bank.py without bank.part to "
                  f"write the manifest")
            return 0
        save(cfg, result.bank_dir / "config.yaml")
        bank = Bank.open(result.bank_dir, expect_fingerprint=backbone.fingerprint, verify=cfg.bank.verify)
        if cfg.bank.index.type in ("ivf", "hnsw"):
            # built and saved now, not at first training step (on the CPU: the saved index is the CPU one)
            build_index(bank, dataclasses.replace(cfg.bank.index, gpu=False), cfg.seed)
    except (ConfigError, SchemaError, BankError, FileNotFoundError, ImportError, OSError) as e:
        print(f"build_bank.py: error: {e}", file=sys.stderr)
        return 2
    lens = [c["n_tokens"] for c in bank.chunks()]
    mb = bank.nbytes_on_disk() / 1e6
    print(
        f"bank {result.bank_dir} ({result.status}{', verified' if cfg.bank.verify else ''})\n"
        f"  groups {result.num_groups}, chunks {result.num_chunks}, tokens {result.num_tokens} "
        f"(mean {result.num_tokens / max(1, result.num_chunks):.1f}, max {max(lens)} per chunk)\n"
        f"  keys [{bank.num_chunks}, {bank.hidden_size}] float32, cache [{bank.num_chunks}, {bank.n_cache}, "
        f"{bank.hidden_size}] {bank.manifest['cache_dtype']}, {len(bank.shards)} shard(s), {mb:.1f} MB on disk\n"
        f"  encoder {bank.manifest['encoder']['name_or_path']} {bank.fingerprint[:23]}...\n"
        f"  {result.shards_encoded} shard(s) encoded in {result.seconds:.1f} s"
        + (f" ({result.num_chunks / result.seconds:.1f} chunks/s)" if result.status == "built" else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
