"""PersonaMem loader on small fixtures in the documented format (questions CSV + shared contexts
JSONL), its split and groups, malformed inputs and their errors, the config.

    OMP_NUM_THREADS=1 pytest tests/unit/test_data_personamem.py
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from elasticmem.data.personamem import parse_answer, parse_options, prepare_personamem
from elasticmem.data.prepare import main as prepare_main
from elasticmem.data.schema import SPLITS, read_examples
from elasticmem.data.sources import DataError, split_random

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["persona_id", "question_id", "question_type", "topic", "stereotypical", "context_length_in_tokens",
           "distance_to_ref_in_blocks", "user_question_or_message", "correct_answer", "all_options",
           "shared_context_id", "end_index_in_shared_context"]
N_CONTEXTS, TURNS = 10, 12


def _context(c: int) -> list[dict]:
    turns = [{"role": "system", "content": f"Persona {c}: a user who likes hiking."}]
    for k in range(1, TURNS):
        turns.append({"role": "user" if k % 2 else "assistant", "content": f"context {c} turn {k}"})
    return turns


def _rows() -> list[dict]:
    rows = []
    for c in range(N_CONTEXTS):
        for q, end in enumerate((5, 5, 9, TURNS)):
            options = [f"({chr(97 + k)}) reply {c}-{q}-{k}, with a comma" for k in range(4)]
            rows.append({
                "persona_id": str(c), "question_id": f"ctx{c}-q{q}", "question_type": ["recall_user_shared_facts",
                "track_full_preference_evolution"][q % 2], "topic": "hiking", "stereotypical": "False",
                "context_length_in_tokens": "32000", "distance_to_ref_in_blocks": "2",
                "user_question_or_message": f"Question {q} about context {c}?\nSecond line.",
                "correct_answer": f"({'abcd'[(c + q) % 4]})", "all_options": repr(options),
                "shared_context_id": f"ctx-{c}", "end_index_in_shared_context": str(end),
            })
    return rows


def _write(tmp_path: Path, rows: list[dict] | None = None, contexts: list[str] | None = None,
           columns: list[str] = COLUMNS) -> tuple[Path, Path]:
    q = tmp_path / "questions_32k.csv"
    with q.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(_rows() if rows is None else rows)
    ctx = tmp_path / "shared_contexts_32k.jsonl"
    if contexts is None:
        contexts = [json.dumps({f"ctx-{c}": _context(c)}) for c in range(N_CONTEXTS)]
    ctx.write_text("\n".join(contexts) + "\n", encoding="utf-8")
    return q, ctx


def _all(out: Path) -> dict:
    return {e.id: e for s in SPLITS for e in read_examples(out / f"{s}.jsonl")}


def test_prepare_personamem(tmp_path: Path) -> None:
    q, ctx = _write(tmp_path)
    stats = prepare_personamem([ctx, q], tmp_path / "out")  # either order
    assert stats["total"]["examples"] == 40 and stats["total"]["units"] == 10
    assert stats["total"]["groups"] == 30  # end indices 5, 9, 12 per context
    assert stats["options_per_question"] == {4: 40} and stats["skipped"]["total"] == 0
    exs = _all(tmp_path / "out")
    e = exs["ctx3-q2"]
    assert e.group == "ctx-3@9" and len(e.history) == 1 and len(e.history[0]) == 9
    assert [t.content for t in e.history[0]] == [t["content"] for t in _context(3)[:9]]
    assert e.history[0][0].role == "system"
    assert e.choices == [f"reply 3-2-{k}, with a comma" for k in range(4)]
    assert e.answer_index == (3 + 2) % 4 and e.answer_text == e.choices[e.answer_index]
    assert e.question == "Question 2 about context 3?\nSecond line." and e.source == "personamem"
    assert e.extra["topic"] == "hiking" and e.extra["persona_id"] == "3" and e.extra["shared_context_id"] == "ctx-3"
    assert e.extra["end_index_in_shared_context"] == 9
    # Questions cut at the same point share one history (one bank group).
    assert exs["ctx3-q0"].history == exs["ctx3-q1"].history and exs["ctx3-q0"].group == exs["ctx3-q1"].group
    assert len(exs["ctx3-q3"].history[0]) == TURNS


def test_split_80_10_10_by_context(tmp_path: Path) -> None:
    q, ctx = _write(tmp_path)
    stats = prepare_personamem([q, ctx], tmp_path / "out")
    expected = split_random([f"ctx-{c}" for c in range(N_CONTEXTS)], (0.8, 0.1, 0.1), 42)
    assert [len(expected[s]) for s in SPLITS] == [8, 1, 1]
    contexts = {}
    for s in SPLITS:
        exs = read_examples(tmp_path / "out" / f"{s}.jsonl")
        assert {e.extra["shared_context_id"] for e in exs} == set(expected[s])
        assert (tmp_path / "out" / "splits" / f"{s}_ids.txt").read_text().split() == expected[s]
        for e in exs:
            assert contexts.setdefault(e.extra["shared_context_id"], s) == s
    assert [stats["splits"][s]["examples"] for s in SPLITS] == [32, 4, 4]
    assert stats["split"]["unit"] == "shared_context_id"


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("['(a) x', '(b) y', '(c) z']", ["x", "y", "z"]),
        ('["(a) x", "(b) y"]', ["x", "y"]),
        ("['x', 'y']", ["x", "y"]),
        ("(a) first one (b) second (c) third", ["first one", "second", "third"]),
        ("['(b) starts at b', '(a) mislabelled']", ["(b) starts at b", "(a) mislabelled"]),
    ],
)
def test_parse_options(raw: str, expected: list[str]) -> None:
    assert parse_options(raw, Path("q.csv"), "row 1") == expected


@pytest.mark.parametrize("raw, index", [("(c)", 2), ("c", 2), ("(C) the third", 2), (" (a)", 0), ("d.", 3)])
def test_parse_answer(raw: str, index: int) -> None:
    assert parse_answer(raw, 4, Path("q.csv"), "row 1") == index


@pytest.mark.parametrize(
    "mutate, field, message, reason",
    [
        (lambda r: r.update(correct_answer="(e)"), "correct_answer", "letter 'e' is outside the 4 options (a)-(d)",
         "bad_answer"),
        (lambda r: r.update(correct_answer="none"), "correct_answer", "is not an option letter", "bad_answer"),
        (lambda r: r.update(all_options="{oops"), "all_options", "neither a list nor", "bad_field"),
        (lambda r: r.update(all_options="['only one']"), "all_options", "at least 2 options", "bad_field"),
        (lambda r: r.update(end_index_in_shared_context="x"), "end_index_in_shared_context", "not an integer",
         "bad_field"),
        (lambda r: r.update(end_index_in_shared_context="0"), "end_index_in_shared_context", "leaves no history",
         "bad_field"),
        (lambda r: r.update(end_index_in_shared_context="99"), "end_index_in_shared_context",
         "99 is beyond the 12 turns of context 'ctx-1'", "bad_end_index"),
        (lambda r: r.update(shared_context_id="ctx-404"), "shared_context_id", "'ctx-404' has no context in",
         "unknown_context"),
        (lambda r: r.update(question_id=""), "question_id", "is empty", "missing_field"),
        (lambda r: r.update(question_id="ctx0-q0"), "id", "duplicate example id 'ctx0-q0'", "duplicate_id"),
    ],
)
def test_invalid_rows_name_file_row_and_field(tmp_path: Path, mutate, field: str, message: str,
                                              reason: str) -> None:
    rows = _rows()
    mutate(rows[5])  # ctx-1, q1: data row 6, CSV lines 8-9 (the question has two lines)
    q, ctx = _write(tmp_path, rows)
    with pytest.raises(DataError) as e:
        prepare_personamem([q, ctx], tmp_path / "out")
    assert str(e.value).startswith(f"{q} row 6 (line 12): field '{field}': ")
    assert message in str(e.value)
    assert not (tmp_path / "out" / "train.jsonl").exists()
    stats = prepare_personamem([q, ctx], tmp_path / "out", skip_invalid=True)
    assert stats["skipped"]["by_reason"] == {reason: 1} and stats["total"]["examples"] == 39


def test_missing_column_is_fatal(tmp_path: Path) -> None:
    q, ctx = _write(tmp_path, columns=[c for c in COLUMNS if c != "all_options"])
    with pytest.raises(DataError, match=rf"{re.escape(str(q))} header \(line 1\): field 'all_options': missing "
                       r"column\(s\) \['all_options'\]"):
        prepare_personamem([q, ctx], tmp_path / "out", skip_invalid=True)
    q, ctx = _write(tmp_path, columns=[c for c in COLUMNS if c != "user_question_or_message"])
    with pytest.raises(DataError, match="user_question_or_message or question"):
        prepare_personamem([q, ctx], tmp_path / "out")


def test_question_column_fallback(tmp_path: Path) -> None:
    rows = [{**r, "question": r["user_question_or_message"]} for r in _rows()]
    cols = [c if c != "user_question_or_message" else "question" for c in COLUMNS]
    q, ctx = _write(tmp_path, rows, columns=cols)
    assert prepare_personamem([q, ctx], tmp_path / "out")["total"]["examples"] == 40


def test_columns_named_like_schema_fields_are_kept_aside(tmp_path: Path) -> None:
    rows = [{**r, "question": "another text", "group": "g", "id": "x"} for r in _rows()]
    q, ctx = _write(tmp_path, rows, columns=[*COLUMNS, "question", "group", "id"])
    prepare_personamem([q, ctx], tmp_path / "out")
    e = _all(tmp_path / "out")["ctx0-q0"]
    assert e.question.startswith("Question 0") and e.group == "ctx-0@5" and e.id == "ctx0-q0"
    assert (e.extra["source_question"], e.extra["source_group"], e.extra["source_id"]) == ("another text", "g", "x")


def test_truncated_csv_row(tmp_path: Path) -> None:
    q, ctx = _write(tmp_path)
    text = q.read_text()
    q.write_text(text[: text.rindex("ctx-9") - 3])  # the last row loses its last columns
    with pytest.raises(DataError, match=r"row 40 \(line \d+\): field 'shared_context_id': missing: the row has "
                       r"fewer columns than the header"):
        prepare_personamem([q, ctx], tmp_path / "out")
    stats = prepare_personamem([q, ctx], tmp_path / "out", skip_invalid=True)
    assert stats["skipped"]["by_reason"] == {"short_row": 1} and stats["total"]["examples"] == 39


@pytest.mark.parametrize(
    "line, where, reason, lost",
    [
        ('{"ctx-2": [{"role": "user", "content": "hi"}', "line 3", "malformed_json", 4),
        ('{"ctx-2": [{"role": "user"}]}', "line 3", "bad_field", 4),
        ('{"ctx-2": [], "ctx-x": []}', "line 3", "bad_record", 4),
        ('["ctx-2"]', "line 3", "bad_record", 4),
        (json.dumps({"ctx-1": _context(1)}), "line 3", "duplicate_context", 4),
    ],
)
def test_invalid_context_lines(tmp_path: Path, line: str, where: str, reason: str, lost: int) -> None:
    contexts = [json.dumps({f"ctx-{c}": _context(c)}) for c in range(N_CONTEXTS)]
    contexts[2] = line
    q, ctx = _write(tmp_path, contexts=contexts)
    with pytest.raises(DataError) as e:
        prepare_personamem([q, ctx], tmp_path / "out")
    assert str(e.value).startswith(f"{ctx} {where}")
    stats = prepare_personamem([q, ctx], tmp_path / "out", skip_invalid=True)
    # The bad line, then each question of ctx-2 (now without a context) is counted.
    assert stats["skipped"]["by_reason"] == {reason: 1, "unknown_context": 4}
    assert stats["total"]["examples"] == 40 - lost
    listed = [s for s in stats["skipped"]["listed"] if s["reason"] == "unknown_context"]
    assert listed[0]["file"] == str(q) and listed[0]["field"] == "shared_context_id"


def test_unused_contexts_are_counted(tmp_path: Path) -> None:
    contexts = [json.dumps({f"ctx-{c}": _context(c)}) for c in range(N_CONTEXTS + 2)]
    q, ctx = _write(tmp_path, contexts=contexts)
    stats = prepare_personamem([q, ctx], tmp_path / "out")
    assert stats["contexts_in_file"] == 12 and stats["contexts_without_questions"] == 2


def test_inputs_are_checked(tmp_path: Path) -> None:
    q, _ = _write(tmp_path)
    with pytest.raises(ValueError, match="two --input files"):
        prepare_personamem([q], tmp_path / "out")
    with pytest.raises(ValueError, match="two --input files"):
        prepare_personamem([q, q], tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="PersonaMem shared contexts file not found"):
        prepare_personamem([q, tmp_path / "nope.jsonl"], tmp_path / "out")


def test_cli(tmp_path: Path, capsys) -> None:
    q, ctx = _write(tmp_path)
    out = tmp_path / "out"
    assert prepare_main(["personamem", "--input", str(q), str(ctx), "--out", str(out)]) == 0
    assert "prepared personamem" in capsys.readouterr().out
    rows = _rows()
    rows[0]["correct_answer"] = "(z)"
    _write(tmp_path, rows)
    assert prepare_main(["personamem", "--input", str(q), str(ctx), "--out", str(out)]) == 2
    assert "field 'correct_answer': letter 'z' is outside the 4 options" in capsys.readouterr().err
    assert prepare_main(["personamem", "--input", str(q), str(ctx), "--out", str(out), "--skip-invalid"]) == 0
    assert "skipped 1 invalid record(s): {'bad_answer': 1}" in capsys.readouterr().out
    stats = json.loads((out / "stats.json").read_text())
    assert stats["skipped"]["listed"][0]["where"] == "row 1 (line 2)"


def test_config_points_at_the_prepared_folder() -> None:
    from elasticmem.config import load_config

    cfg = load_config(str(ROOT / "configs" / "personamem_32k.yaml"))
    assert cfg.data.dir == "runs/data/personamem_32k" and cfg.bank.dir == "runs/bank/personamem_32k"
    assert cfg.backbone.name_or_path == "smollm2" and cfg.memory.top_z == 9
    assert "--out runs/data/personamem_32k" in (ROOT / "configs" / "personamem_32k.yaml").read_text()
