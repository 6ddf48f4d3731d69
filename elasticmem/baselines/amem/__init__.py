"""A-Mem (Xu et al., 2025), the agentic text-memory baseline: notes with LLM-written keywords, tags
and context, link generation, memory evolution and link-following retrieval. See docs/amem.md.

    from elasticmem.baselines.amem import AMemConfig, AMemSystem
    system = AMemSystem(AMemConfig())            # SmolLM2 + MiniLM, offline
    predictions = system.predict(examples)       # elasticmem.eval.system.MemorySystem

LoCoMo command: ``python -m elasticmem.baselines.amem.run_locomo --help``.

Only the config is imported eagerly: ``elasticmem.config`` imports ``AMemConfig``, and loading a
config must not pull in torch, transformers and faiss.
"""

from __future__ import annotations

import importlib
from typing import Any

from elasticmem.baselines.amem.config import AMemConfig, AMemLLMConfig

_LAZY = {
    "AMemSystem": "elasticmem.baselines.amem.system",
    "AgenticMemory": "elasticmem.baselines.amem.memory",
    "build_memories": "elasticmem.baselines.amem.memory",
    "MemoryItem": "elasticmem.baselines.amem.notes",
    "Note": "elasticmem.baselines.amem.notes",
}

__all__ = ["AMemConfig", "AMemLLMConfig", "AMemSystem", "AgenticMemory", "MemoryItem", "Note", "build_memories"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
