"""``python -m elasticmem.serve``: the same as ``elasticmem-serve``."""

import sys

from elasticmem.serve.cli import main

sys.exit(main())
