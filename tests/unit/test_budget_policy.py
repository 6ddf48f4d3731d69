"""Tests of the elastic budget policy (elasticmem.model.budget_policy).

Run with::

    pytest tests/unit/test_budget_policy.py
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from elasticmem.model.budget_policy import (
    LEARNED_VARIANTS,
    VARIANTS,
    BudgetPolicy,
    BudgetPolicyConfig,
)
from elasticmem.utils.configuration import field_docs

D = 16  # hidden size of the query state and keys
Z = 6
SMALL = dict(d_model=32, num_heads=4, num_layers=2, max_budget=7)
FIXED_VARIANTS = tuple(v for v in VARIANTS if v not in LEARNED_VARIANTS)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # these tensors are tiny: with other jobs on the 2 cores, a second intra-op thread spin-waits
    # for its partner and makes each encoder pass ~40x slower than the math it splits
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_policy(variant: str, seed: int = 0, **overrides) -> BudgetPolicy:
    torch.manual_seed(seed)
    return BudgetPolicy(BudgetPolicyConfig(variant=variant, **{**SMALL, **overrides}), D).eval()


def make_inputs(n: int = 5, seed: int = 0):
    """Query states, unit keys, cosine scores and a mask with trailing, inner and all-absent rows."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, D, generator=g)
    keys = F.normalize(torch.randn(n, Z, D, generator=g), dim=-1)
    scores = torch.einsum("nd,nzd->nz", F.normalize(h, dim=-1), keys)
    mask = torch.ones(n, Z, dtype=torch.bool)
    mask[1, 4:] = False  # fewer than Z memories retrieved
    mask[2] = False  # nothing retrieved
    mask[3, [0, 2]] = False  # holes anywhere
    return h, keys, scores, mask


def garbage_at_masked(keys, scores, mask, seed: int, value: float | None = None):
    """Copies of keys/scores whose masked slots hold different garbage (random, or ``value``)."""
    g = torch.Generator().manual_seed(seed)
    k_noise = torch.randn(keys.shape, generator=g) * 50 if value is None else torch.full(keys.shape, value)
    s_noise = torch.randn(scores.shape, generator=g) * 50 if value is None else torch.full(scores.shape, value)
    return (torch.where(mask[..., None], keys, k_noise), torch.where(mask, scores, s_noise))


def sample(policy, inputs, seed: int = 0, greedy: bool = False):
    return policy.sample(*inputs, greedy=greedy, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ config


def test_config_fields_documented():
    docs = field_docs(BudgetPolicyConfig)
    missing = [f.name for f in dataclasses.fields(BudgetPolicyConfig) if not docs.get(f.name)]
    assert not missing


@pytest.mark.parametrize("bad", [
    dict(variant="lstm"), dict(min_budget=-1), dict(min_budget=5, max_budget=4), dict(d_model=30, num_heads=4),
    dict(num_layers=0), dict(dropout=1.0), dict(max_rank=0), dict(uniform_budget=21),
    dict(min_budget=1, uniform_budget=0), dict(min_budget=2, clip_budget=1),
])
def test_config_rejects(bad):
    with pytest.raises(ValueError):
        BudgetPolicyConfig(**bad)


def test_config_ignores_encoder_settings_for_mlp():
    assert BudgetPolicyConfig(variant="mlp", d_model=30, num_heads=4).num_classes == 21


# ------------------------------------------------------------------ every variant


@pytest.mark.parametrize("min_budget", [0, 1])
@pytest.mark.parametrize("variant", VARIANTS)
def test_sample_ranges_and_masked_slots(variant, min_budget):
    policy = make_policy(variant, min_budget=min_budget)
    h, keys, scores, mask = make_inputs(n=40)
    mask[5:, 3] = False
    for greedy in (False, True):
        out = sample(policy, (h, keys, scores, mask), greedy=greedy)
        assert out.budgets.dtype == torch.long and out.budgets.shape == (40, Z)
        present = out.budgets[mask]
        assert present.min() >= min_budget and present.max() <= 7
        for field in out:
            assert not torch.isnan(field.float()).any()
            assert (field[~mask] == 0).all()
        assert out.log_prob.dtype == out.entropy.dtype == torch.float32


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_log_prob_reproduces_sample(variant, greedy):
    policy = make_policy(variant)
    inputs = make_inputs()
    out = sample(policy, inputs, greedy=greedy)
    log_prob, entropy = policy.log_prob(*inputs, out.budgets)
    torch.testing.assert_close(log_prob, out.log_prob, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, out.entropy, atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", LEARNED_VARIANTS)
def test_samples_follow_the_policy_probabilities(variant):
    """Chi-square goodness of fit: the budgets drawn for the first two slots of one query, over
    8000 draws, against the joint law the policy's logits define: softmax of slot 0 times softmax
    of slot 1 (given slot 0's budget for the autoregressive variant, the logits it is scored with).
    min_budget 1, so class c must become budget c + 1. Cells expected fewer than 5 times are
    pooled; a fixed seed keeps the test deterministic. About 1 s of CPU each."""
    from scipy.stats import chisquare

    n, min_budget = 8000, 1
    policy = make_policy(variant, min_budget=min_budget)
    h, keys, scores, mask = (t[:1].expand(n, *t.shape[1:]) for t in make_inputs())
    drawn = sample(policy, (h, keys, scores, mask), seed=11).budgets
    levels = torch.arange(min_budget, SMALL["max_budget"] + 1)
    k = len(levels)
    with torch.no_grad():
        first = torch.softmax(policy.logits(h[:1], keys[:1], scores[:1], mask[:1],
                                            prev_budgets=torch.zeros(1, Z, dtype=torch.long) + min_budget)[0, 0], -1)
        prev = torch.zeros(k, Z, dtype=torch.long) + min_budget
        prev[:, 0] = levels  # slot 1 given each possible budget of slot 0
        second = torch.softmax(policy.logits(h[:k], keys[:k], scores[:k], mask[:k], prev_budgets=prev)[:, 1], -1)
    expected = n * (first[:, None] * second).double().reshape(-1)  # cell (b0, b1) -> index k * c0 + c1
    cells = (drawn[:, 0] - min_budget) * k + (drawn[:, 1] - min_budget)
    counts = torch.bincount(cells, minlength=k * k).double()
    assert counts.sum() == n and (drawn[:, :2] >= min_budget).all()
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if not bool(big.all()):  # the rare cells pooled into one
        obs, exp = torch.cat([obs, counts[~big].sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
    assert int(big.sum()) >= 10, "the test needs a spread distribution to have power"
    stat, p_value = chisquare(obs.numpy(), exp.numpy() * (n / float(exp.sum())))  # sums equal up to rounding
    assert p_value > 1e-3, f"{variant}: budgets are not drawn from softmax(logits): chi2={stat:.1f}, " \
                           f"{len(obs) - 1} dof, p={p_value:.2g}"


@pytest.mark.parametrize("value", [None, float("nan"), float("inf")])
@pytest.mark.parametrize("variant", VARIANTS)
def test_masked_slots_do_not_leak(variant, value):
    policy = make_policy(variant)
    h, keys, scores, mask = make_inputs()
    keys2, scores2 = garbage_at_masked(keys, scores, mask, seed=1, value=value)
    a = sample(policy, (h, keys, scores, mask))
    b = sample(policy, (h, keys2, scores2, mask))
    assert torch.equal(a.budgets, b.budgets)
    torch.testing.assert_close(a.log_prob, b.log_prob, atol=1e-6, rtol=0)
    lp2, ent2 = policy.log_prob(h, keys2, scores2, mask, a.budgets)
    torch.testing.assert_close(lp2, a.log_prob, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent2, a.entropy, atol=1e-6, rtol=0)
    assert not torch.isnan(lp2).any() and not torch.isnan(ent2).any()
    if variant in LEARNED_VARIANTS:
        la = policy.logits(h, keys, scores, mask, prev_budgets=a.budgets)
        lb = policy.logits(h, keys2, scores2, mask, prev_budgets=a.budgets)
        torch.testing.assert_close(la[mask], lb[mask], atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_trailing_padding_equals_a_shorter_set(variant):
    """Z=6 with slots 4, 5 absent computes what Z=4 computes: absent slots are invisible, not just constant."""
    policy = make_policy(variant)
    h, keys, scores, _ = make_inputs()
    mask = torch.ones(5, Z, dtype=torch.bool)
    mask[:, 4:] = False
    budgets = torch.where(mask, torch.randint(0, 8, mask.shape, generator=torch.Generator().manual_seed(1)), 0)
    long_lp, long_ent = policy.log_prob(h, keys, scores, mask, budgets)
    short_lp, short_ent = policy.log_prob(h, keys[:, :4], scores[:, :4], mask[:, :4], budgets[:, :4])
    torch.testing.assert_close(long_lp[:, :4], short_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(long_ent[:, :4], short_ent, atol=1e-6, rtol=0)
    long_greedy = sample(policy, (h, keys, scores, mask), greedy=True)
    short_greedy = sample(policy, (h, keys[:, :4], scores[:, :4], mask[:, :4]), greedy=True)
    if variant != "random":
        assert torch.equal(long_greedy.budgets[:, :4], short_greedy.budgets)


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_masked_rows_give_zeros_and_finite_gradients(variant):
    policy = make_policy(variant).train()
    h, keys, scores, _ = make_inputs()
    mask = torch.zeros(5, Z, dtype=torch.bool)
    out = sample(policy, (h, keys, scores, mask))
    for field in out:
        assert (field == 0).all()
    log_prob, entropy = policy.log_prob(h, keys, scores, mask, torch.zeros(5, Z, dtype=torch.long))
    assert (log_prob == 0).all() and (entropy == 0).all()
    if variant in LEARNED_VARIANTS:
        (log_prob.sum() + entropy.sum()).backward()
        assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_seeded_generator_is_deterministic(variant):
    policy = make_policy(variant)
    inputs = make_inputs(n=8)
    a, b, c = sample(policy, inputs, seed=3), sample(policy, inputs, seed=3), sample(policy, inputs, seed=4)
    assert torch.equal(a.budgets, b.budgets) and torch.equal(a.log_prob, b.log_prob)
    if variant != "uniform":  # a point mass has nothing to vary
        assert not torch.equal(a.budgets, c.budgets)


@pytest.mark.parametrize("variant", ["transformer", "autoregressive", "mlp"])
def test_greedy_is_argmax_of_logits(variant):
    policy = make_policy(variant)
    inputs = make_inputs()
    mask = inputs[3]
    out = sample(policy, inputs, greedy=True)
    logits = policy.logits(*inputs, prev_budgets=out.budgets)
    assert torch.equal(out.budgets[mask], logits.argmax(-1)[mask])
    # and greedy ignores the generator
    assert torch.equal(out.budgets, sample(policy, inputs, seed=9, greedy=True).budgets)


@pytest.mark.parametrize("variant", ["transformer", "mlp"])
def test_log_prob_matches_manual_softmax(variant):
    policy = make_policy(variant, min_budget=1)
    h, keys, scores, mask = make_inputs()
    budgets = torch.where(mask, torch.randint(1, 8, mask.shape, generator=torch.Generator().manual_seed(5)), 0)
    log_prob, entropy = policy.log_prob(h, keys, scores, mask, budgets)

    logits = policy.logits(h, keys, scores, mask)
    logp = torch.log_softmax(logits, -1)
    want = logp.gather(-1, (budgets - 1).clamp_min(0)[..., None]).squeeze(-1)
    want_entropy = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(log_prob, torch.where(mask, want, 0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, torch.where(mask, want_entropy, 0.0), atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", ["transformer", "uniform"])
def test_clip_budget_applies_in_greedy_mode_only(variant):
    clip = 3
    policy = make_policy(variant, clip_budget=clip)
    unclipped = make_policy(variant)  # same seed: same weights
    inputs = make_inputs(n=16)
    mask = inputs[3]
    greedy = sample(policy, inputs, greedy=True)
    raw = sample(unclipped, inputs, greedy=True)
    assert torch.equal(greedy.budgets, raw.budgets.clamp_max(clip))
    torch.testing.assert_close(greedy.log_prob, raw.log_prob, atol=0, rtol=0)  # of the unclipped action
    drawn = sample(policy, inputs)
    assert (drawn.budgets[mask] > clip).any()
    if variant == "uniform":
        assert (raw.budgets[mask] == 7).all() and (greedy.budgets[mask] == clip).all()


@pytest.mark.parametrize("variant", ["transformer", "autoregressive", "mlp"])
def test_without_product_feature(variant):
    policy = make_policy(variant, product_feature=False)
    assert policy.input_proj.in_features == 2 * D + 1
    assert make_policy(variant).input_proj.in_features == 3 * D + 1
    inputs = make_inputs()
    out = sample(policy, inputs)
    log_prob, _ = policy.log_prob(*inputs, out.budgets)
    torch.testing.assert_close(log_prob, out.log_prob, atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", ["transformer", "autoregressive", "mlp"])
def test_gradients_reach_every_parameter(variant):
    policy = make_policy(variant).train()
    inputs = make_inputs()
    out = sample(policy, inputs)
    log_prob, _ = policy.log_prob(*inputs, out.budgets)
    log_prob.sum().backward()
    for name, p in policy.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_float32_math_for_low_precision_inputs():
    policy = make_policy("transformer")
    h, keys, scores, mask = make_inputs()
    low = [t.to(torch.bfloat16) for t in (h, keys, scores)]
    out = sample(policy, (*low, mask))
    assert out.log_prob.dtype == torch.float32
    want = sample(policy, (*[t.float() for t in low], mask))
    assert torch.equal(out.budgets, want.budgets) and torch.equal(out.log_prob, want.log_prob)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert policy.logits(h, keys, scores, mask).dtype == torch.float32


def test_input_validation():
    policy = make_policy("transformer")
    h, keys, scores, mask = make_inputs()
    good = torch.where(mask, 2, 0)
    with pytest.raises(ValueError, match="0..7"):
        policy.log_prob(h, keys, scores, mask, torch.where(mask, 8, 0))
    with pytest.raises(ValueError):
        policy.log_prob(h, keys, scores, mask, torch.where(mask, -1, 0))
    policy.log_prob(h, keys, scores, mask, torch.where(mask, 2, 99))  # masked slots are not checked
    with pytest.raises(ValueError):
        make_policy("transformer", min_budget=1).log_prob(h, keys, scores, mask, torch.where(mask, 0, 0))
    with pytest.raises(ValueError):
        policy.log_prob(h, keys, scores, mask.long(), good)
    with pytest.raises(ValueError):
        policy.sample(h[:, :-1], keys, scores, mask)
    with pytest.raises(ValueError, match="max_rank"):
        make_policy("mlp", max_rank=Z - 1).sample(h, keys, scores, mask)
    with pytest.raises(ValueError, match="prev_budgets"):
        make_policy("autoregressive").logits(h, keys, scores, mask)


# ------------------------------------------------------------------ variant-specific


def test_autoregressive_is_causal():
    policy = make_policy("autoregressive")
    h, keys, scores, _ = make_inputs()
    mask = torch.ones(5, Z, dtype=torch.bool)
    budgets = torch.full((5, Z), 2)
    changed = budgets.clone()
    changed[:, 0] = 6
    a = policy.logits(h, keys, scores, mask, prev_budgets=budgets)
    b = policy.logits(h, keys, scores, mask, prev_budgets=changed)
    torch.testing.assert_close(a[:, 0], b[:, 0], atol=1e-6, rtol=0)
    assert ((a[:, 1:] - b[:, 1:]).abs().amax(-1) > 1e-4).all()
    # a later decision never changes an earlier slot
    later = budgets.clone()
    later[:, 3] = 5
    c = policy.logits(h, keys, scores, mask, prev_budgets=later)
    torch.testing.assert_close(a[:, :4], c[:, :4], atol=1e-6, rtol=0)
    assert ((a[:, 4:] - c[:, 4:]).abs().amax(-1) > 1e-4).all()


def test_autoregressive_sequential_sampling_matches_teacher_forcing():
    policy = make_policy("autoregressive", max_budget=20)
    inputs = make_inputs(n=8, seed=2)
    for seed in range(3):
        out = sample(policy, inputs, seed=seed)
        log_prob, _ = policy.log_prob(*inputs, out.budgets)
        torch.testing.assert_close(log_prob, out.log_prob, atol=1e-6, rtol=0)


def test_mlp_scores_each_slot_alone_but_transformer_compares():
    h, keys, scores, _ = make_inputs()
    mask = torch.ones(5, Z, dtype=torch.bool)
    keys2, scores2 = keys.clone(), scores.clone()
    keys2[:, 2] = F.normalize(torch.randn(5, D, generator=torch.Generator().manual_seed(7)), dim=-1)
    scores2[:, 2] = -scores[:, 2]
    others = [j for j in range(Z) if j != 2]
    for variant, isolated in (("mlp", True), ("transformer", False)):
        policy = make_policy(variant)
        a = policy.logits(h, keys, scores, mask)
        b = policy.logits(h, keys2, scores2, mask)
        assert (a[:, 2] - b[:, 2]).abs().max() > 1e-4
        same = torch.allclose(a[:, others], b[:, others], atol=1e-6, rtol=0)
        assert same == isolated, variant


@pytest.mark.parametrize("variant", FIXED_VARIANTS)
def test_fixed_variants_have_no_parameters_and_constant_distributions(variant):
    policy = make_policy(variant, uniform_budget=5)
    assert list(policy.parameters()) == []
    inputs = make_inputs()
    mask = inputs[3]
    out = sample(policy, inputs)
    k = 8
    if variant == "uniform":
        assert (out.budgets[mask] == 5).all()
        want_lp, want_ent = 0.0, 0.0
    else:
        want_lp, want_ent = -math.log(k), math.log(k)
    assert torch.allclose(out.log_prob[mask], torch.full_like(out.log_prob[mask], want_lp), atol=1e-6)
    assert torch.allclose(out.entropy[mask], torch.full_like(out.entropy[mask], want_ent), atol=1e-6)
    # greedy changes nothing for random: a random allocation stays random at evaluation
    if variant == "random":
        g1, g2 = sample(policy, inputs, seed=1, greedy=True), sample(policy, inputs, seed=2, greedy=True)
        assert not torch.equal(g1.budgets, g2.budgets)


def test_uniform_defaults_to_max_budget():
    out = sample(make_policy("uniform"), make_inputs())
    mask = make_inputs()[3]
    assert (out.budgets[mask] == 7).all()


@pytest.mark.parametrize("min_budget", [0, 3])
def test_random_is_uniform_over_budgets(min_budget):
    policy = make_policy("random", min_budget=min_budget)
    n = 400
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, D, generator=g)
    keys = torch.randn(n, Z, D, generator=g)
    mask = torch.ones(n, Z, dtype=torch.bool)
    budgets = policy.sample(h, keys, torch.zeros(n, Z), mask, generator=g).budgets
    k = 8 - min_budget
    counts = torch.bincount(budgets.flatten() - min_budget, minlength=k).float()
    assert counts.numel() == k
    expected = n * Z / k
    sigma = math.sqrt(expected * (1 - 1 / k))
    assert (counts - expected).abs().max() < 5 * sigma


# ----------------------------------------------------------------------------- the cost dial and supervision


def _cap_reference(budgets, value, mask, cap):
    """cap_budgets written as a loop: memories by value (ties: rank), each keeps what is left."""
    out = torch.zeros_like(budgets)
    for i in range(budgets.shape[0]):
        slots = sorted((j for j in range(budgets.shape[1]) if mask[i, j]), key=lambda j: (-float(value[i, j]), j))
        left = cap
        for j in slots:
            out[i, j] = min(int(budgets[i, j]), left)
            left -= int(out[i, j])
    return out


@pytest.mark.parametrize("cap", [0, 1, 5, 9, 100])
def test_cap_budgets_cuts_the_lowest_value_memories_first(cap):
    from elasticmem.model.budget_policy import cap_budgets

    g = torch.Generator().manual_seed(cap)
    _, _, _, mask = make_inputs()
    budgets = torch.where(mask, torch.randint(0, 8, mask.shape, generator=g), 0)
    value = torch.randint(0, 3, mask.shape, generator=g).float()  # many ties: rank breaks them
    got = cap_budgets(budgets, value, mask, cap)
    assert torch.equal(got, _cap_reference(budgets, value, mask, cap))
    assert (got.sum(-1) <= cap).all() and (got <= budgets).all() and (got[~mask] == 0).all()
    within = budgets.sum(-1) <= cap
    assert torch.equal(got[within], budgets[within])


@pytest.mark.parametrize("cap", [None, 0, 3, 7, 40])
def test_spread_budgets_shares_the_cap_out_evenly(cap):
    from elasticmem.model.budget_policy import spread_budgets

    _, _, _, mask = make_inputs()
    got = spread_budgets(mask, 7, cap)
    assert (got[~mask] == 0).all()
    for i in range(mask.shape[0]):
        b = got[i][mask[i]].tolist()
        if not b:
            continue
        if cap is None:
            assert b == [7] * len(b)
        else:
            assert sum(b) == min(cap, 7 * len(b)) and max(b) - min(b) <= 1
            assert b == sorted(b, reverse=True)  # the extra tokens go to the highest-ranked


def test_token_cap_applies_in_greedy_mode_with_the_policys_own_values():
    from elasticmem.model.budget_policy import cap_budgets

    h, keys, scores, mask = make_inputs()
    free = make_policy("transformer")
    capped = make_policy("transformer", token_cap=6)
    full = free.sample(h, keys, scores, mask, greedy=True)
    got = capped.sample(h, keys, scores, mask, greedy=True)
    logits = free.logits(h, keys, scores, mask)
    value = (torch.softmax(logits, -1) * torch.arange(0, 8).float()).sum(-1)  # E[b]
    assert torch.equal(got.budgets, cap_budgets(full.budgets, value, mask, 6))
    assert torch.equal(got.log_prob, full.log_prob)  # the action's log-prob is the uncapped one's
    torch.manual_seed(0)
    a = capped.sample(h, keys, scores, mask, greedy=False, generator=torch.Generator().manual_seed(1))
    b = free.sample(h, keys, scores, mask, greedy=False, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.budgets, b.budgets)  # sampling for training is not capped


def test_budget_supervision_loss_is_the_cross_entropy_and_teaches_the_policy():
    from elasticmem.model.budget_policy import budget_supervision_loss

    h, keys, scores, mask = make_inputs(n=8, seed=3)
    target = torch.where(scores > 0, 7, 0)  # "evidence" = the positively scored memories
    policy = make_policy("transformer", dropout=0.0)
    logits = policy.logits(h, keys, scores, mask)
    ref = F.cross_entropy(logits[mask], target[mask])
    torch.testing.assert_close(budget_supervision_loss(logits, target, mask), ref)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for _ in range(150):
        loss = budget_supervision_loss(policy.logits(h, keys, scores, mask), target, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.equal(policy.sample(h, keys, scores, mask, greedy=True).budgets, torch.where(mask, target, 0))
    assert budget_supervision_loss(logits, target, torch.zeros_like(mask)) == 0


def test_normalized_features_ignore_the_query_scale_and_read_the_relative_score():
    from elasticmem.model.budget_policy import _standardized

    h, keys, scores, mask = make_inputs()
    policy = make_policy("transformer", features="normalized")
    torch.testing.assert_close(policy.logits(h * 37.0, keys, scores, mask), policy.logits(h, keys, scores, mask))
    assert not torch.allclose(make_policy("transformer").logits(h * 37.0, keys, scores, mask),
                              make_policy("transformer").logits(h, keys, scores, mask))
    z = _standardized(scores, mask)
    for i in range(mask.shape[0]):
        s = scores[i][mask[i]]
        if len(s) > 1:
            torch.testing.assert_close(z[i][mask[i]], (s - s.mean()) / s.std(unbiased=False))
        assert (z[i][~mask[i]] == 0).all()
    # garbage at absent slots does not reach the present ones
    k2, s2 = garbage_at_masked(keys, scores, mask, seed=1)
    torch.testing.assert_close(policy.logits(h, k2, s2, mask)[mask], policy.logits(h, keys, scores, mask)[mask])


def test_balanced_budget_supervision_weighs_evidence_and_others_half_each():
    from elasticmem.model.budget_policy import budget_supervision_loss

    h, keys, scores, mask = make_inputs(n=6, seed=4)
    positive = torch.zeros_like(mask)
    positive[0, 1] = positive[4, [0, 3]] = positive[5, :] = True
    target = torch.where(positive, 7, 0)
    logits = make_policy("transformer").logits(h, keys, scores, mask)
    logp = torch.log_softmax(logits, -1).gather(-1, target[..., None]).squeeze(-1)
    terms = []
    for i in range(6):
        p, n = positive[i] & mask[i], ~positive[i] & mask[i]
        parts = [t for t in (logp[i][p].mean() if p.any() else None, logp[i][n].mean() if n.any() else None)
                 if t is not None]
        if parts:
            terms.append(-sum(parts) / len(parts))
    torch.testing.assert_close(budget_supervision_loss(logits, target, mask, positive=positive),
                               torch.stack(terms).mean())
