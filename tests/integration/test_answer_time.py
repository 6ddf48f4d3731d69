"""benchmarks/answer_time.py at its smallest, checked against what is counted here independently.

    OMP_NUM_THREADS=1 python -m pytest -q tests/integration/test_answer_time.py     # ~30 s on 2 loaded cores

One run of the benchmark (its ``main``, in this process) on the tiny model and data: chunks of at
most 4 and 8 tokens, Z 2 and 4, batches 1 and 4, one repeat, 3 new tokens, every system, the
learned budgets of a checkpoint whose policy was perturbed so that its budgets differ per memory.
Its report must say, for every cell and system, what this test computes from the bank's
``chunks.jsonl`` and the tokenizer:

- prefill: reading KV, the forward over the prompt, separators and suffix only, with the memories'
  slots (min(B_max, n_tokens - 1) each: a chunk's first position is not stored) already in the
  cache; text RAG, the same positions plus every retrieved chunk's tokens; the hidden path, plus
  min(B_max, n_tokens) soft tokens each; no memory, the prompt and suffix;
- every KV memory loaded equals ``Bank.gather_kv``'s last slots of its row;
- the same rows for every system that retrieves (same query state and search), in the question's
  group; as many decoder forwards and answer tokens as ``--new-tokens``;
- the timed path answered as ``ElasticMem.greedy`` did; the cold loads found the bank's pages gone
  (``mincore``: less than 10 % resident);
- ``--write-readme`` puts the tables its results files render into a copy of the README.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

CHUNKS, ZS, BATCHES, NEW = (4, 8), (2, 4), (1, 4), 3


def load_bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("answer_time", ROOT / "benchmarks" / "answer_time.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def perturbed_checkpoint(root: Path) -> Path:
    """An untrained tiny ElasticMem reading KV (B_max 4) whose policy's argmax gives uneven budgets."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import build_bank
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic
    from elasticmem.systems import build_system

    ov = [f"data.dir={root}/data", f"bank.dir={root}/bank", "bank.kv_cache=true", "memory.content=kv",
          "memory.top_z=4"]
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), ov)
    write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    build_bank({"test": load_split(cfg.data.dir, "test")[:4]}, load_backbone(cfg.backbone), cfg.chunking, cfg.bank,
               torch.float32, show_progress=False, memory=cfg.memory)
    model = build_system(cfg, ov).model
    torch.manual_seed(1)  # by rank: budgets 2, 4, 0, 2 on these questions (0: the memory is left out)
    with torch.no_grad():
        w = model.policy.rank_embedding.weight
        w.add_(torch.randn_like(w) * 3.0)
    model.save_pretrained(root / "ckpt")
    return root / "ckpt"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("answer_time")
    ckpt = perturbed_checkpoint(tmp / "ckpt_src")
    readme = tmp / "README.md"
    readme.write_text("# Benchmarks\n\n## answer_time.py\n\n" + load_bench().PLACEHOLDER + "\n\nafter\n")
    threads = torch.get_num_threads()
    argv = ["--config", str(ROOT / "configs/tiny.yaml"), "--data", "synthetic", "--work", str(tmp / "work"),
            "--chunk-tokens", *map(str, CHUNKS), "--zs", *map(str, ZS), "--batches", *map(str, BATCHES),
            "--repeats", "1", "--new-tokens", str(NEW), "--checkpoint", str(ckpt), "--check-batch", "4",
            "--record-loads", "--out", str(tmp / "out.json"), "--write-readme", "--readme", str(readme),
            "--results-dir", str(tmp / "results")]
    try:
        assert load_bench().main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return tmp, json.loads((tmp / "out.json").read_text())


def test_every_cell_has_every_system_and_its_parts(run):
    _, rep = run
    mem = {"kv_max", "kv_learned", "text", "hidden"}
    keys = {f"c{c}_z{z}_b{b}" for c in CHUNKS for z in ZS for b in BATCHES} | {f"c{c}_z0_b{b}" for c in CHUNKS
                                                                              for b in BATCHES}
    assert set(rep["cells"]) == keys
    for key, cell in rep["cells"].items():
        assert set(cell["systems"]) == ({"none"} if cell["z"] == 0 else mem), key
        for n, s in cell["systems"].items():
            q = s["per_question_s"]
            assert all(q[p] >= 0 for p in ("query_state", "search", "load_warm", "load_cold", "prefill", "decode"))
            assert q["total_warm"] == pytest.approx(q["retrieval"] + q["load_warm"] + q["assemble"] + q["prefill"]
                                                    + q["decode"]) and q["total_warm"] > 0
            # a few pages may escape the eviction (SmolLM2's banks kept up to 3 %); a cold load must not be warm
            assert len(s["runs"]) == 1 and s["resident_after_drop"] < 0.1, (key, n)
        if cell["z"]:
            assert cell["kv_max_over_text"] == pytest.approx(
                cell["systems"]["kv_max"]["per_question_s"]["total_warm"]
                / cell["systems"]["text"]["per_question_s"]["total_warm"])
    assert rep["cold"]["possible"] and rep["threads"] == 1
    assert rep["matches_greedy"] and all(rep["matches_greedy"].values()), rep["matches_greedy"]


def test_prefill_reads_kv_memories_as_cache_and_text_as_positions(run):
    from elasticmem.backbone import load_backbone
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.model.prompt import encode_prompt

    tmp, rep = run
    cfg = load_config(str(ROOT / "configs/tiny.yaml"))
    tok = load_backbone(cfg.backbone).tokenizer
    questions = {ex.id: ex for ex in load_split(tmp / "work" / "data", "test")}
    exs = [questions[i] for i in rep["questions"]]
    sep = len(tok(cfg.memory.separator, add_special_tokens=False)["input_ids"])
    base = [sum(map(len, encode_prompt(tok, cfg.memory, ex))) for ex in exs]
    learned: set[int] = set()
    for key, cell in rep["cells"].items():
        C, b, recs = cell["chunk_tokens"], cell["batch"], cell["records"]
        chunks = [json.loads(line) for line in open(Path(cell["bank"]) / "chunks.jsonl")]
        n_tok = {c["row"]: c["n_tokens"] for c in chunks}
        text_len = {c["row"]: len(tok(c["text"], add_special_tokens=False)["input_ids"]) for c in chunks}
        assert max(n_tok.values()) <= C and all(text_len[r] <= n_tok[r] for r in n_tok), key  # cut to fit C
        if cell["z"]:
            rows = recs["kv_max"]["rows"]
            assert all(recs[n]["rows"] == rows for n in ("text", "hidden", "kv_learned")), key
            for i, ex in enumerate(exs[:b]):
                assert len(set(rows[i])) == cell["z"] and all(chunks[r]["group"] == ex.group for r in rows[i])
        for n, rec in recs.items():
            assert len(rec["forwards"]) == NEW and torch.tensor(rec["answer_ids"]).shape == (b, NEW), (key, n)
            for i in range(b):
                rows = [r for r in rec["rows"][i] if r >= 0]
                if n == "kv_learned":  # the checkpoint's B_max is 4
                    want = [min(bj, n_tok[r] - 1, C) for r, bj in zip(rows, rec["budgets"][i])]
                elif n == "kv_max":  # B_max = the largest chunk size; the bank holds C slots at most
                    want = [min(max(CHUNKS), C, n_tok[r] - 1) for r in rows]
                elif n == "text":
                    want = [text_len[r] for r in rows]
                else:  # hidden: the cache holds min(n_tokens, n_cache = C) states
                    want = [min(max(CHUNKS), C, n_tok[r]) for r in rows]
                assert rec["counts"][i][: len(rows)] == want, (key, n, i)
                n_mem = sum(w > 0 for w in want)
                in_positions = 0 if n.startswith("kv") else sum(want)
                control = int(rec["control"][i] >= 0)  # a retrieval-control token, in modes that draw one
                assert rec["positions"][i] == base[i] + control + n_mem * sep + in_positions, (key, n, i)
                if n.startswith("kv"):
                    assert rec["past_per_row"][i] == sum(want), (key, n, i)
                else:
                    assert rec["past_per_row"] is None
            first = rec["forwards"][0]
            assert first["shape"] == [b, max(rec["positions"])], (key, n)
            assert first["past"] == (max(rec["past_per_row"]) if n.startswith("kv") else 0), (key, n)
        if cell["z"]:
            learned |= {bj for row in recs["kv_learned"]["budgets"] for bj in row}
    assert len(learned) > 1, f"the perturbed policy's budgets should differ: {learned}"


def test_loaded_kv_is_the_banks_own(run):
    from elasticmem.bank import Bank

    _, rep = run
    seen = 0
    for key, cell in rep["cells"].items():
        if not cell["z"]:
            continue
        bank = Bank.open(cell["bank"])
        for n in ("kv_max", "kv_learned"):
            for i, mems in enumerate(cell["records"][n]["loaded"]):
                for row, c, digest in mems:
                    want = bank.gather_kv([row])[0, bank.n_cache - c:]
                    assert hashlib.sha256(want.contiguous().numpy().tobytes()).hexdigest()[:16] == digest, (key, n, row)
                    seen += 1
    assert seen > 50


def test_write_readme_puts_the_rendered_tables_in_place(run):
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_results_tables as gen

    tmp, rep = run
    text = (tmp / "README.md").read_text()
    bench = load_bench()
    assert bench.PLACEHOLDER not in text and text.endswith("after\n")
    for name in bench.RESULTS:
        spec = json.loads((tmp / "results" / f"{Path(name).name}.json").read_text())
        assert spec["command"].startswith("python benchmarks/answer_time.py") and spec["commit"] == rep["commit"]
        body = gen.MARKED.search(text[text.index(f"<!-- results:{name} -->"):]).group("body")
        assert body == gen.render(spec)
    assert "| 4 (4) | 2 | 1 |" in text and "ElasticMem KV, learned budgets / text RAG" in text
    shutil.copy(tmp / "README.md", tmp / "again.md")  # markers present: a second write replaces, not appends
    assert bench.main(["--from-json", str(tmp / "out.json"), "--write-readme", "--readme", str(tmp / "again.md"),
                       "--results-dir", str(tmp / "results")]) == 0
    assert (tmp / "again.md").read_text() == text
