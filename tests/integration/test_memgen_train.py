"""MemGen trained by the GRPO loop on the tiny task learns at every seed tried, and its checkpoint
evaluates in the harness next to the other systems.

    pytest tests/integration/test_memgen_train.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli_here
from test_train import _env, _metrics, tiny_setup  # noqa: F401  (fixture)

# 4 prompt latents (no decision points: the tiny task's answer is one token), a small trigger
MEMGEN = ["train.system=memgen", "memgen.prompt_latents=4", "memgen.inference_latents=2", "memgen.trigger_hidden=32",
          "train.max_steps=100", "train.save_every=0"]


@pytest.mark.timeout(1200)  # two trainings of 100 steps at once: ~45 s on 2 idle cores
def test_memgen_learns_and_its_checkpoint_evaluates_in_the_harness(tiny_setup, tmp_path, capsys):  # noqa: F811
    """The frozen random reasoner starts below chance (it rarely writes a letter at all); the weaver,
    reading the retrieved chunk, learns to make it answer: >= 0.6 greedy accuracy on the 120
    held-out histories at both seeds (chance 0.25; seeds 0-2 reach 0.73, 0.98, 0.77 at 100
    steps). The saved model then answers through evaluate.py with the accuracy the trainer
    measured, compared and paired with a baseline on the same questions, and the two seeds are
    aggregated (seeds.md)."""
    args = ["train.py", "--config", "configs/tiny.yaml", f"data.dir={tiny_setup}/data", f"bank.dir={tiny_setup}/bank"]
    procs = {}
    for seed in (0, 1):
        log = open(tmp_path / f"s{seed}.log", "w")
        procs[seed] = subprocess.Popen([sys.executable, *args, f"train.output_dir={tmp_path / f's{seed}'}",
                                        f"seed={seed}", *MEMGEN], cwd=ROOT, env=_env(), stdout=log,
                                       stderr=subprocess.STDOUT)
        log.close()
    for seed, p in procs.items():
        assert p.wait(timeout=1100) == 0, (tmp_path / f"s{seed}.log").read_text()[-4000:]
    for seed in (0, 1):
        run = tmp_path / f"s{seed}"
        rewards = [r["reward/mean"] for r in _metrics(run) if "reward/mean" in r]
        assert sum(rewards[:10]) / 10 < 0.1 and sum(rewards[-10:]) / 10 > 0.3, rewards
        ev = json.loads((run / "eval_val.json").read_text())
        assert ev["num_examples"] == 120 and ev["accuracy"] >= 0.6, ev
        assert ev["avg_memory_tokens"] == 4
    # the harness: both seeds' checkpoints (and the reasoner alone) on the same val questions
    final = tmp_path / "s0" / "final"
    variants = ("{" + ", ".join(f"memgen@{s}: [eval.system=memgen, eval.checkpoint={tmp_path / f's{s}' / 'final'}]"
                                for s in (0, 1)) + ", no_memory: [eval.system=no_memory]}")
    out = tmp_path / "ev"
    code, stdout, err = run_cli_here("evaluate.py", ["--config", str(ROOT / "configs/tiny.yaml"),
                                                     f"data.dir={tiny_setup}/data", f"bank.dir={tiny_setup}/bank",
                                                     f"eval.output_dir={out}", "eval.split=val",
                                                     f"eval.variants={variants}"], capsys)
    assert code == 0, err[-4000:]
    accs = []
    for seed in (0, 1):
        res = json.loads((out / f"memgen@{seed}" / "results.json").read_text())
        trained = json.loads((tmp_path / f"s{seed}" / "eval_val.json").read_text())
        assert res["num_examples"] == 120 and res["accuracy"] == pytest.approx(trained["accuracy"])
        assert res["avg_memory_tokens"] == 4
        accs.append(res["accuracy"])
    first = json.loads((out / "memgen@0" / "predictions.jsonl").read_text().splitlines()[0])
    assert first["retrieved"] and first["retrieved"][0]["budget"] is None  # the chunk the weaver read
    summary = json.loads((out / "comparison.json").read_text())
    assert summary["reference"] == "memgen@0" and summary["paired"]["no_memory"]["n"] == 120
    # the seeds aggregated: mean over the two trainings with a t interval around it
    seeds = json.loads((out / "seeds.json").read_text())
    mg = seeds["systems"]["memgen"]
    assert mg["seeds"] == 2 and mg["per_seed"] == accs and mg["mean"] == pytest.approx(sum(accs) / 2)
    assert mg["ci"][0] <= mg["mean"] <= mg["ci"][1] and "memgen" in (out / "seeds.md").read_text()
    # a MemGen checkpoint is not an ElasticMem one
    code, _, err = run_cli_here("evaluate.py", ["--config", str(ROOT / "configs/tiny.yaml"),
                                                f"data.dir={tiny_setup}/data", f"bank.dir={tiny_setup}/bank",
                                                f"eval.output_dir={tmp_path / 'wrong'}", f"eval.checkpoint={final}",
                                                "eval.limit=2"], capsys)
    assert code != 0 and "eval.system=memgen" in err
    # ElasticMem's own training options are refused for MemGen, before anything runs
    p = subprocess.run([sys.executable, *args, f"train.output_dir={tmp_path / 'kl'}", *MEMGEN,
                        "train.loss.kl_beta=0.1"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "kl_beta" in p.stderr and not (tmp_path / "kl" / "checkpoints").exists()
