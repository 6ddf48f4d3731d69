"""HTTP server over a live memory (``elasticmem.live.LiveMemory``): tenants add turns and ask questions.

    pip install 'elasticmem[serve]'
    python -m elasticmem.serve --checkpoint runs/train/quickstart/final --bank runs/bank/live \\
        --api-keys keys.json [--port 8000] [key=value ...]

One process holds one model. Every piece of model work (asks and adds) goes through ONE worker
thread: requests that arrive within a short collection window (``--batch-window-ms``, default 5)
are answered by one batched forward (``LiveMemory.ask_many``, at most ``--max-batch`` requests,
default 8; ``--no-batching`` answers one at a time), and adds are applied in arrival order, the
sessions of one batch in one append (``LiveMemory.add_many``, one disk write), before its asks.
An add is answered only once it is on disk, so any request sent after its response sees it.
Trailing ``key=value`` arguments are config overrides (``model.device=cpu memory.top_z=4``), as
for ``evaluate.py``.

Tenants (``--api-keys FILE``, JSON, or YAML when the name ends in .yaml/.yml)::

    {"sk-a-...": {"tenant": "a", "groups": ["tenantA/*", "shared-notes"]},
     "sk-b-...": {"tenant": "b", "groups": ["tenantB/*"]}}

Each key names the memory groups it may read and write (``fnmatch`` patterns, case-sensitive). Every
request sends ``Authorization: Bearer KEY``: no or an unknown key is 401, a group the key does not
cover is 403 (also for listing, so a tenant cannot even learn whether another tenant's group
exists). A request names exactly one group and the model searches only that group's memories, so an
answer can neither retrieve nor inject another group's memory; the server also refuses (500) any
answer whose memories name another group. Without ``--api-keys`` the server is open to anyone who
can reach it (a warning is logged): keep it on 127.0.0.1 then.

Endpoints (``$K`` = an API key; errors are ``{"error": {"message", "type", "code"}}``):

``POST /v1/memory/{group}`` adds one session of turns to a group (created on first use); the turns
are chunked like the data pipeline (a user turn and the assistant turn after it make one chunk).
Returns ``{"group", "added", "skipped", "rows"}``; a chunk whose text the group already holds is
skipped, so a retried request adds nothing::

    curl -s localhost:8000/v1/memory/tenantA/notes -H "Authorization: Bearer $K" \\
        -H 'Content-Type: application/json' \\
        -d '{"turns": [{"role": "user", "content": "My cat is called Miso."},
                       {"role": "assistant", "content": "Noted: Miso."}]}'

``GET /v1/memory/{group}`` lists the group's chunks ``{"group", "chunks": [{"row", "group", "text",
"session", "turns", "n_tokens"}, ...]}`` (an empty list for a group with no memory)::

    curl -s localhost:8000/v1/memory/tenantA/notes -H "Authorization: Bearer $K"

``POST /v1/ask`` answers a question from one group's memory (greedy decoding): ``{"group",
"question", "choices"?: [str], "max_new_tokens"?: int}`` -> ``{"group", "question", "text",
"memories": [{"rank", "row", "group", "score", "budget", "tokens", "text"}], "prompt_tokens",
"memory_tokens", "generated_tokens", "total_tokens", "latency": {stage: seconds}}``::

    curl -s localhost:8000/v1/ask -H "Authorization: Bearer $K" -H 'Content-Type: application/json' \\
        -d '{"group": "tenantA/notes", "question": "What is my cat called?"}'

``POST /v1/chat/completions`` is the same in OpenAI's chat-completion format. The memory group is the
top-level ``memory_group`` field (else ``user``); the question is the last user message (earlier
messages are not read: the memory is the history). Sampling parameters are accepted and ignored
(decoding is greedy); ``max_tokens`` / ``max_completion_tokens`` bound the answer; ``stream`` and
``n > 1`` are refused (400). ``usage.prompt_tokens`` counts the memory tokens (also given apart as
``usage.memory_tokens``); the response adds ``memories`` (as in ``/v1/ask``) and ``memory_group``::

    curl -s localhost:8000/v1/chat/completions -H "Authorization: Bearer $K" \\
        -H 'Content-Type: application/json' \\
        -d '{"model": "elasticmem", "memory_group": "tenantA/notes",
             "messages": [{"role": "user", "content": "What is my cat called?"}]}'

``GET /v1/models`` lists the one model (OpenAI format), for clients that ask first::

    curl -s localhost:8000/v1/models -H "Authorization: Bearer $K"

``GET /health`` (no key needed; no tenant data) says whether the worker runs::

    curl -s localhost:8000/health

``GET /metrics`` (no key needed; counts only, no group names): requests by endpoint and status,
latency p50/p95 of successful requests per endpoint (the last 10,000), batches run, mean and
largest ask batch, asks answered, sessions and chunks added, queue depth, worker time::

    curl -s localhost:8000/metrics

Limits (all 4xx with a message): bodies over ``--max-body-bytes`` (default 1 MiB) 413; more than
``--max-turns-per-request`` turns (default 256) 413; a turn over ``--max-turn-chars`` characters
(default: the live memory's own limit) 413; a question over ``--max-question-chars`` (default 4000),
``max_new_tokens`` over ``--max-new-tokens-limit`` (default 256), a group name outside
``[A-Za-z0-9._:/-]{1,128}`` or a missing field 422; malformed JSON 400; more than ``--max-queue``
requests waiting for the model (default 1024) 503.
"""

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import fnmatch
import json
import logging
import math
import queue
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

log = logging.getLogger("elasticmem.serve")

INSTALL_HINT = "pip install 'elasticmem[serve]'"
GROUP_RE = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
"""What a memory group may be called: no spaces, no control characters, short enough for a log line."""
LATENCY_WINDOW = 10_000
"""Latencies kept per endpoint for /metrics percentiles (a bounded window, not the whole history)."""


# --------------------------------------------------------------------------- settings


@dataclass
class Limits:
    """Request limits; a request over one is refused with a 4xx and a message that says which."""

    max_body_bytes: int = 1 << 20
    """Largest request body (413 above)."""
    max_turns_per_request: int = 256
    """Most turns in one add (413 above)."""
    max_turn_chars: int | None = None
    """Longest turn content in characters (413 above); None = the live memory's own ``max_turn_chars``
    (``main`` loads the live memory with this limit, which ``LiveMemory.add`` enforces too)."""
    max_question_chars: int = 4000
    """Longest question (422 above)."""
    max_choices: int = 26
    """Most answer options of one question (422 above)."""
    max_new_tokens: int = 256
    """Largest ``max_new_tokens`` / ``max_tokens`` a request may ask for (422 above)."""
    max_messages: int = 256
    """Most messages in one chat-completion request (422 above)."""
    max_queue: int = 1024
    """Most requests waiting for the model (503 above): a bound on memory and on waiting time."""


@dataclass
class Batching:
    """How the worker groups concurrent asks into one forward."""

    max_batch: int = 8
    """Most questions answered by one ``ask_many`` (and sessions appended by one ``add_many``)."""
    window_ms: float = 5.0
    """After the first request of a batch arrives, how long to wait for more (0 = take what is queued)."""

    @classmethod
    def off(cls) -> "Batching":
        """One request per forward: what ``--no-batching`` runs (the baseline of the benchmark)."""
        return cls(max_batch=1, window_ms=0.0)


@dataclass(frozen=True)
class ApiKey:
    """What one API key may do: the tenant it belongs to and the groups it may read and write."""

    tenant: str
    groups: tuple[str, ...]
    """``fnmatch`` patterns (case-sensitive): ``"tenantA/*"``, or an exact name."""

    def allows(self, group: str) -> bool:
        return any(fnmatch.fnmatchcase(group, pattern) for pattern in self.groups)


class KeysFileError(ValueError):
    """The API-keys file is unreadable or malformed; the message names the file and the entry."""


def load_api_keys(path: str | Path) -> dict[str, ApiKey]:
    """Read ``{"<key>": {"tenant": str, "groups": [pattern, ...]}}`` from JSON or YAML.

    Entries are named by position in errors, never by the key itself: the error may reach a log.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise KeysFileError(f"cannot read the API-keys file {path}: {e}") from e
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except Exception as e:  # json.JSONDecodeError or yaml.YAMLError: both say where
        raise KeysFileError(f"API-keys file {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {e}") from e
    if not isinstance(raw, dict) or not raw:
        raise KeysFileError(f"API-keys file {path} must map each key to {{tenant, groups}}; "
                            f"got {type(raw).__name__ if raw else 'nothing'}")
    keys: dict[str, ApiKey] = {}
    for i, (key, entry) in enumerate(raw.items()):
        where = f"API-keys file {path}, entry {i + 1}"
        if not isinstance(key, str) or len(key) < 8 or any(c.isspace() for c in key):
            raise KeysFileError(f"{where}: a key must be a string of at least 8 characters without spaces")
        if not isinstance(entry, dict) or set(entry) - {"tenant", "groups"}:
            raise KeysFileError(f"{where}: must be an object with 'tenant' and 'groups' only")
        tenant, groups = entry.get("tenant"), entry.get("groups")
        if not isinstance(tenant, str) or not tenant:
            raise KeysFileError(f"{where}: 'tenant' must be a non-empty string")
        if not isinstance(groups, list) or not all(isinstance(g, str) and g for g in groups):
            raise KeysFileError(f"{where} (tenant {tenant!r}): 'groups' must be a list of group names or patterns")
        keys[key] = ApiKey(tenant, tuple(groups))
    return keys


# --------------------------------------------------------------------------- the model worker


class QueueFull(RuntimeError):
    """More requests wait for the model than ``Limits.max_queue``."""


class ServerStopping(RuntimeError):
    """The server shuts down; queued requests are not answered."""


@dataclass
class _Job:
    kind: str  # "ask" or "add"
    payload: Any  # an AskRequest, or (group, turns)
    future: concurrent.futures.Future
    enqueued: float = field(default_factory=time.perf_counter)


_STOP = object()


class ModelWorker:
    """The one thread that touches the model: batches concurrent asks, applies adds in order.

    Why one thread: the model is one torch module and the bank one set of files; running them from
    many request threads would serialise on LiveMemory's lock anyway, without batching. Jobs are taken
    in arrival order; a batch is what arrives within ``window_ms`` of its first job (at most
    ``max_batch``): its adds are applied first, in order, by one ``add_many``, then its asks are
    answered by one ``ask_many``. So an ask sent after an add was answered sees that add.
    """

    def __init__(self, live: Any, batching: Batching, max_queue: int = 1024) -> None:
        self.live = live
        self.batching = batching
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="elasticmem-model-worker", daemon=True)
        self._lock = threading.Lock()
        self._stopping = False
        self.started = time.time()
        # counters for /metrics, under _lock
        self.ask_batches = 0
        self.ask_batch_sizes: collections.Counter[int] = collections.Counter()
        self.asks_answered = 0
        self.ask_errors = 0
        self.add_batches = 0
        self.sessions_added = 0
        self.chunks_added = 0
        self.chunks_skipped = 0
        self.add_errors = 0
        self.busy_s = 0.0
        self.queue_wait: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)

    # -- lifecycle
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the jobs already queued, then end the thread (what a graceful shutdown needs)."""
        self._stopping = True
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)
        while True:  # anything left (the thread died, or the join timed out): tell its waiters
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP and job.future.set_running_or_notify_cancel():
                job.future.set_exception(ServerStopping("the server is shutting down"))

    def queued(self) -> int:
        return self._queue.qsize()

    # -- submitting
    def submit(self, kind: str, payload: Any) -> concurrent.futures.Future:
        """Queue one job; its future gets the Answer / AddResult, or the exception the model raised."""
        if self._stopping:
            raise ServerStopping("the server is shutting down")
        job = _Job(kind, payload, concurrent.futures.Future())
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"server busy: {self._queue.maxsize} requests are already waiting for the model; "
                            "retry later") from None
        return job.future

    # -- the thread
    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch, stop = [first], False
            deadline = time.perf_counter() + self.batching.window_ms / 1000.0
            while len(batch) < self.batching.max_batch:
                try:  # what is already queued is taken at once; then wait out the window
                    remaining = deadline - time.perf_counter()
                    job = self._queue.get_nowait() if remaining <= 0 else self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if job is _STOP:
                    stop = True
                    break
                batch.append(job)
            self._process(batch)
            if stop:
                return

    def _process(self, batch: list[_Job]) -> None:
        # The adds of a batch first (in arrival order, one append), then its asks (one forward).
        # Requests of one batch were all sent before any of them was answered, so none of them can
        # depend on another; adds first gives every ask the freshest bank, and keeps a mixed batch
        # one forward instead of one per stretch between two adds.
        runs = [[job for job in batch if job.kind == "add"], [job for job in batch if job.kind == "ask"]]
        for run in runs:
            if not run:
                continue
            now = time.perf_counter()
            with self._lock:
                self.queue_wait.extend(now - job.enqueued for job in run)
            t0 = time.perf_counter()
            try:
                if run[0].kind == "ask":
                    self._asks(run)
                else:
                    self._adds(run)
            except BaseException as e:  # never leave a waiter hanging, whatever happened
                log.exception("model worker: unexpected failure")
                for job in run:
                    if not job.future.done():
                        job.future.set_exception(e)
            finally:
                with self._lock:
                    self.busy_s += time.perf_counter() - t0

    @staticmethod
    def _each(call: Callable[[list], list], payloads: list) -> list[tuple[Any, BaseException | None]]:
        """``call`` on the whole batch, one ``(result, error)`` per payload: when the batch fails,
        each payload alone, so one bad request does not fail the others (adds stay in order)."""
        try:
            results = call(payloads)
            if len(results) != len(payloads):
                raise RuntimeError(f"got {len(results)} results for {len(payloads)} requests")
            return [(r, None) for r in results]
        except Exception as batch_error:
            if len(payloads) == 1:
                return [(None, batch_error)]
        out: list[tuple[Any, BaseException | None]] = []
        for payload in payloads:
            try:
                out.append((call([payload])[0], None))
            except Exception as e:
                out.append((None, e))
        return out

    def _asks(self, run: list[_Job]) -> None:
        # a client that went away before its turn costs nothing
        live_jobs = [job for job in run if job.future.set_running_or_notify_cancel()]
        if not live_jobs:
            return
        results = self._each(self.live.ask_many, [job.payload for job in live_jobs])
        with self._lock:
            self.ask_batches += 1
            self.ask_batch_sizes[len(live_jobs)] += 1
            for _, err in results:
                if err is None:
                    self.asks_answered += 1
                else:
                    self.ask_errors += 1
        for job, (answer, err) in zip(live_jobs, results):
            if err is None:
                job.future.set_result(answer)
            else:
                job.future.set_exception(err)

    def _adds(self, run: list[_Job]) -> None:
        # Adds are applied even when their client went away: it was accepted into the queue, and a
        # retry of it is skipped as a duplicate, so applying it can never double it.
        jobs = [(job, job.future.set_running_or_notify_cancel()) for job in run]
        outcome = self._each(self.live.add_many, [job.payload for job, _ in jobs])
        with self._lock:
            self.add_batches += 1
            for result, err in outcome:
                if err is None:
                    self.sessions_added += 1
                    self.chunks_added += result.added
                    self.chunks_skipped += result.skipped
                else:
                    self.add_errors += 1
        for (job, running), (result, err) in zip(jobs, outcome):
            if not running:
                continue
            if err is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(err)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            sizes = self.ask_batch_sizes
            n_batches = sum(sizes.values())
            return {
                "batching": {"max_batch": self.batching.max_batch, "window_ms": self.batching.window_ms},
                "batches_run": self.ask_batches,
                "mean_batch_size": (sum(k * v for k, v in sizes.items()) / n_batches) if n_batches else 0.0,
                "max_batch_size": max(sizes) if sizes else 0,
                "batch_size_histogram": {str(k): sizes[k] for k in sorted(sizes)},
                "asks_answered": self.asks_answered,
                "ask_errors": self.ask_errors,
                "add_batches": self.add_batches,
                "sessions_added": self.sessions_added,
                "chunks_added": self.chunks_added,
                "chunks_skipped": self.chunks_skipped,
                "add_errors": self.add_errors,
                "queue_depth": self._queue.qsize(),
                "queue_wait_s": _percentiles(self.queue_wait),
                "worker_busy_s": round(self.busy_s, 3),
                "uptime_s": round(time.time() - self.started, 3),
            }


def _percentiles(values: Sequence[float] | collections.deque) -> dict[str, float | int]:
    """p50 / p95 by nearest rank (no interpolation: every figure is a latency that happened)."""
    v = sorted(values)
    if not v:
        return {"n": 0, "p50": 0.0, "p95": 0.0}
    def rank(q: float) -> float:
        return v[min(len(v), max(1, math.ceil(q * len(v)))) - 1]

    return {"n": len(v), "p50": round(rank(0.50), 6), "p95": round(rank(0.95), 6)}


# --------------------------------------------------------------------------- metrics and limits (ASGI)


class Metrics:
    """Request counts by (endpoint, status) and latency windows by endpoint, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.latency: dict[str, collections.deque[float]] = {}

    def record(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1
            if 200 <= status < 300:  # a refused request's speed says nothing about serving
                self.latency.setdefault(endpoint, collections.deque(maxlen=LATENCY_WINDOW)).append(seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            by_endpoint: dict[str, dict[str, int]] = {}
            for (endpoint, status), n in sorted(self.requests.items()):
                by_endpoint.setdefault(endpoint, {})[str(status)] = n
            return {"requests": by_endpoint,
                    "latency_s": {e: _percentiles(d) for e, d in sorted(self.latency.items())}}


def _json_error(status: int, message: str, kind: str) -> tuple[dict, bytes]:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, body


class _LimitAndMeasure:
    """Outermost ASGI layer: counts and times every request by route, and refuses big bodies.

    The body limit is checked on the declared Content-Length and again while reading (a chunked
    request declares none), before anything parses it; the read body is then replayed to the app.
    """

    def __init__(self, app: Callable, metrics: Metrics, max_body_bytes: int, routes: Callable[[], list]) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.routes = routes

    def _endpoint(self, scope: dict) -> str:
        from starlette.routing import Match

        for route in self.routes():  # the route template, so that labels stay few (not one per group)
            if route.matches(scope)[0] is Match.FULL:
                return f"{scope['method']} {route.path.replace(':path', '')}"
        return "other"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        endpoint = self._endpoint(scope)
        status = [500]

        async def send_measured(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            body = await self._read_body(scope, receive, send_measured)
            if body is None:
                return
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: wait for the disconnect, as the server would

            await self.app(scope, replay, send_measured)
        finally:
            self.metrics.record(endpoint, status[0], time.perf_counter() - t0)

    async def _read_body(self, scope: dict, receive: Callable, send: Callable) -> bytes | None:
        limit = self.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await self._refuse(send, 400, "Content-Length is not a number", "invalid_request_error")
                return None
            if int(declared) > limit:
                await self._refuse(send, 413, f"request body of {int(declared)} bytes is over the limit of {limit} "
                                   "bytes (--max-body-bytes)", "request_too_large")
                return None
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(send, 413, f"request body is over the limit of {limit} bytes (--max-body-bytes)",
                                   "request_too_large")
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    @staticmethod
    async def _refuse(send: Callable, status: int, message: str, kind: str) -> None:
        start, body = _json_error(status, message, kind)
        await send(start)
        await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------- the app


def _to_json(obj: Any) -> dict[str, Any]:
    return obj.to_json() if hasattr(obj, "to_json") else dataclasses.asdict(obj)


def _request_models(limits: Limits) -> dict[str, type]:
    """The pydantic request bodies, with this server's limits in their field constraints (clear 422s)."""
    from pydantic import BaseModel, ConfigDict, Field

    def token_limit() -> Any:  # one Field per field (and a name no class body assigns)
        return Field(default=None, ge=1, le=limits.max_new_tokens)

    class TurnIn(BaseModel):
        model_config = ConfigDict(extra="forbid")
        role: str = Field(min_length=1, max_length=32, description="user, assistant, memory, or another label")
        # the length limit is checked by the endpoint, to answer 413 with the turn's index
        content: str = Field(min_length=1)
        date: str | None = Field(default=None, max_length=64)
        speaker: str | None = Field(default=None, max_length=128)

    class AddBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        turns: list[TurnIn] = Field(min_length=1)

    class AskBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        group: str
        question: str = Field(min_length=1, max_length=limits.max_question_chars)
        choices: list[str] | None = Field(default=None, min_length=2, max_length=limits.max_choices)
        max_new_tokens: int | None = token_limit()

    class ChatMessage(BaseModel):
        model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: accepted, not read
        role: str
        content: str | list[dict[str, Any]] | None = None

    class ChatBody(BaseModel):
        model_config = ConfigDict(extra="allow")  # temperature, top_p, ...: accepted; decoding is greedy
        model: str | None = None
        messages: list[ChatMessage] = Field(min_length=1, max_length=limits.max_messages)
        memory_group: str | None = None
        user: str | None = None
        max_tokens: int | None = token_limit()
        max_completion_tokens: int | None = token_limit()
        stream: bool | None = False
        n: int | None = 1

    return {"TurnIn": TurnIn, "AddBody": AddBody, "AskBody": AskBody, "ChatBody": ChatBody}


def _message_text(content: str | list[dict[str, Any]] | None) -> str:
    """The text of an OpenAI message: a string, or the text parts of a list of content parts."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"only text content parts are supported, got a part of type {part.get('type')!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def create_app(live: Any, keys: dict[str, ApiKey] | None = None, limits: Limits | None = None,
               batching: Batching | None = None, model_name: str | None = None) -> Any:
    """The FastAPI app serving ``live`` (a ``LiveMemory``); see the module docstring for the endpoints.

    ``keys`` None serves everyone (no tenants). The model worker starts with the app (lifespan) and
    finishes the queued jobs when it stops.
    """
    from contextlib import asynccontextmanager

    from fastapi import Depends, FastAPI, Header, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    limits = limits or Limits()
    batching = batching or Batching()
    model_name = model_name or live.system
    live_limit = getattr(live, "max_turn_chars", None)
    # the answer length a request gets when it names none: for finish_reason "length" vs "stop"
    default_new_tokens = getattr(getattr(getattr(live, "model", None), "cfg", None), "max_new_tokens", None)
    turn_limit = min(x for x in (limits.max_turn_chars, live_limit, sys.maxsize) if x)
    models = _request_models(limits)
    AddBody, AskBody, ChatBody = models["AddBody"], models["AskBody"], models["ChatBody"]
    worker = ModelWorker(live, batching, limits.max_queue)
    metrics = Metrics()
    if keys is None:
        log.warning("no --api-keys: the server is open, every client may read and write every memory group")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        log.info("model worker started (system %s, max batch %d, window %.1f ms)", live.system,
                 batching.max_batch, batching.window_ms)
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)
            log.info("model worker stopped: %d asks answered, %d chunks added", worker.asks_answered,
                        worker.chunks_added)

    app = FastAPI(title="elasticmem", summary="latent memory for LLM agents, served", lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # no docs pages: nothing served that needs no key
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.limits = limits
    app.add_middleware(_LimitAndMeasure, metrics=metrics, max_body_bytes=limits.max_body_bytes,
                       routes=lambda: app.router.routes)

    # -- errors: one shape for all, {"error": {"message", "type", "code"}} (OpenAI clients read it)
    def error(status: int, message: str, kind: str, **extra: Any) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"error": {"message": message, "type": kind, "code": status, **extra}}, status,
                            headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                 422: "invalid_request_error", 503: "overloaded_error"}
        return error(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "server_error"))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        bad_json = [e for e in errors if e.get("type") == "json_invalid"]
        if bad_json:
            ctx = bad_json[0].get("ctx") or {}
            return error(400, f"malformed JSON in the request body: {ctx.get('error', bad_json[0].get('msg'))}",
                         "invalid_request_error")
        parts = []
        for e in errors:
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            parts.append(f"{where}: {e.get('msg')}")
        details = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors]
        return error(422, "invalid request: " + "; ".join(parts), "invalid_request_error", details=details)

    # -- auth and group checks
    def caller(authorization: str | None = Header(default=None)) -> ApiKey | None:
        if keys is None:
            return None
        if not authorization:
            raise HTTPException(401, "missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise HTTPException(401, "malformed Authorization header: send 'Authorization: Bearer <key>'")
        key = keys.get(token.strip())
        if key is None:
            raise HTTPException(401, "unknown API key")
        return key

    def authorize(group: str | None, key: ApiKey | None, field_name: str = "group") -> str:
        """The group, once valid and allowed for this key (422 invalid, 403 not this tenant's)."""
        if not group or not GROUP_RE.fullmatch(group):
            raise HTTPException(422, f"invalid memory group in {field_name}: {str(group)[:140]!r}; "
                                f"a group name matches {GROUP_RE.pattern}")
        if key is not None and not key.allows(group):
            raise HTTPException(403, f"this API key (tenant {key.tenant!r}) may not read or write memory group "
                                f"{group!r}")
        return group

    async def run_model(kind: str, payload: Any) -> Any:
        try:
            return await asyncio.wrap_future(worker.submit(kind, payload))
        except QueueFull as e:
            raise HTTPException(503, str(e)) from None
        except ServerStopping as e:
            raise HTTPException(503, str(e)) from None
        except ValueError as e:  # LiveMemory refuses bad input with ValueError (e.g. a turn it cannot chunk)
            raise HTTPException(422, str(e)) from None
        except Exception as e:
            log.exception("%s failed", kind)
            raise HTTPException(500, f"internal error while answering ({type(e).__name__}: {e})") from None

    async def ask(group: str, question: str, choices: list[str] | None, max_new_tokens: int | None) -> Any:
        from elasticmem.live import AskRequest

        answer = await run_model("ask", AskRequest(group=group, question=question, choices=choices,
                                                   max_new_tokens=max_new_tokens))
        foreign = [m for m in answer.memories if m.group != group]
        if foreign:  # defence in depth: the model searches one group; never return another's memory
            log.error("ask for group %r retrieved %d memories of other groups; answer withheld", group, len(foreign))
            raise HTTPException(500, "internal error: retrieval crossed a memory-group boundary; answer withheld")
        return answer

    # -- endpoints
    @app.post("/v1/memory/{group:path}")
    async def add_memory(group: str, body: AddBody, key: ApiKey | None = Depends(caller)) -> dict:
        group = authorize(group, key, "the path")
        if len(body.turns) > limits.max_turns_per_request:
            raise HTTPException(413, f"{len(body.turns)} turns in one request; the limit is "
                                f"{limits.max_turns_per_request} (--max-turns-per-request)")
        for i, t in enumerate(body.turns):
            if len(t.content) > turn_limit:
                raise HTTPException(413, f"turns[{i}].content has {len(t.content)} characters; the limit is "
                                    f"{turn_limit} (--max-turn-chars)")
        turns = [t.model_dump(exclude_none=True) for t in body.turns]
        return _to_json(await run_model("add", (group, turns)))

    @app.get("/v1/memory/{group:path}")
    async def list_memory(group: str, key: ApiKey | None = Depends(caller)) -> dict:
        group = authorize(group, key, "the path")
        # listing reads the chunk table, not the model: no need to queue behind the asks
        return {"group": group, "chunks": await asyncio.to_thread(live.chunks, group)}

    @app.post("/v1/ask")
    async def ask_endpoint(body: AskBody, key: ApiKey | None = Depends(caller)) -> dict:
        group = authorize(body.group, key)
        return _to_json(await ask(group, body.question, body.choices, body.max_new_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, key: ApiKey | None = Depends(caller)) -> dict:
        if body.stream:
            raise HTTPException(400, "stream=true is not supported; send stream=false")
        if body.n not in (None, 1):
            raise HTTPException(400, f"n={body.n} is not supported; one answer per request (greedy decoding)")
        if not body.memory_group and not body.user:
            raise HTTPException(422, "name the memory group in 'memory_group' (or 'user')")
        group = authorize(body.memory_group or body.user, key, "memory_group" if body.memory_group else "user")
        users = [m for m in body.messages if m.role == "user"]
        if not users:
            raise HTTPException(422, "messages has no message with role 'user': the last one is the question")
        try:
            question = _message_text(users[-1].content).strip()
        except ValueError as e:
            raise HTTPException(422, f"messages: {e}") from None
        if not question:
            raise HTTPException(422, "the last user message is empty")
        if len(question) > limits.max_question_chars:
            raise HTTPException(422, f"the question has {len(question)} characters; the limit is "
                                f"{limits.max_question_chars} (--max-question-chars)")
        limit = body.max_completion_tokens or body.max_tokens
        answer = await ask(group, question, None, limit)
        limit = limit or default_new_tokens
        prompt_tokens = answer.total_tokens - answer.generated_tokens  # task text + memory tokens
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                         "logprobs": None,
                         "finish_reason": "length" if limit and answer.generated_tokens >= limit else "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": answer.generated_tokens,
                      "total_tokens": prompt_tokens + answer.generated_tokens,
                      "memory_tokens": answer.memory_tokens},
            "memory_group": group,
            "memories": [_to_json(m) for m in answer.memories],
        }

    @app.get("/v1/models")
    async def list_models(key: ApiKey | None = Depends(caller)) -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(worker.started),
                                            "owned_by": "elasticmem"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = worker.alive()
        return JSONResponse({"status": "ok" if ok else "worker stopped", "system": live.system, "model": model_name,
                             "queue_depth": worker.queued(), "uptime_s": round(time.time() - worker.started, 3)},
                            200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> dict:
        return {**metrics.snapshot(), "model": worker.stats()}

    return app


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m elasticmem.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="a trained checkpoint folder (e.g. runs/train/x/final); none = untrained parts")
    p.add_argument("--bank", required=True, help="the bank folder; created empty when it does not exist")
    p.add_argument("--config", help="a YAML preset (default: the checkpoint's saved config.yaml)")
    p.add_argument("--system", default="elasticmem", choices=["elasticmem", "text_rag", "no_memory"],
                   help="how memories reach the model: latent (elasticmem), as text (text_rag), or not at all")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-keys", metavar="FILE", help="JSON/YAML: key -> {tenant, groups}; without it: open server")
    p.add_argument("--max-batch", type=int, default=Batching.max_batch, help="most questions in one forward")
    p.add_argument("--batch-window-ms", type=float, default=Batching.window_ms,
                   help="how long the first request of a batch waits for others")
    p.add_argument("--no-batching", action="store_true", help="one request per forward (max batch 1, no window)")
    lim = Limits()
    p.add_argument("--max-body-bytes", type=int, default=lim.max_body_bytes)
    p.add_argument("--max-turns-per-request", type=int, default=lim.max_turns_per_request)
    p.add_argument("--max-turn-chars", type=int, default=None,
                   help="longest turn content in characters (default: elasticmem.live.MAX_TURN_CHARS, 20000)")
    p.add_argument("--max-question-chars", type=int, default=lim.max_question_chars)
    p.add_argument("--max-new-tokens-limit", type=int, default=lim.max_new_tokens,
                   help="the largest max_new_tokens / max_tokens a request may ask for")
    p.add_argument("--max-queue", type=int, default=lim.max_queue, help="requests waiting for the model (503 above)")
    p.add_argument("--model-name", help="the model id reported by /v1/models and chat completions")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="no line per request")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.device=cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        print(f"elasticmem.serve needs FastAPI and uvicorn ({e.name or e} is not installed): {INSTALL_HINT}",
              file=sys.stderr)
        return 2
    args = _parser().parse_intermixed_args(argv)
    for flag in ("max_batch", "max_body_bytes", "max_turns_per_request", "max_question_chars",
                 "max_new_tokens_limit", "max_queue"):
        if getattr(args, flag) < 1:
            print(f"--{flag.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.batch_window_ms < 0 or (args.max_turn_chars is not None and args.max_turn_chars < 1):
        print("--batch-window-ms must be >= 0 and --max-turn-chars >= 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = None
    if args.api_keys:
        try:
            keys = load_api_keys(args.api_keys)
        except KeysFileError as e:
            print(f"elasticmem.serve: {e}", file=sys.stderr)
            return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from elasticmem.bank.store import BankError
    from elasticmem.live import LiveMemory

    batching = Batching.off() if args.no_batching else Batching(args.max_batch, args.batch_window_ms)
    try:  # batch_size: one worker batch is one forward pass, not split again by LiveMemory
        live = LiveMemory.load(checkpoint=args.checkpoint, bank=args.bank, config=args.config,
                               overrides=list(args.overrides), system=args.system,
                               batch_size=batching.max_batch,
                               **({"max_turn_chars": args.max_turn_chars} if args.max_turn_chars else {}))
    except (ValueError, OSError, BankError) as e:  # a bad config key or preset (ConfigError), checkpoint or bank
        print(f"elasticmem.serve: cannot load the memory: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    limits = Limits(max_body_bytes=args.max_body_bytes, max_turns_per_request=args.max_turns_per_request,
                    max_turn_chars=args.max_turn_chars, max_question_chars=args.max_question_chars,
                    max_new_tokens=args.max_new_tokens_limit, max_queue=args.max_queue)
    app = create_app(live, keys, limits, batching, args.model_name)
    log.info("serving %s memory from %s on http://%s:%d (%s tenants)", live.system, args.bank, args.host, args.port,
             len({k.tenant for k in keys.values()}) if keys else "no")
    # one process: the model and the bank live in it (uvicorn workers would each load their own)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=not args.no_access_log,
                workers=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
