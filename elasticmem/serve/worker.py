"""The one model worker thread: per-tenant queues served in turn, asks batched within a window, adds
applied in arrival order (one disk write a batch), requests whose client left dropped.

The package's docstring (``elasticmem/serve/__init__.py``) describes the server and its API.
"""

import collections
import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from elasticmem.serve.quota import TenantQuota
from elasticmem.serve.settings import LATENCY_WINDOW, Batching

log = logging.getLogger("elasticmem.serve")

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
    cost: int = 0
    """Prompt tokens of an ask (0 when not counted): what ``Batching.max_batch_tokens`` bounds."""
    enqueued: float = field(default_factory=time.perf_counter)


_STOP = object()
_NOBODY = object()


class ModelWorker:
    """The one thread that touches the model: batches concurrent asks, applies adds in order.

    Why one thread: the model is one torch module and the bank one set of files; running them from
    many request threads would serialise on LiveMemory's lock anyway, without batching. Each tenant
    has its own queue, and the worker takes one job from each tenant with jobs waiting in turn (round
    robin), so a tenant that floods the server waits behind its own requests, not the others behind
    it; one tenant's jobs stay in arrival order. A batch is what arrives within ``window_ms`` of its
    first job (at most ``max_batch``): its adds are applied first, in order, by one ``add_many``, then
    its asks are answered by one ``ask_many``. So an ask sent after an add was answered sees that add.

    What one tenant's requests cost the others is bounded twice. A batch holds at most
    ``max_batch_tokens`` prompt tokens (its first job always fits), which bounds the forward passes
    nothing can interrupt (reading the questions and the prompt); and once a batch of asks has run
    ``slice_ms``, it lets the other tenants' waiting requests run between two of its decoding steps,
    one batch of theirs per step (``generation.step_gate``), and between two chunks of a long prompt
    (``prefill_chunk``), so a tenant that floods the server with maximal questions holds another
    tenant's short one for about one step or one chunk, not for its whole batch.
    The nested batch itself is not interrupted; the tenants of the running batch wait their turn.
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
        self.preemptions = 0
        self._nested = False  # in a batch run between the decoding steps of another (only that thread reads it)
        self._nested_s = 0.0  # seconds spent in such batches: not the interrupted batch's busy time
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
    def submit(self, kind: str, payload: Any, tenant: str | None = None, cost: int = 0) -> concurrent.futures.Future:
        """Queue one job of ``tenant`` (``cost``: an ask's prompt tokens); its future gets the
        Answer / AddResult, or the exception raised."""
        with self._cv:
            if self._stopping:
                raise ServerStopping("the server is shutting down; retry on another instance or later")
            if self._size >= self.max_queue:
                raise QueueFull(f"server busy: {self.max_queue} requests are already waiting for the model "
                                "(--max-queue); retry later")
            full = self.tenant_queue_full(tenant)
            if full:
                raise TenantQueueFull(full)
            mine = self._queues.get(tenant)
            job = _Job(kind, payload, concurrent.futures.Future(), tenant, cost)
            if mine is None:
                mine = self._queues[tenant] = collections.deque()
                self._turns.append(tenant)
            mine.append(job)
            self._size += 1
            self._cv.notify()
        return job.future

    def tenant_queue_full(self, tenant: str | None) -> str | None:
        """Why a new job of ``tenant`` would be refused for its share of the queue, or None (the
        server asks from a request's headers too, before reading its body)."""
        with self._cv:
            if len(self._queues.get(tenant, ())) < self.tenant_max_queued:
                return None
        return (f"too many requests of this tenant waiting for the model: the limit is {self.tenant_max_queued} "
                "(--tenant-max-queued); retry later")

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
    def _take(self, timeout: float | None, budget: float = math.inf, exclude: frozenset = frozenset()) -> Any:
        """The next job in round-robin order over the tenants not in ``exclude``; None when none came
        within ``timeout`` seconds (None = wait for one) or the next one costs more than ``budget``
        (it stays first in line); ``_STOP`` once stopping with nothing left to do."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._size or self._stopping, timeout):
                return None
            if not self._size:
                return _STOP
            tenant = next((t for t in self._turns if t not in exclude), _NOBODY)
            if tenant is _NOBODY or self._queues[tenant][0].cost > budget:
                return None
            self._turns.remove(tenant)
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
            batch, stop = self._fill(first, self.batching.window_ms / 1000.0)
            self._process(batch)
            if stop:
                return

    def _fill(self, first: _Job, window_s: float, exclude: frozenset = frozenset()) -> tuple[list[_Job], bool]:
        """The batch that starts with ``first``: what is already queued is taken at once, then what
        arrives within ``window_s``, up to ``max_batch`` jobs and ``max_batch_tokens`` prompt
        tokens; and whether the worker is stopping."""
        batch = [first]
        budget = (self.batching.max_batch_tokens or math.inf) - first.cost
        deadline = time.perf_counter() + window_s
        while len(batch) < self.batching.max_batch:
            job = self._take(max(0.0, deadline - time.perf_counter()), budget, exclude)
            if job is None:
                break
            if job is _STOP:
                return batch, True
            batch.append(job)
            budget -= job.cost
        return batch, False

    def _gate(self, tenants: frozenset) -> Callable[[], None] | None:
        """The step gate of a batch of ``tenants``' asks (``generation.step_gate``): past
        ``slice_ms``, each call runs one batch of the other tenants' waiting jobs, if any."""
        if self.batching.slice_ms is None or self._nested:
            return None
        preemptible = getattr(self.live, "preemptible", None)
        if preemptible is None:  # a memory that does not say its model state survives nested work
            return None
        start = time.perf_counter() + self.batching.slice_ms / 1000.0

        def gate() -> None:
            if time.perf_counter() < start or not preemptible():
                return
            first = self._take(0.0, exclude=tenants)
            if first is None or first is _STOP:  # stopping: the loop sees _STOP again once the queue is empty
                return
            batch, _ = self._fill(first, 0.0, tenants)  # no window: the interrupted batch is waiting
            self._nested, t0 = True, time.perf_counter()
            try:
                self._process(batch)
            finally:
                self._nested = False
                self._nested_s += time.perf_counter() - t0
            with self._lock:
                self.preemptions += 1

        return gate

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
            t0, nested0 = time.perf_counter(), self._nested_s
            try:
                {"ask": self._asks, "add": self._adds, "forget": self._forgets}[run[0].kind](run)
            except BaseException as e:  # never leave a waiter hanging, whatever happened
                log.exception("model worker: unexpected failure")
                for job in run:
                    if not job.future.done():
                        job.future.set_exception(e)
            finally:
                with self._lock:
                    self.busy_s += time.perf_counter() - t0 - (self._nested_s - nested0)

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
        from elasticmem.model.generation import step_gate

        with step_gate(self._gate(frozenset(job.tenant for job in live_jobs)), self.batching.prefill_chunk):
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
                "preemptions": self.preemptions,
                "queue_depth": self.queued(),
                "queue_wait_s": percentiles(self.queue_wait),
                "worker_busy_s": round(self.busy_s, 3),
                "uptime_s": round(time.time() - self.started, 3),
            }


def percentiles(values: Sequence[float] | collections.deque) -> dict[str, float | int]:
    """p50 / p95 by nearest rank (no interpolation: every figure is a latency that happened)."""
    v = sorted(values)
    if not v:
        return {"n": 0, "p50": 0.0, "p95": 0.0}
    def rank(q: float) -> float:
        return v[min(len(v), max(1, math.ceil(q * len(v)))) - 1]

    return {"n": len(v), "p50": round(rank(0.50), 6), "p95": round(rank(0.95), 6)}
