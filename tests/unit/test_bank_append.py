"""Appending to a bank while it is read (elasticmem.bank.append), tiny random model, CPU.

    pytest tests/unit/test_bank_append.py

An append must equal a build of the union (keys and caches to 1e-6, per group in row order, for
every key variant and content layer), a repeated append must add nothing, a reader opened before
an append keeps its snapshot, indexes follow the grown bank, a process killed in the middle of an
append (os._exit at each file rename, a journal record torn in half, and SIGKILL at a random
moment) leaves a bank that opens and equals the one before, compaction writes each row at most
once per level (bytes counted at the file writes against the bytes the bank keeps) and leaves a
bank equal to a build of the union, and two processes appending at once lose nothing.
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


def _build(tmp_path, backbone, name, examples, **bank_kw):
    cfg = BankConfig(dir=str(tmp_path / name), **BANK, **bank_kw)
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


KEYS = [dict(key="last"), dict(key="mean"), dict(key="layer_mean", key_layers=[0, 2]),
        dict(key="prompt", key_template='This sentence : "{text}" means in one word:"')]  # prompt: prompt_key_ids


@pytest.mark.parametrize("content_layer", [-1, 1])
@pytest.mark.parametrize("key", KEYS, ids=[k["key"] for k in KEYS])
def test_appends_equal_a_build_of_the_union(tmp_path, tiny_backbone, key, content_layer):
    ex = _examples()
    hist = _histories(ex)
    first = [e for e in ex if e.group != "g3"]  # g3 arrives later as a new group
    first = [dataclasses.replace(e, history=e.history[:1]) for e in first]  # only the first sessions
    kw = {**key, "content_layer": content_layer}
    union = _build(tmp_path, tiny_backbone, "union", ex, **kw)
    assert union.key["variant"] == key["key"] and union.content_layer == content_layer

    grown = _build(tmp_path, tiny_backbone, "grown", first, **kw)
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
    cfg = BankConfig(dir=str(tmp_path / "empty"), **BANK, **kw)
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
    manifest, journal = (tmp_path / "b" / "manifest.json").read_text(), once.bank.journal.read_bytes()
    again = _append(once.bank, tiny_backbone, items)
    assert again.added == 0 and sum(again.skipped.values()) == sum(len(chunk_history(h, "")) for h in hist.values())
    assert (tmp_path / "b" / "manifest.json").read_text() == manifest and again.bank.journal.read_bytes() == journal
    # so does a fresh process's first append (the per-group state read from disk, not kept in memory)
    assert _append(tmp_path / "b", tiny_backbone, items).added == 0
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
    from elasticmem.config import BackboneConfig
    from elasticmem.data.schema import Turn
    root, mode = sys.argv[1], sys.argv[2]
    bb = load_backbone(BackboneConfig(name_or_path="tiny", device="cpu"))
    real_replace, real_write = os.replace, os.write
    def replace(src, dst):  # die at the rename that would make the named file appear
        if mode != "loop" and os.path.basename(str(dst)).startswith(mode):
            os._exit(9)
        real_replace(src, dst)
    def write(fd, data):  # mode "journal-": die with half of the commit record written
        if mode == "journal-" and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(mode):
            real_write(fd, bytes(data)[: len(data) // 2])
            os._exit(9)
        return real_write(fd, data)
    os.replace, os.write = replace, write
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
    # a build's bank: the first file an append writes, its chunk file, and its commit (the manifest
    # that starts a journal); then, with a journal, the commit is a journal record: torn in half
    for mode in ("shard-", "chunks-", "manifest.json", "journal-"):
        if mode == "journal-":
            bank = _append(root, tiny_backbone, [SessionAdd("first", [_examples()[1].history[0][0]])]).bank
            before, journal = _snapshot(bank), bank.journal.read_bytes()
        p = _run_crash(root, mode)
        _, err = p.communicate(timeout=600)  # a loaded machine may take minutes to start a process
        assert p.returncode == 9, err[-2000:]
        again = Bank.open(root, expect_fingerprint=tiny_backbone.fingerprint, verify=True)
        now = _snapshot(again)
        assert now[0] == before[0] and torch.equal(now[1], before[1]) and torch.equal(now[2], before[2])
        assert now[3:] == before[3:]
    assert len(bank.journal.read_bytes()) > len(journal)  # the torn half is on disk, and ignored
    assert bank.refresh() is bank
    # SIGKILL at a random moment of a stream of appends: the bank opens, verifies, and holds whole appends
    p = _run_crash(root, "loop")
    p.stdout.readline()  # the first append committed (after the torn record): encoding or writing from here on
    # a new moment each run (a kill anywhere must be safe); failures name the seed, and
    # ELASTICMEM_KILL_SEED=<seed> draws the same delay again
    seed = int(os.environ.get("ELASTICMEM_KILL_SEED", time.time_ns() % 2**32))
    delay = float(np.random.default_rng(seed).uniform(0.05, 1.5))
    when = f"SIGKILL {delay:.2f} s after the first append (ELASTICMEM_KILL_SEED={seed})"
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    try:
        after = Bank.open(root, expect_fingerprint=tiny_backbone.fingerprint, verify=True)
    except Exception as e:  # whatever a torn bank raises, the failure names the moment
        raise AssertionError(f"{when}: {e!r}") from e
    appended = after.num_chunks - before[0]
    assert appended >= 2 and appended % 2 == 0, (appended, when)  # each append adds a g0 chunk and a 'new' chunk
    assert [c["text"] for c in after.chunks()][: before[0]] == before[3], when
    assert after.group_size("new") == appended // 2, when
    # and the next append after the kill works and is read by a fresh reader
    res = _append(after, tiny_backbone, [SessionAdd("late", [dataclasses.replace(_examples()[0].history[0][0])])])
    assert res.added == 1 and Bank.open(root).group_size("late") == 1


def test_many_small_appends_are_compacted_without_moving_rows(tmp_path, tiny_backbone, monkeypatch):
    from elasticmem.bank import append as append_mod
    from elasticmem.data.schema import Turn

    monkeypatch.setattr(append_mod, "COMPACT_FANOUT", 2)  # levels at 2, 4 and 8 rows
    monkeypatch.setattr(append_mod, "COMPACT_ROWS", 8)
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
    appended = [s.rows for s in bank.shards[built_shards:]]
    assert len(appended) <= 3 + 23 // 8 + 1, appended  # not one shard per append: at most one per level left
    assert max(appended) < 2 * 8 and sum(appended) == 23
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
    assert len([n for n in names if n.startswith("journal-")]) > 1  # replaced journals too
    monkeypatch.setattr(append_mod, "GRACE_S", 0.0)
    compacted = append_mod.compact(root)
    needed = {s.file for s in compacted.shards} | {c["file"] for c in compacted.manifest["chunk_files"]}
    assert {p.name for p in root.iterdir() if p.name.startswith(("shard-", "chunks-"))} == needed
    assert [p.name for p in root.iterdir() if p.name.startswith("journal-")] == [compacted.journal.name]
    assert compacted.num_chunks == bank.num_chunks and Bank.open(root, verify=True).chunks() == bank.chunks()


def _one_chunk_sessions(group: str, n: int):
    """``n`` sessions of ``group``, one user + assistant pair (one chunk) each, every text distinct."""
    from elasticmem.data.schema import Turn

    words = "cat dog sun box cup hat key map pen bed car egg fox owl".split()
    return [[Turn("user", f"{group} {' '.join(words[(i * 5 + j) % 14] for j in range(1 + i % 7))} {i}"),
             Turn("assistant", f"the {words[i % 14]} {i}")] for i in range(n)]


def test_compaction_writes_each_row_at_most_once_per_level(tmp_path, tiny_backbone, monkeypatch):
    """Bytes compaction writes (counted at every file write made while it runs) are at most twice the
    bytes the bank's files hold (levels at 4 and 16 rows: a row is rewritten at most twice), and a bank
    grown by 60 one-row appends and compacted equals a build of the union."""
    from elasticmem.bank import append as append_mod
    from elasticmem.data.schema import Example

    monkeypatch.setattr(append_mod, "COMPACT_FANOUT", 4)
    monkeypatch.setattr(append_mod, "COMPACT_ROWS", 16)
    written = {"compaction": 0, "append": 0}
    inside = []
    write, compact = append_mod._atomic_write_bytes, append_mod._compact

    def counted_write(path, data):
        written["compaction" if inside else "append"] += len(data)
        return write(path, data)

    def counted_compact(*a, **k):
        inside.append(1)
        try:
            return compact(*a, **k)
        finally:
            inside.pop()

    monkeypatch.setattr(append_mod, "_atomic_write_bytes", counted_write)
    monkeypatch.setattr(append_mod, "_compact", counted_compact)
    hist = {g: _one_chunk_sessions(g, 20) for g in ("a", "b", "c")}
    cfg = BankConfig(dir=str(tmp_path / "grown"), **BANK)
    bank = create_bank(cfg.dir, tiny_backbone, CHUNKING, cfg, torch.float32)
    for s in range(20):
        for g, h in hist.items():  # interleaved groups: each append is a new segment of its group
            bank = _append(bank, tiny_backbone, [SessionAdd(g, h[s], s)]).bank
    assert bank.num_chunks == 60 and bank.manifest["build"]["compactions"] >= 4
    files = {s.file for s in bank.shards} | {c["file"] for c in bank.manifest["chunk_files"]}
    kept = sum((bank.root / f).stat().st_size for f in files)
    assert 0 < written["compaction"] <= 2 * kept, (written, kept)
    assert len(bank.shards) <= 2 * 3 + 60 // 16 + 1, [s.rows for s in bank.shards]
    bank.verify()
    examples = [Example(id=f"{g}-q", source="test", group=g, question="?", choices=["x", "y"], answer_index=0,
                        question_type="t", history=h) for g, h in hist.items()]
    union = _build(tmp_path, tiny_backbone, "union", examples)
    _assert_same_groups(bank, union, hist)
    _assert_same_groups(Bank.open(bank.root, verify=True), union, hist)  # a fresh reader: manifest + journal


WRITER_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from elasticmem.backbone import load_backbone
    from elasticmem.bank.append import SessionAdd, append_sessions
    from elasticmem.config import BackboneConfig
    from elasticmem.data.schema import Turn
    root, barrier, me, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    bb = load_backbone(BackboneConfig(name_or_path="tiny", device="cpu"))
    (barrier / f"ready-{me}").touch()
    while not all((barrier / f"ready-{k}").exists() for k in (0, 1)):  # start together
        time.sleep(0.01)
    bank = root
    words = "cat dog sun box cup hat key map pen bed car egg fox owl".split()
    for i in range(n):
        turns = [Turn("user", f"writer {me} {words[i % 14]} {i}"), Turn("assistant", f"ok {me} {i}")]
        group = "both" if i % 2 else f"w{me}"  # a group both write to, and one of its own
        bank = append_sessions(bank, [SessionAdd(group, turns)], bb.model.get_decoder(), bb.tokenizer,
                               bb.fingerprint, batch_size=2).bank  # the snapshot, as the live memory passes it
    print("done", flush=True)
""")


def test_two_processes_appending_at_once_lose_nothing(tmp_path, tiny_backbone):
    from elasticmem.bank.builder import chunks_fingerprint

    cfg = BankConfig(dir=str(tmp_path / "b"), **BANK)
    root = create_bank(cfg.dir, tiny_backbone, CHUNKING, cfg, torch.float32).root
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    n = 50
    procs = [subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(root), str(tmp_path), str(me), str(n)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for me in (0, 1)]
    for p in procs:
        out, err = p.communicate(timeout=1200)  # a loaded machine may take minutes to start a process
        assert p.returncode == 0 and "done" in out, err[-3000:]
    bank = Bank.open(root, expect_fingerprint=tiny_backbone.fingerprint, verify=True)
    assert bank.num_chunks == 2 * n
    chunks = bank.chunks()
    assert [c["row"] for c in chunks] == list(range(2 * n))
    assert {g: bank.group_size(g) for g in bank.groups} == {"w0": n // 2, "w1": n // 2, "both": n}
    for g in bank.groups:
        texts = [chunks[r]["text"] for r in bank.group_row_ids(g).tolist()]
        assert len(set(texts)) == len(texts)
        assert bank.groups_sha256[g] == chunks_fingerprint(texts), g  # recomputed from the texts
    # each append to the shared group was its next session, whichever process made it
    assert sorted(chunks[r]["session"] for r in bank.group_row_ids("both").tolist()) == list(range(n))
    writers = [c["text"].split("writer ")[1][0] for c in chunks]
    assert sum(a != b for a, b in zip(writers, writers[1:])) >= 4, "".join(writers)  # the writers overlapped
