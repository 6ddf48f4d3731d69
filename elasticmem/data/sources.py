"""Shared machinery of the real-benchmark loaders (LoCoMo, LongMemEval, PersonaMem).

Every loader turns its source files into ``(unit, Example)`` pairs, where the
*unit* is what the split is drawn over (a conversation, a question or a
context id), and hands them to ``PreparedWriter``. The writer streams them to
disk, so no loader needs to hold more than one history at a time, then
assigns units to train/val/test, writes the three JSONL files, the frozen
split id lists and ``stats.json`` (docs/datasets.md describes all of it).

Errors: every problem with an input is a ``DataError`` naming the file, the
line, row or item, and the field. Record-level problems go through a
``SkipLog``: by default it raises; with ``--skip-invalid`` it logs the error,
counts it by reason and the loader moves on, so ``stats.json`` says what was
skipped and why. File-level problems (not JSON at all, a missing CSV column)
always raise: nothing could be salvaged from such a file.

Why one file: every loader uses all three parts (reading helpers, split assignment, the writer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from elasticmem.data.chunking import chunk_history
from elasticmem.data.schema import SPLITS, Example, SchemaError, Turn
from elasticmem.utils.common import sha256_file

log = logging.getLogger("elasticmem.data")

MAX_LISTED_SKIPS = 50
"""How many skipped records ``stats.json`` lists one by one (all are counted)."""

PENDING = ".pending.jsonl"
SPLIT_IDS_DIR = "splits"


class DataError(SchemaError):
    """An input record or file is invalid; the message names the file, the place and the field.

    ``reason`` is a short stable key ("missing_field", "bad_answer", ...) under which
    ``--skip-invalid`` counts the record in ``stats.json``.
    """

    def __init__(self, path: str | os.PathLike, where: str, field: str | None, message: str, reason: str):
        self.path, self.where, self.field, self.reason = str(path), where, field, reason
        place = f"{path} {where}" if where else str(path)
        what = f"field '{field}': " if field else ""
        super().__init__(f"{place}: {what}{message}")


@dataclass
class SkipLog:
    """Raise on invalid records, or, with ``skip_invalid``, log and count them by reason."""

    skip_invalid: bool = False
    counts: Counter = field(default_factory=Counter)
    listed: list[dict[str, Any]] = field(default_factory=list)

    def handle(self, err: DataError) -> None:
        """Raise ``err`` unless skipping; otherwise record it (the caller then skips the record)."""
        if not self.skip_invalid:
            raise err
        log.warning("skipped: %s", err)
        self.counts[err.reason] += 1
        if len(self.listed) < MAX_LISTED_SKIPS:
            self.listed.append({"reason": err.reason, "file": err.path, "where": err.where,
                                "field": err.field, "error": str(err)})

    def to_json(self) -> dict[str, Any]:
        return {"total": sum(self.counts.values()), "by_reason": dict(sorted(self.counts.items())),
                "listed": self.listed}


# --------------------------------------------------------------------------- reading helpers


def require_file(path: str | os.PathLike, what: str) -> Path:
    """The path as a Path, or FileNotFoundError saying which input it should have been."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p}")
    return p


def load_json_file(path: Path) -> Any:
    """A whole (small) JSON file; malformed or truncated JSON names the line and column."""
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as e:
        raise DataError(path, "", None, f"not a UTF-8 text file ({e.reason} at byte {e.start})", "not_json") from None
    except json.JSONDecodeError as e:
        # Failing at the very end of the document means the file stops mid-value.
        truncated = _at_end(e, e.doc)
        what = "truncated JSON: the file ends early" if truncated else f"malformed JSON ({e.msg})"
        raise DataError(path, f"line {e.lineno} column {e.colno}", None, what,
                        "truncated" if truncated else "not_json") from None


def iter_jsonl(path: Path, skips: SkipLog) -> Iterator[tuple[int, Any]]:
    """(line number, decoded object) per non-blank line; a malformed line goes to ``skips``."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                skips.handle(DataError(path, f"line {lineno}", None,
                                       f"malformed JSON ({e.msg} at column {e.colno}); truncated file?",
                                       "malformed_json"))


def iter_json_list(path: Path, read_size: int = 1 << 20) -> Iterator[tuple[int, Any]]:
    """Stream the items of a top-level JSON list: (item index, decoded item).

    LongMemEval-M is hundreds of MB (~1.5M tokens per history), too much to
    ``json.load`` next to the model. ``ijson`` would do this but is not a
    dependency; ``json.JSONDecoder.raw_decode`` over a growing buffer decodes one
    item at a time with the standard library. When an item does not fit in
    the buffer the read size doubles, so an item of n bytes is decoded O(log n)
    times, never quadratically often. At most one item (plus one read) is in
    memory.

    Raises ``DataError`` (reason "not_json_list", "malformed_json" or
    "truncated") naming the item and its character offset; items before the
    error have been yielded.
    """
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        buf = ""
        offset = 0  # characters of the file before buf[0]
        eof = False

        def fill(min_chars: int) -> None:
            nonlocal buf, eof
            while not eof and len(buf) < min_chars:
                more = f.read(max(read_size, min_chars - len(buf)))
                eof = not more
                buf += more

        fill(1)
        pos = _skip_ws(buf, 0)
        while pos >= len(buf) and not eof:
            fill(len(buf) + read_size)
            pos = _skip_ws(buf, pos)
        if pos >= len(buf) or buf[pos] != "[":
            got = "an empty file" if pos >= len(buf) else f"{buf[pos:pos + 20]!r}"
            raise DataError(path, "", None, f"expected a JSON list of items ('[' first), got {got}", "not_json_list")
        pos += 1
        index = 0
        while True:
            pos = _skip_ws(buf, pos)
            while pos >= len(buf) and not eof:
                buf, offset, pos = buf[pos:], offset + pos, 0
                fill(read_size)
                pos = _skip_ws(buf, pos)
            if pos >= len(buf):
                raise DataError(path, f"item {index} (character {offset + pos})", None,
                                "truncated JSON: the file ends before the list is closed", "truncated")
            if buf[pos] == "]":
                return
            if index > 0:
                if buf[pos] != ",":
                    raise DataError(path, f"item {index} (character {offset + pos})", None,
                                    f"malformed JSON: expected ',' or ']' between items, got {buf[pos]!r}",
                                    "malformed_json")
                pos = _skip_ws(buf, pos + 1)
                while pos >= len(buf) and not eof:
                    buf, offset, pos = buf[pos:], offset + pos, 0
                    fill(read_size)
                    pos = _skip_ws(buf, pos)
            # Drop what is consumed so the buffer holds one item at a time.
            buf, offset, pos = buf[pos:], offset + pos, 0
            want = max(read_size, 2 * len(buf))
            while True:
                try:
                    item, end = decoder.raw_decode(buf, 0)
                except json.JSONDecodeError as e:
                    # Only a failure near the buffer's end can be an item cut by the read; one
                    # earlier is bad syntax, reported now rather than after reading on to EOF.
                    if eof or not _near_end(e, buf):
                        kind = "truncated" if eof and _at_end(e, buf) else "malformed_json"
                        msg = ("truncated JSON: the file ends inside this item" if kind == "truncated"
                               else f"malformed JSON ({e.msg} at character {offset + e.pos})")
                        raise DataError(path, f"item {index} (character {offset})", None, msg, kind) from None
                    fill(len(buf) + want)
                    want *= 2
                    continue
                # A bare number at the buffer's end may continue in the next read.
                if end >= len(buf) and not eof and not isinstance(item, (dict, list, str)):
                    fill(len(buf) + want)
                    continue
                break
            yield index, item
            index += 1
            pos = end


def _at_end(e: json.JSONDecodeError, doc: str) -> bool:
    """Did decoding fail because the text stops (a truncated file) rather than on bad syntax?"""
    # An unclosed string can only run into the end of the text; any other failure at the very
    # end is a value cut short.
    return e.pos >= len(doc.rstrip()) or e.msg.startswith("Unterminated string")


def _near_end(e: json.JSONDecodeError, buf: str) -> bool:
    """Could more text fix this failure? (A literal or a \\uXXXX escape is cut by at most a few
    characters; an unclosed string may have started anywhere.)"""
    return e.pos >= len(buf) - 16 or e.msg.startswith("Unterminated string")


def _skip_ws(s: str, pos: int) -> int:
    while pos < len(s) and s[pos] in " \t\r\n":
        pos += 1
    return pos


def need(obj: dict, key: str, typ: type | tuple[type, ...], path: Path | str, where: str, hint: str = "") -> Any:
    """``obj[key]`` checked for presence and type; a DataError naming the field otherwise.

    ``hint`` is appended when the key is missing: for a record's identifying
    field that usually means the wrong kind of file.
    """
    if key not in obj:
        raise DataError(path, where, key, "missing" + (f" ({hint})" if hint else ""), "missing_field")
    v = obj[key]
    if not isinstance(v, typ) or (isinstance(v, bool) and typ is int):
        name = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise DataError(path, where, key, f"must be {name}, got {type(v).__name__}", "bad_field")
    return v


def parse_turns(raw: Any, path: Path | str, where: str, field_name: str, date: str | None = None) -> list[Turn]:
    """A session given as ``[{role, content, ...}, ...]``; extra keys (e.g. has_answer) are ignored."""
    if not isinstance(raw, list):
        raise DataError(path, where, field_name, f"must be a list of turns, got {type(raw).__name__}", "bad_field")
    turns = []
    for i, t in enumerate(raw):
        tw = f"{field_name}[{i}]"
        if not isinstance(t, dict):
            raise DataError(path, where, tw, f"must be an object, got {type(t).__name__}", "bad_field")
        for key in ("role", "content"):
            if not isinstance(t.get(key), str):
                raise DataError(path, where, f"{tw}.{key}", "missing or not a string", "bad_field")
        speaker = t.get("speaker") if isinstance(t.get("speaker"), str) else None
        turns.append(Turn(t["role"], t["content"], date, speaker))
    return turns


def parse_sessions(obj: dict, key: str, path: Path | str, where: str,
                   date_keys: Sequence[str] = ()) -> list[list[Turn]]:
    """``obj[key]`` as a list of sessions; the first of ``date_keys`` present dates each session."""
    raw = need(obj, key, list, path, where)
    dates: list[Any] = [None] * len(raw)
    for dk in date_keys:
        if dk in obj and obj[dk] is not None:
            dv = obj[dk]
            if not isinstance(dv, list) or len(dv) != len(raw):
                n = len(dv) if isinstance(dv, list) else type(dv).__name__
                raise DataError(path, where, dk, f"must list one date per session ({len(raw)}), got {n}",
                                "bad_field")
            dates = [str(d) if d is not None else None for d in dv]
            break
    history = [parse_turns(s, path, where, f"{key}[{i}]", dates[i]) for i, s in enumerate(raw)]
    if not any(history):
        raise DataError(path, where, key, "has no turns: an example needs a history to remember", "empty_history")
    return history


def evidence_positions(raw_sessions: Any) -> list[list[int]]:
    """[session, turn] of every turn flagged ``has_answer: true`` (LongMemEval's turn-level evidence)."""
    out = []
    if isinstance(raw_sessions, list):
        for si, s in enumerate(raw_sessions):
            if isinstance(s, list):
                out += [[si, ti] for ti, t in enumerate(s) if isinstance(t, dict) and t.get("has_answer") is True]
    return out


MC10_FIELDS = "MC-10 records have question_id, question, choices, correct_choice_index, haystack_sessions"


def read_mc10_record(obj: Any, path: Path | str, where: str, source: str, group: str | None = None) -> Example:
    """One object of a published MC-10 JSONL (Percena locomo-mc10 / lme-mc10) as an Example.

    Fields: ``question_id, question, choices[10], correct_choice_index,
    question_type, haystack_sessions`` (sessions of ``{role, content}`` turns);
    optional ``haystack_session_datetimes`` / ``haystack_dates`` date the
    sessions. Every other field is kept verbatim in ``extra``. ``group``
    defaults to the question id.
    """
    if not isinstance(obj, dict):
        raise DataError(path, where, None, f"expected a JSON object, got {type(obj).__name__}", "bad_record")
    qid = str(need(obj, "question_id", (str, int), path, where, f"is this an MC-10 JSONL file? {MC10_FIELDS}"))
    where = f"{where} (question_id {qid!r})"
    question = need(obj, "question", str, path, where)
    choices = need(obj, "choices", list, path, where, MC10_FIELDS)
    if len(choices) < 2 or not all(isinstance(c, str) for c in choices):
        raise DataError(path, where, "choices", f"must be a list of at least 2 strings, got {choices!r:.80}",
                        "bad_field")
    idx = need(obj, "correct_choice_index", int, path, where)
    if not 0 <= idx < len(choices):
        raise DataError(path, where, "correct_choice_index", f"{idx} is outside the {len(choices)} choices",
                        "bad_answer")
    history = parse_sessions(obj, "haystack_sessions", path, where,
                             ("haystack_session_datetimes", "haystack_dates"))
    known = {"question_id", "question", "choices", "correct_choice_index", "question_type", "haystack_sessions",
             "haystack_session_datetimes", "haystack_dates"}
    extra = safe_extra({k: v for k, v in obj.items() if k not in known})
    ev = evidence_positions(obj["haystack_sessions"])
    if ev:
        extra["evidence"] = ev
    return Example(
        id=qid, source=source, question=question, choices=list(choices), answer_index=idx,
        question_type=str(obj.get("question_type", "")), history=history, group=group or qid,
        answer_text=choices[idx], extra=extra,
    )


_SCHEMA_KEYS = {"id", "source", "group", "question", "choices", "answer_index", "question_type", "history",
                "answer_text"}
"""Top-level keys of the example schema: source fields of these names would clash in ``extra``."""


def safe_extra(fields: dict[str, Any]) -> dict[str, Any]:
    """Source fields for ``Example.extra``; one named like a schema key ("id", "group", ...) is kept
    as ``source_{key}`` rather than overwriting the schema field or being dropped."""
    return {(f"source_{k}" if k in _SCHEMA_KEYS else k): v for k, v in fields.items()}


# --------------------------------------------------------------------------- splits


def natural_key(s: str) -> list[Any]:
    """Sort key that orders "conv-9" before "conv-10" (digit runs compare as numbers)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", s) if p]


def cut(units: Sequence[str], fractions: Sequence[float]) -> dict[str, list[str]]:
    """First ``int(f_train * n)`` units to train, the next ``int(f_val * n)`` to val, the rest to test."""
    n = len(units)
    n_train = int(fractions[0] * n + 1e-9)
    n_val = int(fractions[1] * n + 1e-9)
    return {"train": list(units[:n_train]), "val": list(units[n_train:n_train + n_val]),
            "test": list(units[n_train + n_val:])}


def split_sorted(units: Iterable[str], fractions: Sequence[float]) -> dict[str, list[str]]:
    """Cut the units in natural sort order (LoCoMo: 6/2/2 conversations by sorted id)."""
    return cut(sorted(set(units), key=natural_key), fractions)


def split_random(units: Iterable[str], fractions: Sequence[float], seed: int) -> dict[str, list[str]]:
    """Cut the naturally sorted units after ``random.Random(seed).shuffle`` (independent of file order)."""
    order = sorted(set(units), key=natural_key)
    random.Random(seed).shuffle(order)
    return cut(order, fractions)


def read_frozen_splits(splits_dir: str | os.PathLike) -> dict[str, list[str]]:
    """``DIR/{train,val,test}_ids.txt`` (one unit id a line), as written by a previous prepare."""
    d = Path(splits_dir)
    out: dict[str, list[str]] = {}
    for split in SPLITS:
        p = d / f"{split}_ids.txt"
        if not p.is_file():
            raise FileNotFoundError(f"frozen split list not found: {p} (expected {', '.join(f'{s}_ids.txt' for s in SPLITS)})")
        out[split] = [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    seen: dict[str, str] = {}
    for split, ids in out.items():
        for u in ids:
            if u in seen:
                raise DataError(d / f"{split}_ids.txt", "", None, f"id {u!r} is also listed in {seen[u]}_ids.txt",
                                "bad_split_list")
            seen[u] = split
    return out


def apply_frozen(units: Sequence[str], frozen: dict[str, list[str]], splits_dir: Path) -> tuple[dict[str, list[str]], list[str]]:
    """Assign units by frozen lists; returns the assignment and the listed ids absent from the data."""
    where = {u: s for s, ids in frozen.items() for u in ids}
    missing = [u for u in units if u not in where]
    if missing:
        raise DataError(splits_dir, "", None, f"{len(missing)} id(s) of the data are in no split list, e.g. "
                        f"{missing[:3]}; the lists belong to other data", "bad_split_list")
    present = set(units)
    out = {s: [u for u in ids if u in present] for s, ids in frozen.items()}
    return out, [u for ids in frozen.values() for u in ids if u not in present]


# --------------------------------------------------------------------------- writing


@dataclass
class _Group:
    unit: str
    digest: str
    first_id: str
    sessions: int
    turns: int
    chunks: int
    words: int


def history_json(history: Sequence[Sequence[Turn]]) -> str:
    """The history as it appears in the JSONL line (also what its digest is taken of)."""
    return json.dumps([[t.to_json() for t in s] for s in history], ensure_ascii=False)


def history_digest(history: Sequence[Sequence[Turn]]) -> str:
    return hashlib.sha256(history_json(history).encode()).hexdigest()


def example_line(ex: Example, history: str | None) -> str:
    """``json.dumps(ex.to_json())`` with the history already serialised (same keys, same order);
    ``history`` None leaves it out (the group's earlier line has it: see data/schema.py)."""
    head = {"id": ex.id, "source": ex.source, "group": ex.group, "question": ex.question,
            "choices": list(ex.choices), "answer_index": ex.answer_index, "question_type": ex.question_type}
    tail: dict[str, Any] = {} if ex.answer_text is None else {"answer_text": ex.answer_text}
    tail.update({k: v for k, v in ex.extra.items() if k not in head and k != "history"})
    line = json.dumps(head, ensure_ascii=False)[:-1] + ("" if history is None else ', "history": ' + history)
    return line + (", " + json.dumps(tail, ensure_ascii=False)[1:] if tail else "}") + "\n"


def _length_summary(values: Sequence[int]) -> dict[str, float | int]:
    if not values:
        return {"min": 0, "mean": 0.0, "max": 0, "total": 0}
    return {"min": min(values), "mean": round(sum(values) / len(values), 1), "max": max(values),
            "total": sum(values)}


class PreparedWriter:
    """Stream examples to OUT_DIR, then split them by unit and write the split files and stats.

    Examples go to a pending file as they come (one history in memory at a
    time); ``finish`` copies each line to its split's JSONL once the split is
    known (LongMemEval's random split needs every question id first). A group
    (bank group = one history) must keep one history and one unit.
    """

    def __init__(self, out_dir: str | os.PathLike):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self._pending_path = self.out / PENDING
        self._pending = self._pending_path.open("w", encoding="utf-8")
        self._rows: list[tuple[str, str, str]] = []  # (unit, group, question_type) per pending line
        self._groups: dict[str, _Group] = {}
        self._ids: set[str] = set()
        self.free_form = 0
        # The last history seen and its JSON: the examples of a group usually come one after the
        # other and share one history object, so it is serialised once per group. Only this one
        # history is kept, not one per group (LongMemEval-M histories are ~1.5M tokens each).
        self._last: tuple[int, Any, str, str] | None = None

    def add(self, unit: str, ex: Example, path: Path | str, where: str) -> None:
        """Append one example; a duplicate id or a group whose history changes is a DataError."""
        if ex.id in self._ids:
            raise DataError(path, where, "id", f"duplicate example id {ex.id!r}", "duplicate_id")
        if self._last is not None and self._last[1] is ex.history:
            hist, digest = self._last[2], self._last[3]
        else:
            hist = history_json(ex.history)
            digest = hashlib.sha256(hist.encode()).hexdigest()
            self._last = (id(ex.history), ex.history, hist, digest)
        g = self._groups.get(ex.group)
        if g is None:
            chunks = chunk_history(ex.history, ex.group)
            self._groups[ex.group] = _Group(
                unit, digest, ex.id, len(ex.history), sum(len(s) for s in ex.history), len(chunks),
                sum(len(c.text.split()) for c in chunks),
            )
        else:
            if g.unit != unit:
                raise DataError(path, where, "group", f"group {ex.group!r} is in split unit {unit!r} here but "
                                f"in {g.unit!r} for example {g.first_id!r}", "group_mismatch")
            if digest != g.digest:
                raise DataError(path, where, "history", f"example {ex.id!r} has a different history than example "
                                f"{g.first_id!r} of the same group {ex.group!r}; a group shares one history",
                                "group_mismatch")
        self._ids.add(ex.id)
        # Only a group's first line carries its history; the group's lines all go to one split
        # file in this order, so there it is the first line of the group too.
        self._pending.write(example_line(ex, hist if g is None else None))
        self._rows.append((unit, ex.group, ex.question_type))
        self.free_form += ex.is_free_form

    @property
    def units(self) -> list[str]:
        return list(dict.fromkeys(u for u, _, _ in self._rows))

    def abort(self) -> None:
        """Remove the pending file after an error (the split files are only written by ``finish``)."""
        self._pending.close()
        self._pending_path.unlink(missing_ok=True)

    def finish(self, assignment: dict[str, list[str]], stats: dict[str, Any]) -> dict[str, Any]:
        """Write {train,val,test}.jsonl, splits/{split}_ids.txt and stats.json; returns the stats.

        ``assignment`` maps each split to its unit ids (every unit of the data
        exactly once); ``stats`` holds the loader's own fields, completed here.
        """
        self._pending.close()
        split_of = {u: s for s, us in assignment.items() for u in us}
        missing = [u for u in self.units if u not in split_of]
        if missing:
            raise ValueError(f"units without a split: {missing[:5]}")
        if not self._rows:
            self._pending_path.unlink(missing_ok=True)
            raise DataError(Path(stats.get("inputs", [{}])[0].get("path", self.out)), "", None,
                            "no valid example in the input" + _skipped_note(stats), "no_examples")
        tmp = {s: (self.out / f"{s}.jsonl.tmp").open("w", encoding="utf-8") for s in SPLITS}
        try:
            with self._pending_path.open(encoding="utf-8") as f:
                for (unit, _, _), line in zip(self._rows, f):
                    tmp[split_of[unit]].write(line)
        finally:
            for h in tmp.values():
                h.close()
        for s in SPLITS:
            os.replace(self.out / f"{s}.jsonl.tmp", self.out / f"{s}.jsonl")
        self._pending_path.unlink()
        ids_dir = self.out / SPLIT_IDS_DIR
        ids_dir.mkdir(exist_ok=True)
        for s in SPLITS:
            (ids_dir / f"{s}_ids.txt").write_text("".join(f"{u}\n" for u in assignment.get(s, [])), encoding="utf-8")
        stats["splits"] = {s: self._split_stats(set(assignment.get(s, []))) for s in SPLITS}
        stats["total"] = self._split_stats(set(self.units))
        text = json.dumps(stats, indent=2, ensure_ascii=False) + "\n"
        (self.out / "stats.json").write_text(text, encoding="utf-8")
        return stats

    def _split_stats(self, units: set[str]) -> dict[str, Any]:
        rows = [r for r in self._rows if r[0] in units]
        groups = [g for g in dict.fromkeys(grp for _, grp, _ in rows)]
        gs = [self._groups[g] for g in groups]
        return {
            "examples": len(rows),
            "units": len(units),
            "groups": len(gs),
            "sessions": sum(g.sessions for g in gs),
            "turns": sum(g.turns for g in gs),
            "chunks": sum(g.chunks for g in gs),
            "question_types": dict(sorted(Counter(t for _, _, t in rows).items())),
            "tokens_per_history_whitespace": _length_summary([g.words for g in gs]),
        }


def _skipped_note(stats: dict[str, Any]) -> str:
    n = stats.get("skipped", {}).get("total", 0)
    return f" ({n} record(s) skipped as invalid; see the log)" if n else ""


def input_record(src: Any) -> dict[str, Any]:
    """Path, size and sha256 of an input file, so stats.json pins what was prepared; an input read
    through ``datasets`` (``hub.Table``, which imports this module) brings its own ``record``."""
    if not isinstance(src, Path):
        return dict(src.record)
    return {"path": str(src), "bytes": src.stat().st_size, "sha256": sha256_file(src)}


def run_prepare(
    out_dir: str | os.PathLike,
    inputs: Sequence[Any],
    examples: Callable[[SkipLog], Iterator[tuple[str, Example, Path | str, str]]],
    split: Callable[[list[str]], dict[str, list[str]]],
    meta: dict[str, Any],
    skip_invalid: bool = False,
    splits_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """The common driver: stream ``examples(skips)`` into a writer, split, write everything.

    ``inputs`` are the files (or ``hub.Table`` datasets) read, for stats.json's ``inputs``.
    ``examples`` yields ``(unit, example, path, where)``; ``split`` maps the
    unit ids (in first-seen order) to splits unless ``splits_dir`` holds
    frozen lists. ``meta`` (dataset, source, split rule, loader counts ...) is
    merged into stats.json; the loader may keep adding to it while it yields.
    """
    skips = SkipLog(skip_invalid)
    writer = PreparedWriter(out_dir)
    try:
        for unit, ex, path, where in examples(skips):
            try:
                writer.add(unit, ex, path, where)
            except DataError as e:
                skips.handle(e)
        units = writer.units
        stats: dict[str, Any] = {**meta, "inputs": [input_record(p) for p in inputs]}
        if splits_dir is not None:
            frozen = read_frozen_splits(splits_dir)
            assignment, absent = apply_frozen(units, frozen, Path(splits_dir))
            stats["split"] = {**stats.get("split", {}), "frozen_from": str(splits_dir),
                              "listed_ids_absent_from_data": absent}
        else:
            assignment = split(units)
        stats["skipped"] = skips.to_json()
        stats["free_form_examples"] = writer.free_form
        return writer.finish(assignment, stats)
    except BaseException:
        writer.abort()
        raise
