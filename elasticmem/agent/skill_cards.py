"""Skill cards: an LLM distils each memory-pool expert trajectory into a short procedure.

    python -m elasticmem.agent.skill_cards runs/alfworld/trajectories.jsonl \
        --ids runs/alfworld/pools/memory_ids.txt --out runs/alfworld/cards.jsonl \
        [--backend transformers --model smollm2 | --backend openai --model NAME --api-base URL]

A card (the paper's appendix F.2, reference settings): temperature 0.2, at most 512 new tokens,
the trajectory cut to 6,000 characters; 150-250 words; a first line "Task type: ... Objective
pattern: ...", then 3-6 numbered steps that generalise over object names and say why each
receptacle matters, without copying the trajectory. Checked besides: prose (letters and spaces),
not repetitive, not a copy of the prompt's worked example. A card that breaks a rule is asked for
again (``retries`` times, other sampling seeds); after that the deterministic ``fallback_card``
is used and counted.

Small local models do not hold that format as free text (SmolLM2-135M copies the trajectory), so
the card is asked for as a JSON object (task type, objective pattern, 3-6 steps with a length
range each) through the A-Mem baseline's structured output: its constrained decoder for local
models, JSON-schema output for servers. The object is rendered in the reference's format and
the rules are checked on the rendered card. Cards are cached by a hash of everything that determines them (model,
prompt, settings), so a rerun generates only what is missing or changed; each card is appended
as soon as its batch is done. The card's retrieval text is ``"[{task_type}] {card}"``.
The LLM backends are the A-Mem baseline's (local transformers or an OpenAI-compatible server).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from elasticmem.agent.trajectories import read_records
from elasticmem.llm.client import GenRequest, LLMBackend
from elasticmem.llm.structured import Arr, Obj, Str, check, parse_json_object

SYSTEM = (
    "You write skill cards for a household robot. A skill card is a short, general procedure "
    "learned from one solved task, to help with similar tasks later."
)
# A worked example in the requested layout, for another task type than most trajectories (small
# models follow an example far better than a description of the format).
EXAMPLE = {
    "task_type": "cool then place",
    "objective_pattern": "cool some <object> and put it in <receptacle>.",
    "steps": [
        "Search the places where the target object is usually kept: countertops, the dining table and "
        "the cabinets for food and dishes. Open closed cabinets and drawers, since their contents are "
        "hidden until they are opened, and look at each surface before moving on.",
        "Take the target object as soon as you see it, from the receptacle it is on. Carry only one "
        "object, because the hands can hold a single item and the later steps need it in hand.",
        "Go to the fridge and cool the object with it. The fridge is the only appliance that cools, so "
        "there is no need to open it first or to put the object inside; the cool command does both.",
        "Go to the destination receptacle named in the objective and put the cooled object in or on it. "
        "Open it first if it is closed, because a closed receptacle accepts nothing.",
    ],
}

INSTRUCTIONS = """Below is a solved task: its objective and the actions that solved it, each followed by what was observed.

Task type: {task_type}
Objective: {objective}
Solution:
{trajectory}

Write a skill card of {min_words} to {max_words} words for tasks of this kind, as JSON:
{{"task_type": the kind of task in a few words, "objective_pattern": the objective with the object and receptacle replaced by <object> and <receptacle>, "steps": {min_steps} to {max_steps} steps of the general procedure, each two or three sentences}}
- Generalise: say "the target object" and "the destination receptacle", not "potato 2" or "cabinet 4".
- For each receptacle or appliance, say why it matters (where such objects are usually found, what it does to the object).
- Do not copy the actions; explain the procedure.

An example card for another kind of task:
{example}"""


@dataclass(frozen=True)
class CardSettings:
    """Everything besides the trajectory that determines a card (hashed into its cache key)."""

    temperature: float = 0.2
    max_new_tokens: int = 512
    max_chars: int = 6000
    """The trajectory text is cut to this many characters."""
    min_words: int = 150
    max_words: int = 250
    min_steps: int = 3
    max_steps: int = 6
    retries: int = 2
    """Further attempts (seeds 1, 2, ...) for a card that breaks a rule, before the fallback."""
    no_repeat_ngram: int = 0
    """A local model (``--backend transformers``) may not write an n-gram of this many tokens
    that is already in the prompt or the card: no loops, no copied spans of the trajectory or
    the worked example. 0 = off (servers ignore it)."""


def trajectory_text(record: dict[str, Any], max_chars: int = 6000) -> str:
    """``> action`` / observation lines of a trajectory, cut to ``max_chars`` characters."""
    lines = [f"> {s['action']}\n{s['observation']}" for s in record["steps"]]
    return "\n".join(lines)[:max_chars]


def card_schema(s: CardSettings) -> Obj:
    """The card's JSON layout: a task type, an objective pattern and a number of steps of a
    length range (in characters) such that the fewest steps at their shortest, in long words, and
    the most at their longest, in short words, both land inside the word range: the widest
    step-count range within ``min_steps..max_steps`` that allows it. The word count itself is
    checked on the rendered card."""
    head, long_word, short_word = 25, 6, 5  # words of the rendered first line; characters a word + space
    best = None
    for a in range(s.min_steps, s.max_steps + 1):
        for b in range(a, s.max_steps + 1):
            # n steps of w words render to head + n * (1 + w) words ("1." is one)
            lo = long_word * -(-(s.min_words - head - a) // a)
            hi = short_word * ((s.max_words - head - b) // b) - 1
            if lo <= hi and (best is None or (b - a, hi - lo) > (best[1] - best[0], best[3] - best[2])):
                best = (a, b, max(20, lo), max(20, hi))
    if best is None:
        raise ValueError(f"no step count in {s.min_steps}-{s.max_steps} fits {s.min_words}-{s.max_words} words")
    a, b, lo, hi = best
    # the worked example's own sentences may not be copied (small models do)
    copied = tuple(step[:24].lower() for step in EXAMPLE["steps"])
    return Obj((("task_type", Str(3, 60, exclude=frozenset({EXAMPLE["task_type"]}))),
                ("objective_pattern", Str(10, 160, exclude=frozenset({EXAMPLE["objective_pattern"]}))),
                ("steps", Arr(Str(lo, hi, banned_prefixes=copied), a, b))))


def card_request(record: dict[str, Any], s: CardSettings) -> GenRequest:
    """The chat request that asks for one trajectory's card (a JSON object, see ``card_schema``)."""
    schema = card_schema(s)
    steps = schema.fields[2][1]
    user = INSTRUCTIONS.format(min_words=s.min_words, max_words=s.max_words, task_type=record["task_type"],
                               objective=record["objective"], trajectory=trajectory_text(record, s.max_chars),
                               min_steps=steps.min_items, max_steps=steps.max_items, example=json.dumps(EXAMPLE))
    return GenRequest([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                      max_new_tokens=s.max_new_tokens, schema=schema, kind="skill_card",
                      no_repeat_ngram=s.no_repeat_ngram)


def render_card(value: dict[str, Any]) -> str:
    """The reference's card format from the JSON object."""
    lines = [f"Task type: {value['task_type'].strip().rstrip('.')}. Objective pattern: "
             f"{value['objective_pattern'].strip()}"]
    lines += [f"{i}. {step.strip()}" for i, step in enumerate(value["steps"], 1)]
    return "\n".join(lines)


def card_from_output(text: str, schema: Obj) -> tuple[str | None, list[str]]:
    """(the rendered card, []) from an LLM output, or (None, why not)."""
    try:
        value = parse_json_object(text)
    except ValueError as e:
        return None, [f"not a JSON object: {e}"]
    errors = check(schema, value)
    return (None, errors) if errors else (render_card(value), [])


_STEP = re.compile(r"^\s*(\d+)[.)]\s+\S")


def card_errors(card: str, s: CardSettings) -> list[str]:
    """The rules ``card`` breaks (empty when it is a valid card)."""
    errors = []
    lines = [line for line in card.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("Task type:") or "Objective pattern:" not in lines[0]:
        errors.append("the first line is not 'Task type: ... Objective pattern: ...'")
    steps = [int(m.group(1)) for line in lines[1:] if (m := _STEP.match(line))]
    if not s.min_steps <= len(steps) <= s.max_steps or steps != list(range(1, len(steps) + 1)):
        errors.append(f"{len(steps)} numbered steps {steps}, not {s.min_steps}-{s.max_steps} numbered from 1")
    words = len(card.split())
    if not s.min_words <= words <= s.max_words:
        errors.append(f"{words} words, not {s.min_words}-{s.max_words}")
    letters = sum(c.isalpha() or c.isspace() for c in card)
    if letters < 0.9 * len(card):
        errors.append(f"only {letters / max(1, len(card)):.0%} letters and spaces: not prose")
    grams = card.lower().split()
    trigrams = [tuple(grams[i : i + 3]) for i in range(len(grams) - 2)]
    if trigrams and len(set(trigrams)) < 0.8 * len(trigrams):
        errors.append(f"repetitive: {len(set(trigrams))} distinct of {len(trigrams)} word 3-grams")
    shared = _ngrams(card) & _example_ngrams()
    if len(shared) > 0.2 * max(1, len(_ngrams(card))):
        errors.append(f"{len(shared)} word 5-grams copied from the worked example")
    return errors


@functools.cache
def _example_ngrams() -> frozenset[tuple[str, ...]]:
    return frozenset(_ngrams(render_card(EXAMPLE)))


def _ngrams(text: str, n: int = 5) -> set[tuple[str, ...]]:
    w = text.lower().split()
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


_ID = re.compile(r"\s+\d+\b")
_SEARCH = ("go to", "look", "inventory", "examine", "help", "open", "close")


def fallback_card(record: dict[str, Any]) -> str:
    """A card built without the LLM: the objective and the expert's actions on objects, with the
    object numbers removed (moving, looking and opening or closing while searching left out).
    Used (and counted) when the LLM's cards keep breaking the rules."""
    actions = []
    for step in record["steps"]:
        a = _ID.sub("", step["action"])
        if not a.startswith(_SEARCH) and a not in actions:
            actions.append(a)
    lines = [f"Task type: {record['task_type']}. Objective pattern: {record['objective']}"]
    lines += [f"{i}. Find the receptacle that holds what is needed, then {a}." for i, a in enumerate(actions, 1)]
    return "\n".join(lines)


def card_key(request: GenRequest, s: CardSettings, model: str) -> str:
    """The cache key of a card: a hash of the model, the request and the settings."""
    settings = asdict(s)
    if not settings["no_repeat_ngram"]:  # off: the keys of caches written before the setting existed
        del settings["no_repeat_ngram"]
    blob = json.dumps({"model": model, "messages": request.messages, "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def retrieval_text(card: dict[str, Any]) -> str:
    """What the bank encodes for a card (the reference code's format)."""
    return f"[{card['task_type']}] {card['card']}"


def write_cards(records: Sequence[dict[str, Any]], backend: LLMBackend | None, out: str | Path,
                settings: CardSettings = CardSettings(), model: str = "", batch_size: int = 8,
                progress: bool = True) -> list[dict[str, Any]]:
    """A card for each trajectory, appended to ``out`` batch by batch; cached cards are kept.

    Returns the cards of ``records`` in their order: ``game_id``, ``task_type``, ``card``,
    ``text`` (the retrieval text), ``attempts``, ``fallback``, ``errors`` (of the last LLM
    attempt when it fell back), ``words``, ``key``. ``backend`` None: no LLM, every card is the
    deterministic ``fallback_card`` (for runs without an instruction model able to write cards)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = model or getattr(backend, "name", "") or "fallback"
    cached = {c["key"]: c for c in read_records(out)}
    requests = [card_request(r, settings) for r in records]
    keys = [card_key(q, settings, model) for q in requests]
    todo = [i for i, k in enumerate(keys) if k not in cached]
    if cached:  # rewrite without a truncated tail so appends start on a fresh line
        out.write_text("".join(json.dumps(c) + "\n" for c in cached.values()))
    bar = tqdm(total=len(todo), desc="skill cards", unit="card", disable=not progress)
    with out.open("a") as f:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            pending, last, attempts = list(batch), {}, {i: 0 for i in batch}
            cards: dict[int, str] = {}
            for attempt in range(settings.retries + 1 if backend is not None else 0):
                if not pending:
                    break
                outs = backend.generate([requests[i] for i in pending], temperature=settings.temperature, seed=attempt)
                still = []
                for i, o in zip(pending, outs):
                    attempts[i] += 1
                    card, errors = card_from_output(o.text, requests[i].schema)
                    if card is not None:
                        errors = card_errors(card, settings)
                    if errors:
                        last[i] = errors
                        still.append(i)
                    else:
                        cards[i] = card
                pending = still
            for i in batch:
                rec = records[i]
                fallback = i not in cards
                card = fallback_card(rec) if fallback else cards[i]
                entry = {"game_id": rec["game_id"], "task_type": rec["task_type"], "card": card,
                         "attempts": attempts[i], "fallback": fallback, "errors": last.get(i, []) if fallback else [],
                         "words": len(card.split()), "key": keys[i]}
                entry["text"] = retrieval_text(entry)
                cached[keys[i]] = entry
                f.write(json.dumps(entry) + "\n")
            f.flush()
            bar.update(len(batch))
    bar.close()
    return [cached[k] for k in keys]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m elasticmem.agent.skill_cards",
                                description="Write a skill card for each memory-pool trajectory.")
    p.add_argument("trajectories", help="JSONL from `python -m elasticmem.agent.trajectories collect`")
    p.add_argument("--ids", help="memory_ids.txt from `... trajectories split` (default: every successful one)")
    p.add_argument("--out", required=True, help="cards JSONL (resumes; cached by content)")
    p.add_argument("--backend", choices=["transformers", "openai", "fallback"], default="transformers",
                   help="'fallback': no LLM, every card built from the expert's actions (fallback_card)")
    p.add_argument("--model", default="smollm2", help="elasticmem model name/path, or the server's model name")
    p.add_argument("--api-base", default="http://localhost:8000/v1", help="OpenAI-compatible server (--backend openai)")
    p.add_argument("--batch-size", type=int, default=8)
    for f in CardSettings.__dataclass_fields__.values():
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    a = p.parse_args(argv)
    from elasticmem.config import AMemLLMConfig
    from elasticmem.llm.client import OpenAIBackend, TransformersBackend

    records = read_records(a.trajectories)
    if a.ids:
        wanted = Path(a.ids).read_text().split()
        by_id = {r["game_id"]: r for r in records}
        missing = [i for i in wanted if i not in by_id]
        if missing:
            raise SystemExit(f"{len(missing)} ids of {a.ids} are not in {a.trajectories}, e.g. {missing[:3]}")
        records = [by_id[i] for i in wanted]
    else:
        records = [r for r in records if r.get("success")]
    settings = CardSettings(**{k: getattr(a, k) for k in CardSettings.__dataclass_fields__})
    if a.backend == "fallback":
        backend, model = None, "fallback"
    else:
        cfg = AMemLLMConfig(backend=a.backend, model=a.model, api_base=a.api_base, batch_size=a.batch_size)
        backend = TransformersBackend.from_config(cfg) if a.backend == "transformers" else OpenAIBackend(cfg)
        model = a.model
    cards = write_cards(records, backend, a.out, settings, model=model, batch_size=a.batch_size)
    fell = sum(c["fallback"] for c in cards)
    print(f"{a.out}: {len(cards)} cards, {fell} fallbacks ({fell / max(1, len(cards)):.1%})", file=sys.stderr)


if __name__ == "__main__":
    main()
