"""Resuming an evaluation never mixes systems, settings or data (the runner, with scripted systems).

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_eval_resume.py
"""

from __future__ import annotations

import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import make_examples

from elasticmem.eval.runner import OutputDirError, evaluate
from elasticmem.eval.system import Prediction

EXAMPLES = make_examples(n_groups=4, questions_per_group=3)  # 12 examples


class Scripted:
    """Answers every example with ``answer``; ``memory`` tokens stand for what it injects."""

    def __init__(self, name: str = "no_memory", answer: str = "a", memory: int = 0, top_z: int = 0):
        self.name, self.answer, self.memory, self.top_z = name, answer, memory, top_z
        self.answered: list[str] = []

    def predict(self, batch):
        self.answered += [ex.id for ex in batch]
        return [Prediction(id=ex.id, text=self.answer, prompt_tokens=5, memory_tokens=self.memory,
                           generated_tokens=1) for ex in batch]

    def identity(self):
        return {"system": self.name, "memory": {"top_z": self.top_z, "injection": "text"}}


def _run(system, out: Path, examples=EXAMPLES, **kw):
    kw = {"batch_size": 4, "progress": False, "plots": False, "case_studies": 0, **kw}
    return evaluate(system, examples, out, **kw)


def _predictions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]


def test_a_rerun_with_a_larger_limit_and_another_batch_size_resumes(tmp_path):
    _run(Scripted(), tmp_path, EXAMPLES[:5], batch_size=2)
    again = Scripted()
    res = _run(again, tmp_path, EXAMPLES[:9], batch_size=3)
    assert again.answered == [ex.id for ex in EXAMPLES[5:9]], "only the examples past the old limit"
    assert res["num_examples"] == 9 and [r["id"] for r in _predictions(tmp_path)] == [ex.id for ex in EXAMPLES[:9]]
    smaller = Scripted()
    assert _run(smaller, tmp_path, EXAMPLES[:3])["num_examples"] == 3 and smaller.answered == []


def test_another_system_is_refused_naming_both_until_overwrite(tmp_path):
    _run(Scripted("no_memory"), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    rag = Scripted("text_rag", memory=40, top_z=8)
    with pytest.raises(OutputDirError, match="no_memory") as err:
        _run(rag, tmp_path)
    assert "text_rag" in str(err.value) and "eval.overwrite=true" in str(err.value)
    assert rag.answered == [] and {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    res = _run(rag, tmp_path, overwrite=True)
    assert res["system"] == "text_rag" and res["avg_memory_tokens"] == 40
    assert len(rag.answered) == len(EXAMPLES)
    assert all(r["tokens"]["memory"] == 40 for r in _predictions(tmp_path))


def test_a_changed_setting_of_the_same_system_is_refused_naming_it(tmp_path):
    _run(Scripted("text_rag", top_z=8), tmp_path, EXAMPLES[:4])
    with pytest.raises(OutputDirError, match=r"memory\.top_z: 8 there, 4 now"):
        _run(Scripted("text_rag", top_z=4), tmp_path, EXAMPLES[:4])


def test_changed_example_data_is_refused(tmp_path):
    _run(Scripted(), tmp_path, EXAMPLES[:6])
    edited = list(EXAMPLES)
    edited[8] = dataclasses.replace(edited[8], question="something else?")  # not answered yet: harmless
    assert _run(Scripted(), tmp_path, edited[:9])["num_examples"] == 9
    edited[2] = dataclasses.replace(edited[2], answer_index=3)
    with pytest.raises(OutputDirError, match=EXAMPLES[2].id):
        _run(Scripted(), tmp_path, edited[:9])


def test_a_folder_without_a_record_of_its_run_is_refused(tmp_path):
    """Predictions written before run identities existed (or by hand) are of unknown origin."""
    _run(Scripted(), tmp_path)
    (tmp_path / "run_identity.json").unlink()
    with pytest.raises(OutputDirError, match="eval.overwrite=true"):
        _run(Scripted(), tmp_path)
    assert _run(Scripted(), tmp_path, overwrite=True)["num_examples"] == len(EXAMPLES)


class _Process:
    """The part of ``accelerate.PartialState`` the runner uses, for one of two threads."""

    def __init__(self, rank: int, barrier: threading.Barrier):
        self.process_index, self.num_processes, self.is_main_process = rank, 2, rank == 0
        self._barrier = barrier

    def wait_for_everyone(self):
        self._barrier.wait(timeout=30)


def test_every_process_refuses_alike_and_none_waits(tmp_path):
    _run(Scripted("no_memory"), tmp_path)
    barrier = threading.Barrier(2)

    def one(rank):
        try:
            _run(Scripted("text_rag", top_z=8), tmp_path, state=_Process(rank, barrier))
        except OutputDirError as e:
            return str(e)
        return None

    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(one, (0, 1)))
    assert errors[0] is not None and errors[0] == errors[1]
    assert not barrier.broken

    barrier = threading.Barrier(2)
    with ThreadPoolExecutor(2) as pool:  # and with overwrite, both answer their share
        results = list(pool.map(lambda r: _run(Scripted("text_rag", top_z=8), tmp_path, overwrite=True,
                                               state=_Process(r, barrier)), (0, 1)))
    assert results[0]["system"] == "text_rag" and results[0]["num_examples"] == len(EXAMPLES) and results[1] is None


def test_amem_resumes_across_storage_and_speed_settings_but_not_across_answer_settings(tmp_path):
    from test_amem import ScriptedBackend

    from elasticmem.baselines.amem import AMemSystem
    from elasticmem.baselines.amem.config import AMemConfig, AMemLLMConfig
    from elasticmem.baselines.amem.embed import HashingEmbedder
    from elasticmem.llm.client import StructuredLLM

    def amem(**kw):
        backend = ScriptedBackend()
        return AMemSystem(AMemConfig(embedder="hashing", **kw), llm=StructuredLLM(backend),
                          embedder=HashingEmbedder(256)), backend

    examples = EXAMPLES[:4]  # multiple choice: scored without the free-form metrics' models
    _run(amem(retrieve_k=2)[0], tmp_path, examples)
    system, backend = amem(retrieve_k=2, store_dir=str(tmp_path / "notes"), llm=AMemLLMConfig(batch_size=2))
    assert _run(system, tmp_path, examples)["num_examples"] == 4 and backend.calls == []  # resumed
    with pytest.raises(OutputDirError, match=r"amem\.retrieve_k: 2 there, 3 now"):
        _run(amem(retrieve_k=3)[0], tmp_path, examples)
    with pytest.raises(OutputDirError, match="'amem-wo_me'"):
        _run(amem(retrieve_k=2, ablation="wo_me")[0], tmp_path, examples)


def test_processes_share_whole_groups_and_answer_each_example_once(tmp_path):
    """For a system with a memory per group, each process answers whole groups (the memory is
    built in one process only), all examples once, resumed with another number of processes."""
    from elasticmem.eval.runner import process_share

    ragged = EXAMPLES + [dataclasses.replace(ex, id=f"s{ex.id}", group=f"s{ex.group}")  # groups of 3 and of 1
                         for ex in make_examples(n_groups=2, questions_per_group=1, seed=1)]
    assert process_share(ragged, 0, 1) == ragged
    shares = [process_share(ragged, r, 3) for r in range(3)]
    assert sorted(ex.id for s in shares for ex in s) == sorted(ex.id for ex in ragged)
    groups = [{ex.group for ex in s} for s in shares]
    assert all(not (groups[i] & groups[j]) for i in range(3) for j in range(i + 1, 3))
    assert max(map(len, shares)) - min(map(len, shares)) <= 3  # at most one group apart

    _run(Scripted(), tmp_path, ragged[:5])  # one process answered a few, then two go on
    barrier = threading.Barrier(2)
    systems = [Scripted(), Scripted()]
    for s in systems:
        s.memory_per_group = True  # as A-Mem, Mem0 and LangMem (others are shared out round-robin)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda r: _run(systems[r], tmp_path, ragged, state=_Process(r, barrier)), (0, 1)))
    answered = [set(s.answered) for s in systems]
    assert not (answered[0] & answered[1]) and answered[0] | answered[1] == {ex.id for ex in ragged[5:]}
    by_group = [{ex.group for ex in ragged if ex.id in a} for a in answered]
    assert not (by_group[0] & by_group[1]) and all(by_group)
    assert results[0]["num_examples"] == len(ragged)
