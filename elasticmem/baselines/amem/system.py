"""A-Mem behind the evaluation harness's ``MemorySystem`` interface.

``AMemSystem(cfg, backbone=None).predict(examples)`` builds (or loads, or resumes) one A-Mem per
``example.group`` from ``example.history`` (one note per turn, timestamped with the turn's date),
then answers every example with its retrieved notes in the prompt:

* multiple choice (``choices`` non-empty): options listed as ``(a) ...``, the answer is the
  letter (max ``mc_max_new_tokens`` tokens; parse it with ``data.rewards.parse_option_letter``);
* free form (``choices == []``): a short phrase, or ``cfg.not_answerable`` when the notes do not
  hold the answer (LoCoMo's adversarial questions expect exactly that behaviour).

Token accounting per ``Prediction``: ``prompt_tokens`` = the answer prompt without the notes
(template, question, options, chat markup), ``memory_tokens`` = the notes block,
``generated_tokens`` = the answer. The cost of building the memory (LLM tokens and seconds per
added note) and of query expansion is reported in ``extra["amem"]`` and by ``stats()``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from elasticmem.baselines.amem import prompts
from elasticmem.baselines.amem.config import AMemConfig
from elasticmem.baselines.amem.embed import Embedder, load_embedder
from elasticmem.llm.client import GenRequest, StructuredLLM, TransformersBackend
from elasticmem.baselines.amem.memory import AgenticMemory, build_memories, expand_queries
from elasticmem.baselines.amem.notes import MemoryItem
from elasticmem.config import MemoryConfig
from elasticmem.data.schema import Example, Turn
from elasticmem.eval.system import Prediction, Retrieved
from elasticmem.utils.configuration import ConfigError

logger = logging.getLogger(__name__)


def history_items(history: Sequence[Sequence[Turn]], cfg: AMemConfig) -> list[MemoryItem]:
    """One item per turn, in order, limited by ``max_sessions`` and ``max_turns``."""
    sessions = history[: cfg.max_sessions] if cfg.max_sessions > 0 else history
    items: list[MemoryItem] = []
    turn_no = 0
    for si, session in enumerate(sessions):
        for ti, t in enumerate(session):
            content = cfg.turn_template.format(speaker=t.speaker or t.role, content=t.content)
            items.append(MemoryItem(content, t.date or "", {"turn": turn_no, "session": si, "index": ti}))
            turn_no += 1
    return items[: cfg.max_turns] if cfg.max_turns > 0 else items


def group_dirname(group: str) -> str:
    """A folder name for a group id (readable, and unique even after replacing odd characters)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", group)[:80]
    if safe != group:
        safe += "-" + hashlib.sha1(group.encode()).hexdigest()[:8]
    return safe


class AMemSystem:
    """The ``MemorySystem`` for A-Mem; construct with ``AMemSystem(cfg)`` or ``AMemSystem.from_config``."""

    memory_per_group = True
    """Each group's memory is built as its examples are answered: evaluation gives a group to one process."""

    def __init__(self, cfg: AMemConfig, llm: StructuredLLM | None = None, embedder: Embedder | None = None,
                 backbone=None, memory: MemoryConfig | None = None):
        """``backbone``: an already loaded ``elasticmem.backbone.Backbone`` to reuse as the local LLM
        (transformers backend); otherwise ``cfg.llm.model`` is loaded. ``memory``: the settings of
        ElasticMem's prompt that ``answer_prompt=shared`` reads with (default ``MemoryConfig()``)."""
        self.cfg = cfg
        self.llm = llm if llm is not None else StructuredLLM.from_config(cfg.llm, backbone)
        self.reader = None
        if cfg.answer_prompt == "shared":
            from elasticmem.eval.reader import SharedPromptReader

            backend = self.llm.backend
            if not isinstance(backend, TransformersBackend):
                raise ConfigError("amem.answer_prompt=shared reads the notes with the local model: set "
                                  "amem.llm.backend=transformers, or amem.answer_prompt=amem")
            self.reader = SharedPromptReader(backend.model, backend.tokenizer, memory or MemoryConfig())
        self.embedder = embedder if embedder is not None else load_embedder(cfg.embedder)
        self.memories: dict[str, AgenticMemory] = {}
        self.name = "amem" if cfg.ablation == "full" else f"amem-{cfg.ablation}"
        self._llm_weights: dict[str, str] | None = None  # identity(): the local LLM's fingerprint, once

    @classmethod
    def from_config(cls, cfg: AMemConfig, backbone=None, memory: MemoryConfig | None = None) -> AMemSystem:
        return cls(cfg, backbone=backbone, memory=memory)

    # ------------------------------------------------------------------ memories

    def _open(self, group: str) -> AgenticMemory:
        if self.cfg.store_dir:
            path = Path(self.cfg.store_dir) / group_dirname(group)
            return AgenticMemory.open(path, self.cfg, self.llm, self.embedder)
        return AgenticMemory(self.cfg, self.llm, self.embedder)

    def build(self, examples: Sequence[Example], progress: bool = False) -> None:
        """Make sure every group of ``examples`` has its memory (loaded, resumed or built, in lockstep)."""
        todo: dict[str, Sequence[Sequence[Turn]]] = {}
        for ex in examples:
            if ex.group not in self.memories and ex.group not in todo:
                todo[ex.group] = ex.history
        if not todo:
            return
        mems, item_lists = [], []
        for group, history in todo.items():
            mem = self._open(group)
            items = history_items(history, self.cfg)
            done = mem.items_meta("turn")
            if len(done) > len(items):
                logger.warning("memory of group %s holds %d turns, more than the %d asked for (store_dir reused "
                               "with other max_sessions/max_turns?)", group, len(done), len(items))
            items = [it for it in items if it.meta["turn"] not in done]
            if done and items:
                logger.info("resuming memory of group %s: %d turns stored, %d to add", group, len(done), len(items))
            self.memories[group] = mem
            mems.append(mem)
            item_lists.append(items)
        build_memories(mems, item_lists, progress=progress)

    # ------------------------------------------------------------------ answering

    def predict(self, examples: Sequence[Example]) -> list[Prediction]:
        if not examples:
            return []
        self.build(examples)
        cfg = self.cfg
        t0 = time.perf_counter()
        questions = [ex.question for ex in examples]
        expansion = None
        if cfg.query_expansion:
            queries, expansion = expand_queries(self.llm, cfg, questions)
        else:
            queries = questions
        by_group: dict[str, list[int]] = defaultdict(list)
        for i, ex in enumerate(examples):
            by_group[ex.group].append(i)
        retrieved: list[list[Any]] = [[] for _ in examples]
        for group, idx in by_group.items():
            hits = self.memories[group].retrieve_many([queries[i] for i in idx])
            for i, h in zip(idx, hits):
                retrieved[i] = h
        t_retrieval = (time.perf_counter() - t0) / len(examples)

        t1 = time.perf_counter()
        if self.reader is not None:
            reads = self.reader.answer(examples, [[h.note.render(cfg.answer_fields) for h in hits]
                                                  for hits in retrieved])
            answers = [(r.text, r.prompt_tokens, r.memory_tokens, r.generated_tokens) for r in reads]
        else:
            answers = self._amem_answers(examples, retrieved)
        t_generation = (time.perf_counter() - t1) / len(examples)

        preds = []
        for i, (ex, hits, (text, prompt_tokens, memory_tokens, generated)) in enumerate(
                zip(examples, retrieved, answers)):
            mem = self.memories[ex.group]
            extra: dict[str, Any] = {
                "group": ex.group, "notes_in_memory": len(mem),
                "retrieved_by_link": sum(r.via == "link" for r in hits),
                "build": {k: v for k, v in mem.stats.to_dict().items()
                          if k in ("notes_added", "tokens_per_note", "seconds_per_note", "fallbacks")},
            }
            if expansion is not None:
                extra["query"] = queries[i]
                extra["expansion_tokens"] = expansion[i].tokens
                extra["expansion_fallback"] = expansion[i].fallback
            preds.append(Prediction(
                id=ex.id, text=text, prompt_tokens=prompt_tokens, memory_tokens=memory_tokens,
                generated_tokens=generated,
                retrieved=[Retrieved(rank=r, ref=h.note.id, score=h.score, text=h.note.content,
                                     tokens=self.llm.count_tokens(h.note.render(cfg.answer_fields)))
                           for r, h in enumerate(hits)],
                latency={"retrieval": t_retrieval, "generation": t_generation},
                extra={"amem": extra, **self._evidence(ex, mem)},
            ))
        return preds

    @staticmethod
    def _evidence(ex: Example, mem: AgenticMemory) -> dict[str, Any]:
        """``{"evidence": ...}`` for ``metrics.evidence_stats``: the notes of ``ex``'s evidence
        turns ([session, turn] positions) and the memory's size; empty when it has none of them."""
        positions = {tuple(p) for p in ex.extra.get("evidence") or ()}
        refs = [n.id for n in mem.notes.values()
                if (n.meta.get("session"), n.meta.get("index")) in positions]
        return {"evidence": {"refs": refs, "group_rows": len(mem)}} if refs else {}

    def _amem_answers(self, examples: Sequence[Example], retrieved) -> list[tuple[str, int, int, int]]:
        """(answer, prompt tokens, memory tokens, generated tokens) of each example from A-Mem's
        answer prompt over its notes."""
        cfg = self.cfg
        blocks = [prompts.memory_block([r.note for r in hits], cfg.answer_fields) for hits in retrieved]
        requests = [GenRequest(prompts.answer_messages(cfg, ex.question, block, ex.choices),
                               cfg.mc_max_new_tokens if ex.choices else cfg.answer_max_new_tokens, None,
                               stop=("\n",), kind="answer")
                    for ex, block in zip(examples, blocks)]
        out = []
        for block, ans in zip(blocks, self.llm.text(requests)):
            memory_tokens = self.llm.count_tokens(block) if block else 0
            out.append((ans.value, max(0, ans.prompt_tokens - memory_tokens), memory_tokens, ans.completion_tokens))
        return out

    # ------------------------------------------------------------------ reporting

    def identity(self) -> dict[str, Any]:
        """What makes A-Mem's answers (``MemorySystem.identity``): its settings, less those about
        speed, storage and transport, and for a local LLM its weights' fingerprint and dtype."""
        settings = asdict(self.cfg)
        for key in ("store_dir", "save_every", "fsync"):
            del settings[key]
        for key in ("batch_size", "device", "dtype", "api_base", "api_key_env", "timeout_s", "http_retries",
                    "retry_backoff_s"):
            del settings["llm"][key]
        ident: dict[str, Any] = {"system": self.name, "amem": settings}
        if self.reader is not None:
            ident["answer"] = self.reader.settings()
        backend = self.llm.backend
        if isinstance(backend, TransformersBackend):
            if self._llm_weights is None:
                from elasticmem.backbone import model_fingerprint

                self._llm_weights = {"fingerprint": model_fingerprint(backend.model, backend.tokenizer),
                                     "dtype": str(next(backend.model.parameters()).dtype).removeprefix("torch.")}
            ident["llm_weights"] = self._llm_weights
        return ident

    def stats(self) -> dict[str, Any]:
        """LLM call statistics (valid-JSON rate, fallbacks, tokens by kind) and memory-building cost."""
        total: dict[str, float] = defaultdict(float)
        for mem in self.memories.values():
            for k, v in mem.stats.to_dict().items():
                if k not in ("tokens_per_note", "seconds_per_note"):
                    total[k] += v
        n = max(1, total.get("notes_added", 0))
        build = dict(total)
        build["tokens_per_note"] = (total.get("prompt_tokens", 0) + total.get("completion_tokens", 0)) / n
        build["seconds_per_note"] = total.get("seconds", 0) / n
        build["notes_unmeasured"] = sum(m.notes_unmeasured for m in self.memories.values())
        return {"system": self.name, "llm": self.llm.stats.to_dict(), "build": build,
                "groups": {g: m.stats.to_dict() for g, m in self.memories.items()}}

    def close(self) -> None:
        for mem in self.memories.values():
            mem.save()
