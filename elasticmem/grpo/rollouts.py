"""A rollout step's trajectories outside the model: reward shaping, record and replay, the logged sample.

``record_rollouts`` writes every process's sampled batch per step; ``replay_rollouts``
reads them back instead of sampling, whatever the number of processes that recorded them
(the distributed tests train 1 and 2 processes on the same trajectories this way).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from safetensors.torch import load_file, save_file

from elasticmem.data.schema import Example
from elasticmem.model.trajectories import Trajectories

if TYPE_CHECKING:
    from elasticmem.config import TrainConfig


def token_cost(rewards: torch.Tensor, memory_tokens: torch.Tensor, cost: float) -> torch.Tensor:
    """Rewards [N] minus ``cost`` per injected soft token where the reward is positive.

    Only rewarded trajectories pay: while no answer is right yet, memory is not made to look
    worse than none (which would teach the policy to drop everything before the reasoner has
    learned to read); once answers are right, the same answer with fewer tokens is better.
    """
    if not cost:
        return rewards
    return rewards - cost * memory_tokens.to(rewards) * (rewards > 0)


def sample_rollouts(step: int, traj: Trajectories, batch: Sequence[Example], rewards: torch.Tensor, core,
                    t: TrainConfig) -> list[dict[str, Any]]:
    """The first ``t.log_rollouts`` trajectories of the step as rollouts.jsonl rows (``rewards`` [N])."""
    out = []
    for i in range(min(t.log_rollouts, len(traj))):
        ex = batch[int(traj.query_index[i])]
        out.append({
            "step": step, "id": ex.id, "question": ex.question, "gold": ex.answer_letter,
            "answer": traj.answers[i], "reward": float(rewards[i]),
            "control": core.tokenizer.decode([int(traj.control[i])]) if traj.control[i] >= 0 else None,
            "rows": traj.rows[i].tolist(), "budgets": traj.budgets[i].tolist(),
        })
    return out


def save_rollout(root: Path, step: int, rank: int, traj: Trajectories) -> None:
    """Record one process's rollout batch (tensors as safetensors, the rest as JSON)."""
    root.mkdir(parents=True, exist_ok=True)
    items = vars(traj).items()
    save_file({k: v.contiguous() for k, v in items if isinstance(v, torch.Tensor)},
              root / f"step{step:06d}_rank{rank}.safetensors")
    (root / f"step{step:06d}_rank{rank}.json").write_text(
        json.dumps({k: v for k, v in items if not isinstance(v, torch.Tensor)}))


def load_rollout(root: Path, step: int, rank: int, world: int, batch: Sequence[Example]) -> Trajectories:
    """This process's share of a recorded rollout batch, whatever the number of processes that recorded it.

    The recorded files of the step are joined in process order; queries are then dealt
    out in the same global order the sampler uses, so ``world`` processes with batch B
    replay what one process with batch ``world * B`` recorded (and vice versa).
    """
    files = sorted(root.glob(f"step{step:06d}_rank*.safetensors"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    if not files:
        raise FileNotFoundError(f"no recorded rollout for step {step} in {root}")
    parts = [Trajectories(**load_file(str(p)), **json.loads(p.with_suffix(".json").read_text())) for p in files]
    allt = Trajectories.concat(parts)
    B = len(batch)
    ids = (allt.query_index >= rank * B) & (allt.query_index < (rank + 1) * B)
    mine = allt.select(ids.nonzero().reshape(-1))
    mine.query_index = mine.query_index - rank * B
    got = [mine.example_ids[i] for i in range(0, len(mine), max(1, len(mine) // B))]
    if got != [ex.id for ex in batch]:
        raise ValueError(f"recorded rollout of step {step} is for other queries ({got[:2]}...) than "
                         f"this run draws ({[ex.id for ex in batch][:2]}...): seed or batch size differ")
    return mine
