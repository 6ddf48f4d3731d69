"""A-Mem's memory: note construction, link generation, memory evolution, retrieval (paper 3.1-3.4).

Adding an item (``AgenticMemory.add`` / ``build_memories``):

1. **Note construction** (3.1): one LLM call gives keywords, tags and a context sentence (JSON,
   validated); the note is embedded from content + keywords + tags + context (eq. 3).
2. **Link generation + memory evolution** (3.2, 3.3): the ``evolution_k`` nearest notes by cosine
   (eqs. 4-5) and the new note go to one LLM decision: ``should_evolve``; ``strengthen`` = links
   from the new note to the named neighbours (by id) and its updated tags; ``update_neighbor`` =
   new context and tags for each neighbour, in the listed order. Every note whose text changed
   (the new note after a tag update, each evolved neighbour) is re-embedded at once, so the next
   add and every retrieval see the new text. Ablations: ``wo_me`` asks for links only; ``wo_lg_me``
   makes no decision call.
3. The add is journaled (``store.NoteStore``): all of it or nothing survives a crash.

Defects of the public implementation this avoids: neighbours were referred to by their rank and
updated by indexing the insertion-ordered note list with it (the wrong notes evolved); evolved
notes kept their old vectors in the search index; links were list positions.

Retrieval (3.4): top ``retrieve_k`` notes by cosine with the query, then notes linked from them in
rank and link order, skipping duplicates, at most ``max_linked`` more: a question sees at most
``retrieve_k + max_linked`` notes.

Note construction does not depend on the memory's state, so ``build_memories`` batches it over a
window of items (and over several memories); decisions are sequential within a memory (each sees
the notes before it) and batched across memories built in lockstep.
"""

from __future__ import annotations

import copy
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from elasticmem.baselines.amem import prompts
from elasticmem.baselines.amem.config import AMemConfig
from elasticmem.baselines.amem.embed import Embedder
from elasticmem.llm.client import CallResult, GenRequest, StructuredLLM
from elasticmem.baselines.amem.notes import MemoryItem, Note, note_id
from elasticmem.baselines.amem.store import NoteStore, StoreError, VectorIndex

logger = logging.getLogger(__name__)

_STOPWORDS = {
    "a", "about", "after", "again", "all", "also", "am", "an", "and", "any", "are", "as", "at", "be",
    "because", "been", "before", "being", "but", "by", "can", "could", "did", "do", "does", "doing", "for",
    "from", "had", "has", "have", "having", "he", "her", "here", "hers", "him", "his", "how", "i", "if",
    "in", "into", "is", "it", "its", "just", "like", "me", "more", "my", "no", "not", "now", "of", "on",
    "or", "our", "out", "over", "really", "so", "some", "such", "than", "that", "the", "their", "them",
    "then", "there", "these", "they", "this", "those", "to", "too", "up", "very", "was", "we", "were",
    "what", "when", "where", "which", "while", "who", "why", "will", "with", "would", "yeah", "yes", "you",
    "your",
}


@dataclass
class AddReport:
    """What one add did and cost."""

    note_id: str
    neighbours: list[str]
    """Ids shown to the decision, nearest first."""
    links: list[str]
    """Links the new note got."""
    evolved: list[str]
    """Neighbours whose context or tags changed."""
    llm_calls: int
    prompt_tokens: int
    completion_tokens: int
    fallbacks: int
    """LLM calls of this add that ended on their fallback."""
    seconds: float
    """Wall time of the add (batched steps shared evenly among the notes in the batch)."""

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class MemoryStats:
    """A memory's construction counters over every run that built it (a reopened store restores
    its earlier runs' from the journal)."""

    notes_added: int = 0
    seconds: float = 0.0
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    fallbacks: int = 0
    links_added: int = 0
    neighbours_evolved: int = 0
    decisions: int = 0
    """Adds that made a link/evolution decision (every add after the first, unless wo_lg_me)."""

    @staticmethod
    def cost(r: AddReport, decided: bool) -> dict[str, float]:
        """One add's increment of every counter: what its journal commit keeps."""
        return {"notes_added": 1, "seconds": r.seconds, "llm_calls": r.llm_calls, "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens, "fallbacks": r.fallbacks, "links_added": len(r.links),
                "neighbours_evolved": len(r.evolved), "decisions": int(decided)}

    def add(self, cost: dict[str, float]) -> None:
        """Add a :meth:`cost` (or a journal's sum of them) to the counters."""
        for k, v in cost.items():
            if k in self.__dataclass_fields__:
                cur = getattr(self, k)
                setattr(self, k, type(cur)(cur + v))

    def counters(self) -> dict[str, float]:
        return asdict(self)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        n = max(1, self.notes_added)
        d["tokens_per_note"] = (self.prompt_tokens + self.completion_tokens) / n
        d["seconds_per_note"] = self.seconds / n
        return d


@dataclass
class RetrievedNote:
    note: Note
    score: float
    """Cosine similarity of the query and the note."""
    via: str
    """'cosine' (top-k) or 'link' (followed from a retrieved note)."""
    source: str | None = None
    """For 'link': the id of the retrieved note that links to it."""


def fallback_note_fields(content: str, cfg: AMemConfig) -> dict[str, Any]:
    """Keywords/context/tags without an LLM, when its JSON keeps failing: salient words of the
    content and its first characters. Marked on the note (``fallback``) and counted."""
    body = content.split(":", 1)[1] if ":" in content[:40] else content
    words = []
    for w in re.findall(r"[A-Za-z][A-Za-z'-]{2,}", body):
        if w.lower() not in _STOPWORDS and w.lower() not in (x.lower() for x in words):
            words.append(w[: cfg.max_item_chars])
    return {"keywords": words[: cfg.max_keywords] or ["conversation"],
            "context": body.strip()[: cfg.max_context_chars] or content[: cfg.max_context_chars],
            "tags": ["conversation"]}


def _no_decision() -> dict[str, Any]:
    return {"should_evolve": False, "actions": [], "suggested_connections": [], "tags_to_update": [],
            "new_context_neighborhood": [], "new_tags_neighborhood": []}


class AgenticMemory:
    """One A-Mem memory (one conversation), in RAM or persisted in a folder."""

    def __init__(self, cfg: AMemConfig, llm: StructuredLLM, embedder: Embedder, store: NoteStore | None = None,
                 manifest: dict[str, Any] | None = None):
        self.cfg = cfg
        self.llm = llm
        self.embedder = embedder
        self.store = store
        self.manifest = manifest or {}
        self.notes: dict[str, Note] = {}
        self.by_seq: dict[int, str] = {}
        self.index = VectorIndex(embedder.dim)
        self.op = 0
        self.next_seq = 0
        self.stats = MemoryStats()
        self._since_snapshot = 0

    # ------------------------------------------------------------------ opening and saving

    @staticmethod
    def build_info(cfg: AMemConfig, llm: StructuredLLM) -> dict[str, Any]:
        """What a persisted memory must agree on to be reused or resumed."""
        return {"ablation": cfg.ablation, "llm": llm.backend.name, "evolution_k": cfg.evolution_k}

    @classmethod
    def open(cls, path: str | Path, cfg: AMemConfig, llm: StructuredLLM, embedder: Embedder) -> AgenticMemory:
        """Load the memory in ``path``, or create an empty one there."""
        store = NoteStore(path, fsync=cfg.fsync)
        build = cls.build_info(cfg, llm)
        if not store.exists():
            manifest = store.create(embedder.name, embedder.dim, build)
            return cls(cfg, llm, embedder, store, manifest)
        manifest = store.read_manifest()
        if manifest["embedder"] != embedder.name or manifest["dim"] != embedder.dim:
            raise StoreError(f"{path} was built with encoder {manifest['embedder']} (dim {manifest['dim']}), "
                             f"not {embedder.name} (dim {embedder.dim}); use another store_dir")
        if manifest.get("build") != build:
            raise StoreError(f"{path} was built with {manifest.get('build')}, this run uses {build}; "
                             "use another store_dir to keep both")
        mem = cls(cfg, llm, embedder, store, manifest)
        notes, op, cost = store.replay()
        mem.stats.add(cost)  # earlier runs' construction cost: a resumed build reports all of it
        mem.notes = dict(sorted(notes.items(), key=lambda kv: kv[1].seq))
        mem.by_seq = {n.seq: n.id for n in mem.notes.values()}
        mem.op = op
        mem.next_seq = max((n.seq for n in mem.notes.values()), default=-1) + 1
        index = store.load_vectors(embedder.dim)
        if index is not None:
            mem.index = index
        present = mem.index.ids()
        mem.index.remove(present - set(mem.by_seq))  # vectors of adds that never committed
        stale = [n for n in mem.notes.values()
                 if n.seq not in present or n.updated_op > int(manifest.get("vectors_op", 0))]
        if stale:
            logger.info("%s: re-embedding %d notes changed after the last vector snapshot", path, len(stale))
            mem._embed(stale)
        for n in mem.notes.values():
            if n.embedding is None:
                n.embedding = mem.index.get(n.seq)
        return mem

    def save(self) -> None:
        """Snapshot the vectors and compact the journal (no-op for an in-RAM memory)."""
        if self.store is not None:
            self.store.snapshot(self.notes.values(), self.index, self.op, self.manifest, self.stats.counters())
            self._since_snapshot = 0

    @property
    def notes_unmeasured(self) -> int:
        """Notes whose construction cost is not in ``stats``: those of a journal written before
        commits kept their cost."""
        return max(0, len(self.notes) - self.stats.notes_added)

    def __len__(self) -> int:
        return len(self.notes)

    def get(self, nid: str) -> Note:
        return self.notes[nid]

    def items_meta(self, key: str) -> set[Any]:
        """Values of ``note.meta[key]`` over the notes (e.g. the history turns already added)."""
        return {n.meta.get(key) for n in self.notes.values() if key in n.meta}

    # ------------------------------------------------------------------ adding

    def add(self, content: str, timestamp: str = "", meta: dict[str, Any] | None = None) -> AddReport:
        return self.add_many([MemoryItem(content, timestamp, meta or {})])[0]

    def add_many(self, items: Sequence[MemoryItem]) -> list[AddReport]:
        return build_memories([self], [list(items)])[0]

    def _embed(self, notes: Sequence[Note]) -> None:
        if not notes:
            return
        vecs = self.embedder.encode([n.embedding_text() for n in notes])
        for n, v in zip(notes, vecs):
            n.embedding = v
        self.index.upsert([n.seq for n in notes], vecs)

    def embed_new(self, note: Note) -> None:
        """Embed a note that is not in the index yet (its vector enters the index at commit)."""
        note.embedding = self.embedder.encode([note.embedding_text()])[0]

    def note_request(self, item: MemoryItem) -> GenRequest:
        return GenRequest(prompts.note_messages(item.content, item.timestamp), self.cfg.max_new_tokens,
                          prompts.note_schema(self.cfg), kind="note")

    def new_note(self, item: MemoryItem, fields: dict[str, Any], fallback: bool) -> Note:
        seq = self.next_seq
        self.next_seq += 1
        return Note(id=note_id(seq), seq=seq, content=item.content, timestamp=item.timestamp,
                    keywords=list(fields["keywords"]), tags=list(fields["tags"]), context=fields["context"],
                    meta=dict(item.meta), fallback=fallback)

    def neighbours(self, note: Note) -> list[Note]:
        """The ``evolution_k`` nearest notes to a new (not yet added) note, nearest first."""
        if note.embedding is None:
            raise ValueError("embed the note first")
        hits = self.index.search(note.embedding[None, :], self.cfg.evolution_k, exclude={note.seq})[0]
        return [self.notes[self.by_seq[s]] for s, _ in hits]

    def decision_request(self, note: Note, neighbours: Sequence[Note]) -> GenRequest | None:
        if not self.cfg.link_generation or not neighbours:
            return None
        return GenRequest(prompts.decision_messages(self.cfg, note, neighbours), self.cfg.max_new_tokens,
                          prompts.decision_schema(self.cfg, [n.id for n in neighbours], note.id), kind="decision")

    def commit(self, note: Note, neighbours: Sequence[Note], decision: CallResult | None,
               calls: Sequence[CallResult] = (), seconds: float = 0.0) -> AddReport:
        """Apply the decision, re-embed what changed, journal the add with its cost, insert the note.

        ``calls`` are the add's LLM calls and ``seconds`` its time before this step; the report
        counts them and is added to ``stats`` once the add is journaled.
        """
        t0 = time.perf_counter()
        op = self.op + 1
        note.updated_op = op
        tags_before = list(note.tags)
        links: list[str] = []
        evolved: list[Note] = []
        value = decision.value if decision is not None else None
        if value is not None and value.get("should_evolve"):
            actions = set(value.get("actions", []))
            allowed = {n.id for n in neighbours}
            if "strengthen" in actions and self.cfg.link_generation:
                for nid in value["suggested_connections"]:
                    if nid in allowed and nid not in note.links:  # the schema already restricts ids
                        note.links.append(nid)
                        links.append(nid)
                if value["tags_to_update"]:
                    note.tags = list(value["tags_to_update"])
            if "update_neighbor" in actions and self.cfg.memory_evolution:
                contexts = value["new_context_neighborhood"]
                tag_lists = value["new_tags_neighborhood"]
                if len(contexts) != len(neighbours) or len(tag_lists) != len(neighbours):
                    raise ValueError("decision lists do not match the neighbours (the schema should prevent this)")
                for nb, ctx, tags in zip(neighbours, contexts, tag_lists):
                    new_tags = list(tags) or list(nb.tags)  # an empty list leaves the tags as they are
                    if ctx == nb.context and new_tags == nb.tags:
                        continue
                    # Work on a copy: the stored note changes only once the add is journaled.
                    upd = copy.deepcopy(nb)
                    upd.history.append({"op": op, "by": note.id, "context": nb.context, "tags": list(nb.tags)})
                    upd.context, upd.tags, upd.updated_op = ctx, new_tags, op
                    evolved.append(upd)
        # Re-embed now: the next add's neighbour search and every retrieval must see the new text.
        changed = [note] if note.embedding is None or note.tags != tags_before else []
        vecs = self.embedder.encode([n.embedding_text() for n in changed + evolved]) if changed or evolved else []
        for n, v in zip(changed + evolved, vecs):
            n.embedding = v
        report = AddReport(
            note_id=note.id, neighbours=[n.id for n in neighbours], links=links, evolved=[n.id for n in evolved],
            llm_calls=len(calls), prompt_tokens=sum(c.prompt_tokens for c in calls),
            completion_tokens=sum(c.completion_tokens for c in calls), fallbacks=sum(int(c.fallback) for c in calls),
            seconds=seconds + (time.perf_counter() - t0))
        cost = MemoryStats.cost(report, decided=decision is not None)
        if self.store is not None:
            self.store.append(op, [note, *evolved], cost)  # raises -> nothing below happens, memory unchanged
        self.stats.add(cost)
        self.op = op
        for upd in evolved:
            self.notes[upd.id] = upd
        self.notes[note.id] = note
        self.by_seq[note.seq] = note.id
        self.index.upsert([note.seq] + [n.seq for n in evolved], np.stack([note.embedding] + [n.embedding for n in evolved]))
        self._since_snapshot += 1
        if self.store is not None and self._since_snapshot >= self.cfg.save_every:
            self.save()
        return report

    # ------------------------------------------------------------------ retrieval

    def retrieve(self, query: str, k: int | None = None, max_linked: int | None = None) -> list[RetrievedNote]:
        return self.retrieve_many([query], k, max_linked)[0]

    def retrieve_many(self, queries: Sequence[str], k: int | None = None,
                      max_linked: int | None = None) -> list[list[RetrievedNote]]:
        """Per query: top-k notes by cosine, then notes linked from them (rank, then link order)."""
        k = self.cfg.retrieve_k if k is None else k
        max_linked = self.cfg.max_linked if max_linked is None else max_linked
        if not queries:
            return []
        qv = self.embedder.encode(list(queries))
        out = []
        for q, hits in zip(qv, self.index.search(qv, k)):
            got = [RetrievedNote(self.notes[self.by_seq[s]], score, "cosine") for s, score in hits]
            seen = {r.note.id for r in got}
            budget = max_linked
            for r in list(got):
                for lid in r.note.links:
                    if budget <= 0:
                        break
                    if lid in seen or lid not in self.notes:
                        continue
                    linked = self.notes[lid]
                    score = float(np.dot(q, linked.embedding)) if linked.embedding is not None else 0.0
                    got.append(RetrievedNote(linked, score, "link", r.note.id))
                    seen.add(lid)
                    budget -= 1
            out.append(got)
        return out


def build_memories(memories: Sequence[AgenticMemory], items: Sequence[Sequence[MemoryItem]],
                   window: int | None = None, progress: bool = False) -> list[list[AddReport]]:
    """Add ``items[i]`` to ``memories[i]`` for every i, batching LLM calls across memories.

    Per window of ``window`` items per memory: one batched note-construction call for all of them,
    then, item by item, one batched decision call over the memories (each memory's decision sees
    all its earlier notes). All memories must share one LLM and one encoder.
    """
    if len(memories) != len(items):
        raise ValueError("one list of items per memory")
    if not memories:
        return []
    llm = memories[0].llm
    cfg = memories[0].cfg
    window = window or max(1, getattr(llm.backend, "batch_size", None) or getattr(
        getattr(llm.backend, "cfg", None), "batch_size", 8))
    reports: list[list[AddReport]] = [[] for _ in memories]
    longest = max((len(x) for x in items), default=0)
    t_start = time.perf_counter()
    for w0 in range(0, longest, window):
        # 1. Note construction: independent of memory state, so batched over the window.
        slots = [(m, j) for m in range(len(memories)) for j in range(w0, min(w0 + window, len(items[m])))]
        t0 = time.perf_counter()
        reqs = [memories[m].note_request(items[m][j]) for m, j in slots]
        fbs = [(lambda c=items[m][j].content: fallback_note_fields(c, cfg)) for m, j in slots]
        results = llm.json(reqs, fbs)
        built: dict[tuple[int, int], tuple[Note, CallResult]] = {}
        for (m, j), res in zip(slots, results):
            built[(m, j)] = (memories[m].new_note(items[m][j], res.value, res.fallback), res)
        per_note_build = (time.perf_counter() - t0) / max(1, len(slots))
        # 2. Decisions, one item position at a time, batched across memories.
        for j in range(w0, min(w0 + window, longest)):
            active = [m for m in range(len(memories)) if j < len(items[m])]
            t1 = time.perf_counter()
            pending: list[tuple[int, Note, list[Note], GenRequest | None]] = []
            for m in active:
                mem = memories[m]
                note, _ = built[(m, j)]
                mem.embed_new(note)
                nbs = mem.neighbours(note) if mem.cfg.link_generation else []
                pending.append((m, note, nbs, mem.decision_request(note, nbs)))
            asked = [p for p in pending if p[3] is not None]
            answers = llm.json([p[3] for p in asked], [_no_decision] * len(asked)) if asked else []
            by_m = {p[0]: a for p, a in zip(asked, answers)}
            per_note_decide = (time.perf_counter() - t1) / max(1, len(active))
            for m, note, nbs, req in pending:
                decision = by_m.get(m)
                calls = [built[(m, j)][1]] + ([decision] if decision is not None else [])
                reports[m].append(memories[m].commit(note, nbs, decision, calls, per_note_build + per_note_decide))
            if progress:
                done = sum(len(r) for r in reports)
                total = sum(len(x) for x in items)
                el = time.perf_counter() - t_start
                logger.info("A-Mem build: %d/%d notes, %.1f s/note", done, total, el / max(1, done))
    for mem in memories:
        mem.save()
    return reports


def expand_queries(llm: StructuredLLM, cfg: AMemConfig, questions: Sequence[str]) -> tuple[list[str], list[CallResult]]:
    """Question + LLM keywords for each question (the optional query expansion of section 3.4)."""
    reqs = [GenRequest(prompts.expansion_messages(q), cfg.max_new_tokens, prompts.expansion_schema(cfg),
                       kind="expansion") for q in questions]
    res = llm.json(reqs, [lambda: {"keywords": []}] * len(reqs))
    return [q + (" " + " ".join(r.value["keywords"]) if r.value["keywords"] else "") for q, r in zip(questions, res)], res
