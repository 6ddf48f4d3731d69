"""HTTP server over a live memory (``elasticmem.live.LiveMemory``): tenants add turns and ask questions.

Why one file (for now): keys, limits, the batching worker and the routes share one app state;
the split into auth / worker / app modules is issue 38's next step.

    pip install 'elasticmem[serve]'
    elasticmem-serve --checkpoint runs/train/quickstart/final --bank runs/bank/live \\
        --api-keys keys.json [--port 8000] [key=value ...]      # or: python -m elasticmem.serve ...

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

``DELETE /v1/memory/{group}`` forgets the whole group, ``?session=N`` one session, ``?row=R`` one
memory (its ``row`` in the listing): ``{"group", "deleted", "rows", "purged"}``, answered once the
memories are out of search and out of the bank's files (``LiveMemory.forget``). Memories not in the
group are 404 (a retried delete too); the key must cover the group (403), as for every route::

    curl -s -X DELETE "localhost:8000/v1/memory/tenantA/notes?row=17" -H "Authorization: Bearer $K"

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
largest ask batch, asks answered, sessions and chunks added, memories forgotten, queue depth, worker
time::

    curl -s localhost:8000/metrics

``GET /openapi.json`` and ``GET /docs`` describe the API; they need a key like the API does, unless
``--open-docs``.

Tenants are served in turn: each tenant has its own queue and the worker takes one request of each
tenant with requests waiting, so a tenant that floods the server waits behind its own requests. A
client that disconnects while its request waits for the model has it dropped from the queue (never
computed); one that leaves while it is computed has its answer discarded. /metrics records both
under status 499 (nothing is sent) and counts them in ``client_gone``, not as errors.

Limits (each a field of ``Limits`` and a flag; a refusal's message names the limit, its value and
its flag; docs/serving.md explains each). The key and the tenant's requests in flight are checked
from the headers, before any of the body is read::

    limit                                                  flag                      default     status
    body size in bytes (Content-Length and while reading)  --max-body-bytes          1 MiB       413
    time to send the whole body                            --body-timeout-s          30 s        408
    turns in one add                                       --max-turns-per-request   256         413
    characters of one turn                                 --max-turn-chars          20000       413
    characters of a question / last user message           --max-question-chars      4000        422
    options of one question                                --max-choices             26          422
    characters of one option                               --max-choice-chars        1000        422
    messages of one chat completion                        --max-messages            256         422
    characters of one chat message                         --max-message-chars       20000       422
    prompt tokens after templating (before queueing)       --max-prompt-tokens       4096        413
    max_new_tokens / max_tokens                            --max-new-tokens-limit    256         422
    requests waiting for the model, all tenants            --max-queue               1024        503
    requests of one tenant waiting for the model           --tenant-max-queued       32          429 + Retry-After
    requests of one tenant in flight                       --tenant-max-in-flight    64          429 + Retry-After
    memories (bank rows) of one tenant                     --tenant-max-rows         100000      507
    bytes on disk of one tenant's memories                 --tenant-max-bytes        16 GiB      507
    open connections (uvicorn limit_concurrency)           --limit-concurrency       1024        503
    idle keep-alive seconds (uvicorn timeout_keep_alive)   --timeout-keep-alive-s    5           closed

Also: malformed JSON 400; a missing or unknown field, a group name outside ``[A-Za-z0-9._:/-]{1,128}``
or text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``) 422; shutting down 503.
Without ``--api-keys`` all clients are one tenant for the per-tenant limits.
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
import typing
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


class TenantQueueFull(RuntimeError):
    """One tenant has ``Limits.tenant_max_queued`` requests waiting for the model already."""


class ServerStopping(RuntimeError):
    """The server shuts down; queued requests are not answered."""


class QuotaExceeded(RuntimeError):
    """An add would take a tenant past its memory quota (``Limits.tenant_max_rows`` / ``tenant_max_bytes``)."""


@dataclass
class _Job:
    kind: str  # "ask", "add" or "forget"
    payload: Any  # an AskRequest, or (group, turns)
    future: concurrent.futures.Future
    tenant: str | None = None
    enqueued: float = field(default_factory=time.perf_counter)


_STOP = object()


class ModelWorker:
    """The one thread that touches the model: batches concurrent asks, applies adds in order.

    Why one thread: the model is one torch module and the bank one set of files; running them from
    many request threads would serialise on LiveMemory's lock anyway, without batching. Each tenant
    has its own queue, and the worker takes one job from each tenant with jobs waiting in turn (round
    robin), so a tenant that floods the server waits behind its own requests, not the others behind
    it; one tenant's jobs stay in arrival order. A batch is what arrives within ``window_ms`` of its
    first job (at most ``max_batch``): its adds are applied first, in order, by one ``add_many``, then
    its asks are answered by one ``ask_many``. So an ask sent after an add was answered sees that add.
    """

    def __init__(self, live: Any, batching: Batching, max_queue: int = 1024, tenant_max_queued: int | None = None,
                 quota: "TenantQuota | None" = None) -> None:
        self.live = live
        self.batching = batching
        self.max_queue = max_queue
        self.tenant_max_queued = tenant_max_queued or max_queue
        self.quota = quota
        self._cv = threading.Condition()
        self._queues: dict[str | None, collections.deque[_Job]] = {}  # tenant -> its waiting jobs, in order
        self._turns: collections.deque[str | None] = collections.deque()  # tenants with jobs, next first
        self._size = 0
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
        self.adds_over_quota = 0
        self.forgets = 0
        self.memories_forgotten = 0
        self.forget_errors = 0
        self.withdrawn = 0
        self.busy_s = 0.0
        self.queue_wait: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)

    # -- lifecycle
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 60.0) -> None:
        """Refuse new jobs, finish the ones already queued, then end the thread (a graceful shutdown)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        while True:  # anything left (the thread died, or the join timed out): tell its waiters
            job = self._take(0.0)
            if job is None or job is _STOP:
                break
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(ServerStopping("the server is shutting down; the request was not answered"))

    def queued(self, tenant: Any = _STOP) -> int:
        """Jobs waiting: all of them, or one tenant's."""
        with self._cv:
            return self._size if tenant is _STOP else len(self._queues.get(tenant, ()))

    def mean_batch_s(self) -> float:
        with self._lock:
            n = self.ask_batches + self.add_batches
            return self.busy_s / n if n else 0.0

    # -- submitting
    def submit(self, kind: str, payload: Any, tenant: str | None = None) -> concurrent.futures.Future:
        """Queue one job of ``tenant``; its future gets the Answer / AddResult, or the exception raised."""
        with self._cv:
            if self._stopping:
                raise ServerStopping("the server is shutting down; retry on another instance or later")
            if self._size >= self.max_queue:
                raise QueueFull(f"server busy: {self.max_queue} requests are already waiting for the model "
                                "(--max-queue); retry later")
            mine = self._queues.get(tenant)
            if mine is not None and len(mine) >= self.tenant_max_queued:
                raise TenantQueueFull(f"too many requests of this tenant waiting for the model: the limit is "
                                      f"{self.tenant_max_queued} (--tenant-max-queued); retry later")
            job = _Job(kind, payload, concurrent.futures.Future(), tenant)
            if mine is None:
                mine = self._queues[tenant] = collections.deque()
                self._turns.append(tenant)
            mine.append(job)
            self._size += 1
            self._cv.notify()
        return job.future

    def withdraw(self, future: concurrent.futures.Future, tenant: str | None = None) -> bool:
        """Take a job whose client went away out of the queue; False when it already runs (or ran)."""
        with self._cv:
            mine = self._queues.get(tenant, ())
            job = next((j for j in mine if j.future is future), None)
            if job is None:
                return False
            mine.remove(job)
            self._size -= 1
            if not mine:
                del self._queues[tenant]
                self._turns.remove(tenant)
        future.cancel()
        with self._lock:
            self.withdrawn += 1
        return True

    # -- the thread
    def _take(self, timeout: float | None) -> Any:
        """The next job in round-robin order over tenants; None when none came within ``timeout``
        seconds (None = wait for one); ``_STOP`` once stopping with nothing left to do."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._size or self._stopping, timeout):
                return None
            if not self._size:
                return _STOP
            tenant = self._turns.popleft()
            mine = self._queues[tenant]
            job = mine.popleft()
            self._size -= 1
            if mine:
                self._turns.append(tenant)
            else:
                del self._queues[tenant]
            return job

    def _run(self) -> None:
        while True:
            first = self._take(None)
            if first is _STOP:
                return
            batch, stop = [first], False
            deadline = time.perf_counter() + self.batching.window_ms / 1000.0
            while len(batch) < self.batching.max_batch:
                # what is already queued is taken at once; then wait out the window
                job = self._take(max(0.0, deadline - time.perf_counter()))
                if job is None:
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
        # Deletes come after the adds and before the asks: an ask of the batch never sees a memory
        # forgotten in it (a delete of the same batch was sent before the ask was answered).
        runs = [[job for job in batch if job.kind == kind] for kind in ("add", "forget", "ask")]
        for run in runs:
            if not run:
                continue
            now = time.perf_counter()
            with self._lock:
                self.queue_wait.extend(now - job.enqueued for job in run)
            t0 = time.perf_counter()
            try:
                {"ask": self._asks, "add": self._adds, "forget": self._forgets}[run[0].kind](run)
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
            self._settle(job.future, answer, err)

    def _adds(self, run: list[_Job]) -> None:
        # A client that left while its add waited had it withdrawn from the queue. One that left in
        # the instant between its job being taken and run still gets it applied: a retry of it is
        # skipped as a duplicate, so applying it can never double it.
        jobs = [(job, job.future.set_running_or_notify_cancel()) for job in run]
        if self.quota is not None:  # checked here, in order, so that the adds of one batch count each other
            refusals = self.quota.refusals([(job.tenant, len(job.payload[1])) for job, _ in jobs])
            for (job, running), refusal in zip(jobs, refusals):
                if refusal is not None and running:
                    job.future.set_exception(QuotaExceeded(refusal))
            with self._lock:
                self.adds_over_quota += sum(r is not None for r in refusals)
            jobs = [jr for jr, refusal in zip(jobs, refusals) if refusal is None]
            if not jobs:
                return
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
            if running:
                self._settle(job.future, result, err)

    def _forgets(self, run: list[_Job]) -> None:
        # One at a time, in arrival order: each is its own commit (and purge). A client that left after
        # its delete was taken still has it applied: a retry then gets 404, the memory being gone.
        for job in run:
            running = job.future.set_running_or_notify_cancel()
            group, row, session = job.payload
            try:
                result, err = self.live.forget(group, row=row, session=session), None
            except Exception as e:
                result, err = None, e
            with self._lock:
                if err is None:
                    self.forgets += 1
                    self.memories_forgotten += result.deleted
                elif not isinstance(err, LookupError):  # a 404 is the client's, not a failure
                    self.forget_errors += 1
            if running:
                self._settle(job.future, result, err)

    @staticmethod
    def _settle(future: concurrent.futures.Future, result: Any, err: BaseException | None) -> None:
        """Give a job's waiter its result, or the error its request raised."""
        if err is None:
            future.set_result(result)
        else:
            future.set_exception(err)

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
                "adds_over_quota": self.adds_over_quota,
                "forgets": self.forgets,
                "memories_forgotten": self.memories_forgotten,
                "forget_errors": self.forget_errors,
                "withdrawn": self.withdrawn,
                "queue_depth": self.queued(),
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


# --------------------------------------------------------------------------- memory quotas


class TenantQuota:
    """A tenant's memory usage, from the bank, against ``Limits.tenant_max_rows`` / ``tenant_max_bytes``.

    A tenant's memories are the rows of every group its keys cover (the union of their patterns;
    a group two tenants may write counts for both). A row's bytes are its share of the shard file
    that holds it (cached states and keys: the file's bytes over its rows) plus its chunk text in
    UTF-8. Called from the model worker only (the one writer), so no lock: the bank cannot change
    under it except by another process's append, which the next check sees.
    """

    def __init__(self, live: Any, patterns: dict[str | None, tuple[str, ...]], max_rows: int | None,
                 max_bytes: int | None) -> None:
        self.live = live
        self.patterns = patterns
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self._covers: dict[tuple[str | None, str], bool] = {}
        self._text_bytes: dict[str, tuple[Any, int]] = {}  # group -> (its segments, their text bytes)
        self._bank: Any = None
        self._starts: list[int] = []

    def _covered(self, tenant: str | None, group: str) -> bool:
        k = (tenant, group)
        if k not in self._covers:
            self._covers[k] = any(fnmatch.fnmatchcase(group, p) for p in self.patterns.get(tenant, ()))
        return self._covers[k]

    def _shard_bytes(self, bank: Any, start: int, end: int) -> float:
        """Bytes of rows [start, end) as their shares of the shard files that hold them."""
        import bisect

        total, i = 0.0, bisect.bisect_right(self._starts, start) - 1
        while start < end and i < len(bank.shards):
            sh = bank.shards[i]
            stop = min(end, sh.start + sh.rows)
            if sh.rows:
                total += (stop - start) * sh.bytes / sh.rows
            start, i = stop, i + 1
        return total

    def usage(self, tenant: str | None) -> tuple[int, int]:
        """(rows, bytes) of the tenant's memories in the bank as it is now."""
        bank = self.live.bank
        if bank is not self._bank:
            self._bank, self._starts = bank, [sh.start for sh in bank.shards]
        rows, nbytes = 0, 0.0
        for group in list(bank.groups):
            if not self._covered(tenant, group):
                continue
            segments = bank.group_segments(group)
            cached = self._text_bytes.get(group)
            if cached is None or cached[0] != segments:  # rows added (or renumbered): count its text again
                chunks = bank.chunks()
                text = sum(len(chunks[r]["text"].encode("utf-8", "replace")) for a, b in segments for r in range(a, b))
                cached = self._text_bytes[group] = (segments, text)
            rows += sum(b - a for a, b in segments)
            nbytes += cached[1] + sum(self._shard_bytes(bank, a, b) for a, b in segments)
        return rows, int(nbytes)

    def refusals(self, adds: Sequence[tuple[str | None, int]]) -> list[str | None]:
        """For adds ``(tenant, turns)`` applied in this order: None for each one the quota admits, else
        the message that refuses it. An add may make one chunk per turn, so rows are checked against
        usage + turns (and the turns of the earlier admitted adds of the same tenant); bytes are known
        only once encoded, so an add is refused while the tenant is at or over its byte quota."""
        if self.max_rows is None and self.max_bytes is None:
            return [None] * len(adds)
        usage: dict[str | None, list[int]] = {}
        out: list[str | None] = []
        for tenant, turns in adds:
            if tenant not in usage:
                usage[tenant] = list(self.usage(tenant))
            rows, nbytes = usage[tenant]
            who = "this tenant" if tenant is None else f"tenant {tenant!r}"
            if self.max_rows is not None and rows + turns > self.max_rows:
                out.append(f"memory quota: {who} holds {rows} memories and this add may make {turns} more; the quota "
                           f"is {self.max_rows} memories (--tenant-max-rows)")
            elif self.max_bytes is not None and nbytes >= self.max_bytes:
                out.append(f"memory quota: {who} holds {nbytes} bytes of memory; the quota is {self.max_bytes} bytes "
                           "(--tenant-max-bytes)")
            else:
                usage[tenant][0] += turns
                out.append(None)
        return out


# --------------------------------------------------------------------------- metrics and limits (ASGI)


CLIENT_GONE = 499
"""The status /metrics records for a request whose client went away before its answer (nginx's
"client closed request"); nothing is sent, there is no one to send it to."""


class Metrics:
    """Request counts by (endpoint, status) and latency windows by endpoint, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.latency: dict[str, collections.deque[float]] = {}
        self.client_gone: collections.Counter[str] = collections.Counter()

    def record(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1
            if 200 <= status < 300:  # a refused request's speed says nothing about serving
                self.latency.setdefault(endpoint, collections.deque(maxlen=LATENCY_WINDOW)).append(seconds)

    def gone(self, stage: str) -> None:
        """A client went away: ``reading`` its body, while its job was ``queued`` (dropped, never run)
        or ``running`` (computed, answer discarded)."""
        with self._lock:
            self.client_gone[stage] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            by_endpoint: dict[str, dict[str, int]] = {}
            for (endpoint, status), n in sorted(self.requests.items()):
                by_endpoint.setdefault(endpoint, {})[str(status)] = n
            return {"requests": by_endpoint,
                    "latency_s": {e: _percentiles(d) for e, d in sorted(self.latency.items())},
                    "client_gone": {k: self.client_gone[k] for k in ("reading", "queued", "running")}}


class AuthError(ValueError):
    """No, a malformed or an unknown API key (401)."""


def authenticate(keys: dict[str, ApiKey], authorization: str | None) -> ApiKey:
    """The key an ``Authorization`` header value names, or AuthError saying what is wrong with it."""
    if not authorization:
        raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("malformed Authorization header: send 'Authorization: Bearer <key>'")
    key = keys.get(token.strip())
    if key is None:
        raise AuthError("unknown API key")
    return key


def _json_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> tuple[dict, bytes]:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *extra]}
    return start, body


class InFlight:
    """Requests of each tenant being handled now, against ``Limits.tenant_max_in_flight``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self.counts: collections.Counter[str | None] = collections.Counter()

    def acquire(self, tenant: str | None) -> bool:
        with self._lock:
            if self.counts[tenant] >= self.limit:
                return False
            self.counts[tenant] += 1
            return True

    def release(self, tenant: str | None) -> None:
        with self._lock:
            self.counts[tenant] -= 1
            if not self.counts[tenant]:
                del self.counts[tenant]


class _Gate:
    """Outermost ASGI layer, in this order: counts and times every request by route; checks the API
    key from the headers (401) and the tenant's requests in flight (429), both before a byte of the
    body is read; reads the body within ``body_timeout_s`` (408) and ``max_body_bytes`` (413, on the
    declared Content-Length and again while reading, since a chunked request declares none), then
    replays it to the app. A client that leaves while its body is read is counted, not answered.
    """

    def __init__(self, app: Callable, metrics: Metrics, limits: Limits, keys: dict[str, ApiKey] | None,
                 public: frozenset[str], in_flight: InFlight, retry_after: Callable[[str | None], int],
                 routes: Callable[[], list]) -> None:
        self.app = app
        self.metrics = metrics
        self.limits = limits
        self.keys = keys
        self.public = public
        self.in_flight = in_flight
        self.retry_after = retry_after
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

        holds: list[str | None] = []
        try:
            if scope["path"] not in self.public:
                key = None
                if self.keys is not None:
                    header = dict(scope.get("headers") or []).get(b"authorization")
                    try:
                        key = authenticate(self.keys, header.decode("latin-1") if header is not None else None)
                    except AuthError as e:
                        await self._refuse(send_measured, 401, str(e), "authentication_error",
                                           {"WWW-Authenticate": "Bearer"})
                        return
                    scope[SCOPE_KEY] = key
                tenant = key.tenant if key else None
                if not self.in_flight.acquire(tenant):
                    await self._refuse(send_measured, 429, f"too many requests of this tenant in flight: the limit is "
                                       f"{self.in_flight.limit} (--tenant-max-in-flight); retry later",
                                       "rate_limit_error", {"Retry-After": str(self.retry_after(tenant))})
                    return
                holds.append(tenant)
            body = await self._read_body(scope, receive, send_measured, status)
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
            for tenant in holds:
                self.in_flight.release(tenant)
            self.metrics.record(endpoint, status[0], time.perf_counter() - t0)

    async def _read_body(self, scope: dict, receive: Callable, send: Callable, status: list[int]) -> bytes | None:
        limit = self.limits.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await self._refuse(send, 400, "Content-Length is not a number", "invalid_request_error")
                return None
            if int(declared) > limit:
                await self._refuse(send, 413, f"request body of {int(declared)} bytes is over the limit of {limit} "
                                   "bytes (--max-body-bytes)", "request_too_large")
                return None

        async def read() -> tuple[str, bytes]:  # ("ok", body), ("gone", b"") or ("too large", b"")
            parts, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return "gone", b""
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return "too large", b""
                parts.append(chunk)
                if not message.get("more_body", False):
                    return "ok", b"".join(parts)

        try:
            outcome, body = await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            await self._refuse(send, 408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                               "(--body-timeout-s)", "timeout_error", {"Connection": "close"})
            return None
        if outcome == "gone":
            status[0] = CLIENT_GONE
            self.metrics.gone("reading")
            return None
        if outcome == "too large":
            await self._refuse(send, 413, f"request body is over the limit of {limit} bytes (--max-body-bytes)",
                               "request_too_large")
            return None
        return body

    @staticmethod
    async def _refuse(send: Callable, status: int, message: str, kind: str, headers: dict[str, str] | None = None
                      ) -> None:
        start, body = _json_error(status, message, kind, headers)
        await send(start)
        await send({"type": "http.response.body", "body": body})


SCOPE_KEY = "elasticmem.api_key"
"""Where ``_Gate`` leaves the caller's ApiKey in the ASGI scope for the endpoints."""


# --------------------------------------------------------------------------- the app


def _to_json(obj: Any) -> dict[str, Any]:
    return obj.to_json() if hasattr(obj, "to_json") else dataclasses.asdict(obj)


def _valid_text(text: str) -> str:
    """``text``, unless it cannot be UTF-8 (a lone surrogate such as JSON's "\\ud800"): then a ValueError
    (a 422), instead of a failure deep in the tokenizer or the response encoder (a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {e.start}") from None
    return text


def _request_models(limits: Limits) -> dict[str, type]:
    """The pydantic request bodies, with this server's limits in their field constraints (clear 422s)."""
    from typing import Annotated

    from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

    Text = Annotated[str, AfterValidator(_valid_text)]

    def token_limit() -> Any:  # one Field per field (and a name no class body assigns)
        return Field(default=None, ge=1, le=limits.max_new_tokens)

    class TurnIn(BaseModel):
        model_config = ConfigDict(extra="forbid")
        role: Text = Field(min_length=1, max_length=32, description="user, assistant, memory, or another label")
        # the length limit is checked by the endpoint, to answer 413 with the turn's index
        content: Text = Field(min_length=1)
        date: Text | None = Field(default=None, max_length=64)
        speaker: Text | None = Field(default=None, max_length=128)

    class AddBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        turns: list[TurnIn] = Field(min_length=1)

    class AskBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        group: str
        question: Text = Field(min_length=1, max_length=limits.max_question_chars)
        choices: list[Annotated[str, Field(min_length=1, max_length=limits.max_choice_chars),
                                AfterValidator(_valid_text)]] | None = Field(
            default=None, min_length=2, max_length=limits.max_choices)
        max_new_tokens: int | None = token_limit()

    class ChatMessage(BaseModel):
        model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: accepted, not read
        role: str
        content: str | list[dict[str, Any]] | None = None

        @field_validator("content")
        @classmethod
        def _bounded_text(cls, content: Any) -> Any:
            # every message, read or not: the text parts of a list count together
            texts = [content] if isinstance(content, str) else [
                p["text"] for p in content or () if isinstance(p, dict) and isinstance(p.get("text"), str)]
            for t in texts:
                _valid_text(t)
            n = sum(len(t) for t in texts)
            if n > limits.max_message_chars:
                raise ValueError(f"the message has {n} characters; the limit is {limits.max_message_chars} "
                                 "(--max-message-chars)")
            return content

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


class PromptCounter:
    """Prompt tokens of a question after templating, as the model will read it (``encode_prompt``:
    prompt(q) and suffix(u) with the options), with the server's own copy of the tokenizer: a fast
    tokenizer is one Rust object that the worker's chunking reconfigures (truncation), and using it
    from two threads at once can fail ("Already borrowed")."""

    def __init__(self, tokenizer: Any, cfg: Any) -> None:
        import copy

        from elasticmem.model.elasticmem import encode_prompt  # imported now, not by the first request

        self.tokenizer = copy.deepcopy(tokenizer)
        self.cfg = cfg
        self._encode = encode_prompt
        self._lock = threading.Lock()

    def __call__(self, question: str, choices: Sequence[str] | None) -> int:
        from elasticmem.data.schema import Example

        ex = Example(id="count", source="live", question=question, choices=list(choices or []),
                     answer_index=0 if choices else -1, question_type="live", history=[], group="count",
                     answer_text=None if choices else "")
        with self._lock:
            prompt, suffix = self._encode(self.tokenizer, self.cfg, ex)
        return len(prompt) + len(suffix)


def create_app(live: Any, keys: dict[str, ApiKey] | None = None, limits: Limits | None = None,
               batching: Batching | None = None, model_name: str | None = None, open_docs: bool = False) -> Any:
    """The FastAPI app serving ``live`` (a ``LiveMemory``); see the module docstring for the endpoints.

    ``keys`` None serves everyone (no tenants: all clients are one tenant for the per-tenant limits).
    ``open_docs`` serves /openapi.json and /docs without a key. The model worker starts with the app
    (lifespan) and finishes the queued jobs when it stops.
    """
    from contextlib import asynccontextmanager

    from fastapi import Depends, FastAPI, Query, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
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
    tokenizer = getattr(getattr(live, "model", None), "tokenizer", None)
    count_prompt = PromptCounter(tokenizer, live.model.cfg) if tokenizer is not None else None
    if count_prompt is None:
        log.warning("the live memory has no tokenizer: prompt tokens (--max-prompt-tokens) are not checked")
    patterns: dict[str | None, tuple[str, ...]] = {None: ("*",)}  # no keys: one tenant, every group
    if keys is not None:
        patterns = {}
        for k in keys.values():
            patterns[k.tenant] = tuple(dict.fromkeys(patterns.get(k.tenant, ()) + k.groups))
    quota = TenantQuota(live, patterns, limits.tenant_max_rows, limits.tenant_max_bytes)
    worker = ModelWorker(live, batching, limits.max_queue, limits.tenant_max_queued, quota)
    metrics = Metrics()
    in_flight = InFlight(limits.tenant_max_in_flight)

    def retry_after(tenant: str | None) -> int:
        """Seconds until the tenant's queued work has likely gone through the worker (1 to 60)."""
        batches = worker.queued(tenant) / batching.max_batch + 1
        return int(min(60, max(1, math.ceil(batches * worker.mean_batch_s()))))
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
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.limits = limits
    app.state.in_flight = in_flight
    # /health and /metrics hold no tenant data; the API's description is the API's: behind the key too
    public = {"/health", "/metrics"} | ({"/openapi.json", "/docs", "/docs/oauth2-redirect"} if open_docs else set())
    app.add_middleware(_Gate, metrics=metrics, limits=limits, keys=keys, public=frozenset(public),
                       in_flight=in_flight, retry_after=retry_after, routes=lambda: app.router.routes)

    # -- errors: one shape for all, {"error": {"message", "type", "code"}} (OpenAI clients read it)
    def error(status: int, message: str, kind: str, headers: dict[str, str] | None = None,
              **extra: Any) -> JSONResponse:
        headers = {**(headers or {}), **({"WWW-Authenticate": "Bearer"} if status == 401 else {})}
        return JSONResponse({"error": {"message": message, "type": kind, "code": status, **extra}}, status,
                            headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                 503: "overloaded_error", 507: "quota_exceeded"}
        return error(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "server_error"),
                     headers=dict(exc.headers or {}))

    class ClientGone(Exception):
        """The client went away while its request waited for the model."""

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_GONE)  # for /metrics; the server has no one to send it to

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
    def caller(request: Request) -> ApiKey | None:
        """The key ``_Gate`` checked from the headers before the body was read (None: an open server)."""
        if keys is None:
            return None
        key = request.scope.get(SCOPE_KEY)
        if key is None:  # not reachable through _Gate; refused rather than served without a tenant
            raise HTTPException(401, "missing API key: send 'Authorization: Bearer <key>'")
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

    async def client_left(request: Request) -> None:
        """Returns when the client disconnects (the server's receive says so once the body is read)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def run_model(request: Request, key: ApiKey | None, kind: str, payload: Any) -> Any:
        tenant = key.tenant if key else None
        try:
            future = worker.submit(kind, payload, tenant)
        except (QueueFull, ServerStopping) as e:
            raise HTTPException(503, str(e)) from None
        except TenantQueueFull as e:
            raise HTTPException(429, str(e), headers={"Retry-After": str(retry_after(tenant))}) from None
        result = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(client_left(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not result.done():  # the client left first: drop its job, or discard the answer being computed
            metrics.gone("queued" if worker.withdraw(future, tenant) else "running")
            result.cancel()
            raise ClientGone()
        try:
            return result.result()
        except (QueueFull, ServerStopping) as e:
            raise HTTPException(503, str(e)) from None
        except QuotaExceeded as e:
            raise HTTPException(507, str(e)) from None
        except LookupError as e:  # LiveMemory.forget: no such memory (MemoryNotFound)
            raise HTTPException(404, str(e)) from None
        except ValueError as e:  # LiveMemory refuses bad input with ValueError (e.g. a turn it cannot chunk)
            raise HTTPException(422, str(e)) from None
        except Exception as e:
            log.exception("%s failed", kind)
            raise HTTPException(500, f"internal error while answering ({type(e).__name__}: {e})") from None

    async def ask(request: Request, key: ApiKey | None, group: str, question: str, choices: list[str] | None,
                  max_new_tokens: int | None) -> Any:
        from elasticmem.live import AskRequest

        if count_prompt is not None:  # before queueing: one long prompt must not hold the worker
            n = await asyncio.to_thread(count_prompt, question, choices)
            if n > limits.max_prompt_tokens:
                raise HTTPException(413, f"the prompt is {n} tokens after templating (question"
                                    f"{' and options' if choices else ''}); the limit is {limits.max_prompt_tokens} "
                                    "tokens (--max-prompt-tokens)")
        answer = await run_model(request, key, "ask", AskRequest(group=group, question=question, choices=choices,
                                                                 max_new_tokens=max_new_tokens))
        foreign = [m for m in answer.memories if m.group != group]
        if foreign:  # defence in depth: the model searches one group; never return another's memory
            log.error("ask for group %r retrieved %d memories of other groups; answer withheld", group, len(foreign))
            raise HTTPException(500, "internal error: retrieval crossed a memory-group boundary; answer withheld")
        return answer

    # -- endpoints
    @app.post("/v1/memory/{group:path}")
    async def add_memory(request: Request, group: str, body: AddBody, key: ApiKey | None = Depends(caller)) -> dict:
        group = authorize(group, key, "the path")
        if len(body.turns) > limits.max_turns_per_request:
            raise HTTPException(413, f"{len(body.turns)} turns in one request; the limit is "
                                f"{limits.max_turns_per_request} (--max-turns-per-request)")
        for i, t in enumerate(body.turns):
            if len(t.content) > turn_limit:
                raise HTTPException(413, f"turns[{i}].content has {len(t.content)} characters; the limit is "
                                    f"{turn_limit} (--max-turn-chars)")
        turns = [t.model_dump(exclude_none=True) for t in body.turns]
        return _to_json(await run_model(request, key, "add", (group, turns)))

    @app.get("/v1/memory/{group:path}")
    async def list_memory(group: str, key: ApiKey | None = Depends(caller)) -> dict:
        group = authorize(group, key, "the path")
        # listing reads the chunk table, not the model: no need to queue behind the asks
        return {"group": group, "chunks": await asyncio.to_thread(live.chunks, group)}

    @app.delete("/v1/memory/{group:path}")
    async def forget_memory(request: Request, group: str, key: ApiKey | None = Depends(caller),
                            row: int | None = Query(None, ge=0, description="one memory: its row id"),
                            session: int | None = Query(None, ge=0, description="every memory of one session")
                            ) -> dict:
        # query parameters, not sub-paths: a group name may hold "/", so ".../sessions/3" could be a group
        group = authorize(group, key, "the path")
        if row is not None and session is not None:
            raise HTTPException(422, "give row (one memory) or session (one session), not both")
        return _to_json(await run_model(request, key, "forget", (group, row, session)))

    @app.post("/v1/ask")
    async def ask_endpoint(request: Request, body: AskBody, key: ApiKey | None = Depends(caller)) -> dict:
        group = authorize(body.group, key)
        return _to_json(await ask(request, key, group, body.question, body.choices, body.max_new_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody, key: ApiKey | None = Depends(caller)) -> dict:
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
        answer = await ask(request, key, group, question, None, limit)
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


def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


_optional_int.__name__ = "int"  # its metavar: INT (or the word none)


def _limit_flags() -> list[tuple[str, str, Callable[[str], Any], Any, str]]:
    """(field, --flag, type, default, doc) of every ``Limits`` field: the flags are the dataclass."""
    from elasticmem.utils.configuration import field_docs

    docs, hints = field_docs(Limits), typing.get_type_hints(Limits)
    out = []
    for f in dataclasses.fields(Limits):
        flag = "--max-new-tokens-limit" if f.name == "max_new_tokens" else "--" + f.name.replace("_", "-")
        tp = {int: int, float: float}.get(hints[f.name], _optional_int)
        out.append((f.name, flag, tp, f.default, docs.get(f.name, "")))
    return out


def _parser() -> argparse.ArgumentParser:
    from elasticmem.utils.configuration import command_name

    p = argparse.ArgumentParser(prog=command_name("python -m elasticmem.serve"), description=__doc__,
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
    p.add_argument("--open-docs", action="store_true",
                   help="serve /openapi.json and /docs without an API key (default: they need one, as the API does)")
    limits = p.add_argument_group("limits", "each help says the status a request over it gets; docs/serving.md")
    for name, flag, tp, default, doc in _limit_flags():
        limits.add_argument(flag, dest=name, type=tp, default=default, metavar=tp.__name__.upper(),
                            help=f"{' '.join(doc.split())} (default: {default})")
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
    for name, flag, _, _, _ in _limit_flags():
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            print(f"{flag} must be > 0", file=sys.stderr)
            return 2
    if args.max_batch < 1 or args.batch_window_ms < 0:
        print("--max-batch must be >= 1 and --batch-window-ms >= 0", file=sys.stderr)
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
    limits = Limits(**{name: getattr(args, name) for name, *_ in _limit_flags()})
    app = create_app(live, keys, limits, batching, args.model_name, open_docs=args.open_docs)
    log.info("serving %s memory from %s on http://%s:%d (%s tenants)", live.system, args.bank, args.host, args.port,
             len({k.tenant for k in keys.values()}) if keys else "no")
    # one process: the model and the bank live in it (uvicorn workers would each load their own)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=not args.no_access_log,
                workers=1, limit_concurrency=limits.limit_concurrency, timeout_keep_alive=limits.timeout_keep_alive_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
