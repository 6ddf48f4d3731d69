"""Hugging Face ``datasets`` under the data layer: prepare's inputs through it (local files with
--via-datasets, saved datasets, folders, Hub ids from the cache) give the files the streaming
readers give, byte for byte; its errors; prepared splits as a ``datasets.Dataset``.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_data_datasets.py

No network: ``datasets`` runs offline (HF_HUB_OFFLINE=1, set by conftest and checked here), a Hub
id is served from a datasets cache built here in the layout a download leaves, and the cache is a
temporary folder. The real files are read from ``../shared/data`` (LoCoMo; LongMemEval and
PersonaMem when present) and their tests skip, saying so, where they are absent; fixtures in each
documented format run everywhere.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from elasticmem.data.hub import HubSpec, Table, open_input, parse_hub_spec, split_suffix
from elasticmem.data.locomo import prepare_locomo
from elasticmem.data.longmemeval import prepare_longmemeval
from elasticmem.data.personamem import prepare_personamem
from elasticmem.data.prepare import main as prepare_main
from elasticmem.data.schema import SchemaError, load_split
from elasticmem.data.sources import DataError

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
LOCOMO = SHARED / "locomo10.json"
OUTPUTS = ["train.jsonl", "val.jsonl", "test.jsonl", "splits/train_ids.txt", "splits/val_ids.txt",
           "splits/test_ids.txt"]


@pytest.fixture(autouse=True)
def offline_cache(tmp_path_factory, monkeypatch) -> Path:
    """A private datasets cache, and no network (a download attempt would fail the test)."""
    cache = tmp_path_factory.mktemp("hf_datasets_cache")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return cache


def _same_files(a: Path, b: Path, stats_inputs_equal: bool = True) -> None:
    """Every prepared file equal byte for byte; stats.json too, but for its ``inputs`` when the
    input was not a local file (it then names the dataset instead of a file's sha256)."""
    for name in OUTPUTS:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    if stats_inputs_equal:
        assert (a / "stats.json").read_bytes() == (b / "stats.json").read_bytes()
    else:
        sa, sb = (json.loads((d / "stats.json").read_text()) for d in (a, b))
        assert sa.pop("inputs") != sb.pop("inputs") and sa == sb


def _cache_as_hub(files: list[Path], repo: str, cache: Path) -> None:
    """Put ``files`` in the datasets cache as ``load_dataset(repo)`` leaves a downloaded Hub dataset
    (``owner___name/default/0.0.0/HASH/{name}-train.arrow`` + dataset_info.json), so that loading
    ``repo`` offline finds it there, as it would after one online run."""
    from datasets.packaged_modules.json.json import Json

    owner, name = repo.split("/")
    builder = Json(cache_dir=str(cache), dataset_name=f"{owner}___{name}", hash="0123abcd",
                   data_files={"train": [str(f) for f in files]})
    builder.download_and_prepare()
    built = Path(builder.cache_dir)  # .../owner___name/default-<id>/0.0.0/0123abcd
    (built / f"{owner}___{name}-train.arrow").rename(built / f"{name}-train.arrow")
    built.parents[1].rename(built.parents[2] / "default")


# --------------------------------------------------------------------------- fixtures in each format


def _lme_items(n: int = 12) -> list[dict]:
    """LongMemEval items with what makes Arrow schemas ragged: has_answer on some turns only,
    a numeric answer, a key only some items have."""
    items = []
    for i in range(n):
        item = {"question_id": f"q{i:02d}" + ("_abs" if i == 3 else ""), "question_type": "multi-session",
                "question": f"What about {i}?", "answer": 7 if i == 1 else f"answer {i}",
                "question_date": "2023/05/30 (Tue) 23:40", "haystack_session_ids": [f"s{i}a", f"s{i}b"],
                "haystack_dates": ["2023/05/20 (Sat) 10:00", "2023/05/21 (Sun) 11:00"],
                "haystack_sessions": [[{"role": "user", "content": f"item {i}: \u00e9 [x] {{y}}"},
                                       {"role": "assistant", "content": "Noted.", "has_answer": True}],
                                      [{"role": "user", "content": "later"}]],
                "answer_session_ids": [f"s{i}a"]}
        if i % 4 == 0:
            item["note"] = {"kept": [1, "two"]}
        items.append(item)
    return items


def _mc10_lines(n: int = 8) -> list[dict]:
    """Published MC-10 records; a field only some have is kept verbatim, so a null Arrow puts in
    the others would show in the output."""
    return [{"question_id": f"conv-{i % 2}_q{i}", "question": f"Which {i}?",
             "choices": [f"choice {i}-{k}" for k in range(10)], "correct_choice_index": i % 10,
             "question_type": "single_hop",
             "haystack_sessions": [[{"role": "user", "content": f"conversation {i % 2}"},
                                    {"role": "assistant", "content": "ok"}]],
             **({"annotator": f"a{i}"} if i % 3 == 0 else {})} for i in range(n)]


def _persona_files(d: Path) -> tuple[Path, Path]:
    cols = ["persona_id", "question_id", "question_type", "topic", "stereotypical", "user_question_or_message",
            "correct_answer", "all_options", "shared_context_id", "end_index_in_shared_context"]
    q, ctx = d / "questions_32k.csv", d / "shared_contexts_32k.jsonl"
    with q.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for c in range(10):
            for k, end in enumerate((3, 3, 5)):  # two questions share the history of end index 3
                opts = [f"({'abcd'[j]}) reply {c}-{k}-{j}, with a comma" for j in range(4)]
                # "NA" is text to PersonaMem, a missing value to pandas' defaults.
                topic = "NA" if c == 3 else "hiking"
                w.writerow([c, f"ctx{c}-q{k}", "recall", topic, "False", f"Question {k}?\nline 2",
                            f"({'abcd'[(c + k) % 4]})", repr(opts), f"ctx-{c}", end])
    turns = [{"role": "system", "content": "Persona."}] + [
        {"role": "user" if t % 2 else "assistant", "content": f"turn {t}"} for t in range(1, 6)]
    ctx.write_text("".join(json.dumps({f"ctx-{c}": turns}) + "\n" for c in range(10)), encoding="utf-8")
    return q, ctx


def _write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1), encoding="utf-8")
    return path


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- the same output both ways


def test_longmemeval_through_datasets_equals_the_streaming_reader(tmp_path: Path, offline_cache: Path) -> None:
    src = _write_json(tmp_path / "longmemeval_s.json", _lme_items())
    prepare_longmemeval("longmemeval", [src], tmp_path / "file")
    assert not (offline_cache / "json").exists()  # the streaming reader leaves the datasets cache alone
    prepare_longmemeval("longmemeval", [src], tmp_path / "via", via_datasets=True)
    _same_files(tmp_path / "file", tmp_path / "via")
    # The CLI's flag and its dotted form read through load_dataset("json") too (it caches the file).
    for name, args in [("cli", ["--input", str(src), "--out", str(tmp_path / "cli"), "--via-datasets"]),
                       ("dotted", [f"prepare.input=[{src}]", f"prepare.out={tmp_path / 'dotted'}",
                                   "prepare.via_datasets=true"])]:
        shutil.rmtree(offline_cache / "json")
        assert prepare_main(["longmemeval", *args]) == 0
        assert (offline_cache / "json").is_dir(), name
        _same_files(tmp_path / "file", tmp_path / name)
    # A folder of data files, read as load_dataset reads a Hub repository.
    (tmp_path / "folder").mkdir()
    _write_json(tmp_path / "folder" / "longmemeval_s.json", _lme_items())
    prepare_longmemeval("longmemeval", [tmp_path / "folder"], tmp_path / "folder_out")
    _same_files(tmp_path / "file", tmp_path / "folder_out", stats_inputs_equal=False)


def test_mc10_jsonl_through_datasets_and_a_saved_dataset(tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "lme_mc10.jsonl", _mc10_lines())
    prepare_longmemeval("longmemeval-mc10-jsonl", [src], tmp_path / "file")
    prepare_longmemeval("longmemeval-mc10-jsonl", [src], tmp_path / "via", via_datasets=True)
    _same_files(tmp_path / "file", tmp_path / "via")
    datasets.Dataset.from_list(_mc10_lines()).save_to_disk(str(tmp_path / "saved"))
    prepare_longmemeval("longmemeval-mc10-jsonl", [tmp_path / "saved"], tmp_path / "saved_out")
    _same_files(tmp_path / "file", tmp_path / "saved_out", stats_inputs_equal=False)
    for kind in ("locomo-mc10-jsonl",):
        prepare_locomo(kind, [src], tmp_path / "lf")
        prepare_locomo(kind, [tmp_path / "saved"], tmp_path / "ls")
        _same_files(tmp_path / "lf", tmp_path / "ls", stats_inputs_equal=False)


def test_personamem_through_datasets(tmp_path: Path) -> None:
    q, ctx = _persona_files(tmp_path)
    prepare_personamem([q, ctx], tmp_path / "file")
    prepare_personamem([ctx, q], tmp_path / "via", via_datasets=True)
    _same_files(tmp_path / "file", tmp_path / "via")
    # Saved with datasets' inferred CSV types (persona_id an int, stereotypical a bool, ...): the
    # cells are read back as the text they were; the two folders are told apart by their columns.
    typed = datasets.load_dataset("csv", data_files=str(q), split="train", na_filter=False)
    assert typed.features["persona_id"] == datasets.Value("int64")
    typed.save_to_disk(str(tmp_path / "q_saved"))
    datasets.load_dataset("json", data_files=str(ctx), split="train").save_to_disk(str(tmp_path / "c_saved"))
    prepare_personamem([tmp_path / "c_saved", tmp_path / "q_saved"], tmp_path / "saved")
    _same_files(tmp_path / "file", tmp_path / "saved", stats_inputs_equal=False)


def test_a_hub_id_from_the_offline_cache(tmp_path: Path, offline_cache: Path) -> None:
    src = _write_json(tmp_path / "longmemeval_s.json", _lme_items())
    _cache_as_hub([src], "elasticmem-test/longmemeval", offline_cache)
    prepare_longmemeval("longmemeval", [src], tmp_path / "file")
    stats = prepare_longmemeval("longmemeval", ["elasticmem-test/longmemeval"], tmp_path / "hub")
    _same_files(tmp_path / "file", tmp_path / "hub", stats_inputs_equal=False)
    (inp,) = stats["inputs"]
    assert (inp["hub_id"], inp["split"], inp["rows"]) == ("elasticmem-test/longmemeval", "train", 12)
    # The CLI and the dotted options take it where they take a path.
    assert prepare_main(["longmemeval", "--input", "hf://datasets/elasticmem-test/longmemeval:train",
                         "--out", str(tmp_path / "cli")]) == 0
    assert prepare_main(["longmemeval", "prepare.input=[elasticmem-test/longmemeval]",
                         f"prepare.out={tmp_path / 'dotted'}"]) == 0
    _same_files(tmp_path / "file", tmp_path / "cli", stats_inputs_equal=False)
    _same_files(tmp_path / "file", tmp_path / "dotted", stats_inputs_equal=False)


def _real_cases() -> list:
    """(kind, input files) of every real file in ../shared/data; absent ones skip with the reason."""
    cases = []
    for kind in ("locomo-qa", "locomo-mc10"):
        cases.append(pytest.param(kind, [LOCOMO], id=kind, marks=pytest.mark.skipif(
            not LOCOMO.is_file(), reason=f"real LoCoMo file not found at {LOCOMO}")))
    for name in ("longmemeval_s.json", "longmemeval_oracle.json"):
        p = SHARED / name
        cases.append(pytest.param("longmemeval", [p], id=name, marks=pytest.mark.skipif(
            not p.is_file(), reason=f"real LongMemEval file not found at {p}")))
    q, c = SHARED / "questions_32k.csv", SHARED / "shared_contexts_32k.jsonl"
    cases.append(pytest.param("personamem", [q, c], id="personamem-32k", marks=pytest.mark.skipif(
        not (q.is_file() and c.is_file()), reason=f"real PersonaMem files not found at {q} and {c}")))
    return cases


@pytest.mark.parametrize("kind, inputs", _real_cases())
def test_real_files_both_ways(kind: str, inputs: list[Path], tmp_path: Path, offline_cache: Path) -> None:
    """The real file through the streaming readers, through datasets, and as a cached Hub id."""
    from elasticmem.data.prepare import prepare_real

    prepare_real(kind, [str(p) for p in inputs], str(tmp_path / "file"))
    prepare_real(kind, [str(p) for p in inputs], str(tmp_path / "via"), via_datasets=True)
    _same_files(tmp_path / "file", tmp_path / "via")
    if kind != "personamem":  # one Hub dataset per input file: PersonaMem's two are covered above
        _cache_as_hub(inputs, "elasticmem-test/real", offline_cache)
        prepare_real(kind, ["elasticmem-test/real"], str(tmp_path / "hub"))
        _same_files(tmp_path / "file", tmp_path / "hub", stats_inputs_equal=False)


# --------------------------------------------------------------------------- naming an input, errors


@pytest.mark.parametrize("spec, expected", [
    ("owner/name", HubSpec("owner/name")),
    ("owner/name@v1.0", HubSpec("owner/name", "v1.0")),
    ("hf://datasets/owner/name", HubSpec("owner/name")),
    ("hf://datasets/owner/name@main/data/longmemeval_s.json", HubSpec("owner/name", "main", "data/longmemeval_s.json")),
    ("runs/locomo10.json", None),  # a missing local file, not a Hub id
    ("data/sub/file", None),  # a bare spec takes no /FILE
    ("locomo10.json", None),
    ("/abs/owner/name", None),
])
def test_parse_hub_spec(spec: str, expected: HubSpec | None) -> None:
    assert parse_hub_spec(spec) == expected


def test_split_suffix() -> None:
    assert split_suffix("owner/name:test") == ("owner/name", "test")
    assert split_suffix("hf://datasets/owner/name/f.json:train") == ("hf://datasets/owner/name/f.json", "train")
    assert split_suffix("hf://datasets/owner/name") == ("hf://datasets/owner/name", None)
    assert split_suffix("owner/name") == ("owner/name", None)


def test_an_id_not_in_the_offline_cache(tmp_path: Path, capsys) -> None:
    with pytest.raises(FileNotFoundError, match=r"LoCoMo input not found: nobody/nothing: .*not in the datasets "
                       r"cache .*HF_DATASETS_OFFLINE"):
        prepare_locomo("locomo-qa", ["nobody/nothing"], tmp_path / "out")
    assert prepare_main(["locomo-qa", "--input", "nobody/nothing", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "prepare locomo-qa: error: LoCoMo input not found: nobody/nothing" in err and "network access" in err
    assert not (tmp_path / "out" / "train.jsonl").exists()


def test_a_missing_local_file_is_not_taken_for_a_hub_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # "runs/locomo10.json" is relative, shaped like owner/name
    with pytest.raises(FileNotFoundError, match=r"LoCoMo input not found: runs/locomo10\.json \(no such local file"):
        prepare_locomo("locomo-qa", ["runs/locomo10.json"], tmp_path / "out")


def test_wrong_format_through_datasets(tmp_path: Path) -> None:
    bad = tmp_path / "longmemeval_s.json"
    bad.write_text('[{"question_id": "q1", "question": "unfinished', encoding="utf-8")
    with pytest.raises(DataError, match=rf"{bad}: datasets cannot read it as json \(") as e:
        prepare_longmemeval("longmemeval", [bad], tmp_path / "out", via_datasets=True)
    assert e.value.reason == "not_dataset"
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is an empty folder: neither a dataset saved with save_to_disk nor"):
        prepare_longmemeval("longmemeval", [tmp_path / "empty"], tmp_path / "out")
    (tmp_path / "csvs").mkdir()
    (tmp_path / "csvs" / "a.csv").write_text('x,y\n1,"unclosed\n')
    with pytest.raises(DataError, match="cannot read it as a folder of data files"):
        prepare_longmemeval("longmemeval", [tmp_path / "csvs"], tmp_path / "out")
    # A dataset of the wrong benchmark: the record-level errors name the dataset and the row.
    datasets.Dataset.from_list([{"text": "hello"}]).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=rf"{tmp_path / 'saved'} row 0: field 'question_id': missing"):
        prepare_longmemeval("longmemeval", [tmp_path / "saved"], tmp_path / "out")


def test_a_dataset_with_several_splits_needs_one_named(tmp_path: Path) -> None:
    rows = _mc10_lines()
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                               "test": datasets.Dataset.from_list(rows[4:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"has several splits \(train, test\); name one as .*dd:SPLIT"):
        open_input(tmp_path / "dd", "input")
    with pytest.raises(ValueError, match=r"has no split 'val'"):
        open_input(f"{tmp_path / 'dd'}:val", "input")
    table = open_input(f"{tmp_path / 'dd'}:test", "input")
    assert isinstance(table, Table) and [r["question_id"] for _, r in table.rows()] == [
        r["question_id"] for r in rows[4:]]


def test_datasets_is_imported_only_when_used() -> None:
    code = ("import sys, elasticmem.data, elasticmem.data.prepare, elasticmem.data.locomo, "
            "elasticmem.data.longmemeval, elasticmem.data.personamem, elasticmem.data.hub; "
            "print('datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- prepared splits as a Dataset


def _expected_rows(path: Path) -> list[dict]:
    """The JSONL's objects as json.loads reads them, a group's history filled in where left out."""
    first: dict[str, list] = {}
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            group = r.get("group", r["id"])
            r["history"] = first.setdefault(group, r.get("history"))
            rows.append(r)
    return rows


def _without_nulls(row: dict) -> dict:
    """A Dataset row less the nulls Arrow puts where an example lacks a field (here or in a turn)."""
    out = {k: v for k, v in row.items() if v is not None}
    out["history"] = [[{k: v for k, v in t.items() if v is not None} for t in s] for s in row["history"]]
    return out


@pytest.mark.parametrize("make", ["longmemeval", "personamem", "locomo"])
def test_split_as_dataset_rows_equal_the_jsonl(make: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    if make == "longmemeval":
        prepare_longmemeval("longmemeval", [_write_json(tmp_path / "l.json", _lme_items())], out)
    elif make == "personamem":
        prepare_personamem(list(_persona_files(tmp_path)), out)
    else:
        if not LOCOMO.is_file():
            pytest.skip(f"real LoCoMo file not found at {LOCOMO}")
        prepare_locomo("locomo-mc10", [LOCOMO], out)
    for split in ("train", "test"):
        ds = load_split(out, split, as_dataset=True)
        assert isinstance(ds, datasets.Dataset) and str(ds.split) == split
        expected = _expected_rows(out / f"{split}.jsonl")
        assert len(ds) == len(expected) > 0
        assert [_without_nulls(r) for r in ds] == expected
        # A source field of one scalar type is a typed column; any other is Json.
        scalar = {str: datasets.Value("string"), bool: datasets.Value("bool"), int: datasets.Value("int64")}
        for key in set(ds.column_names) - {"id", "source", "group", "question", "choices", "answer_index",
                                           "question_type", "history", "answer_text"}:
            types = {type(r[key]) for r in expected if r.get(key) is not None}
            only = next(iter(types)) if len(types) == 1 else None
            assert ds.features[key] == scalar.get(only, datasets.Json()), key


def test_split_as_dataset_is_cached_by_content_and_validated(tmp_path: Path, offline_cache: Path) -> None:
    out = tmp_path / "out"
    prepare_longmemeval("longmemeval", [_write_json(tmp_path / "l.json", _lme_items())], out)
    first = load_split(out, "train", as_dataset=True)
    arrow = Path(first.cache_files[0]["filename"])
    assert arrow.parent.parent == offline_cache and arrow.suffix == ".arrow"
    mtime = arrow.stat().st_mtime_ns
    assert Path(load_split(out, "train", as_dataset=True).cache_files[0]["filename"]) == arrow
    assert arrow.stat().st_mtime_ns == mtime  # opened, not rewritten
    # Other content (prepared again from fewer items) gets another file.
    prepare_longmemeval("longmemeval", [_write_json(tmp_path / "l.json", _lme_items(8))], out)
    again = load_split(out, "train", as_dataset=True)
    assert Path(again.cache_files[0]["filename"]) != arrow and len(again) == 6
    # The JSONL stays the contract: an invalid line is refused, and no Arrow file is written.
    lines = (out / "test.jsonl").read_text().splitlines()
    bad = json.loads(lines[0])
    bad["answer_index"] = 3  # free-form with an answer index
    (out / "test.jsonl").write_text("\n".join([json.dumps(bad), *lines[1:]]) + "\n")
    before = set(arrow.parent.iterdir())
    with pytest.raises(SchemaError, match=r"test\.jsonl:1 .*answer_index"):
        load_split(out, "test", as_dataset=True)
    assert set(arrow.parent.iterdir()) == before
    with pytest.raises(FileNotFoundError, match="split 'val' not found|prepare the data first"):
        load_split(tmp_path / "nowhere", "val", as_dataset=True)
