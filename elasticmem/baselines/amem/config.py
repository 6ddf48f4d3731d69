"""Settings of the A-Mem baseline: ``AMemConfig`` and ``AMemLLMConfig`` live in
``elasticmem.config`` (the ground floor, where every section's dataclass is; the top-level
``Config`` holds one as ``amem:``) and are re-exported here under their old names. The LoCoMo
command ``python -m elasticmem.baselines.amem.run_locomo --help`` lists every key.
"""

from elasticmem.config import AMEM_ABLATIONS as ABLATIONS  # noqa: F401
from elasticmem.config import AMemConfig, AMemLLMConfig  # noqa: F401

__all__ = ["ABLATIONS", "AMemConfig", "AMemLLMConfig"]
