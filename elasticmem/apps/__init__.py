"""The command-line apps that sit above everything they run: ``evaluate`` (``evaluate.py``,
``elasticmem-eval``: a checkpoint, a baseline or a list of variants on one split) and ``ladder``
(``python -m elasticmem.apps.ladder``: the reading ladder's rungs as variants of ``evaluate``).

They build systems from the registry (``elasticmem.systems``) and play ALFWorld episodes
(``elasticmem.agent``), so they live here rather than in ``elasticmem.eval``, whose evaluation
core those layers import (tests/unit/test_import_layers.py).
"""
