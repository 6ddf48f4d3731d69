"""ALFWorld episodes in the evaluation harness: each game is one evaluated item, played to the end.

    python evaluate.py --config configs/alfworld_cpu.yaml                      # eval.task=alfworld
    python evaluate.py --config configs/alfworld.yaml eval.split=valid_seen,valid_unseen
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 evaluate.py --config ...

Every system of the QA harness (ElasticMem, no_memory, text_rag with the skill cards as text)
plays through the same ``MemorySystem.predict`` it answers questions with: at each step the
system gets one example built from the live game exactly as the imitation examples are built
from expert trajectories (``elasticmem.agent.imitation.step_fields``: the objective as the query,
the recent steps, the current observation and the admissible commands), answers greedily, and
the first line of its answer, snapped to the admissible commands (``snap_action``), is played.
An episode ends on a win, after ``agent.max_steps`` actions or after ``agent.timeout_s`` seconds
(model time included). Success is the engine's win. The query is the objective at every step, so
ElasticMem retrieves its cards and sets their budgets once per episode
(``ElasticMemSystem.reuse_retrieval``).

A game's record in ``predictions.jsonl`` is a QA record whose ``correct`` is the win, whose
``question_type`` is the split (so the report's per-type rows are the success rate per split
and its headline the success rate over all games, weighted by games), whose ``tokens`` are summed
over the episode's steps (#Tok of the whole episode; memory tokens count at every step they are
in the input) and whose ``retrieved`` are the memories of the first step, with their budgets;
``extra`` holds the trace: objective, task type, steps, and per step the raw output, the action
played and the observation. Resuming, multi-process sharing and refusing another evaluation's
folder are the QA runner's (``elasticmem.eval.runner``).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from elasticmem.agent.alfworld_env import AlfworldEnv, find_games
from elasticmem.agent.imitation import SKILLS_GROUP, step_fields
from elasticmem.config import AgentConfig
from elasticmem.data.schema import Example
from elasticmem.eval.system import MemorySystem, Prediction
from elasticmem.data.rewards import snap_action
from elasticmem.utils.common import sha256_file

WON = "won"
"""The gold 'answer' of every game."""


def games_folder(games_dir: str | Path, split: str) -> Path:
    """The folder of ``split``'s games: ``<games_dir>/json_2.1.1/<split>`` (ALFWorld's layout) if
    it exists, else ``<games_dir>/<split>`` (generated games); ``games_dir`` '' = $ALFWORLD_DATA."""
    root = str(games_dir) or os.environ.get("ALFWORLD_DATA", "")
    if not root:
        raise ValueError("no ALFWorld games: set agent.games_dir, or ALFWORLD_DATA (docs/alfworld.md)")
    base = Path(root).expanduser()
    alfworld = base / "json_2.1.1" / split
    return alfworld if alfworld.is_dir() else base / split


def game_examples(games_dir: str | Path, splits: Sequence[str]) -> tuple[list[Example], dict[str, Path]]:
    """One example per playable game of each split (``find_games``), and each example's game file.

    The example's id is ``<split>/<game id>``, its question type the split, its group the skill
    bank's; ``extra`` holds the game file's sha256 (a game changed since an evaluation is not
    resumed over), its task type and its split. The paths stay outside the example, so a data
    folder moved elsewhere still resumes."""
    if not splits:
        raise ValueError("no split to evaluate: eval.split names one or more, e.g. valid_seen,valid_unseen")
    examples, paths = [], {}
    for split in splits:
        for game in find_games(games_folder(games_dir, split)):
            ex_id = f"{split}/{game.game_id}"
            examples.append(Example(
                id=ex_id, source="alfworld", question=f"ALFWorld game {game.game_id}", choices=[], answer_index=-1,
                question_type=split, history=[], group=SKILLS_GROUP, answer_text=WON,
                extra={"game_sha256": sha256_file(game.path), "task_type": game.task_type, "split": split}))
            paths[ex_id] = game.path
    return examples, paths


def step_example(episode_id: str, step: int, objective: str, task_type: str, fields: dict[str, Any]) -> Example:
    """What a system answers at one step: built like an imitation example (no expert action)."""
    return Example(id=f"{episode_id}#{step}", source="alfworld", question=objective, choices=[], answer_index=-1,
                   question_type=task_type, history=[], group=SKILLS_GROUP, extra=fields)


def play_episode(system: MemorySystem, episode_id: str, game_file: str | Path, agent: AgentConfig) -> Prediction:
    """Play one game greedily with ``system``; the episode as one ``Prediction`` (module docstring)."""
    env = AlfworldEnv(game_file, expert=False, max_steps=agent.max_steps, timeout_s=agent.timeout_s, seed=agent.seed)
    reuse = getattr(system, "reuse_retrieval", contextlib.nullcontext)
    tokens: Counter[str] = Counter()
    latency: Counter[str] = Counter()
    trace: list[dict[str, str]] = []
    past: list[tuple[str, str]] = []
    retrieved = None
    try:
        with reuse():
            obs = env.reset()
            while not obs.done:
                fields = step_fields(past, obs.text, obs.admissible, agent.window, agent.max_chars)
                ex = step_example(episode_id, len(past), env.objective, env.task_type, fields)
                (pred,) = system.predict([ex])
                action = snap_action(pred.text, obs.admissible)
                obs = env.step(action)
                trace.append({"output": pred.text, "action": action, "observation": obs.text})
                past.append((action, obs.text))
                tokens.update(prompt=pred.prompt_tokens, memory=pred.memory_tokens, generated=pred.generated_tokens)
                latency.update(pred.latency)
                if retrieved is None:
                    retrieved = pred.retrieved
    finally:
        env.close()
    outcome = WON if obs.won else ("lost: step limit" if env.steps >= agent.max_steps else "lost: time limit")
    return Prediction(
        id=episode_id, text=outcome, prompt_tokens=tokens["prompt"], memory_tokens=tokens["memory"],
        generated_tokens=tokens["generated"], retrieved=list(retrieved or []), latency=dict(latency),
        extra={"won": bool(obs.won), "steps": env.steps, "objective": env.objective, "task_type": env.task_type,
               "trace": trace},
    )


def episode_outcome(pred: Prediction, ex: Example) -> tuple[str, bool]:
    """The runner's scorer for episodes: gold 'won', correct when the game was won."""
    return WON, bool(pred.extra["won"])


class EpisodePlayer:
    """A ``MemorySystem`` whose examples are games: ``predict`` plays each one with ``system``."""

    def __init__(self, system: MemorySystem, games: dict[str, Path], agent: AgentConfig):
        self.system, self.games, self.agent = system, dict(games), agent
        self.name = system.name
        self.model = getattr(system, "model", None)
        if self.model is not None and self.model.cfg.top_z != 0 and SKILLS_GROUP not in self.model.bank.groups:
            from elasticmem.bank import BankError

            raise BankError(f"bank {self.model.bank.root} has no skill cards (group {SKILLS_GROUP!r}): build it from "
                            "the imitation data (python -m elasticmem.agent.imitation, then build_bank.py)")

    def identity(self) -> dict[str, Any]:
        """The system's identity and the episode settings (every field of ``agent`` but the folder)."""
        episode = {k: v for k, v in asdict(self.agent).items() if k != "games_dir"}
        return {**self.system.identity(), "task": "alfworld", "episode": episode}

    def predict(self, examples: Sequence[Example]) -> list[Prediction]:
        return [play_episode(self.system, ex.id, self.games[ex.id], self.agent) for ex in examples]
