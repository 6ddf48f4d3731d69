"""LoCoMo (Maharana et al., 2024) in the shared example schema: free-form QA and MC-10.

Three ways in (``python -m elasticmem.data.prepare DATASET --input PATH --out DIR``):

* ``locomo-qa`` reads the original ``locomo10.json`` and writes every QA item
  as a free-form example (``choices: []``, ``answer_index: -1``, the answer in
  ``answer_text``) for A-Mem-style F1/BLEU scoring. ``question_type`` is the
  category name (1 multi_hop, 2 temporal, 3 open_domain, 4 single_hop,
  5 adversarial; the number stays in ``category``). Adversarial items have no
  ``answer`` but an ``adversarial_answer`` (the tempting wrong one, kept in the
  extra field of that name); their ``answer_text`` is the correct behaviour,
  ``ADVERSARIAL_ANSWER``, except for the 2 items that do carry an ``answer``,
  which keep it.
* ``locomo-mc10`` builds 10-way multiple choice from the same file,
  deterministic by seed: the gold answer plus 9 distractors drawn from the
  answers to other questions of the same category in the same conversation,
  then (when too few distinct ones exist) of the same category in the whole
  dataset, then of any category. Adversarial items are left out (they have no
  gold answer to choose) and counted in ``stats.json``.
* ``locomo-mc10-jsonl`` reads the published MC-10 JSONL (Percena
  ``locomo-mc10``: ``question_id, question, choices[10], correct_choice_index,
  question_type, haystack_sessions``, one object a line) as is.

Histories: one session per ``session_N`` in N order, each turn with
``speaker`` = the speaker's name and ``date`` = the session's
``session_N_date_time``; ``speaker_a`` speaks as "user", ``speaker_b`` as
"assistant", so chunking pairs their turns. Image turns keep their caption:
``"{text} [shares a photo: {blip_caption}]"``. The bank group is the
conversation (``sample_id``); the split is 6/2/2 conversations by sorted id.

    pytest tests/unit/test_data_locomo.py
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from elasticmem.data.hub import Table, jsonl_records, label, open_input
from elasticmem.data.schema import Example, Turn
from elasticmem.data.sources import (
    DataError,
    SkipLog,
    history_digest,
    load_json_file,
    need,
    read_mc10_record,
    require_file,
    run_prepare,
    split_sorted,
)

SOURCE = "locomo"
CATEGORY_NAMES = {1: "multi_hop", 2: "temporal", 3: "open_domain", 4: "single_hop", 5: "adversarial"}
ADVERSARIAL = 5
ADVERSARIAL_ANSWER = "Not mentioned in the conversation"
"""Reference answer of an adversarial question: the conversation does not say."""
SPLIT_FRACTIONS = (0.6, 0.2, 0.2)
"""6/2/2 of the 10 conversations, in sorted id order (reference code, MemSkill convention)."""
NUM_CHOICES = 10
_SESSION_KEY = re.compile(r"session_(\d+)")
_DIA_ID = re.compile(r"D(\d+):(\d+)")


@dataclass
class QA:
    index: int
    """Position in the conversation's ``qa`` list (the question id is ``{sample_id}_q{index}``)."""
    question: str
    category: int
    answer: str | None
    adversarial_answer: str | None
    evidence: list[str]
    where: str


@dataclass
class Conversation:
    sample_id: str
    history: list[list[Turn]]
    dia_index: dict[str, tuple[int, int]]
    """dia_id ("D3:7") -> (session index, turn index) in ``history``."""
    path: Path | str
    """The file (or dataset spec) it was read from (errors name it)."""
    where: str
    qa: list[QA] = field(default_factory=list)


# --------------------------------------------------------------------------- reading


def image_text(turn: dict[str, Any]) -> str:
    """The turn's text, with the caption of a shared image appended (the image itself is lost)."""
    text = turn["text"]
    caption = turn.get("blip_caption")
    if isinstance(caption, str) and caption.strip():
        shared = f"[shares a photo: {caption.strip()}]"
        return f"{text} {shared}" if text.strip() else shared
    return text


def conversation_history(conv: dict[str, Any], path: Path | str, where: str) -> tuple[list[list[Turn]], dict[str, tuple[int, int]]]:
    """Sessions in N order with speaker names and session dates; dia_id -> position."""
    speaker_a = need(conv, "speaker_a", str, path, where)
    speaker_b = need(conv, "speaker_b", str, path, where)
    roles = {speaker_a: "user", speaker_b: "assistant"}
    numbers = sorted(int(m.group(1)) for k in conv if (m := _SESSION_KEY.fullmatch(k)))
    history: list[list[Turn]] = []
    dia_index: dict[str, tuple[int, int]] = {}
    for n in numbers:
        key = f"session_{n}"
        raw = conv[key]
        if not isinstance(raw, list):
            raise DataError(path, where, f"conversation.{key}", f"must be a list of turns, got {type(raw).__name__}",
                            "bad_field")
        date = conv.get(f"{key}_date_time")
        date = str(date) if date is not None else None
        session: list[Turn] = []
        for ti, t in enumerate(raw):
            tw = f"conversation.{key}[{ti}]"
            if not isinstance(t, dict):
                raise DataError(path, where, tw, f"must be an object, got {type(t).__name__}", "bad_field")
            for k in ("speaker", "text"):
                if not isinstance(t.get(k), str):
                    raise DataError(path, where, f"{tw}.{k}", "missing or not a string", "bad_field")
            if t["speaker"] not in roles:
                raise DataError(path, where, f"{tw}.speaker", f"{t['speaker']!r} is neither speaker_a "
                                f"({speaker_a!r}) nor speaker_b ({speaker_b!r})", "bad_field")
            if isinstance(t.get("dia_id"), str):
                dia_index[t["dia_id"]] = (len(history), ti)
            session.append(Turn(roles[t["speaker"]], image_text(t), date, t["speaker"]))
        history.append(session)
    if not any(history):
        raise DataError(path, where, "conversation", "has no session_N with turns", "empty_history")
    return history, dia_index


def parse_qa(raw: Any, path: Path | str, where: str, index: int) -> QA:
    """One ``qa`` item; answers that are numbers (6 in locomo10.json) become strings."""
    w = f"{where} qa[{index}]"
    if not isinstance(raw, dict):
        raise DataError(path, w, None, f"expected an object, got {type(raw).__name__}", "bad_record")
    question = need(raw, "question", str, path, w)
    category = need(raw, "category", int, path, w)
    if category not in CATEGORY_NAMES:
        raise DataError(path, w, "category", f"{category} is not one of {sorted(CATEGORY_NAMES)}", "bad_field")
    answer = raw.get("answer")
    if isinstance(answer, bool) or (answer is not None and not isinstance(answer, (str, int, float))):
        raise DataError(path, w, "answer", f"must be a string or number, got {type(answer).__name__}", "bad_field")
    answer = str(answer).strip() if answer is not None else None
    adversarial = raw.get("adversarial_answer")
    adversarial = str(adversarial) if adversarial is not None else None
    if category != ADVERSARIAL and not answer:
        raise DataError(path, w, "answer", f"missing or empty (category {category} needs one)", "missing_field")
    evidence = raw.get("evidence") or []
    if not isinstance(evidence, list):
        evidence = [evidence]
    return QA(index, question, category, answer, adversarial, [str(e) for e in evidence], w)


def _items(src: Path | Table) -> Iterator[tuple[str, Any]]:
    """("item I", conversation) of ``locomo10.json``, or ("row I", conversation) of a dataset."""
    if isinstance(src, Table):
        return src.rows()
    data = load_json_file(src)
    if not isinstance(data, list):
        raise DataError(src, "", None, f"expected a JSON list of conversations (locomo10.json), got a "
                        f"{type(data).__name__}; an MC-10 JSONL file goes to `prepare locomo-mc10-jsonl`",
                        "not_json_list")
    return ((f"item {i}", item) for i, item in enumerate(data))


def read_locomo(path: str | Path | Table, skips: SkipLog) -> list[Conversation]:
    """Conversations of ``locomo10.json`` (or of a dataset holding its items, one a row) in order;
    invalid ones or QA items go to ``skips``."""
    src = path if isinstance(path, Table) else require_file(path, "LoCoMo file (locomo10.json)")
    path = label(src)
    out = []
    for item_where, item in _items(src):
        where = item_where
        try:
            if not isinstance(item, dict):
                raise DataError(path, where, None, f"expected an object, got {type(item).__name__}", "bad_record")
            sample_id = str(need(item, "sample_id", (str, int), path, where,
                                 "is this locomo10.json? its items have sample_id, conversation, qa"))
            where = f"{item_where} ({sample_id})"
            conv = need(item, "conversation", dict, path, where)
            qa_raw = need(item, "qa", list, path, where)
            history, dia_index = conversation_history(conv, path, where)
        except DataError as e:
            skips.handle(e)
            continue
        c = Conversation(sample_id, history, dia_index, path, where)
        for qi, q in enumerate(qa_raw):
            try:
                c.qa.append(parse_qa(q, path, where, qi))
            except DataError as e:
                skips.handle(e)
        out.append(c)
    return out


def evidence_positions(conv: Conversation, evidence: Sequence[str]) -> list[list[int]]:
    """[session, turn] of each dia_id named in the evidence strings (some list several, "D8:6; D9:17")."""
    out = []
    for e in evidence:
        for m in _DIA_ID.finditer(e):
            pos = conv.dia_index.get(f"D{m.group(1)}:{m.group(2)}")
            if pos is not None and list(pos) not in out:
                out.append(list(pos))
    return out


def _base(conv: Conversation, qa: QA) -> dict[str, Any]:
    extra: dict[str, Any] = {"category": qa.category, "evidence_dia_ids": qa.evidence,
                             "evidence": evidence_positions(conv, qa.evidence)}
    if qa.adversarial_answer is not None:
        extra["adversarial_answer"] = qa.adversarial_answer
    return {"id": f"{conv.sample_id}_q{qa.index}", "source": SOURCE, "question": qa.question,
            "question_type": CATEGORY_NAMES[qa.category], "history": conv.history, "group": conv.sample_id,
            "extra": extra}


# --------------------------------------------------------------------------- free-form QA


def qa_example(conv: Conversation, qa: QA) -> Example:
    """A free-form example; adversarial items answer ``ADVERSARIAL_ANSWER`` unless the file gives one."""
    answer = qa.answer or (ADVERSARIAL_ANSWER if qa.category == ADVERSARIAL else "")
    return Example(choices=[], answer_index=-1, answer_text=answer, **_base(conv, qa))


# --------------------------------------------------------------------------- MC-10


@functools.lru_cache(maxsize=65536)
def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD-style), to compare answers."""
    s = s.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(w for w in s.split() if w not in ("a", "an", "the"))


def _clashes(candidate: str, gold: str) -> bool:
    """A candidate equal to the gold, or containing it / contained in it as whole words ("2022" vs
    "in 2022"), could also be right: it must not be a distractor."""
    c, g = normalize_answer(candidate), normalize_answer(gold)
    if not c or c == g:
        return True
    return bool(g) and (f" {g} " in f" {c} " or f" {c} " in f" {g} ")


def distractor_pools(convs: Sequence[Conversation]) -> tuple[dict[tuple[str, int], list[str]], dict[int, list[str]], list[str]]:
    """Distinct answers (first-seen order) per (conversation, category), per category, and overall."""
    by_conv: dict[tuple[str, int], list[str]] = {}
    by_cat: dict[int, list[str]] = {}
    every: list[str] = []
    for conv in convs:
        for qa in conv.qa:
            if qa.category == ADVERSARIAL or not qa.answer:
                continue
            for pool in (by_conv.setdefault((conv.sample_id, qa.category), []), by_cat.setdefault(qa.category, []),
                         every):
                if qa.answer not in pool:
                    pool.append(qa.answer)
    return by_conv, by_cat, every


def pick_distractors(gold: str, pools: Sequence[Sequence[str]], k: int, rng: random.Random) -> tuple[list[str], int]:
    """``k`` distractors, drawn from the first pool and topped up from the next ones.

    Returns the distractors and how many pools were used (1 = no fallback).
    Candidates that clash with the gold or normalise like an earlier pick are
    never drawn, so the choices are distinct and only the gold is right.
    """
    picked: list[str] = []
    taken = {normalize_answer(gold)}
    used = 0
    for pool in pools:
        if len(picked) == k:
            break
        used += 1
        cands: dict[str, str] = {}  # normalised -> first spelling in the pool
        for c in pool:
            n = normalize_answer(c)
            if n not in taken and n not in cands and not _clashes(c, gold):
                cands[n] = c
        take = rng.sample(list(cands.values()), min(k - len(picked), len(cands)))
        picked += take
        taken.update(normalize_answer(c) for c in take)
    return picked, used


def mc10_examples(convs: Sequence[Conversation], seed: int, counts: dict[str, Any],
                  skips: SkipLog | None = None) -> Iterator[Example]:
    """MC-10 examples (adversarial items left out and counted in ``counts``); deterministic by seed."""
    skips = skips or SkipLog()
    by_conv, by_cat, every = distractor_pools(convs)
    fallback = {1: "none", 2: "same_category_dataset", 3: "any_category_dataset"}
    counts.setdefault("excluded", {}).setdefault("adversarial", 0)
    counts.setdefault("distractor_fallback", {v: 0 for v in fallback.values()})
    for conv in convs:
        for qa in conv.qa:
            if qa.category == ADVERSARIAL:
                counts["excluded"]["adversarial"] += 1
                continue
            gold = qa.answer or ""
            # One rng per question: adding or removing questions elsewhere changes nothing here.
            rng = random.Random(f"elasticmem-locomo-mc10/{seed}/{conv.sample_id}/{qa.index}")
            distractors, used = pick_distractors(
                gold, [by_conv.get((conv.sample_id, qa.category), []), by_cat.get(qa.category, []), every],
                NUM_CHOICES - 1, rng)
            if len(distractors) < NUM_CHOICES - 1:
                skips.handle(DataError(conv.path, qa.where, "answer", f"only {len(distractors)} distinct distractors "
                                       "exist in the whole input; MC-10 needs 9", "too_few_distractors"))
                continue
            counts["distractor_fallback"][fallback[used]] += 1
            choices = [gold, *distractors]
            rng.shuffle(choices)
            yield Example(choices=choices, answer_index=choices.index(gold), answer_text=gold, **_base(conv, qa))


# --------------------------------------------------------------------------- prepare


def _group_of_mc10(obj: Any) -> str | None:
    """Conversation of a published MC-10 record: ``conversation_id``, else the prefix of a
    ``{conversation}_q{n}`` question id; None when neither exists (the haystack then decides)."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("conversation_id"), (str, int)):
        return str(obj["conversation_id"])
    m = re.fullmatch(r"(.+)_q\d+", str(obj.get("question_id", "")))
    return m.group(1) if m else None


def prepare_locomo(kind: str, inputs: Sequence[str | Path], out_dir: str | Path, *, seed: int = 42,
                   skip_invalid: bool = False, splits_dir: str | Path | None = None,
                   via_datasets: bool = False) -> dict[str, Any]:
    """Write ``locomo-qa`` / ``locomo-mc10`` / ``locomo-mc10-jsonl`` to OUT_DIR; returns stats.json's content.

    The input is a file, a folder or a Hub dataset (``hub.open_input``; ``via_datasets`` reads a
    local file through ``datasets`` too)."""
    if kind not in ("locomo-qa", "locomo-mc10", "locomo-mc10-jsonl"):
        raise ValueError(f"unknown LoCoMo kind {kind!r}")
    if len(inputs) != 1:
        raise ValueError(f"{kind} takes one --input file, got {len(inputs)}")
    src = open_input(inputs[0], "LoCoMo input", via_datasets)
    path = label(src)
    meta: dict[str, Any] = {
        "dataset": kind, "source": SOURCE, "seed": seed,
        "split": {"unit": "conversation", "rule": "6/2/2 conversations by sorted id",
                  "fractions": list(SPLIT_FRACTIONS)},
    }
    if kind == "locomo-qa":
        meta["adversarial_answer_text"] = ADVERSARIAL_ANSWER

    def examples(skips: SkipLog) -> Iterator[tuple[str, Example, Path | str, str]]:
        if kind == "locomo-mc10-jsonl":
            yield from _published_mc10(src, skips, meta)
            return
        convs = read_locomo(src, skips)
        if kind == "locomo-qa":
            for conv in convs:
                for qa in conv.qa:
                    yield conv.sample_id, qa_example(conv, qa), path, qa.where
        else:
            for ex in mc10_examples(convs, seed, meta, skips):
                yield ex.group, ex, path, f"question {ex.id}"

    return run_prepare(out_dir, [src], examples, lambda units: split_sorted(units, SPLIT_FRACTIONS), meta,
                       skip_invalid, splits_dir)


def _published_mc10(src: Path | Table, skips: SkipLog,
                    meta: dict[str, Any]) -> Iterator[tuple[str, Example, Path | str, str]]:
    """Records of the published JSONL; questions without a conversation id are grouped by haystack."""
    by_digest: dict[str, str] = {}
    path = label(src)
    for where, obj in jsonl_records(src, skips):
        try:
            group = _group_of_mc10(obj)
            ex = read_mc10_record(obj, path, where, SOURCE, group)
            if group is None:
                d = history_digest(ex.history)
                group = by_digest.setdefault(d, f"haystack-{d[:12]}")
                ex = dataclasses.replace(ex, group=group)
        except DataError as e:
            skips.handle(e)
            continue
        yield group, ex, path, where
    meta["groups_from_haystack"] = len(by_digest)


__all__ = [
    "ADVERSARIAL_ANSWER",
    "CATEGORY_NAMES",
    "QA",
    "Conversation",
    "mc10_examples",
    "pick_distractors",
    "prepare_locomo",
    "qa_example",
    "read_locomo",
]
