"""The real ALFWorld engine on the sample game of ../shared/data/alfworld_sample_game.

    pytest tests/integration/test_alfworld_engine.py

Skips, with the reason, where the alfworld package (the agent extra) or the sample folder is
absent. The sample comes from ALFWorld's multi-agent branch; the game is rebuilt for one agent
from the installed wheel's logic files (build_game_file), as ``alfworld-play-tw`` builds games.
"""

from __future__ import annotations

import json
import random
import sys

import pytest

from tests.conftest import SHARED_DATA

SAMPLE = SHARED_DATA / "alfworld_sample_game"
pytestmark = [
    pytest.mark.skipif(not SAMPLE.is_dir(), reason=f"ALFWorld sample game not found at {SAMPLE} (../shared/data)"),
    pytest.mark.slow,
]
pytest.importorskip("alfworld", reason="alfworld not installed: pip install 'elasticmem[agent]'")

from elasticmem.agent import trajectories as T  # noqa: E402
from elasticmem.agent.alfworld_env import (  # noqa: E402
    AlfworldEnv,
    build_game_file,
    find_games,
    single_agent_problem,
)


@pytest.fixture(scope="module")
def games_root(tmp_path_factory):
    """<root>/<task>/<trial>/game.tw-pddl, laid out like $ALFWORLD_DATA/json_2.1.1/<split>."""
    root = tmp_path_factory.mktemp("alfworld") / "train"
    traj = json.loads((SAMPLE / "traj_data.json").read_text())
    build_game_file(SAMPLE, root / "pick_heat_then_place_in_recep-Potato-None-SinkBasin-1" / traj["task_id"])
    return root


@pytest.fixture(scope="module")
def game(games_root):
    (g,) = find_games(games_root)
    return g


def test_single_agent_problem_keeps_one_agent_named_agent1():
    problem = (SAMPLE / "initial_state.pddl").read_text()
    out = single_agent_problem(problem)
    assert "alice" not in out and "bob" not in out and "charlie" not in out
    assert out.count("agent1 - agent") == 1 and "(atLocation agent1 " in out
    # every other line is kept as it was
    assert len(out.splitlines()) == len(problem.splitlines()) - 4
    assert single_agent_problem(out) == out


@pytest.fixture(scope="module")
def expert_run(game, tmp_path_factory):
    """(trajectories JSONL, its one record): the handcoded expert played in-process."""
    out = tmp_path_factory.mktemp("traj") / "traj.jsonl"
    argv = list(sys.argv)
    random.seed(123)
    (rec,) = T.collect([game], out, progress=False)
    # fast-downward's translator rewrites sys.argv on load; the expert's ties use the env's own
    # seeded generator, not the caller's global random module
    assert sys.argv == argv and random.random() == random.Random(123).random()
    return out, rec


def test_the_expert_trajectory_is_recorded_and_replays_to_a_win(game, expert_run):
    _, rec = expert_run
    assert rec["success"] and rec["game_id"] == game.game_id and "failure" not in rec
    assert rec["objective"] == "heat some potato and put it in sinkbasin."
    assert rec["task_type"] == game.task_type == "pick_heat_then_place_in_recep"
    assert "microwave 1" in rec["observation"] and "Your task" not in rec["observation"]
    actions = [s["action"] for s in rec["steps"]]
    assert len(actions) == 16 and all(s["action"] in s["admissible"] for s in rec["steps"])
    potato = actions[-1].split()[2]
    assert actions[-2:] == ["go to sinkbasin 1", f"move potato {potato} to sinkbasin 1"]
    assert f"heat potato {potato} with microwave 1" in actions
    # Replayed in a fresh env without the expert: the engine gives the recorded observations and
    # commands and reports the win at the last action, not before.
    env = AlfworldEnv(game.path, expert=False, max_steps=50)
    obs = env.reset()
    assert (obs.text, env.objective) == (rec["observation"], rec["objective"])
    for i, s in enumerate(rec["steps"]):
        assert obs.admissible == s["admissible"]
        obs = env.step(s["action"])
        assert (obs.text, obs.won, obs.done) == (s["observation"], i == 15, i == 15)
    assert obs.expert_action is None and not obs.truncated
    # A step limit ends the episode as truncated; an inadmissible command is harmless.
    short = AlfworldEnv(game.path, expert=False, max_steps=2)
    short.reset()
    assert short.step("fly to the moon").text == "Nothing happens."
    obs = short.step("look")
    assert obs.done and obs.truncated and not obs.won
    # The planner state is process-global: an env another one was reset after refuses to step.
    with pytest.raises(RuntimeError, match="process-global"):
        env.step("look")
    env.reset()
    assert env.step("go to countertop 2").text.startswith("You arrive at countertop 2.")
    env.close()
    short.close()


def test_trajectories_resume_and_survive_a_truncated_line(game, expert_run):
    out, rec = expert_run
    # Resuming plays nothing new; a truncated last line (a crash mid-write) is dropped.
    assert T.collect([game], out, progress=False) == [rec]
    out.write_text(out.read_text() + '{"game_id": "half')
    assert T.read_records(out) == [rec]
    assert T.collect([game], out, progress=False) == [rec]
    assert out.read_text().count("\n") == 1


def test_two_processes_give_the_records_of_one(games_root, expert_run, tmp_path):
    # Two copies of the game under other ids, played by two spawned workers.
    _, rec = expert_run
    for name in ("a", "b"):
        build_game_file(SAMPLE, tmp_path / "games" / name / "trial")
    records = T.collect(find_games(tmp_path / "games"), tmp_path / "two.jsonl", processes=2, progress=False)
    assert [r.pop("game_id") for r in records] == ["a/trial", "b/trial"]
    expect = {k: v for k, v in rec.items() if k != "game_id"}
    assert records == [expect, expect]


def test_pools_are_80_20_by_seed_and_frozen(tmp_path):
    recs = [{"game_id": f"g{i:02d}", "success": i % 7 != 0, "steps": [{}] * (1 if i == 3 else 2)} for i in range(30)]
    memory, imitation = T.write_pools(recs, tmp_path)
    kept = sorted(r["game_id"] for r in recs if r["success"] and len(r["steps"]) >= 2)
    assert sorted(memory + imitation) == kept and len(kept) == 24 and "g03" not in kept
    assert (len(memory), len(imitation)) == (round(0.8 * 24), 24 - round(0.8 * 24))
    import random
    expect = list(kept)
    random.Random(42).shuffle(expect)
    assert memory + imitation == expect
    assert (tmp_path / "memory_ids.txt").read_text().split() == memory
    assert T.write_pools(recs, tmp_path) == (memory, imitation)
    with pytest.raises(ValueError, match="frozen"):
        T.write_pools(recs[:-1], tmp_path)


def test_a_folder_without_games_is_an_error_not_a_hang(tmp_path):
    (tmp_path / "x" / "trial").mkdir(parents=True)
    (tmp_path / "x" / "trial" / "traj_data.json").write_text(json.dumps({"task_type": "pick_and_place_simple"}))
    with pytest.raises(ValueError, match=r"no playable ALFWorld game .*1 traj_data.json"):
        find_games(tmp_path)
    with pytest.raises(FileNotFoundError):
        find_games(tmp_path / "missing")


def test_generated_games_have_new_goals_the_expert_wins(tmp_path):
    from elasticmem.agent import generate_games as G

    scene = G.read_scene((SAMPLE / "initial_state.pddl").read_text())
    potatoes = scene.properties["Potato"]
    assert len(potatoes) == scene.objects["Potato"] and sum({"pickupable", "heatable"} <= p for p in potatoes) == 2
    assert ("SinkBasin", "Potato") in scene.contains and "Microwave" in scene.receptacles
    tasks = G.possible_tasks(scene, (4,))
    assert G.Task("pick_heat_then_place_in_recep", "Potato", "SinkBasin") in tasks
    assert all(t.recep != "Microwave" for t in tasks)  # the heating appliance is not a destination
    assert not G.possible_tasks(scene, (2,))  # no lamp in this kitchen: no look-at-in-light task

    kept = G.generate(SAMPLE, tmp_path, n=1, seed=1, task_types=(5,), progress=False)
    games = find_games(tmp_path)
    assert [g.game_id for g in games] == [r["game_id"] for r in kept] and len(kept) == 1
    for rec, game in zip(sorted(kept, key=lambda r: r["game_id"]), games):
        traj = json.loads(game.traj_data.read_text())
        obj, recep = traj["pddl_params"]["object_target"], traj["pddl_params"]["parent_target"]
        assert game.game_id.startswith(f"{traj['task_type']}-{obj}-None-{recep}-gen")
        assert traj["task_type"] == "pick_cool_then_place_in_recep"
        assert any(s["action"].startswith(f"cool {obj.lower()} ") for s in rec["steps"])
        assert obj.lower() in rec["objective"] and recep.lower() in rec["objective"]
        # the engine checks the new goal: the expert wins by putting the object there, not before
        assert rec["success"] and len(rec["steps"]) >= 2
        last = rec["steps"][-1]["action"]
        assert last.startswith(f"move {obj.lower()} ") and f"to {recep.lower()} " in last + " "
    # held-out games: tasks generated under an excluded folder are not drawn again
    left = G.untaken(G.possible_tasks(scene, (5,)), [tmp_path])
    assert len(left) == len(G.possible_tasks(scene, (5,))) - 1
    assert all(f"{t.task_type}-{t.obj}-None-{t.recep}" not in games[0].game_id for t in left)
