"""build_bank.py end to end: CLI, resume, 2-process accelerate build, SmolLM2 keys vs transformers.

    pytest tests/integration/test_build_bank_cli.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, launch_2, make_examples, requires_smollm2, run_cli_here

from elasticmem.bank import Bank


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def _run(args, env=None, check=True):
    p = subprocess.run(args, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}")
    return p


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    _run([sys.executable, "-m", "elasticmem.data.prepare", "synthetic", "--config", "configs/tiny.yaml",
          f"data.dir={d}", "data.synthetic.num_histories=12"])
    assert {p.name for p in d.iterdir()} >= {"train.jsonl", "val.jsonl", "test.jsonl", "stats.json"}
    return d


def test_cli_builds_prints_and_saves_config(tmp_path, tiny_data, capsys):
    out = tmp_path / "bank"
    stdout, stderr = _build_bank_here(capsys, ["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tiny_data}",
                                               f"bank.dir={out}", "bank.shard_rows=16", "bank.verify=true"])
    assert "resolved config:" in stderr
    bank = Bank.open(out, verify=True)
    assert f"chunks {bank.num_chunks}" in stdout and "(built, verified)" in stdout
    assert (out / "config.yaml").is_file()
    n_groups = sum(len({json.loads(line)["group"] for line in (tiny_data / f"{s}.jsonl").open()})
                   for s in ("train", "val", "test"))
    assert len(bank.groups) == n_groups
    again, _ = _build_bank_here(capsys, ["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tiny_data}",
                                         f"bank.dir={out}", "bank.shard_rows=16"])
    assert "already built" in again


def _build_bank_here(capsys, args: list[str], code: int = 0) -> tuple[str, str]:
    """build_bank.py's main() in this process (no start-up cost): its stdout and stderr."""
    got, out, err = run_cli_here("build_bank.py", args, capsys)
    assert got == code, f"exit {got}\n{err[-3000:]}"
    return out, err


def test_cli_errors_are_clear(tmp_path, tiny_data, capsys):
    config = ["--config", str(ROOT / "configs/tiny.yaml")]
    _, err = _build_bank_here(capsys, [*config, "bank.shard_row=3"], code=2)
    assert "did you mean 'bank.shard_rows'" in err
    _, err = _build_bank_here(capsys, [*config, f"data.dir={tmp_path}/none"], code=2)
    assert "prepare the data first" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.jsonl").write_text('{"id": "a", "question": "q", "choices": ["x", "y"], "answer_index": 0, '
                                     '"history": []}\n')
    _, err = _build_bank_here(capsys, [*config, f"data.dir={bad}", "bank.splits=[train]", f"bank.dir={tmp_path}/b"],
                              code=2)
    assert f"{bad}/train.jsonl:1" in err and "'history' is empty" in err
    _, err = _build_bank_here(capsys, [*config, f"data.dir={tiny_data}", "backbone.name_or_path=/no/such/model"], code=2)
    assert "model path not found: /no/such/model" in err


def test_two_process_build_equals_one_process(tmp_path, tiny_data, capsys):
    common = ["build_bank.py", "--config", "configs/tiny.yaml", f"data.dir={tiny_data}", "bank.shard_rows=8"]
    _build_bank_here(capsys, ["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tiny_data}", "bank.shard_rows=8",
                              f"bank.dir={tmp_path}/one"])  # in this process: no start-up cost
    # Real DDP over gloo on CPU needs ACCELERATE_USE_CPU with --multi_gpu (see DESIGN.md section 4).
    env = dict(_env(), ACCELERATE_USE_CPU="1")
    _run([*launch_2(), *common, f"bank.dir={tmp_path}/two"], env=env)
    one, two = Bank.open(tmp_path / "one", verify=True), Bank.open(tmp_path / "two", verify=True)
    build = two.manifest["build"]
    assert build["num_processes"] == 2
    assert set(build["shard_writers"]) == {0, 1}, "both processes must have encoded shards"
    assert one.manifest["groups"] == two.manifest["groups"]
    assert one.groups_sha256 == two.groups_sha256 and set(one.groups_sha256) == set(one.groups)
    assert [c["text"] for c in one.chunks()] == [c["text"] for c in two.chunks()]
    assert torch.allclose(one.keys(), two.keys(), atol=1e-5)
    c1, l1 = one.gather(torch.arange(one.num_chunks))
    c2, l2 = two.gather(torch.arange(two.num_chunks))
    assert torch.equal(l1, l2) and torch.allclose(c1, c2, atol=1e-5)


@requires_smollm2
def test_smollm2_keys_and_caches_equal_transformers(tmp_path, smollm2_backbone):
    """Real model: bank rows equal hidden_states[-1] recomputed chunk by chunk with plain transformers."""
    from elasticmem.bank import build_bank
    from elasticmem.config import BankConfig, ChunkingConfig, load_config
    from elasticmem.data.synthetic import generate

    cfg = load_config(ROOT / "configs/quickstart.yaml", ["data.synthetic.num_histories=10"])
    persona = generate(cfg.data.synthetic, seed=0)["test"][:1]
    examples = persona + make_examples(1)  # persona chunks (~20-50 tokens) and very short ones
    chunking = ChunkingConfig(max_tokens=40)  # some chunks are truncated
    bank_cfg = BankConfig(dir=str(tmp_path / "bank"), n_cache=20, batch_size=6, shard_rows=16)
    build_bank({"test": examples}, smollm2_backbone, chunking, bank_cfg, torch.float32, show_progress=False)
    bank = Bank.open(bank_cfg.dir, expect_fingerprint=smollm2_backbone.fingerprint)
    lengths = [c["n_tokens"] for c in bank.chunks()]
    assert min(lengths) < 20 < max(lengths) and max(lengths) == 40
    cache, cache_len = bank.gather(torch.arange(bank.num_chunks))
    tok, model = smollm2_backbone.tokenizer, smollm2_backbone.model
    for row, rec in enumerate(bank.chunks()):
        ids = tok(rec["text"], truncation=True, max_length=40, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            H = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        L, c = H.shape[0], min(H.shape[0], 20)
        assert (bank.keys(row, row + 1)[0] - H[-1] / H[-1].norm()).abs().max() < 1e-4
        assert cache_len[row] == c
        assert (cache[row, 20 - c :] - H[L - c :]).abs().max() < 1e-4
        assert (cache[row, : 20 - c] == 0).all()


def assert_same_bank_files(one, two) -> None:
    """Every file of two bank folders byte for byte, except what says how they were built:
    config.yaml (it names its folder) and the manifest's ``build`` record (processes, which one
    wrote each shard)."""
    names = sorted(p.name for p in one.iterdir() if p.name != "config.yaml")
    assert names == sorted(p.name for p in two.iterdir() if p.name != "config.yaml") and ".build" not in names
    assert "manifest.json" in names and "chunks.jsonl" in names and any(n.startswith("shard-") for n in names)
    for name in names:
        if name == "manifest.json":
            continue
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    for m in (m1, m2):
        for k in ("num_processes", "shard_writers"):
            m["build"].pop(k)
    assert m1 == m2


def test_parts_built_at_once_then_merged_equal_a_one_process_build(tmp_path, tiny_data, capsys):
    """bank.part=K/N (job-array tasks, here 3 processes started together) then a plain run (the
    merge) gives the bank a single process builds, byte for byte."""
    common = ["build_bank.py", "--config", "configs/tiny.yaml", f"data.dir={tiny_data}", "bank.shard_rows=8"]
    here = ["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tiny_data}", "bank.shard_rows=8"]
    _build_bank_here(capsys, [*here, f"bank.dir={tmp_path}/one"])  # in this process: no start-up cost
    parts = tmp_path / "parts"
    procs = [subprocess.Popen([sys.executable, *common, f"bank.dir={parts}", f"bank.part={k}/3"], cwd=ROOT,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(3)]
    for k, p in enumerate(procs):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0 and f"part {k}/3 done" in out, err[-3000:]
    assert not (parts / "manifest.json").exists()
    merged, _ = _build_bank_here(capsys, [*here, f"bank.dir={parts}"])
    assert "(resumed" in merged and "0 shard(s) encoded" in merged
    assert set(Bank.open(parts, verify=True).manifest["build"]["shard_writers"]) == {0, 1, 2}
    assert_same_bank_files(tmp_path / "one", parts)
    _, bad = _build_bank_here(capsys, [*here, f"bank.dir={tmp_path}/x", "bank.part=3/3"], code=2)
    assert "0 <= K < N" in bad


def test_cli_append_adds_new_sessions_and_groups_once(tmp_path, capsys):
    """--append on a bank built from the first sessions of some conversations adds their later
    sessions and the other conversations: per group it equals a build of the whole data, and a
    second --append adds nothing."""
    import dataclasses

    from elasticmem.data.schema import write_examples
    from elasticmem.data.synthetic import SyntheticConfig, generate

    full = [ex for s in generate(SyntheticConfig(variant="persona", num_histories=3, num_facts=3, num_filler=1,
                                                 num_options=4), seed=2).values() for ex in s]
    groups = sorted({ex.group for ex in full})
    early = [dataclasses.replace(ex, history=ex.history[:2]) for ex in full if ex.group != groups[-1]]
    write_examples(tmp_path / "early" / "test.jsonl", early)
    write_examples(tmp_path / "full" / "test.jsonl", full)
    base = ["--config", str(ROOT / "configs/tiny.yaml"), "bank.splits=[test]", "backbone.tiny.char_fallback=true"]
    _build_bank_here(capsys, [*base, f"data.dir={tmp_path}/early", f"bank.dir={tmp_path}/grown"])
    _build_bank_here(capsys, [*base, f"data.dir={tmp_path}/full", f"bank.dir={tmp_path}/union"])
    stdout, _ = _build_bank_here(capsys, [*base, f"data.dir={tmp_path}/full", f"bank.dir={tmp_path}/grown", "--append"])
    grown, union = Bank.open(tmp_path / "grown", verify=True), Bank.open(tmp_path / "union")
    assert grown.num_chunks == union.num_chunks and set(grown.groups) == set(union.groups) == set(groups)
    assert "(1 new)" in stdout and "chunk(s) added to 3 group(s)" in stdout
    for g in groups:
        a, b = grown.group_row_ids(g), union.group_row_ids(g)
        assert [grown.chunk(r)["text"] for r in a.tolist()] == [union.chunk(r)["text"] for r in b.tolist()]
        assert [grown.chunk(r)["session"] for r in a.tolist()] == [union.chunk(r)["session"] for r in b.tolist()]
        assert (grown.gather_keys(a) - union.gather_keys(b)).abs().max() <= 1e-6
        assert (grown.gather(a)[0] - union.gather(b)[0]).abs().max() <= 1e-6
    assert grown.groups_sha256 == union.groups_sha256
    again, _ = _build_bank_here(capsys, [*base, f"data.dir={tmp_path}/full", f"bank.dir={tmp_path}/grown", "--append"])
    assert "0 chunk(s) added" in again and Bank.open(tmp_path / "grown").num_chunks == union.num_chunks
