"""Re-scoring predictions from their text, and checking published figures against it.

    python -m pytest -q tests/unit/test_provenance.py

A ``predictions.jsonl`` record keeps the answer text (``prediction``), the gold answer (``gold``:
the option letter for multiple choice, the reference text for free form) and the ``correct`` flag
the evaluation stored. A published figure should follow from the text, not from a flag that an
edit, a bug or an older scorer could have left wrong, so :func:`rescore_file` parses each
answer again with the project's own rules (``elasticmem.data.rewards.parse_option_letter``, the
rule of the ``mc_letter`` reward and of evaluation; or A-Mem's ``exact_match`` for free form).

A results file under ``docs/results/`` (``scripts/gen_results_tables.py``) may name the
predictions its figures come from::

    "predictions": {
      "elasticmem": {"path": "docs/results/x/elasticmem.predictions.jsonl",  # repo-relative or absolute
                     "sha256": "<hex sha256 of the file>",
                     "accuracy": 0.6130952380952381,                     # the published figure, unrounded
                     "num_options": 4,                                   # mc_letter: options per question
                     "scorer": "mc_letter",                              # or "exact_match"; default mc_letter
                     "figure": "systems.elasticmem.accuracy"}            # optional: where data holds it
    }

:func:`check_predictions` refuses (:class:`RescoreError`, naming the file and both figures) a
file that is missing, whose sha256 differs, whose re-scored accuracy differs from ``accuracy``,
or whose ``figure`` in ``data`` differs from ``accuracy``. :func:`predictions_entry` writes such
an entry. A figure that changed may say so in the results file's optional ``changed`` list
(:func:`check_changed`: items with ``figure``, ``was``, ``now`` and ``why``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticmem.data.rewards import MAX_OPTIONS, parse_option_letter
from elasticmem.eval.metrics import load_records
from elasticmem.eval.provenance import file_sha256

SCORERS = ("mc_letter", "exact_match")
"""How a record's text is scored: the option letter parsed from it against the gold letter, or an
exact match (stripped, lower-cased) with the gold reference text."""

TOLERANCE = 1e-9
"""A published accuracy must equal the re-scored one up to float rounding (store it unrounded)."""

CHANGED_KEYS = ("figure", "was", "now", "why")
"""The fields of each item of a results file's ``changed`` list."""


class RescoreError(ValueError):
    """A published figure does not follow from its predictions' text (or they are not the ones named)."""


def rescore_record(record: Mapping[str, Any], num_options: int | None = None, scorer: str = "mc_letter") -> bool:
    """Whether ``record["prediction"]`` is right about ``record["gold"]``, re-parsed from the text.

    ``mc_letter``: the gold is an option letter among the first ``num_options``, and the answer
    is right when ``parse_option_letter(prediction, num_options)`` names it (the stored
    ``correct`` flag is not read). ``exact_match``: A-Mem's exact match with the gold text."""
    text = str(record.get("prediction", ""))
    gold = str(record.get("gold", ""))
    if scorer == "exact_match":
        from elasticmem.eval.free_form import exact_match

        return bool(exact_match(text, gold))
    if scorer != "mc_letter":
        raise ValueError(f"unknown scorer {scorer!r}; one of {SCORERS}")
    if num_options is None or not 1 <= int(num_options) <= MAX_OPTIONS:
        raise ValueError(f"mc_letter re-scoring needs num_options in 1..{MAX_OPTIONS}, got {num_options!r}")
    index = ord(gold.strip().lower()) - ord("a") if len(gold.strip()) == 1 else -1
    if not 0 <= index < int(num_options):
        raise ValueError(f"record {record.get('id')!r}: gold {gold!r} is not one of the first {num_options} "
                         "option letters")
    return parse_option_letter(text, int(num_options)) == index


def rescore_records(records: Sequence[Mapping[str, Any]], num_options: int | None = None,
                    scorer: str = "mc_letter") -> dict[str, bool]:
    """``{id: correct}`` of ``records``, re-scored from their text; refuses an id twice."""
    out: dict[str, bool] = {}
    for r in records:
        i = str(r["id"])
        if i in out:
            raise ValueError(f"id {i!r} occurs twice")
        out[i] = rescore_record(r, num_options, scorer)
    return out


def rescore_file(path: str | Path, num_options: int | None = None, scorer: str = "mc_letter") -> dict[str, bool]:
    """``{id: correct}`` of a ``predictions.jsonl``, re-scored from the answers' text."""
    try:
        return rescore_records(load_records(path), num_options, scorer)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def rescored_accuracy(path: str | Path, num_options: int | None = None, scorer: str = "mc_letter") -> tuple[float, int]:
    """``(accuracy, n)`` of a ``predictions.jsonl`` re-scored from its text."""
    correct = rescore_file(path, num_options, scorer)
    if not correct:
        raise ValueError(f"{path}: no predictions")
    return sum(correct.values()) / len(correct), len(correct)


def resolve(path: str | Path, base: str | Path) -> Path:
    """``path`` as given when absolute, else relative to ``base`` (the repository)."""
    p = Path(path)
    return p if p.is_absolute() else Path(base) / p


def predictions_entry(path: str | Path, base: str | Path, num_options: int | None = None,
                      scorer: str = "mc_letter", figure: str | None = None) -> dict[str, Any]:
    """A results file's ``predictions`` entry for ``path`` (written relative to ``base`` when it
    lies under it): its sha256 and re-scored accuracy now."""
    full = resolve(path, base)
    acc, n = rescored_accuracy(full, num_options, scorer)
    try:
        shown = full.resolve().relative_to(Path(base).resolve()).as_posix()
    except ValueError:
        shown = str(full)
    entry: dict[str, Any] = {"path": shown, "sha256": file_sha256(full), "accuracy": acc, "n": n, "scorer": scorer}
    if scorer == "mc_letter":
        entry["num_options"] = num_options
    if figure is not None:
        entry["figure"] = figure
    return entry


def _lookup(data: Any, dotted: str) -> Any:
    """``data`` at a dotted path (``systems.elasticmem.accuracy``; list items by their index)."""
    obj = data
    for key in dotted.split("."):
        obj = obj[int(key)] if isinstance(obj, list) else obj[key]
    return obj


def check_changed(changed: Any, where: str = "results file") -> None:
    """Refuse a malformed ``changed`` list (each item: ``figure``, ``was``, ``now``, ``why``)."""
    if not isinstance(changed, list) or not all(isinstance(c, dict) for c in changed):
        raise RescoreError(f"{where}: 'changed' must be a list of objects with {', '.join(CHANGED_KEYS)}")
    for i, c in enumerate(changed):
        missing = [k for k in CHANGED_KEYS if k not in c]
        if missing:
            raise RescoreError(f"{where}: changed[{i}] lacks {', '.join(missing)}")
        if not str(c["why"]).strip():
            raise RescoreError(f"{where}: changed[{i}] ({c['figure']}) must say why it changed")


def check_predictions(spec: Mapping[str, Any], base: str | Path, where: str = "results file") -> list[dict[str, Any]]:
    """Re-score every prediction file a results file names (``spec["predictions"]``) and refuse
    any that does not give its published figure; returns one ``{label, path, published,
    rescored, n}`` per file checked (none when the spec names no predictions).

    Raises :class:`RescoreError` naming ``where``, the predictions file and both figures (or both
    sha256) at the first file that fails; also checks ``spec["changed"]`` when present."""
    if "changed" in spec:
        check_changed(spec["changed"], where)
    entries = spec.get("predictions") or {}
    if not isinstance(entries, Mapping):
        raise RescoreError(f"{where}: 'predictions' must map a label to {{path, sha256, accuracy, ...}}")
    checked = []
    for label, e in entries.items():
        for key in ("path", "sha256", "accuracy"):
            if key not in e:
                raise RescoreError(f"{where}: predictions[{label}] lacks '{key}'")
        path = resolve(e["path"], base)
        if not path.is_file():
            raise RescoreError(f"{where}: predictions[{label}]: {path} does not exist, so its figure "
                               f"{e['accuracy']} cannot be re-scored")
        digest = file_sha256(path)
        if digest != e["sha256"]:
            raise RescoreError(f"{where}: predictions[{label}]: {path} has sha256 {digest}, the results file "
                               f"says {e['sha256']}: not the predictions the figure was published from")
        try:
            acc, n = rescored_accuracy(path, e.get("num_options"), e.get("scorer", "mc_letter"))
        except ValueError as err:
            raise RescoreError(f"{where}: predictions[{label}]: {err}") from None
        published = float(e["accuracy"])
        if not math.isclose(acc, published, rel_tol=0.0, abs_tol=TOLERANCE):
            raise RescoreError(f"{where}: predictions[{label}]: {path} re-scores from its text to accuracy "
                               f"{acc!r} (n = {n}), the results file publishes {published!r}")
        if "figure" in e:
            try:
                shown = _lookup(spec.get("data", {}), e["figure"])
            except (KeyError, IndexError, ValueError, TypeError):
                raise RescoreError(f"{where}: predictions[{label}]: no figure {e['figure']!r} in data") from None
            if not isinstance(shown, (int, float)) or not math.isclose(float(shown), published, rel_tol=0.0,
                                                                       abs_tol=TOLERANCE):
                raise RescoreError(f"{where}: predictions[{label}]: data.{e['figure']} is {shown!r}, the "
                                   f"re-scored accuracy is {acc!r}")
        checked.append({"label": label, "path": str(path), "published": published, "rescored": acc, "n": n})
    return checked


__all__ = ["CHANGED_KEYS", "RescoreError", "SCORERS", "check_changed", "check_predictions", "predictions_entry",
           "rescore_file", "rescore_record", "rescore_records", "rescored_accuracy", "resolve"]
