"""Streaming evaluation: memory built session by session while questions are asked.

``evaluate.py eval.stream=session`` evaluates an ElasticMem-path system (elasticmem, text_rag,
no_memory, full_context) the way an agent meets a conversation: each group's memory starts
empty and grows through the live append path (``elasticmem.bank.append``, the one
``LiveMemory.add`` uses), and each question is asked right after the session its evidence ends
in (``extra["evidence"]``'s last session; a question without evidence after the group's last
session), so it can only retrieve what had been said by then, the way A-Mem adds notes as a
conversation flows. ``eval.stream=all`` adds every session through the same path before asking:
its answers equal those from the offline bank (``tests/integration/test_streaming.py``).

The streamed bank lives in the variant's output folder (``stream_bank-<process>``): a
resumed evaluation appends nothing twice (appends skip known chunks). Should a crash leave a
group's memory ahead of a question still to be answered, the bank is rebuilt from empty.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Sequence

from elasticmem.bank.append import SessionAdd
from elasticmem.data.schema import Example
from elasticmem.eval.system import Prediction

STREAM_MODES = ("off", "session", "all")


def due_session(ex: Example, mode: str) -> int:
    """The last session of ``ex``'s history its group's memory holds when ``ex`` is asked."""
    last = len(ex.history) - 1
    if mode == "all":
        return last
    evidence = ex.extra.get("evidence") or []
    return min(last, max(int(s) for s, _ in evidence)) if evidence else last


def stream_order(examples: Sequence[Example], mode: str) -> list[Example]:
    """``examples`` in the order a stream asks them: by group (first appearance), then by due
    session (stable), so each group's memory only ever grows."""
    first = {g: i for i, g in enumerate(dict.fromkeys(ex.group for ex in examples))}
    return sorted(examples, key=lambda ex: (first[ex.group], due_session(ex, mode)))


class StreamingSystem:
    """A ``MemorySystem`` over an ``ElasticMemSystem`` whose model reads a bank it fills as asked.

    ``make_bank()`` must return an empty bank folder's fresh ``Bank`` (used again to rebuild)."""

    def __init__(self, system, mode: str, make_bank):
        if mode not in ("session", "all"):
            raise ValueError(f"eval.stream must be one of {STREAM_MODES}, got {mode!r}")
        self.system, self.mode, self.make_bank = system, mode, make_bank
        self.model = system.model
        self.name = system.name
        self._memo = None

    def identity(self) -> dict[str, Any]:
        ident = dict(self.system.identity())
        m = self.model.bank.manifest
        # the streamed bank grows during the run: what makes its rows is the encoder and settings
        ident["bank"] = {"stream": self.mode, **{k: m.get(k) for k in (
            "encoder", "hidden_size", "n_cache", "cache_dtype", "tokenization", "key", "content_layer")}}
        return ident

    def _held(self, group: str) -> int:
        """The last session of ``group`` the bank holds (-1: none)."""
        bank = self.model.bank
        if group not in bank.groups:
            return -1
        chunks = bank.chunks()
        return max(int(chunks[r]["session"]) for r in bank.group_row_ids(group).tolist())

    def _feed(self, batch: Sequence[Example], due: int) -> None:
        """Make every group of ``batch`` hold exactly its sessions 0..due (one append)."""
        if any(self._held(ex.group) > due for ex in batch):
            shutil.rmtree(self.model.bank.root)  # a crash left memory ahead of a question: start over
            self.model.refresh_bank(self.make_bank())
        items = []
        for ex in {ex.group: ex for ex in batch}.values():
            start = self._held(ex.group) + 1
            items += [SessionAdd(ex.group, ex.history[s], s) for s in range(start, due + 1) if ex.history[s]]
        if items:
            self.model.remember(items)

    def predict(self, examples: Sequence[Example]) -> list[Prediction]:
        out: dict[str, Prediction] = {}
        by_due: dict[int, list[Example]] = {}
        for ex in examples:
            by_due.setdefault(due_session(ex, self.mode), []).append(ex)
        for due in sorted(by_due):
            part = by_due[due]
            self._feed(part, due)
            out.update((p.id, p) for p in self.system.predict(part))
        return [out[ex.id] for ex in examples]


def stream_bank_dir(out: Path, rank: int) -> Path:
    """Where process ``rank`` of a streaming evaluation keeps its bank."""
    return Path(out) / f"stream_bank-{rank}"


__all__ = ["STREAM_MODES", "StreamingSystem", "due_session", "stream_bank_dir", "stream_order"]
