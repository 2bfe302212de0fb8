"""Interval estimates and comparisons for held-out team accuracy.

Each arm (grpo, ada, raft, mixed) is trained with a few seeds; each evaluation yields one reward
per held-out problem (the mean over 2 chats of a team reward in {0, 0.5, 1}). This module turns
those rewards into interval estimates and comparisons, in the manner of rliable's ``metrics.py``
(Agarwal et al. 2021, "Deep Reinforcement Learning at the Edge of the Statistical Precipice",
arXiv:2108.13264): one small estimator per function, numpy only.

* ``bootstrap_ci``: percentile bootstrap of the mean of a 1-D sample.
* ``hierarchical_bootstrap_ci``: interval over seeds *and* problems of a (seeds x problems)
  reward matrix.
* ``paired_bootstrap_test`` / ``learned``: one-sided paired test that one evaluation beats
  another on the same problems.
* ``probability_of_improvement`` / ``probability_of_improvement_ci``: P(X > Y) over run scores
  (Mann-Whitney U / (n_x n_y), ties count 1/2), with a bootstrap over runs.
* ``intervals_overlap``: whether two closed intervals meet.

Randomness comes only from the ``seed`` argument: an ``int`` (a fresh
``np.random.default_rng(seed)`` per call, so equal seeds give equal outputs) or an
``np.random.Generator`` (used and advanced in place). ``None`` is refused, so every result is
reproducible. Functions do no I/O.

Interval endpoints are percentiles (numpy's default linear interpolation) of the bootstrap
distribution; the point estimate returned with them is the plain sample statistic, not the
bootstrap mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "ConfidenceInterval",
    "bootstrap_ci",
    "hierarchical_bootstrap_ci",
    "paired_bootstrap_test",
    "learned",
    "probability_of_improvement",
    "probability_of_improvement_ci",
    "intervals_overlap",
]

SeedLike = int | np.random.Generator

# Replicates are drawn in chunks so that no temporary holds many more than this many elements.
# The chunk length depends only on the input shape, so outputs stay deterministic for a seed.
_MAX_CHUNK_ELEMENTS = 1 << 22


class ConfidenceInterval(NamedTuple):
    """A point estimate with a two-sided interval; unpacks as ``(mean, lo, hi)``."""

    mean: float
    lo: float
    hi: float


# ---------------------------------------------------------------------------------------------
# Validation and random-number helpers.
# ---------------------------------------------------------------------------------------------


def _as_1d(values, name: str) -> np.ndarray:
    """Returns ``values`` as a non-empty, finite, 1-D float array or raises ``ValueError``."""
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D; got shape {arr.shape}.")
    if arr.size == 0:
        raise ValueError(f"{name} is empty; need at least one value.")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinite values.")
    return arr


def _as_2d(values, name: str) -> np.ndarray:
    """Returns ``values`` as a non-empty, finite, 2-D float array or raises ``ValueError``."""
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (seeds x problems); got shape {arr.shape}.")
    if arr.size == 0:
        raise ValueError(f"{name} is empty; got shape {arr.shape}.")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinite values.")
    return arr


def _check_n_boot(n_boot: int) -> int:
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be a positive integer; got {n_boot!r}.")
    return int(n_boot)


def _check_alpha(alpha: float) -> float:
    if not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha must lie strictly between 0 and 1; got {alpha!r}.")
    return float(alpha)


def _rng(seed: SeedLike) -> np.random.Generator:
    """Returns a generator for ``seed``: an int seeds a fresh one, a Generator is used as is."""
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int or np.random.Generator; got {type(seed).__name__}.")
    return np.random.default_rng(int(seed))


def _child_rng(rng: np.random.Generator) -> np.random.Generator:
    """An independent generator derived from ``rng`` without advancing ``rng``'s own stream."""
    try:
        return rng.spawn(1)[0]
    except (TypeError, ValueError, AttributeError):  # bit generator without a SeedSequence
        return np.random.default_rng(rng.integers(np.iinfo(np.int64).max))


def _chunks(n_boot: int, elements_per_replicate: int):
    """Yields replicate counts summing to ``n_boot``, sized by ``_MAX_CHUNK_ELEMENTS``."""
    step = max(1, _MAX_CHUNK_ELEMENTS // max(1, elements_per_replicate))
    for start in range(0, n_boot, step):
        yield min(step, n_boot - start)


def _bootstrap_means(values: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Means of ``n_boot`` with-replacement resamples of the 1-D array ``values``."""
    n = values.shape[0]
    out = np.empty(n_boot)
    pos = 0
    for size in _chunks(n_boot, n):
        idx = rng.integers(0, n, size=(size, n))
        out[pos : pos + size] = values[idx].mean(axis=1)
        pos += size
    return out


def _percentile_interval(replicates: np.ndarray, alpha: float) -> tuple[float, float]:
    lo, hi = np.quantile(replicates, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(lo), float(hi)


# ---------------------------------------------------------------------------------------------
# Estimators.
# ---------------------------------------------------------------------------------------------


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    n_boot: int = 10_000,
    alpha: float = 0.05,
    seed: SeedLike = 0,
) -> ConfidenceInterval:
    """Percentile bootstrap interval for the mean of a 1-D sample.

    Each replicate resamples the ``n`` values with replacement and takes their mean; the
    interval is the (alpha/2, 1 - alpha/2) percentiles of the replicate means. A sample whose
    values are all equal gives a zero-width interval.

    Args:
      values: 1-D sample, e.g. per-problem rewards of one evaluation. Must be non-empty and
        finite.
      n_boot: Number of bootstrap replicates.
      alpha: Two-sided level; the interval has nominal coverage ``1 - alpha``.
      seed: An int (fresh generator) or an ``np.random.Generator`` (advanced in place).

    Returns:
      ``ConfidenceInterval(mean, lo, hi)``: the sample mean and the interval endpoints.

    Raises:
      ValueError: If ``values`` is empty, not 1-D or not finite, or ``n_boot``/``alpha`` is
        out of range.
    """
    x = _as_1d(values, "values")
    n_boot, alpha = _check_n_boot(n_boot), _check_alpha(alpha)
    replicates = _bootstrap_means(x, n_boot, _rng(seed))
    lo, hi = _percentile_interval(replicates, alpha)
    return ConfidenceInterval(float(x.mean()), lo, hi)


def hierarchical_bootstrap_ci(
    per_seed_problem_rewards: np.ndarray,
    n_boot: int = 10_000,
    alpha: float = 0.05,
    seed: SeedLike = 0,
) -> ConfidenceInterval:
    """Percentile bootstrap interval for the grand mean over seeds and problems.

    Each replicate draws ``S`` seed indices with replacement and, independently, ``P``
    problem indices with replacement, and takes the mean of the ``S x P`` submatrix they pick
    out. The interval thus reflects both training-seed variation and the sampling of held-out
    problems.

    Design choice: one problem index set is drawn per replicate and used for every resampled
    seed. The held-out problems are the same for all seeds (a crossed, not nested, design), so
    a hard problem is hard for every seed; resampling problems jointly keeps that shared
    problem effect in the interval. Drawing problems independently per seed would average it
    away and give intervals that are too narrow. Resampling rows and columns independently is
    the "pigeonhole" bootstrap (Owen 2007, "The pigeonhole bootstrap", Ann. Appl. Stat.), whose
    variance is mildly conservative. With ``S = 1`` the seed draw is trivial and the result equals
    ``bootstrap_ci`` on that row for the same ``seed``; with identical rows it likewise equals
    ``bootstrap_ci`` on one row. Problem indices come from the generator's own stream and seed
    indices from an independent child stream, so that these reductions hold exactly.

    Caution: with only a few seeds (e.g. 3, which admit 10 distinct resamples) the seed-level
    part of the bootstrap is coarse, and the interval tends to understate seed variance.

    Args:
      per_seed_problem_rewards: Array of shape ``(S, P)``; entry ``[s, p]`` is the reward of
        seed ``s`` on problem ``p``. Must be non-empty and finite.
      n_boot: Number of bootstrap replicates.
      alpha: Two-sided level; the interval has nominal coverage ``1 - alpha``.
      seed: An int (fresh generator) or an ``np.random.Generator`` (advanced in place).

    Returns:
      ``ConfidenceInterval(mean, lo, hi)``: the mean of the whole matrix and the interval
      endpoints.

    Raises:
      ValueError: If the input is empty, not 2-D or not finite, or ``n_boot``/``alpha`` is out
        of range.
    """
    x = _as_2d(per_seed_problem_rewards, "per_seed_problem_rewards")
    n_boot, alpha = _check_n_boot(n_boot), _check_alpha(alpha)
    rng = _rng(seed)
    seed_rng = _child_rng(rng)
    num_seeds, num_problems = x.shape
    replicates = np.empty(n_boot)
    pos = 0
    # Chunk on the per-row problem count so that S = 1 draws exactly as ``bootstrap_ci`` does.
    for size in _chunks(n_boot, num_problems):
        problem_idx = rng.integers(0, num_problems, size=(size, num_problems))
        seed_idx = seed_rng.integers(0, num_seeds, size=(size, num_seeds))
        # row_means[s, b]: mean of seed s over replicate b's problems.
        row_means = np.empty((num_seeds, size))
        for s in range(num_seeds):
            row_means[s] = x[s][problem_idx].mean(axis=1)
        picked = np.take_along_axis(row_means.T, seed_idx, axis=1)  # (size, S)
        replicates[pos : pos + size] = picked.mean(axis=1)
        pos += size
    lo, hi = _percentile_interval(replicates, alpha)
    return ConfidenceInterval(float(x.mean()), lo, hi)


def paired_bootstrap_test(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    n_boot: int = 10_000,
    seed: SeedLike = 0,
    alpha: float = 0.05,
) -> dict[str, float]:
    """One-sided paired bootstrap test that mean(a) > mean(b) on the same problems.

    The per-problem differences ``d = a - b`` are resampled with replacement (problem indices
    shared by ``a`` and ``b``, which keeps the pairing) and each replicate's mean is taken.
    With ``k`` the number of replicate means ``<= 0``, the p-value is ``(k + 1) / (n_boot + 1)``
    (the usual Monte Carlo +1 correction, so it is never zero). It is the bootstrap-percentile
    p-value for H0: mean(d) <= 0 against H1: mean(d) > 0: ``p_value <= q`` holds, up to the
    +1 correction, exactly when the ``q``-quantile of the replicate means is above zero, i.e.
    when the one-sided ``1 - q`` percentile lower bound excludes zero.

    Args:
      a: 1-D per-problem values of the candidate (e.g. a trained run).
      b: 1-D per-problem values of the reference, aligned with ``a`` problem by problem.
      n_boot: Number of bootstrap replicates.
      seed: An int (fresh generator) or an ``np.random.Generator`` (advanced in place).
      alpha: Two-sided level of the reported interval ``[lo, hi]`` (nominal coverage
        ``1 - alpha``, as in ``bootstrap_ci``). It does not affect ``p_value``.

    Returns:
      Dict with ``diff`` (mean of ``a - b``), ``lo`` and ``hi`` (percentile interval of the
      mean difference) and ``p_value`` (one-sided, for mean(a) > mean(b)).

    Raises:
      ValueError: If ``a``/``b`` are empty, not 1-D, not finite or of different lengths, or
        ``n_boot``/``alpha`` is out of range.
    """
    a_arr, b_arr = _as_1d(a, "a"), _as_1d(b, "b")
    if a_arr.shape != b_arr.shape:
        raise ValueError(f"a and b must be paired (same length); got {a_arr.size} and {b_arr.size}.")
    n_boot, alpha = _check_n_boot(n_boot), _check_alpha(alpha)
    d = a_arr - b_arr
    replicates = _bootstrap_means(d, n_boot, _rng(seed))
    lo, hi = _percentile_interval(replicates, alpha)
    k = int(np.count_nonzero(replicates <= 0.0))
    return {
        "diff": float(d.mean()),
        "lo": lo,
        "hi": hi,
        "p_value": (k + 1) / (n_boot + 1),
    }


def learned(
    run_rewards: Sequence[float] | np.ndarray,
    base_rewards: Sequence[float] | np.ndarray,
    alpha: float = 0.05,
    n_boot: int = 10_000,
    seed: SeedLike = 0,
) -> bool:
    """Whether a run beats the base model on the same problems, one-sided at level ``alpha``.

    Args:
      run_rewards: 1-D per-problem rewards of the trained run.
      base_rewards: 1-D per-problem rewards of the base model, aligned with ``run_rewards``.
      alpha: One-sided level; the default 0.05 is a one-sided 95% test.
      n_boot: Number of bootstrap replicates of ``paired_bootstrap_test``.
      seed: An int (fresh generator) or an ``np.random.Generator`` (advanced in place).

    Returns:
      True if the ``paired_bootstrap_test`` p-value is ``<= alpha``.

    Raises:
      ValueError: As ``paired_bootstrap_test``, or if ``n_boot`` is too small for any p-value
        to reach ``alpha`` (``1 / (n_boot + 1) > alpha``).
    """
    alpha = _check_alpha(alpha)
    n_boot = _check_n_boot(n_boot)
    if 1.0 / (n_boot + 1) > alpha:
        raise ValueError(f"n_boot={n_boot} is too small: the smallest p-value 1/(n_boot+1) exceeds alpha={alpha}.")
    result = paired_bootstrap_test(run_rewards, base_rewards, n_boot=n_boot, seed=seed)
    return bool(result["p_value"] <= alpha)


def probability_of_improvement(
    x_runs: Sequence[float] | np.ndarray,
    y_runs: Sequence[float] | np.ndarray,
) -> float:
    """Probability of improvement P(X > Y) of arm ``X`` over arm ``Y``.

    As in rliable (Agarwal et al. 2021): the Mann-Whitney U statistic of ``X`` against ``Y``
    divided by ``n_x * n_y``, i.e. the share of all (x, y) run pairs with ``x > y``, a tie
    counting 1/2. Hence ``P(X > Y) + P(Y > X) = 1`` and identical samples give 0.5.

    Args:
      x_runs: 1-D scores of the runs (e.g. seeds) of arm ``X``.
      y_runs: 1-D scores of the runs of arm ``Y``.

    Returns:
      The probability of improvement, in [0, 1].

    Raises:
      ValueError: If either input is empty, not 1-D or not finite.
    """
    x, y = _as_1d(x_runs, "x_runs"), _as_1d(y_runs, "y_runs")
    y_sorted = np.sort(y)
    below = np.searchsorted(y_sorted, x, side="left")  # count of y < x, per x
    below_or_tied = np.searchsorted(y_sorted, x, side="right")  # count of y <= x, per x
    u_stat = below.sum() + 0.5 * (below_or_tied - below).sum()
    return float(u_stat / (x.size * y.size))


def probability_of_improvement_ci(
    x_runs: Sequence[float] | np.ndarray,
    y_runs: Sequence[float] | np.ndarray,
    n_boot: int = 10_000,
    seed: SeedLike = 0,
    alpha: float = 0.05,
) -> ConfidenceInterval:
    """Probability of improvement with a percentile bootstrap interval over runs.

    Each replicate resamples the runs of ``X`` and, independently, the runs of ``Y`` with
    replacement (rliable's stratified bootstrap with a single task) and recomputes
    ``probability_of_improvement``. With few runs per arm (e.g. 3) the bootstrap distribution
    takes only a handful of values and the interval is coarse.

    Args:
      x_runs: 1-D scores of the runs of arm ``X``.
      y_runs: 1-D scores of the runs of arm ``Y``.
      n_boot: Number of bootstrap replicates.
      seed: An int (fresh generator) or an ``np.random.Generator`` (advanced in place).
      alpha: Two-sided level; the interval has nominal coverage ``1 - alpha``.

    Returns:
      ``ConfidenceInterval(mean, lo, hi)`` with ``mean`` the probability of improvement on the
      observed runs.

    Raises:
      ValueError: If either input is empty, not 1-D or not finite, or ``n_boot``/``alpha`` is
        out of range.
    """
    x, y = _as_1d(x_runs, "x_runs"), _as_1d(y_runs, "y_runs")
    n_boot, alpha = _check_n_boot(n_boot), _check_alpha(alpha)
    rng = _rng(seed)
    # wins[i, j] = 1 if x_i > y_j, 1/2 if tied, 0 otherwise; a replicate averages a
    # resampled block of it.
    wins = (x[:, None] > y[None, :]) + 0.5 * (x[:, None] == y[None, :])
    nx, ny = x.size, y.size
    replicates = np.empty(n_boot)
    pos = 0
    for size in _chunks(n_boot, nx * ny):
        ix = rng.integers(0, nx, size=(size, nx))
        iy = rng.integers(0, ny, size=(size, ny))
        replicates[pos : pos + size] = wins[ix[:, :, None], iy[:, None, :]].mean(axis=(1, 2))
        pos += size
    lo, hi = _percentile_interval(replicates, alpha)
    return ConfidenceInterval(probability_of_improvement(x, y), lo, hi)


def intervals_overlap(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two closed intervals share at least one point (touching counts).

    Note that overlap of two 95% intervals is not a test of a difference: intervals can
    overlap while the difference is significant (Schenker & Gentleman 2001). Use
    ``paired_bootstrap_test`` for paired comparisons.

    Args:
      a: ``(lo, hi)`` of the first interval.
      b: ``(lo, hi)`` of the second interval.

    Returns:
      True if ``a`` and ``b`` intersect.

    Raises:
      ValueError: If an interval is not a pair, has ``lo > hi``, or has NaN endpoints.
    """
    bounds = []
    for name, interval in (("a", a), ("b", b)):
        arr = np.asarray(interval, dtype=float)
        if arr.shape != (2,):
            raise ValueError(f"{name} must be a (lo, hi) pair; got shape {arr.shape}.")
        lo, hi = float(arr[0]), float(arr[1])
        if np.isnan(lo) or np.isnan(hi) or lo > hi:
            raise ValueError(f"{name} must satisfy lo <= hi; got ({lo}, {hi}).")
        bounds.append((lo, hi))
    (a_lo, a_hi), (b_lo, b_hi) = bounds
    return a_lo <= b_hi and b_lo <= a_hi
