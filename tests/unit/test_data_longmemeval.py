"""LongMemEval loaders on small fixtures in the documented formats (longmemeval_*.json list, the
published MC-10 JSONL), the streaming JSON list reader, malformed inputs and their errors.

    OMP_NUM_THREADS=1 pytest tests/unit/test_data_longmemeval.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from elasticmem.data.longmemeval import prepare_longmemeval
from elasticmem.data.prepare import main as prepare_main
from elasticmem.data.schema import SPLITS, read_examples
from elasticmem.data.sources import DataError, iter_json_list, split_random

ROOT = Path(__file__).resolve().parents[2]
TYPES = ["single-session-user", "multi-session", "temporal-reasoning", "knowledge-update"]


def _item(i: int, abstention: bool = False) -> dict:
    qid = f"q{i:03d}" + ("_abs" if abstention else "")
    return {
        "question_id": qid,
        "question_type": TYPES[i % len(TYPES)],
        "question": f"What did I say about item {i}?",
        "answer": 7 if i == 1 else f"answer {i}",
        "question_date": "2023/05/30 (Tue) 23:40",
        "haystack_session_ids": [f"s{i}_{j}" for j in range(3)],
        "haystack_dates": [f"2023/05/{20 + j} (Sat) 10:0{j}" for j in range(3)],
        "haystack_sessions": [
            [{"role": "user", "content": f"item {i} session {j}: a [bracket], a \"quote\", {{braces}} and \u00e9"},
             {"role": "assistant", "content": "Noted.", "has_answer": j == 1}]
            for j in range(3)
        ],
        "answer_session_ids": [f"s{i}_1"],
    }


def _items(n: int = 20) -> list[dict]:
    return [_item(i, abstention=i in (3, 11)) for i in range(n)]


def _write(tmp_path: Path, items: list, name: str = "longmemeval_s.json", indent: int | None = 1) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(items, indent=indent, ensure_ascii=False), encoding="utf-8")
    return p


# --------------------------------------------------------------------------- the streaming reader


@pytest.mark.parametrize("read_size", [1, 7, 100, 1 << 20])
@pytest.mark.parametrize("indent", [None, 2])
def test_json_list_reader_matches_json_load(tmp_path: Path, read_size: int, indent) -> None:
    items = [*_items(5), {"x": "]" * 50, "n": [1, 2.5, None, True]}, "a string", 12345, [], {}]
    p = _write(tmp_path, items, indent=indent)
    got = list(iter_json_list(p, read_size=read_size))
    assert [i for i, _ in got] == list(range(len(items)))
    assert [x for _, x in got] == json.loads(p.read_text())


def test_json_list_reader_streams_big_items(tmp_path: Path) -> None:
    big = {"question_id": "big", "text": "w " * 200_000}
    p = tmp_path / "l.json"
    p.write_text("[" + json.dumps(big) + ",\n" + json.dumps(_item(0)) + "]")
    got = [x for _, x in iter_json_list(p, read_size=1024)]
    assert got == [big, _item(0)]


def test_json_list_reader_yields_items_before_a_later_error(tmp_path: Path) -> None:
    p = tmp_path / "l.json"
    p.write_text("[" + json.dumps(_item(0)) + ", {oops}]")
    it = iter_json_list(p, read_size=64)
    assert next(it)[1] == _item(0)
    with pytest.raises(DataError, match=r"item 1 \(character \d+\): malformed JSON") as e:
        next(it)
    assert e.value.reason == "malformed_json" and str(e.value).startswith(str(p))


@pytest.mark.parametrize(
    "text, where, reason",
    [
        ('[{"a": 1}, {"b": "unfinished', "item 1", "truncated"),
        ('[{"a": 1}, {"b": 2', "item 1", "truncated"),
        ('[{"a": 1},', "item 1", "truncated"),
        ('[{"a": 1}  ', "item 1", "truncated"),
        ('[{"a": 1} {"b": 2}]', "item 1", "malformed_json"),
        ('{"a": 1}', "", "not_json_list"),
        ("", "", "not_json_list"),
        ("question_id,question\n", "", "not_json_list"),
    ],
)
def test_json_list_reader_errors(tmp_path: Path, text: str, where: str, reason: str) -> None:
    p = tmp_path / "l.json"
    p.write_text(text)
    with pytest.raises(DataError) as e:
        list(iter_json_list(p, read_size=4))
    assert e.value.reason == reason and e.value.where.startswith(where)
    assert str(e.value).startswith(f"{p} {where}" if where else f"{p}: ")


def test_json_list_reader_empty_list(tmp_path: Path) -> None:
    p = tmp_path / "l.json"
    p.write_text(" \n [ \n ] \n")
    assert list(iter_json_list(p, read_size=2)) == []


# --------------------------------------------------------------------------- longmemeval_*.json


def test_prepare_longmemeval(tmp_path: Path) -> None:
    p = _write(tmp_path, _items())
    stats = prepare_longmemeval("longmemeval", [p], tmp_path / "out")
    assert stats["abstention_questions"] == 2 and stats["free_form_examples"] == 20
    assert [stats["splits"][s]["examples"] for s in SPLITS] == [16, 0, 4]
    assert stats["total"]["groups"] == 20 and stats["total"]["sessions"] == 60 and stats["total"]["turns"] == 120
    assert stats["total"]["chunks"] == 60
    assert stats["total"]["question_types"] == {t: 5 for t in TYPES}
    ids = [it["question_id"] for it in _items()]
    expected = split_random(ids, (0.8, 0.0, 0.2), 42)
    for s in SPLITS:
        exs = read_examples(tmp_path / "out" / f"{s}.jsonl")
        assert sorted(ex.id for ex in exs) == sorted(expected[s])
        assert (tmp_path / "out" / "splits" / f"{s}_ids.txt").read_text().split() == expected[s]
    (ex,) = [ex for s in SPLITS for ex in read_examples(tmp_path / "out" / f"{s}.jsonl") if ex.id == "q001"]
    assert ex.is_free_form and ex.answer_text == "7" and ex.group == "q001" and not ex.extra["abstention"]
    assert [s[0].date for s in ex.history] == ["2023/05/20 (Sat) 10:00", "2023/05/21 (Sat) 10:01",
                                               "2023/05/22 (Sat) 10:02"]
    assert ex.extra["evidence"] == [[1, 1]] and ex.extra["answer_session_ids"] == ["s1_1"]
    assert ex.extra["question_date"] == "2023/05/30 (Tue) 23:40" and len(ex.extra["haystack_session_ids"]) == 3
    assert [t.role for t in ex.history[0]] == ["user", "assistant"]
    abstentions = [e for s in SPLITS for e in read_examples(tmp_path / "out" / f"{s}.jsonl") if e.extra["abstention"]]
    assert sorted(e.id for e in abstentions) == ["q003_abs", "q011_abs"]


def test_split_is_seeded_and_independent_of_file_order(tmp_path: Path) -> None:
    a = prepare_longmemeval("longmemeval", [_write(tmp_path, _items(), "a.json")], tmp_path / "a")
    b = prepare_longmemeval("longmemeval", [_write(tmp_path, _items()[::-1], "b.json")], tmp_path / "b")
    c = prepare_longmemeval("longmemeval", [_write(tmp_path, _items(), "c.json")], tmp_path / "c", seed=1)
    ids = {k: {s: (tmp_path / k / "splits" / f"{s}_ids.txt").read_text() for s in SPLITS} for k in "abc"}
    assert ids["a"] == ids["b"] != ids["c"]
    assert a["split"]["unit"] == b["split"]["unit"] == "question" and c["seed"] == 1


@pytest.mark.parametrize(
    "mutate, field, reason",
    [
        (lambda it: it.pop("answer"), "answer", "missing_field"),
        (lambda it: it.update(answer=""), "answer", "bad_field"),
        (lambda it: it.pop("question"), "question", "missing_field"),
        (lambda it: it.update(haystack_dates=["2023/05/20"]), "haystack_dates", "bad_field"),
        (lambda it: it.update(haystack_session_ids="s1"), "haystack_session_ids", "bad_field"),
        (lambda it: it["haystack_sessions"][2].append({"role": "user", "content": 5}),
         "haystack_sessions[2][2].content", "bad_field"),
        (lambda it: it.update(haystack_sessions=[[], []], haystack_dates=None, haystack_session_ids=None),
         "haystack_sessions", "empty_history"),
    ],
)
def test_invalid_items_name_file_item_and_field(tmp_path: Path, mutate, field: str, reason: str) -> None:
    items = _items(10)
    mutate(items[4])
    p = _write(tmp_path, items)
    with pytest.raises(DataError) as e:
        prepare_longmemeval("longmemeval", [p], tmp_path / "out")
    assert str(e.value).startswith(f"{p} item 4 (question_id 'q004'): field '{field}': ")
    assert not (tmp_path / "out" / "train.jsonl").exists()
    stats = prepare_longmemeval("longmemeval", [p], tmp_path / "out", skip_invalid=True)
    assert stats["skipped"]["by_reason"] == {reason: 1} and stats["total"]["examples"] == 9
    assert stats["skipped"]["listed"][0]["field"] == field
    assert "q004" not in (tmp_path / "out" / "splits" / "train_ids.txt").read_text()


def test_truncated_file(tmp_path: Path) -> None:
    p = _write(tmp_path, _items(10))
    text = p.read_text()
    p.write_text(text[: text.index('"q007"') + 20])
    with pytest.raises(DataError, match=rf"{re.escape(str(p))} item 7 \(character \d+\): truncated JSON"):
        prepare_longmemeval("longmemeval", [p], tmp_path / "out")
    stats = prepare_longmemeval("longmemeval", [p], tmp_path / "out", skip_invalid=True)
    assert stats["skipped"]["by_reason"] == {"truncated": 1} and stats["total"]["examples"] == 7


def test_wrong_files(tmp_path: Path) -> None:
    p = tmp_path / "lme_mc10.jsonl"
    p.write_text(json.dumps(_mc10(0)) + "\n")
    with pytest.raises(DataError, match="expected a JSON list.*prepare longmemeval-mc10-jsonl"):
        prepare_longmemeval("longmemeval", [p], tmp_path / "out", skip_invalid=True)
    locomo_like = _write(tmp_path, [{"sample_id": "conv-1", "conversation": {}, "qa": []}])
    with pytest.raises(DataError, match=r"item 0: field 'question_id': missing \(is this a LongMemEval file\?"):
        prepare_longmemeval("longmemeval", [locomo_like], tmp_path / "out")
    # With --skip-invalid every item is skipped: still an error, and it says why.
    with pytest.raises(DataError, match=r"no valid example in the input \(1 record\(s\) skipped"):
        prepare_longmemeval("longmemeval", [locomo_like], tmp_path / "out", skip_invalid=True)


# --------------------------------------------------------------------------- published MC-10 JSONL


def _mc10(i: int, **kw) -> dict:
    it = _item(i, abstention=i == 2)
    r = {"question_id": it["question_id"], "question": it["question"], "choices": [f"opt {k}" for k in range(10)],
         "correct_choice_index": i % 10, "question_type": it["question_type"], "answer": f"opt {i % 10}",
         "haystack_sessions": it["haystack_sessions"], "haystack_dates": it["haystack_dates"]}
    r.update(kw)
    return r


def test_prepare_mc10_jsonl(tmp_path: Path) -> None:
    p = tmp_path / "lme_s_mc10.json"
    p.write_text("".join(json.dumps(_mc10(i)) + "\n" for i in range(10)))
    stats = prepare_longmemeval("longmemeval-mc10-jsonl", [p], tmp_path / "out")
    assert [stats["splits"][s]["examples"] for s in SPLITS] == [8, 0, 2]
    assert stats["abstention_questions"] == 1 and stats["free_form_examples"] == 0
    exs = {e.id: e for s in SPLITS for e in read_examples(tmp_path / "out" / f"{s}.jsonl")}
    e = exs["q002_abs"]
    assert e.extra["abstention"] and e.answer_index == 2 and e.answer_text == "opt 2" and e.group == "q002_abs"
    assert len(e.choices) == 10 and e.history[2][0].date == "2023/05/22 (Sat) 10:02"
    assert e.extra["evidence"] == [[1, 1]] and e.extra["answer"] == "opt 2"


def test_mc10_jsonl_errors(tmp_path: Path) -> None:
    p = tmp_path / "lme_s_mc10.json"
    lines = [json.dumps(_mc10(i)) for i in range(5)]
    lines[2] = json.dumps(_mc10(2, correct_choice_index=-1))
    lines[3] = lines[3][:40]
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(p))} line 3 \(question_id 'q002_abs'\): field "
                       r"'correct_choice_index': -1 is outside the 10 choices"):
        prepare_longmemeval("longmemeval-mc10-jsonl", [p], tmp_path / "out")
    stats = prepare_longmemeval("longmemeval-mc10-jsonl", [p], tmp_path / "out", skip_invalid=True)
    assert stats["skipped"]["by_reason"] == {"bad_answer": 1, "malformed_json": 1}
    assert stats["total"]["examples"] == 3
    lines[0] = lines[1]  # the same question twice
    p.write_text("\n".join(lines[:2]) + "\n")
    with pytest.raises(DataError, match=r"line 2: field 'id': duplicate example id 'q001'"):
        prepare_longmemeval("longmemeval-mc10-jsonl", [p], tmp_path / "out")


# --------------------------------------------------------------------------- CLI and config


def test_cli(tmp_path: Path, capsys) -> None:
    p = _write(tmp_path, _items())
    assert prepare_main(["longmemeval", "--input", str(p), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "prepared longmemeval" in out and "split by question" in out
    assert prepare_main(["longmemeval", "--input", str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2
    assert "LongMemEval input not found" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["inputs"][0]["sha256"]


def test_config_points_at_the_prepared_folder() -> None:
    from elasticmem.config import load_config

    cfg = load_config(str(ROOT / "configs" / "longmemeval_s_mc10.yaml"))
    assert cfg.data.dir == "runs/data/longmemeval_s_mc10" and cfg.bank.dir == "runs/bank/longmemeval_s_mc10"
    assert cfg.backbone.name_or_path == "smollm2" and cfg.memory.top_z == 20
    assert "--out runs/data/longmemeval_s_mc10" in (ROOT / "configs" / "longmemeval_s_mc10.yaml").read_text()


def test_json_list_reader_reports_bad_syntax_without_reading_on(tmp_path: Path, monkeypatch) -> None:
    # A syntax error early in a large file is reported from the first buffer, not at EOF.
    p = tmp_path / "l.json"
    p.write_text('[{"a": tru}, ' + ", ".join(json.dumps(_item(i)) for i in range(200)) + "]")
    reads: list[int] = []
    orig = Path.open

    def spy_open(self, *a, **k):
        f = orig(self, *a, **k)
        read = f.read
        f.read = lambda n=-1: reads.append(n) or read(n)  # the text wrapper allows a new attribute
        return f

    monkeypatch.setattr(Path, "open", spy_open)
    with pytest.raises(DataError, match=r"item 0 \(character 1\): malformed JSON \(Expecting value"):
        list(iter_json_list(p, read_size=256))
    assert 0 < sum(reads) < 2048 < p.stat().st_size
