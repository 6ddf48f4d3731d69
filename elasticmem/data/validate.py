"""Start-up validation: refuse, in one error, examples that would fail or mislead mid-run.

Training and evaluation call :func:`validate_examples` once, after loading the split and
opening the bank and before the first batch. It checks what can be known up front and
raises one :class:`DataError` that lists, per reason, the offending example ids (group ids
for bank problems), at most ``MAX_LISTED`` each plus a count:

* groups missing from the bank (they would raise ``KeyError`` at their first batch);
* groups whose history gives other chunks than the bank holds, i.e. a bank built from
  other data (compared with the manifest's ``groups_sha256``; a bank built before that
  field existed cannot be verified: a warning, once per bank, and no refusal);
* a bank tokenized with other chunking settings than ``chunking``;
* examples with no history to remember (when memory is used);
* more choices than the option letters a..j the scorer reads (``rewards.MAX_OPTIONS``),
  ``answer_index`` outside the choices, duplicate ids;
* free-form examples under the ``mc_letter`` reward, free-form examples without
  ``answer_text``, and examples another reward refuses (it is asked with an empty answer).

Bank checks are skipped without a bank or with ``top_z=0`` (nothing is retrieved). All but
the chunk comparison are a pass over the examples (~10 ms for 10k); the comparison chunks
each distinct history once (no tokenizer: ~3 ms for a 600-turn LoCoMo conversation).

    pytest tests/unit/test_validate.py
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Protocol, Sequence

from elasticmem.config import ChunkingConfig
from elasticmem.data.chunking import history_fingerprint
from elasticmem.data.rewards import MAX_OPTIONS, get_reward
from elasticmem.data.schema import Example, SchemaError


class BankView(Protocol):
    """What validation reads of an ``elasticmem.bank.Bank`` (the bank sits above the data layer,
    so it is described here, not imported)."""

    root: Any
    manifest: Mapping[str, Any]
    groups: Mapping[str, Any]

    @property
    def groups_sha256(self) -> Mapping[str, str] | None: ...

MAX_LISTED = 5
"""Ids shown per reason; the rest are counted."""

_warned_unverified: set[str] = set()


class DataError(SchemaError):
    """Examples that cannot be trained on or evaluated as configured.

    ``problems`` maps each reason to the offending ids (group ids where the reason is about
    groups, none for a bank-wide reason). A ``SchemaError``, so the CLIs report it as one.
    """

    def __init__(self, message: str, problems: dict[str, list[str]]):
        super().__init__(message)
        self.problems = problems


def _listed(ids: Sequence[str]) -> str:
    shown = ", ".join(repr(i) for i in ids[:MAX_LISTED])
    return shown + (f" and {len(ids) - MAX_LISTED} more" if len(ids) > MAX_LISTED else "")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class _Report:
    """Problems found so far, by reason."""

    def __init__(self) -> None:
        self.by_example: dict[str, list[str]] = {}  # reason -> example ids
        self.by_group: dict[str, dict[str, int]] = {}  # reason -> group -> number of examples
        self.bank_wide: list[str] = []

    def flag(self, reason: str, ex_id: str) -> None:
        self.by_example.setdefault(reason, []).append(ex_id)

    def flag_group(self, reason: str, group: str) -> None:
        groups = self.by_group.setdefault(reason, {})
        groups[group] = groups.get(group, 0) + 1

    def raise_if_any(self, split_name: str, n_examples: int) -> None:
        if not (self.by_example or self.by_group or self.bank_wide):
            return
        lines = [f"  - {r}; {_plural(len(ids), 'example')}: {_listed(ids)}" for r, ids in self.by_example.items()]
        lines += [f"  - {r}; {_plural(len(gs), 'group')} ({_plural(sum(gs.values()), 'example')}): "
                  f"{_listed(list(gs))}" for r, gs in self.by_group.items()]
        lines += [f"  - {r}" for r in self.bank_wide]
        problems = {**self.by_example, **{r: list(gs) for r, gs in self.by_group.items()},
                    **{r: [] for r in self.bank_wide}}
        raise DataError(f"{split_name} ({_plural(n_examples, 'example')}) cannot be used as configured:\n"
                        + "\n".join(lines), problems)


def _warn_unverified(bank: BankView) -> None:
    key = str(bank.root.resolve())
    if key in _warned_unverified:
        return
    _warned_unverified.add(key)
    warnings.warn(
        f"bank {bank.root} records no fingerprint of its data (manifest field 'groups_sha256'; built by an "
        f"older version): cannot verify that its chunks come from these examples. Run build_bank.py again "
        f"with the config it was built with to record it (nothing is re-encoded), or rebuild it.",
        stacklevel=4,  # the caller of validate_examples
    )


def validate_examples(
    examples: Sequence[Example],
    bank: BankView | None = None,
    *,
    reward: str | None = None,
    chunking: ChunkingConfig | None = None,
    top_z: int | None = None,
    split_name: str = "examples",
) -> None:
    """Raise one ``DataError`` listing every example that cannot be used as configured.

    Args:
        examples: the examples about to be trained on or evaluated (after any limit).
        bank: the opened bank the memory reads, or None when there is none (A-Mem).
        reward: the training reward's name (``cfg.train.reward``); None for evaluation, where
            multiple-choice examples are scored by option letter and free-form ones by text.
        chunking: the chunking settings in use (``cfg.chunking``); None skips comparing them
            with the bank's ``tokenization``.
        top_z: chunks retrieved per query (``memory.top_z`` in use); 0 = memory off, which
            skips the bank checks; None = memory on.
        split_name: how messages name the examples, e.g. ``"runs/data/x/train.jsonl"``.

    Example::

        validate_examples(examples, bank, reward="mc_letter", chunking=cfg.chunking,
                          top_z=cfg.memory.top_z, split_name=f"{cfg.data.dir}/train.jsonl")
        # DataError: runs/data/x/train.jsonl (1200 examples) cannot be used as configured:
        #   - more than 10 choices: option letters a-j score at most 10 (...); 1 example: 'q17'
        #   - group not in bank runs/bank/x (...); 2 groups (8 examples): 'conv-41', 'conv-42'
    """
    report = _Report()
    flag = report.flag
    reward_fn = get_reward(reward) if reward is not None and reward != "mc_letter" else None
    too_many = (f"more than {MAX_OPTIONS} choices: option letters a-{chr(ord('a') + MAX_OPTIONS - 1)} "
                f"score at most {MAX_OPTIONS} (elasticmem.data.rewards.MAX_OPTIONS)")
    seen: set[str] = set()
    for ex in examples:
        if ex.id in seen:
            flag("duplicate id", ex.id)
        seen.add(ex.id)
        if ex.choices:
            if len(ex.choices) > MAX_OPTIONS:
                flag(too_many, ex.id)
            if not 0 <= ex.answer_index < len(ex.choices):
                flag("answer_index outside the choices", ex.id)
        elif reward == "mc_letter":
            flag("free-form (no choices), which the mc_letter reward cannot score: train on a multiple-choice "
                 "preparation (e.g. locomo-mc10)", ex.id)
        elif not (ex.answer_text or "").strip():
            flag("free-form (no choices) without an answer_text to score against", ex.id)
        if reward_fn is not None:
            try:
                reward_fn("", ex)
            except ValueError as e:
                flag(f"the {reward} reward cannot score it: {str(e).removeprefix(f'example {ex.id!r}: ')}", ex.id)

    if bank is not None and top_z != 0:
        _check_bank(examples, bank, chunking, report)
    report.raise_if_any(split_name, len(examples))


def _check_bank(examples: Sequence[Example], bank: BankView, chunking: ChunkingConfig | None,
                report: _Report) -> None:
    """Groups missing from the bank or whose chunks differ from it; the bank's tokenization."""
    if chunking is not None:
        recorded = bank.manifest.get("tokenization", {})
        differ = {k: v for k, v in recorded.items() if getattr(chunking, k, v) != v}
        if differ:
            wanted = {k: getattr(chunking, k) for k in differ}
            report.bank_wide.append(
                f"bank {bank.root} was tokenized with {differ} but chunking is {wanted}: rebuild the bank "
                f"with these settings (build_bank.py, bank.overwrite=true) or use the chunking it was built with")
    fingerprints = bank.groups_sha256
    if fingerprints is None:
        _warn_unverified(bank)
    missing = f"group not in bank {bank.root} (build the bank from the data and splits used here)"
    mismatch = (f"history chunks differ from the group's chunks in bank {bank.root} (built from other data: "
                f"rebuild it with build_bank.py, bank.overwrite=true)")
    first: dict[str, tuple[object, str]] = {}  # group -> (a history, its fingerprint)
    for ex in examples:
        g = ex.group
        if g not in bank.groups:
            report.flag_group(missing, g)
        elif not any(ex.history):
            report.flag("empty history: no turns to remember", ex.id)
        elif fingerprints is not None:
            ref = first.get(g)
            if ref is not None and (ex.history is ref[0] or ex.history == ref[0]):
                fp = ref[1]
            else:
                fp = history_fingerprint(ex.history)
                first.setdefault(g, (ex.history, fp))
            if fp != fingerprints.get(g):
                report.flag_group(mismatch, g)


__all__ = ["MAX_LISTED", "DataError", "validate_examples"]
