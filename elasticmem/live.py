"""Use a trained memory in an agent: a checkpoint whose bank grows while it answers.

    from elasticmem.live import LiveMemory
    mem = LiveMemory.load("runs/train/quickstart/final", bank="runs/live/bank")
    mem.add("alice", [{"role": "user", "content": "I adopted a cat named Miso."},
                      {"role": "assistant", "content": "Congratulations!"}])
    answer = mem.ask("alice", "What is my cat called?", max_new_tokens=16)
    print(answer.text, [(m.score, m.budget, m.text) for m in answer.memories])

``add`` remembers one session of turns in a memory group (a user, a conversation, an agent's
task), chunked as the data pipeline chunks histories and encoded into the bank by the frozen
base model: it is on disk (``elasticmem.bank.append``) and retrievable by the next ``ask``.
``ask`` answers greedily from the group's memories only: the model's control token, top-Z
search restricted to the group, the budget policy and the projector, as in evaluation
(``ElasticMemSystem``); ``ask_many`` answers many questions in batched forward passes.
``system="text_rag"`` / ``"no_memory"`` answer from the same bank as text or without memory
(the baselines of ``evaluate.py``). The HTTP server (``python -m elasticmem.serve``) serves one
``LiveMemory``; a bank folder may also be appended to by other processes (``refresh``).

``forget`` deletes one memory, a session or a whole group: no later ask or search sees it, and
(compacted at once by default) no file of the bank keeps its text or cached states.

A ``LiveMemory`` may be called from several threads: calls run one at a time (one model).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from elasticmem.data.schema import Example, Turn

MAX_TURN_CHARS = 20_000
"""Default longest turn ``add`` accepts (a chunk is cut at ``chunking.max_tokens`` anyway)."""


@dataclass
class AskRequest:
    group: str
    """The memory group to answer from (and only from)."""
    question: str
    choices: list[str] | None = None
    """Options of a multiple-choice question (answered with a letter); None = free form."""
    max_new_tokens: int | None = None
    """Longest answer in tokens; None = the checkpoint's ``memory.max_new_tokens``."""


@dataclass
class Memory:
    """One memory put in front of the reasoner for an answer."""

    rank: int
    row: int
    """Its bank row."""
    group: str
    score: float
    """Cosine similarity of the query state and the memory's key."""
    budget: int | None
    """Latent tokens the budget policy gave it (None for text memories)."""
    tokens: int
    """Tokens it added to the reasoner's input."""
    text: str


@dataclass
class Answer:
    group: str
    question: str
    text: str
    memories: list[Memory]
    prompt_tokens: int
    """Input text tokens (question, options, template), memories excluded."""
    memory_tokens: int
    generated_tokens: int
    total_tokens: int
    """#Tok: prompt + memory + generated."""
    latency: dict[str, float] = field(default_factory=dict)
    """Seconds: ``retrieval``, ``policy``, ``generation`` (a batch's time shared evenly) and
    ``total`` (the wall time of the batched call that answered it)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class AddResult:
    group: str
    added: int
    """Chunks added to the bank."""
    skipped: int
    """Chunks left out because the group already held their text (a retried add adds nothing)."""
    rows: list[int] = field(default_factory=list)
    """The bank rows of the added chunks."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Forgotten:
    group: str
    deleted: int
    """Memories (bank rows) deleted."""
    rows: list[int] = field(default_factory=list)
    """Their row ids (as ``chunks`` listed them)."""
    purged: bool = False
    """Whether their text and cached states are gone from the bank's files already (compacted)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _turn(t: Turn | dict, max_chars: int) -> Turn:
    if isinstance(t, dict):
        unknown = set(t) - {"role", "content", "date", "speaker"}
        if unknown:
            raise ValueError(f"a turn has keys role, content, date, speaker; got also {sorted(unknown)}")
        if not isinstance(t.get("role"), str) or not isinstance(t.get("content"), str):
            raise ValueError("a turn needs a string 'role' and a string 'content'")
        t = Turn(t["role"], t["content"], t.get("date"), t.get("speaker"))
    if not t.role.strip() or not t.content.strip():
        raise ValueError("a turn needs a non-empty role and non-empty content")
    if len(t.content) > max_chars:
        raise ValueError(f"a turn has {len(t.content)} characters; the limit is {max_chars}")
    return t


def _check_group(group: Any) -> str:
    if not isinstance(group, str) or not group.strip() or len(group) > 256:
        raise ValueError(f"a memory group is a non-empty string of at most 256 characters, got {group!r}")
    return group


class LiveMemory:
    """A trained ElasticMem (or a baseline on its code path) over a bank it can append to."""

    def __init__(self, model, system: str = "elasticmem", batch_size: int = 8, max_turn_chars: int = MAX_TURN_CHARS,
                 encode_batch_size: int = 16, answerer=None):
        """``model``: an ``ElasticMem`` in eval mode; ``batch_size``: questions per forward pass;
        ``answerer``: the ``ElasticMemSystem`` over it, when the caller has one (``load``)."""
        from elasticmem.systems import ElasticMemSystem

        self.model = model
        self.system = system
        self.batch_size = batch_size
        self.max_turn_chars = max_turn_chars
        self.encode_batch_size = encode_batch_size
        self._answerer = answerer or ElasticMemSystem(model, system)
        self._lock = threading.RLock()
        self._asked = 0

    @classmethod
    def load(cls, checkpoint: str | Path | None = None, bank: str | Path | None = None,
             config: str | Path | None = None, overrides: Sequence[str] = (), system: str = "elasticmem",
             device: str | None = None, batch_size: int = 8, max_turn_chars: int = MAX_TURN_CHARS
             ) -> "LiveMemory":
        """Load a checkpoint (``train.output_dir/final`` or a ``checkpoints/step_*`` folder; None =
        untrained parts) on its base model, with the bank at ``bank`` (default: the config's
        ``bank.dir``), created empty when the folder holds none.

        The settings come from ``config`` (a YAML preset), else the ``config.yaml`` saved with the
        checkpoint (in it or in its run folder), then ``overrides`` (``key=value``).
        ``system``: 'elasticmem', or the baselines 'text_rag' / 'no_memory' on the same bank;
        ``batch_size``: questions per forward pass; ``max_turn_chars``: the longest turn ``add`` takes.
        """
        import torch

        from elasticmem.config import Config
        from elasticmem.systems import SYSTEM_MEMORY, build_system
        from elasticmem.utils.configuration import ConfigError
        from elasticmem.utils.configuration import load as load_config

        if system not in SYSTEM_MEMORY:
            raise ValueError(f"system must be one of {sorted(SYSTEM_MEMORY)} (answers from this bank), got {system!r}")
        if config is None and checkpoint is not None:
            ck = Path(checkpoint)
            config = next((p for p in (ck / "config.yaml", ck.parent / "config.yaml") if p.is_file()), None)
            if config is None:
                raise ConfigError(f"no config.yaml in {ck} or {ck.parent}: give the training config (config=...)")
        overrides = list(overrides)
        cfg = load_config(Config, config, overrides)
        cfg.eval.system = system
        cfg.eval.checkpoint = str(checkpoint) if checkpoint is not None else None
        if bank is not None:
            cfg.bank.dir = str(bank)
        dev = torch.device(device or (cfg.backbone.device if cfg.backbone.device != "auto" else
                                      ("cuda" if torch.cuda.is_available() else "cpu")))
        answerer = build_system(cfg, overrides, device=dev, create_bank=True)
        return cls(answerer.model, system, batch_size, max_turn_chars, answerer=answerer)

    # ------------------------------------------------------------------ memory

    @property
    def bank(self):
        return self.model.bank

    def add(self, group: str, turns: Sequence[Turn | dict]) -> AddResult:
        """Remember one new session of ``group`` (see ``add_many``)."""
        return self.add_many([(group, turns)])[0]

    def add_many(self, items: Sequence[tuple[str, Sequence[Turn | dict]]]) -> list[AddResult]:
        """Remember sessions, one ``(group, turns)`` each, in one append (one shard on disk): each
        is the next session of its group. One result per item; a chunk whose text its group holds
        already (an earlier add, or an earlier item of this call) is skipped."""
        from elasticmem.bank.append import SessionAdd

        adds = []
        for group, turns in items:
            if isinstance(turns, (str, bytes)) or not len(turns):
                raise ValueError("turns must be a non-empty list of turns")
            adds.append(SessionAdd(_check_group(group), [_turn(t, self.max_turn_chars) for t in turns]))
        with self._lock:
            res = self.model.remember(adds, batch_size=self.encode_batch_size)
        return [AddResult(a.group, len(rows), skipped, rows) for a, (rows, skipped) in zip(adds, res.per_item)]

    def chunks(self, group: str) -> list[dict[str, Any]]:
        """The group's memories ``{row, group, text, session, turns, n_tokens}`` in the order added
        ([] for a group with none)."""
        with self._lock:
            self._refresh_if_changed()
            bank = self.model.bank
            if group not in bank.groups:
                return []
            chunks = bank.chunks()
            return [dict(chunks[r]) for r in bank.group_row_ids(group).tolist()]

    def forget(self, group: str, *, row: int | None = None, session: int | None = None,
               purge: bool = True) -> Forgotten:
        """Delete memories of ``group``: the one with bank row id ``row`` (as ``chunks`` lists it),
        every memory of session ``session``, or (neither given) the whole group. No later search or
        ask sees them (``elasticmem.bank.forget``: one journal record, atomic across a crash); with
        ``purge`` (the default) the bank is compacted at once so that no file keeps their text or
        cached states (it rewrites the shards holding them). Survivors keep their row ids. Raises
        ``MemoryNotFound`` (a ``LookupError``) when the group holds no such memory; nothing is
        deleted then."""
        from elasticmem.bank.forget import MemoryNotFound, forget_rows

        _check_group(group)
        if row is not None and session is not None:
            raise ValueError("forget one memory (row) or one session, not both")
        with self._lock:
            self._refresh_if_changed()
            bank = self.model.bank
            if group not in bank.groups:
                raise MemoryNotFound(f"memory group {group!r} holds no memory")
            mine = bank.group_row_ids(group).tolist()
            if row is not None:
                if int(row) not in set(mine):
                    raise MemoryNotFound(f"memory group {group!r} holds no memory with row id {row}")
                rows = [int(row)]
            elif session is not None:
                chunks = bank.chunks()
                rows = [r for r in mine if chunks[r].get("session") == int(session)]
                if not rows:
                    raise MemoryNotFound(f"memory group {group!r} holds no memory of session {session}")
            else:
                rows = mine
            res = forget_rows(bank, rows, purge=purge, fingerprint=bank.fingerprint)
            self.model.refresh_bank(res.bank)
        return Forgotten(group, res.deleted, res.rows.get(group, []), res.purged)

    def groups(self) -> list[str]:
        with self._lock:
            return sorted(self.model.bank.groups)

    def refresh(self) -> bool:
        """Pick up rows other processes appended to the bank folder; True when there were any.
        ``ask`` does it by itself (a stat of the manifest and a read of its journal's tail)."""
        with self._lock:
            return self.model.refresh_bank()

    def preemptible(self) -> bool:
        """Whether other requests may run between two decoding steps of the answers being generated
        now (the server's worker asks, ``generation.step_gate``): not while the frozen base model
        generates (adapter off), since a nested request's passes toggle the adapter as they go and
        leave it on. Every other change a request makes to the model (its settings, the bank it
        refreshes or appends to) is restored or only added to by the time it returns."""
        return not getattr(self.model, "_adapter_disabled", False)

    def _refresh_if_changed(self) -> None:
        """Another process (build_bank.py --append, a second server) may have appended: its
        commits are the journal's new records, so reading them costs what they hold, not the bank."""
        self.refresh()

    # ------------------------------------------------------------------ answers

    def ask(self, group: str, question: str, choices: Sequence[str] | None = None,
            max_new_tokens: int | None = None) -> Answer:
        """Answer ``question`` greedily from ``group``'s memories (none yet: from none)."""
        return self.ask_many([AskRequest(group, question, list(choices) if choices else None, max_new_tokens)])[0]

    def ask_many(self, requests: Sequence[AskRequest]) -> list[Answer]:
        """Answers in order, computed in batches of ``batch_size`` questions that share a group
        state (known / not yet in the bank) and ``max_new_tokens``; every question retrieves only
        from its own group."""
        for r in requests:
            _check_group(r.group)
            if not isinstance(r.question, str) or not r.question.strip():
                raise ValueError("a question must be a non-empty string")
            if r.choices is not None and (len(r.choices) < 2 or len(r.choices) > 26):
                raise ValueError(f"a multiple-choice question needs 2 to 26 choices, got {len(r.choices)}")
            if r.max_new_tokens is not None and not 1 <= r.max_new_tokens <= 4096:
                raise ValueError(f"max_new_tokens must be in 1..4096, got {r.max_new_tokens}")
        out: list[Answer | None] = [None] * len(requests)
        with self._lock:
            self._refresh_if_changed()
            model = self.model
            known = set(model.bank.groups)
            batches: dict[tuple[bool, int], list[int]] = {}
            for i, r in enumerate(requests):
                n = r.max_new_tokens or model.cfg.max_new_tokens
                batches.setdefault((r.group in known, n), []).append(i)
            for (is_known, n), idx in batches.items():
                for a in range(0, len(idx), self.batch_size):
                    part = idx[a:a + self.batch_size]
                    for i, ans in zip(part, self._answer([requests[i] for i in part], is_known, n)):
                        out[i] = ans
        return out  # type: ignore[return-value]

    def _answer(self, requests: list[AskRequest], known: bool, max_new_tokens: int) -> list[Answer]:
        model = self.model
        examples = []
        for r in requests:
            self._asked += 1
            mc = bool(r.choices)
            examples.append(Example(
                id=f"live-{self._asked}", source="live", question=r.question, choices=list(r.choices or []),
                answer_index=0 if mc else -1, question_type="live", history=[], group=r.group,
                answer_text=None if mc else ""))
        chunks = model.bank.chunks()  # the rows this batch reads, whatever runs between its steps
        saved = model.cfg
        # a group with no memory yet is answered without memory, as the no-memory system does
        model.cfg = dataclasses.replace(saved, max_new_tokens=max_new_tokens, top_z=saved.top_z if known else 0)
        try:
            t0 = time.perf_counter()
            preds = self._answerer.predict(examples)
            total = time.perf_counter() - t0
        finally:
            model.cfg = saved
        answers = []
        for r, p in zip(requests, preds):
            mems = []
            for m in p.retrieved:
                row = int(m.ref.removeprefix("row:"))
                mems.append(Memory(m.rank, row, chunks[row]["group"], m.score, m.budget, m.tokens, m.text))
            answers.append(Answer(r.group, r.question, p.text, mems, p.prompt_tokens, p.memory_tokens,
                                  p.generated_tokens, p.total_tokens, {**p.latency, "total": total}))
        return answers


__all__ = ["AddResult", "Answer", "AskRequest", "Forgotten", "LiveMemory", "Memory"]
