"""Building blocks the synthetic variants share (``elasticmem.data.synthetic`` and
``elasticmem.data.synthetic_shift``): a question before placement, an utterance's topic, a unit
of utterances, and placing units over dated sessions.

    python -m pytest -q tests/unit/test_synthetic.py tests/unit/test_synthetic_shift.py
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Literal, Sequence


@dataclass
class _Question:
    """A question before placement: evidence points at (unit, position-in-unit) utterances."""

    question: str
    choices: list[str]
    answer_index: int
    question_type: str
    evidence: list[tuple[int, int]]


@dataclass(frozen=True)
class _Topic:
    """What a user utterance is about, for the assistant's engaged reply.

    kind 'fact': ``category`` and ``value``; 'link': ``relation`` and ``name``;
    'filler': the small-talk line in ``value``.
    """

    kind: Literal["fact", "link", "filler"]
    category: str = ""
    value: str = ""
    relation: str = ""
    name: str = ""


@dataclass
class _Unit:
    """One or two user utterances; a pair keeps its order (strict: in a later session)."""

    texts: tuple[str, ...]
    strict: bool = False
    topics: tuple[_Topic, ...] = ()
    """One per text: what the assistant's engaged reply to it talks about."""


def _shuffled_choices(gold: str, wrong: Sequence[str], rng: random.Random) -> tuple[list[str], int]:
    choices = [gold, *wrong]
    rng.shuffle(choices)
    return choices, choices.index(gold)


def _place(units: Sequence[_Unit], num_sessions: int, rng: random.Random) -> list[list[tuple[int, int]]]:
    """Spread units over sessions; returns per session the (unit, position) ids in turn order.

    A pair's first utterance precedes its second: a strict pair (an old value and
    its update) spans two sessions, a loose pair (multi-hop link, then statement)
    may share one.
    """
    slots: list[tuple[int, float, int, int]] = []
    for ui, unit in enumerate(units):
        if len(unit.texts) == 1:
            sessions = [rng.randrange(num_sessions)]
        elif unit.strict:
            sessions = sorted(rng.sample(range(num_sessions), 2))
        else:
            sessions = sorted(rng.randrange(num_sessions) for _ in unit.texts)
        keys = sorted(rng.random() for _ in unit.texts)
        slots.extend((s, k, ui, pi) for pi, (s, k) in enumerate(zip(sessions, keys)))
    slots.sort()
    placed: list[list[tuple[int, int]]] = [[] for _ in range(num_sessions)]
    for s, _, ui, pi in slots:
        placed[s].append((ui, pi))
    return placed


def _session_dates(num_sessions: int, rng: random.Random) -> list[str]:
    day = date(2023, 1, 1) + timedelta(days=rng.randrange(365))
    dates = []
    for _ in range(num_sessions):
        dates.append(day.isoformat())
        day += timedelta(days=rng.randint(1, 30))
    return dates
