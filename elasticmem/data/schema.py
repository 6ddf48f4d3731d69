"""The shared example schema (DESIGN.md section 2) and its JSONL reader/writer.

One example a line::

    {"id": str, "source": str, "group": str, "question": str, "choices": [str, ...],
     "answer_index": int, "question_type": str,
     "history": [[{"role": str, "content": str, "date"?: str, "speaker"?: str}, ...], ...],
     "answer_text"?: str}

Multiple-choice examples have at least 2 ``choices`` and ``answer_index`` in
range. Free-form examples (e.g. LoCoMo QA scored by F1/BLEU) have
``choices: []``, ``answer_index: -1`` and a non-empty ``answer_text``, the
reference answer; ``Example.is_free_form`` tells them apart.

``history`` is a list of sessions, each a list of turns. Examples that share a
history share a ``group`` (conversation or context id): the bank is built once
per group. Within one file, ``history`` may be left out of a record whose group
already appeared: it then is the history of that group's earlier record (so a
LoCoMo conversation asked 200 questions is written once, not 200 times). ``group`` defaults to ``id`` when absent.

Every validation error names the file, the line and the field, so a user can
find the bad record in a multi-GB file.

``load_split(DIR, SPLIT, as_dataset=True)`` gives a split as a Hugging Face ``datasets.Dataset``
(memory-mapped Arrow), derived from the validated JSONL, which stays the contract: one row per
example, its JSON object with the group's history filled in, a field the example lacks null.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, overload

from elasticmem.config import SPLITS  # noqa: F401  (re-exported: the splits are a setting's vocabulary)
from elasticmem.utils.common import sha256_file

if TYPE_CHECKING:
    import datasets


class SchemaError(ValueError):
    """A record does not follow the example schema; the message names where and what."""


@dataclass(frozen=True)
class Turn:
    role: str
    """Who speaks: "user" or "assistant" (other roles are kept as lone turns); "memory" for a
    memory written as such (a skill card), chunked as its content alone."""
    content: str
    """The turn's text."""
    date: str | None = None
    """The session or turn date, kept verbatim from the source."""
    speaker: str | None = None
    """The speaker's name where the source has one (LoCoMo); replaces the role label in chunks."""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.date is not None:
            d["date"] = self.date
        if self.speaker is not None:
            d["speaker"] = self.speaker
        return d


@dataclass(frozen=True)
class Example:
    id: str
    source: str
    question: str
    choices: list[str]
    answer_index: int
    question_type: str
    history: list[list[Turn]]
    group: str = ""
    answer_text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Source-specific fields kept verbatim (not interpreted by the framework)."""

    def __post_init__(self) -> None:
        if not self.group:
            object.__setattr__(self, "group", self.id)

    @property
    def is_free_form(self) -> bool:
        """True for a free-form QA example: no choices, the reference answer in ``answer_text``."""
        return not self.choices

    @property
    def answer_letter(self) -> str:
        """The gold option letter ("a", "b", ...); "" for a free-form example, which has none."""
        return "" if self.is_free_form else chr(ord("a") + self.answer_index)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "source": self.source,
            "group": self.group,
            "question": self.question,
            "choices": list(self.choices),
            "answer_index": self.answer_index,
            "question_type": self.question_type,
            "history": [[t.to_json() for t in session] for session in self.history],
        }
        if self.answer_text is not None:
            d["answer_text"] = self.answer_text
        d.update(self.extra)
        return d

    @classmethod
    def from_json(cls, d: Any, where: str = "<record>",
                  histories: dict[str, list[list[Turn]]] | None = None) -> "Example":
        """Validate one decoded JSON object; ``where`` (e.g. "file.jsonl:12") prefixes errors.

        ``histories`` maps groups seen earlier in the same file to their history: a record
        without ``history`` takes its group's (and a record with one is added).
        """
        if not isinstance(d, dict):
            raise SchemaError(f"{where}: expected a JSON object, got {type(d).__name__}")

        def need(key: str, typ: type | tuple[type, ...]) -> Any:
            if key not in d:
                raise SchemaError(f"{where}: missing field '{key}'")
            v = d[key]
            if not isinstance(v, typ) or isinstance(v, bool) and typ is int:
                name = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
                raise SchemaError(f"{where}: field '{key}' must be {name}, got {type(v).__name__}")
            return v

        ex_id = need("id", (str, int))
        ex_id = str(ex_id)
        where = f"{where} (id {ex_id!r})"
        question = need("question", str)
        choices = need("choices", list)
        answer_index = need("answer_index", int)
        answer_text = d.get("answer_text")
        if answer_text is not None and not isinstance(answer_text, str):
            raise SchemaError(f"{where}: field 'answer_text' must be a string")
        if not choices:
            # Free-form QA: the reference answer is the text itself, so it must be there.
            if answer_index != -1:
                raise SchemaError(
                    f"{where}: field 'answer_index' = {answer_index} but 'choices' is empty; a free-form "
                    "example has answer_index -1 and its reference answer in 'answer_text'"
                )
            if not (answer_text or "").strip():
                raise SchemaError(
                    f"{where}: field 'answer_text' is missing or empty; a free-form example (empty "
                    "'choices') needs its reference answer there"
                )
        elif len(choices) < 2:
            raise SchemaError(f"{where}: field 'choices' needs at least 2 options, got {len(choices)}")
        for i, c in enumerate(choices):
            if not isinstance(c, str):
                raise SchemaError(f"{where}: field 'choices[{i}]' must be str, got {type(c).__name__}")
        if choices and not 0 <= answer_index < len(choices):
            raise SchemaError(
                f"{where}: field 'answer_index' = {answer_index} is outside the {len(choices)} choices"
            )
        group = d.get("group", "")
        if not isinstance(group, (str, int)):
            raise SchemaError(f"{where}: field 'group' must be a string")
        group = str(group) or ex_id
        if "history" not in d and histories is not None and group in histories:
            history_raw = None
        elif "history" not in d:
            raise SchemaError(f"{where}: missing field 'history' (a record may leave it out only when an "
                              f"earlier record of its group {group!r} in the same file has it)")
        else:
            history_raw = need("history", list)
        if history_raw is None:
            history = histories[group]
        elif not history_raw or all(isinstance(s, list) and not s for s in history_raw):
            raise SchemaError(f"{where}: field 'history' is empty: an example needs a history to remember")
        else:
            history = _parse_history(history_raw, where)
            if histories is not None:
                histories[group] = history
        known = {"id", "source", "group", "question", "choices", "answer_index", "question_type",
                 "history", "answer_text"}
        return cls(
            id=ex_id,
            source=str(d.get("source", "")),
            question=question,
            choices=list(choices),
            answer_index=answer_index,
            question_type=str(d.get("question_type", "")),
            history=history,
            group=group,
            answer_text=answer_text,
            extra={k: v for k, v in d.items() if k not in known},
        )


def _parse_history(history_raw: list, where: str) -> list[list[Turn]]:
    """Validate a decoded ``history`` field."""
    history: list[list[Turn]] = []
    for si, session in enumerate(history_raw):
        if not isinstance(session, list):
            raise SchemaError(f"{where}: field 'history[{si}]' must be a list of turns")
        turns = []
        for ti, t in enumerate(session):
            tw = f"history[{si}][{ti}]"
            if not isinstance(t, dict):
                raise SchemaError(f"{where}: field '{tw}' must be an object")
            for key in ("role", "content"):
                if not isinstance(t.get(key), str):
                    raise SchemaError(f"{where}: field '{tw}.{key}' is missing or not a string")
            for key in ("date", "speaker"):
                if t.get(key) is not None and not isinstance(t[key], str):
                    raise SchemaError(f"{where}: field '{tw}.{key}' must be a string")
            turns.append(Turn(t["role"], t["content"], t.get("date"), t.get("speaker")))
        history.append(turns)
    return history


def iter_examples(path: str | os.PathLike) -> Iterator[Example]:
    """Stream examples from a JSONL file, one validated ``Example`` per non-blank line.

    A record without ``history`` gets its group's from an earlier record (the same list
    object, so shared histories are held once).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"example file not found: {path}")
    histories: dict[str, list[list[Turn]]] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SchemaError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            yield Example.from_json(obj, where, histories)


def unique_examples(examples: Iterable[Example], path: str | os.PathLike) -> Iterator[Example]:
    """``examples`` as they come; a duplicate id (a SchemaError naming ``path``) stops them."""
    seen: set[str] = set()
    for ex in examples:
        if ex.id in seen:
            raise SchemaError(f"{path}: duplicate example id {ex.id!r}")
        seen.add(ex.id)
        yield ex


def read_examples(path: str | os.PathLike) -> list[Example]:
    """Read and validate a whole JSONL file; duplicate ids are an error."""
    return list(unique_examples(iter_examples(path), path))


def write_examples(path: str | os.PathLike, examples: Iterable[Example], share_histories: bool = True) -> int:
    """Write examples as JSONL atomically (temp file + rename); returns the count.

    ``share_histories``: a record whose group's history was already written in this file
    (an equal one) leaves ``history`` out; readers fill it in (see the module docstring).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    written: dict[str, list[list[Turn]]] = {}
    with tmp.open("w", encoding="utf-8") as f:
        for ex in examples:
            d = ex.to_json()
            prev = written.get(ex.group)
            if share_histories and prev is not None and (prev is ex.history or prev == ex.history):
                del d["history"]
            else:
                written[ex.group] = ex.history
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def split_path(data_dir: str | os.PathLike, split: str) -> Path:
    return Path(data_dir) / f"{split}.jsonl"


@overload
def load_split(data_dir: str | os.PathLike, split: str, as_dataset: Literal[False] = False) -> list[Example]: ...


@overload
def load_split(data_dir: str | os.PathLike, split: str, as_dataset: Literal[True]) -> "datasets.Dataset": ...


def load_split(data_dir: str | os.PathLike, split: str, as_dataset: bool = False) -> "list[Example] | datasets.Dataset":
    """Read ``DATA_DIR/SPLIT.jsonl``; a missing file names the command that prepares it.

    ``as_dataset``: a ``datasets.Dataset`` instead (``examples_dataset``), memory-mapped from Arrow.
    """
    p = split_path(data_dir, split)
    if not p.is_file():
        raise FileNotFoundError(
            f"split '{split}' not found at {p}; prepare the data first "
            f"(e.g. python -m elasticmem.data.prepare synthetic --config CONFIG)"
        )
    return examples_dataset(p, split) if as_dataset else read_examples(p)


# --------------------------------------------------------------------------- as a datasets.Dataset

ARROW_FORMAT = 1
"""In the Arrow file's name: bump it when the rows or the validation change, so old files are not reused."""
ARROW_CACHE = "elasticmem_splits"
"""The Arrow files' folder under the datasets cache (``HF_DATASETS_CACHE``)."""
_SCALARS = {str: "string", bool: "bool", int: "int64", float: "float64"}


def example_features(extra_types: dict[str, set[type]]) -> "datasets.Features":
    """The schema's columns, typed, then one column per source-specific field (``extra_types``:
    field -> the Python types of its non-null values).

    A field whose values are all str (or all bool, int, float) is a column of that type; any other
    (lists such as LoCoMo's evidence, objects, values of mixed types) is a ``Json`` column, which
    returns each value exactly as written.
    """
    import datasets

    text = datasets.Value("string")
    turn = {"role": text, "content": text, "date": text, "speaker": text}
    core = {"id": text, "source": text, "group": text, "question": text, "choices": datasets.List(text),
            "answer_index": datasets.Value("int64"), "question_type": text,
            "history": datasets.List(datasets.List(turn)), "answer_text": text}
    extra = {}
    for k, types in extra_types.items():
        only = next(iter(types)) if len(types) == 1 else None
        extra[k] = datasets.Value(_SCALARS[only]) if only in _SCALARS else datasets.Json()
    return datasets.Features({**core, **{k: v for k, v in extra.items() if k not in core}})


def examples_dataset(path: str | os.PathLike, split: str | None = None) -> "datasets.Dataset":
    """The JSONL file's examples as a ``datasets.Dataset``, memory-mapped from an Arrow file.

    Every line is validated first (``iter_examples``, duplicate ids refused), so the Dataset is
    only ever made of valid examples. The Arrow file lives in the datasets cache under the JSONL's
    sha256: a later call on the same content opens it without reading the JSONL again, and a
    re-prepared split (other content) gets a new one.
    """
    import datasets
    from datasets.arrow_writer import ArrowWriter

    path = Path(path)
    folder = Path(datasets.config.HF_DATASETS_CACHE) / ARROW_CACHE
    arrow = folder / f"examples-v{ARROW_FORMAT}-{sha256_file(path)}.arrow"
    if not arrow.is_file():
        extra: dict[str, set[type]] = {}  # in first-seen order
        for ex in unique_examples(iter_examples(path), path):
            for k, v in ex.extra.items():
                extra.setdefault(k, set()).update(() if v is None else (type(v),))
        features = example_features(extra)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = arrow.with_name(f"{arrow.name}.{os.getpid()}.tmp")
        try:
            # Small batches: a row holds its whole history (LongMemEval-M: ~1.5M tokens).
            with ArrowWriter(features=features, path=str(tmp), writer_batch_size=32) as writer:
                for ex in iter_examples(path):
                    row = ex.to_json()
                    writer.write({k: row.get(k) for k in features})
                writer.finalize()
            os.replace(tmp, arrow)  # atomic: a concurrent reader sees the whole file or none
        finally:
            tmp.unlink(missing_ok=True)
    return datasets.Dataset.from_file(str(arrow), split=datasets.NamedSplit(split) if split else None)
