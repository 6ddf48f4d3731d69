"""What runs before a route: /metrics counters, requests in flight per tenant, and the ASGI gate that
checks the key and the limits from the headers before any of the body is read.

The package's docstring (``elasticmem/serve/__init__.py``) describes the server and its API.
"""

import asyncio
import collections
import json
import threading
import time
from typing import Any, Callable

from elasticmem.serve.auth import ApiKey, AuthError, authenticate
from elasticmem.serve.settings import LATENCY_WINDOW, Limits
from elasticmem.serve.worker import percentiles

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
                    "latency_s": {e: percentiles(d) for e, d in sorted(self.latency.items())},
                    "client_gone": {k: self.client_gone[k] for k in ("reading", "queued", "running")}}


def json_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> tuple[dict, bytes]:
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


class Gate:
    """Outermost ASGI layer, in this order: counts and times every request by route; checks the API
    key from the headers (401), the tenant's requests in flight and, for a request that queues model
    work (POST, DELETE), its share of the queue (429), all before a byte of the body is read; reads
    the body within ``body_timeout_s`` (408) and ``max_body_bytes`` (413, on the declared
    Content-Length and again while reading, since a chunked request declares none), then
    replays it to the app. A client that leaves while its body is read is counted, not answered.
    """

    def __init__(self, app: Callable, metrics: Metrics, limits: Limits, keys: dict[str, ApiKey] | None,
                 public: frozenset[str], in_flight: InFlight, retry_after: Callable[[str | None], int],
                 routes: Callable[[], list], queue_full: Callable[[str | None], str | None] | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.limits = limits
        self.keys = keys
        self.public = public
        self.in_flight = in_flight
        self.retry_after = retry_after
        self.routes = routes
        self.queue_full = queue_full
        """Why a tenant's next model job would be refused for its share of the queue (None: it fits):
        a flooding tenant's requests are then refused before their bodies are read, parsed and their
        prompts tokenized, work that would take the CPU from the other tenants."""

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
                full = self.queue_full(tenant) if self.queue_full and scope["method"] in ("POST", "DELETE") else None
                if full:
                    await self._refuse(send_measured, 429, full, "rate_limit_error",
                                       {"Retry-After": str(self.retry_after(tenant))})
                    return
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
        start, body = json_error(status, message, kind, headers)
        await send(start)
        await send({"type": "http.response.body", "body": body})


SCOPE_KEY = "elasticmem.api_key"
"""Where ``Gate`` leaves the caller's ApiKey in the ASGI scope for the endpoints."""
