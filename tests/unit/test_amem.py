"""Unit tests of the A-Mem baseline with a scripted fake LLM and a hashing encoder (fast, offline).

    OMP_NUM_THREADS=1 pytest tests/unit/test_amem.py -q

The fake backend returns chosen JSON per kind of call (note, decision, expansion, answer),
including malformed answers; the hashing encoder makes nearest neighbours predictable (texts
that share words are close, others orthogonal).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import textwrap
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from elasticmem.baselines.amem import prompts
from elasticmem.baselines.amem.config import AMemConfig, AMemLLMConfig
from elasticmem.baselines.amem.embed import HashingEmbedder
from elasticmem.llm.client import Completion, GenRequest, OpenAIBackend, ServerError, StructuredLLM
from elasticmem.baselines.amem.memory import AgenticMemory
from elasticmem.baselines.amem.store import NoteStore
from elasticmem.llm.structured import Arr, Bool, Enum, Matcher, Obj, Str, accepts, canonical
from elasticmem.baselines.amem.system import AMemSystem
from elasticmem.data.schema import Example, Turn
from elasticmem.utils.configuration import ConfigError

ROOT = Path(__file__).resolve().parents[2]

Responder = Callable[[GenRequest], str]


# --------------------------------------------------------------------------- fakes


def neighbour_ids(req: GenRequest) -> list[str]:
    """The neighbour ids a decision request allows (from its schema)."""
    node = dict(req.schema.fields)["suggested_connections"]
    return list(node.item.values)


def neighbour_contexts(req: GenRequest) -> list[str]:
    """Current contexts of the neighbours, from the prompt (in the listed order)."""
    out = []
    for line in req.messages[-1]["content"].splitlines():
        if line.startswith("[n"):
            out.append(line.split("context: ", 1)[1].split(" | keywords:")[0])
    return out


def note_from_content(req: GenRequest) -> str:
    content = req.messages[-1]["content"].split("Content: ", 1)[1]
    words = [w.strip(".,!?").lower() for w in content.split(":", 1)[-1].split()]
    return canonical({"keywords": words[:3] or ["x"], "context": f"About {' '.join(words[:3])}.", "tags": ["chat"]})


def no_change(req: GenRequest) -> str:
    fields = dict(req.schema.fields)
    d: dict[str, Any] = {"should_evolve": False, "actions": [], "suggested_connections": [], "tags_to_update": []}
    if "new_context_neighborhood" in fields:
        ctx = neighbour_contexts(req)
        d["new_context_neighborhood"] = ctx
        d["new_tags_neighborhood"] = [[] for _ in ctx]
    return canonical(d)


class ScriptedBackend:
    """Answers from per-kind queues (strings or callables of the request), then from defaults."""

    name = "scripted"
    batch_size = 4

    def __init__(self, **queues: list[str | Responder]):
        self.queues = {k: deque(v) for k, v in queues.items()}
        self.calls: list[tuple[str, GenRequest, float]] = []
        self.defaults: dict[str, Responder] = {"note": note_from_content, "decision": no_change,
                                               "expansion": lambda r: canonical({"keywords": ["extra"]}),
                                               "answer": lambda r: "an answer\nmore"}

    def generate(self, requests, temperature=0.0, seed=0):
        out = []
        for r in requests:
            self.calls.append((r.kind, r, temperature))
            q = self.queues.get(r.kind)
            item = q.popleft() if q else self.defaults[r.kind]
            text = item(r) if callable(item) else item
            prompt = sum(self.count_tokens(m["content"]) for m in r.messages) + 3
            out.append(Completion(text, prompt, self.count_tokens(text), True))
        return out

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def kinds(self) -> list[str]:
        return [k for k, _, _ in self.calls]


def make_memory(backend: ScriptedBackend, path: Path | None = None, **cfg_kw) -> AgenticMemory:
    cfg_kw.setdefault("embedder", "hashing")
    cfg = AMemConfig(**cfg_kw)
    llm = StructuredLLM(backend, json_retries=cfg.llm.json_retries)
    emb = HashingEmbedder(256)
    if path is not None:
        return AgenticMemory.open(path, cfg, llm, emb)
    return AgenticMemory(cfg, llm, emb)


def link_to(word: str) -> Responder:
    """A decision that links the new note to the neighbour whose context mentions ``word``."""
    def respond(req: GenRequest) -> str:
        ids, ctx = neighbour_ids(req), neighbour_contexts(req)
        chosen = [i for i, c in zip(ids, ctx) if word in c]
        d = json.loads(no_change(req))
        d.update(should_evolve=True, actions=["strengthen"], suggested_connections=chosen,
                 tags_to_update=["chat", "linked"])
        return canonical(d)
    return respond


# --------------------------------------------------------------------------- structured


def test_matcher_accepts_canonical_json_and_rejects_everything_else():
    schema = Obj((("ok", Bool()), ("ids", Arr(Enum(("n1", "n12")), 0, 2)), ("ctx", Arr(Str(1, 8), 2, 2))))
    good = canonical({"ok": True, "ids": ["n12"], "ctx": ["a b", "c"]})
    assert accepts(schema, good)
    assert json.loads(good) and schema.validate(json.loads(good)) == []
    for bad in (good.replace("n12", "n3"), good.replace("true", "True"), good[:-1], good + " ",
                canonical({"ok": True, "ids": [], "ctx": ["a"]}),                 # wrong length
                canonical({"ok": True, "ids": [], "ctx": ["a", "123456789"]}),    # string too long
                canonical({"ok": True, "ids": [], "ctx": ["a", ""]}),             # empty string
                '{"ok": true, "ids": ["n1\\"x"], "ctx": ["a", "b"]}'):
        assert not accepts(schema, bad), bad
    m = Matcher(schema)
    assert m.allowed_first() == {"{"}
    assert m.forced() == '{"ok": ' and m.forced(space=False) == '{"ok":'  # keys cost the model no choice
    assert m.feed('{"ok": true, "ids": ["n1')
    assert m.allowed_first() == {'"', "2"} and m.forced() == ""
    assert accepts(schema, '{"ok":false,"ids":[],"ctx":["a","b"]}')  # spaces are optional


def test_strings_may_not_begin_like_the_worked_examples():
    s = Str(1, 80, banned_prefixes=("alice talks about",))
    assert not accepts(s, '"Alice talks about her dog."') and s.validate("alice talks about x")
    assert accepts(s, '"Alice talked about her dog."') and s.validate("Alice talked") == []
    ctx = prompts.note_schema(AMemConfig(embedder="hashing"))
    assert not accepts(ctx, canonical({"keywords": ["k"], "context": prompts.NOTE_EXAMPLE_CONTEXT, "tags": ["t"]}))


def test_decision_schema_names_neighbour_ids_and_fixes_list_lengths():
    cfg = AMemConfig(embedder="hashing")
    s = prompts.decision_schema(cfg, ["n4", "n9"])
    d = {"should_evolve": True, "actions": ["update_neighbor"], "suggested_connections": ["n4"],
         "tags_to_update": [], "new_context_neighborhood": ["x"], "new_tags_neighborhood": [["a"], ["b"]]}
    errors = s.validate(d)
    assert any("exactly 2" in e for e in errors)
    d["new_context_neighborhood"] = ["x", "y"]
    d["suggested_connections"] = ["n0"]  # a position, not a neighbour id
    assert any("not one of" in e for e in s.validate(d))
    d["suggested_connections"] = ["n9"]
    assert s.validate(d) == []
    d["new_context_neighborhood"] = ["x", "N4"]  # a copied id is no context
    assert any("not allowed" in e for e in s.validate(d))
    assert not accepts(s, canonical(d)) and accepts(s, canonical({**d, "new_context_neighborhood": ["x", "n44"]}))


# --------------------------------------------------------------------------- links and evolution


def test_links_are_stored_by_note_id_and_followed_at_retrieval():
    be = ScriptedBackend(decision=[no_change, link_to("apple")])
    mem = make_memory(be, evolution_k=2, retrieve_k=1, max_linked=5)
    a = mem.add("Ann: apple banana cherry")
    mem.add("Bob: dog cat mouse")
    c = mem.add("Ann: apple banana grape")
    assert c.neighbours[0] == a.note_id  # nearest first, named by id
    assert mem.get(c.note_id).links == [a.note_id] == c.links
    assert mem.get(c.note_id).tags == ["chat", "linked"]  # strengthen updates the new note's tags
    for _ in range(3):  # ids stay valid as the memory grows
        mem.add("Cid: totally unrelated words here")
    hits = mem.retrieve("grape")
    assert [(h.note.id, h.via, h.source) for h in hits] == [(c.note_id, "cosine", None), (a.note_id, "link", c.note_id)]
    assert hits[1].score == pytest.approx(float(np.dot(mem.embedder.encode(["grape"])[0], mem.get(a.note_id).embedding)))
    assert mem.retrieve("grape", max_linked=0)[1:] == []  # the linked budget is respected
    assert be.kinds().count("decision") == 5  # every add after the first makes one decision


def test_update_neighbor_changes_exactly_the_named_neighbours_and_reembeds_them():
    be = ScriptedBackend()
    mem = make_memory(be, evolution_k=2)
    n_far = mem.add("Zed: zebra zoo")                   # not a neighbour of the new note
    n_second = mem.add("Ann: apple pie")                # 2nd nearest
    n_first = mem.add("Ann: apple pie banana")          # nearest
    before = {nid: (mem.get(nid).context, list(mem.get(nid).tags), mem.get(nid).embedding.copy())
              for nid in (n_far.note_id, n_second.note_id, n_first.note_id)}

    def evolve(req: GenRequest) -> str:
        ids, ctx = neighbour_ids(req), neighbour_contexts(req)
        assert ids == [n_first.note_id, n_second.note_id]  # listed nearest first, by id
        return canonical({"should_evolve": True, "actions": ["update_neighbor"], "suggested_connections": [],
                          "tags_to_update": [], "new_context_neighborhood": ["Ann loves quince jam now.", ctx[1]],
                          "new_tags_neighborhood": [["food", "quince"], []]})

    be.queues["decision"] = deque([evolve])
    rep = mem.add("Ann: apple banana split")
    assert rep.evolved == [n_first.note_id]
    first = mem.get(n_first.note_id)
    assert (first.context, first.tags) == ("Ann loves quince jam now.", ["food", "quince"])
    assert first.history[-1] == {"op": 4, "by": rep.note_id, "context": before[n_first.note_id][0],
                                 "tags": before[n_first.note_id][1]}
    for nid in (n_far.note_id, n_second.note_id):  # the others are untouched
        n = mem.get(nid)
        assert (n.context, n.tags) == before[nid][:2]
        assert np.array_equal(n.embedding, before[nid][2])
    # Re-embedded at once, in the note and in the index: retrieval sees the new text.
    expect = mem.embedder.encode([first.embedding_text()])[0]
    assert np.allclose(first.embedding, expect) and np.allclose(mem.index.get(first.seq), expect)
    assert mem.retrieve("quince jam", k=1)[0].note.id == n_first.note_id


def test_neighbour_order_is_not_insertion_order():
    """The public code applied the i-th update to the i-th note inserted; here it goes to the i-th listed id."""
    be = ScriptedBackend()
    mem = make_memory(be, evolution_k=2)
    old = mem.add("Ann: kiwi")                  # inserted first, 2nd nearest
    new = mem.add("Ann: kiwi mango melon")      # inserted second, nearest

    def evolve(req: GenRequest) -> str:
        assert neighbour_ids(req) == [new.note_id, old.note_id]
        return canonical({"should_evolve": True, "actions": ["update_neighbor"], "suggested_connections": [],
                          "tags_to_update": [], "new_context_neighborhood": ["FIRST", "SECOND"],
                          "new_tags_neighborhood": [["t1"], ["t2"]]})

    be.queues["decision"] = deque([evolve])
    mem.add("Bob: kiwi mango melon smoothie")
    assert mem.get(new.note_id).context == "FIRST" and mem.get(old.note_id).context == "SECOND"


# --------------------------------------------------------------------------- malformed JSON


def test_malformed_json_is_retried_then_counted_as_a_fallback(caplog):
    valid = canonical({"keywords": ["tea"], "context": "About tea.", "tags": ["drinks"]})
    be = ScriptedBackend(note=["not json at all", valid,                       # retried once, then valid
                               "{\"keywords\": [", "```json\n{}\n```", '{"keywords": "tea"}'])  # 3 failures
    mem = make_memory(be)
    r1 = mem.add("Ann: I drink green tea")
    assert not mem.get(r1.note_id).fallback and mem.get(r1.note_id).keywords == ["tea"]
    temps = [t for k, _, t in be.calls if k == "note"]
    assert temps == [0.0, 0.7]  # greedy first, sampled retry
    with caplog.at_level(logging.WARNING):
        r2 = mem.add("Bob: Coffee roasting is my weekend hobby")
    note = mem.get(r2.note_id)
    assert note.fallback and r2.fallbacks == 1
    assert note.keywords[:2] == ["Coffee", "roasting"] and note.context  # never silently empty
    assert "no valid JSON after 3 attempts" in caplog.text
    s = mem.llm.stats.kind("note")
    assert (s.calls, s.attempts, s.valid_attempts, s.valid_first, s.fallbacks) == (2, 5, 1, 0, 1)
    # valid generations / all JSON generations: 1 of 5 note attempts + the one (valid) decision
    assert mem.llm.stats.valid_json_rate == pytest.approx(2 / 6)
    assert mem.stats.fallbacks == 1


def test_invalid_decision_falls_back_to_no_change():
    bad_id = lambda r: canonical({"should_evolve": True, "actions": ["strengthen"], "suggested_connections": ["n99"],
                                  "tags_to_update": [], "new_context_neighborhood": neighbour_contexts(r),
                                  "new_tags_neighborhood": [[]]})
    short = lambda r: canonical({"should_evolve": True, "actions": ["update_neighbor"], "suggested_connections": [],
                                 "tags_to_update": [], "new_context_neighborhood": [], "new_tags_neighborhood": []})
    be = ScriptedBackend(decision=[bad_id, short, "nope"])
    mem = make_memory(be, evolution_k=1)
    a = mem.add("Ann: plum")
    ctx = mem.get(a.note_id).context
    r = mem.add("Ann: plum tart")
    assert r.links == [] and r.evolved == [] and r.fallbacks == 1
    assert mem.get(a.note_id).context == ctx
    assert mem.llm.stats.kind("decision").fallbacks == 1


# --------------------------------------------------------------------------- ablations


def test_ablation_without_link_generation_and_evolution_makes_no_decision():
    be = ScriptedBackend()
    mem = make_memory(be, ablation="wo_lg_me", retrieve_k=1)
    for text in ("Ann: apple", "Ann: apple pie", "Bob: apple tart"):
        rep = mem.add(text)
        assert rep.links == [] and rep.evolved == [] and rep.llm_calls == 1
    assert be.kinds() == ["note"] * 3
    assert all(h.via == "cosine" for h in mem.retrieve("apple"))
    assert mem.stats.decisions == 0


def test_ablation_without_evolution_links_but_never_updates_neighbours():
    be = ScriptedBackend(decision=[
        # asks to update a neighbour: not in the wo_me schema -> invalid, retried
        lambda r: canonical({"should_evolve": True, "actions": ["update_neighbor"], "suggested_connections": [],
                             "tags_to_update": []}),
        link_to("apple"),
    ])
    mem = make_memory(be, ablation="wo_me", evolution_k=2)
    a = mem.add("Ann: apple")
    ctx = mem.get(a.note_id).context
    rep = mem.add("Ann: apple pie")
    assert rep.links == [a.note_id] and rep.evolved == []
    assert mem.get(a.note_id).context == ctx
    req = next(r for k, r, _ in be.calls if k == "decision")
    assert list(dict(req.schema.fields)) == ["should_evolve", "actions", "suggested_connections", "tags_to_update"]
    assert "update_neighbor" not in req.messages[0]["content"]
    assert mem.llm.stats.kind("decision").attempts == 2


# --------------------------------------------------------------------------- persistence


def _snapshot(mem: AgenticMemory) -> dict[str, Any]:
    return {nid: n.to_json() for nid, n in mem.notes.items()}


def test_persistence_round_trips_and_a_loaded_memory_keeps_growing(tmp_path):
    be = ScriptedBackend(decision=[no_change, link_to("apple")])
    mem = make_memory(be, tmp_path / "m", evolution_k=2, retrieve_k=2)
    for text in ("Ann: apple banana", "Bob: dog cat", "Ann: apple grape"):
        mem.add(text, timestamp="8 May 2023", meta={"turn": len(mem)})
    mem.save()
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert files == ["manifest.json", "notes.jsonl", "vectors.faiss"]
    again = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2, retrieve_k=2)
    assert _snapshot(again) == _snapshot(mem)
    for nid in mem.notes:
        assert np.allclose(again.get(nid).embedding, mem.get(nid).embedding)
    q = ["apple grape", "dog"]
    assert [[(h.note.id, round(h.score, 5), h.via) for h in hs] for hs in again.retrieve_many(q)] == \
           [[(h.note.id, round(h.score, 5), h.via) for h in hs] for hs in mem.retrieve_many(q)]
    rep = again.add("Cid: apple pie", meta={"turn": 3})
    assert rep.note_id == "n3" and len(again) == 4 and again.items_meta("turn") == {0, 1, 2, 3}
    third = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)  # no save(): journal alone
    assert _snapshot(third) == _snapshot(again)


def _counts(stats: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in stats.items() if k != "seconds"}  # wall time differs from run to run


def test_a_reopened_store_keeps_its_construction_cost(tmp_path):
    """Each commit keeps its add's cost and the compacted journal their sum, so a build resumed
    over several runs counts every note's tokens once: equal to the sum of the adds' own reports,
    and to the same adds made in one memory that was never closed."""
    texts = ["Ann: apple banana", "Bob: dog cat", "Ann: apple grape", "Cid: apple pie", "Bob: cat food"]
    reports = []
    mem = make_memory(ScriptedBackend(decision=[no_change, link_to("apple")]), tmp_path / "m", evolution_k=2)
    reports += [mem.add(t) for t in texts[:2]]
    again = make_memory(ScriptedBackend(decision=[link_to("apple")]), tmp_path / "m", evolution_k=2)  # journal
    assert again.stats.counters() == pytest.approx(mem.stats.counters())
    reports.append(again.add(texts[2]))
    again.save()  # compacted: one commit line with the sum
    third = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)
    assert third.stats.counters() == pytest.approx(again.stats.counters())
    reports += [third.add(t) for t in texts[3:]]
    last = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in reports)
    assert last.stats.notes_added == 5 and last.notes_unmeasured == 0
    assert last.stats.prompt_tokens + last.stats.completion_tokens == tokens > 0
    assert last.stats.llm_calls == sum(r.llm_calls for r in reports)
    assert last.stats.seconds == pytest.approx(sum(r.seconds for r in reports))
    once = make_memory(ScriptedBackend(decision=[no_change, link_to("apple")]), evolution_k=2)
    for t in texts:
        once.add(t)
    assert _snapshot(last) == _snapshot(once)
    assert _counts(last.stats.counters()) == pytest.approx(_counts(once.stats.counters()))


def test_a_journal_without_costs_counts_its_notes_as_unmeasured(tmp_path):
    """Stores written before commits kept costs: their notes load, and the cost reported is the
    new adds' with the older notes counted apart, not a smaller figure passed off as the whole."""
    mem = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)
    for t in ("Ann: apple", "Bob: dog"):
        mem.add(t)
    journal = tmp_path / "m" / "notes.jsonl"
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    journal.write_text("".join(json.dumps({"commit": r["commit"]} if "commit" in r else r) + "\n" for r in lines))
    old = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)
    assert len(old) == 2 and old.stats.notes_added == 0 and old.notes_unmeasured == 2
    rep = old.add("Cid: apple pie")
    assert old.stats.notes_added == 1 and old.notes_unmeasured == 2
    assert old.stats.prompt_tokens + old.stats.completion_tokens == rep.prompt_tokens + rep.completion_tokens


def test_store_refuses_another_build(tmp_path):
    make_memory(ScriptedBackend(), tmp_path / "m").add("Ann: hi there")
    with pytest.raises(Exception, match="another store_dir"):
        make_memory(ScriptedBackend(), tmp_path / "m", ablation="wo_me")


def test_crash_between_records_and_commit_leaves_the_previous_memory(tmp_path, monkeypatch):
    mem = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)
    mem.add("Ann: apple")
    mem.add("Ann: apple pie")
    before, cost_before = _snapshot(mem), mem.stats.counters()

    def crash(self, f, op, cost):
        raise OSError("disk died")

    monkeypatch.setattr(NoteStore, "_write_commit", crash)
    with pytest.raises(OSError):
        mem.add("Ann: apple crumble")
    assert _snapshot(mem) == before and mem.op == 2  # RAM state unchanged too
    assert mem.stats.counters() == cost_before  # the add that did not land cost nothing on record
    monkeypatch.undo()
    loaded = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)
    assert _snapshot(loaded) == before
    assert loaded.stats.counters() == pytest.approx(cost_before)
    loaded.add("Ann: apple crumble")
    assert len(make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)) == 3


def test_torn_journal_tail_and_missing_vectors_are_recovered(tmp_path):
    mem = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)
    for t in ("Ann: apple", "Bob: dog", "Ann: apple pie"):
        mem.add(t)
    mem.save()
    mem.add("Cid: fig")  # journaled after the vector snapshot
    with open(tmp_path / "m" / "notes.jsonl", "a") as f:
        f.write('{"op": 5, "note": {"id": "n4", "se')  # torn write of a 5th add
    (tmp_path / "m" / "vectors.faiss").unlink()
    loaded = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)
    assert sorted(loaded.notes) == ["n0", "n1", "n2", "n3"]
    for n in mem.notes.values():
        assert np.allclose(loaded.index.get(n.seq), n.embedding)
    loaded.add("Dan: fig jam")  # appends start on a clean line
    assert len(make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)) == 5


def test_hard_crash_in_the_middle_of_add_leaves_a_loadable_store(tmp_path):
    """A real process death (os._exit) during the 3rd add's decision call: no cleanup code runs."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_amem import ScriptedBackend, make_memory, no_change
        def die(req):
            os._exit(3)
        be = ScriptedBackend(decision=[no_change, die])
        mem = make_memory(be, {str(tmp_path / 'm')!r}, evolution_k=2, save_every=1)
        for t in ("Ann: apple", "Ann: apple pie", "Ann: apple crumble"):
            mem.add(t)
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr
    loaded = make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2)
    assert sorted(loaded.notes) == ["n0", "n1"]
    loaded.add("Ann: apple crumble")
    assert sorted(make_memory(ScriptedBackend(), tmp_path / "m", evolution_k=2).notes) == ["n0", "n1", "n2"]


# --------------------------------------------------------------------------- the MemorySystem adapter


def _examples() -> list[Example]:
    hist = [[Turn("user", "I adopted a puppy named Max", "1 May 2023", "Ann"),
             Turn("assistant", "Max is a lovely name for a puppy", "1 May 2023", "Bob")],
            [Turn("user", "We painted the kitchen blue", "9 May 2023", "Ann")]]
    other = [[Turn("user", "My bike got stolen", "2 June 2023", "Cid")]]
    return [
        Example(id="q1", source="t", group="g1", question="What is the puppy called?", choices=[], answer_index=0,
                question_type="single-hop", history=hist, answer_text="Max"),
        Example(id="q2", source="t", group="g1", question="What colour is the kitchen?",
                choices=["red", "blue", "green"], answer_index=1, question_type="single-hop", history=hist),
        Example(id="q3", source="t", group="g2", question="What got stolen?", choices=[], answer_index=0,
                question_type="single-hop", history=other, answer_text="bike"),
    ]


def test_system_builds_one_memory_per_group_and_accounts_tokens():
    from elasticmem.eval.system import MemorySystem

    be = ScriptedBackend(answer=["Max\nand more", "(b)", "a bike"])
    cfg = AMemConfig(embedder="hashing", retrieve_k=2)
    system = AMemSystem(cfg, llm=StructuredLLM(be), embedder=HashingEmbedder())
    assert isinstance(system, MemorySystem) and system.name == "amem"
    preds = system.predict(_examples())
    assert be.kinds().count("note") == 4  # 3 turns + 1 turn, each group built once
    assert [p.text for p in preds] == ["Max", "(b)", "a bike"]  # cut at the newline
    notes_g1 = system.memories["g1"].notes
    assert notes_g1["n0"].content == "Ann: I adopted a puppy named Max" and notes_g1["n0"].timestamp == "1 May 2023"
    answers = [r for k, r, _ in be.calls if k == "answer"]
    assert "(a) red\n(b) blue\n(c) green" in answers[1].messages[-1]["content"]
    assert "Not mentioned in the conversation" in answers[0].messages[0]["content"]
    assert answers[1].max_new_tokens == cfg.mc_max_new_tokens and answers[0].max_new_tokens == cfg.answer_max_new_tokens
    for p, req in zip(preds, answers):
        block = req.messages[-1]["content"].split("Memory notes:\n", 1)[1].split("\n\nQuestion:")[0]
        total = sum(be.count_tokens(m["content"]) for m in req.messages) + 3
        assert p.memory_tokens == be.count_tokens(block) and p.prompt_tokens + p.memory_tokens == total
        assert p.generated_tokens == be.count_tokens({"q1": "Max\nand more", "q2": "(b)", "q3": "a bike"}[p.id])
        assert all(r.ref in system.memories[p.extra["amem"]["group"]].notes for r in p.retrieved)
    assert preds[2].retrieved[0].ref == "n0" and len(preds[2].retrieved) == 1
    system.predict(_examples()[:1])
    assert be.kinds().count("note") == 4  # memories are kept between calls
    st = system.stats()
    assert st["build"]["notes_added"] == 4 and st["build"]["tokens_per_note"] > 0


def test_shared_answer_prompt_reads_the_retrieved_notes_with_the_local_model(tiny_backbone, one_thread):
    """amem.answer_prompt=shared: no answer call; each question is read by the local model through
    ElasticMem's prompt from its retrieved notes, each rendered with answer_fields, in rank order."""
    from elasticmem.llm.client import TransformersBackend
    from elasticmem.config import MemoryConfig
    from elasticmem.eval.reader import SharedPromptReader

    scripted = ScriptedBackend()
    backend = TransformersBackend(tiny_backbone.model, tiny_backbone.tokenizer)
    backend.generate = scripted.generate  # the notes and decisions as scripted; the weights are the reader's
    cfg = AMemConfig(embedder="hashing", retrieve_k=2, answer_prompt="shared")
    memory = MemoryConfig(max_new_tokens=4, suffix_template="\n{options}\nAnswer:")
    system = AMemSystem(cfg, llm=StructuredLLM(backend), embedder=HashingEmbedder(), memory=memory)
    examples = _examples()
    preds = system.predict(examples)
    assert "answer" not in scripted.kinds() and scripted.kinds().count("note") == 4
    notes = [[system.memories[ex.group].notes[r.ref].render(cfg.answer_fields) for r in p.retrieved]
             for ex, p in zip(examples, preds)]
    assert all(notes) and "time: 1 May 2023" in notes[0][0]
    reads = SharedPromptReader(tiny_backbone.model, tiny_backbone.tokenizer, memory).answer(examples, notes)
    assert [(p.text, p.prompt_tokens, p.memory_tokens, p.generated_tokens) for p in preds] == [
        (r.text, r.prompt_tokens, r.memory_tokens, r.generated_tokens) for r in reads]
    assert system.identity()["answer"]["max_new_tokens"] == 4
    with pytest.raises(ConfigError, match="answer_prompt=shared"):
        AMemSystem(dataclasses.replace(cfg, llm=AMemLLMConfig(backend="openai")), embedder=HashingEmbedder())


def test_system_resumes_a_partially_built_store(tmp_path):
    be = ScriptedBackend()
    cfg = AMemConfig(embedder="hashing", store_dir=str(tmp_path), max_turns=2)
    AMemSystem(cfg, llm=StructuredLLM(be), embedder=HashingEmbedder()).predict(_examples()[:1])
    assert be.kinds().count("note") == 2
    be2 = ScriptedBackend()
    cfg2 = AMemConfig(embedder="hashing", store_dir=str(tmp_path))
    sys2 = AMemSystem(cfg2, llm=StructuredLLM(be2), embedder=HashingEmbedder())
    sys2.predict(_examples()[:1])
    assert be2.kinds().count("note") == 1  # only the third turn was added
    assert sorted(sys2.memories["g1"].items_meta("turn")) == [0, 1, 2]
    # the construction cost covers both runs, as if built in one
    once = AMemSystem(AMemConfig(embedder="hashing"), llm=StructuredLLM(ScriptedBackend()), embedder=HashingEmbedder())
    p_once = once.predict(_examples()[:1])[0]
    p_resumed = sys2.predict(_examples()[:1])[0]
    assert p_resumed.extra["amem"]["build"]["notes_added"] == 3 == p_once.extra["amem"]["build"]["notes_added"]
    assert p_resumed.extra["amem"]["build"]["tokens_per_note"] == p_once.extra["amem"]["build"]["tokens_per_note"]
    assert sys2.stats()["build"]["notes_unmeasured"] == 0


def test_evidence_turns_are_scored_on_the_notes_that_hold_them():
    """A question's [session, turn] evidence maps to the notes of those turns, so results.json
    tells whether A-Mem retrieved its evidence (``metrics.evidence_stats``), as it does for
    systems that retrieve bank rows."""
    from elasticmem.eval import metrics as M

    exs = _examples()
    exs[1].extra["evidence"] = [[1, 0]]            # "We painted the kitchen blue": 3rd turn, n2
    exs[0].extra["evidence"] = [[0, 0], [5, 0]]    # the puppy turn, and a session the memory lacks
    system = AMemSystem(AMemConfig(embedder="hashing", retrieve_k=1, max_linked=0),
                        llm=StructuredLLM(ScriptedBackend()), embedder=HashingEmbedder())
    preds = system.predict(exs)
    assert system.memories["g1"].get("n2").content == "Ann: We painted the kitchen blue"
    assert preds[1].extra["evidence"] == {"refs": ["n2"], "group_rows": 3}
    assert preds[0].extra["evidence"] == {"refs": ["n0"], "group_rows": 3}
    assert "evidence" not in preds[2].extra
    records = [M.make_record(p, question_type="single-hop", gold="", correct=c)
               for p, c in zip(preds, (True, False, True))]
    e = M.evidence_stats(records)
    hits = [p.retrieved[0].ref == p.extra["evidence"]["refs"][0] for p in preds[:2]]
    assert e["n"] == 2 and e["n_no_evidence"] == 1 and e["hits"] == sum(hits) and e["mean_retrieved"] == 1
    assert e["random_recall_any"] == pytest.approx(1 / 3)


def test_query_expansion_adds_llm_keywords_to_the_query():
    be = ScriptedBackend(expansion=[canonical({"keywords": ["kitchen", "paint"]})])
    cfg = AMemConfig(embedder="hashing", query_expansion=True)
    system = AMemSystem(cfg, llm=StructuredLLM(be), embedder=HashingEmbedder())
    p = system.predict(_examples()[:1])[0]
    assert p.extra["amem"]["query"] == "What is the puppy called? kitchen paint"
    assert p.extra["amem"]["expansion_tokens"] > 0


# --------------------------------------------------------------------------- OpenAI-compatible backend


def _hx():
    try:
        import httpx
    except ImportError:
        httpx = pytest.importorskip("httpx2")
    return httpx


def _ok(text: str, **usage) -> dict[str, Any]:
    return {"choices": [{"message": {"content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": usage.get("p", 11), "completion_tokens": usage.get("c", 5)}}


def test_openai_backend_retries_downgrades_and_reads_usage(monkeypatch):
    hx = _hx()
    seen: list[dict[str, Any]] = []
    replies = deque([
        ("status", 503, "overloaded"),
        ("timeout", None, None),
        ("status", 400, "response_format json_schema: minLength is not supported"),
        ("json", 200, _ok(canonical({"keywords": ["a"], "context": "c.", "tags": ["t"]}), p=42, c=7)),
    ])

    def handler(request):
        body = json.loads(request.content)
        seen.append(body)
        kind, code, payload = replies.popleft()
        if kind == "timeout":
            raise hx.ReadTimeout("slow", request=request)
        if kind == "status":
            return hx.Response(code, text=payload)
        return hx.Response(code, json=payload)

    monkeypatch.setenv("AMEM_TEST_KEY", "sk-test")
    cfg = AMemLLMConfig(backend="openai", model="qwen2.5-7b", api_base="http://server/v1", api_key_env="AMEM_TEST_KEY",
                        http_retries=3, batch_size=1)
    sleeps: list[float] = []
    backend = OpenAIBackend(cfg, client=hx.Client(transport=hx.MockTransport(handler)), sleep=sleeps.append)
    llm = StructuredLLM(backend)
    schema = prompts.note_schema(AMemConfig(embedder="hashing"))
    res = llm.json([GenRequest([{"role": "user", "content": "hi"}], 64, schema, kind="note")], [lambda: None])[0]
    assert res.ok and res.value["keywords"] == ["a"] and (res.prompt_tokens, res.completion_tokens) == (42, 7)
    assert sleeps == [1.0, 2.0]  # back-off after 503 and the timeout; the 400 downgrade is not a failed try
    assert seen[0]["response_format"]["json_schema"]["schema"]["properties"]["context"]["maxLength"] == 160
    assert "maxLength" not in json.dumps(seen[-1]["response_format"])  # the portable schema
    assert seen[0]["model"] == "qwen2.5-7b" and seen[0]["temperature"] == 0.0 and seen[0]["max_tokens"] == 64
    assert backend.headers["Authorization"] == "Bearer sk-test"


def test_openai_backend_gives_up_loudly_and_batches_concurrently():
    hx = _hx()
    cfg = AMemLLMConfig(backend="openai", model="m", api_base="http://server/v1", http_retries=2, batch_size=4,
                        structured_output="json_object")
    failing = OpenAIBackend(cfg, client=hx.Client(transport=hx.MockTransport(lambda r: hx.Response(500, text="boom"))),
                            sleep=lambda s: None)
    with pytest.raises(ServerError, match="after 3 tries"):
        failing.generate([GenRequest([{"role": "user", "content": "x"}], 8)])
    bodies = []

    def echo(request):
        body = json.loads(request.content)
        bodies.append(body)
        return hx.Response(200, json=_ok(body["messages"][0]["content"].upper()))

    backend = OpenAIBackend(cfg, client=hx.Client(transport=hx.MockTransport(echo)))
    reqs = [GenRequest([{"role": "user", "content": f"q{i}"}], 8, stop=("\n",), kind="answer") for i in range(6)]
    outs = StructuredLLM(backend).text(reqs)
    assert [o.value for o in outs] == [f"Q{i}" for i in range(6)]  # order kept under concurrency
    assert all(b["stop"] == ["\n"] and "response_format" not in b for b in bodies)
    with pytest.raises(ServerError, match="HTTP 401"):
        OpenAIBackend(cfg, client=hx.Client(transport=hx.MockTransport(lambda r: hx.Response(401, text="no key")))
                      ).generate([GenRequest([{"role": "user", "content": "x"}], 8)])


# --------------------------------------------------------------------------- local transformers backend


def test_transformers_backend_constrained_json_is_valid_even_from_a_random_model(tiny_backbone, one_thread):
    from elasticmem.llm.client import TransformersBackend

    cfg = AMemConfig(embedder="hashing", max_item_chars=8, max_context_chars=24, max_keywords=3, max_tags=2)
    backend = TransformersBackend(tiny_backbone.model, tiny_backbone.tokenizer, batch_size=3)
    llm = StructuredLLM(backend)
    schema_n = prompts.note_schema(cfg)
    schema_d = prompts.decision_schema(cfg, ["n3", "n17"])
    reqs = [GenRequest(prompts.note_messages("cat dog", "today"), 400, schema_n, kind="note"),
            GenRequest([{"role": "user", "content": "cat"}], 400, schema_d, kind="decision"),
            GenRequest([{"role": "user", "content": "dog"}], 6, None, kind="answer")]
    res = llm.json(reqs[:2], [lambda: None] * 2)  # one batch of two constrained rows
    for r, req in zip(res, reqs[:2]):
        assert r.ok and r.attempts == 1 and accepts(req.schema, r.text), r.text
        assert req.schema.validate(json.loads(r.text)) == []
    free = backend.generate(reqs[2:])[0]
    assert 0 < free.completion_tokens <= 6
    # A budget too small for the answer: cut, invalid, retried (sampled), then the fallback.
    tight = GenRequest(prompts.note_messages("cat dog", "today"), 3, schema_n, kind="note")
    r = llm.json([tight], [lambda: {"fallback": True}])[0]
    assert r.fallback and r.attempts == 3 and "token budget" in r.errors[0]


def test_shared_prefix_prefill_generates_what_the_plain_prefill_does(tiny_backbone, one_thread):
    """A batch of calls that share their instructions: the common prefix is prefilled once (one
    forward of batch 1) and the answers, constrained and free, equal those of the plain batched
    prefill, token for token, as do the prompt token counts."""
    from elasticmem.llm.client import TransformersBackend

    cfg = AMemConfig(embedder="hashing", max_item_chars=8, max_context_chars=24, max_keywords=3, max_tags=2)
    reqs = [GenRequest(prompts.note_messages(text, "today"), 60, prompts.note_schema(cfg), kind="note")
            for text in ("cat dog", "a much longer turn about the garden and the weather", "hi")]
    reqs += [GenRequest(prompts.note_messages(text, "today"), 7, None, kind="answer") for text in ("x y", "zebra")]
    shapes = []
    plain = TransformersBackend(tiny_backbone.model, tiny_backbone.tokenizer, batch_size=8, share_prefix=False)
    shared = TransformersBackend(tiny_backbone.model, tiny_backbone.tokenizer, batch_size=8)
    expected = plain.generate(reqs)
    hook = tiny_backbone.model.register_forward_pre_hook(
        lambda mod, args, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        got = shared.generate(reqs)
    finally:
        hook.remove()
    assert got == expected
    assert shapes[0][0] == 1 and shapes[0][1] >= TransformersBackend.MIN_SHARED_PREFIX  # the prefix, once
    assert shapes[1][0] == len(reqs) and shapes[1][1] < max(c.prompt_tokens for c in got) - shapes[0][1] + 1
    assert any(c.completion_tokens > 3 for c in got)


def test_finished_rows_leave_the_batch_and_the_answers_stay_the_same(tiny_backbone, one_thread):
    """drop_closed (the default): a row that has finished is taken out of the batch and its KV
    cache, so later decoding steps run only the live rows; every answer, constrained or free,
    equals that of decoding with the finished rows kept in (and of decoding each request alone),
    greedy and sampled."""
    from elasticmem.llm.client import TransformersBackend

    cfg = AMemConfig(embedder="hashing", max_item_chars=8, max_context_chars=24, max_keywords=3, max_tags=2)
    reqs = [GenRequest(prompts.note_messages(text, "today"), 60, prompts.note_schema(cfg), kind="note")
            for text in ("cat dog", "a much longer turn about the garden and the weather")]
    reqs += [GenRequest(prompts.note_messages(text, "today"), n, None, kind="answer")
             for text, n in (("x y", 2), ("zebra", 19), ("hi", 5))]
    model, tok = tiny_backbone.model, tiny_backbone.tokenizer
    kept = TransformersBackend(model, tok, batch_size=8, drop_closed=False)
    dropped = TransformersBackend(model, tok, batch_size=8)
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda mod, args, kw: rows.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        expected = kept.generate(reqs)
        n_kept = len(rows)
        got = dropped.generate(reqs)
    finally:
        hook.remove()
    assert got == expected
    assert [dropped.generate([r])[0] for r in reqs] == expected
    assert len({c.completion_tokens for c in got}) > 2  # the rows end at different steps
    assert set(rows[1:n_kept]) == {len(reqs)}  # kept: every step runs the whole batch
    steps = rows[n_kept + 2:]  # after the shared prefix and the rows' own prefill
    assert steps[0] == len(reqs) and steps[-1] < len(reqs) - 1 and steps == sorted(steps, reverse=True)
    assert sum(steps) < len(reqs) * len(steps)
    assert dropped.generate(reqs, temperature=0.8, seed=3) == kept.generate(reqs, temperature=0.8, seed=3)


# --------------------------------------------------------------------------- the LoCoMo command


LOCOMO = ROOT.parent / "shared" / "data" / "locomo10.json"


@pytest.mark.skipif(not LOCOMO.is_file(), reason=f"real LoCoMo file not found at {LOCOMO} (../shared/data)")
def test_run_locomo_writes_the_per_category_tables(tmp_path):
    from elasticmem.baselines.amem.run_locomo import LoCoMoRunConfig, run

    amem = AMemConfig(embedder="hashing", max_sessions=2, evolution_k=2)
    cfg = LoCoMoRunConfig(input=str(LOCOMO), out_dir=str(tmp_path), conversations=["conv-26"], max_questions=10,
                          with_meteor=False, with_sbert=False, amem=amem)
    be = ScriptedBackend(answer=[lambda r: "Not mentioned in the conversation" if "Options" not in r.messages[-1]["content"]
                                 else "(a)"] * 50)
    system = AMemSystem(amem, llm=StructuredLLM(be), embedder=HashingEmbedder())
    summary = run(cfg, system=system)
    assert be.kinds().count("note") == 35  # sessions 1-2 of conv-26, built once for both formats
    qa = [json.loads(line) for line in (tmp_path / "predictions_qa.jsonl").read_text().splitlines()]
    assert len(qa) == 10 and all(r["id"].startswith("conv-26_q") for r in qa)
    assert len({r["question_type"] for r in qa}) == 5  # round-robin over the categories
    adv = [r for r in qa if r["question_type"] == "adversarial"]
    assert adv and all(r["gold"] == "Not mentioned in the conversation" and r["correct"] for r in adv)
    table = (tmp_path / "table.md").read_text()
    assert "| F1 |" in table and "| BLEU-1 |" in table and "Adversarial" in table and "MC-10" in table
    assert summary["qa"]["free_form"]["per_type"]["adversarial"]["f1"] == 1.0
    assert summary["amem"]["build"]["notes_added"] == 35
    assert summary["data"]["skipped_outside_memory"]["qa"] > 100  # evidence in later sessions
    assert (tmp_path / "store" / "conv-26" / "manifest.json").is_file()


def test_no_repeat_ngram_decoding_equals_transformers_own(tiny_backbone, one_thread):
    """The backend's n-gram ban (free rows, batched with left padding) gives transformers'
    ``generate(no_repeat_ngram_size=n)`` greedy output row by row; a random model loops, so the
    ban decides many tokens. Constrained rows keep valid JSON under the ban."""
    import torch

    from elasticmem.llm.client import TransformersBackend

    model, tok = tiny_backbone.model, tiny_backbone.tokenizer
    backend = TransformersBackend(model, tok, batch_size=2)
    msgs = [[{"role": "user", "content": "cat dog cat"}], [{"role": "user", "content": "the memory of a long day " * 3}]]
    for n in (2, 3):
        outs = backend.generate([GenRequest(m, 24, no_repeat_ngram=n) for m in msgs])
        for m, o in zip(msgs, outs):
            ids = tok(backend.render(m), add_special_tokens=False, return_tensors="pt").input_ids
            with torch.no_grad():
                ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                     no_repeat_ngram_size=n, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
            ref = [t for t in ref.tolist() if t != tok.eos_token_id]
            assert o.text == tok.decode(ref, skip_special_tokens=True) and o.completion_tokens == len(ref)
    plain = backend.generate([GenRequest(msgs[1], 24)])[0].text
    assert plain != backend.generate([GenRequest(msgs[1], 24, no_repeat_ngram=2)])[0].text  # the ban acts
    cfg = AMemConfig(embedder="hashing", max_item_chars=8, max_context_chars=24, max_keywords=3, max_tags=2)
    schema = prompts.note_schema(cfg)
    (o,) = backend.generate([GenRequest(prompts.note_messages("cat dog", "today"), 400, schema, no_repeat_ngram=3)])
    assert accepts(schema, o.text) and schema.validate(json.loads(o.text)) == []


class _AcceleratorTensor(torch.Tensor):
    """A CPU tensor that keeps CUDA's device rules, standing in for logits on an accelerator (no GPU
    here): an operation that mixes it with a host tensor of one or more dimensions fails, except
    indexing it with host indices (PyTorch moves those over); a host tensor indexed by it fails, and
    so does sampling it with a CPU generator. ``.cpu()`` gives a plain host tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        if func is torch.Tensor.cpu:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)
        leaves = tree_leaves((args, kwargs))
        on_device = any(isinstance(t, cls) for t in leaves)
        if on_device and any(isinstance(g, torch.Generator) and g.device.type == "cpu" for g in leaves):
            raise RuntimeError(f"{func.__name__}: device tensor sampled with a CPU generator")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            if on_device and not isinstance(args[0], cls):
                raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
        elif on_device and any(type(t) is torch.Tensor and t.dim() > 0 for t in leaves):
            raise RuntimeError(f"{func.__name__}: expected all tensors to be on the same device")
        return super().__torch_function__(func, types, args, kwargs)


def test_transformers_backend_choosers_get_host_logits_when_the_model_runs_on_an_accelerator(
        tiny_backbone, one_thread):
    """With the model on a GPU its logits are device tensors while the token chooser's tables and
    sampling generator live on the host. Logits that follow CUDA's device rules
    (``_AcceleratorTensor``) decode constrained JSON and free text, greedy and sampled, without a
    device mix, and give exactly the answers of host logits."""
    from elasticmem.llm.client import TransformersBackend

    cfg = AMemConfig(embedder="hashing", max_item_chars=8, max_context_chars=24, max_keywords=3, max_tags=2)
    reqs = [GenRequest(prompts.note_messages(t, "today"), 60, prompts.note_schema(cfg), kind="note")
            for t in ("cat dog", "a much longer turn about the garden")]
    reqs.append(GenRequest([{"role": "user", "content": "cat"}], 80, prompts.decision_schema(cfg, ["n3", "n17"])))
    reqs += [GenRequest(prompts.note_messages(t, "today"), n, None, kind="answer", no_repeat_ngram=ng)
             for t, n, ng in (("x y", 9, 0), ("zebra", 19, 2))]
    model, tok = tiny_backbone.model, tiny_backbone.tokenizer
    backend = TransformersBackend(model, tok, batch_size=8)
    runs = [(0.0, 0), (0.8, 3), (1.3, 11)]
    expected = [backend.generate(reqs, temperature=t, seed=s) for t, s in runs]

    def on_accelerator(module, args, kwargs, out):
        out.logits = out.logits.as_subclass(_AcceleratorTensor)
        return out

    # the stand-in bites: the old chooser's ops on device logits fail as they would on CUDA
    dev_logits = model(input_ids=tok("cat", return_tensors="pt").input_ids).logits[0, -1].as_subclass(
        _AcceleratorTensor)
    with pytest.raises(RuntimeError, match="indices should be"):
        torch.tensor([1, 2, 3])[dev_logits[:3].argsort()]
    hook = model.register_forward_hook(on_accelerator, with_kwargs=True)
    try:
        got = [backend.generate(reqs, temperature=t, seed=s) for t, s in runs]
    finally:
        hook.remove()
    assert got == expected
    assert any(c.completion_tokens > 3 for c in got[1])
