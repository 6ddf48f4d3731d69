"""Log-probabilities of given tokens, with gradients, in one forward pass: a recorded trajectory's
actions under the current parameters (``ElasticMem.score``, the GRPO loss's input) and each
chunk's own text read back after its soft tokens by the frozen LM (``ElasticMem.reconstruction_logps``,
the reading warm-up's first stage, xRAG's).

    python -m pytest -q tests/unit/test_elasticmem.py tests/unit/test_warmup_reading.py
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from elasticmem.model.generation import read_only
from elasticmem.model.injection import Layout
from elasticmem.model.steps import Steps
from elasticmem.model.token_counts import right_pad
from elasticmem.model.trajectories import ScoreOutput, Trajectories


def target_logps(logps: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], H: torch.Tensor,
                 answer_start: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor,
                 temperature: float = 1.0) -> torch.Tensor:
    """[N, T] log-probs of the right-aligned target tokens ``targets`` [N, T] at ``temperature``
    (0 at t >= ``lengths`` [N]); ``H`` [N, L, d] final states, ``answer_start`` [N] (``assemble``'s).
    ``logps(states [N, T, d], targets [N, T], temperature) -> [N, T]``: the model's ``_token_logps``."""
    N, T = targets.shape
    device = H.device
    # target token t sits at answer_start + t and is predicted from the position before it
    t_idx = torch.arange(T, device=device)
    pos = (answer_start[:, None] - 1 + t_idx[None, :]).clamp(max=H.shape[1] - 1)
    logp = logps(H[torch.arange(N, device=device)[:, None], pos], targets, temperature)
    valid = t_idx[None, :] < lengths.to(device)[:, None]
    return torch.where(valid, logp, torch.zeros_like(logp))


def reconstruction_targets(rows: Sequence[int], chunk_ids: Callable[[int], list[int]], eos: int) -> list[list[int]]:
    """Each bank row's chunk tokens and then ``eos``: the text its soft tokens should give back."""
    return [chunk_ids(int(r)) + [eos] for r in rows]


def trajectory_layouts(model: Steps, traj: Trajectories, answers: Sequence[Sequence[int]]) -> list[Layout]:
    """``ElasticMem.trajectory_layouts``: each trajectory's input as recorded, ``answers[i]`` to read."""
    soft, _ = model._soft_tokens(traj.rows, traj.budgets)
    control = traj.control.tolist()
    return [Layout(traj.prompt_ids[i], None if control[i] < 0 else control[i], soft[i], traj.suffix_ids[i],
                   list(answers[i]))
            for i in range(len(traj.example_ids))]


def score(model: Steps, traj: Trajectories) -> ScoreOutput:
    """``ElasticMem.score``: every recorded action's log-probs under the current parameters."""
    device, mode = model.device, model.cfg.retrieval
    N = len(traj.example_ids)
    answers = [traj.answer_ids[i][traj.answer_mask[i]].tolist() for i in range(N)]
    x = model._assemble(trajectory_layouts(model, traj, answers))
    H, _ = model._forward_hidden(**read_only(x).forward_kwargs(), use_cache=False)
    ar = torch.arange(N, device=device)
    if mode == "control":
        logp_control = model._token_logps(H[ar, x.query_pos - 1], traj.control, traj.control_temperature)
    else:
        logp_control = torch.zeros(N, device=device)
    own_state = mode in ("control", "query_only")
    h_query = H[ar, x.query_pos].float() if own_state else None
    h = h_query if own_state else traj.query_state.to(device)
    if model.cfg.detach_policy_inputs:
        h = h.detach()
    logp_b, ent_b = model._allocate(h, traj.rows, traj.scores, traj.mask, traj.greedy, traj.budgets)
    logp_ans = target_logps(model._token_logps, H, x.answer_start, traj.answer_ids, traj.answer_mask.sum(-1),
                            traj.answer_temperature)
    return ScoreOutput(logp_control, logp_b, ent_b, logp_ans, h_query)


def reconstruction_logps(model: Steps, rows: torch.Tensor, budgets: torch.Tensor, prompt: Sequence[int],
                         suffix: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``ElasticMem.reconstruction_logps``: (log-probs [n, T], mask [n, T]) of each row's chunk
    text and end-of-text token after ``prompt [its soft tokens] sep suffix``, adapter off."""
    soft, _ = model._soft_tokens(rows.reshape(-1, 1).cpu(), budgets.reshape(-1, 1).cpu())
    eos = model.tokenizer.eos_token_id if model.tokenizer.eos_token_id is not None else model.eos_ids[0]
    targets = reconstruction_targets(rows.reshape(-1).tolist(), model._chunk_ids, eos)
    x = model._assemble([Layout(list(prompt), None, soft[i], list(suffix), t) for i, t in enumerate(targets)])
    with model._decoder(disable_adapter=True):
        H, _ = model._forward_hidden(**x.forward_kwargs(), use_cache=False)
    # the padding is never read back: target_logps zeroes the positions past each row's length
    tgt, mask = right_pad(targets, 0)
    return target_logps(model._token_logps, H, x.answer_start, tgt, mask.sum(-1)), mask.to(H.device)
