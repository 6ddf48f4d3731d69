"""What training logs and does across processes and micro-batches, against an independent computation.

    pytest tests/integration/test_train_distributed.py

One rollout step is recomputed here from the recorded trajectories and a saved checkpoint
with the model's scoring and the loss function called once on the whole batch (one process,
one micro-batch); the logged loss, its parts, the unit counts, the unit means and the
gradient norm must equal it for 1 and 2 processes and several micro-batch sizes. Sampling
on 2 processes must train exactly as 1 process replaying those samples, and a non-finite
loss on one process only must skip the step on both, leaving weights and optimizer state
untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, launch_2
from safetensors.torch import load_file
from test_train import _env, _metrics, _params, _train_cli, tiny_setup  # noqa: F401  (fixture)

# Every kind of unit: a sampled control token, two memories (budget actions), two answer tokens.
MECHANISM = ("memory.retrieval=control", "memory.top_z=2", "memory.max_new_tokens=2", "train.eval_split=",
             "train.group_size=4", "train.warmup_steps=0", "train.save_every=1", "train.max_steps=2")
SAME = ("time/", "processes", "distributed_type")  # keys that may differ between the runs


def _two(**extra):
    return dict(env=_env(ACCELERATE_USE_CPU="1", **extra), launcher=launch_2())


def _steps(out: Path) -> list[dict]:
    return [r for r in _metrics(out) if "eval" not in r]


def _assert_same_rows(a: list[dict], b: list[dict], rel: float = 1e-5) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert set(ra) == set(rb)
        for k in ra:
            if k.startswith(SAME):
                continue
            if isinstance(ra[k], float):
                assert rb[k] == pytest.approx(ra[k], rel=rel, abs=1e-7), (ra["step"], k)
            else:
                assert ra[k] == rb[k], (ra["step"], k)


def _independent(root: Path, ckpt: Path, rec: Path, step: int, overrides: tuple[str, ...]) -> dict[str, float]:
    """The step's loss metrics and gradient norm from one scoring pass and one loss call."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.grpo.loss import Normalizer, PartLogProbs, PartMasks, elasticmem_loss, group_advantages
    from elasticmem.data.rewards import mc_letter_reward
    from elasticmem.model.elasticmem import ElasticMem
    from elasticmem.model.trajectories import Trajectories

    cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.dir={root}/data", f"bank.dir={root}/bank", *overrides])
    model = ElasticMem(load_backbone(cfg.backbone), cfg.memory, Bank.open(cfg.bank.dir))
    model.load_weights(ckpt)
    files = sorted(rec.glob(f"step{step:06d}_rank*.safetensors"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    traj = Trajectories.concat([Trajectories(**load_file(str(p)), **json.loads(p.with_suffix(".json").read_text()))
                                for p in files])
    by_id = {ex.id: ex for ex in load_split(cfg.data.dir, "train")}
    rewards = torch.tensor([mc_letter_reward(a, by_id[i]) for a, i in zip(traj.answers, traj.example_ids)])
    G = cfg.train.group_size
    adv = group_advantages(rewards.view(-1, G), cfg.train.loss).view(-1)
    masks = PartMasks.of(traj)
    norm = Normalizer.from_masks(masks, cfg.memory.max_new_tokens, with_control=cfg.memory.retrieval == "control")
    model.train()
    new = PartLogProbs.of(model.score(traj))
    old = PartLogProbs(new.control.detach(), new.budget.detach(), new.answer.detach())
    loss, m = elasticmem_loss(new, old, adv, masks, cfg.train.loss, norm)
    loss.backward()
    grads = [p.grad.norm() for p in model.parameters() if p.requires_grad and p.grad is not None]
    # evidence recall of the rollout, from chunks.jsonl's (group, session, turns) by hand
    chunks = [json.loads(line) for line in (Path(cfg.bank.dir) / "chunks.jsonl").read_text().splitlines()]
    where = {(c["group"], c["session"], t): c["row"] for c in chunks for t in c["turns"]}
    hits = [any(where[(by_id[i].group, s, t)] in set(r.tolist()) for s, t in by_id[i].extra["evidence"])
            for i, r in zip(traj.example_ids, traj.rows)]
    return {**{k: float(v) for k, v in m.items()}, "loss": float(loss.detach()),
            f"retrieval/recall@{cfg.memory.top_z}": sum(hits) / len(hits),
            "grad_norm": float(torch.stack(grads).norm()),
            "reward/mean": float(rewards.mean())}


def test_logged_loss_and_grad_norm_equal_one_pass_for_any_processes_and_micro_batches(tiny_setup, tmp_path):  # noqa: F811
    """1 process (micro-batch 6 and 64) and 2 processes (micro-batch 3 and 64), same recorded
    rollouts: the same step metrics, equal to the independent one-pass computation."""
    rec = tmp_path / "rec"
    _train_cli(tiny_setup, tmp_path / "one", *MECHANISM, "train.batch_size=8", "train.micro_batch_size=6",
               f"train.record_rollouts={rec}")
    runs = {"one": _steps(tmp_path / "one")}
    replay = (*MECHANISM, f"train.replay_rollouts={rec}")
    _train_cli(tiny_setup, tmp_path / "one64", *replay, "train.batch_size=8", "train.micro_batch_size=64")
    _train_cli(tiny_setup, tmp_path / "two3", *replay, "train.batch_size=4", "train.micro_batch_size=3", **_two())
    _train_cli(tiny_setup, tmp_path / "two64", *replay, "train.batch_size=4", "train.micro_batch_size=64", **_two())
    for name in ("one64", "two3", "two64"):
        runs[name] = _steps(tmp_path / name)
        _assert_same_rows(runs["one"], runs[name])
    assert runs["two3"][0]["processes"] == 2 and runs["one"][0]["processes"] == 1

    # step 2 is scored with the weights saved after step 1
    ref = _independent(tiny_setup, tmp_path / "one" / "checkpoints" / "step_000001", rec, 2, MECHANISM)
    logged = runs["one"][1]
    assert ref["units/lm"] > ref["units/budget"] > 0
    for key in ("loss", "loss/lm", "loss/budget", "units/lm", "units/budget", "objective/lm", "objective/budget",
                "ratio/lm", "ratio/budget", "clip_frac/lm", "entropy/budget", "grad_norm", "reward/mean",
                "retrieval/recall@2"):
        assert logged[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), key
    assert abs(logged["loss"]) > 1e-6 and logged["grad_norm"] > 0  # nothing trivially zero

    final = {name: _params(tmp_path / name / "final", defined_only=True) for name in runs}
    for name in ("one64", "two3", "two64"):
        for k in final["one"]:
            assert torch.allclose(final["one"][k], final[name][k], atol=1e-5), (name, k)


def test_two_processes_sampling_train_as_one_process_replaying_their_samples(tiny_setup, tmp_path):  # noqa: F811
    """The sampling path on 2 processes (each its own queries and RNG) against 1 process replaying
    what they sampled with the doubled batch: same metrics and weights."""
    rec = tmp_path / "rec"
    _train_cli(tiny_setup, tmp_path / "two", *MECHANISM, "train.batch_size=4", "train.micro_batch_size=5",
               f"train.record_rollouts={rec}", **_two())
    assert len(list(rec.glob("step000001_rank*.safetensors"))) == 2
    _train_cli(tiny_setup, tmp_path / "one", *MECHANISM, "train.batch_size=8", "train.micro_batch_size=16",
               f"train.replay_rollouts={rec}")
    two, one = _steps(tmp_path / "two"), _steps(tmp_path / "one")
    assert two[0]["processes"] == 2
    _assert_same_rows(two, one)
    a, b = _params(tmp_path / "two" / "final", defined_only=True), _params(tmp_path / "one" / "final", defined_only=True)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


NAN_ON_RANK_1 = """
import os, sys
sys.argv = ["train.py"]
from elasticmem.grpo import trainer
from elasticmem.config import load_config
real, calls = trainer.elasticmem_loss, []
def poisoned(*a, **k):
    loss, m = real(*a, **k)
    calls.append(1)
    # rank 1 only, on the second micro-batch of step 2 (the first one has already run backward)
    bad = os.environ["RANK"] == "1" and len(calls) == 4
    return (loss * float("nan"), m) if bad else (loss, m)
trainer.elasticmem_loss = poisoned
trainer.train(load_config("configs/tiny.yaml", sys.argv_overrides))
"""


def test_nonfinite_loss_on_one_process_skips_the_step_on_all(tiny_setup, tmp_path):  # noqa: F811
    out = tmp_path / "nan"
    overrides = [f"data.dir={tiny_setup}/data", f"bank.dir={tiny_setup}/bank", f"train.output_dir={out}",
                 "train.max_steps=3", "train.save_every=1", "train.eval_split=", "train.batch_size=4",
                 "train.micro_batch_size=16"]  # 2 micro-batches per step
    script = tmp_path / "nan_on_rank1.py"
    script.write_text(NAN_ON_RANK_1.replace("sys.argv_overrides", repr(overrides)))
    import subprocess

    p = subprocess.run([*launch_2(), str(script)], cwd=ROOT, env=_env(ACCELERATE_USE_CPU="1"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-5000:]
    rows = _steps(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["processes"] == 2
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1]
    assert "update skipped" in p.stderr
    ck = out / "checkpoints"
    step1, step2, step3 = (_params(ck / f"step_00000{i}") for i in (1, 2, 3))
    for k in step1:
        assert torch.equal(step1[k], step2[k]), f"{k} changed in the skipped step"
        assert torch.isfinite(step3[k]).all()
    assert any(not torch.equal(step2[k], step3[k]) for k in step1), "step 3 must train again"
    opt1, opt2 = (load_file(str(ck / f"step_00000{i}" / "trainer_state" / "optimizer.safetensors")) for i in (1, 2))
    assert opt1.keys() == opt2.keys() and all(torch.equal(opt1[k], opt2[k]) for k in opt1), "optimizer state moved"
    s1, s2 = (json.loads((ck / f"step_00000{i}" / "trainer_state" / "state.json").read_text()) for i in (1, 2))
    assert s1["optimizer_steps"] == s2["optimizer_steps"] == 1
