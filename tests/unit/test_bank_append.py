"""Appending to a bank while it is read (elasticmem.bank.append), tiny random model, CPU.

    pytest tests/unit/test_bank_append.py

An append must equal a build of the union (keys and caches to 1e-6, per group in row order), a
repeated append must add nothing, a reader opened before an append keeps its snapshot, indexes
follow the grown bank, and a process killed in the middle of an append (os._exit at each file
rename, and SIGKILL at a random moment) leaves a bank that opens and equals the one before.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_examples

from elasticmem.bank import Bank, BankError, build_bank, build_index
from elasticmem.bank.append import SessionAdd, append_sessions, create_bank
from elasticmem.config import BankConfig, ChunkingConfig, IndexConfig
from elasticmem.data.chunking import chunk_history

CHUNKING = ChunkingConfig(max_tokens=48, truncation_side="right", add_special_tokens=True)
BANK = dict(n_cache=8, batch_size=5, shard_rows=7)


def _examples():
    """4 groups of 1-3 sessions with no repeated chunk text inside a group (a repeated text is stored
    once by an append, by design, so the union build would differ)."""
    ex = make_examples(4, seed=3)
    for g in {e.group for e in ex}:
        texts = [c.text for c in chunk_history(next(e.history for e in ex if e.group == g), g)]
        assert len(texts) == len(set(texts)), "test data must not repeat a chunk inside a group"
    assert max(len(e.history) for e in ex) >= 2, "test data needs a group of several sessions"
    return ex


def _build(tmp_path, backbone, name, examples):
    cfg = BankConfig(dir=str(tmp_path / name), **BANK)
    build_bank({"train": examples}, backbone, CHUNKING, cfg, torch.float32, show_progress=False)
    return Bank.open(cfg.dir, expect_fingerprint=backbone.fingerprint)


def _append(bank_or_root, backbone, items):
    return append_sessions(bank_or_root, items, backbone.model.get_decoder(), backbone.tokenizer,
                           backbone.fingerprint, batch_size=3)


def _histories(examples):
    return {e.group: e.history for e in examples}


def _group_view(bank, g):
    """A group's chunks (text, session, turns), keys, caches and lengths in row order."""
    rows = bank.group_row_ids(g)
    chunks = bank.chunks()
    recs = [(chunks[r]["text"], chunks[r]["session"], tuple(chunks[r]["turns"]), chunks[r]["n_tokens"])
            for r in rows.tolist()]
    cache, cache_len = bank.gather(rows)
    return recs, bank.gather_keys(rows), cache, cache_len


def _assert_same_groups(a, b, groups):
    assert set(a.groups) == set(b.groups) == set(groups)
    for g in groups:
        ra, ka, ca, la = _group_view(a, g)
        rb, kb, cb, lb = _group_view(b, g)
        assert ra == rb, g
        assert (ka - kb).abs().max() <= 1e-6 and (ca - cb).abs().max() <= 1e-6, g
        assert torch.equal(la, lb)
    assert a.groups_sha256 == b.groups_sha256


def _snapshot(bank):
    return (bank.num_chunks, bank.keys().clone(), bank.gather(torch.arange(bank.num_chunks))[0].clone(),
            [c["text"] for c in bank.chunks()], dict(bank.groups))


def test_appends_equal_a_build_of_the_union(tmp_path, tiny_backbone):
    ex = _examples()
    hist = _histories(ex)
    first = [e for e in ex if e.group != "g3"]  # g3 arrives later as a new group
    first = [dataclasses.replace(e, history=e.history[:1]) for e in first]  # only the first sessions
    union = _build(tmp_path, tiny_backbone, "union", ex)

    grown = _build(tmp_path, tiny_backbone, "grown", first)
    before = grown
    rounds = max(len(h) for h in hist.values())
    for s in range(rounds):  # session by session, every group in one append per round (as streaming does)
        items = [SessionAdd(g, h[s], s) for g, h in hist.items() if s < len(h) and (s > 0 or g == "g3")]
        if items:
            res = _append(grown, tiny_backbone, items)
            assert res.added == sum(len(chunk_history([it.turns], it.group)) for it in items)
            grown = res.bank
    assert grown.manifest["format_version"] == 2 and len(grown.groups["g0"]) >= 1
    assert any(len(segs) > 1 for segs in grown.groups.values()), "an appended group must span segments"
    _assert_same_groups(grown, union, hist)
    assert before.num_chunks < grown.num_chunks  # the first snapshot is unchanged
    assert grown.refresh() is grown

    # an empty bank filled by one append of every session equals the build too
    cfg = BankConfig(dir=str(tmp_path / "empty"), **BANK)
    empty = create_bank(cfg.dir, tiny_backbone, CHUNKING, cfg, torch.float32)
    assert empty.num_chunks == 0 and empty.keys().shape == (0, empty.hidden_size) and empty.chunks() == []
    filled = _append(empty, tiny_backbone, [SessionAdd(g, t) for g, h in hist.items() for t in h]).bank
    _assert_same_groups(filled, union, hist)
    assert all(len(s) == 1 for s in filled.groups.values())


def test_repeated_append_adds_nothing(tmp_path, tiny_backbone):
    ex = _examples()
    bank = _build(tmp_path, tiny_backbone, "b", ex[:2])
    hist = _histories(ex)
    items = [SessionAdd(g, t) for g, h in hist.items() for t in h]
    once = _append(bank, tiny_backbone, items)
    assert once.skipped[ex[0].group] == len(chunk_history(hist[ex[0].group], ""))  # already built
    manifest = (tmp_path / "b" / "manifest.json").read_text()
    again = _append(once.bank, tiny_backbone, items)
    assert again.added == 0 and sum(again.skipped.values()) == sum(len(chunk_history(h, "")) for h in hist.values())
    assert (tmp_path / "b" / "manifest.json").read_text() == manifest
    assert again.bank.num_chunks == once.bank.num_chunks


def test_reader_keeps_its_snapshot_and_indexes_follow(tmp_path, tiny_backbone):
    ex = _examples()
    hist = _histories(ex)
    bank = _build(tmp_path, tiny_backbone, "b", [dataclasses.replace(e, history=e.history[:1]) for e in ex])
    old = _snapshot(bank)
    torch_index = build_index(bank, IndexConfig(type="torch"))
    flat = build_index(bank, IndexConfig(type="flat"))
    grown = _append(bank, tiny_backbone, [SessionAdd(g, t, s) for g, h in hist.items()
                                          for s, t in enumerate(h) if s > 0]).bank
    # the old reader reads what it read before, rows and texts alike
    now = _snapshot(bank)
    assert now[0] == old[0] and torch.equal(now[1], old[1]) and torch.equal(now[2], old[2]) and now[3:] == old[3:]
    assert bank.refresh().num_chunks == grown.num_chunks
    grown.verify()

    q = torch.randn(6, grown.hidden_size)
    groups = [sorted(grown.groups)[i % len(grown.groups)] for i in range(6)]
    ref = build_index(grown, IndexConfig(type="torch")).search(q, 4, groups)
    for index in (torch_index.refresh(grown), flat.refresh(grown)):
        res = index.search(q, 4, groups)
        assert torch.equal(res.rows, ref.rows) and torch.allclose(res.scores, ref.scores, atol=1e-5)
    allowed = {g: set(grown.group_row_ids(g).tolist()) for g in grown.groups}
    for g, row in zip(groups, ref.rows.tolist()):
        assert {r for r in row if r >= 0} <= allowed[g]
    assert torch.equal(flat.search(q, 5).rows, build_index(grown, IndexConfig(type="flat")).search(q, 5).rows)


def test_saved_ivf_index_is_extended_or_rebuilt(tmp_path, tiny_backbone):
    ex = _examples()
    hist = _histories(ex)
    bank = _build(tmp_path, tiny_backbone, "b", [dataclasses.replace(e, history=e.history[:2]) for e in ex])
    cfg = IndexConfig(type="ivf", nlist=2, nprobe=2)  # nprobe = nlist: exact, comparable with torch
    build_index(bank, cfg)
    saved = json.loads((tmp_path / "b" / "index.json").read_text())
    assert saved["num_chunks"] == bank.num_chunks
    grown = _append(bank, tiny_backbone, [SessionAdd(g, t, s) for g, h in hist.items()
                                          for s, t in enumerate(h) if s >= 2]).bank
    assert bank.num_chunks < grown.num_chunks <= 2 * bank.num_chunks, "test data: the bank grows, at most 2x"
    index = build_index(grown, cfg)
    assert index.index.ntotal == grown.num_chunks
    assert json.loads((tmp_path / "b" / "index.json").read_text())["num_chunks"] == grown.num_chunks
    q = torch.randn(5, grown.hidden_size)
    g = [sorted(grown.groups)[i % 4] for i in range(5)]
    assert torch.equal(index.search(q, 3, g).rows, build_index(grown, IndexConfig(type="torch")).search(q, 3, g).rows)
    # a bank that more than doubled: the saved index is stale and rebuilt (trained anew)
    small = _build(tmp_path, tiny_backbone, "s", [dataclasses.replace(e, history=e.history[:1]) for e in ex[:1]])
    build_index(small, cfg)
    big = _append(small, tiny_backbone, [SessionAdd(g, t, s) for g, h in hist.items() for s, t in enumerate(h)]).bank
    assert big.num_chunks > 2 * small.num_chunks
    assert build_index(big, cfg).index.ntotal == big.num_chunks


def test_append_refuses_another_encoder(tmp_path, tiny_backbone):
    bank = _build(tmp_path, tiny_backbone, "b", _examples()[:1])
    with pytest.raises(BankError, match="encoded by"):
        append_sessions(bank, [SessionAdd("g9", [])], tiny_backbone.model.get_decoder(), tiny_backbone.tokenizer,
                        "sha256:other")
    with pytest.raises(BankError, match="no bank"):
        _append(tmp_path / "nothing", tiny_backbone, [])


CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    from elasticmem.backbone import load_backbone
    from elasticmem.bank.append import SessionAdd, append_sessions
    from elasticmem.config import ModelConfig
    from elasticmem.data.schema import Turn
    root, mode = sys.argv[1], sys.argv[2]
    bb = load_backbone(ModelConfig(name_or_path="tiny", device="cpu"))
    real_replace = os.replace
    def replace(src, dst):  # die at the rename that would make the named file appear
        if mode != "loop" and os.path.basename(str(dst)).startswith(mode):
            os._exit(9)
        real_replace(src, dst)
    os.replace = replace
    words = "cat dog sun box cup hat key map pen bed car egg fox owl".split()
    for i in range(1000 if mode == "loop" else 1):
        turns = [Turn("user", " ".join(words[(i + j) % 14] for j in range(9)) + f" {i}"),
                 Turn("assistant", "the " + words[i % 14] + f" {i}")]
        append_sessions(root, [SessionAdd("g0", turns), SessionAdd("new", turns)], bb.model.get_decoder(),
                        bb.tokenizer, bb.fingerprint, batch_size=2)
        print(i, flush=True)
""")


def _run_crash(root, mode):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, str(root), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_killed_append_leaves_the_bank_before(tmp_path, tiny_backbone):
    bank = _build(tmp_path, tiny_backbone, "b", _examples()[:2])
    root = bank.root
    before = _snapshot(bank)
    for mode in ("shard-", "manifest.json"):  # the first file an append writes, and its commit
        p = _run_crash(root, mode)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 9, err[-2000:]
        again = Bank.open(root, expect_fingerprint=tiny_backbone.fingerprint, verify=True)
        now = _snapshot(again)
        assert now[0] == before[0] and torch.equal(now[1], before[1]) and torch.equal(now[2], before[2])
        assert now[3:] == before[3:]
    # SIGKILL at a random moment of a stream of appends: the bank opens, verifies, and holds whole appends
    p = _run_crash(root, "loop")
    p.stdout.readline()  # the first append committed: it is encoding or writing from here on
    time.sleep(float(np.random.default_rng(int(time.time())).uniform(0.05, 1.5)))
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    after = Bank.open(root, expect_fingerprint=tiny_backbone.fingerprint, verify=True)
    appended = after.num_chunks - before[0]
    assert appended >= 2 and appended % 2 == 0, appended  # each append adds a g0 chunk and a 'new' chunk
    assert [c["text"] for c in after.chunks()][: before[0]] == before[3]
    assert after.group_size("new") == appended // 2
    # and the next append after the kill works and is read by a fresh reader
    res = _append(after, tiny_backbone, [SessionAdd("late", [dataclasses.replace(_examples()[0].history[0][0])])])
    assert res.added == 1 and Bank.open(root).group_size("late") == 1


def test_many_small_appends_are_compacted_without_moving_rows(tmp_path, tiny_backbone, monkeypatch):
    from elasticmem.bank import append as append_mod
    from elasticmem.data.schema import Turn

    monkeypatch.setattr(append_mod, "MAX_SMALL_SHARDS", 4)
    monkeypatch.setattr(append_mod, "COMPACT_ROWS", 5)
    bank = _build(tmp_path, tiny_backbone, "b", _examples()[:1])
    root, built_shards = bank.root, len(bank.shards)
    words = "cat dog sun box cup hat key map pen bed car egg fox owl".split()
    snapshots, index = [], build_index(bank, IndexConfig(type="flat"))
    for i in range(23):  # one chunk per append, as a server adding one turn per request
        said = Turn("user", f"{words[i % 14]} {words[i // 14]} {i}")
        bank = _append(bank, tiny_backbone, [SessionAdd("live", [said])]).bank
        index = index.refresh(bank)
        if i in (2, 11):
            snapshots.append((bank, _snapshot(bank)))
    assert bank.manifest["build"]["compactions"] >= 2
    appended = len(bank.shards) - built_shards
    assert appended <= append_mod.MAX_SMALL_SHARDS + 23 // 5 + 1, appended  # not one shard per append
    assert max(s.rows for s in bank.shards[built_shards:]) <= 5
    bank.verify()
    texts = [c["text"] for c in bank.chunks()]
    assert bank.group_size("live") == 23 and len(set(texts[-23:])) == 23
    # compaction regroups files only: every earlier snapshot's rows are the first rows, unchanged
    for old, (n, keys, cache, texts_then, _) in snapshots:
        assert bank.extends(old)
        assert torch.equal(bank.keys(0, n), keys) and torch.equal(bank.gather(torch.arange(n))[0], cache)
        assert texts[:n] == texts_then
        assert torch.equal(old.keys(), keys)  # and the old reader still reads its own files
    q = torch.randn(3, bank.hidden_size)
    ref = build_index(bank, IndexConfig(type="torch")).search(q, 4, ["live"] * 3)
    assert torch.equal(index.search(q, 4, ["live"] * 3).rows, ref.rows) and index.index.ntotal == bank.num_chunks
    # replaced files are kept for readers of older snapshots, then deleted once old enough
    names = {p.name for p in root.iterdir()}
    needed = {s.file for s in bank.shards} | {c["file"] for c in bank.manifest["chunk_files"]}
    assert {n for n in names if n.startswith(("shard-", "chunks-"))} > needed
    monkeypatch.setattr(append_mod, "GRACE_S", 0.0)
    compacted = append_mod.compact(root)
    needed = {s.file for s in compacted.shards} | {c["file"] for c in compacted.manifest["chunk_files"]}
    assert {p.name for p in root.iterdir() if p.name.startswith(("shard-", "chunks-"))} == needed
    assert compacted.num_chunks == bank.num_chunks and Bank.open(root, verify=True).chunks() == bank.chunks()
