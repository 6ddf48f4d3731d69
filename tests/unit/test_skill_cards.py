"""Skill cards: the rules a card must follow, retries then a counted fallback, the content cache.

    pytest tests/unit/test_skill_cards.py

The LLM here is a scripted backend (the A-Mem LLMBackend protocol) so that every path is
exercised deterministically; tests/integration/test_alfworld_cards.py runs SmolLM2.
"""

from __future__ import annotations

import json

import pytest

from elasticmem.agent import skill_cards as S
from elasticmem.llm.client import Completion


def record(game_id="g1", task_type="pick_heat_then_place_in_recep"):
    steps = [("go to countertop 2", "You arrive at countertop 2. You see a potato 2."),
             ("take potato 2 from countertop 2", "You pick up the potato 2 from the countertop 2."),
             ("go to microwave 1", "You arrive at microwave 1. The microwave 1 is closed."),
             ("heat potato 2 with microwave 1", "You heat the potato 2 using the microwave 1."),
             ("go to sinkbasin 1", "You arrive at sinkbasin 1."),
             ("move potato 2 to sinkbasin 1", "You move the potato 2 to the sinkbasin 1.")]
    return {"game_id": game_id, "task_type": task_type, "objective": "heat some potato and put it in sinkbasin.",
            "observation": "You are in a kitchen.", "success": True,
            "steps": [{"admissible": [a], "action": a, "observation": o} for a, o in steps]}


WORDS = ("apple bread cabinet drawer egg fridge glass handle ice jar kettle lamp mug napkin oven pan quilt rack "
         "sink towel").split()


def good_value(steps=5, step_words=26):
    """A card as the LLM is asked for it (JSON) that renders to a valid card by default: prose
    of distinct words (no repeated 3-grams), about 6.5 characters a word."""
    def word(n):
        return WORDS[n % 20] + "abcdefghijklmnopqrst"[(n // 20) % 20]
    return {"task_type": "heat then place", "objective_pattern": "heat some <object> and put it in <receptacle>.",
            "steps": [" ".join(word(k * step_words + i) for i in range(step_words)) for k in range(steps)]}


def good_card(**kw):
    return S.render_card(good_value(**kw))


def good_json(**kw):
    return json.dumps(good_value(**kw))


class Scripted:
    """Answers request i (in the order first seen) at seed k with script[i][k]; counts calls."""

    name = "scripted"

    def __init__(self, script):
        self.script, self.seen, self.calls = script, {}, []

    def generate(self, requests, temperature=0.0, seed=0):
        out = []
        for r in requests:
            i = self.seen.setdefault(r.messages[1]["content"], len(self.seen))
            self.calls.append((i, seed, temperature))
            out.append(Completion(self.script[i][seed], 100, 50))
        return out

    def count_tokens(self, text):
        return len(text.split())


def test_card_rules():
    s = S.CardSettings()
    card = good_card()
    assert card.splitlines()[0] == ("Task type: heat then place. Objective pattern: heat some <object> and put it "
                                    "in <receptacle>.")
    assert card.splitlines()[1].startswith("1. applea breada") and len(card.splitlines()) == 6
    assert S.card_errors(card, s) == [] and 150 <= len(card.split()) <= 250
    assert any("words" in e for e in S.card_errors(good_card(step_words=20), s))
    assert any("words" in e for e in S.card_errors(good_card(step_words=70), s))
    assert any("numbered steps" in e for e in S.card_errors(good_card(steps=2, step_words=70), s))
    assert any("numbered steps" in e for e in S.card_errors(good_card(steps=7, step_words=20), s))
    assert any("first line" in e for e in S.card_errors(card.replace("Objective pattern:", "Goal:"), s))
    # prose, not bracket runs; not the worked example copied
    assert any("not prose" in e for e in S.card_errors(card + " " + "}]" * 100, s))
    assert any("copied" in e for e in S.card_errors(S.render_card(S.EXAMPLE), s))
    looping = {**good_value(), "steps": [("the pantry, " * 40)[:170]] * 5}
    assert any("repetitive" in e for e in S.card_errors(S.render_card(looping), s))
    # the decoder cannot start a step with the example's own sentence or reuse its task type
    schema = S.card_schema(s)
    copied = {**good_value(), "steps": [S.EXAMPLE["steps"][0]] + good_value()["steps"][1:]}
    assert S.card_from_output(json.dumps(copied), schema)[0] is None
    assert S.card_from_output(json.dumps({**good_value(), "task_type": S.EXAMPLE["task_type"]}), schema)[0] is None


def test_the_schema_bounds_land_inside_the_word_range():
    s = S.CardSettings()
    steps = S.card_schema(s).fields[2][1]
    assert s.min_steps <= steps.min_items <= steps.max_items <= s.max_steps
    # the fewest steps at their shortest in long words and the most at their longest in short
    # words, rendered, in range
    for n, length, word in ((steps.min_items, steps.item.min_len, "abcde "), (steps.max_items, steps.item.max_len,
                                                                                "abcd ")):
        words = (word * 300)[: length - 1] + "x"  # no trailing space
        value = {"task_type": "pick heat then place", "objective_pattern": "heat some <object> and put it in "
                 "the <receptacle> as the person asked you to do it", "steps": [words] * n}
        assert len(S.render_card({**value, "steps": []}).split()) == 25  # the first line the bounds assume
        assert S.card_from_output(json.dumps(value), S.card_schema(s))[1] == []
        assert 150 <= len(S.render_card(value).split()) <= 250
    assert S.card_from_output("no json", S.card_schema(s))[0] is None
    with pytest.raises(ValueError, match="no step count"):
        S.card_schema(S.CardSettings(min_words=240, max_words=242, min_steps=3, max_steps=3))


def test_the_prompt_holds_the_trajectory_cut_to_max_chars():
    rec = record()
    req = S.card_request(rec, S.CardSettings(max_chars=80))
    text = S.trajectory_text(rec, 80)
    assert len(text) == 80 and text in req.messages[1]["content"]
    assert "> go to countertop 2\nYou arrive at countertop 2." in S.trajectory_text(rec)
    assert req.max_new_tokens == 512 and rec["objective"] in req.messages[1]["content"]


def test_retries_then_a_counted_fallback_and_the_cache(tmp_path):
    recs = [record("g1"), record("g2", "pick_cool_then_place_in_recep")]
    recs[1]["objective"] = "cool some apple and put it in countertop."
    backend = Scripted([["no card", good_json()], ["bad", "worse", good_json(step_words=70)]])
    out = tmp_path / "cards.jsonl"
    cards = S.write_cards(recs, backend, out, progress=False)
    assert [c["game_id"] for c in cards] == ["g1", "g2"]
    assert (cards[0]["card"], cards[0]["attempts"], cards[0]["fallback"]) == (good_card(), 2, False)
    # the third answer parses but renders too long: the rules are checked on the rendered card
    assert cards[1]["fallback"] and cards[1]["attempts"] == 3 and "words" in cards[1]["errors"][0]
    assert cards[1]["card"] == S.fallback_card(recs[1])
    assert cards[1]["text"] == "[pick_cool_then_place_in_recep] " + cards[1]["card"]
    # seeds 0, 1, 2 at the reference temperature; only the failing card is asked again
    assert backend.calls == [(0, 0, 0.2), (1, 0, 0.2), (0, 1, 0.2), (1, 1, 0.2), (1, 2, 0.2)]
    # A rerun generates nothing; another setting changes the key and generates again.
    again = Scripted([[]])
    assert S.write_cards(recs, again, out, progress=False) == cards and again.calls == []
    other = Scripted([[good_json()], [good_json()]])
    new = S.write_cards(recs[:1], other, out, S.CardSettings(max_chars=100), progress=False)
    assert len(other.calls) == 1 and new[0]["key"] != cards[0]["key"]
    # a line cut by a crash is dropped on the next run
    out.write_text(out.read_text() + '{"key": "tru')
    assert S.write_cards(recs, Scripted([[]]), out, progress=False) == cards
    assert all(json.loads(line) for line in out.read_text().splitlines())


def test_fallback_card_generalises_object_numbers():
    rec = record()
    rec["steps"].insert(3, {"admissible": [], "action": "open microwave 1", "observation": "You open it."})
    card = S.fallback_card(rec)
    assert card.splitlines()[0].startswith("Task type: pick_heat_then_place_in_recep. Objective pattern:")
    assert "potato 2" not in card and "heat potato with microwave" in card and "go to" not in card and "open" not in card
    assert len(card.splitlines()) == 1 + 3  # take, heat, move


def test_cli_refuses_ids_missing_from_the_trajectories(tmp_path):
    traj = tmp_path / "t.jsonl"
    traj.write_text(json.dumps(record("g1")) + "\n")
    (tmp_path / "ids.txt").write_text("g1\nnope\n")
    with pytest.raises(SystemExit, match="1 ids"):
        S.main([str(traj), "--ids", str(tmp_path / "ids.txt"), "--out", str(tmp_path / "c.jsonl")])


def test_cli_fallback_backend_writes_every_card_without_an_llm(tmp_path):
    traj = tmp_path / "t.jsonl"
    recs = [record("g1"), record("g2")]
    traj.write_text("".join(json.dumps(r) + "\n" for r in recs))
    S.main([str(traj), "--out", str(tmp_path / "c.jsonl"), "--backend", "fallback"])
    cards = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert [c["game_id"] for c in cards] == ["g1", "g2"]
    assert all(c["fallback"] and c["attempts"] == 0 and c["card"] == S.fallback_card(r) for c, r in zip(cards, recs))


def test_the_ngram_ban_reaches_the_request_and_the_cache_key():
    import hashlib
    from dataclasses import asdict

    off, on = S.CardSettings(), S.CardSettings(no_repeat_ngram=3)
    req_off, req_on = S.card_request(record(), off), S.card_request(record(), on)
    assert (req_off.no_repeat_ngram, req_on.no_repeat_ngram) == (0, 3) and req_off.messages == req_on.messages
    # off: the key a cache written before the setting existed holds
    old = {k: v for k, v in asdict(off).items() if k != "no_repeat_ngram"}
    blob = json.dumps({"model": "m", "messages": req_off.messages, "settings": old}, sort_keys=True)
    assert S.card_key(req_off, off, "m") == hashlib.sha256(blob.encode()).hexdigest()
    assert S.card_key(req_on, on, "m") != S.card_key(req_off, off, "m")
