"""Uncertainty of evaluation results: intervals for accuracies, paired tests between systems.

The project's standard: every accuracy is reported with its n and a 95 % interval,
differences between systems with a paired test on the same questions, and headlines on at
least :data:`HEADLINE_MIN_N` questions.

- :func:`wilson_interval`: the Wilson score interval of one proportion (scipy's
  ``binomtest(k, n).proportion_ci(method="wilson")``), also right at 0 % and 100 %, where
  the normal-approximation (Wald) interval collapses to a point.
- :func:`paired_comparison`: two systems answered the same questions. The exact McNemar
  test (a two-sided binomial test with p = 1/2 on the discordant pairs, scipy's
  ``binomtest``) and Tango's asymptotic score interval for the difference of the paired
  accuracies (Tango 1998, *Stat. Med.* 17:891-908). It inverts the score test, so it needs
  no seed (unlike a bootstrap), stays inside [-1, 1], and is not a point when the systems
  never disagree (a paired bootstrap would say "exactly 0" there).
- :func:`pair_by_id`: the per-example correctness of two systems, paired by example id;
  refuses to pair when the id sets differ.
- :func:`pooled_per_question` and :func:`pooled_paired_per_question`: several training seeds
  answered the same questions. Their (seed, question) outcomes are not independent (a question
  hard for one seed is hard for the others), so they are pooled per question: each question's
  mean correctness over the seeds (its mean difference, paired), and n = the questions. The 95 %
  interval is a percentile bootstrap over questions (:func:`bootstrap_mean_interval`, seeded: the
  same figures on every run); the p-value of a difference is a sign-flip permutation test over
  questions (:func:`sign_flip_p`; exact with few non-zero differences, which on one seed makes it
  the exact McNemar test). The percentile interval is a little narrow on few questions, so near
  p = 0.05 the interval and the test may disagree (at 336 questions, rarely). :func:`seed_paired`
  stays the interval over the seeds' own results.

Everything here is a pure function of counts or of ``correct`` flags.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize as _scipy_optimize
from scipy import stats as _scipy_stats

LEVEL = 0.95
"""The confidence level of every interval the evaluation reports."""

HEADLINE_MIN_N = 200
"""Fewer questions than this are too few for a headline number."""

TOO_FEW_FOR_HEADLINE = f"n < {HEADLINE_MIN_N}: too few questions for a headline"
"""The flag the reports print next to results on fewer than :data:`HEADLINE_MIN_N` questions."""


def wilson_interval(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The Wilson score interval ``(lo, hi)`` of the proportion ``k / n`` at confidence ``level``.

    ``n = 0`` carries no information: the interval is the whole ``(0.0, 1.0)``.
    """
    k, n = int(k), int(n)
    if n < 0 or not 0 <= k <= max(n, 0):
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n == 0:
        return 0.0, 1.0
    ci = _scipy_stats.binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    return max(0.0, float(ci.low)), min(1.0, float(ci.high))


def count_correct(correct: Iterable[bool | float]) -> tuple[int, int]:
    """``(k, n)``: how many of the 0/1 outcomes ``correct`` are 1, and how many there are.

    Refuses outcomes other than 0/1 (``True``/``False``, ``0.0``/``1.0``): the intervals here
    are for proportions, not for the mean of a graded score.
    """
    values = [float(c) for c in correct]
    if any(v not in (0.0, 1.0) for v in values):
        raise ValueError("correct must hold 0/1 outcomes; an interval for a graded score needs another method")
    return int(sum(values)), len(values)


def accuracy_with_interval(correct: Iterable[bool | float], level: float = LEVEL) -> tuple[float, int, list[float]]:
    """``(accuracy, n, [lo, hi])`` of 0/1 outcomes (accuracy 0.0 and ``[0, 1]`` when there are none)."""
    k, n = count_correct(correct)
    return (k / n if n else 0.0), n, list(wilson_interval(k, n, level))


@dataclass(frozen=True)
class PairedComparison:
    """System B against system A on the same ``n`` questions (see :func:`paired_comparison`)."""

    n: int
    """Questions both systems answered (paired by id)."""
    accuracy_a: float
    accuracy_b: float
    difference: float
    """``accuracy_b - accuracy_a``: positive when B is better."""
    difference_ci: tuple[float, float]
    """Tango's score interval of ``difference`` at ``level`` (:func:`tango_interval`)."""
    both_correct: int
    only_a_correct: int
    """Discordant pairs: A right, B wrong."""
    only_b_correct: int
    """Discordant pairs: B right, A wrong."""
    both_wrong: int
    p_value: float
    """Exact two-sided McNemar test: binomial(only_a + only_b, 1/2) on the discordant pairs
    (1.0 when there are none)."""
    level: float = LEVEL

    @property
    def discordant(self) -> int:
        """Questions exactly one of the two systems got right."""
        return self.only_a_correct + self.only_b_correct

    @property
    def too_few_for_headline(self) -> bool:
        """True when ``n < HEADLINE_MIN_N``."""
        return self.n < HEADLINE_MIN_N

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields, the interval as a list, plus ``discordant`` and
        ``too_few_for_headline``."""
        out = asdict(self)
        out["difference_ci"] = list(self.difference_ci)
        out["discordant"] = self.discordant
        out["too_few_for_headline"] = self.too_few_for_headline
        return out


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: the binomial test of ``only_b`` successes in
    ``only_a + only_b`` discordant pairs with p = 1/2; 1.0 without discordant pairs."""
    if only_a < 0 or only_b < 0:
        raise ValueError("discordant counts must be >= 0")
    if only_a + only_b == 0:
        return 1.0
    return float(_scipy_stats.binomtest(int(only_b), int(only_a + only_b), 0.5).pvalue)


def _tango_score(d: float, only_a: int, only_b: int, n: int) -> float:
    """Tango's score statistic of ``H0: p_b - p_a = d``: ``(only_b - only_a - n d) /
    sqrt(n (2 q + d (1 - d)))``, ``q`` the maximum-likelihood probability of "only A right"
    under H0 (the root of Tango's quadratic)."""
    a_, b_ = 2.0 * n, -only_b - only_a + (2.0 * n - only_b + only_a) * d
    c_ = -only_a * d * (1.0 - d)
    q = (math.sqrt(max(0.0, b_ * b_ - 4.0 * a_ * c_)) - b_) / (2.0 * a_)
    var = n * (2.0 * q + d * (1.0 - d))
    num = only_b - only_a - n * d
    if var <= 0.0:
        return math.copysign(math.inf, num) if num else 0.0
    return num / math.sqrt(var)


def tango_interval(only_a: int, only_b: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Tango's (1998) asymptotic score interval of ``p_b - p_a`` for paired 0/1 outcomes.

    ``only_a`` / ``only_b``: questions only A / only B got right, of ``n`` paired questions.
    The interval holds every ``d`` whose score statistic :func:`_tango_score` is within
    ``+-z``: it inverts the score (McNemar-type) test, so it agrees with the test about 0, is
    not empty or a point without discordant pairs (``+-z^2 / (n + z^2)`` then), stays in
    [-1, 1] and needs no seed. Limits are found with ``scipy.optimize.brentq``.
    """
    if n <= 0 or min(only_a, only_b) < 0 or only_a + only_b > n:
        raise ValueError(f"need 0 <= only_a + only_b <= n and n > 0, got {only_a}, {only_b}, {n}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    z = float(_scipy_stats.norm.ppf(0.5 + level / 2.0))
    d_hat = (only_b - only_a) / n
    edge = 1.0 - 1e-12

    def limit(end: float, shift: float) -> float:
        """The root of ``score(d) + shift`` between ``d_hat`` and ``end`` (the score falls from
        +inf to -inf across [-1, 1]), or ``+-1`` when the score stays short of it there."""
        def f(d: float) -> float:
            return _tango_score(d, only_a, only_b, n) + shift

        if d_hat == math.copysign(1.0, end) or f(end) * f(d_hat) > 0:
            return math.copysign(1.0, end)
        return float(_scipy_optimize.brentq(f, *sorted((d_hat, end)), xtol=1e-12))

    return max(-1.0, limit(-edge, -z)), min(1.0, limit(edge, z))


def paired_comparison(correct_a: Sequence[bool | float], correct_b: Sequence[bool | float],
                      level: float = LEVEL) -> PairedComparison:
    """System B against system A on the same questions, in the same order.

    ``correct_a[i]`` and ``correct_b[i]`` are the 0/1 outcomes of question ``i`` (pair them
    by id first, e.g. with :func:`pair_by_id`). Returns the 2 x 2 counts, the exact McNemar
    p-value (:func:`mcnemar_exact_p`) and Tango's score interval of the accuracy difference
    ``B - A`` (:func:`tango_interval`).
    """
    if len(correct_a) != len(correct_b):
        raise ValueError(f"paired outcomes differ in length: {len(correct_a)} vs {len(correct_b)}")
    if not correct_a:
        raise ValueError("no paired questions to compare")
    k_a, n = count_correct(correct_a)
    count_correct(correct_b)  # 0/1 check
    a = [bool(x) for x in correct_a]
    b = [bool(x) for x in correct_b]
    both = sum(x and y for x, y in zip(a, b))
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    neither = n - both - only_a - only_b
    return PairedComparison(
        n=n, accuracy_a=k_a / n, accuracy_b=(both + only_b) / n, difference=(only_b - only_a) / n,
        difference_ci=tango_interval(only_a, only_b, n, level),
        both_correct=both, only_a_correct=only_a, only_b_correct=only_b, both_wrong=neither,
        p_value=mcnemar_exact_p(only_a, only_b), level=level)


class PairingError(ValueError):
    """Two systems' predictions are not on the same questions."""


def pair_by_id(a: Mapping[str, bool], b: Mapping[str, bool]) -> tuple[list[bool], list[bool]]:
    """The outcomes ``{id: correct}`` of two systems as two lists in the same (sorted id) order.

    Raises :class:`PairingError` (saying how many ids each side lacks) when the id sets differ:
    a paired test on a subset would silently compare other questions than the accuracies do.
    """
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    if only_a or only_b:
        raise PairingError(f"not the same questions: {len(only_a)} id(s) only in the first "
                           f"(e.g. {only_a[:2]}), {len(only_b)} only in the second (e.g. {only_b[:2]})")
    ids = sorted(a)
    return [bool(a[i]) for i in ids], [bool(b[i]) for i in ids]


def seed_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, tuple[float, float] | None]:
    """Mean of per-seed results (one value per independent training seed) and the Student t
    interval of that mean (scipy's ``t.interval``); None with fewer than two seeds, where the
    spread between seeds is unknown. Over seeds, not questions: it says how much another
    training run could differ, which a question-level interval of one run does not."""
    k = len(values)
    if k == 0:
        raise ValueError("no seeds")
    mean = float(sum(values) / k)
    if k < 2:
        return mean, None
    sem = float(_scipy_stats.sem(values))
    if sem == 0.0:
        return mean, (mean, mean)
    lo, hi = _scipy_stats.t.interval(level, k - 1, loc=mean, scale=sem)
    return mean, (float(lo), float(hi))


def seed_paired(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> dict[str, Any]:
    """Seed-paired comparison of two systems trained with the same seeds (``a[i]``, ``b[i]``: seed
    i's results): mean difference b - a, its t interval over seeds and the paired t-test's
    two-sided p (scipy's ``ttest_rel``; None with fewer than two seeds or no spread)."""
    if len(a) != len(b):
        raise ValueError(f"seed-paired comparison needs the same seeds: {len(a)} vs {len(b)} results")
    diffs = [y - x for x, y in zip(a, b)]
    mean, ci = seed_interval(diffs, level)
    p = None
    if len(diffs) >= 2 and ci is not None and ci[0] != ci[1]:
        p = float(_scipy_stats.ttest_rel(b, a).pvalue)
    return {"seeds": len(diffs), "difference": mean, "difference_ci": None if ci is None else list(ci), "p_value": p,
            "per_seed": diffs}


# --------------------------------------------------------------------------- pooled over seeds, per question

RESAMPLES = 10_000
"""Bootstrap resamples (and random sign flips) of the pooled figures."""

BOOTSTRAP_SEED = 0
"""Seed of the pooled figures' resampling: the same data give the same interval and p every run."""

EXACT_FLIPS_MAX = 13
"""Up to this many questions with a non-zero difference, :func:`sign_flip_p` enumerates all
2^k sign patterns (8,192 <= :data:`RESAMPLES`): exact, and no more work than sampling."""


def outcome_matrix(per_seed: Sequence[Mapping[str, bool]]) -> tuple[list[str], np.ndarray]:
    """``(ids, correct)``: the seeds' outcomes ``{id: correct}`` as a 0/1 float array of shape
    ``(seeds, questions)``, questions in sorted id order. Raises :class:`PairingError` when a
    seed answered other questions than the first: pooling per question needs the same ones."""
    if not per_seed:
        raise ValueError("no seeds")
    ids = sorted(per_seed[0])
    for i, outcomes in enumerate(per_seed[1:], 1):
        if outcomes.keys() != set(ids):
            raise PairingError(f"seed {i} answered other questions than seed 0: "
                               f"{len(outcomes.keys() - set(ids))} more, {len(set(ids) - outcomes.keys())} fewer")
    return ids, np.array([[float(bool(o[i])) for i in ids] for o in per_seed], dtype=np.float64).reshape(
        len(per_seed), len(ids))


def _as_matrix(correct: ArrayLike) -> np.ndarray:
    """0/1 outcomes as a float array ``(seeds, questions)`` (a 1-D array is one seed)."""
    x = np.asarray(correct, dtype=np.float64)
    x = x[None, :] if x.ndim == 1 else x
    if x.ndim != 2 or x.shape[1] == 0 or x.shape[0] == 0:
        raise ValueError(f"need outcomes of shape (seeds, questions) with both > 0, got {x.shape}")
    if not np.isin(x, (0.0, 1.0)).all():
        raise ValueError("correct must hold 0/1 outcomes")
    return x


def bootstrap_means(values: ArrayLike, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """The means of ``resamples`` bootstrap resamples (with replacement, the same size) of
    ``values`` (shape ``(Q,)``): shape ``(resamples,)``. Seeded (numpy ``default_rng(seed)``)."""
    v = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    out = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, 1000):  # (1000, Q) indices at a time: bounded memory for any Q
        stop = min(resamples, start + 1000)
        out[start:stop] = v[rng.integers(0, len(v), size=(stop - start, len(v)))].mean(axis=1)
    return out


def bootstrap_mean_interval(values: ArrayLike, level: float = LEVEL, resamples: int = RESAMPLES,
                            seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (shape ``(Q,)``, one per question).

    Percentile rather than a t interval: the per-question values are bounded (accuracies in
    [0, 1], differences in [-1, 1]) and often skewed near a bound, and the percentile interval
    stays inside the bounds; rather than BCa: with all values equal (every seed right on every
    question) BCa is undefined, the percentile interval is the point. It is the interval of
    ``scipy.stats.bootstrap(..., method="percentile")`` with numpy's own resampling (the paired
    figures resample the questions once for both the interval and the accuracies)."""
    means = bootstrap_means(values, resamples, seed)
    alpha = 1.0 - level
    lo, hi = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(lo), float(hi)


def sign_flip_p(diffs: ArrayLike, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, str]:
    """``(p, method)``: two-sided sign-flip permutation test of ``mean(diffs) = 0``.

    ``diffs`` (shape ``(Q,)``): each question's mean difference over seeds. Under the null, the
    two systems are exchangeable on each question, so each difference is as likely to have the
    other sign; p = P(|mean of randomly signed diffs| >= |observed mean|). Zeros never change
    the statistic, so with at most :data:`EXACT_FLIPS_MAX` non-zero differences every sign
    pattern is enumerated (exact; on one seed's 0/+-1 differences this is the exact McNemar
    test); otherwise ``resamples`` random patterns, p = (1 + hits) / (1 + resamples), so the
    smallest p is 1 / (1 + resamples): read it as "p below that"."""
    d = np.asarray(diffs, dtype=np.float64)
    observed = abs(d.mean())
    nz = d[d != 0.0]
    tol = 1e-9 * max(1.0, observed)  # the statistic is a sum of floats: ties must count as ties
    if len(nz) <= EXACT_FLIPS_MAX:
        k = len(nz)
        signs = ((np.arange(2**k)[:, None] >> np.arange(k)) & 1) * 2.0 - 1.0  # (2^k, k)
        stats = np.abs(signs @ nz) / len(d)
        return float(np.mean(stats >= observed - tol)), f"sign-flip permutation test over questions (exact: all 2^{k})"
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, resamples, 1000):
        stop = min(resamples, start + 1000)
        signs = rng.choice(np.array([-1.0, 1.0]), size=(stop - start, len(nz)))
        hits += int(np.sum(np.abs(signs @ nz) / len(d) >= observed - tol))
    return (1 + hits) / (1 + resamples), f"sign-flip permutation test over questions ({resamples} random patterns)"


def pooling_note(seeds: int, questions: int, paired: bool = False) -> str:
    """How a pooled figure was pooled, as its ``pooling`` field and the reports say it."""
    kind = "paired bootstrap" if paired else "bootstrap"
    return f"per question, mean over {seeds} seed{'s' if seeds != 1 else ''}, {kind} over {questions} questions"


def pooled_per_question(correct: ArrayLike, level: float = LEVEL, resamples: int = RESAMPLES,
                        seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """Accuracy of one system over several seeds, pooled per question.

    ``correct``: 0/1 outcomes of shape ``(seeds, questions)``, the same questions in the same
    order on every seed (:func:`outcome_matrix`). The accuracy is the mean over questions of
    each question's mean over seeds (= the mean of the seeds' accuracies); ``n`` = questions;
    ``ci95``: the percentile bootstrap over questions (:func:`bootstrap_mean_interval`)."""
    x = _as_matrix(correct)
    per_question = x.mean(axis=0)  # (Q,)
    lo, hi = bootstrap_mean_interval(per_question, level, resamples, seed)
    s, q = x.shape
    return {"accuracy": float(per_question.mean()), "n": q, "seeds": s, "ci95": [lo, hi], "level": level,
            "interval": f"percentile bootstrap over questions ({resamples} resamples, seed {seed})",
            "pooling": pooling_note(s, q), "too_few_for_headline": q < HEADLINE_MIN_N}


def pooled_paired_per_question(correct_a: ArrayLike, correct_b: ArrayLike, level: float = LEVEL,
                               resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """System B against system A over several seeds, pooled per question.

    ``correct_a``, ``correct_b``: 0/1 outcomes of shape ``(seeds, questions)``, seed i of B
    paired with seed i of A and the same questions in the same order. Per question, ``d_q`` =
    the mean over seeds of ``b - a`` (shape ``(Q,)``); ``difference`` = mean of ``d_q``;
    ``difference_ci``: the paired percentile bootstrap over questions; ``p_value``: the
    sign-flip permutation test of the ``d_q`` (:func:`sign_flip_p`); ``n`` = questions."""
    a, b = _as_matrix(correct_a), _as_matrix(correct_b)
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes differ in shape: {a.shape} vs {b.shape}")
    d = (b - a).mean(axis=0)  # (Q,)
    lo, hi = bootstrap_mean_interval(d, level, resamples, seed)
    p, how = sign_flip_p(d, resamples, seed)
    s, q = a.shape
    return {"n": q, "seeds": s, "accuracy_a": float(a.mean()), "accuracy_b": float(b.mean()),
            "difference": float(d.mean()), "difference_ci": [lo, hi], "p_value": p, "level": level,
            "interval": f"paired percentile bootstrap over questions ({resamples} resamples, seed {seed})",
            "test": how, "pooling": pooling_note(s, q, paired=True), "too_few_for_headline": q < HEADLINE_MIN_N}
