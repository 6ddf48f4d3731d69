"""Imitation examples for GRPO on ALFWorld: one example per expert step, over a bank of skill cards.

    python -m elasticmem.agent.imitation --trajectories runs/alfworld/trajectories.jsonl \
        --pools runs/alfworld/pools --cards runs/alfworld/cards.jsonl --out runs/data/alfworld

Writes ``train.jsonl`` and ``val.jsonl`` (held-out steps, default 5 %) in the data format every
other command reads. Each example is one step of an imitation-pool trajectory (reference code):
the question is the task objective (so retrieval gives the same cards at every step of an
episode), the expert's action is ``answer_text``, the admissible commands are
``extra["admissible_commands"]`` (the ``snapped_action`` reward snaps the answer to them), and
the step's text fields fill ``memory.suffix_template`` (``ALFWORLD_SUFFIX``): ``{recent}`` the
last ``window`` (action, observation) pairs as ACTION / OBSERVATION lines, cut to ``max_chars``
characters from the oldest end; ``{observation}`` the current observation; ``{commands}`` the
admissible commands, one a line. Every example shares one bank group whose history is the skill
cards, one memory each, so the bank builder encodes the cards once. Episode evaluation builds
the same fields from the live game with ``step_fields``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any, Sequence

from elasticmem.agent.trajectories import read_records
from elasticmem.data.schema import Example, Turn, write_examples

SKILLS_GROUP = "alfworld_skills"
ALFWORLD_SUFFIX = (
    "\n\nRecent steps:\n{recent}\n\nCurrent observation:\n{observation}\n\nAdmissible commands:\n{commands}\n\n"
    "Reply with exactly one admissible command for the next step.\nAction:"
)


def recent_steps(past: Sequence[tuple[str, str]], window: int = 5, max_chars: int = 4000) -> str:
    """The last ``window`` (action, observation) pairs as ``ACTION:`` / ``OBSERVATION:`` lines,
    cut to the last ``max_chars`` characters; "(none)" before the first action."""
    if window < 0 or max_chars < 1:
        raise ValueError(f"window must be >= 0 and max_chars >= 1, got {window}, {max_chars}")
    pairs = list(past)[-window:] if window else []
    text = "\n".join(f"ACTION: {a}\nOBSERVATION: {o}" for a, o in pairs)
    return text[-max_chars:] if text else "(none)"


def step_fields(past: Sequence[tuple[str, str]], observation: str, admissible: Sequence[str],
                window: int = 5, max_chars: int = 4000) -> dict[str, Any]:
    """The extra fields of one step: ``recent``, ``observation``, ``commands`` (for the suffix
    template) and ``admissible_commands`` (for the reward)."""
    return {"recent": recent_steps(past, window, max_chars), "observation": observation,
            "commands": "\n".join(admissible), "admissible_commands": list(admissible)}


def cards_history(cards: Sequence[dict[str, Any]]) -> list[list[Turn]]:
    """The skill cards as a history: one session per card holding one memory turn (its retrieval
    text), so that each card is one chunk of the bank."""
    if not cards:
        raise ValueError("no skill cards: the imitation examples need a card bank to retrieve from")
    return [[Turn("memory", c["text"])] for c in cards]


def trajectory_examples(record: dict[str, Any], history: list[list[Turn]], window: int = 5,
                        max_chars: int = 4000) -> list[Example]:
    """One example per step of an expert trajectory."""
    out, past = [], []
    observation = record["observation"]
    for i, step in enumerate(record["steps"]):
        extra = step_fields(past, observation, step["admissible"], window, max_chars)
        extra.update(game_id=record["game_id"], step=i)
        out.append(Example(id=f"{record['game_id']}#{i}", source="alfworld", question=record["objective"],
                           choices=[], answer_index=-1, question_type=record["task_type"], history=history,
                           group=SKILLS_GROUP, answer_text=step["action"], extra=extra))
        past.append((step["action"], step["observation"]))
        observation = step["observation"]
    return out


def imitation_examples(records: Sequence[dict[str, Any]], ids: Sequence[str], cards: Sequence[dict[str, Any]],
                       heldout: float = 0.05, seed: int = 42, window: int = 5,
                       max_chars: int = 4000) -> tuple[list[Example], list[Example]]:
    """(train, held-out) step examples of the trajectories ``ids``: every step of every one, a
    ``heldout`` fraction of the steps drawn with ``seed`` (at least one when there are two or
    more steps) held out for step accuracy."""
    if not 0.0 <= heldout < 1.0:
        raise ValueError(f"heldout must be in [0, 1), got {heldout}")
    by_id = {r["game_id"]: r for r in records}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"{len(missing)} imitation ids have no trajectory, e.g. {missing[:3]}")
    history = cards_history(cards)
    steps = [ex for i in ids for ex in trajectory_examples(by_id[i], history, window, max_chars)]
    n_out = max(1, round(heldout * len(steps))) if heldout > 0 and len(steps) >= 2 else 0
    out = set(random.Random(seed).sample(range(len(steps)), n_out))
    return ([ex for k, ex in enumerate(steps) if k not in out], [ex for k, ex in enumerate(steps) if k in out])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m elasticmem.agent.imitation",
                                description="Per-step imitation examples over the skill-card bank.")
    p.add_argument("--trajectories", required=True)
    p.add_argument("--pools", required=True, help="folder with imitation_ids.txt (trajectories split)")
    p.add_argument("--cards", required=True, help="cards JSONL (python -m elasticmem.agent.skill_cards)")
    p.add_argument("--out", required=True, help="data folder: train.jsonl, val.jsonl")
    p.add_argument("--heldout", type=float, default=0.05, help="fraction of steps held out (val.jsonl)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--window", type=int, default=5, help="recent (action, observation) pairs in the prompt")
    p.add_argument("--max-chars", type=int, default=4000, help="character cap of the recent steps")
    a = p.parse_args(argv)
    ids = (Path(a.pools) / "imitation_ids.txt").read_text().split()
    cards = read_records(a.cards)
    train, val = imitation_examples(read_records(a.trajectories), ids, cards, a.heldout, a.seed, a.window, a.max_chars)
    out = Path(a.out)
    write_examples(out / "train.jsonl", train)
    write_examples(out / "val.jsonl", val)
    print(f"{out}: {len(train)} training and {len(val)} held-out steps of {len(ids)} trajectories, "
          f"over {len(cards)} skill cards", file=sys.stderr)


if __name__ == "__main__":
    main()
