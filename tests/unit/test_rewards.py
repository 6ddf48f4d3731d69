"""Tests of the answer rewards (elasticmem.data.rewards).

Run with::

    pytest tests/unit/test_rewards.py
"""

from __future__ import annotations

import pytest

from elasticmem.data.schema import Example, Turn
from elasticmem.data.rewards import (
    REWARDS,
    get_reward,
    mc_letter_reward,
    parse_option_letter,
    snap_action,
    snapped_action_reward,
)

HISTORY = [[Turn("user", "hello")]]


def mc_example(answer_index: int, num_options: int = 4) -> Example:
    return Example(id="q1", source="test", question="?", choices=[f"opt{i}" for i in range(num_options)],
                   answer_index=answer_index, question_type="t", history=HISTORY)


ADMISSIBLE = ["go to fridge 1", "go to countertop 1", "open fridge 1", "take potato 1 from countertop 1",
              "heat potato 1 with microwave 1"]


def alf_example(expert: str | None = "open fridge 1", admissible=ADMISSIBLE) -> Example:
    extra = {} if admissible is None else {"admissible_commands": admissible}
    return Example(id="alf-1", source="alfworld", question="task", choices=["x", "y"], answer_index=0,
                   question_type="alfworld", history=HISTORY, answer_text=expert, extra=extra)


@pytest.mark.parametrize("text, num_options, expected", [
    ("(c)", 4, 2),
    ("(C)", 4, 2),
    ("( c )", 4, 2),
    ("Answer: (c)", 4, 2),
    ("(C) Paris", 4, 2),
    ("c", 4, 2),
    ("  C\n", 4, 2),
    ("The answer is b.", 4, 1),
    ("b)", 4, 1),
    ("B:", 4, 1),
    ("d. the last one", 4, 3),
    ("a guess: (b)", 4, 1),  # a parenthesised letter beats an earlier bare one
    ("(e) or (b)", 4, 1),  # (e) is not an option of 4: the search goes on
    ("e", 4, None),
    ("(j)", 10, 9),
    ("j", 10, 9),
    ("(k)", 10, None),
    ("bad", 4, None),  # letters inside words are not answers
    ("I'd say", 4, None),  # ...nor glued by an apostrophe
    ("b2", 4, None),
    ("", 4, None),
    ("none of them", 4, None),
    ("a dog", 4, 0),  # the article counts as a bare letter: the reference rule, documented
    ("I think so", 10, 8),  # likewise the pronoun once i is an option
    ("I think so", 4, None),
])
def test_parse_option_letter(text, num_options, expected):
    assert parse_option_letter(text, num_options) == expected


@pytest.mark.parametrize("bad", [0, 11])
def test_parse_option_letter_rejects_option_counts(bad):
    with pytest.raises(ValueError, match="num_options"):
        parse_option_letter("a", bad)


@pytest.mark.parametrize("prediction, reward", [("(c)", 1.0), ("C", 1.0), ("(b)", 0.0), ("", 0.0), ("(e)", 0.0)])
def test_mc_letter_reward(prediction, reward):
    assert mc_letter_reward(prediction, mc_example(answer_index=2)) == reward


def test_mc_letter_reward_uses_the_example_option_count():
    assert mc_letter_reward("(e)", mc_example(answer_index=4, num_options=5)) == 1.0
    assert mc_letter_reward("(e)", mc_example(answer_index=3, num_options=4)) == 0.0


def test_snap_action_exact_after_normalisation():
    assert snap_action("  Open   FRIDGE 1 ", ADMISSIBLE) == "open fridge 1"


def test_snap_action_nearest():
    assert snap_action("open the fridge", ADMISSIBLE) == "open fridge 1"
    assert snap_action("heat potato with microwave", ADMISSIBLE) == "heat potato 1 with microwave 1"
    assert snap_action("take potato 1 from countertop", ADMISSIBLE) == "take potato 1 from countertop 1"


def test_snap_action_uses_the_first_line():
    assert snap_action("\ngo to fridge 1\nopen fridge 1", ADMISSIBLE) == "go to fridge 1"


def test_snap_action_ties_broken_by_list_order():
    assert snap_action("xyz", ["abc", "def"]) == "abc"  # both ratios 0
    assert snap_action("go to b", ["go to a", "go to c"]) == "go to a"
    assert snap_action("go to b", ["go to c", "go to a"]) == "go to c"


def test_snap_action_needs_commands():
    with pytest.raises(ValueError, match="admissible"):
        snap_action("look", [])


@pytest.mark.parametrize("prediction, reward", [
    ("open fridge 1", 1.0), ("Open the fridge.", 1.0), ("go to fridge 1", 0.0), ("", 0.0),
])
def test_snapped_action_reward(prediction, reward):
    assert snapped_action_reward(prediction, alf_example()) == reward


def test_snapped_action_reward_normalises_the_expert_action():
    assert snapped_action_reward("open fridge 1", alf_example(expert=" Open  Fridge 1")) == 1.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(admissible=None), "admissible_commands"),
    (dict(admissible=[]), "admissible_commands"),
    (dict(admissible="open fridge 1"), "admissible_commands"),
    (dict(admissible=["open fridge 1", 3]), "admissible_commands"),
    (dict(expert=None), "answer_text"),
    (dict(expert="  "), "answer_text"),
])
def test_snapped_action_reward_rejects_incomplete_examples(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        snapped_action_reward("open fridge 1", alf_example(**kwargs))
    assert "alf-1" in str(err.value)


def test_registry():
    assert set(REWARDS) == {"mc_letter", "snapped_action"}
    assert get_reward("mc_letter") is mc_letter_reward
    assert get_reward("snapped_action") is snapped_action_reward
    with pytest.raises(ValueError, match="mc_letter.*snapped_action"):
        get_reward("f1")
