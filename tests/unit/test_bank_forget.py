"""Forgetting memories of a bank (elasticmem.bank.forget), tiny random model, CPU.

    OMP_NUM_THREADS=1 pytest tests/unit/test_bank_forget.py

A delete must take its rows out of every search at once (the rows an exact search restricted to
each group returns are compared with an oracle: the rows added minus the rows deleted), in this
process and in another one after its refresh; compaction must leave no byte of a deleted chunk's
text, key or cached states in any file under the bank folder while the survivors load equal to
before; a process killed at each point of a delete (its commit record torn in half, each rename
and unlink of the purge, and SIGKILL at a random moment of a stream of deletes) must leave the
bank either before or after each whole delete, opening and verifying; unknown rows are refused
with nothing deleted, and a delete on a built bank (no journal yet) starts one.
"""

from __future__ import annotations

import json
import os
import shutil
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

from elasticmem.bank import Bank, build_bank, build_index
from elasticmem.bank.append import SessionAdd, append_sessions, compact
from elasticmem.bank.forget import MemoryNotFound, forget_rows
from elasticmem.config import BankConfig, ChunkingConfig, IndexConfig
from elasticmem.data.schema import Turn

CHUNKING = ChunkingConfig(max_tokens=48, truncation_side="right", add_special_tokens=True)
ROOT = Path(__file__).resolve().parents[2]


def _secret(i: int) -> list[Turn]:
    """One session of one chunk whose text no other chunk contains (a number no other text has)."""
    words = "cat dog sun box cup hat key map pen bed car egg fox owl".split()
    return [Turn("user", f"secret {9000 + i} " + " ".join(words[(i + j) % 14] for j in range(6))),
            Turn("assistant", f"noted {9000 + i}")]


def _bank(tmp_path, backbone, kv: bool = False) -> Bank:
    """A built bank of groups g0-g2 (shards of 5 rows) grown by appends: a secret session in g0 and
    g1, and a group 'gone' of two sessions."""
    cfg = BankConfig(dir=str(tmp_path / "bank"), n_cache=8, batch_size=5, shard_rows=5, kv_cache=kv)
    build_bank({"train": make_examples(3, seed=3)}, backbone, CHUNKING, cfg, torch.float32, show_progress=False)
    bank = Bank.open(cfg.dir)
    dec, tok, fp = backbone.model.get_decoder(), backbone.tokenizer, backbone.fingerprint
    bank = append_sessions(bank, [SessionAdd("g0", _secret(0)), SessionAdd("g1", _secret(1))], dec, tok, fp).bank
    bank = append_sessions(bank, [SessionAdd("gone", _secret(2)), SessionAdd("gone", _secret(3))], dec, tok, fp).bank
    assert bank.group_size("gone") == 2 and len(bank.groups) == 4
    return bank


def _rows(bank) -> dict[str, set[int]]:
    return {g: set(bank.group_row_ids(g).tolist()) for g in bank.groups}


def _searched(bank) -> dict[str, set[int]]:
    """Every row an exact search restricted to each group returns, for queries that are the keys of
    all rows ever added (a deleted row's own key would find it first), k = every row."""
    index = build_index(bank, IndexConfig(type="torch"))
    queries = bank.keys()
    out: dict[str, set[int]] = {}
    for g in bank.groups:
        res = index.search(queries, bank.num_chunks, groups=[g] * len(queries))
        out[g] = set(res.rows[res.rows >= 0].tolist())
    whole = index.search(queries, bank.num_chunks)
    out[None] = set(whole.rows[whole.rows >= 0].tolist())
    return out


def _to_forget(bank) -> list[int]:
    """A built row of g1 (in a build shard, text in chunks.jsonl), g0's appended secret, all of 'gone'."""
    chunks = bank.chunks()
    g0 = [r for r in bank.group_row_ids("g0").tolist() if "secret" in chunks[r]["text"]]
    g1_built = bank.group_row_ids("g1").tolist()[0]
    return [g1_built, *g0, *bank.group_row_ids("gone").tolist()]


READER_SCRIPT = textwrap.dedent("""
    import json, sys
    from elasticmem.bank import Bank, build_index
    from elasticmem.config import IndexConfig
    bank = Bank.open(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()  # the delete is committed
    bank = bank.refresh()
    index = build_index(bank, IndexConfig(type="torch"))
    q = bank.keys()
    out = {}
    for g in bank.groups:
        res = index.search(q, bank.num_chunks, groups=[g] * len(q))
        out[g] = sorted(set(res.rows[res.rows >= 0].tolist()))
    print(json.dumps(out), flush=True)
""")


def test_deleted_rows_leave_search_at_once_here_and_in_another_process(tmp_path, tiny_backbone):
    bank = _bank(tmp_path, tiny_backbone)
    before = _rows(bank)
    assert _searched(bank)["g0"] == before["g0"]  # the check sees every row of a group
    gone = _to_forget(bank)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    reader = subprocess.Popen([sys.executable, "-c", READER_SCRIPT, str(bank.root)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready", reader.stderr.read()[-2000:]
        old = bank
        res = forget_rows(bank, gone)
        assert sorted(r for rs in res.rows.values() for r in rs) == sorted(gone) and not res.purged
        oracle = {g: rows - set(gone) for g, rows in before.items() if rows - set(gone)}
        assert "gone" not in res.bank.groups and _rows(res.bank) == oracle
        found = _searched(res.bank)  # this process, at once
        assert {g: found[g] for g in oracle} == oracle
        assert found[None] == set(range(bank.num_chunks)) - set(gone)  # unrestricted search too
        assert _rows(old.refresh()) == oracle  # a snapshot opened before, refreshed
        reader.stdin.write("go\n")
        reader.stdin.flush()
        out, err = reader.communicate(timeout=600)
    finally:
        reader.kill()
    assert reader.returncode == 0, err[-2000:]
    assert {g: set(r) for g, r in json.loads(out.splitlines()[-1]).items()} == oracle  # another process
    # survivors keep their ids; the groups' fingerprints are those of the survivors' texts
    from elasticmem.data.chunking import chunks_fingerprint

    now = Bank.open(bank.root)
    assert now.groups_sha256["g1"] == chunks_fingerprint([now.chunk(r)["text"] for r in sorted(oracle["g1"])])
    with pytest.raises(MemoryNotFound, match="forgotten already"):  # nothing deleted twice, nothing half
        forget_rows(now, [gone[0], sorted(oracle["g2"])[0]])
    assert _rows(Bank.open(bank.root)) == oracle
    # the group's next append works from the survivors (a forgotten text may be added again)
    again = append_sessions(now.root, [SessionAdd("g0", _secret(0))], tiny_backbone.model.get_decoder(),
                            tiny_backbone.tokenizer, tiny_backbone.fingerprint)
    assert again.added == 1 and again.rows["g0"][0] == bank.num_chunks  # a new row: ids are never reused


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _holders(files: dict[str, bytes], needle: bytes) -> list[str]:
    return [name for name, data in files.items() if needle in data]


@pytest.mark.parametrize("kv", [False, True], ids=["hidden", "kv"])
def test_compaction_leaves_no_byte_of_a_deleted_memory(tmp_path, tiny_backbone, kv):
    bank = _bank(tmp_path, tiny_backbone, kv=kv)
    build_index(bank, IndexConfig(type="hnsw", save=True))  # a saved index holds keys too
    assert (bank.root / "index.faiss").is_file()
    gone = _to_forget(bank)
    chunks = bank.chunks()
    survivors = sorted(set(range(bank.num_chunks)) - set(gone))
    texts = {r: chunks[r]["text"] for r in range(bank.num_chunks)}
    secret = [r for r in gone if "secret" in texts[r]]
    assert len(secret) == 3
    # what must vanish: the secret texts (as stored, JSON-escaped, and their user turn), each deleted row's
    # key and last cached state (raw float bytes) and, with kv, its last per-layer key/value slot
    needles = {}
    for r in secret:
        needles[f"text of row {r}"] = json.dumps(texts[r], ensure_ascii=False)[1:-1].encode()
        needles[f"user turn of row {r}"] = next(t for t in texts[r].split("\n") if "secret" in t).encode()
    keys = bank.keys()
    cache, _ = bank.gather(torch.arange(bank.num_chunks))
    kvs = bank.gather_kv(torch.arange(bank.num_chunks)) if kv else None
    for r in gone:
        needles[f"key of row {r}"] = keys[r].numpy().tobytes()
        needles[f"cache of row {r}"] = cache[r, -1].numpy().tobytes()
        if kv:
            needles[f"kv of row {r}"] = kvs[r, -1].contiguous().numpy().tobytes()
    before_files = _files(bank.root)
    for what, needle in needles.items():  # the check finds them before
        assert _holders(before_files, needle), what
    keep = {"keys": keys[survivors].clone(), "cache": cache[survivors].clone(),
            "chunks": [dict(chunks[r]) for r in survivors], **({"kv": kvs[survivors].clone()} if kv else {})}

    deleted = forget_rows(bank.root, gone).bank
    assert deleted.unpurged  # the data is still on disk until compaction
    purged = compact(bank.root)
    assert not purged.unpurged and purged.deleted == deleted.deleted
    after = _files(bank.root)
    for what, needle in needles.items():
        assert not _holders(after, needle), f"{what} is still in {_holders(after, needle)}"
    assert not (bank.root / "index.faiss").exists()
    # the survivors load equal to before, with their ids; the bank verifies
    again = Bank.open(bank.root, verify=True)
    assert torch.equal(again.keys()[survivors], keep["keys"])
    assert torch.equal(again.gather(torch.tensor(survivors))[0], keep["cache"])
    if kv:
        assert torch.equal(again.gather_kv(torch.tensor(survivors)), keep["kv"])
    assert [dict(again.chunk(r)) for r in survivors] == keep["chunks"]
    assert all(again.chunk(r).get("deleted") and not again.chunk(r)["text"] for r in gone)
    for r in survivors:  # and their texts are on disk still
        assert _holders(after, json.dumps(texts[r], ensure_ascii=False)[1:-1].encode())
    # a second compaction has nothing to purge and keeps the bank
    assert compact(bank.root).manifest["shards"] == again.manifest["shards"]


CRASH_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from elasticmem.bank.forget import forget_rows
    root, mode, plan = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    real_replace, real_write, real_unlink = os.replace, os.write, os.unlink
    def replace(src, dst):  # die at the rename that would make the named file appear
        if os.path.basename(str(dst)).startswith(mode):
            os._exit(9)
        real_replace(src, dst)
    def write(fd, data):  # mode "journal-": die with half of the delete record written
        if mode == "journal-" and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(mode):
            real_write(fd, bytes(data)[: len(data) // 2])
            os._exit(9)
        return real_write(fd, data)
    def unlink(path, *a, **k):  # mode "unlink": die before the purge deletes the replaced files
        if mode == "unlink" and os.path.basename(str(path)).startswith(("shard-", "chunks-")):
            os._exit(9)
        return real_unlink(path, *a, **k)
    os.replace, os.write, os.unlink = replace, write, unlink
    import time
    for rows in plan:
        t0 = time.perf_counter()
        forget_rows(root, rows, purge=True)
        print(json.dumps(rows), round(time.perf_counter() - t0, 3), flush=True)
""")


def _run_crash(root, mode, plan):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, str(root), mode, json.dumps(plan)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _state(root) -> tuple[dict[str, set[int]], dict[str, str]]:
    bank = Bank.open(root, verify=True)
    return _rows(bank), dict(bank.groups_sha256)


def test_killed_delete_leaves_the_bank_before_or_after(tmp_path, tiny_backbone):
    bank = _bank(tmp_path, tiny_backbone)
    root = bank.root
    many = [Turn("user" if i % 2 == 0 else "assistant", f"pad {i} cat dog") for i in range(60)]
    bank = append_sessions(bank, [SessionAdd("g1", many), SessionAdd("g2", many)], tiny_backbone.model.get_decoder(),
                           tiny_backbone.tokenizer, tiny_backbone.fingerprint).bank  # for a long stream of deletes
    gone = _to_forget(bank)
    before = _state(root)
    saved = shutil.copytree(root, tmp_path / "saved")
    # the commit torn in half: before; dying at the purge's first file, its manifest or its unlinks:
    # after the delete (committed), its data still on disk until the next compaction
    for mode, committed in (("journal-", False), ("shard-", True), ("chunks-", True), ("chunks.jsonl", True),
                            ("manifest.json", True),
                            ("unlink", True)):
        p = _run_crash(root, mode, [gone])
        _, err = p.communicate(timeout=600)
        assert p.returncode == 9, (mode, err[-2000:])
        now = _state(root)
        if not committed:
            assert now == before, mode
            continue
        assert now[0] == {g: rows - set(gone) for g, rows in before[0].items() if rows - set(gone)}, mode
        secret = next(json.dumps(bank.chunk(r)["text"])[1:-1] for r in gone if "secret" in bank.chunk(r)["text"]).encode()
        assert _holders(_files(root), secret), mode  # not purged yet...
        compact(root)
        assert not _holders(_files(root), secret), mode  # ...until the next compaction
        assert _state(root) == now, mode
        shutil.rmtree(root)  # undo the delete for the next mode: the bank as before, from a copy
        shutil.copytree(saved, root)
        assert _state(root) == before
    # SIGKILL at a random moment of a stream of deletes of two rows each (in two groups): the bank
    # holds a prefix of the deletes, each whole
    rows = {g: sorted(r) for g, r in before[0].items()}
    plan = [[rows["g2"][i], rows["g1"][i]] for i in range(min(len(rows["g1"]), len(rows["g2"])))]
    assert len(plan) >= 30
    p = _run_crash(root, "loop", plan)
    p.stdout.readline()  # the first delete committed: the next ones from here on
    seed = int(os.environ.get("ELASTICMEM_KILL_SEED", time.time_ns() % 2**32))
    delay = float(np.random.default_rng(seed).uniform(0.0, 0.4))  # deletes take ~20 ms each
    when = f"SIGKILL {delay:.2f} s after the first delete (ELASTICMEM_KILL_SEED={seed})"
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    when += " (it had finished)" if p.returncode == 0 else ""
    try:
        now = _state(root)[0]
    except Exception as e:
        raise AssertionError(f"{when}: {e!r}") from e
    done = [d for d in plan if not any(r in now.get(g, ()) for g, r in zip(("g2", "g1"), d))]
    assert done == plan[: len(done)] and len(done) >= 1, (done, when)
    assert all(all(r in now.get(g, ()) for g, r in zip(("g2", "g1"), d)) for d in plan[len(done):]), when
    assert not compact(root).unpurged


def test_unknown_rows_are_refused(tmp_path, tiny_backbone):
    bank = _bank(tmp_path, tiny_backbone)
    with pytest.raises(MemoryNotFound, match="no memory with row id"):
        forget_rows(bank, [bank.num_chunks + 5])
    assert forget_rows(bank, []).deleted == 0 and Bank.open(bank.root).manifest == bank.manifest


def test_a_delete_on_a_built_bank_starts_its_journal(tmp_path, tiny_backbone):
    cfg = BankConfig(dir=str(tmp_path / "built"), n_cache=8, batch_size=5, shard_rows=5)
    build_bank({"train": make_examples(2, seed=3)}, tiny_backbone, CHUNKING, cfg, torch.float32, show_progress=False)
    bank = Bank.open(cfg.dir)
    assert bank.journal is None
    row = bank.group_row_ids("g1").tolist()[-1]
    res = forget_rows(cfg.dir, [row], purge=True)
    again = Bank.open(cfg.dir, verify=True)
    assert again.journal is not None and row not in again.group_row_ids("g1").tolist()
    assert again.chunk(row)["deleted"] and again.manifest == res.bank.manifest
    assert not again.keys()[row].any() and again.keys()[row - 1].any()
