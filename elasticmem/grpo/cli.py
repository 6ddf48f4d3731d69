"""GRPO training of ElasticMem (LoRA reasoner + budget policy + projector) from task reward.

    elasticmem-train --config configs/quickstart.yaml [key=value ...]   # or: python train.py ...
    elasticmem-train --help                                  # every config key, documented
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml train.py --config ...
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 train.py --config ...  # CPU, 2 processes
    sbatch slurm/train.sbatch configs/quickstart.yaml        # one or more nodes

The run folder (train.output_dir) gets config.yaml, metrics.jsonl, rollouts.jsonl,
checkpoints/step_XXXXXX/ and final/, each with a model card (README.md: base model,
config, data, metrics at save, how to load). Running the same command again resumes from
the newest checkpoint; Ctrl-C (or SIGTERM) finishes the step and writes a checkpoint.

(``train.py`` at the repository root and the ``elasticmem-train`` console script call ``main``;
``accelerate launch`` takes the root script, as it needs a file.)
"""

from __future__ import annotations

import json
import sys

from elasticmem.utils.configuration import ConfigError, print_config
from elasticmem.utils.options import command_name, parse_cli


def main(argv: list[str] | None = None) -> int:
    from elasticmem.config import Config

    prog = command_name("train.py")
    cfg, _ = parse_cli(Config, argv, prog=prog, description=__doc__)
    import os

    from elasticmem.bank import BankError
    from elasticmem.data.schema import SchemaError
    from elasticmem.grpo.trainer import train

    if int(os.environ.get("RANK", "0")) == 0:
        print_config(cfg, file=sys.stderr)
    try:
        result = train(cfg)
    except (ConfigError, SchemaError, BankError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        last = result["history"][-1] if result.get("history") else {}
        summary = {k: last.get(k) for k in ("step", "reward/mean", "loss", "budget/mean_B_mem") if k in last}
        if "eval" in result:
            summary["eval"] = {k: v for k, v in result["eval"].items() if not k.startswith("per_type")}
        if "stopped_at" in result:
            summary["stopped_at"] = result["stopped_at"]
        print(f"{prog}: {cfg.train.output_dir}: {json.dumps(summary)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
