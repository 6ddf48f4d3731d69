"""The server's limits and failure paths (elasticmem.serve), in process: the app over httpx's ASGI
transport, most tests with a rule-based memory in place of a model (no forward pass), so the whole
file takes seconds; the quota tests use the real LiveMemory on the tiny random model.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_serve_limits.py

Covers every ``Limits`` field with its status code and message (body bytes, body deadline, turns,
question, options, messages, prompt tokens after templating, answer tokens, queue, a tenant's
queued requests (refused from the headers once its share is full) and requests in flight with
Retry-After, memory quotas in rows and bytes), the API
key checked before the body is read, /openapi.json and /docs behind the key, lone surrogates
(4xx, not 500), a client that leaves (its job dropped from the queue and counted in /metrics as 499,
not 500), one poisoned request in a batch of 8, shutdown (503), the tenants taken in turn, a memory
of another group withheld, and finish_reason; DELETE of one memory, a session or a group by its
tenant only (401 without a key, 403 for another tenant's group, 404 for a memory the group does not
hold), gone from listings, answers and the bank's files, and no longer counted by the quota; and,
on the real text-RAG memory over a FAISS index (flat, ivf), from every copy the server holds
(tests/forget_support.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from serve_support import require_serve_extra

from elasticmem.live import AddResult, Answer, Memory

KEY_A = "sk-tenant-a-0123456789"
KEY_B = "sk-tenant-b-9876543210"
ANSWER_WORDS = ["one", "two", "three", "four", "five"]
"""What the rule-based memory answers: one token per word, cut at max_new_tokens."""
WAIT_S = 300.0
"""How long a test waits for something that takes milliseconds: generous, for a loaded machine."""


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer():
    from elasticmem.backbone import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(autouse=True)
def _serve_extra():
    require_serve_extra()


class RuleMemory:
    """The surface of ``LiveMemory`` that the server uses, answering by rule instead of by model.

    Clearing ``gate`` makes the worker's next call block (the model "busy") until it is set again;
    ``entered`` is set once a call began. A question containing "poison" fails its whole batch (as a
    bad input would), "leak" answers with a memory of another group. ``seen`` lists every question
    the "model" computed, in order; ``batches`` the size of every ``ask_many`` call.
    """

    system = "elasticmem"
    max_turn_chars = 20_000

    def __init__(self) -> None:
        from elasticmem.config import MemoryConfig

        self.model = SimpleNamespace(cfg=MemoryConfig(max_new_tokens=4), tokenizer=_tiny_tokenizer())
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.seen: list[str] = []
        self.batches: list[int] = []
        self.texts: dict[str, list[str]] = {}

    def _wait(self) -> None:
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test never released the worker"

    def ask_many(self, requests):
        self._wait()
        self.batches.append(len(requests))
        if any("poison" in r.question for r in requests):
            raise ValueError("this question is poisoned")
        out = []
        for r in requests:
            self.seen.append(r.question)
            n = min(len(ANSWER_WORDS), r.max_new_tokens or self.model.cfg.max_new_tokens)
            mems = [Memory(i, i, r.group, 0.5, 4, 4, t) for i, t in enumerate(self.texts.get(r.group, []))]
            if "leak" in r.question:
                mems.append(Memory(len(mems), 99, "b/secret", 0.9, 4, 4, "the other tenant's secret"))
            mem_tokens = sum(m.tokens for m in mems)
            out.append(Answer(r.group, r.question, " ".join(ANSWER_WORDS[:n]), mems, 7, mem_tokens, n,
                              7 + mem_tokens + n, {"total": 0.0}))
        return out

    def add_many(self, items):
        self._wait()
        results = []
        for group, turns in items:
            rows = self.texts.setdefault(group, [])
            rows.append(" ".join(t["content"] for t in turns))
            results.append(AddResult(group, 1, 0, [len(rows) - 1]))
        return results

    def chunks(self, group):
        return [{"row": i, "group": group, "text": t} for i, t in enumerate(self.texts.get(group, []))]


def _keys():
    from elasticmem.serve import ApiKey

    return {KEY_A: ApiKey("a", ("a/*",)), KEY_B: ApiKey("b", ("b/*",))}


@contextlib.asynccontextmanager
async def served(app):
    """The app started (its lifespan: the model worker) and an httpx client per tenant key."""
    import httpx

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        clients = {name: httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30,
                                           headers={"Authorization": f"Bearer {key}"} if key else {})
                   for name, key in (("a", KEY_A), ("b", KEY_B), ("anon", None))}
        try:
            yield SimpleNamespace(**clients, app=app, worker=app.state.worker)
        finally:
            for c in clients.values():
                await c.aclose()


def make_app(memory=None, keys=True, **limits):
    from elasticmem.serve import Batching, Limits, create_app

    batching = limits.pop("batching", Batching(max_batch=8, window_ms=0.0))
    open_docs = limits.pop("open_docs", False)
    lim = Limits(**{"tenant_max_rows": None, "tenant_max_bytes": None, **limits})
    return create_app(memory or RuleMemory(), _keys() if keys else None, lim, batching, open_docs=open_docs)


async def until(predicate, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


async def hold(s, mem: RuleMemory) -> asyncio.Future:
    """Make the worker busy: tenant a's question "held" is being computed until ``mem.gate`` is set."""
    mem.gate.clear()
    held = asyncio.ensure_future(s.a.post("/v1/ask", json=ask(question="held")))
    await until(mem.entered.is_set)
    return held


def refused(r, status: int, *needles: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()  # always JSON with a message (never an encoder failure)
    message = body["error"]["message"]
    for needle in needles:
        assert needle in message, (needle, message)
    return body


def ask(group="a/x", question="where is it?", **extra) -> dict:
    return {"group": group, "question": question, **extra}


def run(coro):
    return asyncio.run(coro)


# --------------------------------------------------------------------------- request limits


def test_every_size_limit_answers_its_status_and_names_its_flag():
    mem = RuleMemory()
    app = make_app(mem, max_body_bytes=4000, max_turns_per_request=3, max_turn_chars=50, max_question_chars=40,
                   max_choices=4, max_choice_chars=10, max_messages=3, max_message_chars=50, max_new_tokens=8)

    async def main():
        async with served(app) as s:
            a = s.a
            refused(await a.post("/v1/memory/a/x", json={"turns": [{"role": "user", "content": "x" * 4000}]}),
                    413, "4000", "--max-body-bytes")

            async def chunked():  # no Content-Length: refused while reading
                for _ in range(5):
                    yield b" " * 1000
            refused(await a.post("/v1/ask", content=chunked(), headers={"Content-Type": "application/json"}),
                    413, "over the limit of 4000 bytes", "--max-body-bytes")
            refused(await a.post("/v1/memory/a/x", json={"turns": [{"role": "user", "content": "x"}] * 4}),
                    413, "4 turns", "limit is 3", "--max-turns-per-request")
            refused(await a.post("/v1/memory/a/x", json={"turns": [{"role": "user", "content": "x" * 51}]}),
                    413, "turns[0].content has 51 characters", "limit is 50", "--max-turn-chars")
            refused(await a.post("/v1/ask", json=ask(question="q" * 41)), 422, "question", "40 characters")
            refused(await a.post("/v1/ask", json=ask(choices=list("abcde"))), 422, "choices", "at most 4")
            refused(await a.post("/v1/ask", json=ask(choices=["short", "x" * 11])), 422, "choices.1",
                    "at most 10 characters")
            refused(await a.post("/v1/ask", json=ask(max_new_tokens=9)), 422, "max_new_tokens", "less than or equal to 8")
            chat = {"memory_group": "a/x"}
            refused(await a.post("/v1/chat/completions", json={
                **chat, "messages": [{"role": "user", "content": "hi"}] * 4}), 422, "messages", "at most 3")
            refused(await a.post("/v1/chat/completions", json={**chat, "messages": [
                {"role": "system", "content": "s" * 51}, {"role": "user", "content": "hi"}]}), 422,
                "messages.0.content", "51 characters", "limit is 50", "--max-message-chars")
            refused(await a.post("/v1/chat/completions", json={**chat, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "t" * 30}, {"type": "text", "text": "u" * 21}]}]}),
                422, "51 characters", "--max-message-chars")
            refused(await a.post("/v1/chat/completions", json={**chat, "messages": [
                {"role": "user", "content": "q" * 41}]}), 422, "the question has 41 characters", "--max-question-chars")
            # within every limit: answered (the limits are not refusing everything)
            ok = await a.post("/v1/ask", json=ask(choices=["red", "blue"], max_new_tokens=8))
            assert ok.status_code == 200, ok.text
        assert mem.seen == ["where is it?"]  # nothing refused reached the model

    run(main())


def test_prompt_tokens_are_counted_after_templating_before_the_request_is_queued():
    # The tiny tokenizer falls back to one token per character (for a word of at most 100), so 26
    # options of 30 letters make a prompt of at least 26 x 30 = 780 tokens, whatever the template adds.
    mem = RuleMemory()
    app = make_app(mem, max_prompt_tokens=300, max_choice_chars=40)
    letters = "abcdefghijklmnopqrstuvwxyz"
    long_options = [(c * 30) for c in letters]

    async def main():
        async with served(app) as s:
            blocker = await hold(s, mem)  # a refused request must be refused without waiting for the worker
            r = await asyncio.wait_for(s.a.post("/v1/ask", json=ask(choices=long_options)), WAIT_S)
            body = refused(r, 413, "tokens after templating", "the limit is 300 tokens", "--max-prompt-tokens")
            n = int(body["error"]["message"].split("the prompt is ")[1].split()[0])
            assert n >= 26 * 30
            assert s.worker.queued() == 0  # never queued
            refused(await s.a.post("/v1/chat/completions", json={
                "memory_group": "a/x", "messages": [{"role": "user", "content": "w " * 301}]}), 413,
                "--max-prompt-tokens")
            mem.gate.set()
            assert (await blocker).status_code == 200
            short = await s.a.post("/v1/ask", json=ask(choices=long_options[:4]))  # ~4 x 30 tokens: under
            assert short.status_code == 200, short.text
        assert mem.seen == ["held", "where is it?"]

    run(main())


def test_lone_surrogates_get_422_not_500():
    mem = RuleMemory()
    app = make_app(mem)
    raw = {"Content-Type": "application/json"}

    async def main():
        async with served(app) as s:
            for path, body in (
                    ("/v1/ask", b'{"group": "a/x", "question": "where is \\ud800 it?"}'),
                    ("/v1/ask", b'{"group": "a/x", "question": "q", "choices": ["ok", "\\udfff"]}'),
                    ("/v1/memory/a/x", b'{"turns": [{"role": "user", "content": "a\\ud800"}]}'),
                    ("/v1/chat/completions",
                     b'{"memory_group": "a/x", "messages": [{"role": "user", "content": "hi \\ud800"}]}'),
                    ("/v1/chat/completions", b'{"memory_group": "a/x", "messages": [{"role": "user", "content": '
                                             b'[{"type": "text", "text": "\\udbff"}]}]}'),
                    ("/v1/chat/completions", b'{"memory_group": "a/x", "messages": [{"role": "system", "content": '
                                             b'"\\ud800"}, {"role": "user", "content": "fine"}]}')):
                # refused by pydantic's string check or by the server's own (text parts, which pydantic
                # types as Any), in both cases a 422 that says what is wrong
                message = refused(await s.a.post(path, content=body, headers=raw), 422)["error"]["message"]
                assert "surrogate" in message or "unicode" in message, message
            # a surrogate pair is one valid character, answered
            r = await s.a.post("/v1/ask", content=b'{"group": "a/x", "question": "emoji \\ud83d\\ude00?"}', headers=raw)
            assert r.status_code == 200 and r.json()["question"] == "emoji \U0001F600?", r.text
        assert mem.seen == ["emoji \U0001F600?"]
        assert "500" not in json.dumps(app.state.metrics.snapshot()["requests"])

    run(main())


# --------------------------------------------------------------------------- keys, bodies, docs


async def _call(app, method: str, path: str, headers: dict[str, str], receive):
    """One raw ASGI request: (status, headers, body) of the response the app sends."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return (start["status"] if start else None), dict(start["headers"]) if start else {}, body


def _body_never_sent():
    """A receive() whose body never arrives, and the list it appends to each time it is awaited."""
    reads: list[int] = []

    async def receive():
        reads.append(1)
        await asyncio.sleep(3600)

    return reads, receive


async def _refused_unread(app, method: str, path: str, receive, flag: str) -> None:
    """Tenant a's request is answered 429 with Retry-After, naming ``flag``, from its headers alone."""
    status, hdrs, body = await asyncio.wait_for(
        _call(app, method, path, {"Authorization": f"Bearer {KEY_A}"}, receive), WAIT_S)
    assert status == 429 and int(hdrs[b"retry-after"]) >= 1, (method, path, status)
    assert flag in json.loads(body)["error"]["message"]


def test_the_key_and_the_tenants_requests_in_flight_are_checked_before_the_body_is_read():
    mem = RuleMemory()
    app = make_app(mem, tenant_max_in_flight=1)
    reads, never_sends_a_body = _body_never_sent()

    async def main():
        async with served(app) as s:
            for headers, why in (({}, "missing API key"), ({"Authorization": "Bearer sk-unknown-000000"}, "unknown"),
                                 ({"Authorization": "Basic x"}, "malformed")):
                status, hdrs, body = await asyncio.wait_for(
                    _call(app, "POST", "/v1/ask", {**headers, "content-type": "application/json"}, never_sends_a_body),
                    WAIT_S)
                assert status == 401 and why in json.loads(body)["error"]["message"]
                assert hdrs[b"www-authenticate"] == b"Bearer"
            # tenant a has one request in flight (held by the busy worker): the next is refused unread
            held = await hold(s, mem)
            await _refused_unread(app, "POST", "/v1/ask", never_sends_a_body, "--tenant-max-in-flight")
            assert reads == []  # no body was read for any refused request
            other = asyncio.ensure_future(s.b.post("/v1/ask", json=ask("b/x")))  # b has its own count
            await until(lambda: s.worker.queued("b") == 1)
            mem.gate.set()
            assert (await held).status_code == 200 and (await other).status_code == 200
            assert app.state.in_flight.counts == {}  # every slot given back

    run(main())


def test_a_tenant_with_its_queue_full_is_refused_before_its_body_is_read():
    """Its share of the queue plus one batch being computed: a further model request of the tenant
    is refused from its headers (a flood's refusals are not tokenized), another tenant's is not."""
    from elasticmem.serve import Batching

    mem = RuleMemory()
    app = make_app(mem, tenant_max_queued=2, batching=Batching(max_batch=1, window_ms=0.0))
    reads, never_sends_a_body = _body_never_sent()

    async def main():
        async with served(app) as s:
            held = await hold(s, mem)
            mine = [asyncio.ensure_future(s.a.post("/v1/ask", json=ask(question=f"a{i}"))) for i in range(2)]
            await until(lambda: s.worker.queued("a") == 2)
            for method, path in (("POST", "/v1/ask"), ("POST", "/v1/memory/a/x"), ("DELETE", "/v1/memory/a/x")):
                await _refused_unread(app, method, path, never_sends_a_body, "--tenant-max-queued")
            assert reads == []
            assert (await s.a.get("/v1/memory/a/x")).status_code != 429  # reading needs no model work
            other = asyncio.ensure_future(s.b.post("/v1/ask", json=ask("b/x", question="b0")))
            await until(lambda: s.worker.queued("b") == 1)
            mem.gate.set()
            assert all(x.status_code == 200 for x in await asyncio.gather(held, other, *mine))
        assert app.state.in_flight.counts == {}

    run(main())


def test_a_body_that_does_not_arrive_in_time_gets_408():
    app = make_app(body_timeout_s=0.2)

    async def trickle():
        await asyncio.sleep(3600)

    async def main():
        async with served(app):
            t0 = time.monotonic()
            status, hdrs, body = await _call(app, "POST", "/v1/ask", {"Authorization": f"Bearer {KEY_A}"}, trickle)
            assert status == 408 and "--body-timeout-s" in json.loads(body)["error"]["message"]
            assert time.monotonic() - t0 < WAIT_S  # the deadline, not the client, ended it
            assert app.state.metrics.snapshot()["requests"]["POST /v1/ask"] == {"408": 1}

    run(main())


def test_openapi_and_docs_need_a_key_unless_opened():
    async def main():
        async with served(make_app()) as s:
            for path in ("/openapi.json", "/docs"):
                refused(await s.anon.get(path), 401, "missing API key")
                assert (await s.a.get(path)).status_code == 200
            assert "/v1/ask" in (await s.a.get("/openapi.json")).json()["paths"]
            assert (await s.anon.get("/health")).status_code == 200  # still open
            assert (await s.anon.get("/metrics")).status_code == 200
        async with served(make_app(open_docs=True)) as s:
            assert (await s.anon.get("/openapi.json")).status_code == 200
            refused(await s.anon.post("/v1/ask", json=ask()), 401)  # only the docs are opened

    run(main())


# --------------------------------------------------------------------------- clients that leave


class Client:
    """The ASGI side of one client: sends ``body`` (in ``parts``), then disconnects once ``leave`` is set."""

    def __init__(self, body: bytes, parts: int = 1, send_all: bool = True) -> None:
        step = -(-len(body) // parts)
        pieces = [body[i:i + step] for i in range(0, len(body), step)]
        self.messages = [{"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1}
                         for i, piece in enumerate(pieces)][: None if send_all else 1]
        self.leave = asyncio.Event()

    async def receive(self) -> dict:
        if self.messages:
            return self.messages.pop(0)
        await self.leave.wait()
        return {"type": "http.disconnect"}


def _asking(app, client: Client):
    return asyncio.ensure_future(_call(app, "POST", "/v1/ask", {"Authorization": f"Bearer {KEY_A}",
                                                                "content-type": "application/json"}, client.receive))


def test_a_client_that_leaves_is_dropped_from_the_queue_and_counted_as_gone_not_500():
    mem = RuleMemory()
    app = make_app(mem)

    async def main():
        async with served(app) as s:
            held = await hold(s, mem)
            # leaves while its question waits in the queue: dropped at once, never computed
            waiting = Client(json.dumps(ask(question="nobody reads this")).encode())
            call = _asking(app, waiting)
            await until(lambda: s.worker.queued() == 1)
            waiting.leave.set()
            status, _, _ = await asyncio.wait_for(call, WAIT_S)
            assert status == 499 and s.worker.queued() == 0
            # leaves once its question is computed (nothing can stop a batch midway): answer discarded
            computed = Client(json.dumps(ask(question="computed")).encode())
            call = _asking(app, computed)
            await until(lambda: s.worker.queued() == 1)
            mem.gate.set()
            assert (await held).status_code == 200
            await until(lambda: "computed" in mem.seen)
            computed.leave.set()
            status, _, _ = await asyncio.wait_for(call, WAIT_S)
            assert status in (200, 499)  # 200 when the answer was sent before the disconnect was seen
            # leaves halfway through sending its body
            half = Client(json.dumps(ask(question="half")).encode(), parts=2, send_all=False)
            call = _asking(app, half)
            await asyncio.sleep(0.05)
            half.leave.set()
            status, _, _ = await asyncio.wait_for(call, WAIT_S)
            assert status is None  # nothing sent: no one is there
            return (await s.a.get("/metrics")).json()

    m = run(main())
    assert mem.seen == ["held", "computed"]  # the abandoned question never reached the model
    assert m["client_gone"]["queued"] == 1 and m["client_gone"]["reading"] == 1
    assert m["model"]["withdrawn"] == 1
    statuses = m["requests"]["POST /v1/ask"]
    assert statuses.get("499", 0) >= 2 and "500" not in statuses, statuses


# --------------------------------------------------------------------------- the worker's failure paths


def test_one_poisoned_request_in_a_batch_of_eight_fails_alone():
    mem = RuleMemory()
    app = make_app(mem)
    questions = [f"question {i}" for i in range(7)] + ["poison"]

    async def main():
        async with served(app) as s:
            held = await hold(s, mem)
            calls = [asyncio.ensure_future(s.a.post("/v1/ask", json=ask(question=q))) for q in questions]
            await until(lambda: s.worker.queued() == 8)
            mem.gate.set()
            assert (await held).status_code == 200
            return await asyncio.gather(*calls)

    responses = run(main())
    for q, r in zip(questions, responses):
        if q == "poison":
            refused(r, 422, "poisoned")
        else:
            assert r.status_code == 200 and r.json()["question"] == q, r.text
    assert mem.batches[:2] == [1, 8]  # the eight were one batch, then answered one by one
    assert sorted(mem.seen) == sorted(["held", *questions[:7]])


def test_a_full_queue_gives_503_and_a_tenants_share_gives_429_with_retry_after():
    mem = RuleMemory()
    app = make_app(mem, max_queue=1)

    async def main():
        async with served(app) as s:
            held = await hold(s, mem)
            queued = asyncio.ensure_future(s.b.post("/v1/ask", json=ask("b/x", question="queued")))
            await until(lambda: s.worker.queued() == 1)
            refused(await s.a.post("/v1/ask", json=ask(question="one too many")), 503, "--max-queue")
            refused(await s.b.post("/v1/memory/b/x", json={"turns": [{"role": "user", "content": "x"}]}), 503,
                    "--max-queue")
            mem.gate.set()
            assert (await held).status_code == 200 and (await queued).status_code == 200
        assert "one too many" not in mem.seen

    run(main())

    mem = RuleMemory()
    app = make_app(mem, tenant_max_queued=2)

    async def share():
        async with served(app) as s:
            held = await hold(s, mem)
            mine = [asyncio.ensure_future(s.a.post("/v1/ask", json=ask(question=f"a{i}"))) for i in range(2)]
            await until(lambda: s.worker.queued("a") == 2)
            r = await s.a.post("/v1/ask", json=ask(question="over the share"))
            refused(r, 429, "limit is 2", "--tenant-max-queued")
            assert int(r.headers["retry-after"]) >= 1
            other = asyncio.ensure_future(s.b.post("/v1/ask", json=ask("b/x", question="b0")))  # b has its own share
            await until(lambda: s.worker.queued() == 3)
            mem.gate.set()
            assert all(x.status_code == 200 for x in await asyncio.gather(held, other, *mine))

    run(share())
    assert "over the share" not in mem.seen


def test_tenants_are_served_in_turn_not_in_arrival_order():
    from elasticmem.serve import Batching

    mem = RuleMemory()
    app = make_app(mem, batching=Batching.off())  # one request per forward: the order is the schedule

    async def main():
        async with served(app) as s:
            held = await hold(s, mem)
            calls = []
            for i in range(4):  # tenant a floods first...
                calls.append(asyncio.ensure_future(s.a.post("/v1/ask", json=ask(question=f"a{i}"))))
                await until(lambda: s.worker.queued() == len(calls))
            for i in range(2):  # ...then b arrives
                calls.append(asyncio.ensure_future(s.b.post("/v1/ask", json=ask("b/x", question=f"b{i}"))))
                await until(lambda: s.worker.queued() == len(calls))
            mem.gate.set()
            await asyncio.gather(held, *calls)

    run(main())
    assert mem.seen == ["held", "a0", "b0", "a1", "b1", "a2", "a3"]  # FIFO would be a0 a1 a2 a3 b0 b1


def test_shutdown_answers_503():
    mem = RuleMemory()
    app = make_app(mem)

    async def main():
        async with served(app) as s:
            held = await hold(s, mem)
            queued = asyncio.ensure_future(s.a.post("/v1/ask", json=ask(question="queued")))
            await until(lambda: s.worker.queued() == 1)
            # a shutdown whose grace period ends while the worker is still busy
            stopping = asyncio.ensure_future(asyncio.to_thread(s.worker.stop, 0.3))
            refused(await queued, 503, "shutting down")
            refused(await s.a.post("/v1/ask", json=ask(question="after")), 503, "shutting down")
            refused(await s.a.post("/v1/memory/a/x", json={"turns": [{"role": "user", "content": "x"}]}), 503,
                    "shutting down")
            await stopping
            mem.gate.set()
            assert (await held).status_code == 200  # what was running still gets its answer

    run(main())
    assert mem.seen == ["held"]


def test_a_memory_of_another_group_never_reaches_a_response():
    mem = RuleMemory()
    app = make_app(mem)

    async def main():
        async with served(app) as s:
            assert (await s.a.post("/v1/memory/a/x", json={"turns": [{"role": "user", "content": "mine"}]})
                    ).status_code == 200
            ok = await s.a.post("/v1/ask", json=ask(question="what is mine?"))
            assert ok.status_code == 200 and [m["text"] for m in ok.json()["memories"]] == ["mine"]
            leaks = [await s.a.post("/v1/ask", json=ask(question="leak it")),
                     await s.a.post("/v1/chat/completions", json={
                         "memory_group": "a/x", "messages": [{"role": "user", "content": "leak it"}]})]
            for r in leaks:
                refused(r, 500, "crossed a memory-group boundary", "withheld")
                assert "secret" not in r.text and "b/secret" not in r.text

    run(main())
    assert mem.seen.count("leak it") == 2  # computed, and withheld


def test_finish_reason_is_length_exactly_when_the_answer_hit_its_token_limit():
    async def main():
        async with served(make_app()) as s:
            out = {}
            for limit in (1, 3, 5, 10, None):  # the rule memory answers 5 tokens, or fewer when cut
                body = {"memory_group": "a/x", "messages": [{"role": "user", "content": "count"}]}
                if limit is not None:
                    body["max_tokens"] = limit
                r = await s.a.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                out[limit] = (r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"])
            return out

    out = run(main())
    # cut at 1, 3 (and at the default of 4): "length"; 5 words within a limit of 5 or 10: "stop"
    assert out == {1: ("length", 1), 3: ("length", 3), 5: ("length", 5), 10: ("stop", 5), None: ("length", 4)}


# --------------------------------------------------------------------------- memory quotas (the real LiveMemory)


@pytest.fixture(scope="module")
def tiny_live(tmp_path_factory):
    import torch

    from elasticmem.live import LiveMemory

    require_serve_extra()
    torch.manual_seed(0)
    overrides = ["backbone.name_or_path=tiny", "backbone.device=cpu", "memory.retrieval=frozen", "memory.top_z=2",
                 "memory.max_new_tokens=2", "memory.policy.max_budget=4", "bank.n_cache=8", "chunking.max_tokens=48"]
    return LiveMemory.load(bank=tmp_path_factory.mktemp("quota") / "bank", overrides=overrides, batch_size=4)


def _session(i: int, n_pairs: int = 1) -> dict:
    turns = []
    for j in range(n_pairs):
        turns += [{"role": "user", "content": f"note {i} {j} the cat"}, {"role": "assistant", "content": f"ok {i} {j}"}]
    return {"turns": turns}


def _usage_from_files(bank_dir: Path, group_prefix: str) -> tuple[int, int]:
    """Rows and bytes of the groups under ``group_prefix`` for a bank where every shard file holds one
    tenant's rows: the sizes of those whole files on disk, plus the UTF-8 texts of the rows."""
    from elasticmem.bank.store import Bank

    bank = Bank.open(bank_dir)
    chunks = bank.chunks()
    mine = {r for g in bank.groups if g.startswith(group_prefix) for r in bank.group_row_ids(g).tolist()}
    files = 0
    for shard in bank.shards:
        held = set(range(shard.start, shard.start + shard.rows))
        if held and held <= mine:
            files += (bank_dir / shard.file).stat().st_size
        else:
            assert not held & mine, "a shard mixes tenants: this oracle does not apply"
    return len(mine), files + sum(len(chunks[r]["text"].encode("utf-8")) for r in mine)


def test_memory_quotas_in_rows_and_bytes_refuse_adds_with_507(tiny_live):
    app = make_app(tiny_live, tenant_max_rows=3, tenant_max_bytes=None)

    async def rows():
        async with served(app) as s:
            assert (await s.a.post("/v1/memory/a/q1", json=_session(0))).json()["added"] == 1
            assert (await s.a.post("/v1/memory/a/q2", json=_session(1))).json()["added"] == 1  # 1 + 2 turns <= 3
            r = await s.a.post("/v1/memory/a/q1", json=_session(2))  # 2 rows + up to 2 more > 3
            refused(r, 507, "holds 2 memories", "may make 2 more", "quota is 3 memories", "--tenant-max-rows")
            assert (await s.b.post("/v1/memory/b/q1", json=_session(3))).status_code == 200  # b's own quota
            assert len((await s.a.get("/v1/memory/a/q1")).json()["chunks"]) == 1  # the refused add wrote nothing
            usage = s.worker.quota.usage("a")
            m = (await s.a.get("/metrics")).json()["model"]
        assert m["adds_over_quota"] == 1
        assert usage == _usage_from_files(tiny_live.bank.root, "a/")

    run(rows())

    a_bytes = _usage_from_files(tiny_live.bank.root, "a/")[1]
    app = make_app(tiny_live, tenant_max_rows=None, tenant_max_bytes=a_bytes + 1)

    async def nbytes():
        async with served(app) as s:
            assert (await s.a.post("/v1/memory/a/q3", json=_session(4))).status_code == 200  # under: one more
            refused(await s.a.post("/v1/memory/a/q3", json=_session(5)), 507, f"quota is {a_bytes + 1} bytes",
                    "--tenant-max-bytes")
            assert (await s.b.post("/v1/memory/b/q2", json=_session(6))).status_code == 200

    run(nbytes())


def test_every_limit_is_a_flag_with_a_docstring():
    from elasticmem.serve import Limits
    from elasticmem.serve.cli import OPTIONS, parse_args
    from elasticmem.utils.configuration import field_docs
    from elasticmem.utils.options import option_keys

    flags = {k.removeprefix("serve.limits."): f for k, f in option_keys(OPTIONS).items()
             if k.startswith("serve.limits.")}
    assert list(flags) == list(Limits.__dataclass_fields__)
    assert all(len(doc) > 20 for doc in field_docs(Limits).values()) and set(field_docs(Limits)) == set(flags)
    opts, _ = parse_args(["--bank", "x", "--tenant-max-rows", "none", "--max-prompt-tokens", "77",
                          "--body-timeout-s", "2.5", "--max-new-tokens-limit", "9"])
    assert opts.limits == replace(Limits(), tenant_max_rows=None, max_prompt_tokens=77, body_timeout_s=2.5,
                                  max_new_tokens=9)


def test_delete_forgets_for_the_owner_only_and_frees_its_quota(tiny_live):
    bank = tiny_live.bank.refresh()
    held = sum(bank.group_size(g) for g in bank.groups if g.startswith("a/"))  # by the tests before
    app = make_app(tiny_live, tenant_max_rows=held + 4, tenant_max_bytes=None)

    async def go():
        async with served(app) as s:
            for i in range(3):
                assert (await s.a.post("/v1/memory/a/del", json=_session(10 + i))).json()["added"] == 1
            assert (await s.b.post("/v1/memory/b/del", json=_session(13))).status_code == 200
            listed = (await s.a.get("/v1/memory/a/del")).json()["chunks"]
            rows = [c["row"] for c in listed]
            refused(await s.a.post("/v1/memory/a/del", json=_session(14)), 507, f"holds {held + 3} memories")
            # no key, another tenant's key: refused, nothing deleted
            refused(await s.anon.delete(f"/v1/memory/a/del?row={rows[0]}"), 401)
            refused(await s.b.delete(f"/v1/memory/a/del?row={rows[0]}"), 403, "may not read or write")
            refused(await s.a.delete("/v1/memory/a/del?row=0&session=0"), 422, "not both")
            refused(await s.a.delete(f"/v1/memory/b/del?row={rows[0]}"), 403)
            b_row = (await s.b.get("/v1/memory/b/del")).json()["chunks"][0]["row"]
            refused(await s.a.delete(f"/v1/memory/a/del?row={b_row}"), 404, "no memory with row id")  # b's row
            assert [c["row"] for c in (await s.a.get("/v1/memory/a/del")).json()["chunks"]] == rows
            # the owner deletes one memory: gone from the listing and from every answer's memories
            r = await s.a.delete(f"/v1/memory/a/del?row={rows[0]}")
            assert r.status_code == 200 and r.json() == {"group": "a/del", "deleted": 1, "rows": [rows[0]],
                                                         "purged": True}
            assert [c["row"] for c in (await s.a.get("/v1/memory/a/del")).json()["chunks"]] == rows[1:]
            files = b"".join(f.read_bytes() for f in tiny_live.bank.root.rglob("*") if f.is_file())
            assert json.dumps(listed[0]["text"])[1:-1].encode() not in files  # purged from the bank's files
            assert json.dumps(listed[1]["text"])[1:-1].encode() in files
            for q in ("what is the cat?", listed[0]["text"]):
                ans = (await s.a.post("/v1/ask", json=ask("a/del", q))).json()
                assert ans["memories"] and {m["row"] for m in ans["memories"]} <= set(rows[1:])
            refused(await s.a.delete(f"/v1/memory/a/del?row={rows[0]}"), 404, "no memory with row id")  # a retry
            assert (await s.a.post("/v1/memory/a/del", json=_session(14))).status_code == 200  # the quota counts it
            refused(await s.a.delete("/v1/memory/a/del?session=99"), 404, "session 99")
            # the whole group, then nothing is left to delete or retrieve
            r = await s.a.delete("/v1/memory/a/del")
            assert r.status_code == 200 and r.json()["deleted"] == 3
            assert (await s.a.get("/v1/memory/a/del")).json()["chunks"] == []
            assert (await s.a.post("/v1/ask", json=ask("a/del", "what is the cat?"))).json()["memories"] == []
            refused(await s.a.delete("/v1/memory/a/del"), 404, "holds no memory")
            assert len((await s.b.get("/v1/memory/b/del")).json()["chunks"]) == 1  # b's memory stays
            m = (await s.a.get("/metrics")).json()
        assert m["model"]["forgets"] == 2 and m["model"]["memories_forgotten"] == 4
        assert m["model"]["forget_errors"] == 0

    run(go())


@pytest.mark.parametrize("index_type", ["flat", "ivf"])
def test_delete_reaches_every_copy_the_server_holds(tmp_path, index_type):
    """DELETE on the app over the real text-RAG LiveMemory (MiniLM retrieval, a FAISS index saved in
    the bank: ivf; flat is never saved): once answered, no file under the bank holds the memory's
    text, key or cached state, the FAISS index holds the live rows only and the deleted key as a
    query finds live rows, the retriever holds no embedding of the text and no token ids of the
    chunk stay memoised (tests/forget_support.py, as tests/unit/test_forget_copies.py checks forget)."""
    from forget_support import check_no_copy_holds, fill_bank, holders, session, text_rag, traces

    root = tmp_path / "bank"
    fill_bank(root, {"a/notes": 3, "a/more": 2, "b/x": 2})
    live = text_rag(root, index_type)
    assert (root / "index.faiss").is_file() == (index_type == "ivf")
    app = make_app(live)

    async def go():
        async with served(app) as s:
            assert (await s.a.post("/v1/memory/a/notes", json={"turns": session(40)})).json()["added"] == 1
            listed = (await s.a.get("/v1/memory/a/notes")).json()["chunks"]
            row, text = listed[1]["row"], listed[1]["text"]  # one the saved index holds
            ans = (await s.a.post("/v1/ask", json=ask("a/notes", text))).json()
            assert row in {m["row"] for m in ans["memories"]}  # retrieved (its tokens memoised) before
            key, needles = live.bank.keys(row, row + 1)[0].clone(), traces(live.bank, row)
            assert all(holders(root, n) for n in needles.values())
            r = await s.a.delete(f"/v1/memory/a/notes?row={row}")
            assert r.status_code == 200 and r.json()["rows"] == [row] and r.json()["purged"], r.text
            ans = (await s.a.post("/v1/ask", json=ask("a/notes", text))).json()
            assert ans["memories"] and row not in {m["row"] for m in ans["memories"]}
        return row, text, key, needles

    row, text, key, needles = run(go())
    check_no_copy_holds(live, row, text, key)
    for what, needle in needles.items():
        assert not holders(root, needle), f"the {what} of row {row} is still in {holders(root, needle)}"
