"""Streaming evaluation (eval.stream) on the synthetic persona task and a real LoCoMo conversation,
tiny random model, CPU.

    OMP_NUM_THREADS=1 python -m pytest -q tests/integration/test_streaming.py

'all' (every session added through the live append path, then the questions) must give the
offline bank's answers, memories, scores and budgets; 'session' (each question right after the
session its evidence ends in) must only ever retrieve what had been said by then.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli_here

from elasticmem.bank import Bank, build_bank
from elasticmem.config import Config
from elasticmem.data.chunking import chunk_history
from elasticmem.data.schema import load_split, write_examples
from elasticmem.eval.runner import evaluate
from elasticmem.eval.streaming import due_session, stream_bank_dir, stream_order
from elasticmem.systems import build_system
from elasticmem.utils.configuration import load

LOCOMO = ROOT.parent / "shared" / "data" / "locomo10.json"
OVERRIDES = ["backbone.name_or_path=tiny", "backbone.device=cpu", "memory.retrieval=frozen", "memory.top_z=3",
             "memory.max_new_tokens=2", "memory.policy.max_budget=4", "bank.n_cache=8", "chunking.max_tokens=48",
             "eval.plots=false", "eval.case_studies=0", "eval.batch_size=7"]


def _cfg(root: Path, *extra: str) -> Config:
    return load(Config, None, [*OVERRIDES, f"data.dir={root}/data", f"bank.dir={root}/bank", *extra])


def _records(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def _run(root: Path, examples, name: str, stream: str):
    cfg = _cfg(root, f"eval.stream={stream}")
    out = root / name
    torch.manual_seed(cfg.seed)  # the untrained policy and projector start the same in every run (as evaluate.py)
    system = build_system(cfg, stream_dir=stream_bank_dir(out, 0))
    exs = stream_order(examples, stream) if stream != "off" else examples
    res = evaluate(system, exs, out, progress=False, plots=False, case_studies=0, batch_size=7)
    return res, _records(out / "predictions.jsonl")


def _check(root: Path, examples):
    from elasticmem.backbone import load_backbone

    cfg = _cfg(root)
    build_bank({"test": examples}, load_backbone(cfg.backbone), cfg.chunking, cfg.bank, torch.float32, show_progress=False)
    off, p_off = _run(root, examples, "offline", "off")
    all_, p_all = _run(root, examples, "all", "all")
    assert set(p_all) == set(p_off) == {ex.id for ex in examples}
    for i, a in p_all.items():
        b = p_off[i]
        assert a["prediction"] == b["prediction"], i
        ra, rb = a["retrieved"], b["retrieved"]
        assert [m["text"] for m in ra] == [m["text"] for m in rb], i
        assert [m["budget"] for m in ra] == [m["budget"] for m in rb], i
        assert all(abs(x["score"] - y["score"]) < 1e-5 for x, y in zip(ra, rb)), i
    assert all_["accuracy"] == off["accuracy"] and all_["num_examples"] == off["num_examples"]
    assert all_["avg_tokens"] == off["avg_tokens"]

    _, p_ses = _run(root, examples, "session", "session")
    early = 0
    for ex in examples:
        due = due_session(ex, "session")
        said = {c.text for c in chunk_history(ex.history[: due + 1], ex.group)}
        got = [m["text"] for m in p_ses[ex.id]["retrieved"]]
        assert set(got) <= said, ex.id  # nothing from a later session
        early += due < len(ex.history) - 1
    assert early >= 3, "test data: questions whose evidence ends before the last session"
    differs = sum(p_ses[i]["retrieved"] != p_off[i]["retrieved"] for i in p_off)
    assert differs >= 1
    return p_ses


def test_streaming_on_synthetic_persona(tmp_path):
    from elasticmem.data.synthetic import SyntheticConfig, generate

    cfg = SyntheticConfig(variant="persona", num_histories=4, num_facts=4, num_filler=2, num_options=4)
    examples = [ex for split in generate(cfg, seed=0).values() for ex in split]
    for g in {ex.group for ex in examples}:
        texts = [c.text for c in chunk_history(next(e.history for e in examples if e.group == g), g)]
        assert len(texts) == len(set(texts)), "test data must not repeat a chunk inside a group"
    _check(tmp_path, examples)


@pytest.mark.skipif(not LOCOMO.is_file(), reason=f"real LoCoMo file not found at {LOCOMO} (../shared/data)")
def test_streaming_on_a_locomo_conversation(tmp_path):
    from elasticmem.data.locomo import qa_example, read_locomo
    from elasticmem.data.sources import SkipLog

    conv = read_locomo(LOCOMO, SkipLog())[0]
    examples = [qa_example(conv, q) for q in conv.qa][::4][:40]  # spread over the conversation's sessions
    assert len({due_session(ex, "session") for ex in examples}) >= 5
    _check(tmp_path, examples)


def _evaluate_here(capsys, args: list[str]) -> tuple[int, str]:
    """evaluate.py's main() in this process (no start-up cost): exit code and stderr."""
    code, _, err = run_cli_here("evaluate.py", args, capsys)
    return code, err


def test_evaluate_cli_streams_and_resumes(tmp_path, capsys):
    from elasticmem.data.synthetic import SyntheticConfig, generate

    cfg = SyntheticConfig(variant="persona", num_histories=3, num_facts=3, num_filler=1, num_options=4)
    write_examples(tmp_path / "data" / "test.jsonl", [ex for s in generate(cfg, seed=1).values() for ex in s])
    args = [*OVERRIDES, f"data.dir={tmp_path}/data", f"bank.dir={tmp_path}/none",
            f"eval.output_dir={tmp_path}/out", "eval.stream=session", "eval.system=text_rag"]
    code, err = _evaluate_here(capsys, args)
    assert code == 0, err[-3000:]
    n = len(load_split(tmp_path / "data", "test"))
    assert json.loads((tmp_path / "out" / "results.json").read_text())["num_examples"] == n
    ident = json.loads((tmp_path / "out" / "run_identity.json").read_text())
    assert "session" in json.dumps(ident)
    bank = Bank.open(tmp_path / "out" / "stream_bank-0").manifest  # manifest.json and its journal
    assert bank["build"]["appends"] >= 2 and bank["num_chunks"] > 0
    code, err = _evaluate_here(capsys, args)
    assert code == 0 and f"{n} of {n} examples already answered" in err, err[-3000:]
    code, err = _evaluate_here(capsys, args[:-1] + ["eval.system=amem"])
    assert code == 2 and "eval.stream" in err
