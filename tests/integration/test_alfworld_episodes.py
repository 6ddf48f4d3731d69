"""ALFWorld episodes in evaluate.py (eval.task=alfworld): a trained tiny checkpoint, no_memory and
text_rag play the sample game in the real engine on 2 processes; each episode equals its replay in
one process, step by step (outputs, actions, observations, retrieval, budgets, tokens); a rerun
resumes.

    pytest tests/integration/test_alfworld_episodes.py

Skips, with the reason, where the alfworld package (the agent extra) or the sample folder is absent.
The games are the sample game twice, once under valid_seen and once under valid_unseen, so that
the success rate is reported per split and two processes each get a game.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SHARED_DATA, launch_2
from test_evaluate import _records
from test_train import _env

SAMPLE = SHARED_DATA / "alfworld_sample_game"
pytestmark = [
    pytest.mark.skipif(not SAMPLE.is_dir(), reason=f"ALFWorld sample game not found at {SAMPLE} (../shared/data)"),
    pytest.mark.slow,
]
pytest.importorskip("alfworld", reason="alfworld not installed: pip install 'elasticmem[agent]'")

from elasticmem.agent.alfworld_env import AlfworldEnv, build_game_file, find_games  # noqa: E402
from elasticmem.config import load_config  # noqa: E402

MAX_STEPS = 4
VARIANTS = "{elasticmem: [], no_memory: [eval.system=no_memory, eval.checkpoint=null], text_rag: [eval.system=text_rag]}"


def _overrides(root: Path, *extra: str) -> list[str]:
    return [f"data.dir={root}/data", f"bank.dir={root}/bank", f"agent.games_dir={root}/games",
            f"agent.max_steps={MAX_STEPS}", "eval.task=alfworld", "eval.split=valid_seen,valid_unseen", *extra]


def _evaluate(root: Path, out: Path, *extra: str, launcher=(sys.executable,), env=None):
    import subprocess

    args = [*launcher, "evaluate.py", "--config", "configs/alfworld_tiny.yaml", *_overrides(root, *extra),
            f"eval.output_dir={out}"]
    p = subprocess.run(args, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"
    return p


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Games, the expert's trajectory as a card bank and imitation data, and a checkpoint
    trained for a few GRPO steps on it."""
    from elasticmem.agent.imitation import imitation_examples
    from elasticmem.agent.skill_cards import fallback_card
    from elasticmem.agent.trajectories import expert_trajectory
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import build_bank
    from elasticmem.data.schema import load_split, write_examples
    from elasticmem.grpo.trainer import train

    root = tmp_path_factory.mktemp("episodes")
    traj = json.loads((SAMPLE / "traj_data.json").read_text())
    for split in ("valid_seen", "valid_unseen"):
        build_game_file(SAMPLE, root / "games" / split / "pick_heat_then_place_in_recep-sample" / traj["task_id"])
    record = expert_trajectory(find_games(root / "games" / "valid_seen")[0])
    assert record["success"]
    cards = [{"text": f"[{record['task_type']}] {fallback_card(record)}"},
             {"text": "[pick_and_place_simple] Task type: pick and place. Objective pattern: put an object "
                      "in a receptacle.\n1. Go to where the object is.\n2. Take it.\n3. Put it in the receptacle."}]
    train_ex, val_ex = imitation_examples([record], [record["game_id"]], cards, heldout=0.2)
    write_examples(root / "data" / "train.jsonl", train_ex)
    write_examples(root / "data" / "val.jsonl", val_ex)
    cfg = load_config(ROOT / "configs/alfworld_tiny.yaml", _overrides(root, f"train.output_dir={root}/run",
                                                                        "train.max_steps=2", "train.eval_split=",
                                                                        "train.batch_size=4", "train.group_size=4"))
    build_bank({s: load_split(cfg.data.dir, s) for s in ("train", "val")}, load_backbone(cfg.backbone), cfg.chunking,
               cfg.bank, torch.float32, show_progress=False)
    train(cfg)
    out = root / "eval"
    _evaluate(root, out, f"eval.checkpoint={root}/run/final", f"eval.variants={VARIANTS}", launcher=launch_2(),
              env=_env(ACCELERATE_USE_CPU="1"))
    return root, out


def test_every_system_plays_each_game_and_reports_success_per_split(setup):
    root, out = setup
    comparison = (out / "comparison.md").read_text()
    for name in ("elasticmem", "no_memory", "text_rag"):
        res = json.loads((out / name / "results.json").read_text())
        assert res["num_examples"] == 2 and set(res["per_type_counts"]) == {"valid_seen", "valid_unseen"}
        assert res["success_rate"] == res["accuracy"] and len(res["success_rate_ci95"]) == 2
        recs = _records(out / name / "predictions.jsonl")
        assert [r["id"].split("/")[0] for r in recs] == ["valid_seen", "valid_unseen"]
        parts = sorted((out / name).glob("predictions.part-*.jsonl"))
        assert [len(_records(p)) for p in parts] == [1, 1], "each of the 2 processes played one game"
        for r in recs:
            trace = r["extra"]["trace"]
            assert r["correct"] == r["extra"]["won"] == (r["prediction"] == "won")
            assert r["extra"]["steps"] == len(trace) and 1 <= len(trace) <= MAX_STEPS
            assert r["correct"] or len(trace) == MAX_STEPS, "an episode ends on a win or at the step limit"
            assert r["tokens"]["total"] == sum(r["tokens"][k] for k in ("prompt", "memory", "generated")) > 0
        assert res["avg_tokens"] == pytest.approx(sum(r["tokens"]["total"] for r in recs) / 2)
        assert name in comparison
    no_mem = _records(out / "no_memory" / "predictions.jsonl")
    assert all(r["tokens"]["memory"] == 0 and not r["retrieved"] for r in no_mem)
    text = _records(out / "text_rag" / "predictions.jsonl")
    assert all(r["tokens"]["memory"] > 0 and r["retrieved"][0]["text"].startswith("[") for r in text)


@pytest.mark.parametrize("split", ["valid_seen", "valid_unseen"])
def test_each_episode_of_two_processes_replays_in_one_and_its_tokens_are_the_sum_of_its_steps(setup, split):
    """The trace's actions, played again in a fresh env in this process, give its observations;
    each step's output is what the system answers here to that step's example rebuilt from the
    trace (greedy, no memo: retrieving once per episode changes nothing), and the episode's
    tokens are their sum: the 2-process evaluation played each game as one process does."""
    from elasticmem.agent.episodes import step_example
    from elasticmem.agent.imitation import step_fields
    from elasticmem.systems import build_system

    root, out = setup
    (rec,) = [r for r in _records(out / "elasticmem" / "predictions.jsonl") if r["id"].startswith(split)]
    cfg = load_config(ROOT / "configs/alfworld_tiny.yaml", _overrides(root, f"eval.checkpoint={root}/run/final"))
    system = build_system(cfg)
    (game,) = find_games(root / "games" / split)
    env = AlfworldEnv(game.path, expert=False, max_steps=MAX_STEPS)
    obs, past, totals = env.reset(), [], {"prompt": 0, "memory": 0, "generated": 0}
    assert env.objective == rec["extra"]["objective"]
    for i, step in enumerate(rec["extra"]["trace"]):
        ex = step_example(rec["id"], i, env.objective, env.task_type, step_fields(past, obs.text, obs.admissible))
        (pred,) = system.predict([ex])
        assert pred.text == step["output"]
        assert [m.ref for m in pred.retrieved] == [m["ref"] for m in rec["retrieved"]]
        assert [m.budget for m in pred.retrieved] == rec["budgets"]
        totals = {"prompt": totals["prompt"] + pred.prompt_tokens, "memory": totals["memory"] + pred.memory_tokens,
                  "generated": totals["generated"] + pred.generated_tokens}
        obs = env.step(step["action"])
        assert obs.text == step["observation"]
        past.append((step["action"], obs.text))
    assert obs.won == rec["correct"]
    assert {k: rec["tokens"][k] for k in totals} == totals
    # retrieved once: only the first step of an episode spends time on retrieval
    assert rec["latency"]["retrieval"] > 0


def test_a_rerun_resumes_every_variant_without_playing_again(setup):
    root, out = setup
    before = {n: (out / n / "predictions.jsonl").read_text() for n in ("elasticmem", "no_memory", "text_rag")}
    p = _evaluate(root, out, f"eval.checkpoint={root}/run/final", f"eval.variants={VARIANTS}")
    assert p.stderr.count("2 of 2 examples already answered") == 3
    assert before == {n: (out / n / "predictions.jsonl").read_text() for n in before}
