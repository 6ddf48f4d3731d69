"""Other tenants' requests run between the decoding steps and prompt chunks of a long batch
(elasticmem.serve.worker, generation.step_gate, generation.chunked_prefill), and a batch holds at
most ``Batching.max_batch_tokens`` prompt tokens.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_serve_preemption.py

Against independent computations: a batch interrupted between its steps by other requests (asks,
an add) answers exactly as it does alone, and the nested requests as they do alone, for both
content paths (generate over soft tokens; the written-out loop over a KV cache); a long prompt read
in chunks (``prefill_chunk``, other requests run between them) answers as one pass does, and the
chunks' states and cache equal one pass's with left padding; in the worker a
short request of another tenant is answered while a long batch still runs (and only after it with
preemption off); the token bound splits batches where their counted prompt tokens say.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from serve_support import require_serve_extra

from elasticmem.live import AskRequest, LiveMemory

LONG = 48
"""Answer tokens of the long request: many decoding steps to run others between."""
WAIT_S = 300.0


@pytest.fixture(scope="module", params=["hidden", "kv"])
def live(request, tmp_path_factory):
    torch.manual_seed(0)
    overrides = ["backbone.name_or_path=tiny", "backbone.device=cpu", "memory.retrieval=frozen", "memory.top_z=2",
                 "memory.max_new_tokens=4", "memory.policy.max_budget=4", "bank.n_cache=8", "chunking.max_tokens=48",
                 f"memory.content={request.param}", f"bank.kv_cache={request.param == 'kv'}"]
    mem = LiveMemory.load(bank=tmp_path_factory.mktemp(f"preempt_{request.param}") / "bank", overrides=overrides,
                          batch_size=8)
    for g in ("a/g0", "b/g0", "b/g1"):
        mem.add(g, [{"role": "user", "content": f"my favourite colour in {g} is blue"},
                    {"role": "assistant", "content": "noted, blue it is"}])
    return mem


def _long(i: int = 0) -> AskRequest:
    return AskRequest("a/g0", f"tell me everything you remember, part {i}", None, LONG)


def _short(i: int = 0) -> AskRequest:
    return AskRequest(f"b/g{i % 2}", f"what colour do I like {i}?", ["red", "blue", "green"], 3)


def _same(x, y) -> None:
    assert (x.text, x.generated_tokens, [(m.row, m.budget) for m in x.memories]) == \
        (y.text, y.generated_tokens, [(m.row, m.budget) for m in y.memories])


def test_a_batch_interrupted_between_its_steps_answers_as_it_does_alone(live):
    from elasticmem.model.generation import step_gate

    alone_long = live.ask_many([_long(0), _long(1)])
    alone_short = [live.ask_many([_short(i)])[0] for i in range(3)]
    assert all(a.generated_tokens > 8 for a in alone_long), "the long answers must give steps to interrupt"
    steps, nested = [0], []

    def gate():
        steps[0] += 1
        if steps[0] in (2, 5):  # the short asks one at a time and batched, and an add of another group
            with step_gate(None):
                nested.append(live.ask_many([_short(0)]) if steps[0] == 2 else live.ask_many([_short(1), _short(2)]))
                if steps[0] == 5:
                    live.add("b/g2", [{"role": "user", "content": "a new memory while a batch runs"}])

    with step_gate(gate):
        got = live.ask_many([_long(0), _long(1)])
    assert steps[0] >= 5 and len(nested) == 2
    for x, y in zip(got, alone_long):
        _same(x, y)
    for x, y in zip([*nested[0], *nested[1]], alone_short):
        _same(x, y)
    assert live.preemptible()  # the reasoner's answers run with the adapter on


def _long_prompt(i: int = 0) -> AskRequest:
    return AskRequest("a/g0", f"part {i}: " + "tell me everything you remember about the colours I like " * 3, None, 6)


def test_a_long_prompt_read_in_chunks_answers_as_it_does_in_one_pass(live):
    """With ``prefill_chunk``, the query pass and the answer's prompt are read in chunks, the gate
    called between them (many more calls than decoding steps), other requests run there, and
    every answer equals the one-pass one."""
    from elasticmem.model.generation import step_gate

    alone = live.ask_many([_long_prompt(0), _long_prompt(1)])
    alone_short = live.ask_many([_short(0)])[0]
    calls = {}
    for chunk in (None, 8):
        n, nested = [0], []

        def gate():
            n[0] += 1
            if n[0] == 2:  # inside the first prompt's read when chunked
                with step_gate(None):
                    nested.append(live.ask_many([_short(0)])[0])

        with step_gate(gate, prefill_chunk=chunk):
            got = live.ask_many([_long_prompt(0), _long_prompt(1)])
        for x, y in zip(got, alone):
            _same(x, y)
        _same(nested[0], alone_short)
        calls[chunk] = n[0]
    prompt_tokens = len(live.model.tokenizer(_long_prompt(0).question)["input_ids"])
    assert calls[8] - calls[None] >= prompt_tokens // 8, calls  # the query pass alone has that many chunks


def test_chunked_prefill_equals_one_pass_with_left_padding(live):
    from elasticmem.model.generation import chunked_prefill, step_gate
    from elasticmem.model.injection import left_pad

    model = live.model
    decoder = model.base.get_decoder()
    ids, mask = left_pad([list(range(5, 45)), list(range(7, 30))], model.tokenizer.pad_token_id)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        one = decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        assert chunked_prefill(decoder, mask, pos, input_ids=ids) is None  # no gate: the caller's one pass
        gates = [0]
        with step_gate(lambda: gates.__setitem__(0, gates[0] + 1), prefill_chunk=7):
            h, cache = chunked_prefill(decoder, mask, pos, input_ids=ids)
    assert gates[0] == 6  # 40 positions in chunks of 7: 5 between and 1 after
    torch.testing.assert_close(h[:, -1], one.last_hidden_state[:, -1])
    for layer in range(len(one.cache.layers)):
        torch.testing.assert_close(cache.layers[layer].keys, one.cache.layers[layer].keys)
        torch.testing.assert_close(cache.layers[layer].values, one.cache.layers[layer].values)


def test_chunked_prefill_over_kv_memories_equals_one_pass(live, monkeypatch):
    """The KV content path: the prompt is read over a cache of memory slots behind a 4D mask; each
    chunk sees its rows of the mask and the slots and text before it."""
    import copy

    from elasticmem.model import generation

    if live.model.cfg.content != "kv":
        pytest.skip("the KV content path only")
    seen = []
    real = generation._generate_with_cache

    def capture(base, max_new_tokens, x, *args, **kwargs):
        seen.append(copy.deepcopy(x))
        return real(base, max_new_tokens, x, *args, **kwargs)

    monkeypatch.setattr(generation, "_generate_with_cache", capture)
    live.ask_many([_long_prompt(0), AskRequest("a/g0", "and the colours?", None, 6)])  # two lengths: left padding
    x = seen[0]
    assert x.past_valid.any() and x.lengths.unique().numel() == 2
    decoder = live.model.base.get_decoder()
    with torch.no_grad():
        one = decoder(**copy.deepcopy(x).forward_kwargs(), use_cache=True)
        with step_gate_for_test(5):
            h, cache = generation.chunked_prefill(decoder, x.attention_mask, x.position_ids, inputs_embeds=x.embeds,
                                                  cache=copy.deepcopy(x.cache))
    torch.testing.assert_close(h[:, -1], one.last_hidden_state[:, -1])
    for layer in range(len(one.cache.layers)):
        torch.testing.assert_close(cache.layers[layer].keys, one.cache.layers[layer].keys)
        torch.testing.assert_close(cache.layers[layer].values, one.cache.layers[layer].values)


def step_gate_for_test(chunk: int):
    from elasticmem.model.generation import step_gate

    return step_gate(lambda: None, prefill_chunk=chunk)


def _worker(live, slice_ms):
    from elasticmem.serve.settings import Batching
    from elasticmem.serve.worker import ModelWorker

    w = ModelWorker(live, Batching(max_batch=8, window_ms=0.0, slice_ms=slice_ms))
    w.start()
    return w


def _wait_running(future: concurrent.futures.Future) -> None:
    deadline = time.monotonic() + WAIT_S
    while not future.running() and not future.done():
        assert time.monotonic() < deadline, "the long ask never started"
        time.sleep(0.001)


@pytest.mark.parametrize("slice_ms", [0.0, None])
def test_another_tenants_short_ask_is_answered_while_a_long_batch_runs(live, slice_ms):
    alone = live.ask_many([_long(3)])[0]
    w = _worker(live, slice_ms)
    try:
        done_order: list[str] = []
        lock = threading.Lock()

        def note(name):
            def cb(_):
                with lock:
                    done_order.append(name)
            return cb

        long_f = w.submit("ask", _long(3), "a")
        long_f.add_done_callback(note("long"))
        _wait_running(long_f)
        short_f = w.submit("ask", _short(0), "b")
        short_f.add_done_callback(note("short"))
        long_answer = long_f.result(WAIT_S)
        short_f.result(WAIT_S)
        stats = w.stats()
    finally:
        w.stop()
    _same(long_answer, alone)
    if slice_ms is None:  # no preemption: the short ask waits for the whole long batch
        assert done_order == ["long", "short"] and stats["preemptions"] == 0
    else:
        assert done_order == ["short", "long"] and stats["preemptions"] >= 1


class _Counting:
    """A memory that records each ask batch's questions and answers nothing of interest."""

    model = SimpleNamespace(cfg=None)

    def __init__(self, started: threading.Event, release: threading.Event) -> None:
        self.batches: list[list[str]] = []
        self.started, self.release = started, release

    def ask_many(self, requests):
        self.started.set()
        assert self.release.wait(WAIT_S)
        self.batches.append([r.question for r in requests])
        return [r.question for r in requests]


def test_a_batch_holds_at_most_max_batch_tokens_prompt_tokens():
    from elasticmem.serve.settings import Batching
    from elasticmem.serve.worker import ModelWorker

    require_serve_extra()
    started, release = threading.Event(), threading.Event()
    mem = _Counting(started, release)
    w = ModelWorker(mem, Batching(max_batch=8, window_ms=0.0, max_batch_tokens=100, slice_ms=None))
    w.start()
    try:
        first = w.submit("ask", AskRequest("x", "hold"), "t", cost=1)
        assert started.wait(WAIT_S)  # the worker is busy: the rest queue up behind it
        costs = [("big", 90), ("small1", 5), ("small2", 5), ("small3", 5), ("huge", 500), ("tail", 1)]
        futures = [w.submit("ask", AskRequest("x", q), "t", cost=c) for q, c in costs]
        release.set()
        for f in [first, *futures]:
            f.result(WAIT_S)
    finally:
        w.stop()
    # 90 + 5 + 5 fits 100, the third small one does not; a request over the bound runs alone
    assert mem.batches == [["hold"], ["big", "small1", "small2"], ["small3"], ["huge"], ["tail"]]
