"""PersonaMem (Jiang et al., 2025) 32K / 128K in the shared example schema (MC-4).

    python -m elasticmem.data.prepare personamem --input questions_32k.csv shared_contexts_32k.jsonl --out DIR

Inputs (the two files in either order, told apart by extension):

* ``questions_*.csv``: one question a row, with at least ``question_id,
  question_type, user_question_or_message`` (or ``question``),
  ``correct_answer`` ("(c)"), ``all_options`` (a Python/JSON list of option
  strings, each optionally prefixed "(a) "), ``shared_context_id`` and
  ``end_index_in_shared_context``. Every other column (``topic``,
  ``persona_id``, ...) is kept verbatim in the example's extra fields.
* ``shared_contexts_*.jsonl``: one ``{context_id: [{role, content}, ...]}``
  a line.

The history of a question is ``context[:end_index_in_shared_context]`` (the
reference code's slice), as one session; roles stay user/assistant/system.
Questions of one context asked at the same end index share that history, so
the bank group is ``{context_id}@{end_index}``. The split is 80/10/10 by
context id, seed 42, so every cut of a context is in the same split.

The questions file is read whole (it is small); the contexts file is
streamed, one context in memory at a time.

    pytest tests/unit/test_data_personamem.py
"""

from __future__ import annotations

import ast
import csv
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from elasticmem.data.hub import Table, jsonl_records, label, open_input, split_suffix
from elasticmem.data.schema import Example, Turn
from elasticmem.data.sources import (
    DataError,
    SkipLog,
    parse_turns,
    run_prepare,
    safe_extra,
    split_random,
)

SOURCE = "personamem"
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
"""80/10/10 by shared context id, seed 42 (reference code)."""
REQUIRED_COLUMNS = ("question_id", "question_type", "correct_answer", "all_options", "shared_context_id",
                    "end_index_in_shared_context")
QUESTION_COLUMNS = ("user_question_or_message", "question")
"""The question text: the first of these columns the file has."""
_OPTION_PREFIX = re.compile(r"\s*\(([a-zA-Z])\)\s*")
_ANSWER = re.compile(r"\s*\(?\s*([a-zA-Z])\s*\)?(?:[\s.:,]|$)")


@dataclass
class Question:
    path: Path | str
    """The questions file or dataset (errors about this question name it)."""
    where: str
    qid: str
    question: str
    question_type: str
    choices: list[str]
    answer_index: int
    context_id: str
    end_index: int
    extra: dict[str, Any]


def parse_options(raw: str, path: Path | str, where: str) -> list[str]:
    """``all_options`` as a list of option texts, "(a) " prefixes removed.

    PersonaMem writes the list with Python's repr (the reference loader reads
    it with ``ast.literal_eval``, which only evaluates literals); JSON lists and
    a plain "(a) ... (b) ..." string are accepted too.
    """
    text = raw.strip()
    value: Any = None
    for parse in (ast.literal_eval, json.loads):
        try:
            value = parse(text)
            break
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    if isinstance(value, (list, tuple)):
        if not all(isinstance(o, str) for o in value):
            raise DataError(path, where, "all_options", "must be a list of strings", "bad_field")
        options = list(value)
    else:
        # "(a) first (b) second ...": split at the option letters, in order.
        marks = list(re.finditer(r"(?:^|\s)\(([a-z])\)\s", text + " "))
        letters = [m.group(1) for m in marks]
        if not marks or letters != [chr(ord("a") + i) for i in range(len(letters))]:
            raise DataError(path, where, "all_options", f"is neither a list nor '(a) ... (b) ...' text: {text!r:.80}",
                            "bad_field")
        ends = [m.start() for m in marks[1:]] + [len(text)]
        options = [text[m.end():e] for m, e in zip(marks, ends)]
    out = []
    for i, o in enumerate(options):
        m = _OPTION_PREFIX.match(o)
        out.append(o[m.end():].strip() if m and m.group(1).lower() == chr(ord("a") + i) else o.strip())
    if len(out) < 2:
        raise DataError(path, where, "all_options", f"needs at least 2 options, got {len(out)}", "bad_field")
    return out


def parse_answer(raw: str, n_options: int, path: Path | str, where: str) -> int:
    """Index of the answer letter ("(c)", "c", "(c) text"); it must name one of the options."""
    m = _ANSWER.match(raw or "")
    if not m:
        raise DataError(path, where, "correct_answer", f"{raw!r:.40} is not an option letter like '(c)'", "bad_answer")
    index = ord(m.group(1).lower()) - ord("a")
    if not 0 <= index < n_options:
        last = chr(ord("a") + n_options - 1)
        raise DataError(path, where, "correct_answer", f"letter '{m.group(1)}' is outside the {n_options} options "
                        f"(a)-({last})", "bad_answer")
    return index


def parse_question_row(row: dict[str, Any], qcol: str, path: Path | str, where: str) -> Question:
    """One CSV row as a Question; a short (truncated) row or a bad value is a DataError."""
    short = [k for k, v in row.items() if v is None and k is not None]
    if short:
        raise DataError(path, where, short[0], f"missing: the row has fewer columns than the header "
                        f"({len(short)} missing; truncated file?)", "short_row")
    for col in ("question_id", "shared_context_id", qcol):
        if not row[col].strip():
            raise DataError(path, where, col, "is empty", "missing_field")
    choices = parse_options(row["all_options"], path, where)
    answer_index = parse_answer(row["correct_answer"], len(choices), path, where)
    try:
        end = int(row["end_index_in_shared_context"].strip())
    except ValueError:
        raise DataError(path, where, "end_index_in_shared_context",
                        f"{row['end_index_in_shared_context']!r:.40} is not an integer", "bad_field") from None
    if end < 1:
        raise DataError(path, where, "end_index_in_shared_context", f"{end} leaves no history", "bad_field")
    # Cells beyond the header (DictReader's None key) are no column of the file: dropped.
    mapped = {*REQUIRED_COLUMNS, qcol}
    extra = safe_extra({k: v for k, v in row.items() if k is not None and k not in mapped})
    return Question(path, where, row["question_id"].strip(), row[qcol], row["question_type"].strip(),
                    choices, answer_index, row["shared_context_id"].strip(), end, extra)


def question_column(header: Sequence[str], path: Path | str, where: str) -> str:
    """The column holding the question text; a missing column is fatal (it would fail every row)."""
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    qcol = next((c for c in QUESTION_COLUMNS if c in header), None)
    if qcol is None:
        missing.append(" or ".join(QUESTION_COLUMNS))
    if missing:
        raise DataError(path, where, missing[0], f"missing column(s) {missing}; the file has "
                        f"{list(header)[:20]} (is this PersonaMem's questions_*.csv?)", "missing_column")
    return qcol  # type: ignore[return-value]  (None is in ``missing``)


def cell_text(value: Any) -> str:
    """A dataset's cell as the CSV text it came from: a dataset loaded with its default types holds
    numbers, booleans and nulls where the file had text (a local CSV read ``via_datasets`` is all text)."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # pandas reads an integer column with a gap as floats
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)  # all_options stored as a list: parse_options reads JSON
    return str(value)


def read_questions(path: Path | Table, skips: SkipLog) -> list[Question]:
    """Every valid question row of the CSV file (or of a dataset holding it)."""
    out: list[Question] = []
    if isinstance(path, Table):
        qcol = question_column(path.columns, path.spec, "columns")
        for where, row in path.rows(strip=False):
            try:
                out.append(parse_question_row({k: cell_text(v) for k, v in row.items()}, qcol, path.spec, where))
            except DataError as e:
                skips.handle(e)
        return out
    csv.field_size_limit(2**31 - 1)  # options and questions can be long texts
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        qcol = question_column(reader.fieldnames or [], path, "header (line 1)")
        line = reader.line_num + 1
        rowno = 0
        try:
            for row in reader:
                rowno += 1
                where = f"row {rowno} (line {line})"
                line = reader.line_num + 1
                try:
                    out.append(parse_question_row(row, qcol, path, where))
                except DataError as e:
                    skips.handle(e)
        except csv.Error as e:
            skips.handle(DataError(path, f"row {rowno + 1} (line {line})", None, f"malformed CSV ({e}); the rest "
                                   "of the file is not read", "malformed_csv"))
    return out


def context_examples(cid: str, turns: list[Turn], questions: Sequence[Question], ctx_path: Path | str,
                     ctx_where: str, skips: SkipLog) -> Iterator[tuple[str, Example, Path, str]]:
    """Examples of one context, grouped by end index (consecutive, so a group's history is built once)."""
    by_end: dict[int, list[Question]] = {}
    for q in questions:
        by_end.setdefault(q.end_index, []).append(q)
    for end in sorted(by_end):
        qs = by_end[end]
        if end > len(turns):
            for q in qs:
                skips.handle(DataError(q.path, q.where, "end_index_in_shared_context",
                                       f"{end} is beyond the {len(turns)} turns of context {cid!r} "
                                       f"({ctx_path} {ctx_where})", "bad_end_index"))
            continue
        history = [list(turns[:end])]
        group = f"{cid}@{end}"
        for q in qs:
            extra = {"shared_context_id": cid, "end_index_in_shared_context": end, **q.extra}
            ex = Example(id=q.qid, source=SOURCE, question=q.question, choices=q.choices,
                         answer_index=q.answer_index, question_type=q.question_type, history=history, group=group,
                         answer_text=q.choices[q.answer_index], extra=extra)
            yield cid, ex, q.path, q.where


_WHAT = {"questions": "PersonaMem questions file", "contexts": "PersonaMem shared contexts file"}


def _kind_by_suffix(spec: str) -> str | None:
    """A data file's extension says which input it is (a folder or a Hub id does not)."""
    base = split_suffix(spec)[0].lower()
    return "questions" if base.endswith(".csv") else "contexts" if base.endswith((".jsonl", ".json")) else None


def _split_inputs(inputs: Sequence[str | Path], via_datasets: bool) -> tuple[Path | Table, Path | Table]:
    """(questions, contexts), told apart by extension, or for a dataset by its columns: the
    questions have a ``shared_context_id`` column, the contexts one column per context id."""
    wrong = ValueError("personamem takes two --input files: questions_*.csv and shared_contexts_*.jsonl, got "
                       f"{[str(p) for p in inputs]}")
    if len(inputs) != 2:
        raise wrong
    kinds = [_kind_by_suffix(str(p)) for p in inputs]
    if kinds[0] is not None and kinds[0] == kinds[1]:
        raise wrong
    found: dict[str, Path | Table] = {}
    for spec, kind in zip(inputs, kinds):
        src = open_input(spec, _WHAT[kind] if kind else "PersonaMem input", via_datasets)
        if kind is None:
            if not isinstance(src, Table):  # a local file of another kind
                raise wrong
            kind = "questions" if "shared_context_id" in src.columns else "contexts"
        if kind in found:
            raise wrong
        found[kind] = src
    return found["questions"], found["contexts"]


def prepare_personamem(inputs: Sequence[str | Path], out_dir: str | Path, *, seed: int = 42,
                       skip_invalid: bool = False, splits_dir: str | Path | None = None,
                       via_datasets: bool = False) -> dict[str, Any]:
    """Write PersonaMem to OUT_DIR; returns stats.json's content.

    Each input is a file, a folder or a Hub dataset (``hub.open_input``; ``via_datasets`` reads
    local files through ``datasets`` too)."""
    q_src, ctx_src = _split_inputs(inputs, via_datasets)
    q_file, ctx_file = label(q_src), label(ctx_src)
    meta: dict[str, Any] = {
        "dataset": "personamem", "source": SOURCE, "seed": seed,
        "split": {"unit": "shared_context_id", "rule": f"random 80/10/10 by context id, random.Random({seed})"
                  ".shuffle of the naturally sorted ids", "fractions": list(SPLIT_FRACTIONS)},
        "group": "{shared_context_id}@{end_index_in_shared_context}",
    }

    def examples(skips: SkipLog) -> Iterator[tuple[str, Example, Path | str, str]]:
        questions = read_questions(q_src, skips)
        by_context: dict[str, list[Question]] = {}
        for q in questions:
            by_context.setdefault(q.context_id, []).append(q)
        meta["options_per_question"] = dict(sorted(Counter(len(q.choices) for q in questions).items()))
        seen: dict[str, str] = {}  # context id -> where it was read
        unused = 0
        for where, obj in jsonl_records(ctx_src, skips):
            try:
                if not isinstance(obj, dict) or len(obj) != 1:
                    got = f"{len(obj)} keys" if isinstance(obj, dict) else f"a {type(obj).__name__}"
                    raise DataError(ctx_file, where, None, f"expected one {{context_id: [turns]}} object a line, "
                                    f"got {got}", "bad_record")
                ((cid, raw),) = obj.items()
                if cid in seen:
                    raise DataError(ctx_file, where, cid, f"context id repeats {seen[cid]}", "duplicate_context")
                seen[cid] = where
                turns = parse_turns(raw, ctx_file, where, cid)
            except DataError as e:
                skips.handle(e)
                continue
            qs = by_context.pop(cid, None)
            if qs is None:
                unused += 1
                continue
            yield from context_examples(cid, turns, qs, ctx_file, where, skips)
        for cid, qs in by_context.items():
            for q in qs:
                reason = "has no context" if cid not in seen else "has only an invalid context"
                skips.handle(DataError(q_file, q.where, "shared_context_id", f"{cid!r} {reason} in {ctx_file}",
                                       "unknown_context"))
        meta["contexts_in_file"] = len(seen)
        meta["contexts_without_questions"] = unused

    return run_prepare(out_dir, [q_src, ctx_src], examples,
                       lambda units: split_random(units, SPLIT_FRACTIONS, seed), meta, skip_invalid, splits_dir)
