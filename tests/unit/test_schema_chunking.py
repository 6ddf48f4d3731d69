"""Example schema validation (errors name file, line, field) and history chunking.

    pytest tests/unit/test_schema_chunking.py
"""

from __future__ import annotations

import json

import pytest

from elasticmem.data.chunking import chunk_history, format_chunk, tokenize_chunks
from elasticmem.data.schema import Example, SchemaError, Turn, read_examples, write_examples

GOOD = {"id": "e1", "source": "s", "group": "g", "question": "q?", "choices": ["x", "y"], "answer_index": 1,
        "question_type": "t", "history": [[{"role": "user", "content": "hi"}]]}


def _write(tmp_path, lines):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_roundtrip(tmp_path):
    ex = Example.from_json({**GOOD, "answer_text": "y", "evidence": [[0, 0]]})
    p = tmp_path / "a.jsonl"
    write_examples(p, [ex])
    (back,) = read_examples(p)
    assert back == ex and back.extra == {"evidence": [[0, 0]]} and back.answer_letter == "b"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("question"), "missing field 'question'"),
        (lambda d: d.update(answer_index=5), "'answer_index' = 5 is outside the 2 choices"),
        (lambda d: d.update(history=[]), "'history' is empty"),
        (lambda d: d.update(history=[[]]), "'history' is empty"),
        (lambda d: d.update(history=[[{"role": "user"}]]), r"'history\[0\]\[0\]\.content' is missing"),
        (lambda d: d.update(choices=["only"]), "at least 2 options"),
        (lambda d: d.update(answer_index="1"), "'answer_index' must be int"),
    ],
)
def test_errors_name_file_line_and_field(tmp_path, mutate, message):
    bad = dict(GOOD, id="e2")
    mutate(bad)
    p = _write(tmp_path, [json.dumps(GOOD), json.dumps(bad)])
    with pytest.raises(SchemaError, match=message) as e:
        read_examples(p)
    assert f"{p}:2" in str(e.value)


def test_malformed_json_names_line(tmp_path):
    p = _write(tmp_path, [json.dumps(GOOD), "", '{"id": "x", '])
    with pytest.raises(SchemaError, match=rf"{p}:3: malformed JSON"):
        read_examples(p)


def test_duplicate_ids(tmp_path):
    p = _write(tmp_path, [json.dumps(GOOD), json.dumps(GOOD)])
    with pytest.raises(SchemaError, match="duplicate example id 'e1'"):
        read_examples(p)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_examples(tmp_path / "nope.jsonl")


def test_chunking_pairs_lone_turns_speakers_dates():
    u, a = Turn("user", "I like tea."), Turn("assistant", "Noted.")
    history = [
        [u, a, Turn("user", "Bye."), Turn("user", "Hello?"), Turn("assistant", "Hi!")],
        [Turn("assistant", "Welcome back.", date="2024-05-01"), Turn("user", "Thanks", speaker="Caroline")],
    ]
    chunks = chunk_history(history, "g")
    assert [c.text for c in chunks] == [
        "User:\nI like tea.\n\nAssistant:\nNoted.",
        "User:\nBye.",
        "User:\nHello?\n\nAssistant:\nHi!",
        "[2024-05-01]\nAssistant:\nWelcome back.",
        "Caroline:\nThanks",
    ]
    assert [(c.session, c.turns) for c in chunks] == [(0, (0, 1)), (0, (2,)), (0, (3, 4)), (1, (0,)), (1, (1,))]
    assert format_chunk([Turn("user", "x", date="d", speaker="Mel"), Turn("assistant", "y", speaker="Bob")]) == \
        "[d]\nMel:\nx\n\nBob:\ny"


def test_a_memory_turn_is_its_own_chunk_without_a_label():
    history = [[Turn("memory", "[heat] Task type: heat."), Turn("user", "a"), Turn("assistant", "b")],
               [Turn("user", "c"), Turn("memory", "card 2")]]
    assert [c.text for c in chunk_history(history, "g")] == [
        "[heat] Task type: heat.", "User:\na\n\nAssistant:\nb", "User:\nc", "card 2"]


def test_pairs_never_cross_sessions():
    chunks = chunk_history([[Turn("user", "a")], [Turn("assistant", "b")]], "g")
    assert len(chunks) == 2


def test_token_cap_and_side(tiny_backbone):
    tok = tiny_backbone.tokenizer
    text = "one two three four five six seven eight nine ten"
    full = tok(text, add_special_tokens=False)["input_ids"]
    right, = tokenize_chunks([text], tok, 4, "right", add_special_tokens=False)
    left, = tokenize_chunks([text], tok, 4, "left", add_special_tokens=False)
    assert right == full[:4] and left == full[-4:]
    assert tok.truncation_side == "right"  # restored
    with pytest.raises(ValueError):
        tokenize_chunks([text], tok, 0)


def test_a_group_history_is_written_once_and_filled_in_on_reading(tmp_path):
    """Records of a group after the first leave 'history' out; reading gives every example its
    group's history back (the same object), and a record without one and no earlier group
    record is refused."""
    import json

    from elasticmem.data.schema import Example, SchemaError, Turn, read_examples, write_examples

    h1 = [[Turn("user", "I live in Porto."), Turn("assistant", "Nice.")]]
    h2 = [[Turn("user", "My dog is Rex.")]]
    exs = [Example(f"q{i}", "t", "where?", ["a", "b"], i % 2, "x", h, group=g)
           for i, (g, h) in enumerate([("g1", h1), ("g2", h2), ("g1", h1), ("g1", [list(h1[0])]), ("g2", h2)])]
    write_examples(tmp_path / "x.jsonl", exs)
    lines = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert ["history" in d for d in lines] == [True, True, False, False, False]
    back = read_examples(tmp_path / "x.jsonl")
    assert [ex.to_json() for ex in back] == [ex.to_json() for ex in exs]
    assert back[0].history is back[2].history is back[3].history
    write_examples(tmp_path / "full.jsonl", exs, share_histories=False)
    assert all("history" in json.loads(line) for line in (tmp_path / "full.jsonl").read_text().splitlines())
    (tmp_path / "bad.jsonl").write_text(json.dumps({k: v for k, v in lines[0].items() if k != "history"}) + "\n")
    with pytest.raises(SchemaError, match=r"bad.jsonl:1.*missing field 'history'.*'g1'"):
        read_examples(tmp_path / "bad.jsonl")
