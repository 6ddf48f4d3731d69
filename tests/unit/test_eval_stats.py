"""Tests of the evaluation statistics (elasticmem.eval.stats): Wilson intervals, the exact McNemar
test and Tango's interval of a paired difference.

Run with::

    OMP_NUM_THREADS=1 pytest tests/unit/test_eval_stats.py

Expected values come from independent computations written out here (the Wilson formula, the
binomial tail with math.comb, closed forms of Tango's interval at its edges) and from a
textbook example (Agresti, An Introduction to Categorical Data Analysis, 2nd ed., Table 8.1:
presidential approval of 1600 people in two surveys).
"""

from __future__ import annotations

import math
import random

import pytest

from elasticmem.eval import stats as S

Z95 = 1.959963984540054  # the 0.975 quantile of the standard normal


def wilson_by_hand(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """(p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)."""
    p = k / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def mcnemar_by_hand(b: int, c: int) -> float:
    """Two-sided exact McNemar: 2 P(X <= min(b, c)), X ~ Binomial(b + c, 1/2), at most 1."""
    m = b + c
    tail = sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2**m
    return min(1.0, 2 * tail)


# --------------------------------------------------------------------------- Wilson


@pytest.mark.parametrize("k,n", [(5, 10), (1, 3), (123, 200), (61, 240), (999, 1000)])
def test_wilson_interval_equals_the_formula(k, n):
    assert S.wilson_interval(k, n) == pytest.approx(wilson_by_hand(k, n), abs=1e-12)


def test_wilson_interval_worked_example():
    # k = 5, n = 10: centre 0.5, half-width 1.96 / 13.8415 * sqrt(2.5 + 0.9604) = 0.2634
    lo, hi = S.wilson_interval(5, 10)
    assert (lo, hi) == pytest.approx((0.2366, 0.7634), abs=1e-4)


def test_wilson_interval_edges():
    assert S.wilson_interval(0, 0) == (0.0, 1.0)  # no questions: no information
    lo, hi = S.wilson_interval(0, 10)  # 0 %: [0, z^2 / (n + z^2)] = [0, 3.8415 / 13.8415]
    assert lo == 0.0 and hi == pytest.approx(Z95**2 / (10 + Z95**2), abs=1e-12)
    lo, hi = S.wilson_interval(10, 10)  # 100 %: not a point, unlike the Wald interval
    assert hi == 1.0 and lo == pytest.approx(10 / (10 + Z95**2), abs=1e-12)
    assert S.wilson_interval(5, 10, level=0.99)[0] < S.wilson_interval(5, 10)[0]  # wider at 99 %
    for bad in [(-1, 10), (11, 10), (0, -1)]:
        with pytest.raises(ValueError):
            S.wilson_interval(*bad)
    with pytest.raises(ValueError, match="level"):
        S.wilson_interval(1, 2, level=95)


def test_accuracy_with_interval_counts_0_1_outcomes_only():
    acc, n, ci = S.accuracy_with_interval([True, False, True, 1.0, 0.0])
    assert (acc, n) == (0.6, 5) and ci == pytest.approx(list(wilson_by_hand(3, 5)))
    assert S.accuracy_with_interval([]) == (0.0, 0, [0.0, 1.0])
    with pytest.raises(ValueError, match="0/1"):
        S.accuracy_with_interval([0.5, 1.0])


# --------------------------------------------------------------------------- McNemar


@pytest.mark.parametrize("b,c", [(1, 9), (9, 1), (20, 40), (7, 7), (0, 5), (150, 86)])
def test_mcnemar_exact_p_equals_the_binomial_tail(b, c):
    assert S.mcnemar_exact_p(b, c) == pytest.approx(mcnemar_by_hand(b, c), rel=1e-9)


def test_mcnemar_worked_example():
    # 1 vs 9 discordant: 2 (C(10,0) + C(10,1)) / 2^10 = 22 / 1024
    assert S.mcnemar_exact_p(1, 9) == pytest.approx(22 / 1024)
    assert S.mcnemar_exact_p(0, 0) == 1.0  # the systems never disagree


# --------------------------------------------------------------------------- paired comparison


def _pairs(both: int, only_a: int, only_b: int, neither: int) -> tuple[list[bool], list[bool]]:
    a = [True] * both + [True] * only_a + [False] * only_b + [False] * neither
    b = [True] * both + [False] * only_a + [True] * only_b + [False] * neither
    return a, b


def test_paired_comparison_textbook_example():
    """Agresti's approval ratings: 794 approve twice, 150 approve then disapprove, 86 the
    reverse, 570 disapprove twice. Approval 944/1600 = 0.59 then 880/1600 = 0.55; the change
    -0.04 with a 95 % interval -0.04 -+ 1.96 x 0.0095 = (-0.059, -0.021); McNemar
    z^2 = (86 - 150)^2 / 236 = 17.36, p < 0.0001."""
    c = S.paired_comparison(*_pairs(794, 150, 86, 570))
    assert (c.n, c.both_correct, c.only_a_correct, c.only_b_correct, c.both_wrong) == (1600, 794, 150, 86, 570)
    assert c.accuracy_a == pytest.approx(0.59) and c.accuracy_b == pytest.approx(0.55)
    assert c.difference == pytest.approx(-0.04)
    assert c.difference_ci == pytest.approx((-0.04 - 1.96 * 0.0095, -0.04 + 1.96 * 0.0095), abs=1e-3)
    assert c.p_value == pytest.approx(mcnemar_by_hand(150, 86), rel=1e-9)
    assert c.p_value < 1e-4 and (86 - 150) ** 2 / 236 == pytest.approx(17.36, abs=0.01)
    assert c.discordant == 236 and not c.too_few_for_headline


def test_paired_comparison_interval_is_the_score_test_inverted():
    """At each limit Tango's score statistic (constrained ML under H0, written out here) is -+z."""
    only_a, only_b, n = 20, 40, 200

    def score(d: float) -> float:
        a, b = 2 * n, -only_b - only_a + (2 * n - only_b + only_a) * d
        q = (math.sqrt(b * b + 4 * a * only_a * d * (1 - d)) - b) / (2 * a)
        return (only_b - only_a - n * d) / math.sqrt(n * (2 * q + d * (1 - d)))

    c = S.paired_comparison(*_pairs(100, only_a, only_b, 40))
    lo, hi = c.difference_ci
    assert c.difference == pytest.approx(0.1) and lo < 0.1 < hi
    assert score(lo) == pytest.approx(Z95, abs=1e-7) and score(hi) == pytest.approx(-Z95, abs=1e-7)
    assert c.p_value == pytest.approx(mcnemar_by_hand(only_a, only_b), rel=1e-9)


def test_paired_comparison_without_discordant_pairs():
    """Same answers on every question: difference 0, p = 1, and the interval is not a point:
    +-z^2 / (n + z^2) (the score equation n d^2 = z^2 d (1 - d) solved by hand)."""
    a = [True] * 30 + [False] * 20
    c = S.paired_comparison(a, list(a))
    assert (c.difference, c.p_value, c.discordant) == (0.0, 1.0, 0)
    w = Z95**2 / (50 + Z95**2)
    assert c.difference_ci == pytest.approx((-w, w), abs=1e-9)
    assert c.too_few_for_headline


def test_paired_comparison_all_correct_and_all_one_way():
    c = S.paired_comparison([True] * 8, [True] * 8)  # both all correct
    assert (c.accuracy_a, c.accuracy_b, c.difference, c.p_value) == (1.0, 1.0, 0.0, 1.0)
    # B right on all 10, A on none: d = 1, lower limit (n - z^2) / (n + z^2) by hand, upper 1
    c = S.paired_comparison([False] * 10, [True] * 10)
    assert c.difference == 1.0 and c.difference_ci == pytest.approx(((10 - Z95**2) / (10 + Z95**2), 1.0), abs=1e-9)
    assert c.p_value == pytest.approx(2 / 2**10)
    swapped = S.paired_comparison([True] * 10, [False] * 10)  # A minus B: the mirror image
    assert swapped.difference_ci == pytest.approx((-1.0, -c.difference_ci[0]), abs=1e-9)


def test_paired_comparison_covers_the_true_difference():
    """Monte Carlo with a fixed seed: 400 paired samples of 200 questions (p_a = 0.6, p_b = 0.7,
    correlated); the 95 % interval covers the true difference 0.1 about 95 % of the time."""
    rng = random.Random(0)
    cells = [(0.5, True, True), (0.1, True, False), (0.2, False, True), (0.2, False, False)]
    covered = 0
    for _ in range(400):
        draws = rng.choices([(x, y) for _, x, y in cells], weights=[w for w, _, _ in cells], k=200)
        c = S.paired_comparison([x for x, _ in draws], [y for _, y in draws])
        covered += c.difference_ci[0] <= 0.1 <= c.difference_ci[1]
    assert 0.91 <= covered / 400 <= 0.99


def test_paired_comparison_refuses_bad_input():
    with pytest.raises(ValueError, match="length"):
        S.paired_comparison([True], [True, False])
    with pytest.raises(ValueError, match="no paired"):
        S.paired_comparison([], [])
    with pytest.raises(ValueError, match="0/1"):
        S.paired_comparison([0.5], [1.0])


def test_as_dict_is_json_ready():
    d = S.paired_comparison(*_pairs(2, 1, 3, 4)).as_dict()
    assert d["difference_ci"] == list(d["difference_ci"]) and isinstance(d["difference_ci"], list)
    assert (d["n"], d["discordant"], d["too_few_for_headline"]) == (10, 4, True)
    assert d["difference"] == pytest.approx(0.2) and d["level"] == 0.95


def test_pair_by_id_orders_and_refuses_other_questions():
    a = {"q2": True, "q1": False, "q3": True}
    b = {"q3": False, "q1": True, "q2": True}
    assert S.pair_by_id(a, b) == ([False, True, True], [True, True, False])  # ids sorted: q1, q2, q3
    with pytest.raises(S.PairingError, match="1 id.* only in the first.*0 only in the second"):
        S.pair_by_id(a, {"q1": True, "q2": True})


def test_seed_interval_is_the_t_interval_of_the_mean():
    """Three seeds at 0.70, 0.76, 0.79: mean 0.75, half-width t(0.975, 2) * s / sqrt(3) with s the
    sample standard deviation; t(0.975, 2) = 4.302653 (the textbook table's 4.303)."""
    import statistics

    values = [0.70, 0.76, 0.79]
    mean, (lo, hi) = S.seed_interval(values)
    half = 4.302653 * statistics.stdev(values) / math.sqrt(3)
    assert mean == pytest.approx(0.75)
    assert (lo, hi) == (pytest.approx(0.75 - half, abs=1e-6), pytest.approx(0.75 + half, abs=1e-6))
    assert S.seed_interval([0.4]) == (0.4, None)  # one seed: the spread between runs is unknown
    assert S.seed_interval([0.5, 0.5]) == (0.5, (0.5, 0.5))
    with pytest.raises(ValueError):
        S.seed_interval([])


def test_seed_paired_is_the_t_test_of_the_per_seed_differences():
    a, b = [0.60, 0.65, 0.70], [0.70, 0.71, 0.83]
    out = S.seed_paired(a, b)
    d = [0.10, 0.06, 0.13]
    assert out["per_seed"] == pytest.approx(d) and out["difference"] == pytest.approx(sum(d) / 3)
    # paired t-test = one-sample t-test of the differences: t = mean / (sd / sqrt(k)), k - 1 = 2 df
    import statistics

    t = (sum(d) / 3) / (statistics.stdev(d) / math.sqrt(3))
    # two-sided p of Student's t with 2 df has a closed form: 1 - t / sqrt(2 + t^2)
    assert out["p_value"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-6)
    assert out["difference_ci"][0] > 0  # all three seeds agree: the interval excludes 0
    with pytest.raises(ValueError, match="same seeds"):
        S.seed_paired([0.5], [0.5, 0.6])
