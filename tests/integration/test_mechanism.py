"""The full ElasticMem mechanism learns on the tiny model, at every seed, and uses its memory.

    pytest tests/integration/test_mechanism.py

``configs/tiny_mechanism.yaml``: a sampled retrieval-control token whose state retrieves 4 of
a history's 8 memories (the others compete), the Transformer budget policy giving each 0..4
latent tokens, the MLP projector, GRPO on all of it. Three runs (at once, one thread each),
each a training seed on a synthetic data set of its own seed (its own bank). For each: greedy
held-out accuracy goes from chance to >= 0.8, and the controls hold: without memory, and with
the memories of another history (same bank, wrong group), the same model still writes an
option letter for at least half the questions (a model that writes none cannot pass) and is
not above chance + 0.1; the evidence memory gets more budget than the others; retrieval
recall@4 of the evidence closes at least half of its distance to 1 and ends >= 0.95.

Which runs: the preset's step counts were tuned on training seeds 0-3 of data seed 0
(``TUNED``, the default); ``ELASTICMEM_MECHANISM_RUNS=untuned`` runs training seeds 4-6 on
data seeds 1-3 instead (``UNTUNED``, same wall time), ``all`` both (twice the time)::

    ELASTICMEM_MECHANISM_RUNS=untuned pytest tests/integration/test_mechanism.py -k every_seed
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT

PRESET = ROOT / "configs/tiny_mechanism.yaml"
SEEDS = (0, 1, 2)
"""Training seeds of the recipe test (data seed 0)."""
TUNED = ((0, 0), (1, 0), (2, 0))
"""(training seed, data seed) the preset's step counts were tuned on."""
UNTUNED = ((4, 1), (5, 2), (6, 3))
"""(training seed, data seed) pairs no setting was chosen on. Measured once (issue 41): seeds 4
and 6 pass every check (accuracy 1.0, controls 0.26-0.30 with 95-100 % option letters, recall
0.84-0.87 -> 1.0); seed 5 on data seed 2 fails, at accuracy 0.31: its budget policy drops the
memories (mean B_mem 1.9 by step 150, 0.2 at step 600) before the reasoner reads them."""
RUNS = {"tuned": TUNED, "untuned": UNTUNED, "all": TUNED + UNTUNED}[os.environ.get("ELASTICMEM_MECHANISM_RUNS",
                                                                                     "tuned")]
CHANCE = 0.25
VALID_FLOOR = 0.5
"""Share of the controls' answers that must be an option letter: below it, 'not above chance'
would hold for a model that has stopped answering, not only for one that cannot answer."""


def _prepare(root: Path, data_seed: int) -> None:
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import build_bank
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic

    cfg = load_config(PRESET, [f"data.dir={root}/data{data_seed}", f"bank.dir={root}/bank{data_seed}"])
    write_synthetic(cfg.data.synthetic, data_seed, cfg.data.dir)
    examples = {s: load_split(cfg.data.dir, s) for s in ("train", "val", "test")}
    build_bank(examples, load_backbone(cfg.backbone), cfg.chunking, cfg.bank, torch.float32, show_progress=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Data and bank of every data seed the runs use (seed 0 always: the recipe test's)."""
    root = tmp_path_factory.mktemp("mechanism")
    for data_seed in sorted({0} | {d for _, d in RUNS}):
        _prepare(root, data_seed)
    return root


def _overrides(root: Path, seed: int, data_seed: int = 0) -> list[str]:
    return [f"data.dir={root}/data{data_seed}", f"bank.dir={root}/bank{data_seed}",
            f"train.output_dir={root}/run{seed}", f"seed={seed}"]


def _train_all(root: Path) -> None:
    """The runs' trainings, all at once, one thread each (on 2 cores three processes finish
    sooner than two rounds of two)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("ACCELERATE_USE_CPU", None)
    pending, running = list(RUNS), []
    while pending or running:
        while pending:
            seed, data_seed = pending.pop(0)
            cmd = [sys.executable, "train.py", "--config", str(PRESET), *_overrides(root, seed, data_seed)]
            log = open(root / f"train{seed}.log", "w")  # a file, not a pipe nobody reads while it runs
            running.append((seed, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)))
            log.close()
        time.sleep(1)
        for seed, p in list(running):
            if p.poll() is not None:
                tail = (root / f"train{seed}.log").read_text()[-4000:]
                assert p.returncode == 0, f"seed {seed}: exit {p.returncode}\n{tail}"
                running.remove((seed, p))


def _greedy(model, examples, batch_size=32):
    """Accuracy, the mean budget of evidence / other retrieved memories, and the share of answers
    that hold an option letter (greedy)."""
    from elasticmem.eval.retrieval import evidence_rows
    from elasticmem.data.rewards import mc_letter_reward, parse_option_letter

    correct, ev_b, other_b, valid = [], [], [], []
    for i in range(0, len(examples), batch_size):
        batch = examples[i : i + batch_size]
        with torch.no_grad():
            traj = model.greedy(batch)
        for k, ex in enumerate(batch):
            correct.append(mc_letter_reward(traj.answers[k], ex))
            valid.append(parse_option_letter(traj.answers[k], len(ex.choices)) is not None)
            ev = evidence_rows(ex, model.bank)
            for j, row in enumerate(traj.rows[k].tolist()):
                if row >= 0:
                    (ev_b if row in ev else other_b).append(float(traj.budgets[k, j]))
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return mean(correct), mean(ev_b), mean(other_b), mean(valid)


@pytest.mark.timeout(1800)  # 2 min 37 s on 2 idle cores
def test_full_mechanism_learns_at_every_seed_and_uses_its_memory(setup):
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.model.elasticmem import ElasticMem

    _train_all(setup)
    report = {}
    for seed, data_seed in RUNS:
        cfg = load_config(PRESET, _overrides(setup, seed, data_seed))
        bank = Bank.open(cfg.bank.dir)
        val = load_split(cfg.data.dir, "val")
        groups = sorted({ex.group for ex in val})
        # every question asked of the next history's memories: same bank, wrong group
        elsewhere = [dataclasses.replace(ex, group=groups[(groups.index(ex.group) + 1) % len(groups)]) for ex in val]
        assert len(val) >= 150
        run = setup / f"run{seed}"
        evaluated = json.loads((run / "eval_val.json").read_text())
        model = ElasticMem(load_backbone(cfg.backbone), cfg.memory, bank)
        model.load_weights(run / "final")
        model.eval()
        acc, ev_budget, other_budget, _ = _greedy(model, val)
        wrong_group, _, _, wrong_group_valid = _greedy(model, elsewhere)
        no_memory_model = ElasticMem(load_backbone(cfg.backbone), dataclasses.replace(cfg.memory, top_z=0), bank)
        no_memory_model.load_weights(run / "final")
        no_memory, _, _, no_memory_valid = _greedy(no_memory_model.eval(), val)
        steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval" not in r]
        recall = [r["retrieval/recall@4"] for r in steps]
        report[seed] = dict(data_seed=data_seed, acc=acc, logged=evaluated["accuracy"], wrong_group=wrong_group,
                            wrong_group_valid=wrong_group_valid, no_memory=no_memory, no_memory_valid=no_memory_valid,
                            budget_evidence=ev_budget, budget_other=other_budget,
                            recall_first=sum(recall[:20]) / 20, recall_last=sum(recall[-20:]) / 20,
                            reward_first=steps[0]["reward/mean"])
    for seed, r in report.items():
        assert r["reward_first"] < 0.1, (seed, r)  # the random model starts far from the answer format
        assert r["acc"] == pytest.approx(r["logged"]) and r["acc"] >= 0.8, (seed, r)
        # without its memories, or with another history's, the model cannot answer: at most chance +
        # 0.1 (below chance is allowed: never trained without memory, it writes some non-letters,
        # e.g. 0.144 at seeds 0 and 1 on an AVX-512 CPU)
        assert r["no_memory"] <= CHANCE + 0.1 and r["no_memory_valid"] >= VALID_FLOOR, (seed, r)
        assert r["wrong_group"] <= CHANCE + 0.1 and r["wrong_group_valid"] >= VALID_FLOOR, (seed, r)
        assert r["budget_evidence"] > r["budget_other"], (seed, r)
        # retrieval learned: at least half the way from where it started to 1 (0.85 -> 1.0 over
        # the first 120 steps of the untuned runs, on data seeds 1-3), and nearly perfect at the end
        assert r["recall_last"] >= r["recall_first"] + 0.5 * (1 - r["recall_first"]), (seed, r)
        assert r["recall_last"] >= 0.95, (seed, r)


RECIPE_GRPO_STEPS = 60
"""GRPO steps after the reading warm-up: the GRPO-only test above runs 600 (the preset's)."""


def _recipe_all(root: Path) -> None:
    """Warm-up then GRPO from it, for each seed and a no-memory arm (seed 0, same recipe and
    budget), all at once, one thread each."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("ACCELERATE_USE_CPU", None)
    arms = {f"r{s}": [f"seed={s}"] for s in SEEDS} | {"nomem": ["seed=0", "memory.top_z=0"]}
    procs = {}
    for arm, extra in arms.items():
        common = [f"data.dir={root}/data0", f"bank.dir={root}/bank0", *extra]
        warm = [sys.executable, "-m", "elasticmem.warmup.reading", "--config", str(PRESET), *common,
                f"warmup.output_dir={root}/{arm}_warmup"] + (["warmup.retrieval_weight=0"] if arm == "nomem" else [])
        grpo = [sys.executable, "train.py", "--config", str(PRESET), *common, f"train.output_dir={root}/{arm}",
                f"train.init_from={root}/{arm}_warmup/final", f"train.max_steps={RECIPE_GRPO_STEPS}"] + (
                    ["train.loss.retrieval_weight=0"] if arm == "nomem" else [])
        script = " && ".join(subprocess.list2cmdline(c) for c in (warm, grpo))
        log = open(root / f"{arm}.log", "w")
        procs[arm] = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
    for arm, p in procs.items():
        p.wait()
        assert p.returncode == 0, f"{arm}: exit {p.returncode}\n{(root / f'{arm}.log').read_text()[-4000:]}"


@pytest.mark.timeout(1800)  # about 2 min on 2 idle cores
def test_reading_warmup_then_a_quarter_of_the_grpo_steps_learns_at_every_seed(setup):
    """The recipe: the supervised reading warm-up, then GRPO from it for 60 steps (not 600),
    reaches >= 0.9 held-out accuracy at every seed, and its budget policy learns to inject fewer
    tokens (mean B_mem of the last 10 steps below 3/4 of the first 10's; in 60 steps it cuts
    every memory to about 1 token, not yet the non-evidence ones to 0 as the 600-step GRPO-only
    run does). The no-memory reasoner trained with the same recipe and budget stays within 0.1
    of chance."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.model.elasticmem import ElasticMem

    _recipe_all(setup)
    cfg = load_config(PRESET, _overrides(setup, 0))
    bank = Bank.open(cfg.bank.dir)
    val = load_split(cfg.data.dir, "val")
    report = {}
    for seed in SEEDS:
        run = setup / f"r{seed}"
        warm = json.loads((setup / f"r{seed}_warmup/eval.json").read_text())
        steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval" not in r]
        model = ElasticMem(load_backbone(cfg.backbone), cfg.memory, bank)
        model.load_weights(run / "final")
        acc, ev_budget, other_budget, _ = _greedy(model.eval(), val)
        b_mem = [r["budget/mean_B_mem"] for r in steps]
        report[seed] = dict(acc=acc, logged=json.loads((run / "eval_val.json").read_text())["accuracy"],
                            b_mem_first=sum(b_mem[:10]) / 10, b_mem_last=sum(b_mem[-10:]) / 10,
                            warmup_acc=warm["eval"]["accuracy"], steps=len(steps),
                            budget_evidence=ev_budget, budget_other=other_budget,
                            warmup_answer_loss=[r for r in map(json.loads, (setup / f"r{seed}_warmup/metrics.jsonl")
                                                               .read_text().splitlines())][-1]["loss/answer"])
    nomem = json.loads((setup / "nomem/eval_val.json").read_text())["accuracy"]
    for seed, r in report.items():
        assert r["steps"] == RECIPE_GRPO_STEPS, (seed, r)
        assert r["acc"] == pytest.approx(r["logged"]) and r["acc"] >= 0.9, (seed, r, report)
        assert r["warmup_answer_loss"] < 0.1, (seed, r)  # the warm-up alone taught reading
        assert r["b_mem_last"] < 0.75 * r["b_mem_first"], (seed, r)
    assert abs(nomem - CHANCE) <= 0.1, (nomem, report)
