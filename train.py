"""GRPO training: ``python train.py --config configs/quickstart.yaml [key=value ...]`` (= ``elasticmem-train``;
``accelerate launch ... train.py --config ...`` for several processes). The code: ``elasticmem.grpo.cli``."""
import sys

from elasticmem.grpo.cli import main

if __name__ == "__main__":
    sys.exit(main())
