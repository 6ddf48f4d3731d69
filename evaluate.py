"""Evaluate a checkpoint, a baseline, or a list of variants on one split, greedily.

    python evaluate.py --config configs/quickstart.yaml checkpoint=runs/train/quickstart/final split=test
    python evaluate.py --help                                  # every config key and more examples

The command line itself is ``elasticmem.eval.cli`` (its docstring lists the outputs and more uses).
"""

import sys

from elasticmem.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
