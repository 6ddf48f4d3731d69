"""A-Mem (Xu et al., 2025), the agentic text-memory baseline: notes with LLM-written keywords, tags
and context, link generation, memory evolution and link-following retrieval. See docs/amem.md.

    from elasticmem.baselines.amem import AMemConfig, AMemSystem
    system = AMemSystem(AMemConfig())            # SmolLM2 + MiniLM, offline
    predictions = system.predict(examples)       # elasticmem.eval.system.MemorySystem

LoCoMo command: ``python -m elasticmem.baselines.amem.run_locomo --help``. The settings
(``AMemConfig``) live in ``elasticmem.config``, so loading a config does not load this package.
"""

from elasticmem.baselines.amem.memory import AgenticMemory, build_memories
from elasticmem.baselines.amem.notes import MemoryItem, Note
from elasticmem.baselines.amem.system import AMemSystem
from elasticmem.config import AMemConfig, AMemLLMConfig

__all__ = ["AMemConfig", "AMemLLMConfig", "AMemSystem", "AgenticMemory", "MemoryItem", "Note", "build_memories"]
