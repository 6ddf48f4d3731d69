"""LoCoMo loaders: the real locomo10.json (free-form QA, MC-10, split), small fixtures in each
documented format, malformed inputs and their errors, the free-form schema, the configs.

    OMP_NUM_THREADS=1 pytest tests/unit/test_data_locomo.py

The real-data tests read ``../shared/data/locomo10.json`` (relative to the repo root) and skip,
saying so, where it is absent; nothing is copied into the repository.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from conftest import locomo_conversation as _conversation
from conftest import locomo_file as _fixture

from elasticmem.data import locomo
from elasticmem.data.locomo import ADVERSARIAL_ANSWER, prepare_locomo, read_locomo
from elasticmem.data.prepare import main as prepare_main
from elasticmem.data.schema import SPLITS, Example, SchemaError, iter_examples, read_examples, write_examples
from elasticmem.data.sources import DataError, SkipLog

ROOT = Path(__file__).resolve().parents[2]
LOCOMO = ROOT.parent / "shared" / "data" / "locomo10.json"
requires_locomo = pytest.mark.skipif(
    not LOCOMO.is_file(), reason=f"real LoCoMo file not found at {LOCOMO} (../shared/data is absent)")
CONVERSATIONS = ["conv-26", "conv-30", "conv-41", "conv-42", "conv-43", "conv-44", "conv-47", "conv-48", "conv-49",
                 "conv-50"]


def _lines(path: Path, keep_history: int = 0) -> list[dict]:
    """Decoded JSONL objects, histories dropped after the first ``keep_history`` (only a group's
    first line carries its ~100 KB history)."""
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if len(out) >= keep_history:
                    r.pop("history", None)
                out.append(r)
    return out


# --------------------------------------------------------------------------- the real file


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, Path]:
    """Both real datasets prepared once for the module."""
    if not LOCOMO.is_file():
        pytest.skip(f"real LoCoMo file not found at {LOCOMO} (../shared/data is absent)")
    base = tmp_path_factory.mktemp("locomo")
    for kind in ("locomo-qa", "locomo-mc10"):
        prepare_locomo(kind, [LOCOMO], base / kind)
    return {"qa": base / "locomo-qa", "mc10": base / "locomo-mc10", "base": base}


@pytest.fixture(scope="module")
def rows(real) -> dict[str, dict[str, list[dict]]]:
    """The prepared lines per dataset and split, read once (histories kept for the first 50 only)."""
    return {k: {s: _lines(real[k] / f"{s}.jsonl", keep_history=50) for s in SPLITS} for k in ("qa", "mc10")}


@requires_locomo
def test_real_file_counts() -> None:
    convs = read_locomo(LOCOMO, SkipLog())
    assert [c.sample_id for c in convs] == CONVERSATIONS
    assert sum(len(c.history) for c in convs) == 272
    assert sum(len(s) for c in convs for s in c.history) == 5882
    assert sum(len(c.qa) for c in convs) == 1986
    assert Counter(q.category for c in convs for q in c.qa) == {1: 282, 2: 321, 3: 96, 4: 841, 5: 446}


def test_real_free_form_qa(real, rows) -> None:
    stats = json.loads((real["qa"] / "stats.json").read_text())
    total = stats["total"]
    assert (total["examples"], total["groups"], total["sessions"], total["turns"]) == (1986, 10, 272, 5882)
    assert total["question_types"] == {"multi_hop": 282, "temporal": 321, "open_domain": 96, "single_hop": 841,
                                       "adversarial": 446}
    assert stats["skipped"]["total"] == 0 and stats["free_form_examples"] == 1986
    rows = [r for s in SPLITS for r in rows["qa"][s]]
    assert len(rows) == 1986 and len({r["id"] for r in rows}) == 1986
    by_cat = Counter(r["category"] for r in rows)
    assert by_cat == {1: 282, 2: 321, 3: 96, 4: 841, 5: 446}
    for r in rows:
        assert r["choices"] == [] and r["answer_index"] == -1 and r["answer_text"].strip()
        assert r["question_type"] == locomo.CATEGORY_NAMES[r["category"]]
    adversarial = [r for r in rows if r["category"] == 5]
    assert all("adversarial_answer" in r for r in adversarial)
    # Two adversarial items carry the dataset's own answer ("No"); the rest answer "not mentioned".
    assert Counter(r["answer_text"] for r in adversarial) == {ADVERSARIAL_ANSWER: 444, "No": 2}
    assert {r["answer_text"] for r in rows if r["question"].startswith("How many children does Melanie")} == {"3"}
    ex = next(iter_examples(real["qa"] / "test.jsonl"))
    assert ex.is_free_form and ex.answer_letter == ""


def test_real_turns_keep_speakers_dates_and_captions(rows) -> None:
    first = rows["qa"]["train"][0]
    assert first["group"] == "conv-26"
    turns = [t for s in first["history"] for t in s]
    assert {t["speaker"] for t in turns} == {"Caroline", "Melanie"}
    assert {t["role"] for t in turns if t["speaker"] == "Caroline"} == {"user"}
    assert {t["role"] for t in turns if t["speaker"] == "Melanie"} == {"assistant"}
    assert first["history"][0][0]["date"] == "1:56 pm on 8 May, 2023"
    assert all(len({t["date"] for t in s}) == 1 for s in first["history"])
    assert sum("[shares a photo: " in t["content"] for t in turns) > 10
    # The evidence of the first question points at the turn its dia_id names.
    raw = json.loads(LOCOMO.read_text())[0]
    dia = {t["dia_id"]: t for k, v in raw["conversation"].items() if re.fullmatch(r"session_\d+", k) for t in v}
    checked = 0
    for r in rows["qa"]["train"][:50]:
        assert r["group"] == "conv-26" and r.get("history", first["history"]) == first["history"]
        ids = r["evidence_dia_ids"]
        if all(re.fullmatch(r"D\d+:\d+", d) for d in ids) and len(set(ids)) == len(ids):
            for (s, t), d in zip(r["evidence"], ids):
                assert first["history"][s][t]["content"].startswith(dia[d]["text"])
                checked += 1
    assert checked > 30


def test_real_mc10(real, rows) -> None:
    stats = json.loads((real["mc10"] / "stats.json").read_text())
    assert stats["excluded"] == {"adversarial": 446}
    assert stats["total"]["examples"] == 1986 - 446
    assert sum(stats["distractor_fallback"].values()) == 1540
    n = 0
    for split in SPLITS:
        for r in rows["mc10"][split]:
            n += 1
            assert r["question_type"] != "adversarial" and r["category"] != 5
            assert len(r["choices"]) == 10 and len(set(r["choices"])) == 10
            assert len({locomo.normalize_answer(c) for c in r["choices"]}) == 10
            assert r["choices"][r["answer_index"]] == r["answer_text"]
    assert n == 1540
    positions = Counter(r["answer_index"] for r in rows["mc10"]["train"])
    assert len(positions) == 10 and max(positions.values()) < 3 * min(positions.values())


def test_real_mc10_is_deterministic_by_seed(rows) -> None:
    # Regenerated in memory (writing 200 MB twice more would only re-test json.dumps).
    def generate(seed: int) -> list[tuple]:
        convs = read_locomo(LOCOMO, SkipLog())
        return [(ex.id, ex.choices, ex.answer_index) for ex in locomo.mc10_examples(convs, seed, {})]

    written = [(r["id"], r["choices"], r["answer_index"]) for s in SPLITS for r in rows["mc10"][s]]
    again = generate(42)
    assert sorted(again) == sorted(written) and again == generate(42)
    other = generate(7)
    assert [x[0] for x in other] == [x[0] for x in again]
    assert sum(a != b for a, b in zip(other, again)) > 1400


def test_real_split_is_6_2_2_by_sorted_conversation(real, rows) -> None:
    for kind in ("qa", "mc10"):
        d = real[kind]
        groups = {s: {r["group"] for r in rows[kind][s]} for s in SPLITS}
        assert groups == {"train": set(CONVERSATIONS[:6]), "val": set(CONVERSATIONS[6:8]),
                          "test": set(CONVERSATIONS[8:])}
        for s in SPLITS:
            assert (d / "splits" / f"{s}_ids.txt").read_text().split() == sorted(groups[s])
        stats = json.loads((d / "stats.json").read_text())
        assert [stats["splits"][s]["groups"] for s in SPLITS] == [6, 2, 2]
    assert [json.loads((real["qa"] / "stats.json").read_text())["splits"][s]["examples"] for s in SPLITS] == \
        [1157, 429, 400]




# --------------------------------------------------------------------------- small fixtures


def test_fixture_histories_and_roles(tmp_path: Path) -> None:
    convs = read_locomo(_fixture(tmp_path, n_conv=1), SkipLog())
    (c,) = convs
    assert len(c.history) == 2 and [len(s) for s in c.history] == [3, 2]
    t = c.history[0][2]
    assert (t.role, t.speaker, t.date) == ("user", "Ann", "1:00 pm on 1 May, 2023")
    assert t.content == "Look. [shares a photo: a photo of a cat]"
    assert [t.role for t in c.history[1]] == ["assistant", "user"]
    assert locomo.evidence_positions(c, ["D1:1; D2:2", "D", "D9:9"]) == [[0, 0], [1, 1]]
    assert c.qa[-1].answer == "2022"  # integer answers become strings


def test_frozen_splits_are_reused(tmp_path: Path) -> None:
    p = _fixture(tmp_path)
    prepare_locomo("locomo-qa", [p], tmp_path / "first")
    frozen = tmp_path / "first" / "splits"
    stats = prepare_locomo("locomo-qa", [p], tmp_path / "again", splits_dir=frozen)
    for s in SPLITS:
        assert (tmp_path / "again" / f"{s}.jsonl").read_bytes() == (tmp_path / "first" / f"{s}.jsonl").read_bytes()
    (frozen / "train_ids.txt").write_text("".join(f"conv-{i}\n" for i in range(3, 11)))
    (frozen / "val_ids.txt").write_text("conv-1\n")
    (frozen / "test_ids.txt").write_text("conv-2\nconv-99\n")
    stats = prepare_locomo("locomo-qa", [p], tmp_path / "out", splits_dir=frozen)
    assert [stats["splits"][s]["groups"] for s in SPLITS] == [8, 1, 1]
    assert stats["split"]["listed_ids_absent_from_data"] == ["conv-99"]
    assert stats["split"]["frozen_from"] == str(frozen)


def test_frozen_splits_must_cover_the_data(tmp_path: Path) -> None:
    p = _fixture(tmp_path)
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    for s in SPLITS:
        (frozen / f"{s}_ids.txt").write_text("conv-1\n" if s == "train" else "")
    with pytest.raises(DataError, match=r"9 id\(s\) of the data are in no split list"):
        prepare_locomo("locomo-qa", [p], tmp_path / "out", splits_dir=frozen)
    (frozen / "val_ids.txt").write_text("conv-1\n")
    with pytest.raises(DataError, match=r"id 'conv-1' is also listed in train_ids.txt"):
        prepare_locomo("locomo-qa", [p], tmp_path / "out", splits_dir=frozen)
    (frozen / "val_ids.txt").unlink()
    with pytest.raises(FileNotFoundError, match="val_ids.txt"):
        prepare_locomo("locomo-qa", [p], tmp_path / "out", splits_dir=frozen)


def test_fixture_split_uses_natural_id_order(tmp_path: Path) -> None:
    stats = prepare_locomo("locomo-qa", [_fixture(tmp_path)], tmp_path / "out")
    ids = {s: (tmp_path / "out" / "splits" / f"{s}_ids.txt").read_text().split() for s in SPLITS}
    assert ids == {"train": [f"conv-{i}" for i in range(1, 7)], "val": ["conv-7", "conv-8"],
                   "test": ["conv-9", "conv-10"]}
    assert stats["total"]["question_types"]["adversarial"] == 10


def test_fixture_mc10_distractors_fall_back_to_the_dataset(tmp_path: Path) -> None:
    # 3 answers per category and conversation: 9 distractors need the dataset-wide pools.
    stats = prepare_locomo("locomo-mc10", [_fixture(tmp_path)], tmp_path / "out", seed=3)
    assert stats["excluded"] == {"adversarial": 10}
    assert stats["distractor_fallback"]["none"] == 0
    assert stats["distractor_fallback"]["same_category_dataset"] == 130

    def category(answer: str) -> int:  # the fixture's answer i has category (i % 4) + 1; 2022 is temporal
        return 2 if answer == "2022" else int(answer.split("-")[1]) % 4 + 1

    for ex in read_examples(tmp_path / "out" / "train.jsonl"):
        assert len(set(ex.choices)) == 10 and ex.choices[ex.answer_index] == ex.answer_text
        assert {category(c) for c in ex.choices} == {ex.extra["category"]}


def test_pick_distractors_never_picks_an_equivalent_answer() -> None:
    import random

    pool = ["2022", "In 2022", "2022.", "Paris", "paris, France", "Lyon", "Nice", "the Lyon"]
    for seed in range(20):
        picked, used = locomo.pick_distractors("2022", [pool], 3, random.Random(seed))
        assert used == 1 and len(picked) == 3 and set(picked) <= {"Paris", "paris, France", "Lyon", "Nice"}
    picked, used = locomo.pick_distractors("2022", [pool[:4], ["Rome", "Oslo"], ["Bern"]], 4, random.Random(0))
    assert used == 3 and picked[:1] == ["Paris"] and set(picked[1:]) == {"Rome", "Oslo", "Bern"}


# --------------------------------------------------------------------------- published MC-10 JSONL


def _mc10_record(qid: str, conv: str | None = None, **kw) -> dict:
    hay = conv or re.sub(r"_q\d+$", "", qid)  # the questions of one conversation share its haystack
    r = {"question_id": qid, "question": f"{qid}?", "choices": [f"c{i}" for i in range(10)],
         "correct_choice_index": 3, "question_type": "single_hop", "answer": "c3",
         "haystack_sessions": [[{"role": "user", "content": f"hi {hay}"},
                                {"role": "assistant", "content": "hello", "has_answer": True}]],
         "haystack_session_datetimes": ["2023-05-01"]}
    if conv:
        r["conversation_id"] = conv
    r.update(kw)
    return r


def test_published_mc10_jsonl_read_as_is(tmp_path: Path) -> None:
    recs = [_mc10_record(f"conv-{c}_q{q}") for c in range(10) for q in range(2)]
    recs.append(_mc10_record("x1", conv="conv-99"))
    p = tmp_path / "locomo_mc10.json"
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    stats = prepare_locomo("locomo-mc10-jsonl", [p], tmp_path / "out")
    assert stats["total"]["groups"] == 11 and stats["total"]["examples"] == 21
    ex = [e for s in SPLITS for e in read_examples(tmp_path / "out" / f"{s}.jsonl")]
    (x1,) = [e for e in ex if e.id == "x1"]
    assert x1.group == "conv-99" and x1.answer_index == 3 and x1.answer_text == "c3"
    assert x1.history[0][0].date == "2023-05-01" and x1.extra["answer"] == "c3"
    assert x1.extra["evidence"] == [[0, 1]]
    assert {e.group for e in ex if e.id.startswith("conv-0_")} == {"conv-0"}


def test_published_mc10_without_conversation_ids_groups_by_haystack(tmp_path: Path) -> None:
    recs = [_mc10_record(f"q{i}", conv=None) for i in range(4)]
    for r in recs[2:]:
        r["haystack_sessions"] = recs[0]["haystack_sessions"]
    p = tmp_path / "mc.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    stats = prepare_locomo("locomo-mc10-jsonl", [p], tmp_path / "out")
    assert stats["total"]["groups"] == 2 and stats["groups_from_haystack"] == 2


@pytest.mark.parametrize(
    "mutate, where, message, reason",
    [
        (lambda r: r.update(correct_choice_index=10), "line 2", r"field 'correct_choice_index': 10 is outside", "bad_answer"),
        (lambda r: r.pop("choices"), "line 2", r"field 'choices': missing", "missing_field"),
        (lambda r: r.update(haystack_sessions=[[{"role": "user"}]]), "line 2",
         r"field 'haystack_sessions\[0\]\[0\]\.content'", "bad_field"),
        (lambda r: r.update(haystack_session_datetimes=["a", "b"]), "line 2", r"field 'haystack_session_datetimes'",
         "bad_field"),
    ],
)
def test_published_mc10_errors_name_file_line_and_field(tmp_path: Path, mutate, where, message, reason) -> None:
    good, bad = _mc10_record("conv-1_q0"), _mc10_record("conv-1_q1")
    mutate(bad)
    p = tmp_path / "mc.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=message) as e:
        prepare_locomo("locomo-mc10-jsonl", [p], tmp_path / "out")
    assert str(e.value).startswith(f"{p} {where}")
    stats = prepare_locomo("locomo-mc10-jsonl", [p], tmp_path / "out", skip_invalid=True)
    assert stats["skipped"]["by_reason"] == {reason: 1} and stats["total"]["examples"] == 1
    assert stats["skipped"]["listed"][0]["where"].startswith(where)


def test_published_mc10_truncated_last_line(tmp_path: Path) -> None:
    p = tmp_path / "mc.jsonl"
    p.write_text(json.dumps(_mc10_record("conv-1_q0")) + "\n" + json.dumps(_mc10_record("conv-1_q1"))[:50])
    with pytest.raises(DataError, match=rf"{re.escape(str(p))} line 2: malformed JSON .*truncated file\?"):
        prepare_locomo("locomo-mc10-jsonl", [p], tmp_path / "out")
    stats = prepare_locomo("locomo-mc10-jsonl", [p], tmp_path / "out", skip_invalid=True)
    assert stats["skipped"]["by_reason"] == {"malformed_json": 1}


# --------------------------------------------------------------------------- malformed locomo10.json


def test_truncated_locomo_file(tmp_path: Path) -> None:
    p = _fixture(tmp_path, n_conv=2)
    p.write_text(p.read_text()[:-200])
    with pytest.raises(DataError, match=rf"{re.escape(str(p))} line \d+ column \d+: truncated JSON"):
        prepare_locomo("locomo-qa", [p], tmp_path / "out", skip_invalid=True)  # nothing to salvage


def test_wrong_file_says_what_it_expected(tmp_path: Path) -> None:
    p = tmp_path / "mc.jsonl"
    p.write_text(json.dumps(_mc10_record("q1")) + "\n")
    with pytest.raises(DataError, match="prepare locomo-mc10-jsonl"):
        prepare_locomo("locomo-mc10", [p], tmp_path / "out")
    p.write_text(json.dumps([{"question_id": "q"}]))
    with pytest.raises(DataError, match=r"item 0: field 'sample_id': missing \(is this locomo10.json\?"):
        prepare_locomo("locomo-qa", [p], tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        prepare_locomo("locomo-qa", [tmp_path / "nope.json"], tmp_path / "out")


@pytest.mark.parametrize(
    "mutate, where, field, reason",
    [
        (lambda d: d[1]["qa"][0].pop("category"), "item 1 (conv-2) qa[0]", "category", "missing_field"),
        (lambda d: d[1]["qa"][0].update(category=7), "item 1 (conv-2) qa[0]", "category", "bad_field"),
        (lambda d: d[1]["qa"][0].pop("answer"), "item 1 (conv-2) qa[0]", "answer", "missing_field"),
        (lambda d: d[1]["conversation"]["session_2"][0].update(speaker="Eve"), "item 1 (conv-2)",
         "conversation.session_2[0].speaker", "bad_field"),
        (lambda d: d[1]["conversation"]["session_1"][1].pop("text"), "item 1 (conv-2)",
         "conversation.session_1[1].text", "bad_field"),
    ],
)
def test_invalid_records_name_file_place_and_field(tmp_path: Path, mutate, where, field, reason) -> None:
    p = _fixture(tmp_path, n_conv=3)
    data = json.loads(p.read_text())
    mutate(data)
    p.write_text(json.dumps(data))
    with pytest.raises(DataError) as e:
        prepare_locomo("locomo-qa", [p], tmp_path / "out")
    assert str(e.value).startswith(f"{p} {where}: field '{field}': ")
    assert not (tmp_path / "out" / "train.jsonl").exists() and not list((tmp_path / "out").glob("*.tmp"))
    stats = prepare_locomo("locomo-qa", [p], tmp_path / "out", skip_invalid=True)
    assert stats["skipped"]["by_reason"] == {reason: 1}
    assert stats["skipped"]["listed"][0]["field"] == field
    lost = 1 if "qa[" in where else 14  # one question, or the whole conversation
    assert stats["total"]["examples"] == 3 * 14 - lost


def test_cli(tmp_path: Path, capsys) -> None:
    p = _fixture(tmp_path)
    assert prepare_main(["locomo-mc10", "--input", str(p), "--out", str(tmp_path / "out"), "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "prepared locomo-mc10" in out and "excluded: {'adversarial': 10}" in out
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    assert prepare_main(["locomo-qa", "--input", str(bad), "--out", str(tmp_path / "o2")]) == 2
    assert f"error: {bad} line 1 column 3: truncated JSON" in capsys.readouterr().err
    assert prepare_main(["nope"]) == 2


# --------------------------------------------------------------------------- free-form schema


GOOD = {"id": "e1", "source": "s", "group": "g", "question": "q?", "choices": [], "answer_index": -1,
        "answer_text": "Paris", "question_type": "t", "history": [[{"role": "user", "content": "hi"}]]}


def test_free_form_examples_round_trip(tmp_path: Path) -> None:
    ex = Example.from_json(GOOD)
    assert ex.is_free_form and ex.answer_letter == ""
    write_examples(tmp_path / "a.jsonl", [ex])
    assert read_examples(tmp_path / "a.jsonl") == [ex]
    mc = Example.from_json({**GOOD, "choices": ["x", "y"], "answer_index": 0})
    assert not mc.is_free_form and mc.answer_letter == "a"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"answer_text": ""}, "'answer_text' is missing or empty"),
        ({"answer_text": None}, "'answer_text' is missing or empty"),
        ({"answer_index": 0}, "'answer_index' = 0 but 'choices' is empty"),
        ({"choices": ["x", "y"]}, "'answer_index' = -1 is outside the 2 choices"),
        ({"choices": ["x"], "answer_index": 0}, "at least 2 options"),
    ],
)
def test_free_form_validation(change: dict, message: str) -> None:
    d = {**GOOD, **change}
    with pytest.raises(SchemaError, match=re.escape(message)):
        Example.from_json(d, "f.jsonl:3")


# --------------------------------------------------------------------------- configs and the bank


@pytest.mark.parametrize("name, data_dir", [("locomo_mc10", "runs/data/locomo_mc10"),
                                            ("locomo_qa", "runs/data/locomo_qa")])
def test_configs_point_at_the_prepared_folders(name: str, data_dir: str) -> None:
    from elasticmem.config import load_config

    cfg = load_config(str(ROOT / "configs" / f"{name}.yaml"))
    assert cfg.data.dir == data_dir and cfg.bank.dir == f"runs/bank/{name}"
    assert cfg.backbone.name_or_path == "smollm2"
    text = (ROOT / "configs" / f"{name}.yaml").read_text()
    assert f"prepare {name.replace('_', '-')} " in text and f"--out {data_dir}" in text


def test_bank_builds_on_prepared_mc10_test_split(real, tiny_backbone, tmp_path: Path) -> None:
    import torch

    from elasticmem.bank import Bank, build_bank
    from elasticmem.config import BankConfig, ChunkingConfig

    examples = read_examples(real["mc10"] / "test.jsonl")
    cfg = BankConfig(dir=str(tmp_path / "bank"), n_cache=4, batch_size=64, shard_rows=4096)
    res = build_bank({"test": examples}, tiny_backbone, ChunkingConfig(max_tokens=32), cfg, torch.float32,
                     show_progress=False)
    stats = json.loads((real["mc10"] / "stats.json").read_text())["splits"]["test"]
    assert (res.num_groups, res.num_chunks) == (stats["groups"], stats["chunks"]) == (2, 569)
    bank = Bank.open(cfg.dir, expect_fingerprint=tiny_backbone.fingerprint)
    assert bank.num_chunks == 569
