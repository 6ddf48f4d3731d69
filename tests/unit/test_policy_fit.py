"""The budget policy's fit on cached retrieval sets (elasticmem.warmup.budget): the cached inputs are
the ones a greedy rollout gives the policy, and the fit learns an allocation its features allow.

    python -m pytest -q tests/unit/test_policy_fit.py
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT

from elasticmem.config import BudgetPolicyConfig, load_config
from elasticmem.model.budget_policy import BudgetPolicy
from elasticmem.warmup.budget import PolicySets, argmax_budgets, budget_targets, fit_policy, policy_sets, prefix_mask


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import build_bank
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic
    from elasticmem.systems import build_system

    root = tmp_path_factory.mktemp("policy_fit")
    cfg = load_config(ROOT / "configs/tiny_mechanism.yaml",
                      [f"data.dir={root}/data", f"bank.dir={root}/bank", "data.synthetic.num_histories=12"])
    write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    examples = {s: load_split(cfg.data.dir, s) for s in ("train", "val", "test")}
    build_bank(examples, load_backbone(cfg.backbone), cfg.chunking, cfg.bank, torch.float32, show_progress=False)
    return build_system(cfg).model, examples["train"]


def test_cached_sets_are_the_rollouts_policy_inputs(tiny_model):
    from elasticmem.eval.retrieval import evidence_rows

    model, examples = tiny_model
    model.eval()
    ev = {ex.id: evidence_rows(ex, model.bank) for ex in examples}
    sets = policy_sets(model, examples, ev, batch_size=5)
    with torch.no_grad():
        traj = model.greedy(examples)  # one batch: batched sets equal it
    assert torch.equal(sets.mask, traj.mask.cpu())
    assert torch.allclose(sets.h, traj.query_state.float().cpu(), atol=1e-5)
    assert torch.allclose(sets.scores, traj.scores.float().cpu(), atol=1e-5)
    assert torch.allclose(sets.keys, model._policy_inputs(traj.query_state, traj.rows).float().cpu(), atol=1e-6)
    for i, ex in enumerate(examples):
        assert [bool(int(r) in ev[ex.id]) for r in traj.rows[i].tolist()] == sets.evidence[i].tolist()
    # the policy's greedy budgets on the cached sets are the rollout's
    b = model.policy.sample(sets.h, sets.keys, sets.scores, sets.mask, greedy=True).budgets
    assert torch.equal(b, traj.budgets.cpu())


def test_prefix_mask_keeps_a_rank_prefix():
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(200, 5, dtype=torch.bool)
    mask[::3, 4] = False
    cut = prefix_mask(mask, gen)
    assert not (cut & ~mask).any() and cut[:, 0].all()
    kept = cut.long()
    assert torch.equal(kept, kept.cummin(-1).values * mask)  # no slot kept after a dropped one (among present)
    assert len(set(cut.sum(-1).tolist())) == 5


@pytest.mark.parametrize("fallback", [False, True])
def test_targets_name_the_present_evidence_or_fall_back_to_the_top_memory(fallback):
    gen = torch.Generator().manual_seed(3)
    evidence = torch.rand(200, 5, generator=gen) < 0.2
    mask = prefix_mask(torch.ones(200, 5, dtype=torch.bool), gen)
    target, positive = budget_targets(evidence, mask, 8, 1, fallback_top1=fallback)
    for n in range(200):  # one set at a time, as the docstring says
        named = [bool(evidence[n, z] and mask[n, z]) for z in range(5)]
        if fallback and not any(named):
            named[0] = bool(mask[n, 0])
        assert positive[n].tolist() == named
        assert target[n].tolist() == [8 if p else 1 for p in named]
    assert bool((~mask & positive).any()) is False


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_learns_an_allocation_its_features_allow(seed):
    """Evidence marked by a direction of the key (h * k large), at any rank and 1 or 2 per set:
    the fitted policy's argmax gives B_max to every evidence slot and 0 to the others on held-out
    sets, where the untrained policy does not."""
    g = torch.Generator().manual_seed(seed)
    N, Z, d, top = 600, 4, 16, 8

    def make(n):
        h = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=-1)
        keys = torch.nn.functional.normalize(torch.randn(n, Z, d, generator=g), dim=-1)
        ev = torch.zeros(n, Z, dtype=torch.bool)
        for i in range(n):
            for j in torch.randperm(Z, generator=g)[: 1 + int(torch.rand(1, generator=g) < 0.5)]:
                ev[i, j] = True
                keys[i, j] = torch.nn.functional.normalize(h[i] + 0.3 * keys[i, j], dim=0)
        scores = (keys * h[:, None]).sum(-1)
        return PolicySets(h, keys, scores, torch.ones(n, Z, dtype=torch.bool), ev)

    train, held = make(N), make(200)
    torch.manual_seed(seed)
    policy = BudgetPolicy(BudgetPolicyConfig(max_budget=top, d_model=32, num_heads=2, num_layers=1, dropout=0.0), d)
    before = argmax_budgets(policy, held)
    history = fit_policy(policy, train, epochs=60, lr=3e-3, batch_size=32, max_budget=top, augment_z=False,
                         generator=torch.Generator().manual_seed(seed))
    after = argmax_budgets(policy, held)
    assert history[-1]["loss"] < history[0]["loss"]
    assert after["evidence_all_read"] >= 0.95 and after["budget/evidence"] >= 0.95 * top
    assert after["budget/other"] <= 0.05 * top
    assert not (before["evidence_all_read"] >= 0.95 and before["budget/other"] <= 0.05 * top)


def test_cross_fitted_sets_never_retrieve_through_a_map_trained_on_their_history(tiny_model, tmp_path, monkeypatch):
    """Each fold's sets come through a map trained on the other folds' histories only; the model
    keeps its own map afterwards; and the sets are those the fold's map retrieves."""
    from elasticmem.eval.retrieval import evidence_rows
    from elasticmem.model.retrieval_map import MappedIndex
    from elasticmem.warmup import budget, retrieval_map
    from elasticmem.warmup.retrieval_map import MapTrainConfig, query_states, train_map, training_pairs

    model, examples = tiny_model
    model.eval()
    kept, positives, ranges, _ = training_pairs(examples, model.bank)
    keys = model.bank.keys().float().clone()
    settings = MapTrainConfig(kind="linear", epochs=2, d_out=16, batch_size=8)
    own_map = train_map(query_states(model, kept), positives, ranges, keys, settings)
    path = own_map.save(tmp_path / "map.safetensors", model.cfg.retrieval, model.bank.key,
                        {"name_or_path": model.backbone_name, "fingerprint": model.fingerprint},
                        {"settings": {"kind": "linear", "epochs": 2, "d_out": 16, "batch_size": 8}})
    own_index = model.mapped_index
    group_of = {tuple(p): ex.group for ex, p in zip(kept, positives)}
    trained_on: list[set[str]] = []

    def recording(queries, pos, rng, k, cfg, log=None):
        trained_on.append({group_of[tuple(p)] for p in pos})
        return train_map(queries, pos, rng, k, cfg, log)

    monkeypatch.setattr(retrieval_map, "train_map", recording)
    ev = {ex.id: evidence_rows(ex, model.bank) for ex in examples}
    sets = budget.cross_fitted_sets(model, kept, ev, folds=3, map_path=str(path), seed=0)
    assert model.mapped_index is own_index and len(sets) == len(kept) and len(trained_on) == 3
    groups = {ex.group for ex in kept}
    held = [groups - t for t in trained_on]
    assert all(h for h in held) and set.union(*held) == groups and sum(len(h) for h in held) == len(groups)
    # fold 0's sets equal a retrieval through a map trained, independently, on the other folds
    fold0 = [ex for ex in kept if ex.group in held[0]]
    fit = [i for i, ex in enumerate(kept) if ex.group not in held[0]]
    rmap = train_map(query_states(model, kept)[fit], [positives[i] for i in fit], [ranges[i] for i in fit], keys,
                     MapTrainConfig(kind="linear", epochs=2, d_out=16, batch_size=8, seed=0))
    model.mapped_index = MappedIndex(model.bank, rmap)
    try:
        want = budget.policy_sets(model, fold0, ev)
    finally:
        model.mapped_index = own_index
    assert torch.allclose(sets.scores[: len(fold0)], want.scores, atol=1e-5)
    assert torch.equal(sets.evidence[: len(fold0)], want.evidence)


def test_the_warmups_policy_fit_equals_the_stage_run_on_its_checkpoint(tmp_path):
    """warmup.policy_epochs > 0 in the reading warm-up gives the policy that
    ``python -m elasticmem.warmup.budget`` gives from the same warm-up run without it."""
    from safetensors.torch import load_file

    from elasticmem.warmup import budget
    from test_warmup_reading import _tiny_warmups

    base = [f"data.dir={tmp_path}/data", f"bank.dir={tmp_path}/bank", "data.synthetic.num_histories=12",
            "warmup.steps=2", "warmup.batch_size=4", "warmup.budget_weight=1.0", "warmup.eval_split=",
            "warmup.policy_lr=0.01"]
    run = _tiny_warmups(tmp_path, base)
    run("plain")
    run("fitted", "warmup.policy_epochs=3")
    fit = json.loads((tmp_path / "fitted" / "policy_fit.json").read_text())
    assert len(fit["epochs"]) == 3 and fit["train_sets"] > 0
    assert budget.main(["--config", str(ROOT / "configs/tiny_mechanism.yaml"), *base,
                        f"eval.checkpoint={tmp_path / 'plain' / 'final'}", f"warmup.output_dir={tmp_path / 'stage'}",
                        "warmup.policy_epochs=3"]) == 0
    plain, fitted, stage = (load_file(str(tmp_path / d / "final" / "budget_policy.safetensors"))
                            for d in ("plain", "fitted", "stage"))
    assert any(not torch.equal(plain[k], fitted[k]) for k in plain)  # the fit moved the policy
    for k in fitted:
        assert torch.allclose(fitted[k], stage[k], atol=1e-6), k
