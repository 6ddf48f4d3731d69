"""A synthetic multi-session memory task, deterministic by seed, no download.

The task's tables (the persona categories with their value pools and templates, the tiny variant's
words) are ``elasticmem.data.synthetic_tables``; this module is the generator that reads them.

Three variants share one config (``SyntheticConfig``) and one output format
(the example schema of ``elasticmem.data.schema``, split by history so no
history is shared between train, val and test):

* ``persona``: realistic multi-session user/assistant chats about one
  persona. Each fact (a dog's name, the city the user moved to, a new job
  field, ...) sits in one user turn; lexically near-identical distractors
  about other people ("My neighbor adopted a dog named Pepper.") sit in
  other turns. Question types: ``single_hop`` (one chunk answers it),
  ``multi_hop`` ("My sister is called Maya." + "Maya moved to Porto." →
  "Which city did my sister move to?") and ``knowledge_update`` (an old
  value in an earlier session, the new one in a later session). Every
  option value is drawn from the same pool and written exactly once in the
  history, so without memory no prior beats chance. The assistant's replies
  engage with what the user said, as in real dialogue (LoCoMo): a reply to a
  fact names its value and then asks a follow-up that names its attribute
  ("Pepper, what a cute name! What is special about this dog? Tell me more."),
  so the chunk's last state, its bank key, carries its topic. Fact replies
  never name the subject, so they look the same for the user's own facts and
  for the distractors, and a reply names no value, name or relation its user
  turn does not, so every value still lives in exactly one chunk.
  ``assistant_replies="acknowledge"`` keeps the older replies from a short
  fixed list ("Got it, I will keep that in mind."), which leave the key
  encoding the acknowledgement rather than the fact.
* ``tiny``: for a tiny random model learning by RL. One session of
  ``num_facts`` lone user turns ``"{letter} {key}"`` (chunk text
  ``"User:\\n{letter} {key}"``) and one question per turn, ``"recall {key}"``,
  whose choices are the option letters. A learner must retrieve the chunk that
  ends with the key its question ends with and copy that chunk's letter;
  without memory the gold letter is uniform, so accuracy is chance
  (1/num_options). ``num_facts`` of 4 to 8 and ``num_keys`` of 16 (the
  defaults suit it) keep the word vocabulary at ``len(VOCABULARY)`` words.

* ``persona_shift`` (``elasticmem.data.synthetic_shift``): the persona task in three dialogue
  styles whose val and test splits use sentence templates, question forms, names, relations and
  values the training split never uses, so a learned map cannot reach them by template matching.

Write the splits with ``write_synthetic(cfg, seed, out_dir)``; test with::

    pytest tests/unit/test_synthetic.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

# The knobs (SyntheticConfig) and the limits they are checked against live on the ground floor.
from elasticmem.config import SPLITS, SyntheticConfig
from elasticmem.config import synthetic_fact_types as _fact_types
from elasticmem.config.data import SYNTHETIC_SHIFT_FIELDS
from elasticmem.data.chunking import chunk_history
from elasticmem.data.schema import Example, Turn, write_examples
from elasticmem.data.synthetic_parts import _place, _Question, _session_dates, _shuffled_choices, _Topic, _Unit
from elasticmem.data.synthetic_shift import shift_history
from elasticmem.data.synthetic_tables import (
    ACKNOWLEDGEMENTS,
    FACT_OPENERS,
    FILLER,
    FILLER_REPLIES,
    GREETINGS,
    LINK_REPLIES,
    LINK_TEMPLATE,
    OPTION_LETTERS,
    PERSONA_CATEGORIES,
    PERSON_NAMES,
    RELATIONS,
    REPLY_CLOSERS,
    REPLY_NOUNS,
    TINY_KEYS,
    TINY_QUESTION_WORD,
    Category,
)

TINY_QUESTION_TYPE = "recall"
SOURCE = "synthetic"


# --------------------------------------------------------------------------- building blocks


def _fact(cat: Category, subject: str, value: str, template: str | None = None) -> tuple[str, _Topic]:
    """A fact's user utterance and its topic; ``subject`` is "I", "My {relation}" or a name,
    ``template`` defaults to the category's statement."""
    return (template or cat.statement).format(s=subject, v=value), _Topic("fact", category=cat.name, value=value)


def _engaged_reply(topic: _Topic, rng: random.Random) -> str:
    """The assistant's reply to a user utterance about ``topic`` (assistant_replies='engaged')."""
    if topic.kind == "link":
        return rng.choice(LINK_REPLIES).format(r=topic.relation, n=topic.name)
    if topic.kind == "filler":
        return rng.choice(FILLER_REPLIES[topic.value])
    fields = dict(v=topic.value, V=topic.value[:1].upper() + topic.value[1:], noun=REPLY_NOUNS[topic.category])
    opener = rng.choice(FACT_OPENERS[topic.category]).format(**fields)
    return f"{opener} {rng.choice(REPLY_CLOSERS).format(**fields)}"



def _persona_fact(
    cat: Category, qtype: str, cfg: SyntheticConfig, rng: random.Random,
    people: list[tuple[str, str]],
) -> tuple[list[_Unit], _Question]:
    """Units and question of one fact; unit indices in the evidence are local to this fact.

    ``people`` are the (relation, name) links this fact may use (multi_hop only),
    so names and relations never repeat across the facts of one history.
    """
    nd = cfg.num_distractors
    values = rng.sample(cat.values, nd + (2 if qtype == "knowledge_update" else 1))
    gold, others = values[0], values[1:]
    def unit(*said: tuple[str, _Topic], strict: bool = False) -> _Unit:
        return _Unit(tuple(t for t, _ in said), strict, tuple(topic for _, topic in said))

    if qtype == "multi_hop":
        units = [unit((LINK_TEMPLATE.format(r=r, n=n), _Topic("link", relation=r, name=n)), _fact(cat, n, v))
                 for (r, n), v in zip(people, values)]
        question = cat.question.format(s=f"my {people[0][0]}")
        wrong = rng.sample(others, cfg.num_options - 1)
        evidence = [(0, 0), (0, 1)]
    else:
        distractors = others[1:] if qtype == "knowledge_update" else others
        relations = rng.sample(RELATIONS, nd)
        units = [unit(_fact(cat, f"My {r}", v)) for r, v in zip(relations, distractors)]
        if qtype == "knowledge_update":
            old = others[0]
            units.insert(0, unit(_fact(cat, "I", old), _fact(cat, "I", gold, cat.update), strict=True))
            question = cat.question_now
            wrong = [old, *rng.sample(distractors, cfg.num_options - 2)]
            evidence = [(0, 1)]
        else:
            units.insert(0, unit(_fact(cat, "I", gold)))
            question = cat.question.format(s="I")
            wrong = rng.sample(distractors, cfg.num_options - 1)
            evidence = [(0, 0)]
    choices, answer_index = _shuffled_choices(gold, wrong, rng)
    return units, _Question(question, choices, answer_index, qtype, evidence)



def _persona_history(
    cfg: SyntheticConfig, rng: random.Random, reply_rng: random.Random,
) -> tuple[list[list[Turn]], list[_Question]]:
    """One persona history and its questions, evidence as (session, user-turn index).

    Engaged replies come from ``reply_rng``; ``rng`` advances exactly as it does with
    acknowledgements, so both reply styles give the same user turns, order and dates.
    """
    types = _fact_types(cfg.question_types, cfg.num_facts)
    categories = rng.sample(PERSONA_CATEGORIES, cfg.num_facts)
    n_people = types.count("multi_hop") * (cfg.num_distractors + 1)
    people = list(zip(rng.sample(RELATIONS, n_people), rng.sample(PERSON_NAMES, n_people)))
    units: list[_Unit] = []
    questions: list[_Question] = []
    for cat, qtype in zip(categories, types):
        mine = [people.pop() for _ in range(cfg.num_distractors + 1)] if qtype == "multi_hop" else []
        fact_units, q = _persona_fact(cat, qtype, cfg, rng, mine)
        q.evidence = [(len(units) + u, p) for u, p in q.evidence]
        units.extend(fact_units)
        questions.append(q)
    units.extend(_Unit((text,), topics=(_Topic("filler", value=text),)) for text in rng.sample(FILLER, cfg.num_filler))

    where: dict[tuple[int, int], tuple[int, int]] = {}
    history: list[list[Turn]] = []
    for si, (ids, day) in enumerate(zip(_place(units, cfg.num_sessions, rng), _session_dates(cfg.num_sessions, rng))):
        greet_user, greet_reply = rng.choice(GREETINGS)
        session = [Turn("user", greet_user, day), Turn("assistant", greet_reply, day)]
        for ui, pi in ids:
            where[(ui, pi)] = (si, len(session))
            reply = rng.choice(ACKNOWLEDGEMENTS)  # drawn in both styles: rng stays in step
            if cfg.assistant_replies == "engaged":
                reply = _engaged_reply(units[ui].topics[pi], reply_rng)
            session += [Turn("user", units[ui].texts[pi], day), Turn("assistant", reply, day)]
        history.append(session)
    for q in questions:
        q.evidence = [where[e] for e in q.evidence]
    return history, questions


def _tiny_letters(num_facts: int, num_options: int, rng: random.Random) -> list[str]:
    """Values of one tiny history: every letter at least once when there is room, shuffled."""
    letters = list(OPTION_LETTERS[:num_options])
    if num_facts < num_options:
        return rng.sample(letters, num_facts)
    values = letters + [rng.choice(letters) for _ in range(num_facts - num_options)]
    rng.shuffle(values)
    return values


def _tiny_history(cfg: SyntheticConfig, rng: random.Random) -> tuple[list[list[Turn]], list[_Question]]:
    keys = rng.sample(TINY_KEYS[: cfg.num_keys], cfg.num_facts)
    letters = _tiny_letters(cfg.num_facts, cfg.num_options, rng)
    choices = list(OPTION_LETTERS[: cfg.num_options])
    session = [Turn("user", f"{letter} {key}") for letter, key in zip(letters, keys)]
    questions = [
        _Question(f"{TINY_QUESTION_WORD} {key}", list(choices), choices.index(letter), TINY_QUESTION_TYPE, [(0, i)])
        for i, (letter, key) in enumerate(zip(letters, keys))
    ]
    return [session], questions


# --------------------------------------------------------------------------- public API


def split_sizes(num_histories: int, fractions: Sequence[float]) -> list[int]:
    """Histories per split: floors of the shares, remainders to the largest fractional parts."""
    shares = [num_histories * f for f in fractions]
    sizes = [int(s) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(shares[i] - sizes[i]), i))
    for i in by_remainder[: num_histories - sum(sizes)]:
        sizes[i] += 1
    return sizes


def _history_examples(cfg: SyntheticConfig, seed: int, h: int, split: str = "train") -> list[Example]:
    # One rng per history (seeded by a string, which Python hashes deterministically),
    # so a history does not change when num_histories or the fractions do (persona_shift:
    # as long as it stays in its split, which picks its surface forms and styles).
    rng = random.Random(f"elasticmem-synthetic/{cfg.variant}/{seed}/{h}")
    added: dict[str, Any] = {}
    if cfg.variant == "tiny":
        history, questions = _tiny_history(cfg, rng)
    elif cfg.variant == "persona_shift":
        reply_rng = random.Random(f"elasticmem-synthetic/{cfg.variant}/{seed}/{h}/replies")
        history, questions, added = shift_history(cfg, split, rng, reply_rng)
    else:
        reply_rng = random.Random(f"elasticmem-synthetic/{cfg.variant}/{seed}/{h}/replies")
        history, questions = _persona_history(cfg, rng, reply_rng)
    group = f"synth-{cfg.variant}-{seed}-{h}"
    return [
        Example(
            id=f"{group}-{qi}",
            source=SOURCE,
            question=q.question,
            choices=q.choices,
            answer_index=q.answer_index,
            question_type=q.question_type,
            history=history,
            group=group,
            answer_text=q.choices[q.answer_index],
            extra={"evidence": [list(e) for e in q.evidence], **added},
        )
        for qi, q in enumerate(questions)
    ]


def generate(cfg: SyntheticConfig, seed: int) -> dict[str, list[Example]]:
    """Examples per split ("train", "val", "test"); the same (cfg, seed) gives the same data."""
    cfg.validate()
    sizes = split_sizes(cfg.num_histories, cfg.split_fractions)
    out: dict[str, list[Example]] = {}
    start = 0
    for split, n in zip(SPLITS, sizes):
        out[split] = [ex for h in range(start, start + n) for ex in _history_examples(cfg, seed, h, split)]
        start += n
    return out


def split_stats(examples: Sequence[Example]) -> dict[str, Any]:
    """Counts of one split; sessions, turns and chunks are counted once per history."""
    histories = {ex.group: ex.history for ex in examples}
    return {
        "examples": len(examples),
        "histories": len(histories),
        "sessions": sum(len(h) for h in histories.values()),
        "turns": sum(len(s) for h in histories.values() for s in h),
        "chunks": sum(len(chunk_history(h, g)) for g, h in histories.items()),
        "question_types": dict(sorted(Counter(ex.question_type for ex in examples).items())),
    }


def _config_record(cfg: SyntheticConfig) -> dict[str, Any]:
    """The config as stats.json records it: the persona_shift-only fields are left out for the other
    variants while they hold their defaults, so those variants' stats.json stay as they were."""
    record = dataclasses.asdict(cfg)
    if cfg.variant != "persona_shift":
        default = dataclasses.asdict(SyntheticConfig())
        for key in SYNTHETIC_SHIFT_FIELDS:
            if record[key] == default[key]:
                del record[key]
    return record


def write_synthetic(cfg: SyntheticConfig, seed: int, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Write OUT_DIR/{train,val,test}.jsonl and OUT_DIR/stats.json; returns the stats."""
    out = Path(out_dir)
    splits = generate(cfg, seed)
    for split, examples in splits.items():
        write_examples(out / f"{split}.jsonl", examples)
    stats = {
        "source": SOURCE,
        "variant": cfg.variant,
        "seed": seed,
        "config": _config_record(cfg),
        "splits": {split: split_stats(examples) for split, examples in splits.items()},
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    return stats
