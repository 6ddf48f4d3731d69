"""A batch's trajectories through ElasticMem's steps: the rollout (``ElasticMem.sample`` and
``greedy``: control token, retrieval, budgets, memories, generated answer) and teacher forcing
(``ElasticMem.teacher_forced``: the same up to the memories, with a given answer), recorded as
``Trajectories`` with the token bookkeeping of ``token_counts.py``.

    python -m pytest -q tests/unit/test_elasticmem.py tests/unit/test_warmup_reading.py
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from elasticmem.data.schema import Example
from elasticmem.model.generation import decode_answers
from elasticmem.model.injection import Layout
from elasticmem.model.steps import Rows, Steps
from elasticmem.model.token_counts import per_trajectory, query_index, right_pad, trajectory_tokens
from elasticmem.model.trajectories import Trajectories


def rollout(model: Steps, batch: Sequence[Example], G: int, temperature: float, greedy: bool,
            include_rows: Rows | None = None, budgets: str = "policy", memo: dict | None = None,
            memories: Rows | None = None, evidence: Rows | None = None) -> Trajectories:
    """G trajectories per example of ``batch``, sampled or greedy; the arguments are
    ``ElasticMem.greedy``'s (``memo`` keyed by each example's prompt ids and group)."""
    if not batch:
        raise ValueError("empty batch")
    if G < 1 or temperature <= 0:
        raise ValueError(f"group_size must be >= 1 and temperature > 0, got {G} and {temperature}")
    if memo is not None and not (greedy and G == 1 and include_rows is None and budgets == "policy"
                                 and memories is None):
        raise ValueError("memo is for greedy rollouts with the policy's budgets and the retrieved memories")
    if (memories is not None or evidence is not None) and G != 1:
        raise ValueError("memories and evidence are given per example: for greedy rollouts (G = 1)")
    t0 = time.perf_counter()
    keys = texts = None
    if memo is not None:
        texts = [model.encode_texts(ex) for ex in batch]
        keys = [(tuple(t[0]), ex.group) for t, ex in zip(texts, batch)]
    if keys is not None and all(k in memo for k in keys):
        prompts, suffixes, groups = [t[0] for t in texts], [t[1] for t in texts], [ex.group for ex in batch]
        a, logp_a, h, rows, scores, mask, budgets, logp_b, ent_b = (
            torch.cat(parts) for parts in zip(*(memo[k] for k in keys)))
        t1 = t2 = time.perf_counter()
    else:
        prompts, suffixes, groups, a, logp_a, h, rows, scores, mask = model._query_and_retrieve(batch, G, greedy,
                                                                                                texts)
        if memories is not None:
            rows, scores, mask = model._given(h, memories)
        rows, scores, mask = model._include(h, rows, scores, mask, include_rows)
        t1 = time.perf_counter()
        h_pol = h.detach() if model.cfg.detach_policy_inputs else h
        budgets, logp_b, ent_b = model._budgets(budgets, h_pol, rows, scores, mask, greedy, evidence=evidence)
        t2 = time.perf_counter()
        if keys is not None:
            for i, k in enumerate(keys):
                memo[k] = tuple(t[i : i + 1] for t in (a, logp_a, h, rows, scores, mask, budgets, logp_b, ent_b))
    soft, counts = model._soft_tokens(rows, budgets)
    prompt_ids, suffix_ids = per_trajectory(prompts, G), per_trajectory(suffixes, G)
    layouts = [Layout(p, None if c < 0 else c, m, s, [])
               for p, c, m, s in zip(prompt_ids, a.tolist(), soft, suffix_ids)]
    answer_ids, answer_mask, logp_ans = model._generate(model._assemble(layouts), temperature, greedy)
    t3 = time.perf_counter()
    num_tokens, memory_tokens = trajectory_tokens(prompt_ids, suffix_ids, a, counts, len(model.sep_ids), answer_mask)
    return Trajectories(
        example_ids=per_trajectory([ex.id for ex in batch], G), query_index=query_index(len(batch), G),
        prompt_ids=prompt_ids, suffix_ids=suffix_ids,
        groups=groups, control=a, rows=rows, scores=scores, mask=mask, budgets=budgets, soft_counts=counts,
        answer_ids=answer_ids, answer_mask=answer_mask,
        answers=decode_answers(model.tokenizer, answer_ids, answer_mask, model.eos_ids),
        logp_control=logp_a, logp_budget=logp_b, entropy_budget=ent_b, logp_answer=logp_ans,
        query_state=h.detach().cpu(), answer_temperature=1.0 if greedy else temperature,
        control_temperature=1.0 if greedy else model.cfg.control_temperature, greedy=greedy,
        num_tokens=num_tokens, memory_tokens=memory_tokens,
        timings={"retrieval": t1 - t0, "policy": t2 - t1, "generation": t3 - t2},
        budget_actions=model.cfg.injection == "latent",
    )


def teacher_forced(model: Steps, batch: Sequence[Example], answers: Sequence[Sequence[int]],
                   include_rows: Rows | None = None, budgets: str = "policy",
                   generator: torch.Generator | None = None) -> Trajectories:
    """One trajectory per example whose answer is ``answers[i]`` (token ids); the arguments are
    ``ElasticMem.teacher_forced``'s."""
    if len(answers) != len(batch):
        raise ValueError(f"{len(batch)} examples but {len(answers)} answers")
    prompts, suffixes, groups, a, logp_a, h, retrieved, scores, mask = model._query_and_retrieve(batch, 1, True)
    rows, scores, mask = model._include(h, retrieved, scores, mask, include_rows)
    N, Z = rows.shape
    b, logp_b, ent_b = model._budgets(budgets, h.detach(), rows, scores, mask, False, generator, include_rows)
    _, counts = model._soft_tokens(rows, b) if Z else (None, torch.zeros(N, 0, dtype=torch.long))
    answer_ids, answer_mask = right_pad(answers, model.tokenizer.pad_token_id)
    num_tokens, memory_tokens = trajectory_tokens(prompts, suffixes, a, counts, len(model.sep_ids), answer_mask)
    return Trajectories(
        example_ids=[ex.id for ex in batch], query_index=query_index(N, 1), prompt_ids=prompts,
        suffix_ids=suffixes, groups=groups, control=a, rows=rows, scores=scores, mask=mask, budgets=b,
        soft_counts=counts, answer_ids=answer_ids, answer_mask=answer_mask,
        answers=[model.tokenizer.decode(t, skip_special_tokens=True).strip() for t in answers],
        logp_control=logp_a, logp_budget=logp_b, entropy_budget=ent_b, logp_answer=torch.zeros(answer_ids.shape),
        query_state=h.detach().cpu(), answer_temperature=1.0, control_temperature=1.0, greedy=False,
        num_tokens=num_tokens, memory_tokens=memory_tokens, budget_actions=model.cfg.injection == "latent",
        retrieved_rows=retrieved,
    )
