"""The surface forms of the ``persona_shift`` synthetic variant (``elasticmem.data.synthetic_shift``) and
their split into a training side and a held-out side.

Every sentence that states, asks about or answers a fact is composed from interchangeable parts:
a statement is ``{opener}{core}{suffix}.`` (12 openers x 8 cores per fact kind x 6 suffixes), a
question ``{prefix}{question core}{suffix}`` (8 x 6 per kind x 4), a knowledge update
``{opener}{update core}{suffix}.`` (4 update cores per kind), its question from 4 update question
cores per kind, a multi-hop link ``{link opener}{link core}.`` (6 x 6), and a reply ``{value opener} {closer}`` (8 x 8).
``{s}`` is the subject ("I", "my sister", "Nora" in statements; "I", "my sister", "Maya",
"Maya's sister" in questions), ``{v}`` the value, ``{r}`` a relation, ``{n}`` a name; every core
is in the past tense ("did {s} ..." in questions), so one core fits every subject.

``surface_forms(side, surface_seed)`` partitions **every part list** (and the value pools, the
person names, the relations and the small talk) in two halves by a seeded hash: the training side
("train") and the held-out side ("heldout", used by val and test). A held-out sentence therefore
shares no opener, core, suffix, prefix, name, relation or value with any training sentence, so its
skeleton (the sentence with values and names masked) never occurs in training. ``"all"`` is the
union (``surface_split: false``, the control without the shift). Session greetings and the
``acknowledge`` replies carry no fact and are shared by both sides.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Literal

from elasticmem.config import data as _limits
from elasticmem.data.synthetic_tables import (
    FILLER,
    FILLER_REPLIES,
    LINK_REPLIES,
    PERSON_NAMES,
    PERSONA_CATEGORIES,
    RELATIONS,
    REPLY_CLOSERS,
    REPLY_NOUNS,
)

Side = Literal["train", "heldout", "all"]


@dataclass(frozen=True)
class Kind:
    """One kind of fact: the cores that state it, ask about it, update it and ask for the update."""

    name: str
    statements: tuple[str, ...]
    questions: tuple[str, ...]
    updates: tuple[str, ...]
    update_questions: tuple[str, ...]


KINDS: tuple[Kind, ...] = (
    Kind("dog",
         ("{s} adopted a dog named {v}", "{s} got a puppy called {v}", "{s} brought home a rescue dog named {v}",
          "{s} took in a dog called {v}", "{s} welcomed a new dog named {v}",
          "{s} picked a puppy at the shelter and named it {v}", "{s} became the owner of a dog called {v}",
          "{s} named the new family dog {v}"),
         ("what is the name of the dog {s} adopted?", "what did {s} name the new dog?",
          "what is the dog {s} got called?", "which name did {s} give the puppy?",
          "what is the dog that {s} took in called?", "what name does the dog {s} brought home have?"),
         ("{s} rehomed the old dog and adopted a new one named {v}", "{s} said goodbye to the old dog and got a puppy called {v}",
          "{s} ended up with a different dog, one named {v}", "{s} later took in another dog and called it {v}"),
         ("what is the name of the newest dog {s} adopted?", "what did {s} call the dog adopted most recently?",
          "which dog did {s} end up with after the change?", "what is the latest dog {s} got called?")),
    Kind("city",
         ("{s} moved to {v}", "{s} relocated to {v}", "{s} packed up and settled in {v}",
          "{s} found an apartment in {v} and moved there", "{s} made the move to {v}",
          "{s} left town for a new home in {v}", "{s} signed a lease in {v} and moved", "{s} started a new life in {v}"),
         ("which city did {s} move to?", "where did {s} relocate to?", "which city did {s} settle in?",
          "in which city did {s} find a new home?", "what city did {s} make the move to?",
          "where did {s} start a new life?"),
         ("{s} moved again, this time to {v}", "{s} relocated once more and landed in {v}",
          "{s} left that city behind and moved to {v}", "{s} changed cities again and settled in {v}"),
         ("which city did {s} move to most recently?", "where did {s} end up after the latest move?",
          "which city did {s} settle in after moving again?", "what city did {s} last move to?")),
    Kind("field",
         ("{s} started working in {v}", "{s} got a job in {v}", "{s} began a career in {v}",
          "{s} switched into {v} for work", "{s} took a position in {v}", "{s} landed a job in {v}",
          "{s} found work in {v}", "{s} entered the field of {v}"),
         ("which field did {s} start working in?", "in which field did {s} get a job?",
          "what line of work did {s} go into?", "which career did {s} begin?", "what field did {s} find work in?",
          "which industry did {s} join?"),
         ("{s} changed careers again and moved into {v}", "{s} left that job and started over in {v}",
          "{s} retrained and went into {v}", "{s} switched fields once more, to {v}"),
         ("which field did {s} move into most recently?", "what field did {s} switch to in the latest career change?",
          "which line of work did {s} go into last?", "in which field did {s} end up after changing careers?")),
    Kind("dish",
         ("{s} learned to cook {v}", "{s} mastered a recipe for {v}", "{s} took a class on making {v}",
          "{s} figured out how to make {v}", "{s} cooked {v} from scratch for the first time",
          "{s} perfected homemade {v}", "{s} practiced making {v} all month", "{s} got really good at making {v}"),
         ("which dish did {s} learn to cook?", "what dish did {s} master?", "which recipe did {s} learn?",
          "what did {s} learn to make in the kitchen?", "which dish did {s} figure out how to make?",
          "what food did {s} get good at cooking?"),
         ("{s} moved on to a new weekly dish, {v}", "{s} switched the weekly dinner to {v}",
          "{s} stopped making the old dish and cooked {v} instead", "{s} replaced the usual recipe with {v}"),
         ("which dish did {s} switch to most recently?", "what dish did {s} start cooking most recently?",
          "which recipe did {s} move on to last?", "what did {s} cook instead after dropping the old dish?")),
    Kind("instrument",
         ("{s} started taking lessons on the {v}", "{s} picked up the {v}", "{s} began learning to play the {v}",
          "{s} started renting the {v} for practice", "{s} signed up for {v} lessons", "{s} joined a class for the {v}",
          "{s} took up playing the {v}", "{s} started practicing the {v} every evening"),
         ("which instrument did {s} start taking lessons on?", "what instrument did {s} pick up?",
          "which instrument did {s} begin learning?", "what instrument did {s} start practicing?",
          "which instrument did {s} sign up to learn?", "on which instrument did {s} start lessons?"),
         ("{s} switched instruments and moved on to the {v}", "{s} gave up the old instrument for the {v}",
          "{s} swapped instruments and took up the {v}", "{s} traded the old instrument in for the {v}"),
         ("which instrument did {s} switch to most recently?", "what instrument did {s} move on to last?",
          "which instrument did {s} take up after giving up the old one?",
          "what instrument did {s} play after switching?")),
    Kind("car",
         ("{s} bought a new car made by {v}", "{s} got a car from {v}", "{s} picked up a used {v}",
          "{s} drove home a brand new {v}", "{s} purchased a car built by {v}", "{s} leased a car from {v}",
          "{s} chose {v} for a new car", "{s} traded up to a shiny new {v}"),
         ("which car brand did {s} buy?", "what make of car did {s} get?", "which brand is the car {s} bought?",
          "what kind of car did {s} drive home?", "which carmaker built the car {s} got?",
          "what brand of car did {s} purchase?"),
         ("{s} sold the old car and bought one made by {v}", "{s} replaced the old car with a newer {v}",
          "{s} switched brands and went with {v}", "{s} traded in the old car for a new {v}"),
         ("which car brand did {s} buy most recently?", "what make of car did {s} switch to?",
          "which brand did {s} replace the old car with?", "what car did {s} get after selling the old one?")),
    Kind("hobby",
         ("{s} recently took up {v}", "{s} got into {v}", "{s} started spending weekends on {v}",
          "{s} discovered a love for {v}", "{s} joined a club for {v}", "{s} found a new hobby in {v}",
          "{s} signed up for a course in {v}", "{s} became obsessed with {v}"),
         ("which hobby did {s} take up?", "what did {s} get into as a hobby?", "which pastime did {s} discover?",
          "what new hobby did {s} find?", "which hobby did {s} join a club for?",
          "what activity did {s} start doing for fun?"),
         ("{s} dropped the old hobby and moved on to {v}", "{s} lost interest in the old hobby and picked up {v}",
          "{s} switched hobbies, to {v}", "{s} replaced the old hobby with {v}"),
         ("which hobby did {s} switch to most recently?", "what hobby did {s} pick up after dropping the old one?",
          "which pastime did {s} move on to last?", "what did {s} replace the old hobby with?")),
    Kind("language",
         ("{s} started learning {v}", "{s} signed up for {v} classes", "{s} began studying {v}",
          "{s} downloaded an app to learn {v}", "{s} enrolled in evening classes in {v}", "{s} took up {v} as a new language",
          "{s} started practicing {v} with a language partner", "{s} decided to learn {v}"),
         ("which language did {s} start learning?", "what language did {s} begin studying?",
          "which language did {s} sign up to learn?", "what language did {s} enroll in a course for?",
          "which new language did {s} take up?", "what language did {s} decide to learn?"),
         ("{s} switched languages and moved on to {v}", "{s} gave up the old language and started {v}",
          "{s} dropped that course and enrolled in {v}", "{s} changed languages, to {v}"),
         ("which language did {s} switch to most recently?", "what language did {s} move on to last?",
          "which language did {s} start after giving up the old one?", "what language did {s} change to?")),
    Kind("drink",
         ("{s} got hooked on {v}", "{s} started drinking {v} every morning", "{s} fell in love with {v}",
          "{s} discovered {v} at a cafe", "{s} could not stop ordering {v}", "{s} made {v} the daily drink",
          "{s} developed a taste for {v}", "{s} became a big fan of {v}"),
         ("which drink did {s} get hooked on?", "what drink did {s} fall in love with?",
          "which drink did {s} start having every morning?", "what did {s} develop a taste for?",
          "which beverage did {s} become a fan of?", "what drink did {s} keep ordering?"),
         ("{s} gave up the old favorite drink for {v}", "{s} switched drinks and went for {v}",
          "{s} replaced the usual drink with {v}", "{s} moved on to {v} as the daily drink"),
         ("which drink did {s} switch to most recently?", "what drink did {s} replace the old favorite with?",
          "which beverage did {s} move on to last?", "what did {s} start drinking after giving up the old favorite?")),
    Kind("color",
         ("{s} painted the living room {v}", "{s} gave the living room a coat of {v}",
          "{s} redid the living room walls in {v}", "{s} chose {v} for the living room walls",
          "{s} went with {v} paint for the living room", "{s} decorated the living room in {v}",
          "{s} picked {v} as the new living room color", "{s} covered the living room walls in {v}"),
         ("which color did {s} paint the living room?", "what color did {s} choose for the living room walls?",
          "which shade did {s} pick for the living room?", "what color did {s} use on the living room?",
          "which paint color did {s} go with for the living room?", "what color did {s} decorate the living room in?"),
         ("{s} repainted the living room, this time in {v}", "{s} changed the living room color to {v}",
          "{s} covered the old paint with {v}", "{s} redid the living room once more, in {v}"),
         ("which color did {s} repaint the living room most recently?", "what color did {s} change the living room to?",
          "which shade did {s} cover the old paint with?", "what is the latest color {s} painted the living room?")),
    Kind("country",
         ("{s} went on a trip to {v}", "{s} spent two weeks traveling around {v}", "{s} took a vacation in {v}",
          "{s} flew to {v} for a holiday", "{s} backpacked through {v}", "{s} visited {v} for the first time",
          "{s} toured {v} by train", "{s} explored {v} on a road trip"),
         ("which country did {s} travel to?", "what country did {s} visit?", "where did {s} go on vacation?",
          "which country did {s} tour?", "what country did {s} explore?", "which country did {s} fly to for a holiday?"),
         ("{s} came back from another trip, this time to {v}", "{s} traveled again, to {v}",
          "{s} made a more recent trip to {v}", "{s} just got back from {v}"),
         ("which country did {s} visit most recently?", "where did {s} travel on the latest trip?",
          "which country did {s} go to on the last trip?", "what country did {s} just get back from?")),
    Kind("sport",
         ("{s} joined a local {v} team", "{s} started playing {v} on weekends", "{s} signed up for a {v} league",
          "{s} took up {v} as a sport", "{s} tried out for the {v} team", "{s} began training for {v}",
          "{s} became a regular at {v} practice", "{s} joined a {v} club"),
         ("which sport did {s} join a team for?", "what sport did {s} start playing?",
          "which sport did {s} sign up to play?", "what sport did {s} begin training for?",
          "which team sport did {s} take up?", "what sport did {s} join a club for?"),
         ("{s} switched sports and started playing {v}", "{s} quit the old team and joined a {v} team",
          "{s} moved on to {v} as the new sport", "{s} traded the old sport for {v}"),
         ("which sport did {s} switch to most recently?", "what sport did {s} move on to?",
          "which sport did {s} join after quitting the old team?", "what sport did {s} start playing last?")),
)
"""The fact kinds, the persona variant's categories (same names, nouns and value pools)."""

VALUES: dict[str, tuple[str, ...]] = {c.name: c.values for c in PERSONA_CATEGORIES}
"""Each kind's value pool (the persona variant's), split in halves by ``surface_forms``."""
NOUNS: dict[str, str] = dict(REPLY_NOUNS)

OPENERS: tuple[str, ...] = (
    "", "Guess what, ", "So, ", "Oh, and ", "By the way, ", "Big news: ", "Last month ", "A few weeks ago ",
    "Over the summer ", "Not long ago ", "Funny thing, ", "You know what? ",
)
SUFFIXES: tuple[str, ...] = (
    "", ", believe it or not", ", just so you know", ", if you can believe it", ", as it turns out",
    ", for what it's worth",
)
QUESTION_PREFIXES: tuple[str, ...] = (
    "", "Quick question: ", "Remind me, ", "Do you remember: ", "Tell me, ", "Think back: ",
    "One thing I wonder: ", "Help me out: ",
)
QUESTION_SUFFIXES: tuple[str, ...] = ("", " Any idea?", " I forgot.", " Just checking.")
LINK_OPENERS: tuple[str, ...] = ("", "By the way, ", "Oh, and ", "So, ", "Also, ", "You know what? ")
"""Openers of a multi-hop link (no time words, no suffix: "Last month my sister is called Nora" reads wrong)."""
LINKS: tuple[str, ...] = (
    "my {r} is called {n}", "my {r}'s name is {n}", "{n} is my {r}", "I should mention my {r}, {n}",
    "my {r} goes by {n}", "the name of my {r} is {n}",
)
VALUE_OPENERS: tuple[str, ...] = (
    "{V}, nice!", "Oh, {v}!", "{V}, how fun!", "{V}, wonderful.", "Wow, {v}!", "{V}, that is great news.",
    "{V}, how lovely.", "{V}, what a surprise!",
)
CLOSERS: tuple[str, ...] = REPLY_CLOSERS + (
    "What made this {noun} the choice? Tell me more.", "How did this {noun} come about? Tell me more.",
    "Why this {noun}? Tell me more.",
)
LINK_ANSWERS: tuple[str, ...] = LINK_REPLIES + (
    "{n} sounds like a good {r} to have. How did you two meet?", "Glad you mentioned {n}. Do you see your {r} often?",
    "Your {r} {n}, got it. What does {n} do for fun?",
)
NAMES: tuple[str, ...] = PERSON_NAMES + (
    "Hana", "Felipe", "Ingrid", "Joon", "Mira", "Tariq", "Bea", "Caleb", "Daria", "Elias", "Fatima", "Gustav",
    "Helga", "Idris", "Jana", "Kofi", "Linnea", "Malik", "Nadia", "Otto", "Paula", "Quentin", "Rhea", "Stefan",
    "Tessa", "Umar", "Vera", "Wendell", "Ximena", "Yusuf", "Zara", "Anders", "Bianca", "Cyrus", "Dalia", "Emre",
    "Flora", "Gideon", "Hedda", "Ilan",
)
"""Person names: speakers (third_person, named) and the relatives that multi-hop links introduce."""
RELATIONS_ALL: tuple[str, ...] = RELATIONS + (
    "stepsister", "stepbrother", "flatmate", "childhood friend", "yoga instructor", "manager", "grandson",
    "granddaughter", "pen pal", "old friend", "landlady", "coach", "godson", "goddaughter", "stepfather",
    "stepmother",
)

GREETINGS_NAMED_USER: tuple[tuple[str, str], ...] = (
    ("Hi, it's {n} again.", "Welcome back, {n}! What is on your mind?"),
    ("Hello! {n} here, do you have a minute?", "Of course, {n}, I am happy to chat."),
    ("Hey, {n} again.", "Hi {n}! How can I help today?"),
    ("Good morning, it's {n}!", "Good morning, {n}! What would you like to talk about?"),
)
"""Session openers of the ``third_person`` style, which name the user ({n}); shared by both sides."""
GREETINGS_TWO: tuple[tuple[str, str], ...] = (
    ("Hi {b}, how have you been?", "Hi {a}! Good to see you. Lots of news?"),
    ("Hey {b}, got a minute to catch up?", "Sure, {a}, always."),
    ("{b}! Long time no see.", "{a}! Great to see you again."),
    ("Morning, {b}. Coffee and a chat?", "Sounds good, {a}. What is new?"),
)
"""Session openers of the ``named`` style: {a} greets {b}; shared by both sides."""


@dataclass(frozen=True)
class SurfaceForms:
    """One side's parts; ``statements`` and the other dicts are keyed by kind name."""

    openers: tuple[str, ...]
    suffixes: tuple[str, ...]
    statements: dict[str, tuple[str, ...]]
    questions: dict[str, tuple[str, ...]]
    updates: dict[str, tuple[str, ...]]
    update_questions: dict[str, tuple[str, ...]]
    question_prefixes: tuple[str, ...]
    question_suffixes: tuple[str, ...]
    links: tuple[str, ...]
    link_openers: tuple[str, ...]
    value_openers: tuple[str, ...]
    closers: tuple[str, ...]
    link_answers: tuple[str, ...]
    values: dict[str, tuple[str, ...]]
    names: tuple[str, ...]
    relations: tuple[str, ...]
    fillers: tuple[str, ...]


def _half(items: tuple[str, ...], salt: str, side: Side, surface_seed: int) -> tuple[str, ...]:
    """The training half (the first ceil(n/2) by a seeded sha256 order) or the held-out rest, in table order."""
    if side == "all":
        return items
    rank = sorted(items, key=lambda x: hashlib.sha256(f"{surface_seed}/{salt}/{x}".encode()).hexdigest())
    train = set(rank[: (len(items) + 1) // 2])
    return tuple(x for x in items if (x in train) == (side == "train"))


@functools.lru_cache(maxsize=None)
def surface_forms(side: Side, surface_seed: int = 0) -> SurfaceForms:
    """The parts one side may use (``"all"``: both sides'); disjoint between "train" and "heldout"."""
    def h(items: tuple[str, ...], salt: str) -> tuple[str, ...]:
        return _half(items, salt, side, surface_seed)

    def per_kind(field: str) -> dict[str, tuple[str, ...]]:
        return {k.name: h(getattr(k, field), f"{field}/{k.name}") for k in KINDS}

    return SurfaceForms(
        openers=h(OPENERS, "openers"), suffixes=h(SUFFIXES, "suffixes"),
        statements=per_kind("statements"), questions=per_kind("questions"), updates=per_kind("updates"),
        update_questions=per_kind("update_questions"),
        question_prefixes=h(QUESTION_PREFIXES, "question_prefixes"),
        question_suffixes=h(QUESTION_SUFFIXES, "question_suffixes"),
        links=h(LINKS, "links"), link_openers=h(LINK_OPENERS, "link_openers"), value_openers=h(VALUE_OPENERS, "value_openers"), closers=h(CLOSERS, "closers"),
        link_answers=h(LINK_ANSWERS, "link_answers"),
        values={k: h(v, f"values/{k}") for k, v in VALUES.items()},
        names=h(NAMES, "names"), relations=h(RELATIONS_ALL, "relations"), fillers=h(FILLER, "fillers"),
    )


def filler_replies(filler: str) -> tuple[str, ...]:
    """Engaged replies to one small-talk line (each line's replies go with it to its side)."""
    return FILLER_REPLIES[filler]


def side_counts(side: Side, surface_seed: int = 0) -> dict[str, object]:
    """How many composed forms and pool entries one side has (per kind where it differs): for docs and reports."""
    f = surface_forms(side, surface_seed)
    frame = len(f.openers) * len(f.suffixes)
    qframe = len(f.question_prefixes) * len(f.question_suffixes)
    return {
        "statements": {k: len(v) * frame for k, v in f.statements.items()},
        "updates": {k: len(v) * frame for k, v in f.updates.items()},
        "questions": {k: len(v) * qframe for k, v in f.questions.items()},
        "update_questions": {k: len(v) * qframe for k, v in f.update_questions.items()},
        "links": len(f.links) * len(f.link_openers), "replies": len(f.value_openers) * len(f.closers),
        "link_replies": len(f.link_answers), "values": {k: len(v) for k, v in f.values.items()},
        "names": len(f.names), "relations": len(f.relations), "fillers": len(f.fillers),
    }


def _check_limits() -> None:
    """elasticmem.config bounds the persona_shift knobs by these tables' per-side sizes, written there
    as numbers: refuse to run with tables that no longer match them."""
    sizes = {"SYNTHETIC_SHIFT_KINDS": len(KINDS),
             "SYNTHETIC_SHIFT_SIDE_POOL": min(len(v) for v in VALUES.values()) // 2,
             "SYNTHETIC_SHIFT_SIDE_NAMES": len(NAMES) // 2,
             "SYNTHETIC_SHIFT_SIDE_RELATIONS": len(RELATIONS_ALL) // 2,
             "SYNTHETIC_SHIFT_SIDE_FILLER": len(FILLER) // 2}
    wrong = {k: (getattr(_limits, k), v) for k, v in sizes.items() if getattr(_limits, k) != v}
    if wrong or [k.name for k in KINDS] != list(VALUES):
        raise ImportError(f"elasticmem.config's persona_shift limits disagree with the tables of {__name__} "
                          f"(config, tables): {wrong}")


_check_limits()
