"""Bank build: ``python build_bank.py --config configs/quickstart.yaml [key=value ...]`` (= ``elasticmem-build-bank``;
``accelerate launch ... build_bank.py --config ...`` for several processes). The code: ``elasticmem.bank.cli``."""
import sys

from elasticmem.bank.cli import main

if __name__ == "__main__":
    sys.exit(main())
