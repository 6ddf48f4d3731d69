"""The one small interface every evaluated system implements (ElasticMem and the baselines).

``evaluate.py`` hands a system batches of examples of the shared schema and gets back one
``Prediction`` per example. How a system remembers (soft tokens from a bank, plain text
chunks, A-Mem notes, nothing) is its own business; the harness only scores, counts tokens
and times what comes back, so every system is measured the same way. ``identity()`` says what
makes its answers, so a resumed evaluation never mixes the predictions of two systems.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from elasticmem.data.schema import Example


@dataclass
class Retrieved:
    """One memory a system put in front of the reasoner for an example."""

    rank: int
    """0 = best."""
    ref: str
    """What was retrieved: a bank row (``"row:123"``) or a note id (A-Mem)."""
    score: float
    """Retrieval score (cosine similarity for every system in this framework)."""
    text: str
    """The memory's text (the chunk, or the note's content), for case studies."""
    budget: int | None = None
    """Latent tokens given to it (ElasticMem); None for text memories."""
    tokens: int = 0
    """Tokens this memory added to the reasoner's input (soft tokens or text tokens)."""


@dataclass
class Prediction:
    """A system's answer to one example, with what it cost."""

    id: str
    """The example's id."""
    text: str
    """The generated answer, verbatim."""
    prompt_tokens: int
    """Task-text input tokens (question, options, template), memories excluded."""
    memory_tokens: int
    """Tokens the memories added (``B_mem`` for ElasticMem, text tokens for text memories)."""
    generated_tokens: int
    """Tokens generated for the answer."""
    retrieved: list[Retrieved] = field(default_factory=list)
    latency: dict[str, float] = field(default_factory=dict)
    """Seconds spent for this example, by stage: ``retrieval``, ``policy``, ``generation``
    (a batch's time is shared evenly among its examples)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """System-specific details kept in ``predictions.jsonl`` (e.g. A-Mem's LLM call counts)."""

    @property
    def total_tokens(self) -> int:
        """``#Tok`` of DESIGN.md section 1 item 8: input text + memory + generated tokens."""
        return self.prompt_tokens + self.memory_tokens + self.generated_tokens


@runtime_checkable
class MemorySystem(Protocol):
    """Answers examples with whatever memory it has; see the module docstring."""

    name: str
    # Optional: ``memory_per_group = True`` for a system that builds a memory per example group
    # as it answers (A-Mem, Mem0, LangMem); the evaluation then gives each group to one process.

    def predict(self, examples: Sequence[Example]) -> list[Prediction]:
        """Greedy answers for a batch, in order, one ``Prediction`` per example."""
        ...

    def identity(self) -> dict[str, Any]:
        """JSON-able description of everything that changes the answers (weights by content hash,
        memory and prompt settings), and nothing that does not (batch size, paths, processes):
        an output folder holding predictions of another identity is not resumed."""
        ...


def fingerprint(obj: Any) -> str:
    """``sha256:<hex>`` of ``obj``'s canonical JSON (sorted keys): equal for equal JSON values."""
    text = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
