"""ALFWorld imitation examples: one per expert step, the prompt fields, the held-out steps.

    pytest tests/unit/test_alfworld_imitation.py

Trajectories here are written by hand in the format `elasticmem.agent.trajectories` records
(tests/integration/test_alfworld_engine.py checks that format against the real engine).
"""

from __future__ import annotations

import json

import pytest

from elasticmem.agent import imitation as I
from elasticmem.data.chunking import chunk_history
from elasticmem.data.schema import load_split
from elasticmem.data.rewards import snapped_action_reward
from elasticmem.model.prompt import format_suffix


def trajectory(game_id, n_steps, task_type="pick_and_place_simple"):
    steps = [{"admissible": [f"go to shelf {k}" for k in range(1, 4)] + [f"take thing {i}"],
              "action": f"take thing {i}", "observation": f"obs {i}"} for i in range(n_steps)]
    return {"game_id": game_id, "task_type": task_type, "objective": f"put the thing of {game_id} on a shelf.",
            "observation": "You are in a room.", "steps": steps, "success": True}


CARDS = [{"game_id": "m1", "task_type": "pick_and_place_simple", "text": "[pick_and_place_simple] Task type: put."},
         {"game_id": "m2", "task_type": "pick_heat_then_place_in_recep", "text": "[pick_heat] Task type: heat."}]


def test_recent_steps_window_and_character_cap():
    past = [(f"a{i}", f"o{i}") for i in range(8)]
    assert I.recent_steps([], 5) == "(none)"
    text = I.recent_steps(past, 5)
    assert text.splitlines() == [line for i in range(3, 8) for line in (f"ACTION: a{i}", f"OBSERVATION: o{i}")]
    assert I.recent_steps(past, 5, max_chars=20) == text[-20:]  # the oldest end is cut
    with pytest.raises(ValueError):
        I.recent_steps(past, -1)


def test_one_example_per_step_with_the_state_before_it():
    rec = trajectory("g1", 7)
    exs = I.trajectory_examples(rec, I.cards_history(CARDS))
    assert [e.id for e in exs] == [f"g1#{i}" for i in range(7)]
    e0, e6 = exs[0], exs[6]
    assert (e0.question, e0.answer_text, e0.group) == (rec["objective"], "take thing 0", I.SKILLS_GROUP)
    assert e0.extra["recent"] == "(none)" and e0.extra["observation"] == "You are in a room."
    assert e6.extra["observation"] == "obs 5" and e6.extra["recent"].startswith("ACTION: take thing 1\n")
    assert e6.extra["recent"].endswith("ACTION: take thing 5\nOBSERVATION: obs 5")
    assert e6.extra["commands"].splitlines() == rec["steps"][6]["admissible"]
    # the preset's suffix renders from these fields; the expert's action earns the reward
    suffix = format_suffix(I.ALFWORLD_SUFFIX, e6)
    assert "Current observation:\nobs 5" in suffix and suffix.endswith("Action:") and "take thing 6" in suffix
    assert snapped_action_reward(" take thing 6\nmore", e6) == 1.0
    assert snapped_action_reward("go to shelf 2", e6) == 0.0
    # every card is one chunk, encoded as its retrieval text
    assert [c.text for c in chunk_history(e0.history, e0.group)] == [c["text"] for c in CARDS]


def test_heldout_steps_and_the_written_data(tmp_path):
    recs = [trajectory(f"g{i}", 10) for i in range(6)]
    train, val = I.imitation_examples(recs, ["g1", "g3", "g4"], CARDS, heldout=0.1, seed=42)
    assert len(train) + len(val) == 30 and len(val) == 3
    assert {e.id for e in train}.isdisjoint({e.id for e in val})
    assert {e.extra["game_id"] for e in train + val} == {"g1", "g3", "g4"}
    again = I.imitation_examples(recs, ["g1", "g3", "g4"], CARDS, heldout=0.1, seed=42)
    assert [e.id for e in again[1]] == [e.id for e in val]
    with pytest.raises(ValueError, match="1 imitation ids have no trajectory"):
        I.imitation_examples(recs, ["g1", "zz"], CARDS)
    with pytest.raises(ValueError, match="no skill cards"):
        I.imitation_examples(recs, ["g1"], [])
    # the CLI writes the splits every other command reads; the card history is written once
    for name, rows in (("traj.jsonl", recs), ("cards.jsonl", CARDS)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "pools").mkdir()
    (tmp_path / "pools" / "imitation_ids.txt").write_text("g1\ng3\ng4\n")
    I.main(["--trajectories", str(tmp_path / "traj.jsonl"), "--pools", str(tmp_path / "pools"), "--cards",
            str(tmp_path / "cards.jsonl"), "--out", str(tmp_path / "data"), "--heldout", "0.1"])
    read = load_split(tmp_path / "data", "train")
    assert [e.id for e in read] == [e.id for e in train]
    assert read[5].extra == train[5].extra and read[5].history == train[5].history
    assert (tmp_path / "data" / "train.jsonl").read_text().count('"history"') == 1
    assert [e.id for e in load_split(tmp_path / "data", "val")] == [e.id for e in val]


def test_the_harness_scores_a_held_out_step_by_its_snapped_action():
    """evaluate.py on the held-out steps gives the step accuracy the trainer's reward defines."""
    from elasticmem.eval.runner import gold_and_correct
    from elasticmem.eval.system import Prediction

    (ex,) = I.trajectory_examples(trajectory("g1", 1), I.cards_history(CARDS))[:1]
    for text, right in [("take thing 0", True), ("take thing", True), ("go to shelf 2", False), ("", False)]:
        pred = Prediction(id=ex.id, text=text, prompt_tokens=1, memory_tokens=0, generated_tokens=1)
        assert gold_and_correct(pred, ex) == ("take thing 0", right) == ("take thing 0", snapped_action_reward(text, ex) == 1.0)


def test_evaluate_refuses_missing_or_empty_game_folders_with_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("evaluate_cli", ROOT / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    (tmp_path / "valid").mkdir()
    base = ["--config", str(ROOT / "configs/alfworld_tiny.yaml"), "eval.task=alfworld", "eval.split=valid"]
    for games, why in [(tmp_path / "missing", "no ALFWorld game folder"), (tmp_path, "no playable ALFWorld game"),
                       ("", "set agent.games_dir, or ALFWORLD_DATA")]:
        assert evaluate.main([*base, f"agent.games_dir={games}"]) == 2
        assert why in capsys.readouterr().err
