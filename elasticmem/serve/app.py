"""The FastAPI app: request models with their limits, the routes, and the errors' JSON form.

The package's docstring (``elasticmem/serve/__init__.py``) describes the server and its API.
"""

import asyncio
import collections
import dataclasses
import logging
import math
import sys
import threading
import time
import uuid
from typing import Any, Sequence

from elasticmem.serve.asgi import CLIENT_GONE, SCOPE_KEY, Gate, InFlight, Metrics
from elasticmem.serve.auth import ApiKey
from elasticmem.serve.quota import TenantQuota
from elasticmem.serve.settings import GROUP_RE, Batching, Limits
from elasticmem.serve.worker import ModelWorker, QueueFull, QuotaExceeded, ServerStopping, TenantQueueFull

log = logging.getLogger("elasticmem.serve")

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

        from elasticmem.model.prompt import encode_prompt  # imported now, not by the first request

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
    # one prompt of a tenant tokenized at a time: a burst of one tenant's maximal prompts then queues
    # behind itself in the thread pool, not in front of the other tenants' prompts
    tokenizing: collections.defaultdict[str | None, asyncio.Semaphore] = collections.defaultdict(asyncio.Semaphore)
    app.add_middleware(Gate, metrics=metrics, limits=limits, keys=keys, public=frozenset(public),
                       in_flight=in_flight, retry_after=retry_after, routes=lambda: app.router.routes,
                       queue_full=worker.tenant_queue_full)

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
        """The key ``Gate`` checked from the headers before the body was read (None: an open server)."""
        if keys is None:
            return None
        key = request.scope.get(SCOPE_KEY)
        if key is None:  # not reachable through Gate; refused rather than served without a tenant
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

    async def run_model(request: Request, key: ApiKey | None, kind: str, payload: Any, cost: int = 0) -> Any:
        tenant = key.tenant if key else None
        try:
            future = worker.submit(kind, payload, tenant, cost)
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

        n = 0
        if count_prompt is not None:  # before queueing: one long prompt must not hold the worker
            async with tokenizing[key.tenant if key else None]:
                n = await asyncio.to_thread(count_prompt, question, choices)
            if n > limits.max_prompt_tokens:
                raise HTTPException(413, f"the prompt is {n} tokens after templating (question"
                                    f"{' and options' if choices else ''}); the limit is {limits.max_prompt_tokens} "
                                    "tokens (--max-prompt-tokens)")
        answer = await run_model(request, key, "ask", AskRequest(group=group, question=question, choices=choices,
                                                                 max_new_tokens=max_new_tokens), cost=n)
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
