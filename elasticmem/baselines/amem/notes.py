"""A-Mem's memory note (paper eq. 1) and the texts made from it.

``m_i = {c_i, t_i, K_i, G_i, X_i, e_i, L_i}``: content, timestamp, keywords, tags, context,
embedding and links. Links hold note *ids* (never positions in a list, which change as the
memory grows: the public implementation's evolution step indexed neighbours by rank into the
insertion-ordered note list, so it updated the wrong notes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class MemoryItem:
    """Something to remember: one interaction (a conversation turn) with its time."""

    content: str
    """The interaction's text (c_i)."""
    timestamp: str = ""
    """When it happened (t_i), verbatim (LoCoMo: the session's date and time)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Where it came from (speaker, session, turn index); kept with the note, never shown to the LLM."""


@dataclass
class Note:
    """One memory note. ``embedding`` lives in the vector index on disk, not in notes.jsonl."""

    id: str
    """Stable id, ``n<seq>``; what links and the LLM's neighbour references name."""
    seq: int
    """Integer id of the note's vector in the index (and its insertion order)."""
    content: str
    timestamp: str
    keywords: list[str]
    tags: list[str]
    context: str
    links: list[str] = field(default_factory=list)
    """Ids of linked notes (L_i), in the order they were linked."""
    meta: dict[str, Any] = field(default_factory=dict)
    updated_op: int = 0
    """The add operation that last changed this note's text (to re-embed after a crash)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Earlier context/tags replaced by evolution, with the id of the note that triggered it."""
    fallback: bool = False
    """True when keywords/tags/context came from the fallback because the LLM's JSON failed."""
    embedding: np.ndarray | None = field(default=None, repr=False, compare=False)
    """e_i, L2-normalised (float32)."""

    def embedding_text(self) -> str:
        """Paper eq. 3: the encoder reads content, keywords, tags and context together."""
        return " ".join(
            part for part in (self.content, ", ".join(self.keywords), ", ".join(self.tags), self.context) if part
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("embedding")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Note:
        known = {k: d[k] for k in ("id", "seq", "content", "timestamp", "keywords", "tags", "context", "links",
                                   "meta", "updated_op", "history", "fallback") if k in d}
        return cls(**known)

    def render(self, fields: Sequence[str]) -> str:
        """One line for a prompt, e.g. ``time: 8 May 2023 | content: ... | keywords: a, b``."""
        names = {"timestamp": "time"}
        parts = []
        for f in fields:
            v = getattr(self, f)
            if isinstance(v, list):
                v = ", ".join(v)
            if v:
                parts.append(f"{names.get(f, f)}: {v}")
        return " | ".join(parts)


def note_id(seq: int) -> str:
    return f"n{seq}"
