"""LongMemEval (Wu et al., ICLR 2025) in the shared example schema.

Two ways in (``python -m elasticmem.data.prepare DATASET --input PATH --out DIR``):

* ``longmemeval`` reads ``longmemeval_s.json``, ``longmemeval_m.json`` or
  ``longmemeval_oracle.json`` (a JSON list; fields ``question_id,
  question_type, question, answer, question_date, haystack_session_ids,
  haystack_dates, haystack_sessions, answer_session_ids``) and writes
  free-form examples (``choices: []``, the answer in ``answer_text``).
* ``longmemeval-mc10-jsonl`` reads the published MC-10 JSONL (Percena
  ``lme-mc10``: ``question_id, question, choices[10], correct_choice_index,
  question_type, haystack_sessions``, one object a line).

Every question has its own haystack, so the bank group is the question id.
Sessions are dated by ``haystack_dates`` (or ``haystack_session_datetimes``);
turns flagged ``has_answer`` are listed in ``evidence`` as [session, turn];
``question_date``, ``haystack_session_ids`` and ``answer_session_ids`` are
kept verbatim. Abstention questions (question id ending in ``_abs``) carry
``abstention: true``. Split: random 80/20 by question, seed 42 (no val).

LongMemEval-M is ~1.5M tokens per history and hundreds of MB: the JSON list
is read one item at a time (``sources.iter_json_list``), and each example is
written out before the next is read.

    pytest tests/unit/test_data_longmemeval.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

from elasticmem.data.hub import Table, jsonl_records, label, open_input
from elasticmem.data.schema import Example
from elasticmem.data.sources import (
    DataError,
    SkipLog,
    evidence_positions,
    iter_json_list,
    need,
    parse_sessions,
    read_mc10_record,
    run_prepare,
    split_random,
)

SOURCE = "longmemeval"
SPLIT_FRACTIONS = (0.8, 0.0, 0.2)
"""Random 80/20 train/test by question (reference code); val stays empty."""
ABSTENTION_SUFFIX = "_abs"


def is_abstention(question_id: str) -> bool:
    """LongMemEval marks questions whose answer is not in the history with an ``_abs`` id suffix."""
    return question_id.endswith(ABSTENTION_SUFFIX)


def lme_example(obj: Any, path: Path | str, where: str) -> Example:
    """One LongMemEval item as a free-form example (its own history, its own group)."""
    if not isinstance(obj, dict):
        raise DataError(path, where, None, f"expected an object, got {type(obj).__name__}", "bad_record")
    qid = str(need(obj, "question_id", (str, int), path, where,
                   "is this a LongMemEval file? its items have question_id, question, answer, haystack_sessions"))
    where = f"{where} (question_id {qid!r})"
    question = need(obj, "question", str, path, where)
    qtype = need(obj, "question_type", str, path, where)
    if "answer" not in obj:
        raise DataError(path, where, "answer", "missing", "missing_field")
    answer = obj["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise DataError(path, where, "answer", f"must be a non-empty string or number, got {answer!r:.60}",
                        "bad_field")
    history = parse_sessions(obj, "haystack_sessions", path, where, ("haystack_dates",))
    n = len(history)
    ids = obj.get("haystack_session_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) != n):
        got = len(ids) if isinstance(ids, list) else type(ids).__name__
        raise DataError(path, where, "haystack_session_ids", f"must list one id per session ({n}), got {got}",
                        "bad_field")
    extra: dict[str, Any] = {
        "abstention": is_abstention(qid),
        "evidence": evidence_positions(obj["haystack_sessions"]),
    }
    for key in ("question_date", "haystack_session_ids", "answer_session_ids"):
        if key in obj:
            extra[key] = obj[key]
    return Example(id=qid, source=SOURCE, question=question, choices=[], answer_index=-1, question_type=qtype,
                   history=history, group=qid, answer_text=str(answer).strip(), extra=extra)


def mc10_example(obj: Any, path: Path | str, where: str) -> Example:
    """One published MC-10 record, abstention marked."""
    ex = read_mc10_record(obj, path, where, SOURCE)
    ex.extra["abstention"] = is_abstention(ex.id)
    return ex


def prepare_longmemeval(kind: str, inputs: Sequence[str | Path], out_dir: str | Path, *, seed: int = 42,
                        skip_invalid: bool = False, splits_dir: str | Path | None = None,
                        via_datasets: bool = False) -> dict[str, Any]:
    """Write ``longmemeval`` / ``longmemeval-mc10-jsonl`` to OUT_DIR; returns stats.json's content.

    The input is a file, a folder or a Hub dataset (``hub.open_input``; ``via_datasets`` reads a
    local file through ``datasets`` too)."""
    if kind not in ("longmemeval", "longmemeval-mc10-jsonl"):
        raise ValueError(f"unknown LongMemEval kind {kind!r}")
    if len(inputs) != 1:
        raise ValueError(f"{kind} takes one --input file, got {len(inputs)}")
    src = open_input(inputs[0], "LongMemEval input", via_datasets)
    path = label(src)
    meta: dict[str, Any] = {
        "dataset": kind, "source": SOURCE, "seed": seed,
        "split": {"unit": "question", "rule": f"random 80/20 by question id, random.Random({seed}).shuffle "
                  "of the naturally sorted ids", "fractions": list(SPLIT_FRACTIONS)},
        "abstention_questions": 0,
    }

    def examples(skips: SkipLog) -> Iterator[tuple[str, Example, Path | str, str]]:
        if kind == "longmemeval":
            items = _list_items(src, skips)
            make = lme_example
        else:
            items = jsonl_records(src, skips)
            make = mc10_example
        for where, obj in items:
            try:
                ex = make(obj, path, where)
            except DataError as e:
                skips.handle(e)
                continue
            meta["abstention_questions"] += ex.extra["abstention"]
            yield ex.id, ex, path, where

    return run_prepare(out_dir, [src], examples, lambda units: split_random(units, SPLIT_FRACTIONS, seed), meta,
                       skip_invalid, splits_dir)


def _list_items(path: Path | Table, skips: SkipLog) -> Iterator[tuple[str, Any]]:
    """Items of the JSON list (rows of a dataset); a malformed or truncated list ends the stream through
    ``skips`` (raised by default; with --skip-invalid the items read so far are kept and the rest counted once)."""
    if isinstance(path, Table):
        yield from path.rows()
        return
    try:
        for i, obj in iter_json_list(path):
            yield f"item {i}", obj
    except DataError as e:
        if e.reason == "not_json_list":  # the wrong file: nothing to salvage
            raise DataError(path, "", None, str(e).split(": ", 1)[1] + "; a published MC-10 JSONL file goes to "
                            "`prepare longmemeval-mc10-jsonl`", e.reason) from None
        skips.handle(e)
