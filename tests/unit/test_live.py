"""The live-memory Python API (elasticmem.live.LiveMemory) on the tiny random model, CPU.

    pytest tests/unit/test_live.py

Adds land in the bank and are retrieved by the next ask, only from the asker's group; a retried
add adds nothing; batched asks equal one-at-a-time asks; a second LiveMemory on the same folder
sees the first one's adds after refresh(); a saved checkpoint loads with its weights; a forgotten
memory (one, a session, a group) leaves chunks() and every ask at once, here and in a second
LiveMemory, and its text leaves the bank's files.
"""

from __future__ import annotations

import pytest
import torch

from elasticmem.live import AskRequest, LiveMemory
from elasticmem.utils.configuration import save

OVERRIDES = ["backbone.name_or_path=tiny", "backbone.device=cpu", "memory.retrieval=frozen", "memory.top_z=2",
             "memory.max_new_tokens=3", "memory.policy.max_budget=4", "bank.n_cache=8", "chunking.max_tokens=48"]
WORDS = "cat dog sun box cup hat key map pen bed car egg fox owl".split()


def _session(i: int) -> list[dict]:
    said = " ".join(WORDS[(i + j) % 14] for j in range(6))
    return [{"role": "user", "content": f"{said} {i}", "date": "2024-05-01"},
            {"role": "assistant", "content": f"the {WORDS[i % 14]} {i}"}]


@pytest.fixture
def live(tmp_path_factory):
    """A LiveMemory over a new empty bank for each test, so that each test holds in any order or alone."""
    torch.manual_seed(0)
    return LiveMemory.load(bank=tmp_path_factory.mktemp("live") / "bank", overrides=OVERRIDES, batch_size=4)


def test_add_then_ask_retrieves_only_the_groups_memories(live):
    assert live.ask("nobody", "what is the cat?").memories == []  # a group with no memory: answered without
    a = live.add("alice", _session(0))
    assert (a.added, a.skipped) == (1, 0) and len(a.rows) == 1
    assert live.add("alice", _session(0)).added == 0  # a retried add
    results = live.add_many([("alice", _session(1)), ("bob", _session(2)), ("bob", _session(3))])
    assert [r.added for r in results] == [1, 1, 1] and [r.group for r in results] == ["alice", "bob", "bob"]
    assert live.groups() == ["alice", "bob"]
    alice = live.chunks("alice")
    assert [c["row"] for c in alice] == a.rows + results[0].rows and [c["session"] for c in alice] == [0, 1]
    assert alice[0]["text"].startswith("[2024-05-01]\n")  # chunked as the data pipeline chunks a session
    assert live.chunks("carol") == []
    for group in ("alice", "bob"):
        ans = live.ask(group, "what is the cat?")
        rows = {c["row"] for c in live.chunks(group)}
        assert ans.memories and all(m.group == group and m.row in rows for m in ans.memories)
        assert ans.total_tokens == ans.prompt_tokens + ans.memory_tokens + ans.generated_tokens
        assert ans.memory_tokens == sum(m.tokens for m in ans.memories) > 0
        assert ans.latency["total"] > 0 and ans.generated_tokens <= 3
    mc = live.ask("bob", "which animal?", choices=["cat", "dog"], max_new_tokens=1)
    assert mc.generated_tokens <= 1


def test_batched_asks_equal_one_at_a_time(live):
    live.add_many([("alice" if i % 2 == 0 else "bob", _session(i)) for i in range(6)])  # 3 memories each
    reqs = [AskRequest(g, q, c, n) for g, q, c, n in [
        ("alice", "what is the cat?", None, None), ("bob", "where is the box?", None, 2),
        ("alice", "which one?", ["sun", "hat", "key"], 1), ("bob", "what is the cat?", None, None),
        ("nobody", "anything?", None, None), ("alice", "where is the pen?", None, 2)]]
    many = live.ask_many(reqs)
    for r, m in zip(reqs, many):
        one = live.ask(r.group, r.question, r.choices, r.max_new_tokens)
        assert one.text == m.text and one.total_tokens == m.total_tokens
        assert [(x.row, x.budget) for x in one.memories] == [(x.row, x.budget) for x in m.memories]
        assert all(abs(x.score - y.score) < 1e-5 for x, y in zip(one.memories, m.memories))


def test_bad_input_is_refused_clearly(live):
    with pytest.raises(ValueError, match="non-empty list"):
        live.add("alice", [])
    with pytest.raises(ValueError, match="characters; the limit"):
        live.add("alice", [{"role": "user", "content": "x" * (live.max_turn_chars + 1)}])
    with pytest.raises(ValueError, match="role"):
        live.add("alice", [{"content": "hi"}])
    with pytest.raises(ValueError, match="memory group"):
        live.add("", _session(9))
    with pytest.raises(ValueError, match="2 to 26 choices"):
        live.ask("alice", "which?", choices=["only"])
    with pytest.raises(ValueError, match="non-empty string"):
        live.ask("alice", "  ")


def test_a_second_reader_sees_adds_after_refresh_and_checkpoints_load(live, tmp_path):
    live.add("alice", _session(0))
    other = LiveMemory.load(bank=live.bank.root, overrides=OVERRIDES)
    snapshot = other.bank
    added = live.add("carol", _session(7))
    assert "carol" not in snapshot.groups and snapshot.refresh().group_row_ids("carol").tolist() == added.rows
    # the other instance notices the new manifest by itself (one stat per call)
    assert other.chunks("carol")[0]["row"] == added.rows[0] and other.bank is not snapshot
    assert {m.row for m in other.ask("carol", "what is the cat?").memories} == set(added.rows)
    assert not other.refresh()
    live.add("carol", _session(8))
    assert other.refresh() and len(other.chunks("carol")) == 2

    # a saved model (train.py's final/ + the run's config.yaml) loads with its weights
    with torch.no_grad():
        for p in live.model.policy.parameters():
            p.add_(0.01)
    live.model.save_pretrained(tmp_path / "run" / "final")
    from elasticmem.config import Config
    from elasticmem.utils.configuration import load

    save(load(Config, None, OVERRIDES), tmp_path / "run" / "config.yaml")
    loaded = LiveMemory.load(tmp_path / "run" / "final", bank=live.bank.root, system="text_rag")
    assert loaded.system == "text_rag" and loaded.model.cfg.injection == "text"
    for (n, p), (_, q) in zip(live.model.policy.named_parameters(), loaded.model.policy.named_parameters()):
        assert torch.equal(p, q), n
    ans = loaded.ask("alice", "what is the cat?")
    assert ans.memories and all(m.budget is None and m.group == "alice" for m in ans.memories)
    with pytest.raises(ValueError, match="system must be one of"):
        LiveMemory.load(bank=live.bank.root, overrides=OVERRIDES, system="amem")


def test_forget_a_memory_a_session_and_a_group(live):
    from elasticmem.bank.forget import MemoryNotFound

    live.add("alice", _session(0))
    other = LiveMemory.load(bank=live.bank.root, overrides=OVERRIDES)  # a second process's view
    adds = [live.add("erin", _session(20 + i)) for i in range(4)]  # sessions 0-3, one memory each
    rows = [a.rows[0] for a in adds]
    texts = {c["row"]: c["text"] for c in live.chunks("erin")}
    assert {m.row for m in other.ask("erin", "what is the cat?").memories}  # it retrieves erin's memories
    gone = live.forget("erin", row=rows[1])
    assert (gone.deleted, gone.rows, gone.purged) == (1, [rows[1]], True)
    alive = [rows[0], *rows[2:]]
    for mem in (live, other):  # at once here, and in the other after its (automatic) refresh
        assert [c["row"] for c in mem.chunks("erin")] == alive  # the survivors keep their ids
        for q in ("what is the cat?", texts[rows[1]], "dog sun box"):
            assert {m.row for m in mem.ask("erin", q).memories} <= set(alive)
    raw = b"".join(p.read_bytes() for p in live.bank.root.rglob("*") if p.is_file())
    assert texts[rows[1]].split("\n")[-1].encode() not in raw and texts[rows[2]].split("\n")[-1].encode() in raw
    assert live.forget("erin", session=2).rows == [rows[2]]
    with pytest.raises(MemoryNotFound, match="row id"):
        live.forget("erin", row=rows[1])  # forgotten already
    with pytest.raises(MemoryNotFound, match="row id"):
        live.forget("erin", row=live.chunks("alice")[0]["row"])  # another group's memory
    with pytest.raises(MemoryNotFound, match="session 7"):
        live.forget("erin", session=7)
    with pytest.raises(ValueError, match="not both"):
        live.forget("erin", row=rows[0], session=0)
    whole = live.forget("erin")
    assert whole.rows == [rows[0], rows[3]] and "erin" not in live.groups() and live.chunks("erin") == []
    assert other.chunks("erin") == [] and other.ask("erin", "what is the cat?").memories == []
    with pytest.raises(MemoryNotFound, match="holds no memory"):
        live.forget("erin")
    assert live.chunks("alice") and live.ask("alice", "what is the cat?").memories  # other groups keep theirs
