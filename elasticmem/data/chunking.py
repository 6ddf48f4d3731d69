"""Split a history into memory chunks and tokenize them with a token cap.

Reference-code chunking (DESIGN.md section 2): one chunk per user+assistant
turn pair inside a session, ``"User:\\n{u}\\n\\nAssistant:\\n{a}"``; any turn
that is not part of such a pair is a chunk of its own. Where the source names
the speaker (LoCoMo) the name replaces the role label, and where it dates the
turn the chunk starts with ``"[{date}]\\n"``. Pairs never cross sessions. A turn whose role is
``memory`` (a memory written as such, e.g. an ALFWorld skill card) is its own chunk and is
encoded as its content alone, without a role label.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal, Sequence

from elasticmem.data.schema import Turn


@dataclass(frozen=True)
class Chunk:
    group: str
    """The bank group (conversation or context id) this chunk belongs to."""
    text: str
    """The chunk text exactly as it is encoded."""
    session: int
    """Index of the session inside the history."""
    turns: tuple[int, ...]
    """Indices of the turns inside that session (one or two)."""


def _label(turn: Turn) -> str:
    return turn.speaker if turn.speaker else turn.role.capitalize()


def format_chunk(turns: Sequence[Turn]) -> str:
    """Render one or two turns as chunk text."""
    body = "\n\n".join(t.content if t.role == "memory" else f"{_label(t)}:\n{t.content}" for t in turns)
    date = turns[0].date
    return f"[{date}]\n{body}" if date else body


def chunk_history(history: Sequence[Sequence[Turn]], group: str) -> list[Chunk]:
    """Turn pairs (user then assistant) become one chunk; every other turn is its own chunk."""
    chunks: list[Chunk] = []
    for si, session in enumerate(history):
        i = 0
        while i < len(session):
            t = session[i]
            if t.role == "user" and i + 1 < len(session) and session[i + 1].role == "assistant":
                pair = (t, session[i + 1])
                chunks.append(Chunk(group, format_chunk(pair), si, (i, i + 1)))
                i += 2
            else:
                chunks.append(Chunk(group, format_chunk((t,)), si, (i,)))
                i += 1
    return chunks


def tokenize_chunks(
    texts: Sequence[str],
    tokenizer,
    max_tokens: int,
    truncation_side: Literal["left", "right"] = "right",
    add_special_tokens: bool = True,
) -> list[list[int]]:
    """Token ids per chunk, each capped at ``max_tokens``.

    ``truncation_side="right"`` keeps the start of a long chunk (HF default),
    ``"left"`` keeps its end. The tokenizer's own setting is restored after.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if truncation_side not in ("left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
    old = tokenizer.truncation_side
    tokenizer.truncation_side = truncation_side
    try:
        enc = tokenizer(
            list(texts),
            add_special_tokens=add_special_tokens,
            truncation=True,
            max_length=max_tokens,
        )["input_ids"]
    finally:
        tokenizer.truncation_side = old
    for i, ids in enumerate(enc):
        if not ids:
            raise ValueError(f"chunk {i} tokenizes to no tokens: {texts[i]!r}")
    return [list(ids) for ids in enc]


# The fingerprints a bank's manifest records per group (``groups_sha256``): data-layer functions,
# so that data validation can compare a history with a bank without importing the bank.


def chunks_fingerprint(texts: Sequence[str]) -> str:
    """sha256 (hex) of a group's chunk texts in row order: of ``json.dumps(texts, ensure_ascii=False)``
    in UTF-8, so it can be recomputed from ``chunks.jsonl`` alone."""
    return hashlib.sha256(json.dumps(list(texts), ensure_ascii=False).encode("utf-8")).hexdigest()


def history_fingerprint(history: Sequence[Sequence[Turn]]) -> str:
    """``chunks_fingerprint`` of the chunks ``chunk_history`` makes of ``history`` (no tokenizer needed)."""
    return chunks_fingerprint([c.text for c in chunk_history(history, "")])
