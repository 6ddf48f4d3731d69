"""The HTTP server (elasticmem.serve): a real uvicorn process on a free port, the tiny model, real HTTP.

    OMP_NUM_THREADS=1 python -m pytest -q tests/integration/test_serve.py      # ~1 min (30 s of it the load test)

One server process serves the whole module (two tenants, keys in a file, batching on). Tests: add,
list, ask and chat completions; tenants refused each other's groups (403) and requests without a
key (401); malformed and oversized input (4xx with a message); batched answers equal one-at-a-time
answers; 16 clients of two tenants adding and asking for 30 s lose no write and never see another
group's memory; a DELETE (refused to other tenants and without a key) is on disk once answered: a
server killed by SIGKILL right after leaves a bank without the memory, in its groups and its files. Every test uses its own memory groups, so their order does not matter.

Without the ``serve`` extra (FastAPI, uvicorn; httpx from ``dev``) each test that needs it skips and
says why; ``ELASTICMEM_REQUIRE_SERVE=1`` (set by .ci/run) turns those skips into failures. The
limits and failure paths are tested in process, in seconds, by tests/unit/test_serve_limits.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT
from serve_support import require_serve_extra

from elasticmem.utils.common import free_port

try:
    import httpx
except ImportError:  # the tests that need it skip, or fail under ELASTICMEM_REQUIRE_SERVE=1
    httpx = None

KEY_A = "sk-tenant-a-0123456789"
KEY_B = "sk-tenant-b-9876543210"
KEY_SHARED = "sk-tenant-c-shared-000"
LOAD_SECONDS = 30.0
CLIENTS = 16
MAX_BODY = 64 * 1024
MAX_TURN_CHARS = 2000
WORDS = "cat dog sun box cup hat key map pen bed car egg fox jar owl pig bus cow bee ant bat rug toy van".split()


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def client(self, key: str | None = KEY_A) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120.0)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _start(d: Path) -> Server:
    """A server on a free port over the bank ``d/bank``, answering /health (the module's settings)."""
    keys = d / "keys.json"
    keys.write_text(json.dumps({KEY_A: {"tenant": "a", "groups": ["a/*"]},
                                KEY_B: {"tenant": "b", "groups": ["b/*"]},
                                KEY_SHARED: {"tenant": "c", "groups": ["a/shared", "c/*"]}}))
    port = free_port()
    # The tiny random model (configs/tiny.yaml) with its character fallback on, so that any text
    # tokenizes; Z = 2 memories per question and 3 generated tokens; the bank folder does not exist yet.
    cmd = [sys.executable, "-m", "elasticmem.serve", "--config", "configs/tiny.yaml", "--bank", str(d / "bank"),
           "--api-keys", str(keys), "--port", str(port), "--threads", "1", "--max-batch", "8",
           "--batch-window-ms", "20", "--max-body-bytes", str(MAX_BODY), "--max-turn-chars", str(MAX_TURN_CHARS),
           "--log-level", "info", "--no-access-log",
           "backbone.device=cpu", "backbone.tiny.char_fallback=true", "memory.top_z=2", "memory.max_new_tokens=3"]
    log = d / "server.log"
    with open(log, "w") as out:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode} before it served:\n{srv.log_tail()}")
        try:
            if httpx.get(f"{srv.url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not answer /health within 180 s:\n{srv.log_tail()}")
        time.sleep(0.2)
    return srv


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    require_serve_extra()
    srv = _start(tmp_path_factory.mktemp("serve"))
    proc, log = srv.proc, srv.log
    yield srv
    proc.terminate()  # SIGTERM: uvicorn's graceful shutdown, the worker finishes its queue
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the server did not stop within 60 s of SIGTERM:\n{srv.log_tail()}")
    text = log.read_text(errors="replace")
    # uvicorn re-raises the signal after its graceful shutdown, so -SIGTERM is a clean exit here
    assert code in (0, -signal.SIGTERM) and "Traceback" not in text, f"exit {code}:\n{text[-4000:]}"
    assert "model worker stopped" in text and "Application shutdown complete" in text, text[-4000:]


def _turns(*pairs: tuple[str, str]) -> dict:
    turns = []
    for user, assistant in pairs:
        turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"turns": turns}


def _listing(c: httpx.Client, group: str) -> list[dict]:
    r = c.get(f"/v1/memory/{group}")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["group"] == group and all(ch["group"] == group for ch in body["chunks"])
    return body["chunks"]


def _check_memories(memories: list[dict], group: str, chunks: list[dict]) -> None:
    """Every cited memory is a chunk of ``group``: by its group field, its row and its text."""
    by_row = {ch["row"]: ch["text"] for ch in chunks}
    for m in memories:
        assert m["group"] == group, (m, group)
        assert m["row"] in by_row and by_row[m["row"]] == m["text"], (m, group)


def _metrics(c: httpx.Client) -> dict:
    r = c.get("/metrics")
    assert r.status_code == 200
    return r.json()


# --------------------------------------------------------------------------- the endpoints


def test_add_list_ask_and_chat_completions(server):
    with server.client(KEY_A) as c:
        session = _turns(("my cat is called miso", "noted, the cat is miso"), ("i live in lyon", "lyon it is"))
        r = c.post("/v1/memory/a/profile", json=session)
        assert r.status_code == 200, r.text
        added = r.json()
        assert added["group"] == "a/profile" and added["added"] == 2 and added["skipped"] == 0
        assert len(added["rows"]) == 2
        again = c.post("/v1/memory/a/profile", json=session).json()  # a retried add adds nothing
        assert again["added"] == 0 and again["skipped"] == 2
        c.post("/v1/memory/a/profile", json=_turns(("the box is red", "red box")))

        chunks = _listing(c, "a/profile")
        assert len(chunks) == 3 and {ch["row"] for ch in chunks} >= set(added["rows"])
        texts = [ch["text"] for ch in chunks]
        assert any("miso" in t for t in texts) and any("lyon" in t for t in texts)
        assert all({"row", "text", "session", "turns", "n_tokens"} <= set(ch) for ch in chunks)

        r = c.post("/v1/ask", json={"group": "a/profile", "question": "what is my cat called?"})
        assert r.status_code == 200, r.text
        ans = r.json()
        assert ans["group"] == "a/profile" and isinstance(ans["text"], str) and len(ans["memories"]) == 2
        _check_memories(ans["memories"], "a/profile", chunks)
        assert ans["total_tokens"] == ans["prompt_tokens"] + ans["memory_tokens"] + ans["generated_tokens"]
        assert 1 <= ans["generated_tokens"] <= 3 and ans["latency"]["total"] > 0

        r = c.post("/v1/ask", json={"group": "a/profile", "question": "which city?", "choices": ["lyon", "oslo"],
                                    "max_new_tokens": 1})
        assert r.status_code == 200 and r.json()["generated_tokens"] == 1, r.text

        r = c.post("/v1/chat/completions", json={
            "model": "anything", "memory_group": "a/profile", "temperature": 0.7, "max_tokens": 2,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                         {"role": "assistant", "content": "hi"},
                         {"role": "user", "content": [{"type": "text", "text": "where do i live?"}]}]})
        assert r.status_code == 200, r.text
        chat = r.json()
        assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
        assert chat["model"] == "elasticmem" and isinstance(chat["created"], int)
        choice = chat["choices"][0]
        assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
        usage = chat["usage"]
        assert 1 <= usage["completion_tokens"] <= 2
        # "length" exactly when the answer used all of max_tokens (else it ended on its own: "stop")
        assert choice["finish_reason"] == ("length" if usage["completion_tokens"] == 2 else "stop"), chat
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens"] > usage["memory_tokens"] >= 0  # memory tokens counted in the prompt
        assert chat["memory_group"] == "a/profile" and len(chat["memories"]) == 2
        _check_memories(chat["memories"], "a/profile", chunks)
        # the group may also come from OpenAI's "user" field
        r = c.post("/v1/chat/completions", json={"user": "a/profile", "messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 1})
        assert r.status_code == 200 and r.json()["memory_group"] == "a/profile", r.text
        assert r.json()["usage"]["completion_tokens"] == 1 and r.json()["choices"][0]["finish_reason"] == "length"

        assert _listing(c, "a/never-written") == []  # a group with no memory: empty, not an error
        r = c.post("/v1/ask", json={"group": "a/never-written", "question": "anything?"})
        assert r.status_code == 200 and r.json()["memories"] == [], r.text
        assert c.get("/v1/models").json()["data"][0]["id"] == "elasticmem"

    health = httpx.get(f"{server.url}/health").json()  # no key needed, no tenant data
    assert health["status"] == "ok" and health["system"] == "elasticmem"
    assert httpx.get(f"{server.url}/openapi.json").status_code == 401  # the API's description needs a key
    with server.client(KEY_B) as b:
        assert "/v1/ask" in b.get("/openapi.json").json()["paths"]


def test_tenants_are_refused_each_others_groups(server):
    with server.client(KEY_A) as a:
        a.post("/v1/memory/a/secret", json=_turns(("the code is owl", "owl, noted")))
        before = _listing(a, "a/secret")
    ask = {"group": "a/secret", "question": "what is the code?"}
    chat = {"memory_group": "a/secret", "messages": [{"role": "user", "content": "what is the code?"}]}
    for key in (KEY_B, KEY_SHARED):  # tenant b; tenant c, which may use a/shared only
        with server.client(key) as b:
            for r in (b.post("/v1/memory/a/secret", json=_turns(("planted", "planted"))), b.get("/v1/memory/a/secret"),
                      b.delete("/v1/memory/a/secret"), b.delete(f"/v1/memory/a/secret?row={before[0]['row']}"),
                      b.post("/v1/ask", json=ask), b.post("/v1/chat/completions", json=chat),
                      b.post("/v1/chat/completions", json={**chat, "memory_group": None, "user": "a/secret"})):
                assert r.status_code == 403, (key, r.status_code, r.text)
                assert "may not read or write memory group 'a/secret'" in r.json()["error"]["message"]
        # the refused add wrote nothing, the refused deletes deleted nothing
    with server.client(KEY_A) as a:
        assert _listing(a, "a/secret") == before
    with server.client(KEY_SHARED) as c:  # an exact-name grant inside another tenant's prefix works
        assert c.post("/v1/memory/a/shared", json=_turns(("shared", "note"))).status_code == 200
        assert c.get("/v1/memory/a/shared").status_code == 200
    with server.client(KEY_A) as a:
        assert len(_listing(a, "a/shared")) == 1

    for key, auth in ((None, None), ("bad", "Bearer sk-not-a-key-000"), ("basic", "Basic " + KEY_A)):
        headers = {"Authorization": auth} if auth else {}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as anon:
            for r in (anon.post("/v1/memory/a/secret", json=_turns(("x", "y"))), anon.get("/v1/memory/a/secret"),
                      anon.delete("/v1/memory/a/secret"), anon.post("/v1/ask", json=ask), anon.post("/v1/chat/completions", json=chat),
                      anon.get("/v1/models")):
                assert r.status_code == 401, (key, r.status_code, r.text)
                assert r.headers["www-authenticate"] == "Bearer" and r.json()["error"]["message"]


def test_malformed_and_oversized_input_get_4xx_with_a_message(server):
    def refused(r: httpx.Response, status: int, *needles: str) -> None:
        assert r.status_code == status, (r.status_code, r.text)
        message = r.json()["error"]["message"]
        for needle in needles:
            assert needle in message, (needle, message)

    with server.client(KEY_A) as c:
        raw = {"Content-Type": "application/json"}
        refused(c.post("/v1/ask", content=b'{"group": "a/x", "question": ', headers=raw), 400, "malformed JSON")
        refused(c.post("/v1/memory/a/x", content=b"[1, 2", headers=raw), 400, "malformed JSON")
        refused(c.post("/v1/ask", json={"group": "a/x"}), 422, "question", "Field required")
        refused(c.post("/v1/ask", json={"question": "q?"}), 422, "group")
        refused(c.post("/v1/ask", json={"group": "a/x", "question": ""}), 422, "question")
        refused(c.post("/v1/ask", json={"group": "a/x", "question": "q", "max_new_tokens": 10**6}), 422,
                "max_new_tokens")
        refused(c.post("/v1/ask", json={"group": "a/x", "question": "q", "extra": 1}), 422, "extra")
        refused(c.post("/v1/ask", json={"group": "a/x", "question": "q" * 4001}), 422, "question")
        refused(c.post("/v1/memory/a/x", json={}), 422, "turns")
        refused(c.post("/v1/memory/a/x", json={"turns": "hello"}), 422, "turns")
        refused(c.post("/v1/memory/a/x", json={"turns": []}), 422, "turns")
        refused(c.post("/v1/memory/a/x", json={"turns": [{"role": "user"}]}), 422, "turns.0.content")
        refused(c.post("/v1/memory/a/x", json={"turns": [{"role": "user", "content": 5}]}), 422, "turns.0.content")
        refused(c.post("/v1/chat/completions", json={"memory_group": "a/x"}), 422, "messages")
        refused(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]}), 422,
                "memory_group")
        refused(c.post("/v1/chat/completions", json={"memory_group": "a/x", "messages": [
            {"role": "system", "content": "q"}]}), 422, "role 'user'")
        refused(c.post("/v1/chat/completions", json={"memory_group": "a/x", "stream": True, "messages": [
            {"role": "user", "content": "q"}]}), 400, "stream")
        refused(c.post("/v1/chat/completions", json={"memory_group": "a/x", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 422, "text")
        # group names: validated before anything is read or written
        refused(c.post("/v1/memory/a/bad name", json=_turns(("x", "y"))), 422, "invalid memory group")
        refused(c.get("/v1/memory/a/" + "x" * 200), 422, "invalid memory group")
        refused(c.post("/v1/ask", json={"group": "a/<script>", "question": "q"}), 422, "invalid memory group")
        # sizes
        refused(c.post("/v1/memory/a/x", json=_turns(("x" * (MAX_BODY + 10), "y"))), 413, "--max-body-bytes")
        refused(c.post("/v1/memory/a/x", json=_turns(("x" * (MAX_TURN_CHARS + 1), "y"))), 413,
                "turns[0].content", f"limit is {MAX_TURN_CHARS}")
        refused(c.post("/v1/memory/a/x", json={"turns": [{"role": "user", "content": "x"}] * 257}), 413,
                "--max-turns-per-request")

        def chunked():  # no Content-Length: the limit is enforced while reading
            for _ in range(MAX_BODY // 1024 + 2):
                yield b" " * 1024

        refused(c.post("/v1/ask", content=chunked(), headers=raw), 413, "--max-body-bytes")
        # methods and paths
        refused(c.get("/v1/ask"), 405, "Method Not Allowed")
        refused(c.get("/v1/nothing"), 404, "Not Found")
        assert _listing(c, "a/x") == []  # nothing refused was written
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


# --------------------------------------------------------------------------- batching


def test_concurrent_asks_are_batched_and_match_one_at_a_time(server):
    group = "a/batching"
    with server.client(KEY_A) as c:
        for s in range(4):
            words = WORDS[4 * s: 4 * s + 4]
            r = c.post(f"/v1/memory/{group}", json=_turns((f"the {words[0]} has the {words[1]}",
                                                           f"yes the {words[0]}"),
                                                          (f"where is the {words[2]}", f"with the {words[3]}")))
            assert r.status_code == 200, r.text
        chunks = _listing(c, group)
        questions = [f"where is the {w}?" for w in WORDS[:8]]
        single = [c.post("/v1/ask", json={"group": group, "question": q}).json() for q in questions]
        before = _metrics(c)["model"]

    barrier = threading.Barrier(len(questions))
    batched: list[dict | None] = [None] * len(questions)

    def ask(i: int) -> None:
        with server.client(KEY_A) as cc:
            cc.get("/health")  # connect first, so that the asks leave together when the barrier opens
            barrier.wait()
            batched[i] = cc.post("/v1/ask", json={"group": group, "question": questions[i]}).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    with server.client(KEY_A) as c:
        after = _metrics(c)["model"]
    asks = after["asks_answered"] - before["asks_answered"]
    batches = after["batches_run"] - before["batches_run"]
    assert asks == len(questions) and batches < asks, (before, after)  # some forward answered several
    assert after["max_batch_size"] > 1
    for one, many in zip(single, batched):
        assert many is not None and "error" not in many, many
        _check_memories(many["memories"], group, chunks)
        assert many["text"] == one["text"], (one, many)  # greedy: batching changes nothing
        assert [m["row"] for m in many["memories"]] == [m["row"] for m in one["memories"]]
        assert [m["budget"] for m in many["memories"]] == [m["budget"] for m in one["memories"]]


# --------------------------------------------------------------------------- load


def test_sixteen_clients_of_two_tenants_lose_no_write_and_see_only_their_group(server):
    groups = {"a": ["a/load0", "a/load1"], "b": ["b/load0", "b/load1"]}
    keys = {"a": KEY_A, "b": KEY_B}
    confirmed: dict[str, list[str]] = defaultdict(list)  # group -> markers whose add returned 200
    added_counts: dict[str, int] = defaultdict(int)
    answers: list[tuple[str, list[dict]]] = []
    failures: list[str] = []
    counts: dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    deadline = time.monotonic() + LOAD_SECONDS

    def client(cid: int) -> None:
        tenant = "ab"[cid % 2]
        other = "ba"[cid % 2]
        group = groups[tenant][(cid // 2) % 2]
        rng = random.Random(cid)
        mine: list[str] = []
        with server.client(keys[tenant]) as c:
            i = 0
            while time.monotonic() < deadline:
                i += 1
                op = rng.random()
                try:
                    if op < 0.45:  # add one session (one chunk) that no other client writes
                        marker = f"client{cid}-note{i}-{tenant}"
                        r = c.post(f"/v1/memory/{group}", json=_turns((f"{marker} the {rng.choice(WORDS)}",
                                                                        f"ok {marker}")))
                        if r.status_code != 200 or r.json()["added"] != 1:
                            failures.append(f"add {group}: {r.status_code} {r.text[:300]}")
                            continue
                        mine.append(marker)
                        with lock:
                            confirmed[group].append(marker)
                            added_counts[group] += r.json()["added"]
                            counts["add"] += 1
                    elif op < 0.85:
                        q = f"where is the {rng.choice(WORDS)}?"
                        if rng.random() < 0.5:
                            r = c.post("/v1/ask", json={"group": group, "question": q})
                            memories = r.json().get("memories") if r.status_code == 200 else None
                        else:
                            r = c.post("/v1/chat/completions", json={
                                "memory_group": group, "messages": [{"role": "user", "content": q}]})
                            memories = r.json().get("memories") if r.status_code == 200 else None
                        if memories is None:
                            failures.append(f"ask {group}: {r.status_code} {r.text[:300]}")
                            continue
                        with lock:
                            answers.append((group, memories))
                            counts["ask"] += 1
                    elif op < 0.95:  # read your writes: every add this client saw confirmed is listed
                        texts = "\n".join(ch["text"] for ch in _listing(c, group))
                        missing = [m for m in mine if m not in texts]
                        if missing:
                            failures.append(f"list {group}: confirmed adds missing: {missing[:5]}")
                        with lock:
                            counts["list"] += 1
                    else:  # the other tenant's group: always refused
                        target = groups[other][rng.randrange(2)]
                        r = c.post("/v1/ask", json={"group": target, "question": "what do they know?"})
                        if r.status_code != 403:
                            failures.append(f"cross-tenant ask {target}: {r.status_code} {r.text[:300]}")
                        with lock:
                            counts["refused"] += 1
                except Exception as e:  # a transport error is a failure too, not a crash of the thread
                    failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(cid,)) for cid in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LOAD_SECONDS + 120)
    assert not any(t.is_alive() for t in threads), "clients still running"
    assert not failures, failures[:10]
    assert counts["add"] >= 2 * CLIENTS and counts["ask"] >= 2 * CLIENTS, dict(counts)

    listings: dict[str, list[dict]] = {}
    with server.client(KEY_A) as a, server.client(KEY_B) as b:
        for tenant, c in (("a", a), ("b", b)):
            for group in groups[tenant]:
                listings[group] = _listing(c, group)
    for group, chunks in listings.items():
        texts = [ch["text"] for ch in chunks]
        # no lost write and nothing extra: one chunk per confirmed add, each marker in exactly one chunk
        assert len(chunks) == added_counts[group] == len(confirmed[group]), group
        assert len({ch["row"] for ch in chunks}) == len(chunks)
        for marker in confirmed[group]:
            assert sum(marker in t.split() for t in texts) == 1, (group, marker)
    for group, memories in answers:
        _check_memories(memories, group, listings[group])
        tenants = {t for m in memories for t in re.findall(r"client\d+-note\d+-([ab])", m["text"])}
        assert tenants <= {group[0]}, (group, memories)  # the markers name the tenant that wrote them
    with server.client(KEY_A) as a:
        model = _metrics(a)["model"]
    assert model["ask_errors"] == 0 and model["add_errors"] == 0
    print(f"\nload: {dict(counts)} in {LOAD_SECONDS:.0f} s; chunks per group "
          f"{ {g: len(c) for g, c in listings.items()} }; mean ask batch {model['mean_batch_size']:.2f}")


def test_metrics_count_requests_by_endpoint_and_status(server):
    with server.client(KEY_B) as b:
        b.get("/v1/memory/b/metrics-probe")
        b.get("/v1/memory/a/metrics-probe")
        m = _metrics(b)
    reqs = m["requests"]
    assert reqs["GET /v1/memory/{group}"]["200"] >= 1 and reqs["GET /v1/memory/{group}"]["403"] >= 1
    assert m["latency_s"]["GET /v1/memory/{group}"]["p95"] >= m["latency_s"]["GET /v1/memory/{group}"]["p50"] > 0
    for key in ("batches_run", "mean_batch_size", "asks_answered", "chunks_added", "queue_depth"):
        assert key in m["model"]
    assert not any("metrics-probe" in endpoint for endpoint in reqs)  # route templates, not group names


# --------------------------------------------------------------------------- start-up errors (no model)


def test_missing_fastapi_prints_the_install_command():
    code = ("import sys; sys.modules['fastapi'] = None; import elasticmem.serve as s; "
            "sys.exit(s.main(['--bank', 'x']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "pip install 'elasticmem[serve]'" in p.stderr, p.stderr


def test_bad_api_keys_file_is_refused_at_start(tmp_path):
    require_serve_extra()  # without FastAPI, main() stops at the install hint before reading the keys
    bad = tmp_path / "keys.json"
    bad.write_text(json.dumps({"sk-valid-key-1": {"tenant": "a", "groups": "a/*"}}))
    p = subprocess.run([sys.executable, "-m", "elasticmem.serve", "--bank", str(tmp_path / "bank"), "--api-keys",
                        str(bad)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "entry 1 (tenant 'a'): 'groups' must be a list" in p.stderr, p.stderr
    assert "sk-valid-key-1" not in p.stderr  # keys never reach a message


def test_api_key_patterns(tmp_path):
    from elasticmem.serve import ApiKey, load_api_keys

    key = ApiKey("a", ("tenantA/*", "shared"))
    assert key.allows("tenantA/notes") and key.allows("shared")
    assert not key.allows("tenantB/notes") and not key.allows("shared2") and not key.allows("tenanta/notes")
    assert not key.allows("tenantA")  # the pattern needs the slash
    path = tmp_path / "keys.yaml"
    path.write_text("sk-yaml-key-0001:\n  tenant: a\n  groups: [a/*]\n")
    assert load_api_keys(path) == {"sk-yaml-key-0001": ApiKey("a", ("a/*",))}


def test_a_delete_answered_survives_a_sigkill_of_the_server(tmp_path):
    """DELETE by the owner: out of the listing and of every answer at once, and, once answered, on
    disk: a server killed right after (SIGKILL, no shutdown) leaves a bank without the memory, in
    its groups and in its files' bytes; a server started again on it does not see it either."""
    require_serve_extra()
    from elasticmem.bank.store import Bank

    srv = _start(tmp_path)
    try:
        with srv.client(KEY_A) as a:
            for i in range(3):
                assert a.post("/v1/memory/a/forget", json=_turns((f"secret {i} is the {WORDS[i]}", f"ok {i}"))
                              ).status_code == 200
            chunks = _listing(a, "a/forget")
            r = a.delete(f"/v1/memory/a/forget?row={chunks[1]['row']}")
            assert r.status_code == 200 and r.json()["rows"] == [chunks[1]["row"]], r.text
            assert [c["row"] for c in _listing(a, "a/forget")] == [chunks[0]["row"], chunks[2]["row"]]
            ans = a.post("/v1/ask", json={"group": "a/forget", "question": chunks[1]["text"]}).json()
            assert ans["memories"] and chunks[1]["row"] not in {m["row"] for m in ans["memories"]}
            srv.proc.send_signal(signal.SIGKILL)  # right after the answer
            srv.proc.wait(60)
    finally:
        srv.proc.kill()
    bank = Bank.open(tmp_path / "bank", verify=True)
    assert bank.group_row_ids("a/forget").tolist() == [chunks[0]["row"], chunks[2]["row"]]
    files = b"".join(f.read_bytes() for f in (tmp_path / "bank").rglob("*") if f.is_file())
    assert json.dumps(chunks[1]["text"])[1:-1].encode() not in files
    assert json.dumps(chunks[2]["text"])[1:-1].encode() in files
    again = _start(tmp_path)
    try:
        with again.client(KEY_A) as a:
            assert [c["row"] for c in _listing(a, "a/forget")] == [chunks[0]["row"], chunks[2]["row"]]
    finally:
        again.proc.kill()
