"""The real-benchmark loaders' inputs through Hugging Face ``datasets``: Hub ids, saved datasets, folders.

An ``--input`` of ``python -m elasticmem.data.prepare`` (``prepare.input``) is one of:

* a local file (``locomo10.json``, ``questions_32k.csv``, ...): read by the loaders' own
  streaming readers, as before; with ``--via-datasets`` through
  ``datasets.load_dataset("json" | "csv", data_files=FILE)`` instead (same prepared output);
* a local folder: a dataset written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
  (``datasets.load_from_disk``), else a folder of data files (``datasets.load_dataset(FOLDER)``,
  the builder inferred from the files' extensions, as for a Hub repository);
* a Hub dataset: ``owner/name`` (when no local path of that name exists), or
  ``hf://datasets/owner/name[@REVISION][/FILE]`` to pin a revision or pick one file of the
  repository (LongMemEval's repository holds ``longmemeval_s.json`` and ``longmemeval_m.json``).
  It is loaded with ``datasets.load_dataset``: from the user's datasets cache, else downloaded;
  with ``HF_DATASETS_OFFLINE=1`` (or ``HF_HUB_OFFLINE=1``) only from the cache.

``SPEC:SPLIT`` picks one split of a folder or Hub dataset that has several.

Why local files keep the streaming readers by default: ``load_dataset("json")`` reads a
top-level JSON list whole (LongMemEval-M is GBs; ``sources.iter_json_list`` holds one item) and
writes an Arrow copy into the cache, and its errors name no line or item, where the readers name
both and ``--skip-invalid`` keeps what precedes a truncation. Nothing else differs: the records
reach the same parsers either way (tests/unit/test_data_datasets.py prepares both ways and
compares the files byte for byte).

Why ``load_dataset("json")`` is safe for these ragged records: ``datasets`` >= 5 stores a field
whose values change shape between records (LoCoMo's ``conversation`` with its ``session_N`` keys,
turns with optional keys, answers that are strings or numbers) as a ``Json`` feature, which
decodes to exactly the JSON it read; no schema is forced on them. Only a key a record lacks
comes back as null (Arrow has no "absent"), so ``strip_nulls`` drops null-valued keys.

``datasets`` is imported inside the functions: ``import elasticmem`` stays fast.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_data_datasets.py
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from elasticmem.data.sources import DataError, SkipLog, input_record, iter_jsonl

if TYPE_CHECKING:
    import datasets

HF_PREFIX = "hf://datasets/"
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".txt", ".gz", ".zip", ".bz2", ".xz")
"""A bare ``a/b`` ending like a data file is a mistyped local path, not a Hub id."""
_SPLIT = re.compile(r"[A-Za-z0-9_][\w.-]*")
_REPO_AT_REV = r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w.-]+))?"
_BARE_ID = re.compile(_REPO_AT_REV)
_HF_URL = re.compile(_REPO_AT_REV + r"(?:/(?P<file>.+))?")
_HINT = "a Hub dataset is given as owner/name or hf://datasets/owner/name[@REVISION][/FILE]"


@dataclass(frozen=True)
class HubSpec:
    """A Hub dataset named on the command line."""

    repo: str
    """``owner/name``."""
    revision: str | None = None
    """A branch, tag or commit (``@REVISION``); None = the default branch."""
    file: str | None = None
    """One data file of the repository (``/FILE``, a glob allowed); None = the repository's own layout."""


@dataclass(frozen=True)
class Table:
    """One split of a dataset read through ``datasets``, handed to a loader in place of a file."""

    spec: str
    """What the user gave; errors about its records name it."""
    dataset: "datasets.Dataset"
    record: dict[str, Any]
    """What stats.json's ``inputs`` lists for it (a local file: its path, size and sha256, as read directly)."""

    @property
    def columns(self) -> list[str]:
        return list(self.dataset.column_names)

    def rows(self, strip: bool = True) -> Iterator[tuple[str, Any]]:
        """("row I", record) per row; ``strip`` drops null-valued keys (see the module docstring)."""
        for i, row in enumerate(self.dataset):
            yield f"row {i}", strip_nulls(row) if strip else row


def strip_nulls(value: Any) -> Any:
    """``value`` with every null-valued dict key dropped, at any depth (list items are kept).

    Arrow fills a struct field that a record lacks with null; the loaders read a null field as an
    absent one, so this gives them the record as the source file has it. (A field that is null in
    the source is dropped too: only a verbatim-kept extra field could tell.)
    """
    if isinstance(value, dict):
        return {k: strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_nulls(v) for v in value]
    return value


def label(src: Path | Table) -> str | Path:
    """What an error about a record of ``src`` names: the file, or the spec the user gave."""
    return src.spec if isinstance(src, Table) else src


def jsonl_records(src: Path | Table, skips: SkipLog) -> Iterator[tuple[str, Any]]:
    """("line N" or "row I", decoded object) per record of a JSONL input (MC-10 files, PersonaMem contexts)."""
    if isinstance(src, Table):
        yield from src.rows()
        return
    for lineno, obj in iter_jsonl(src, skips):
        yield f"line {lineno}", obj


# --------------------------------------------------------------------------- resolving an input


def parse_hub_spec(spec: str) -> HubSpec | None:
    """The Hub dataset ``spec`` names, or None when it cannot be one.

    ``hf://datasets/owner/name[@REV][/FILE]`` always is; a bare ``owner/name[@REV]`` is unless its
    name ends like a data file (``runs/locomo10.json`` is a missing local file). A bare spec takes
    no ``/FILE``: ``a/b/c.json`` is far more likely a mistyped local path.
    """
    if spec.startswith(HF_PREFIX):
        m = _HF_URL.fullmatch(spec[len(HF_PREFIX):])
        return HubSpec(m["repo"], m["rev"], m["file"]) if m else None
    m = _BARE_ID.fullmatch(spec)
    if m is None or m["repo"].lower().endswith(DATA_SUFFIXES):
        return None
    return HubSpec(m["repo"], m["rev"])


def split_suffix(spec: str) -> tuple[str, str | None]:
    """``SPEC:SPLIT`` as (SPEC, SPLIT); (spec, None) without one (``hf://``'s colon is no split)."""
    head, sep, tail = spec.rpartition(":")
    if sep and head and _SPLIT.fullmatch(tail):
        return head, tail
    return spec, None


def open_input(spec: str | os.PathLike, what: str, via_datasets: bool = False) -> Path | Table:
    """A loader's input: a local file as a Path (or, ``via_datasets``, as a Table), anything else
    (a folder, a saved dataset, a Hub id) as a Table.

    Raises FileNotFoundError starting "{what} not found: {spec}" when it is none of these, and
    FileNotFoundError / DataError / ValueError saying what failed when ``datasets`` cannot load it.
    """
    text = os.fspath(spec)
    path = Path(text)
    if path.is_file():
        return _file_table(path) if via_datasets else path
    if path.is_dir():
        return _folder_table(path, text, None)
    base, split = split_suffix(text)
    if split is not None and Path(base).is_dir():
        return _folder_table(Path(base), text, split)
    hub = parse_hub_spec(base)
    if hub is None:
        raise FileNotFoundError(f"{what} not found: {text} (no such local file or folder; {_HINT})")
    return _hub_table(hub, split, text, what)


def _file_table(path: Path) -> Table:
    """A local file through ``load_dataset``: CSV cells as the text they are, anything else as JSON."""
    import datasets

    builder = "csv" if path.suffix.lower() == ".csv" else "json"
    kwargs: dict[str, Any] = {}
    if builder == "csv":
        # pandas would type the cells ("007" -> 7, "" -> NaN); the loaders parse the text themselves.
        with path.open(encoding="utf-8", newline="") as f:
            header = next(csv.reader(f), [])
        kwargs = {"features": datasets.Features({c: datasets.Value("string") for c in header}), "na_filter": False}
    try:
        ds = datasets.load_dataset(builder, data_files=str(path.resolve()), split="train", **kwargs)
    except Exception as e:  # datasets wraps parse errors in its own types; the cause says what is wrong
        raise DataError(path, "", None, f"datasets cannot read it as {builder} ({_cause(e)})", "not_dataset") from None
    return Table(str(path), ds, input_record(path))


def _folder_table(folder: Path, spec: str, split: str | None) -> Table:
    """A ``save_to_disk`` folder, else a folder of data files."""
    import datasets

    saved = any((folder / f).is_file() for f in ("state.json", "dataset_dict.json"))
    if not saved and not any(f.is_file() and not f.name.startswith(".") for f in folder.rglob("*")):
        raise DataError(folder, "", None, "is an empty folder: neither a dataset saved with save_to_disk nor a "
                        "folder of data files", "not_dataset")
    try:
        obj = datasets.load_from_disk(str(folder)) if saved else datasets.load_dataset(str(folder.resolve()))
    except Exception as e:
        how = "a dataset saved with save_to_disk" if saved else "a folder of data files (json, jsonl, csv, parquet)"
        raise DataError(folder, "", None, f"datasets cannot read it as {how} ({_cause(e)})", "not_dataset") from None
    return _split_table(obj, spec, split, {})


def _hub_table(hub: HubSpec, split: str | None, spec: str, what: str) -> Table:
    import datasets

    try:
        obj = datasets.load_dataset(hub.repo, data_files=hub.file, revision=hub.revision)
    except Exception as e:
        named = f"the Hub dataset {hub.repo!r}" + (f" (file {hub.file!r})" if hub.file else "")
        # Offline, load_dataset answers ConnectionError for an id it has never cached, and
        # ValueError ("Couldn't find cache ... for config") for one cached with other files.
        if datasets.config.HF_HUB_OFFLINE and (isinstance(e, ConnectionError) or "find cache" in str(e)):
            raise FileNotFoundError(
                f"{what} not found: {spec}: no local file or folder of that name, and {named} is not in the "
                f"datasets cache ({datasets.config.HF_DATASETS_CACHE}) while HF_DATASETS_OFFLINE / HF_HUB_OFFLINE "
                f"forbids downloading it. Run this command once with network access (those variables unset), "
                f"or pass a local file or folder") from None
        if isinstance(e, (FileNotFoundError, ConnectionError)):  # DatasetNotFoundError is a FileNotFoundError
            raise FileNotFoundError(f"{what} not found: {spec}: no local file or folder of that name, and "
                                    f"{named} cannot be found ({_cause(e)})") from None
        raise DataError(spec, "", None, f"datasets cannot load {named} ({_cause(e)})", "not_dataset") from None
    return _split_table(obj, spec, split, {"hub_id": hub.repo, "revision": hub.revision, "file": hub.file})


def _split_table(obj: Any, spec: str, split: str | None, origin: dict[str, Any]) -> Table:
    """The requested split, or the only one, as a Table (its record: ``path``, ``origin``, the split,
    row count and fingerprint); several splits without a choice is an error listing them."""
    import datasets

    if isinstance(obj, datasets.Dataset):
        if split is not None:
            raise ValueError(f"{spec}: the dataset is a single split; drop ':{split}'")
        ds, name = obj, str(obj.split or "")
    else:
        names = list(obj)
        if split is None and len(names) == 1:
            split = names[0]
        if split is None or split not in obj:
            which = f"has no split {split!r}" if split is not None else "has several splits"
            raise ValueError(f"{spec}: the dataset {which} ({', '.join(names)}); name one as "
                             f"{split_suffix(spec)[0]}:SPLIT")
        ds, name = obj[split], split
    return Table(spec, ds, {"path": spec, **origin, "split": name, "rows": len(ds), "fingerprint": ds._fingerprint})


def _cause(e: BaseException) -> str:
    """The innermost explicit cause of ``e``, "Type: message" (datasets wraps parser errors in its own)."""
    for _ in range(20):  # a chain is short; the bound only guards against a pathological one
        if e.__cause__ is None:
            break
        e = e.__cause__
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


__all__ = ["HubSpec", "Table", "jsonl_records", "label", "open_input", "parse_hub_spec", "split_suffix",
           "strip_nulls"]
