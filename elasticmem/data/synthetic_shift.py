"""The ``persona_shift`` synthetic variant: the persona task with a surface shift between training and
evaluation, so a question/key map cannot reach the test split by matching templates.

Differences from ``persona`` (``elasticmem.data.synthetic``), which stays as it is:

* **Disjoint surface forms.** Every sentence is composed from parts (``synthetic_shift_tables``):
  openers x statement cores x suffixes, question prefixes x question cores x suffixes, link cores,
  update cores, reply openers x closers. Each part list, each kind's value pool, the person names,
  the relations and the small talk are split in halves by a seeded hash (``surface_seed``); the
  training split uses one half, val and test the other (they share it). No training sentence,
  question, value, name or relation occurs in val or test. ``surface_split: false`` lets every split
  draw from both halves (the control).
* **Dialogue styles**, one drawn per history from ``train_styles`` (train) or ``eval_styles`` (val,
  test): ``chat`` (user/assistant, "Which city did I move to?"), ``third_person`` (the same chat, the
  user named in the chunk labels and greetings, "Which city did Maya move to?") and ``named`` (two
  named people, "Maya:" / "Leo:"; each states facts of their own in the first person, the other
  answers; questions ask in the third person about either). In ``named`` the stating speaker's turn
  has role "user" and the answering one's "assistant" (so a statement and its answer form one chunk);
  ``speaker`` holds the names.
* **Question types** as in persona: ``single_hop``; ``knowledge_update`` (the old value in an earlier
  session, the new one later; the latest counts and the old value is an option); ``multi_hop``
  ("My sister is called Nora." + "Nora moved to Porto." -> "Which city did Maya's sister move to?";
  both statements are evidence, in different chunks).
* **Distractors sharing the kind or the person.** The wrong options are the same kind about other
  people: relatives ("My cousin moved to Oslo."), in ``named`` always the other speaker too (an
  option), and in multi_hop the other speaker's relative of the same relation ("Leo: My sister is
  called Yara." + "Yara moved to Oslo."). Every asked person also states a fact of another kind
  (the relative of a multi_hop question always; a speaker where the history has none yet).

Every value a history uses is distinct and written in exactly one chunk (the statement and its
answer), so every option occurs exactly once and no prior beats chance without memory. Examples
carry ``extra = {"evidence": [[session, turn], ...], "style": ..., "surface": "train" | "heldout" |
"all"}``; evidence turns are the statements (role "user").

Test with::

    python -m pytest -q tests/unit/test_synthetic_shift.py
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from elasticmem.config import SyntheticConfig
from elasticmem.config import synthetic_fact_types as _fact_types
from elasticmem.data.schema import Turn
from elasticmem.data.synthetic_parts import _place, _Question, _session_dates, _shuffled_choices, _Topic
from elasticmem.data.synthetic_shift_tables import (
    GREETINGS_NAMED_USER,
    GREETINGS_TWO,
    NOUNS,
    Side,
    SurfaceForms,
    filler_replies,
    surface_forms,
)
from elasticmem.data.synthetic_tables import ACKNOWLEDGEMENTS, GREETINGS


@dataclass(frozen=True)
class _Said:
    """One statement: its text, who says it (0: the user or the first named speaker, 1: the second)
    and its topic (what the answer talks about)."""

    text: str
    speaker: int
    topic: _Topic


@dataclass
class _Unit:
    """Statements placed together in order (strict: the second in a later session); see ``_place``."""

    said: tuple[_Said, ...]
    strict: bool = False

    @property
    def texts(self) -> tuple[str, ...]:
        return tuple(s.text for s in self.said)


def side_of(cfg: SyntheticConfig, split: str) -> Side:
    """The half of the tables a split draws from."""
    if not cfg.surface_split:
        return "all"
    return "train" if split == "train" else "heldout"


class _Builder:
    """Builds one history; ``rng`` draws everything but the engaged answers (``reply_rng``)."""

    def __init__(self, cfg: SyntheticConfig, forms: SurfaceForms, style: str, rng: random.Random,
                 reply_rng: random.Random) -> None:
        self.cfg, self.f, self.style, self.rng, self.reply_rng = cfg, forms, style, rng, reply_rng
        self.named = style == "named"
        self.values = {k: rng.sample(v, len(v)) for k, v in forms.values.items()}
        self.kinds_of: dict[tuple, set[str]] = defaultdict(set)
        self.units: list[_Unit] = []
        self.questions: list[_Question] = []
        self.asked: list[tuple[int, str]] = []  # (speaker, kind) of the questions about a speaker

    # ------------------------------------------------------------------ sentences

    def take(self, kind: str) -> str:
        return self.values[kind].pop()

    def say(self, core: str, subject: str = "", value: str = "", link: dict[str, str] | None = None) -> str:
        """``{opener}{core}{suffix}.``; a ``link`` ({r}, {n}) takes a link opener and no suffix."""
        if link:
            opener, suffix, clause = self.rng.choice(self.f.link_openers), "", core.format(**link)
        else:
            opener, suffix = self.rng.choice(self.f.openers), self.rng.choice(self.f.suffixes)
            clause = core.format(s=subject, v=value)
        if not opener or opener.endswith("? "):
            clause = clause[:1].upper() + clause[1:]
        return f"{opener}{clause}{suffix}."

    def state(self, kind: str, speaker: int, subject: str, value: str, person: tuple, update: bool = False) -> _Said:
        cores = self.f.updates[kind] if update else self.f.statements[kind]
        self.kinds_of[person].add(kind)
        return _Said(self.say(self.rng.choice(cores), subject, value), speaker, _Topic("fact", category=kind, value=value))

    def ask(self, kind: str, subject: str, update: bool = False) -> str:
        cores = self.f.update_questions[kind] if update else self.f.questions[kind]
        prefix, core, suffix = (self.rng.choice(p) for p in (self.f.question_prefixes, cores, self.f.question_suffixes))
        text = prefix + core.format(s=subject)
        return (text[:1].upper() + text[1:] if not prefix else text) + suffix

    def speaker_subject(self, p: int) -> str:
        """How a question names speaker ``p``."""
        return "I" if self.style == "chat" else self.who[p]

    def relative_subject(self, p: int, relation: str) -> str:
        return f"my {relation}" if self.style == "chat" else f"{self.who[p]}'s {relation}"

    def add(self, *said: _Said, strict: bool = False) -> int:
        self.units.append(_Unit(tuple(said), strict))
        return len(self.units) - 1

    def question(self, text: str, gold: str, wrong: list[str], qtype: str, evidence: list[tuple[int, int]]) -> None:
        choices, answer_index = _shuffled_choices(gold, wrong, self.rng)
        self.questions.append(_Question(text, choices, answer_index, qtype, evidence))

    # ------------------------------------------------------------------ facts

    def speaker_fact(self, kind: str, qtype: str) -> None:
        """single_hop or knowledge_update about a speaker, with same-kind statements about others."""
        cfg, rng, update = self.cfg, self.rng, qtype == "knowledge_update"
        p = rng.randrange(2) if self.named else 0
        gold = self.take(kind)
        if update:
            old = self.take(kind)
            u = self.add(self.state(kind, p, "I", old, ("p", p)), self.state(kind, p, "I", gold, ("p", p), update=True),
                         strict=True)
            evidence, prior = [(u, 1)], [old]
        else:
            u = self.add(self.state(kind, p, "I", gold, ("p", p)))
            evidence, prior = [(u, 0)], []
        first: list[str] = []
        if self.named:  # the other speaker, same kind: always an option
            first.append(self.take(kind))
            self.add(self.state(kind, 1 - p, "I", first[0], ("p", 1 - p)))
        rest = []
        for r in rng.sample(self.f.relations, cfg.num_distractors - len(first)):
            sp = rng.randrange(2) if self.named else p
            rest.append(self.take(kind))
            self.add(self.state(kind, sp, f"my {r}", rest[-1], ("r", sp, r)))
        wrong = prior + first + rng.sample(rest, cfg.num_options - 1 - len(prior) - len(first))
        self.asked.append((p, kind))
        self.question(self.ask(kind, self.speaker_subject(p), update), gold, wrong, qtype, evidence)

    def multi_hop(self, kind: str, people: list[tuple[str, str]]) -> None:
        """A relation link and a fact about the named relative; ``people`` are fresh (relation, name)s."""
        cfg, rng = self.cfg, self.rng
        p = rng.randrange(2) if self.named else 0
        (r0, n0), others = people[0], people[1:]
        owners = [p]
        if self.named:  # the other speaker's relative of the same relation, then anyone's
            others[0] = (r0, others[0][1])
            owners.append(1 - p)
        owners += [rng.randrange(2) if self.named else p for _ in range(len(others) - len(owners) + 1)]
        values, evidence = [], []
        for (r, n), sp in zip([(r0, n0), *others], owners):
            values.append(self.take(kind))
            link = _Said(self.say(rng.choice(self.f.links), link=dict(r=r, n=n)), sp, _Topic("link", relation=r, name=n))
            said = [link, self.state(kind, sp, n, values[-1], ("n", n))]
            if n == n0:
                extra = self.other_kind(("n", n), kind)
                if extra:
                    said.append(self.state(extra, sp, n, self.take(extra), ("n", n)))
            u = self.add(*said)
            if n == n0:
                evidence = [(u, 0), (u, 1)]
        first = values[1:2] if self.named else []
        wrong = first + rng.sample(values[1 + len(first):], cfg.num_options - 1 - len(first))
        self.question(self.ask(kind, self.relative_subject(p, r0)), values[0], wrong, "multi_hop", evidence)

    def other_kind(self, person: tuple, kind: str) -> str | None:
        """A kind ``person`` has said nothing of (not ``kind``), preferring kinds no question asks about."""
        free = [k for k, vs in self.values.items() if vs and k != kind and k not in self.kinds_of[person]]
        unasked = [k for k in free if k not in self.history_kinds]
        return self.rng.choice(unasked or free) if free else None

    # ------------------------------------------------------------------ the history

    def build(self) -> tuple[list[list[Turn]], list[_Question]]:
        cfg, rng = self.cfg, self.rng
        types = _fact_types(cfg.question_types, cfg.num_facts)
        kinds = rng.sample(sorted(self.f.statements), cfg.num_facts)
        self.history_kinds = set(kinds)
        n_links = types.count("multi_hop") * (cfg.num_distractors + 1)
        n_speakers = {"chat": 0, "third_person": 1, "named": 2}[self.style]
        names = rng.sample(self.f.names, n_speakers + n_links)
        self.who, linked = names[:n_speakers], names[n_speakers:]
        people = list(zip(rng.sample(self.f.relations, n_links), linked))
        for kind, qtype in zip(kinds, types):
            if qtype == "multi_hop":
                mine, people = people[: cfg.num_distractors + 1], people[cfg.num_distractors + 1:]
                self.multi_hop(kind, mine)
            else:
                self.speaker_fact(kind, qtype)
        for p, kind in self.asked:  # every asked speaker also states a fact of another kind
            if not self.kinds_of[("p", p)] - {kind} and (extra := self.other_kind(("p", p), kind)):
                self.add(self.state(extra, p, "I", self.take(extra), ("p", p)))
        for text in rng.sample(self.f.fillers, cfg.num_filler):
            self.add(_Said(text, rng.randrange(2) if self.named else 0, _Topic("filler", value=text)))
        return self.sessions()

    def sessions(self) -> tuple[list[list[Turn]], list[_Question]]:
        cfg, rng = self.cfg, self.rng
        where: dict[tuple[int, int], tuple[int, int]] = {}
        history: list[list[Turn]] = []
        placed = _place(self.units, cfg.num_sessions, rng)
        for si, (ids, day) in enumerate(zip(placed, _session_dates(cfg.num_sessions, rng))):
            session = self.greeting(day)
            for ui, pi in ids:
                said = self.units[ui].said[pi]
                where[(ui, pi)] = (si, len(session))
                reply = rng.choice(ACKNOWLEDGEMENTS)  # drawn in both reply styles: rng stays in step
                if cfg.assistant_replies == "engaged":
                    reply = self.reply(said.topic)
                session += self.pair(said.text, reply, said.speaker, day)
            history.append(session)
        for q in self.questions:
            q.evidence = [where[e] for e in q.evidence]
        return history, self.questions

    def greeting(self, day: str) -> list[Turn]:
        if self.style == "chat":
            return self.pair(*self.rng.choice(GREETINGS), 0, day)
        if self.style == "third_person":
            said, reply = self.rng.choice(GREETINGS_NAMED_USER)
            return self.pair(said.format(n=self.who[0]), reply.format(n=self.who[0]), 0, day)
        said, reply = self.rng.choice(GREETINGS_TWO)
        g = self.rng.randrange(2)
        names = dict(a=self.who[g], b=self.who[1 - g])
        return self.pair(said.format(**names), reply.format(**names), g, day)

    def pair(self, text: str, reply: str, speaker: int, day: str) -> list[Turn]:
        """A statement and its answer (one chunk): role "user" states, "assistant" answers."""
        if self.style == "chat":
            return [Turn("user", text, day), Turn("assistant", reply, day)]
        if self.style == "third_person":
            return [Turn("user", text, day, self.who[0]), Turn("assistant", reply, day)]
        return [Turn("user", text, day, self.who[speaker]), Turn("assistant", reply, day, self.who[1 - speaker])]

    def reply(self, topic: _Topic) -> str:
        rr = self.reply_rng
        if topic.kind == "link":
            return rr.choice(self.f.link_answers).format(r=topic.relation, n=topic.name)
        if topic.kind == "filler":
            return rr.choice(filler_replies(topic.value))
        fields = dict(v=topic.value, V=topic.value[:1].upper() + topic.value[1:], noun=NOUNS[topic.category])
        return f"{rr.choice(self.f.value_openers).format(**fields)} {rr.choice(self.f.closers).format(**fields)}"


def shift_history(cfg: SyntheticConfig, split: str, rng: random.Random, reply_rng: random.Random,
                  ) -> tuple[list[list[Turn]], list[_Question], dict[str, Any]]:
    """One persona_shift history of ``split``, its questions (evidence as [session, turn]) and the
    example fields it adds (``style``, ``surface``)."""
    side = side_of(cfg, split)
    styles = cfg.train_styles if split == "train" else cfg.eval_styles
    style = rng.choice(styles)
    history, questions = _Builder(cfg, surface_forms(side, cfg.surface_seed), style, rng, reply_rng).build()
    return history, questions, {"style": style, "surface": side}
