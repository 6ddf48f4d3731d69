"""Evaluation: ``python evaluate.py --config configs/quickstart.yaml checkpoint=runs/train/quickstart/final``
(= ``elasticmem-eval``; ``--help`` lists every key). The code: ``elasticmem.apps.evaluate``."""
import sys

from elasticmem.apps.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
