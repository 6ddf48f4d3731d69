"""A synthetic multi-session memory task, deterministic by seed, no download.

Why one file (about 680 lines): about half of it is the task's tables (the persona categories with their value
pools and templates, the tiny variant's words), which only make sense beside the generator that reads them.

Two variants share one config (``SyntheticConfig``) and one output format
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

Write the splits with ``write_synthetic(cfg, seed, out_dir)``; test with::

    pytest tests/unit/test_synthetic.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections import Counter
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any, Literal, Sequence

# The knobs (SyntheticConfig) and the limits they are checked against live on the ground floor.
from elasticmem.config import SPLITS, SyntheticConfig
from elasticmem.config import synthetic_fact_types as _fact_types
from elasticmem.data.chunking import chunk_history
from elasticmem.data.schema import Example, Turn, write_examples

TINY_QUESTION_TYPE = "recall"
SOURCE = "synthetic"


@dataclass(frozen=True)
class Category:
    """One kind of persona fact: its value pool and the sentences that carry it.

    ``{s}`` is the subject ("I", "My neighbor", "Maya" in statements; "I",
    "my sister" in questions) and ``{v}`` the value. Statements are past tense
    so one template fits every subject.
    """

    name: str
    statement: str
    question: str
    update: str
    """First-person statement that replaces an earlier value (knowledge_update)."""
    question_now: str
    values: tuple[str, ...]


PERSONA_CATEGORIES: tuple[Category, ...] = (
    Category(
        "dog", "{s} adopted a dog named {v}.", "What is the name of the dog {s} adopted?",
        "My old dog went to live with my parents, and I adopted a new dog named {v}.",
        "What is the name of my dog now?",
        ("Biscuit", "Waffles", "Noodle", "Pickles", "Mochi", "Bubbles", "Ziggy", "Snickers",
         "Pretzel", "Muffin", "Sprinkles", "Nugget", "Peanut", "Bandit", "Rocket", "Gizmo",
         "Scooter", "Pebbles", "Sparky", "Fudge", "Marshmallow", "Doodle", "Wiggles", "Jellybean",
         "Cupcake", "Buttons", "Chewie", "Domino", "Pixel", "Nacho", "Zorro", "Pumpkin", "Truffle",
         "Clover"),
    ),
    Category(
        "city", "{s} moved to {v}.", "Which city did {s} move to?",
        "I moved again, I live in {v} now.", "Which city do I live in now?",
        ("Porto", "Oslo", "Denver", "Seattle", "Lisbon", "Vienna", "Prague", "Dublin", "Austin",
         "Boston", "Chicago", "Toronto", "Madrid", "Berlin", "Munich", "Zurich", "Geneva",
         "Helsinki", "Stockholm", "Copenhagen", "Amsterdam", "Brussels", "Krakow", "Budapest",
         "Athens", "Milan", "Naples", "Seville", "Valencia", "Lyon", "Marseille", "Edinburgh",
         "Glasgow", "Montreal", "Vancouver", "Portland", "Atlanta", "Nashville", "Kyoto", "Osaka",
         "Melbourne", "Auckland"),
    ),
    Category(
        "field", "{s} started working in {v}.", "Which field did {s} start working in?",
        "I changed careers and now I work in {v}.", "Which field do I work in now?",
        ("accounting", "nursing", "marketing", "architecture", "journalism", "dentistry",
         "carpentry", "plumbing", "logistics", "insurance", "robotics", "pharmacy", "forestry",
         "publishing", "banking", "teaching", "translation", "cybersecurity", "animation",
         "aviation", "hospitality", "landscaping", "tailoring", "welding", "radiology",
         "physiotherapy", "consulting", "recruiting", "genetics", "oceanography", "archaeology",
         "economics"),
    ),
    Category(
        "dish", "{s} learned to cook {v}.", "Which dish did {s} learn to cook?",
        "Lately the dish I cook every week is {v}.", "Which dish do I cook every week now?",
        ("lasagna", "ramen", "paella", "risotto", "goulash", "moussaka", "gnocchi", "dumplings",
         "falafel", "shakshuka", "enchiladas", "burritos", "pho", "biryani", "ratatouille",
         "quiche", "gazpacho", "ceviche", "pierogi", "borscht", "tagine", "couscous", "gumbo",
         "jambalaya", "carbonara", "bibimbap", "bulgogi", "tempura", "katsu", "satay", "laksa",
         "empanadas", "tamales", "fondue", "souvlaki"),
    ),
    Category(
        "instrument", "{s} started taking lessons on the {v}.",
        "Which instrument did {s} start taking lessons on?",
        "I switched instruments and now I practice the {v} every day.",
        "Which instrument do I practice now?",
        ("piano", "violin", "cello", "guitar", "banjo", "ukulele", "harp", "flute", "clarinet",
         "saxophone", "trumpet", "trombone", "drums", "accordion", "harmonica", "mandolin", "oboe",
         "bassoon", "tuba", "xylophone", "bagpipes", "sitar", "marimba", "piccolo", "viola", "lute",
         "harpsichord", "didgeridoo", "bongos", "synthesizer", "kalimba", "glockenspiel"),
    ),
    Category(
        "car", "{s} bought a new car made by {v}.", "Which car brand did {s} buy?",
        "I sold my old car and bought one made by {v}.", "Which car brand do I drive now?",
        ("Toyota", "Honda", "Ford", "Subaru", "Mazda", "Volvo", "Audi", "Tesla", "Kia", "Hyundai",
         "Nissan", "Peugeot", "Renault", "Fiat", "Skoda", "Opel", "Chevrolet", "Jeep", "Dodge",
         "Lexus", "Porsche", "Jaguar", "Mini", "Saab", "Citroen", "Suzuki", "Mitsubishi", "Buick",
         "Cadillac", "Acura", "Infiniti", "Lancia", "Dacia"),
    ),
    Category(
        "hobby", "{s} recently took up {v}.", "Which hobby did {s} take up?",
        "I dropped my old hobby and now I spend my free time on {v}.",
        "Which hobby do I spend my free time on now?",
        ("pottery", "knitting", "birdwatching", "calligraphy", "origami", "woodworking",
         "beekeeping", "juggling", "geocaching", "bouldering", "stargazing", "scrapbooking",
         "embroidery", "quilting", "crochet", "glassblowing", "leathercraft", "bonsai", "sketching",
         "falconry", "kayaking", "canoeing", "orienteering", "taxidermy", "skydiving",
         "paragliding", "snorkeling", "archery", "ventriloquism", "whittling", "macrame"),
    ),
    Category(
        "language", "{s} started learning {v}.", "Which language did {s} start learning?",
        "I switched languages and now I study {v}.", "Which language am I studying now?",
        ("Spanish", "French", "German", "Italian", "Portuguese", "Dutch", "Swedish", "Norwegian",
         "Danish", "Finnish", "Polish", "Czech", "Greek", "Turkish", "Arabic", "Hebrew", "Hindi",
         "Bengali", "Japanese", "Korean", "Mandarin", "Cantonese", "Vietnamese", "Indonesian",
         "Swahili", "Russian", "Ukrainian", "Hungarian", "Romanian", "Icelandic", "Welsh",
         "Tagalog", "Persian"),
    ),
    Category(
        "drink", "{s} got hooked on {v}.", "Which drink did {s} get hooked on?",
        "I gave up my old favorite drink and now I have {v} every day.",
        "Which drink do I have every day now?",
        ("espresso", "matcha", "kombucha", "chai", "cappuccino", "macchiato", "cortado",
         "americano", "lemonade", "cider", "oolong", "rooibos", "horchata", "kefir", "lassi",
         "sangria", "mojito", "eggnog", "limeade", "frappe", "root beer", "ginger ale",
         "hot chocolate", "cold brew", "yerba mate", "chamomile", "ayran", "kvass", "mead",
         "tepache", "boza"),
    ),
    Category(
        "color", "{s} painted the living room {v}.", "Which color did {s} paint the living room?",
        "I repainted the living room, it is {v} now.", "What color is my living room now?",
        ("teal", "maroon", "lavender", "beige", "turquoise", "crimson", "magenta", "ochre", "navy",
         "coral", "ivory", "charcoal", "burgundy", "lilac", "indigo", "violet", "amber", "emerald",
         "scarlet", "cobalt", "khaki", "taupe", "mauve", "periwinkle", "chartreuse", "fuchsia",
         "aquamarine", "cerulean", "vermilion", "sepia"),
    ),
    Category(
        "country", "{s} went on a trip to {v}.", "Which country did {s} travel to?",
        "My most recent trip was to {v}.", "Which country did I visit most recently?",
        ("Portugal", "Norway", "Iceland", "Peru", "Chile", "Argentina", "Brazil", "Mexico",
         "Canada", "Japan", "Vietnam", "Thailand", "Morocco", "Egypt", "Kenya", "Tanzania", "Ghana",
         "Croatia", "Slovenia", "Estonia", "Latvia", "Lithuania", "Armenia", "Nepal", "Bhutan",
         "Mongolia", "Cambodia", "Oman", "Malta", "Cyprus", "Ireland", "Austria", "Belgium",
         "Colombia", "Ecuador", "Bolivia", "Uruguay"),
    ),
    Category(
        "sport", "{s} joined a local {v} team.", "Which sport did {s} join a team for?",
        "I switched sports and now I play {v} every weekend.", "Which sport do I play now?",
        ("rugby", "cricket", "volleyball", "badminton", "handball", "lacrosse", "hockey",
         "baseball", "softball", "basketball", "netball", "squash", "tennis", "curling", "golf",
         "bowling", "darts", "polo", "football", "futsal", "korfball", "dodgeball", "kickball",
         "pickleball", "padel", "croquet", "billiards", "snooker", "bocce", "hurling", "frisbee",
         "racquetball"),
    ),
)

RELATIONS: tuple[str, ...] = (
    "sister", "brother", "cousin", "neighbor", "coworker", "boss", "roommate", "best friend",
    "aunt", "uncle", "mentor", "classmate", "nephew", "niece", "landlord", "teammate",
    "grandmother", "grandfather", "godmother", "godfather", "tutor", "barber", "doctor",
    "therapist",
)
"""Other people a fact can be about; distractors and multi-hop links use them."""

PERSON_NAMES: tuple[str, ...] = (
    "Maya", "Leo", "Nora", "Ethan", "Iris", "Omar", "Priya", "Lucas", "Zoe", "Hugo", "Ava",
    "Felix", "Lena", "Mateo", "Clara", "Jonas", "Elena", "Ravi", "Sofia", "Theo", "Mila", "Ivan",
    "Alma", "Nico", "Yara", "Oscar", "Freya", "Arjun", "Ines", "Kai", "Lucia", "Tomas", "Anya",
    "Emil", "Rosa", "Dario", "Selma", "Marco", "Greta", "Samir",
)
"""Names that multi-hop links introduce ("My sister is called Maya.")."""

LINK_TEMPLATE = "My {r} is called {n}."

FILLER: tuple[str, ...] = (
    "The weather has been strange this week.",
    "I finally cleaned out my garage over the weekend.",
    "Work was really busy today.",
    "I watched a documentary about whales last night.",
    "My internet connection keeps dropping.",
    "I slept in late this morning.",
    "The traffic downtown was terrible today.",
    "I am trying to drink more water.",
    "I found an old photo album in the attic.",
    "My phone battery died in the middle of a call.",
    "I have been thinking about rearranging my furniture.",
    "It rained all afternoon.",
    "I started a new jigsaw puzzle with a thousand pieces.",
    "I forgot my umbrella again.",
    "The grocery store was out of bread.",
    "I have an appointment next week that I keep forgetting about.",
    "I need to fix the fence in the backyard.",
    "There was a loud party down the street last night.",
    "I need to renew my passport soon.",
    "I spent the evening answering emails.",
    "I tried a new route for my morning walk.",
    "The power went out for an hour today.",
    "I am reading a long mystery novel.",
    "I cannot decide what to watch tonight.",
)
"""Small talk with no fact in it (num_filler of these per persona history)."""

ACKNOWLEDGEMENTS: tuple[str, ...] = (
    "Thanks for sharing that with me.",
    "Got it, I will keep that in mind.",
    "That sounds lovely.",
    "Noted, thanks for letting me know.",
    "Good to know!",
    "Interesting, tell me more any time.",
    "I appreciate you telling me.",
)
"""Assistant replies of ``assistant_replies="acknowledge"``; they never repeat a value,
so each value lives in exactly one chunk."""

REPLY_NOUNS: dict[str, str] = {
    "dog": "dog", "city": "city", "field": "field", "dish": "dish", "instrument": "instrument",
    "car": "car brand", "hobby": "hobby", "language": "language", "drink": "drink", "color": "color",
    "country": "country", "sport": "sport",
}
"""The attribute a category's question asks for, as engaged replies name it."""

FACT_OPENERS: dict[str, tuple[str, ...]] = {
    "dog": ("{V}, what a cute name!", "A dog named {v}, how sweet!", "{V} sounds adorable."),
    "city": ("{V}, how exciting!", "A move to {v}, wow!", "{V} is a lovely place."),
    "field": ("{V}, what a change!", "A job in {v}, nice!", "{V} sounds rewarding."),
    "dish": ("{V}, yum!", "Homemade {v}, nice!", "{V} sounds tasty."),
    "instrument": ("The {v}, how lovely!", "Lessons on the {v}, nice!", "The {v} sounds fun."),
    "car": ("{V}, nice!", "A new {v}, great!", "{V} makes good cars."),
    "hobby": ("{V}, how fun!", "{V} sounds relaxing.", "Taking up {v}, nice!"),
    "language": ("{V}, great choice!", "Learning {v}, nice!", "{V} sounds beautiful."),
    "drink": ("{V}, yum!", "{V} every day, nice!", "{V} sounds delicious."),
    "color": ("{V}, how bold!", "{V} walls, nice!", "{V} sounds cozy."),
    "country": ("{V}, how exciting!", "A trip to {v}, wow!", "{V} must have been amazing."),
    "sport": ("{V}, how fun!", "A {v} team, nice!", "{V} is a great sport."),
}
"""First sentence of an engaged reply to a fact, per category: it names the value
(``{v}``, or ``{V}`` capitalised)."""

REPLY_CLOSERS: tuple[str, ...] = (
    "What is the next {noun}? Tell me more.",
    "Which {noun} is next? Tell me more.",
    "What will the next {noun} be? Tell me more.",
    "What is special about this {noun}? Tell me more.",
    "What is the story behind this {noun}? Tell me more.",
)
"""Second sentence of an engaged reply to a fact: a follow-up that names the attribute
(``{noun}``, from ``REPLY_NOUNS``) near the chunk's end, where its bank key is read.
The wording was chosen by measuring recall of evidence with SmolLM2-135M's frozen
state (issue 12): a closing question about the attribute followed by "Tell me more."
ranked the evidence chunk highest among the phrasings tried."""

LINK_REPLIES: tuple[str, ...] = (
    "Nice to hear about {n}. Are you close with your {r}?",
    "{n} is a lovely name. How often do you see your {r}?",
    "Thanks for telling me about {n}. What is your {r} like?",
    "So your {r} is {n}. Do you two get along?",
    "Good to know {n} is your {r}. Does {n} live nearby?",
)
"""Engaged replies to a multi-hop link ("My sister is called Maya."): ``{r}`` relation, ``{n}`` name."""

FILLER_REPLIES: dict[str, tuple[str, ...]] = {
    "The weather has been strange this week.": (
        "Strange how? Has it been too warm for the season?", "I hope it settles down soon. Rain or sun?"),
    "I finally cleaned out my garage over the weekend.": (
        "That must feel great! Did you find anything surprising in the garage?",
        "Well done, that is a big job. What did you do with the old stuff?"),
    "Work was really busy today.": (
        "Sorry to hear that. Did you get a break at all?", "Busy days are tiring. What kept you so busy?"),
    "I watched a documentary about whales last night.": (
        "Whales are fascinating! What was the most surprising part?",
        "That sounds interesting. Which whales did the documentary cover?"),
    "My internet connection keeps dropping.": (
        "That is so annoying. Have you tried restarting the router?",
        "Ugh, a flaky connection is the worst. Did you call your provider?"),
    "I slept in late this morning.": (
        "Sounds like you needed the rest! Do you feel refreshed?", "Nice, a lazy morning. Was it a day off?"),
    "The traffic downtown was terrible today.": (
        "Oh no, how long were you stuck in traffic?", "Traffic like that is exhausting. Was there an accident?"),
    "I am trying to drink more water.": (
        "Good plan! Do you use a bottle with markings to keep track?",
        "That is a healthy habit. How many glasses a day are you aiming for?"),
    "I found an old photo album in the attic.": (
        "How fun! Were there any old family photos in it?", "What a find. Whose photos were in the album?"),
    "My phone battery died in the middle of a call.": (
        "That is frustrating. Is the phone getting old?", "Oh no! Were you able to call them back?"),
    "I have been thinking about rearranging my furniture.": (
        "A new layout can refresh a room. Which room would you start with?",
        "Sounds like a fun project. Do you have a plan for the furniture yet?"),
    "It rained all afternoon.": (
        "A rainy afternoon is perfect for staying in. What did you do inside?",
        "Did you get caught in the rain?"),
    "I started a new jigsaw puzzle with a thousand pieces.": (
        "A thousand pieces is ambitious! What is the picture on the puzzle?",
        "Nice! Do you start with the edges of the puzzle?"),
    "I forgot my umbrella again.": (
        "Oh no, did you get soaked?", "That happens to everyone. Maybe keep a spare umbrella at work?"),
    "The grocery store was out of bread.": (
        "That is annoying. Did you find bread somewhere else?",
        "Maybe it is a sign to try baking bread at home?"),
    "I have an appointment next week that I keep forgetting about.": (
        "Want to set a reminder for the appointment?", "It helps to write it down. What day is the appointment?"),
    "I need to fix the fence in the backyard.": (
        "Is the fence badly damaged?", "Fixing a fence is a good weekend job. Will you do it yourself?"),
    "There was a loud party down the street last night.": (
        "Did the noise keep you up?", "That sounds annoying. How late did the party go on?"),
    "I need to renew my passport soon.": (
        "Good idea to do it early. Are you planning to travel soon?",
        "Renewals can take a while. When does your passport expire?"),
    "I spent the evening answering emails.": (
        "That sounds tedious. Did you clear your inbox?", "Not the most fun evening. Were the emails for work?"),
    "I tried a new route for my morning walk.": (
        "Nice change! What did you see on the new route?", "How long was the new walk?"),
    "The power went out for an hour today.": (
        "That is inconvenient. Do you know what caused the outage?",
        "Did the power cut spoil anything in the fridge?"),
    "I am reading a long mystery novel.": (
        "I love a good mystery! Who do you think the culprit is?",
        "How far into the novel are you?"),
    "I cannot decide what to watch tonight.": (
        "Are you in the mood for a comedy or a thriller?", "How about a classic film you have seen before?"),
}
"""Engaged replies to each small-talk line of ``FILLER``."""

GREETINGS: tuple[tuple[str, str], ...] = (
    ("Hi, it's me again.", "Welcome back! What is on your mind?"),
    ("Hello! Do you have a minute to chat?", "Of course, I am happy to chat."),
    ("Hey, I'm back.", "Hi! How can I help today?"),
    ("Good morning!", "Good morning! What would you like to talk about?"),
)
"""Session openers; they also keep every session non-empty whatever the sampling."""

TINY_KEYS: tuple[str, ...] = (
    "cat", "dog", "sun", "box", "cup", "hat", "key", "map", "pen", "bed", "car", "egg",
    "fox", "jar", "owl", "pig", "bus", "cow", "bee", "ant", "bat", "rug", "toy", "van",
)
"""Key nouns of the tiny variant; the first num_keys of them are in use."""

OPTION_LETTERS: tuple[str, ...] = tuple("abcdefghij")
TINY_QUESTION_WORD = "recall"
TINY_FIXED_WORDS: tuple[str, ...] = ("User", TINY_QUESTION_WORD)
"""Words the tiny variant emits besides keys and letters ("User" is the chunk's role label)."""

VOCABULARY: tuple[str, ...] = TINY_FIXED_WORDS + OPTION_LETTERS + TINY_KEYS
"""Every word the tiny variant can emit (chunks, questions, choices), in a fixed order."""
TINY_WORDS = VOCABULARY


def _check_limits() -> None:
    """elasticmem.config checks SyntheticConfig against these tables' sizes, written there as
    numbers: refuse to run with tables that no longer match them."""
    from elasticmem import config as C

    sizes = {"SYNTHETIC_TINY_KEYS": len(TINY_KEYS), "SYNTHETIC_CATEGORIES": len(PERSONA_CATEGORIES),
             "SYNTHETIC_VALUE_POOL": min(len(c.values) for c in PERSONA_CATEGORIES),
             "SYNTHETIC_RELATIONS": len(RELATIONS), "SYNTHETIC_PERSON_NAMES": len(PERSON_NAMES),
             "SYNTHETIC_FILLER": len(FILLER)}
    wrong = {k: (getattr(C, k), v) for k, v in sizes.items() if getattr(C, k) != v}
    if wrong:
        raise ImportError(f"elasticmem.config's synthetic limits disagree with the tables of {__name__} "
                          f"(config, tables): {wrong}")


_check_limits()


# --------------------------------------------------------------------------- building blocks


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


def _shuffled_choices(gold: str, wrong: Sequence[str], rng: random.Random) -> tuple[list[str], int]:
    choices = [gold, *wrong]
    rng.shuffle(choices)
    return choices, choices.index(gold)


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


def _history_examples(cfg: SyntheticConfig, seed: int, h: int) -> list[Example]:
    # One rng per history (seeded by a string, which Python hashes deterministically),
    # so a history does not change when num_histories or the fractions do.
    rng = random.Random(f"elasticmem-synthetic/{cfg.variant}/{seed}/{h}")
    if cfg.variant == "tiny":
        history, questions = _tiny_history(cfg, rng)
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
            extra={"evidence": [list(e) for e in q.evidence]},
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
        out[split] = [ex for h in range(start, start + n) for ex in _history_examples(cfg, seed, h)]
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
        "config": dataclasses.asdict(cfg),
        "splits": {split: split_stats(examples) for split, examples in splits.items()},
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    return stats
