"""Tests of the synthetic memory task (elasticmem.data.synthetic).

Run with::

    pytest tests/unit/test_synthetic.py
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from elasticmem.data import synthetic, synthetic_tables
from elasticmem.data.chunking import chunk_history
from elasticmem.data.schema import SPLITS, Example, read_examples
from elasticmem.data.synthetic import SyntheticConfig, generate, write_synthetic

TINY = dict(variant="tiny", num_facts=6)
ACK = dict(assistant_replies="acknowledge")
STYLES = ["engaged", "acknowledge"]


def _mentions(text: str, value: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(value)}(?!\w)", text, re.IGNORECASE) is not None


def _chunks_with(ex: Example, value: str) -> list:
    return [c for c in chunk_history(ex.history, ex.group) if _mentions(c.text, value)]


def _chunk_of_turn(ex: Example, session: int, turn: int):
    (chunk,) = [c for c in chunk_history(ex.history, ex.group) if c.session == session and turn in c.turns]
    return chunk


def _all(splits: dict[str, list[Example]]) -> list[Example]:
    return [ex for split in SPLITS for ex in splits[split]]


@functools.cache
def _persona(style: str) -> list[Example]:
    return _all(generate(SyntheticConfig(num_histories=150, assistant_replies=style), seed=3))


@functools.cache
def _persona10(style: str) -> list[Example]:
    cfg = SyntheticConfig(num_histories=40, num_options=10, num_distractors=9, assistant_replies=style)
    return _all(generate(cfg, seed=4))


@pytest.fixture(params=STYLES)
def persona(request) -> list[Example]:
    """MC-4 persona examples, once per reply style."""
    return _persona(request.param)


# --------------------------------------------------------------------------- files and splits


@pytest.mark.parametrize("kwargs", [{}, ACK, TINY])
def test_same_seed_same_files_other_seed_other_files(tmp_path: Path, kwargs: dict) -> None:
    cfg = SyntheticConfig(num_histories=12, **kwargs)
    write_synthetic(cfg, 7, tmp_path / "a")
    write_synthetic(cfg, 7, tmp_path / "b")
    write_synthetic(cfg, 8, tmp_path / "c")
    for split in SPLITS:
        a = (tmp_path / "a" / f"{split}.jsonl").read_bytes()
        assert a == (tmp_path / "b" / f"{split}.jsonl").read_bytes()
        assert a != (tmp_path / "c" / f"{split}.jsonl").read_bytes()


@pytest.mark.parametrize("kwargs", [{}, ACK, TINY])
def test_files_parse_back_to_the_generated_examples(tmp_path: Path, kwargs: dict) -> None:
    cfg = SyntheticConfig(num_histories=10, **kwargs)
    write_synthetic(cfg, 1, tmp_path)
    expected = generate(cfg, 1)
    for split in SPLITS:
        back = read_examples(tmp_path / f"{split}.jsonl")
        assert [ex.to_json() for ex in back] == [ex.to_json() for ex in expected[split]]
        for ex in back:
            assert ex.source == "synthetic"
            assert ex.answer_text == ex.choices[ex.answer_index]
            assert len(ex.choices) == cfg.num_options


@pytest.mark.parametrize(
    "num_histories, fractions, sizes",
    [(60, [0.8, 0.1, 0.1], [48, 6, 6]), (10, [0.5, 0.3, 0.2], [5, 3, 2]), (7, [1.0, 0.0, 0.0], [7, 0, 0])],
)
@pytest.mark.parametrize("kwargs", [{}, TINY])
def test_splits_partition_histories(num_histories: int, fractions: list, sizes: list, kwargs: dict) -> None:
    cfg = SyntheticConfig(num_histories=num_histories, split_fractions=fractions, **kwargs)
    splits = generate(cfg, 0)
    groups = {split: {ex.group for ex in splits[split]} for split in SPLITS}
    assert [len(groups[s]) for s in SPLITS] == sizes
    assert not (groups["train"] & groups["val"] or groups["train"] & groups["test"] or groups["val"] & groups["test"])
    ids = [ex.id for ex in _all(splits)]
    assert len(ids) == len(set(ids)) == num_histories * cfg.num_facts


def test_questions_of_a_group_share_its_history(persona: list[Example]) -> None:
    by_group = defaultdict(list)
    for ex in persona:
        by_group[ex.group].append(ex)
    for exs in by_group.values():
        assert len(exs) == 6
        assert all(ex.history == exs[0].history for ex in exs)


def test_write_synthetic_stats_match_the_files(tmp_path: Path) -> None:
    cfg = SyntheticConfig(num_histories=20, split_fractions=[0.5, 0.25, 0.25])
    returned = write_synthetic(cfg, 5, tmp_path)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats == returned
    assert stats["seed"] == 5 and stats["config"]["num_histories"] == 20
    assert SyntheticConfig(**stats["config"]) == cfg
    for split in SPLITS:
        exs = read_examples(tmp_path / f"{split}.jsonl")
        histories = {ex.group: ex.history for ex in exs}
        turns = sum(len(s) for h in histories.values() for s in h)
        got = stats["splits"][split]
        assert got["examples"] == len(exs)
        assert got["histories"] == len(histories)
        assert got["sessions"] == len(histories) * cfg.num_sessions
        assert got["turns"] == turns
        assert got["chunks"] == turns // 2  # persona turns always come in user+assistant pairs
        assert got["question_types"] == dict(Counter(ex.question_type for ex in exs))


# --------------------------------------------------------------------------- persona variant


def test_persona_sessions_are_dated_paired_and_ordered(persona: list[Example]) -> None:
    for ex in persona[::6]:
        assert len(ex.history) == 4
        dates = []
        for session in ex.history:
            assert session and len(session) % 2 == 0
            assert [t.role for t in session] == ["user", "assistant"] * (len(session) // 2)
            assert len({t.date for t in session}) == 1
            dates.append(session[0].date)
        assert all(re.fullmatch(r"\d{4}-\d\d-\d\d", d) for d in dates)
        assert dates == sorted(dates) and len(set(dates)) == len(dates)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("make", [_persona, _persona10], ids=["mc4", "mc10"])
def test_gold_lives_in_its_evidence_and_every_option_once(make, style: str) -> None:
    examples = make(style)
    types = Counter()
    for ex in examples:
        types[ex.question_type] += 1
        evidence = [tuple(e) for e in ex.extra["evidence"]]
        for s, t in evidence:
            assert ex.history[s][t].role == "user"
        gold = ex.answer_text
        (gold_chunk,) = _chunks_with(ex, gold)
        assert _mentions(ex.history[gold_chunk.session][gold_chunk.turns[0]].content, gold)
        for i, option in enumerate(ex.choices):
            assert len(_chunks_with(ex, option)) == 1, (ex.id, option)
            assert i == ex.answer_index or option != gold
        evidence_chunks = [_chunk_of_turn(ex, s, t) for s, t in evidence]
        if ex.question_type == "multi_hop":
            assert len(evidence_chunks) == 2 and gold_chunk in evidence_chunks
            (link,) = [c for c in evidence_chunks if c != gold_chunk]
            assert not any(_mentions(link.text, o) for o in ex.choices)
            # The link alone says which relation (from the question) the answer's person is.
            (relation,) = [r for r in synthetic.RELATIONS if _mentions(ex.question, f"my {r}")]
            assert _mentions(link.text, f"my {relation}") and not _mentions(gold_chunk.text, relation)
            link_user = ex.history[link.session][link.turns[0]].content
            gold_user = ex.history[gold_chunk.session][gold_chunk.turns[0]].content
            (name,) = set(re.findall(r"[A-Z]\w+", link_user)) & set(re.findall(r"[A-Z]\w+", gold_user)) - {"My", "I"}
            assert len(_chunks_with(ex, name)) == 2
            assert (link.session, link.turns) < (gold_chunk.session, gold_chunk.turns)
        else:
            assert evidence_chunks == [gold_chunk]
        if ex.question_type == "knowledge_update":
            sessions = [_chunks_with(ex, o)[0].session for o in ex.choices if o != gold]
            assert min(sessions) < gold_chunk.session  # the old value, said before the update
    assert set(types) == {"single_hop", "multi_hop", "knowledge_update"}


def _reply_templates() -> list[str]:
    """Every fixed text of an engaged reply (with its placeholders)."""
    return [*(t for ts in synthetic.FACT_OPENERS.values() for t in ts), *synthetic.REPLY_CLOSERS,
            *synthetic.REPLY_NOUNS.values(), *synthetic.LINK_REPLIES,
            *(t for ts in synthetic.FILLER_REPLIES.values() for t in ts)]


def test_persona_pools_never_leak_into_other_text() -> None:
    fixed = [*synthetic.FILLER, *synthetic.ACKNOWLEDGEMENTS, *(t for g in synthetic.GREETINGS for t in g),
             *synthetic.RELATIONS, *synthetic.PERSON_NAMES, synthetic.LINK_TEMPLATE, *_reply_templates()]
    for cat in synthetic.PERSONA_CATEGORIES:
        fixed += [cat.statement, cat.question, cat.update, cat.question_now]
    values = [v for cat in synthetic.PERSONA_CATEGORIES for v in cat.values]
    assert len({v.lower() for v in values}) == len(values)
    assert all(len(cat.values) >= 30 for cat in synthetic.PERSONA_CATEGORIES)
    assert len(synthetic.PERSONA_CATEGORIES) >= 8
    for v in values:
        assert not [t for t in fixed if _mentions(t, v)], v
        assert not [w for w in values if w != v and _mentions(w, v)], v


def test_engaged_reply_templates_cover_every_topic_and_name_no_person() -> None:
    names = {c.name for c in synthetic.PERSONA_CATEGORIES}
    assert set(synthetic.FACT_OPENERS) == set(synthetic.REPLY_NOUNS) == names
    assert set(synthetic.FILLER_REPLIES) == set(synthetic.FILLER)
    assert all(len(ts) >= 2 for ts in [*synthetic.FACT_OPENERS.values(), *synthetic.FILLER_REPLIES.values()])
    assert len(synthetic.REPLY_CLOSERS) >= 3 and len(synthetic.LINK_REPLIES) >= 3
    # A person in a reply would add a chunk that mentions them (multi-hop names live in exactly
    # two chunks, a relation never in the answer's chunk), so only link replies name one, their own.
    people = [*synthetic.RELATIONS, *synthetic.PERSON_NAMES]
    for text in _reply_templates():
        assert not [p for p in people if _mentions(text, p)], text
    # Fact replies never name the subject: they read the same for the user's facts and the distractors.
    for text in [*(t for ts in synthetic.FACT_OPENERS.values() for t in ts), *synthetic.REPLY_CLOSERS]:
        assert not re.search(r"\b(you|your|yours)\b", text, re.IGNORECASE), text
        assert "{noun}" in text or "{v}" in text.lower(), text


def test_reply_styles_differ_only_in_assistant_replies() -> None:
    engaged = _all(generate(SyntheticConfig(num_histories=30), seed=9))
    acknowledge = _all(generate(SyntheticConfig(num_histories=30, assistant_replies="acknowledge"), seed=9))
    greetings = {reply for _, reply in synthetic.GREETINGS}
    replies: dict[str, set] = {"engaged": set(), "acknowledge": set()}
    for e, a in zip(engaged, acknowledge, strict=True):
        assert (e.id, e.question, e.choices, e.answer_index, e.extra) == (a.id, a.question, a.choices, a.answer_index, a.extra)
        assert [len(s) for s in e.history] == [len(s) for s in a.history]
        for se, sa in zip(e.history, a.history):
            for te, ta in zip(se, sa):
                assert (te.role, te.date) == (ta.role, ta.date)
                if te.role == "user" or ta.content in greetings:
                    assert te.content == ta.content
                else:
                    assert ta.content in synthetic.ACKNOWLEDGEMENTS and te.content not in synthetic.ACKNOWLEDGEMENTS
                    replies["engaged"].add(te.content)
                    replies["acknowledge"].add(ta.content)
    assert len(replies["acknowledge"]) == len(synthetic.ACKNOWLEDGEMENTS)
    assert len(replies["engaged"]) > 20 * len(synthetic.ACKNOWLEDGEMENTS)


def test_engaged_fact_replies_name_the_value_or_the_attribute() -> None:
    by_value = {v: cat for cat in synthetic.PERSONA_CATEGORIES for v in cat.values}
    for ex in _persona("engaged")[::6]:
        for session in ex.history:
            for user, reply in zip(session[::2], session[1::2]):
                said = [v for v in by_value if _mentions(user.content, v)]
                if not said:
                    continue
                (value,) = said
                assert _mentions(reply.content, value) or _mentions(reply.content, synthetic.REPLY_NOUNS[by_value[value].name])
                assert reply.content.endswith(("?", ".", "!"))


def test_gold_position_is_uniform(persona: list[Example]) -> None:
    assert len(persona) >= 400
    share = Counter(ex.answer_index for ex in persona)
    for position in range(4):
        assert 0.15 <= share[position] / len(persona) <= 0.35


@pytest.mark.parametrize("kwargs", [{}, TINY])
def test_no_memory_prior_stays_at_chance(kwargs: dict) -> None:
    cfg = SyntheticConfig(num_histories=600, split_fractions=[0.6, 0.0, 0.4], **kwargs)
    splits = generate(cfg, 11)
    by_question: dict[str, Counter] = defaultdict(Counter)
    overall: Counter = Counter()
    for ex in splits["train"]:
        by_question[ex.question][ex.answer_text] += 1
        overall[ex.answer_text] += 1

    def predict(ex: Example) -> int:
        # The option most often gold for this question text, then overall, in train.
        return max(range(len(ex.choices)),
                   key=lambda i: (by_question[ex.question][ex.choices[i]], overall[ex.choices[i]]))

    test = splits["test"]
    assert len(test) >= 1000
    accuracy = sum(predict(ex) == ex.answer_index for ex in test) / len(test)
    assert abs(accuracy - 1 / cfg.num_options) <= 0.06


# --------------------------------------------------------------------------- tiny variant


@pytest.mark.parametrize("num_facts, num_options", [(4, 4), (6, 4), (8, 4), (3, 4), (10, 10)])
def test_tiny_chunks_and_questions_end_with_the_key(num_facts: int, num_options: int) -> None:
    cfg = SyntheticConfig(variant="tiny", num_facts=num_facts, num_options=num_options, num_histories=30)
    letters = [chr(ord("a") + i) for i in range(num_options)]
    for ex in _all(generate(cfg, 2)):
        assert len(ex.history) == 1
        assert all(t.role == "user" and t.date is None for t in ex.history[0])
        chunks = chunk_history(ex.history, ex.group)
        assert len(chunks) == num_facts
        keys = [c.text.split()[-1] for c in chunks]
        assert len(set(keys)) == num_facts
        key = ex.question.split()[-1]
        assert key in keys
        ((s, t),) = ex.extra["evidence"]
        evidence = _chunk_of_turn(ex, s, t)
        assert evidence.text.endswith(f" {key}")
        assert evidence.text.split()[-2] == ex.answer_text
        assert ex.choices == letters and ex.question_type == "recall"
        values = [c.text.split()[-2] for c in chunks]
        if num_facts >= num_options:
            assert set(values) == set(letters)


def test_tiny_vocabulary_covers_everything_it_emits() -> None:
    vocab = synthetic_tables.VOCABULARY
    assert len(vocab) == len(set(vocab)) < 60
    cfg = SyntheticConfig(variant="tiny", num_facts=8, num_keys=24, num_options=10, num_histories=40)
    for ex in _all(generate(cfg, 0)):
        texts = [ex.question, *ex.choices, *(c.text for c in chunk_history(ex.history, ex.group))]
        assert set(re.findall(r"\w+", " ".join(texts))) <= set(vocab)


def test_tiny_uses_only_the_first_num_keys_keys() -> None:
    cfg = SyntheticConfig(variant="tiny", num_facts=4, num_keys=5, num_histories=50)
    keys = {ex.question.split()[-1] for ex in _all(generate(cfg, 0))}
    assert len(keys) == 5


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_distractors=2), "num_distractors (2) must be >= num_options - 1"),
        (dict(num_options=10), "num_distractors (3) must be >= num_options - 1 (9)"),
        (dict(split_fractions=[0.8, 0.1, 0.2]), "must sum to 1"),
        (dict(split_fractions=[0.9, 0.1]), "split_fractions needs 3 numbers"),
        (dict(split_fractions=[1.2, -0.1, -0.1]), "must be >= 0"),
        (dict(question_types=["single_hop", "temporal"]), "valid: ['single_hop', 'multi_hop', 'knowledge_update']"),
        (dict(question_types=[]), "must not be empty"),
        (dict(num_sessions=1), "knowledge_update needs num_sessions >= 2"),
        (dict(num_facts=13), "number of fact categories"),
        (dict(num_facts=12, num_distractors=5, question_types=["multi_hop"]), "linked people"),
        (dict(num_distractors=40), "smallest value pool"),
        (dict(num_filler=100), "num_filler must be in"),
        (dict(num_histories=0), "num_histories must be >= 1"),
        (dict(variant="huge"), "variant must be"),
        (dict(assistant_replies="polite"), "assistant_replies must be 'engaged' or 'acknowledge'"),
        (dict(variant="tiny", num_keys=30), "num_keys must be in 1..24"),
        (dict(variant="tiny", num_facts=8, num_keys=6), "must be <= num_keys"),
    ],
)
def test_invalid_configs_raise_helpful_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SyntheticConfig(**kwargs)
    assert message in str(info.value)


def test_generate_revalidates_a_mutated_config() -> None:
    cfg = SyntheticConfig()
    cfg.num_distractors = 1
    with pytest.raises(ValueError, match="num_distractors"):
        generate(cfg, 0)


def test_every_config_field_is_documented() -> None:
    from elasticmem.utils.configuration import field_docs

    docs = field_docs(SyntheticConfig)
    assert set(docs) == {f for f in SyntheticConfig.__dataclass_fields__}
    assert all(docs.values())


def test_config_limits_match_the_tables(monkeypatch) -> None:
    # elasticmem.config checks SyntheticConfig against the pools' sizes written there as numbers;
    # the task refuses to load when its tables and those numbers part ways.
    from elasticmem import config

    synthetic_tables._check_limits()  # as they are: they agree
    monkeypatch.setattr(config, "SYNTHETIC_FILLER", len(synthetic.FILLER) + 1)
    with pytest.raises(ImportError, match="SYNTHETIC_FILLER"):
        synthetic_tables._check_limits()
    monkeypatch.undo()
    with pytest.raises(ValueError, match=f"num_filler must be in 0..{len(synthetic.FILLER)}"):
        SyntheticConfig(num_filler=len(synthetic.FILLER) + 1)
