"""A-Mem's prompts and answer schemas, written from the paper's description (sections 3.1-3.4).

* ``P_s1`` note construction: keywords, tags and a one-sentence context for a new interaction;
* ``P_s2`` + ``P_s3`` in one decision (as the public implementation does): given the new note and
  its nearest notes, whether to evolve, which neighbours to link (``strengthen``, with the new
  note's updated tags) and the neighbours' new context and tags (``update_neighbor``, one entry
  per neighbour, in the listed order);
* query keyword expansion (optional) and the answer prompts (free-form and multiple choice).

Neighbours are shown with their note ids and the decision may only name those ids (an ``Enum``
in the schema): links are stored by id, never by position.

Each prompt carries a one-line worked example of the exact output format; small local models
follow an example far better than a schema description.
"""

from __future__ import annotations

from collections.abc import Sequence

from elasticmem.baselines.amem.config import AMemConfig
from elasticmem.baselines.amem.notes import Note
from elasticmem.llm.structured import Arr, Bool, Enum, Obj, Str, canonical

Messages = list[dict[str, str]]

NOTE_EXAMPLE_CONTEXT = "Alice tells that she adopted a puppy called Max the weekend before 2 June 2023."
EVOLVE_EXAMPLE_CONTEXTS = ("Alice talks about wanting a dog, which she later adopted (Max).",
                           "Bob describes his new job at a bakery.")
# Small models copy the worked examples verbatim: a context may not begin like an example sentence.
EXAMPLE_PREFIXES = tuple(" ".join(t.lower().split()[:3]) for t in (NOTE_EXAMPLE_CONTEXT, *EVOLVE_EXAMPLE_CONTEXTS))

NOTE_SYSTEM = """You write notes for a memory. Read one interaction and its time, and answer with a JSON object:
- "keywords": specific key terms from the content (names of things, activities, places), most important first; not the speaker's name and not the time;
- "context": one sentence saying what the interaction is about and who it concerns;
- "tags": broad categories to file the note under (topic, domain, kind of event).
Example:
Time: 3 pm on 2 June, 2023
Content: Alice: I adopted a puppy named Max last weekend!
Answer: """ + canonical({
    "keywords": ["puppy", "Max", "adoption"],
    "context": NOTE_EXAMPLE_CONTEXT,
    "tags": ["pets", "family", "life event"],
})

EVOLVE_SYSTEM = """You organise a memory of notes. A new note arrives together with its most similar existing notes (its neighbours), each shown with its id. Decide, as a JSON object:
- "should_evolve": true if the new note is related to any neighbour, else false;
- "actions": what to do when it evolves: "strengthen" to link the new note to related neighbours, "update_neighbor" to refresh the neighbours' context and tags with what the new note adds;
- "suggested_connections": the ids of the neighbours to link the new note to;
- "tags_to_update": the new note's tags after linking;
- "new_context_neighborhood": one context sentence per neighbour, in the order listed (repeat a neighbour's current context to leave it unchanged);
- "new_tags_neighborhood": one list of tags per neighbour, in the order listed (repeat its current tags to leave them unchanged).
Example with neighbours n4 and n9:
Answer: """ + canonical({
    "should_evolve": True,
    "actions": ["strengthen", "update_neighbor"],
    "suggested_connections": ["n4"],
    "tags_to_update": ["pets", "family"],
    "new_context_neighborhood": list(EVOLVE_EXAMPLE_CONTEXTS),
    "new_tags_neighborhood": [["pets", "plans"], ["work", "food"]],
})

LINK_SYSTEM = """You organise a memory of notes. A new note arrives together with its most similar existing notes (its neighbours), each shown with its id. Decide, as a JSON object:
- "should_evolve": true if the new note is related to any neighbour, else false;
- "actions": ["strengthen"] to link the new note to related neighbours, or [] to do nothing;
- "suggested_connections": the ids of the neighbours to link the new note to;
- "tags_to_update": the new note's tags after linking.
Example with neighbours n4 and n9:
Answer: """ + canonical({
    "should_evolve": True, "actions": ["strengthen"], "suggested_connections": ["n4"],
    "tags_to_update": ["pets", "family"],
})

EXPAND_SYSTEM = """You help search a memory. Give the keywords to search for to answer the question, as a JSON object.
Example:
Question: What did Alice name her puppy?
Answer: """ + canonical({"keywords": ["Alice", "puppy", "name"]})

ANSWER_SYSTEM = """You answer a question about a long conversation, using memory notes taken from it. Each note has the time it was said. Answer with a short phrase, using exact words from the notes where possible; for a question about when something happened, give the date worked out from the note's time. If the notes do not contain the answer, reply exactly: {not_answerable}"""

MC_SYSTEM = """You answer a question about a long conversation, using memory notes taken from it. Each note has the time it was said. Pick the correct option and reply with its letter only, e.g. (b)."""


# --------------------------------------------------------------------------- schemas


def note_schema(cfg: AMemConfig) -> Obj:
    item = Str(1, cfg.max_item_chars)
    return Obj((
        ("keywords", Arr(item, 1, cfg.max_keywords)),
        ("context", Str(1, cfg.max_context_chars, banned_prefixes=EXAMPLE_PREFIXES)),
        ("tags", Arr(item, 1, cfg.max_tags)),
    ))


def decision_schema(cfg: AMemConfig, neighbour_ids: Sequence[str], note_id: str | None = None) -> Obj:
    """The link/evolution decision for these neighbours; lengths and ids are part of the schema.

    Contexts and tags may not be bare note ids, nor contexts the worked example's sentences (small
    models copy both from the prompt).
    """
    n = len(neighbour_ids)
    ids_text = frozenset(i.lower() for i in [*neighbour_ids, *([note_id] if note_id else [])])
    item = Str(1, cfg.max_item_chars, ids_text)
    ids = Enum(tuple(neighbour_ids))
    if not cfg.memory_evolution:
        return Obj((
            ("should_evolve", Bool()),
            ("actions", Arr(Enum(("strengthen",)), 0, 1)),
            ("suggested_connections", Arr(ids, 0, n)),
            ("tags_to_update", Arr(item, 0, cfg.max_tags)),
        ))
    return Obj((
        ("should_evolve", Bool()),
        ("actions", Arr(Enum(("strengthen", "update_neighbor")), 0, 2)),
        ("suggested_connections", Arr(ids, 0, n)),
        ("tags_to_update", Arr(item, 0, cfg.max_tags)),
        ("new_context_neighborhood", Arr(Str(1, cfg.max_context_chars, ids_text, EXAMPLE_PREFIXES), n, n)),
        ("new_tags_neighborhood", Arr(Arr(item, 0, cfg.max_tags), n, n)),
    ))


def expansion_schema(cfg: AMemConfig) -> Obj:
    return Obj((("keywords", Arr(Str(1, cfg.max_item_chars), 1, cfg.max_keywords)),))


# --------------------------------------------------------------------------- messages


def note_messages(content: str, timestamp: str) -> Messages:
    return [
        {"role": "system", "content": NOTE_SYSTEM},
        {"role": "user", "content": f"Time: {timestamp or 'unknown'}\nContent: {content}"},
    ]


def _note_block(note: Note) -> str:
    return (f"time: {note.timestamp} | content: {note.content} | context: {note.context} | "
            f"keywords: {', '.join(note.keywords)} | tags: {', '.join(note.tags)}")


def decision_messages(cfg: AMemConfig, note: Note, neighbours: Sequence[Note]) -> Messages:
    system = EVOLVE_SYSTEM if cfg.memory_evolution else LINK_SYSTEM
    lines = [f"New note: {_note_block(note)}", "", f"Neighbours ({len(neighbours)}):"]
    lines += [f"[{nb.id}] {_note_block(nb)}" for nb in neighbours]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(lines)}]


def expansion_messages(question: str) -> Messages:
    return [{"role": "system", "content": EXPAND_SYSTEM}, {"role": "user", "content": f"Question: {question}"}]


def memory_block(notes: Sequence[Note], fields: Sequence[str]) -> str:
    """The retrieved notes as the answer prompt shows them, one per line."""
    return "\n".join(f"- {n.render(fields)}" for n in notes)


def answer_messages(cfg: AMemConfig, question: str, memories: str, choices: Sequence[str] = ()) -> Messages:
    """Free-form when ``choices`` is empty, else multiple choice with options (a), (b), ..."""
    mem = memories if memories else "(no notes)"
    if choices:
        options = "\n".join(f"({chr(ord('a') + i)}) {c}" for i, c in enumerate(choices))
        user = f"Memory notes:\n{mem}\n\nQuestion: {question}\nOptions:\n{options}\nAnswer:"
        return [{"role": "system", "content": MC_SYSTEM}, {"role": "user", "content": user}]
    user = f"Memory notes:\n{mem}\n\nQuestion: {question}\nShort answer:"
    return [{"role": "system", "content": ANSWER_SYSTEM.format(not_answerable=cfg.not_answerable)},
            {"role": "user", "content": user}]
