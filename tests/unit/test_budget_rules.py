"""The simple budget rules (elasticmem.model.budget_modes, elasticmem.eval.budget_rules) against an
independent numpy computation, and the choices the ladder makes with them.

    python -m pytest -q tests/unit/test_budget_rules.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticmem.config import ConfigError, load_config
from elasticmem.eval.budget_rules import budget_vectors, choose_gap, derived_variants, pick_best
from elasticmem.model.budget_modes import fixed_budgets, is_fixed_mode, top_k_of


def _reference(mode: str, scores: np.ndarray, mask: np.ndarray, top: int, gap: float, cap: int | None) -> np.ndarray:
    out = np.zeros_like(scores, dtype=int)
    for i in range(scores.shape[0]):
        present = [j for j in range(scores.shape[1]) if mask[i, j]]
        if mode.startswith("top"):
            keep = present[: int(mode[3:])]
        else:
            best = max(scores[i, j] for j in present)
            keep = [j for j in present if scores[i, j] >= best - gap]
        left = np.inf if cap is None else cap
        for j in present:  # by rank
            if j in keep:
                out[i, j] = min(top, left)
                left -= out[i, j]
    return out


@pytest.mark.parametrize("mode", ["top1", "top2", "top3", "gap"])
@pytest.mark.parametrize("cap", [None, 5, 12])
def test_rules_equal_a_numpy_reference(mode, cap):
    rng = np.random.default_rng(0)
    N, Z, top, gap = 40, 5, 8, 0.1
    scores = -np.sort(-rng.uniform(0.2, 0.6, (N, Z)), axis=1)  # rank order: scores descending
    mask = np.ones((N, Z), dtype=bool)
    mask[::7, 3:] = False  # some rows retrieved fewer memories
    rows = torch.arange(N * Z).reshape(N, Z)
    got = fixed_budgets(mode, rows, torch.from_numpy(mask), top, cap, scores=torch.from_numpy(scores).float(),
                        score_gap=gap)
    want = _reference(mode, scores.astype(np.float32), mask, top, gap, cap)
    assert got.tolist() == want.tolist()
    if mode == "gap" and cap is None:  # the gap is not a disguised top-K: the number kept varies with the scores
        assert len(set((got > 0).sum(-1).tolist())) > 1


def test_gap_needs_scores_and_unknown_modes_are_refused():
    rows, mask = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="gap"):
        fixed_budgets("gap", rows, mask, 4, None)
    with pytest.raises(ValueError, match="unknown budget mode"):
        fixed_budgets("top0", rows, mask, 4, None)
    assert top_k_of("top12") == 12 and top_k_of("topx") is None and top_k_of("max") is None
    assert is_fixed_mode("top3") and is_fixed_mode("gap") and not is_fixed_mode("policy")


def test_eval_budgets_accepts_the_rules_and_refuses_others():
    assert load_config(None, ["eval.budgets=top2"]).eval.budgets == "top2"
    assert load_config(None, ["eval.budgets=gap", "memory.policy.score_gap=0.2"]).memory.policy.score_gap == 0.2
    for bad in ("top0", "topk", "best"):
        with pytest.raises(ConfigError, match="budgets"):
            load_config(None, [f"eval.budgets={bad}"])
    with pytest.raises(ConfigError, match="score_gap"):
        load_config(None, ["memory.policy.score_gap=-1"])


def test_choose_gap_and_pick_best():
    val = {0.0: {"accuracy": 0.5, "memory_tokens": 10}, 0.1: {"accuracy": 0.7, "memory_tokens": 30},
           0.2: {"accuracy": 0.7, "memory_tokens": 20}, 0.5: {"accuracy": 0.7, "memory_tokens": 20}}
    assert choose_gap(val) == 0.2  # most accurate, then fewest tokens, then the smaller gap
    rules = [{"name": "a", "accuracy": 0.6, "memory_tokens": 64}, {"name": "b", "accuracy": 0.5, "memory_tokens": 20},
             {"name": "c", "accuracy": 0.7, "memory_tokens": 128}]
    assert pick_best(rules, 64)["name"] == "a" and pick_best(rules, 30)["name"] == "b"
    assert pick_best(rules, 10) is None and pick_best(rules, float("inf"))["name"] == "c"
    var = derived_variants(0.1, 47.4, [16], top_z=4)
    assert var["rule_spread"] == ["eval.budgets=max", "memory.policy.token_cap=47"]
    assert set(var) == {"rule_gap", "rule_spread", "top1_cap16", "top2_cap16", "gap_cap16"}
    assert "top2_cap16" not in derived_variants(None, None, [16], top_z=2)


def test_budget_vectors_count_each_question():
    def rec(budgets, evidence=(), qtype="single_hop"):
        return {"question_type": qtype, "extra": {"evidence": {"rows": list(evidence)}},
                "retrieved": [{"rank": j, "ref": f"row:{10 + j}", "budget": b} for j, b in enumerate(budgets)]}

    records = [rec([64, 0, 0]), rec([64, 0, 0]), rec([64, 32, 0], (10, 11), "multi_hop"), rec([64, 0, 0], (10, 12))]
    v = budget_vectors(records)
    assert v["n"] == 4 and v["distinct"] == 2
    assert v["most_common"][0] == {"budgets": [64, 0, 0], "share": 0.75}
    assert v["memories_with_tokens"] == {"1": 0.75, "2": 0.25}
    assert v["two_evidence_questions"] == 2 and v["two_evidence_all_read"] == 0.5
    assert v["mean_by_rank"]["multi_hop"] == [64.0, 32.0, 0.0]
    assert budget_vectors([{"retrieved": []}]) is None
