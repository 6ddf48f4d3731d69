"""The old home of the systems registry, kept so that ``elasticmem.eval.systems`` still imports:
the registry is ``elasticmem.systems`` now, above ``elasticmem.eval`` and the baselines it
registers. This alias sits in the systems layer (tests/unit/test_import_layers.py), not in
eval's; nothing in the package imports it.
"""

from elasticmem.systems import (  # noqa: F401
    CHECKPOINT_WEIGHTS,
    MEMGEN_WEIGHTS,
    SYSTEM_MEMORY,
    ElasticMemSystem,
    bank_fingerprint,
    build_system,
    checkpoint_fingerprint,
    memory_config,
)
