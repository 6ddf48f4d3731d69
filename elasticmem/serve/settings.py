"""Limits and batching settings of the server, with their documented defaults (docs/serving.md).

The package's docstring (``elasticmem/serve/__init__.py``) describes the server and its API.
"""

import logging
import re
from dataclasses import dataclass

log = logging.getLogger("elasticmem.serve")

INSTALL_HINT = "pip install 'elasticmem[serve]'"
GROUP_RE = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
"""What a memory group may be called: no spaces, no control characters, short enough for a log line."""
LATENCY_WINDOW = 10_000
"""Latencies kept per endpoint for /metrics percentiles (a bounded window, not the whole history)."""


@dataclass
class Limits:
    """Request limits; a request over one is refused with a 4xx (or 503 / 507) and a message that says
    which limit, its value and the flag that sets it. Every field is a ``--flag`` of the same name
    (``max_new_tokens``: ``--max-new-tokens-limit``); docs/serving.md lists them with their status codes."""

    # -- one request's size
    max_body_bytes: int = 1 << 20
    """Largest request body in bytes (413 above), checked on Content-Length and while reading, before parsing."""
    body_timeout_s: float = 30.0
    """Seconds a client has to send the whole body once its headers arrived (408 after): a slow upload
    cannot hold a connection and its buffer for long."""
    max_turns_per_request: int = 256
    """Most turns in one add (413 above)."""
    max_turn_chars: int | None = None
    """Longest turn content in characters (413 above); None = the live memory's own ``max_turn_chars``
    (``main`` loads the live memory with this limit, which ``LiveMemory.add`` enforces too)."""
    max_question_chars: int = 4000
    """Longest question, also the last user message of a chat completion (422 above)."""
    max_choices: int = 26
    """Most answer options of one question (422 above; options are lettered a-z)."""
    max_choice_chars: int = 1000
    """Longest answer option in characters (422 above)."""
    max_messages: int = 256
    """Most messages in one chat-completion request (422 above)."""
    max_message_chars: int = 20_000
    """Longest content of any one chat message in characters, text parts together (422 above)."""
    max_prompt_tokens: int = 4096
    """Most prompt tokens of one question after templating (question, options, template; memories
    excluded), counted with the model's tokenizer before the request is queued (413 above): the
    bound on how long one request can hold the model worker."""
    max_new_tokens: int = 256
    """Largest ``max_new_tokens`` / ``max_tokens`` a request may ask for (422 above)."""

    # -- sharing the server between tenants
    max_queue: int = 1024
    """Most requests waiting for the model, all tenants together (503 above)."""
    tenant_max_queued: int = 32
    """Most requests of one tenant waiting for the model: its share of the queue (429 with Retry-After
    above). The worker takes the tenants' requests in turn, so this bounds a tenant's memory, not
    the others' wait."""
    tenant_max_in_flight: int = 64
    """Most requests of one tenant being handled at once, from its headers to its response (429 with
    Retry-After above); counted before the body is read. Without API keys all clients are one tenant."""
    tenant_max_rows: int | None = 100_000
    """Most memories (bank rows) in the groups a tenant's keys cover (507 on an add that could pass it:
    its usage plus one row per turn of the add); None (``--tenant-max-rows none``) = no quota."""
    tenant_max_bytes: int | None = 16 << 30
    """Most bytes on disk of those memories: each row's share of its shard file (cached states and keys)
    plus its chunk text in UTF-8 (507 on an add while the tenant is at or over it); None = no quota."""

    # -- connections (uvicorn)
    limit_concurrency: int = 1024
    """Most open connections and tasks; uvicorn answers 503 above, before reading anything."""
    timeout_keep_alive_s: float = 5.0
    """Seconds an idle keep-alive connection is held open."""


@dataclass
class Batching:
    """How the worker groups concurrent asks into one forward."""

    max_batch: int = 8
    """Most questions answered by one ``ask_many`` (and sessions appended by one ``add_many``)."""
    window_ms: float = 5.0
    """After the first request of a batch arrives, how long to wait for more (0 = take what is queued)."""
    max_batch_tokens: int | None = 4096
    """Most prompt tokens (questions and options, as ``max_prompt_tokens`` counts them) of the asks in
    one batch; a batch's first request always fits. It bounds the forward passes nothing can
    interrupt (reading the batch's questions and prompts), so it bounds how long a batch of maximal
    requests holds another tenant's request that arrives then. None = no bound."""
    slice_ms: float | None = 20.0
    """Once a batch of asks has run this long, other tenants' waiting requests run between two of its
    decoding steps (one batch of theirs per step): a long batch cannot hold a short request of
    another tenant for longer than about one decoding step. 0 = from the first step; None = never."""
    prefill_chunk: int | None = 64
    """With ``slice_ms``: a prompt longer than this many positions is read in chunks of it, the other
    tenants' waiting requests run between two (``generation.chunked_prefill``), so a maximal prompt's
    forward pass holds another tenant's request for one chunk, not for the whole prompt (SmolLM2 on
    one CPU thread reads a 3072-token prompt in 16-18 s in one pass, in 20 s in chunks of 64, each at
    most 0.6 s). The answers are the same. On a GPU, where one pass over a long prompt is fast and
    small chunks waste it, use 512 or more. None = one pass."""

    @classmethod
    def off(cls) -> "Batching":
        """One request per forward: what ``--no-batching`` runs (the baseline of the benchmark)."""
        return cls(max_batch=1, window_ms=0.0)
