"""Start-up validation of examples against the reward and the bank (tiny random model, CPU).

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_validate.py
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from conftest import make_examples
from elasticmem.bank import Bank, build_bank
from elasticmem.config import BankConfig, ChunkingConfig
from elasticmem.data.schema import SchemaError, Turn
from elasticmem.data.validate import DataError, validate_examples
from elasticmem.data.rewards import MAX_OPTIONS

CHUNKING = ChunkingConfig(max_tokens=48)


@pytest.fixture(scope="module")
def data_a():
    return make_examples(3)  # groups g0, g1, g2, two questions each


@pytest.fixture(scope="module")
def bank_a(tmp_path_factory, tiny_backbone, data_a):
    cfg = BankConfig(dir=str(tmp_path_factory.mktemp("validate") / "bank"), n_cache=4, shard_rows=5)
    build_bank({"train": data_a}, tiny_backbone, CHUNKING, cfg, torch.float32, show_progress=False)
    return Bank.open(cfg.dir)


def _with_history(ex, history):
    return dataclasses.replace(ex, history=history)


def test_bank_refuses_examples_of_other_data(data_a, bank_a):
    validate_examples(data_a, bank_a, reward="mc_letter", chunking=CHUNKING, split_name="a.jsonl")  # its own data
    # data B: g1's history differs in one word (a copy, not the same object), g2's is equal but another object
    h1 = [list(s) for s in data_a[2].history]
    h1[0][0] = Turn(h1[0][0].role, h1[0][0].content + " owl", h1[0][0].date)
    h2 = [list(s) for s in data_a[4].history]
    data_b = [data_a[0], data_a[1], _with_history(data_a[2], h1), data_a[3], _with_history(data_a[4], h2)]
    with pytest.raises(DataError) as e:
        validate_examples(data_b, bank_a, split_name="b.jsonl")
    msg = str(e.value)
    assert msg.startswith("b.jsonl (5 examples) cannot be used as configured:")
    assert "history chunks differ" in msg and "; 1 group (1 example): 'g1'" in msg
    assert "'g2'" not in msg and "'g0'" not in msg
    assert isinstance(e.value, SchemaError) and isinstance(e.value, ValueError)  # the CLIs report it


def test_missing_groups_too_many_choices_bad_answer_index_in_one_error(data_a, bank_a):
    other = make_examples(2, seed=5)
    missing = [dataclasses.replace(ex, id=f"m{i}", group=f"new{i // 2}") for i, ex in enumerate(other)]
    eleven = dataclasses.replace(data_a[0], id="eleven", choices=[f"c{i}" for i in range(MAX_OPTIONS + 1)])
    bad_answer = dataclasses.replace(data_a[1], id="bad-answer", answer_index=4)  # 4 choices: 0..3
    examples = [*data_a, *missing, eleven, bad_answer]
    with pytest.raises(DataError) as e:
        validate_examples(examples, bank_a, reward="mc_letter", split_name="train.jsonl")
    msg = str(e.value)
    assert "group not in bank" in msg and "; 2 groups (4 examples): 'new0', 'new1'" in msg
    assert f"more than {MAX_OPTIONS} choices" in msg and "; 1 example: 'eleven'" in msg
    assert "answer_index outside the choices; 1 example: 'bad-answer'" in msg
    assert sorted(sum(e.value.problems.values(), [])) == ["bad-answer", "eleven", "new0", "new1"]


def test_reward_checks(data_a):
    free = dataclasses.replace(data_a[0], id="free", choices=[], answer_index=-1, answer_text="on the mat")
    with pytest.raises(DataError, match=r"mc_letter reward cannot score.*; 1 example: 'free'"):
        validate_examples([free, data_a[1]], reward="mc_letter")
    validate_examples([free, data_a[1]])  # evaluation scores free-form answers by text
    no_answer = dataclasses.replace(free, id="no-answer", answer_text=None)
    with pytest.raises(DataError, match=r"without an answer_text.*'no-answer'"):
        validate_examples([no_answer])
    # another reward is asked whether it can score each example
    alf = dataclasses.replace(free, id="alf", answer_text="open fridge 1", extra={"admissible_commands": ["look"]})
    validate_examples([alf], reward="snapped_action")
    with pytest.raises(DataError, match=r"snapped_action reward cannot score it: the snapped_action reward needs "
                                        r"extra\['admissible_commands'\].*'free'"):
        validate_examples([alf, free], reward="snapped_action")
    with pytest.raises(DataError, match=r"duplicate id; 1 example: 'g0-q0'"):
        validate_examples([data_a[0], data_a[0]])


def test_lists_at_most_five_ids_and_a_count(data_a):
    many = [dataclasses.replace(data_a[0], id=f"x{i}", answer_index=9) for i in range(8)]
    with pytest.raises(DataError, match=r"; 8 examples: 'x0', 'x1', 'x2', 'x3', 'x4' and 3 more$"):
        validate_examples(many)


def test_memory_off_skips_bank_checks_and_empty_history_is_reported(data_a, bank_a):
    elsewhere = dataclasses.replace(data_a[0], id="elsewhere", group="not-in-bank")
    validate_examples([elsewhere], bank_a, top_z=0)  # nothing is retrieved: the bank is not read
    with pytest.raises(DataError, match="group not in bank"):
        validate_examples([elsewhere], bank_a, top_z=4)
    empty = _with_history(data_a[0], [[]])
    with pytest.raises(DataError, match=r"empty history.*'g0-q0'"):
        validate_examples([empty], bank_a)


def test_chunking_other_than_the_banks_is_refused(data_a, bank_a):
    with pytest.raises(DataError, match=r"tokenized with \{'max_tokens': 48\} but chunking is \{'max_tokens': 64\}"):
        validate_examples(data_a, bank_a, chunking=ChunkingConfig(max_tokens=64))


def test_bank_without_fingerprints_opens_and_warns_once(tmp_path, data_a, bank_a):
    """A bank written before manifests recorded groups_sha256: opens, data unverifiable (one warning)."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(bank_a.root, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["groups_sha256"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    bank = Bank.open(old, verify=True)
    assert bank.groups_sha256 is None
    changed = [_with_history(data_a[0], [[Turn("user", "something else")]])]
    with pytest.warns(UserWarning, match="records no fingerprint of its data.*cannot verify"):
        validate_examples(changed, bank)  # not refused: it cannot be known
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_examples(changed, Bank.open(old))  # once per bank
