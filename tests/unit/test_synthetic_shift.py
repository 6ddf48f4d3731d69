"""Tests of the persona_shift synthetic variant (elasticmem.data.synthetic_shift) and of the byte-identity
of the older variants.

Run with::

    python -m pytest -q tests/unit/test_synthetic_shift.py
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from elasticmem.data import synthetic_shift_tables as T
from elasticmem.data.chunking import chunk_history
from elasticmem.data.schema import SPLITS, Example, read_examples
from elasticmem.data.synthetic import SyntheticConfig, generate, split_stats, write_synthetic

ROOT = Path(__file__).resolve().parents[2]
SHIFT = dict(variant="persona_shift")
STYLES = ("chat", "third_person", "named")
VALUES = sorted({v for vs in T.VALUES.values() for v in vs}, key=len, reverse=True)
NAMES = sorted(T.NAMES, key=len, reverse=True)
RELATIONS = sorted(T.RELATIONS_ALL, key=len, reverse=True)
KIND_OF = {v.lower(): k for k, vs in T.VALUES.items() for v in vs}
"""Each value's kind, by the value in lower case (answers capitalise it: "Marketing, nice!")."""


def _alternation(words) -> re.Pattern:
    return re.compile(r"(?<!\w)(" + "|".join(re.escape(w) for w in words) + r")(?!\w)", re.IGNORECASE)


VALUE_RE, NAME_RE, RELATION_RE = _alternation(VALUES), _alternation(NAMES), _alternation(RELATIONS)


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE) is not None


def _skeleton(text: str) -> str:
    """The text with every value, name and relation masked: what a template looks like filled."""
    return RELATION_RE.sub("<R>", NAME_RE.sub("<N>", VALUE_RE.sub("<V>", text)))


def _digest(splits: dict[str, list[Example]]) -> str:
    text = json.dumps({k: [e.to_json() for e in v] for k, v in splits.items()}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _shift(**kwargs) -> dict[str, list[Example]]:
    cfg = dict(num_histories=120, split_fractions=[0.5, 0.1, 0.4], **SHIFT)
    cfg.update(kwargs)
    return generate(SyntheticConfig(**cfg), seed=3)


def _all(splits: dict[str, list[Example]]) -> list[Example]:
    return [ex for split in SPLITS for ex in splits[split]]


def _texts(examples: list[Example]) -> str:
    """Every history turn and question of ``examples``, one per line."""
    histories = {ex.group: ex.history for ex in examples}
    lines = [t.content for h in histories.values() for s in h for t in s]
    lines += [t.speaker for h in histories.values() for s in h for t in s if t.speaker]
    return "\n".join(lines + [ex.question for ex in examples])


def _fact_turns(examples: list[Example]) -> list:
    """Turns after each session's greeting that mention a value, a name or a relation (statements,
    links and their answers; small talk and greetings are left out)."""
    histories = {ex.group: ex.history for ex in examples}
    return [t for h in histories.values() for s in h for t in s[2:] if _skeleton(t.content) != t.content]


def _chunk_of_turn(ex: Example, session: int, turn: int):
    (chunk,) = [c for c in chunk_history(ex.history, ex.group) if c.session == session and turn in c.turns]
    return chunk


def _chunks_with(ex: Example, word: str) -> list:
    return [c for c in chunk_history(ex.history, ex.group) if _mentions(c.text, word)]


# --------------------------------------------------------------------------- the older variants


# These digests were computed from the code before the persona_shift variant existed: they guard
# the byte-identity of the persona and tiny variants' outputs (tests and published results depend
# on them). Do not update them to make a change pass.
OLD_DIGESTS = [
    (dict(), 0, "ff596e0d09f00b544f8c6dfdd4a609e7034fdfb88da9d8443fc504fa937d7e4b"),
    (dict(assistant_replies="acknowledge", num_histories=20), 1,
     "1f46c86992c3935a83e023deca99ae03886c248733ea59053a13b5001023f913"),
    (dict(num_histories=12, num_options=10, num_distractors=9), 2,
     "6b9416f20bb63d5e48db72c887381bb5ff02b643d5083843e9358432c187a7b2"),
    (dict(num_histories=90, split_fractions=[0.4, 0.02, 0.58], num_sessions=2, num_facts=4, num_filler=0), 0,
     "62396f10de7d525ce59a49893e158e74e27c9c20bfbdd9486c2ae0770bfad069"),  # configs/quickstart.yaml
    (dict(variant="tiny", num_facts=6, num_histories=50), 0,
     "9bdee8f8695c28e0d72efc0dd14412984e6716187a3361f312b58a651d8c71be"),
]
OLD_FILE_DIGESTS = [  # sha256 of train.jsonl + val.jsonl + test.jsonl + stats.json as write_synthetic writes them
    (dict(num_histories=20), "8da9fc41f696dd4e9cabb977e315ca256035b03396f7b5ccfbbf172c5b1de21c"),
    (dict(variant="tiny", num_facts=6, num_histories=20), "aa1c6ed9bd29488bffae0b9322202b4c22bddb16aabc6a55f062c3f029651fa8"),
]


@pytest.mark.parametrize("kwargs, seed, digest", OLD_DIGESTS)
def test_older_variants_are_byte_identical(kwargs: dict, seed: int, digest: str) -> None:
    assert _digest(generate(SyntheticConfig(**kwargs), seed)) == digest


@pytest.mark.parametrize("kwargs, digest", OLD_FILE_DIGESTS)
def test_older_variants_files_are_byte_identical(tmp_path: Path, kwargs: dict, digest: str) -> None:
    write_synthetic(SyntheticConfig(**kwargs), 0, tmp_path)
    h = hashlib.sha256()
    for name in ("train.jsonl", "val.jsonl", "test.jsonl", "stats.json"):
        h.update((tmp_path / name).read_bytes())
    assert h.hexdigest() == digest


# --------------------------------------------------------------------------- files, determinism, stats


def test_same_seed_same_files_other_seed_other_files(tmp_path: Path) -> None:
    cfg = SyntheticConfig(num_histories=12, **SHIFT)
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        write_synthetic(cfg, seed, tmp_path / name)
    for split in SPLITS:
        a = (tmp_path / "a" / f"{split}.jsonl").read_bytes()
        assert a == (tmp_path / "b" / f"{split}.jsonl").read_bytes()
        assert a != (tmp_path / "c" / f"{split}.jsonl").read_bytes()


def test_files_parse_back_and_stats_match(tmp_path: Path) -> None:
    cfg = SyntheticConfig(num_histories=10, split_fractions=[0.4, 0.3, 0.3], **SHIFT)
    stats = write_synthetic(cfg, 1, tmp_path)
    assert json.loads((tmp_path / "stats.json").read_text()) == stats
    assert SyntheticConfig(**stats["config"]) == cfg and stats["variant"] == "persona_shift"
    expected = generate(cfg, 1)
    for split in SPLITS:
        back = read_examples(tmp_path / f"{split}.jsonl")
        assert [ex.to_json() for ex in back] == [ex.to_json() for ex in expected[split]]
        assert stats["splits"][split] == split_stats(back)
        for ex in back:
            assert ex.answer_text == ex.choices[ex.answer_index] and len(ex.choices) == 4
            assert ex.extra["surface"] == ("train" if split == "train" else "heldout")


def test_prepare_cli_writes_the_preset(tmp_path: Path, capsys) -> None:
    from elasticmem.data.prepare import main

    assert main(["synthetic", "--config", str(ROOT / "configs/persona_shift.yaml"), f"data.dir={tmp_path}"]) == 0
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["variant"] == "persona_shift"
    assert stats["splits"]["test"]["examples"] >= 300 and stats["splits"]["train"]["examples"] >= 150
    assert "persona_shift" in capsys.readouterr().out


# --------------------------------------------------------------------------- the surface split


def test_test_split_shares_no_surface_form_with_training() -> None:
    splits = _shift()
    train_text = _texts(splits["train"])
    for split in ("val", "test"):
        held = splits[split]
        options = {o for ex in held for o in ex.choices}
        assert options and not [o for o in options if _mentions(train_text, o)]
        names = {t.speaker for ex in held for s in ex.history for t in s if t.speaker}
        names |= {m.group(0) for ex in held for m in NAME_RE.finditer(_texts([ex]))}
        assert len(names) > 20 and not [n for n in names if _mentions(train_text, n)]
        relations = {m.group(0).lower() for m in RELATION_RE.finditer(_texts(held))}
        assert relations and not [r for r in relations if _mentions(train_text, r)]
        questions = {_skeleton(ex.question) for ex in held}
        assert len(questions) > 50 and not questions & {_skeleton(ex.question) for ex in splits["train"]}
        said = {_skeleton(t.content) for t in _fact_turns(held)}
        assert len(said) > 200 and not said & {_skeleton(t.content) for t in _fact_turns(splits["train"])}


def test_without_the_surface_split_forms_are_shared() -> None:
    # The control (surface_split: false) draws every split from both halves: the checks above see it.
    splits = _shift(surface_split=False)
    questions = {_skeleton(ex.question) for ex in splits["train"]}
    assert {_skeleton(ex.question) for ex in splits["test"]} & questions
    assert {ex.extra["surface"] for ex in _all(splits)} == {"all"}


def test_tables_split_into_disjoint_halves() -> None:
    train, held, every = (T.surface_forms(side) for side in ("train", "heldout", "all"))
    for field in ("openers", "suffixes", "question_prefixes", "question_suffixes", "links", "link_openers",
                  "value_openers", "closers", "link_answers", "names", "relations", "fillers"):
        a, b = getattr(train, field), getattr(held, field)
        assert not set(a) & set(b) and set(a) | set(b) == set(getattr(every, field)) and len(b) >= 2, field
    for field in ("statements", "questions", "updates", "update_questions", "values"):
        for kind in T.VALUES:
            a, b = getattr(train, field)[kind], getattr(held, field)[kind]
            assert not set(a) & set(b) and len(b) >= 2, (field, kind)
    assert min(len(v) for f in (train, held) for v in f.values.values()) >= 8
    assert min(len(f.names) for f in (train, held)) >= 20
    assert T.surface_forms("heldout", 1) != held  # another surface_seed, other halves


def test_templates_mention_no_value_name_or_relation() -> None:
    parts = [*T.OPENERS, *T.SUFFIXES, *T.QUESTION_PREFIXES, *T.QUESTION_SUFFIXES, *T.LINKS, *T.LINK_OPENERS,
             *T.VALUE_OPENERS, *T.CLOSERS, *T.LINK_ANSWERS, *(t for g in T.GREETINGS_NAMED_USER + T.GREETINGS_TWO for t in g)]
    cores = [c for k in T.KINDS for c in (*k.statements, *k.questions, *k.updates, *k.update_questions)]
    for text in parts + cores:
        assert _skeleton(text) == text, text
    assert len(set(cores)) == len(cores)  # a core belongs to one kind, so it goes to one side
    for k in T.KINDS:
        assert all(c.count("{s}") == 1 and c.count("{v}") == 1 for c in k.statements + k.updates), k.name
        assert all(c.count("{s}") == 1 and "{v}" not in c and c.endswith("?") for c in k.questions + k.update_questions)
    assert len({n.lower() for n in T.NAMES}) == len(T.NAMES) and len(set(T.RELATIONS_ALL)) == len(T.RELATIONS_ALL)
    for word in T.NAMES + T.RELATIONS_ALL:
        assert not [v for v in VALUES if _mentions(v, word) or _mentions(word, v)], word


# --------------------------------------------------------------------------- styles


def test_every_style_occurs_and_styles_follow_the_split_settings() -> None:
    splits = _shift()
    for split in ("train", "test"):
        assert {ex.extra["style"] for ex in splits[split]} == set(STYLES)
    held_out = _shift(train_styles=("chat", "third_person"), eval_styles=("named",))
    assert {ex.extra["style"] for ex in held_out["train"]} == {"chat", "third_person"}
    assert {ex.extra["style"] for ex in held_out["val"] + held_out["test"]} == {"named"}


def _core(question: str) -> str:
    """The question without its prefix ("One thing I wonder: ") and suffix (" I forgot.")."""
    prefix = max((p for p in T.QUESTION_PREFIXES if question.startswith(p)), key=len)
    suffix = max((p for p in T.QUESTION_SUFFIXES if question.endswith(p)), key=len)
    return question[len(prefix): len(question) - len(suffix)]


def test_styles_name_the_speakers_as_they_promise() -> None:
    for ex in _all(_shift())[::4]:
        style, turns = ex.extra["style"], [t for s in ex.history for t in s]
        speakers = {t.speaker for t in turns}
        asked, core = set(NAME_RE.findall(ex.question)), _core(ex.question)
        if style == "chat":
            assert speakers == {None} and re.search(r"\b(I|my)\b", core) and not asked
        elif style == "third_person":
            (user,) = {t.speaker for t in turns if t.role == "user"}
            assert {t.speaker for t in turns if t.role == "assistant"} == {None}
            assert user in asked and not re.search(r"\b(I|my)\b", core)
        else:
            assert len(speakers) == 2 and None not in speakers and asked & speakers
            assert all(a.speaker != b.speaker for s in ex.history for a, b in zip(s[::2], s[1::2]))


# --------------------------------------------------------------------------- questions and evidence


def test_evidence_options_updates_and_multi_hop() -> None:
    types: Counter = Counter()
    for ex in _all(_shift()):
        types[ex.question_type] += 1
        evidence = [tuple(e) for e in ex.extra["evidence"]]
        assert all(ex.history[s][t].role == "user" for s, t in evidence)
        for option in ex.choices:  # every option value is written in exactly one chunk
            assert len(_chunks_with(ex, option)) == 1, (ex.id, option)
        assert len(set(ex.choices)) == 4 and len({KIND_OF[o.lower()] for o in ex.choices}) == 1
        (gold_chunk,) = _chunks_with(ex, ex.answer_text)
        chunks = [_chunk_of_turn(ex, s, t) for s, t in evidence]
        assert _mentions(ex.history[evidence[-1][0]][evidence[-1][1]].content, ex.answer_text)
        if ex.question_type == "multi_hop":
            assert len(chunks) == 2 and chunks[0] != chunks[1] and chunks[1] == gold_chunk
            link = chunks[0]
            assert (link.session, link.turns) < (gold_chunk.session, gold_chunk.turns)
            assert not any(_mentions(link.text, o) for o in ex.choices)
            (relation,) = {r.lower() for r in RELATION_RE.findall(ex.question)}
            assert _mentions(link.text, relation) and not _mentions(gold_chunk.text, relation)
            (name,) = set(NAME_RE.findall(ex.history[link.session][link.turns[0]].content))
            assert _mentions(ex.history[gold_chunk.session][gold_chunk.turns[0]].content, name)
            # the asked person's other fact: a third chunk about the relative, of another kind
            other = [c for c in _chunks_with(ex, name) if c not in chunks]
            assert [c for c in other if {KIND_OF[v.lower()] for v in VALUE_RE.findall(c.text)} - {KIND_OF[ex.answer_text.lower()]}]
        else:
            assert chunks == [gold_chunk]
        if ex.question_type == "knowledge_update":  # the latest value counts; the old one is an option
            stated = ex.history[gold_chunk.session][gold_chunk.turns[0]]
            olds = [c for o in ex.choices if o != ex.answer_text for c in _chunks_with(ex, o)
                    if ex.history[c.session][c.turns[0]].speaker == stated.speaker and c.session < gold_chunk.session]
            assert olds
    assert set(types) == {"single_hop", "multi_hop", "knowledge_update"}


def _speaker_statements(ex: Example, name: str | None) -> list[str]:
    """The first-person statements of the asked speaker (``name`` None: the chat style's user)."""
    def said(t) -> bool:
        return t.role == "user" and (t.speaker == name if ex.extra["style"] == "named" else True)
    return [t.content for s in ex.history for t in s[2:] if said(t) and re.search(r"\bI\b", t.content)
            and not re.search(r"\bmy\b", t.content, re.IGNORECASE)]


def test_distractors_share_the_asked_kind_or_the_asked_person() -> None:
    for ex in _all(_shift()):
        if ex.question_type == "multi_hop":
            continue  # checked with its evidence above
        kind = KIND_OF[ex.answer_text.lower()]
        name = None if ex.extra["style"] == "chat" else NAME_RE.findall(ex.question)[0]
        mine = _speaker_statements(ex, name)
        other_kinds = {KIND_OF[v.lower()] for text in mine for v in VALUE_RE.findall(text)} - {kind}
        assert other_kinds, ex.id  # the same person, another kind
        same_kind = [o for o in ex.choices if o != ex.answer_text]  # the same kind, other people
        if ex.extra["style"] == "named":
            (other,) = {t.speaker for s in ex.history for t in s} - {name}
            theirs = " ".join(_speaker_statements(ex, other))
            assert [o for o in same_kind if _mentions(theirs, o)], ex.id  # the other speaker's value is an option


def test_gold_position_is_uniform() -> None:
    examples = _all(_shift())
    share = Counter(ex.answer_index for ex in examples)
    assert len(examples) >= 600 and all(0.15 <= share[i] / len(examples) <= 0.35 for i in range(4))


def test_mc10_and_acknowledge_work() -> None:
    for kwargs in (dict(num_options=10, num_distractors=9), dict(assistant_replies="acknowledge")):
        for ex in _all(generate(SyntheticConfig(num_histories=9, **SHIFT, **kwargs), 0)):
            assert len(ex.choices) == kwargs.get("num_options", 4)
            assert all(len(_chunks_with(ex, o)) == 1 for o in ex.choices)


def test_chunks_stay_short() -> None:
    lengths = [len(c.text) for ex in _all(_shift())[::6] for c in chunk_history(ex.history, ex.group)]
    assert max(lengths) < 330  # ~70 SmolLM2 tokens at most, well under chunking.max_tokens=128
    path = Path.home() / ".cache/elasticmem/models/SmolLM2-135M-Instruct/tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        assert max(len(tok.encode(c.text).ids) for ex in _all(_shift())[::24]
                   for c in chunk_history(ex.history, ex.group)) <= 100


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, message", [
    (dict(train_styles=["chat", "poem"]), "train_styles must be a non-empty list"),
    (dict(eval_styles=[]), "eval_styles must be a non-empty list"),
    (dict(num_distractors=14), "smallest half of a value pool"),
    (dict(num_filler=13), "num_filler must be in 0..12"),
    (dict(num_facts=13), "number of fact kinds"),
    (dict(num_facts=12, num_distractors=5, question_types=["multi_hop"]), "linked people"),
    (dict(num_sessions=1), "knowledge_update needs num_sessions >= 2"),
])
def test_invalid_shift_configs_raise_helpful_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SyntheticConfig(**SHIFT, **kwargs)
