"""Tests for talkmethods.stats, with hand-computed fixtures in the manner of rliable's tests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talkmethods import stats

# ---------------------------------------------------------------------------------------------
# probability_of_improvement
# ---------------------------------------------------------------------------------------------


def _poi_brute_force(x, y):
    """P(X > Y) by the definition: a double loop over run pairs, ties counting 1/2."""
    total = sum(1.0 if xi > yi else 0.5 if xi == yi else 0.0 for xi in x for yi in y)
    return total / (len(x) * len(y))


def test_poi_dominant_is_one_and_reverse_is_zero():
    assert stats.probability_of_improvement([1, 2, 3], [0, 0, 0]) == 1.0
    assert stats.probability_of_improvement([0, 0, 0], [1, 2, 3]) == 0.0


@pytest.mark.parametrize("scores", [[1.0, 2.0, 3.0], [0.4, 0.4, 0.4], [0.7], [0.2, 0.9, 0.2]])
def test_poi_identical_is_half(scores):
    assert stats.probability_of_improvement(scores, scores) == 0.5


def test_poi_hand_worked_ties():
    # x = [0.5, 0.6, 0.6], y = [0.6, 0.4]. Pairs (x, y) -> credit:
    #   (0.5, 0.6) 0   (0.5, 0.4) 1
    #   (0.6, 0.6) 1/2 (0.6, 0.4) 1
    #   (0.6, 0.6) 1/2 (0.6, 0.4) 1
    # Sum 4 over 3 * 2 = 6 pairs -> 2/3.
    assert stats.probability_of_improvement([0.5, 0.6, 0.6], [0.6, 0.4]) == pytest.approx(2 / 3)
    assert stats.probability_of_improvement([0.6, 0.4], [0.5, 0.6, 0.6]) == pytest.approx(1 / 3)


def test_poi_all_tied_with_one_win():
    # x = [1, 1], y = [1, 0]: pairs 1/2, 1, 1/2, 1 -> 3/4.
    assert stats.probability_of_improvement([1, 1], [1, 0]) == 0.75


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=6),
    st.lists(st.integers(0, 4), min_size=1, max_size=6),
)
def test_poi_matches_definition_and_is_complementary(x, y):
    # Small integer scores force many ties.
    x = [v / 4 for v in x]
    y = [v / 4 for v in y]
    p_xy = stats.probability_of_improvement(x, y)
    assert p_xy == pytest.approx(_poi_brute_force(x, y))
    assert p_xy + stats.probability_of_improvement(y, x) == pytest.approx(1.0)
    assert 0.0 <= p_xy <= 1.0


def test_poi_ci_degenerate_cases_are_exact():
    assert tuple(stats.probability_of_improvement_ci([1, 2, 3], [0, 0, 0], n_boot=500)) == (
        1.0,
        1.0,
        1.0,
    )
    assert tuple(stats.probability_of_improvement_ci([0.5] * 3, [0.5] * 3, n_boot=500)) == (
        0.5,
        0.5,
        0.5,
    )


def test_poi_ci_hand_worked_two_by_one():
    # x = [0, 1], y = [0.5]: a resample of x is {0,0}, {0,1}/{1,0} or {1,1} with probability
    # 1/4, 1/2, 1/4, giving P(X > Y) = 0, 1/2, 1. The 95% interval is [0, 1]; the 40% one
    # (alpha = 0.6, percentiles 30 and 70) is [1/2, 1/2].
    point, lo, hi = stats.probability_of_improvement_ci([0, 1], [0.5], n_boot=4000, seed=1)
    assert (point, lo, hi) == (0.5, 0.0, 1.0)
    _, lo, hi = stats.probability_of_improvement_ci([0, 1], [0.5], n_boot=4000, seed=1, alpha=0.6)
    assert (lo, hi) == (0.5, 0.5)


def test_poi_ci_contains_point_and_is_deterministic():
    x, y = [0.61, 0.58, 0.64], [0.57, 0.60, 0.55]
    first = stats.probability_of_improvement_ci(x, y, n_boot=2000, seed=3)
    assert first == stats.probability_of_improvement_ci(x, y, n_boot=2000, seed=3)
    assert first.mean == pytest.approx(_poi_brute_force(x, y))
    assert 0.0 <= first.lo <= first.mean <= first.hi <= 1.0


# ---------------------------------------------------------------------------------------------
# bootstrap_ci
# ---------------------------------------------------------------------------------------------


def test_bootstrap_hand_worked_two_points():
    # Resample means of [0, 1] are 0, 1/2, 1 with probability 1/4, 1/2, 1/4.
    mean, lo, hi = stats.bootstrap_ci([0.0, 1.0], n_boot=4000, seed=0)
    assert (mean, lo, hi) == (0.5, 0.0, 1.0)
    _, lo, hi = stats.bootstrap_ci([0.0, 1.0], n_boot=4000, alpha=0.6, seed=0)
    assert (lo, hi) == (0.5, 0.5)


@pytest.mark.parametrize("value", [0.0, 0.5, 1.0])
def test_bootstrap_all_equal_gives_zero_width(value):
    mean, lo, hi = stats.bootstrap_ci([value] * 300, n_boot=1000)
    assert mean == lo == hi == value


def test_bootstrap_all_equal_inexact_float_gives_zero_width():
    mean, lo, hi = stats.bootstrap_ci([0.1] * 50, n_boot=1000)
    assert lo == hi
    assert mean == pytest.approx(0.1) and lo == pytest.approx(0.1)


def test_bootstrap_single_value():
    assert tuple(stats.bootstrap_ci([0.25], n_boot=100)) == (0.25, 0.25, 0.25)


def test_bootstrap_returns_named_tuple_of_floats():
    result = stats.bootstrap_ci(np.array([0.0, 0.5, 1.0, 1.0]), n_boot=200)
    assert isinstance(result, tuple) and len(result) == 3
    assert result.mean == result[0] and result.lo == result[1] and result.hi == result[2]
    assert all(type(v) is float for v in result)


def test_bootstrap_is_deterministic_for_a_seed():
    values = np.random.default_rng(11).choice([0.0, 0.5, 1.0], size=300)
    assert stats.bootstrap_ci(values, seed=5) == stats.bootstrap_ci(values, seed=5)
    assert stats.bootstrap_ci(values, seed=5) != stats.bootstrap_ci(values, seed=6)
    # An explicit Generator draws the same stream as the int that seeds it.
    assert stats.bootstrap_ci(values, seed=np.random.default_rng(5)) == stats.bootstrap_ci(values, seed=5)


def test_bootstrap_interval_shrinks_with_sample_size():
    rng = np.random.default_rng(2)
    small = stats.bootstrap_ci(rng.binomial(1, 0.3, size=30), n_boot=2000)
    large = stats.bootstrap_ci(rng.binomial(1, 0.3, size=3000), n_boot=2000)
    assert large.hi - large.lo < small.hi - small.lo


@pytest.mark.parametrize(
    "draw, true_mean",
    [
        (lambda rng, n: rng.binomial(1, 0.3, size=n).astype(float), 0.3),
        (lambda rng, n: rng.normal(2.0, 1.5, size=n), 2.0),
        # The task's reward scale: mean of two chats each in {0, 0.5, 1}.
        (lambda rng, n: rng.choice([0.0, 0.5, 1.0], p=[0.5, 0.2, 0.3], size=(n, 2)).mean(1), 0.4),
    ],
    ids=["bernoulli", "normal", "team_reward"],
)
def test_bootstrap_coverage(draw, true_mean):
    # 400 samples of size 50; the 95% interval should cover the true mean about 95% of the
    # time (the percentile bootstrap runs slightly low at n = 50).
    rng = np.random.default_rng(2024)
    trials = 400
    covered = 0
    for trial in range(trials):
        _, lo, hi = stats.bootstrap_ci(draw(rng, 50), n_boot=1000, seed=trial)
        covered += lo <= true_mean <= hi
    assert 0.90 <= covered / trials <= 0.99


@pytest.mark.parametrize("bad", [[], np.array([]), np.zeros((0,))])
def test_bootstrap_empty_raises(bad):
    with pytest.raises(ValueError, match="empty"):
        stats.bootstrap_ci(bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"values": [0.0, float("nan")]}, "NaN"),
        ({"values": [[0.0, 1.0]]}, "1-D"),
        ({"values": [0.0, 1.0], "alpha": 0.0}, "alpha"),
        ({"values": [0.0, 1.0], "alpha": 1.5}, "alpha"),
        ({"values": [0.0, 1.0], "n_boot": 0}, "n_boot"),
    ],
)
def test_bootstrap_invalid_inputs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        stats.bootstrap_ci(**kwargs)


def test_seed_none_is_refused():
    with pytest.raises(TypeError, match="seed"):
        stats.bootstrap_ci([0.0, 1.0], seed=None)


# ---------------------------------------------------------------------------------------------
# hierarchical_bootstrap_ci
# ---------------------------------------------------------------------------------------------


def _reward_matrix(num_seeds, num_problems, seed=0):
    rng = np.random.default_rng(seed)
    return rng.choice([0.0, 0.5, 1.0], size=(num_seeds, num_problems, 2)).mean(axis=2)


def test_hierarchical_single_seed_equals_problem_bootstrap():
    row = _reward_matrix(1, 300)[0]
    for seed in (0, 7):
        assert stats.hierarchical_bootstrap_ci(row[None, :], n_boot=2000, seed=seed) == (
            stats.bootstrap_ci(row, n_boot=2000, seed=seed)
        )


def test_hierarchical_identical_seeds_equal_problem_bootstrap():
    # Identical rows make seed resampling a no-op, so the interval is the problem bootstrap of
    # one row. This also pins the shared-problem-index design: resampling problems
    # independently per seed would average 3 resamples and give a narrower interval.
    row = _reward_matrix(1, 300, seed=4)[0]
    matrix = np.tile(row, (3, 1))
    got = stats.hierarchical_bootstrap_ci(matrix, n_boot=2000, seed=9)
    want = stats.bootstrap_ci(row, n_boot=2000, seed=9)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_hierarchical_hand_worked_seed_only_variation():
    # Seed 0 scores 0 everywhere and seed 1 scores 1 everywhere, so the problems do not
    # matter: a replicate picks seeds {0,0}, {0,1}/{1,0} or {1,1} with probability 1/4, 1/2,
    # 1/4, giving 0, 1/2, 1.
    matrix = np.array([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert stats.hierarchical_bootstrap_ci(matrix, n_boot=4000) == (0.5, 0.0, 1.0)
    _, lo, hi = stats.hierarchical_bootstrap_ci(matrix, n_boot=4000, alpha=0.6)
    assert (lo, hi) == (0.5, 0.5)


def test_hierarchical_constant_matrix_gives_zero_width():
    assert stats.hierarchical_bootstrap_ci(np.full((3, 300), 0.5), n_boot=500) == (0.5, 0.5, 0.5)


def test_hierarchical_mean_is_grand_mean():
    matrix = _reward_matrix(3, 300, seed=1)
    mean, lo, hi = stats.hierarchical_bootstrap_ci(matrix, n_boot=1000)
    assert mean == pytest.approx(matrix.mean())
    assert lo <= mean <= hi


def test_hierarchical_seed_variation_widens_interval():
    # Same problem pattern, seeds shifted by -0.1, 0, +0.1 (kept inside [0, 1]): the seed
    # spread must widen the interval relative to ignoring seeds (pooling into seed means).
    base = np.clip(_reward_matrix(1, 300, seed=2)[0], 0.1, 0.9)
    matrix = base[None, :] + np.array([[-0.1], [0.0], [0.1]])
    hier = stats.hierarchical_bootstrap_ci(matrix, n_boot=2000)
    pooled = stats.bootstrap_ci(matrix.mean(axis=0), n_boot=2000)
    assert hier.mean == pytest.approx(pooled.mean)
    assert (hier.hi - hier.lo) > 1.5 * (pooled.hi - pooled.lo)


def test_hierarchical_is_deterministic():
    matrix = _reward_matrix(3, 300, seed=3)
    first = stats.hierarchical_bootstrap_ci(matrix, n_boot=1500, seed=2)
    assert first == stats.hierarchical_bootstrap_ci(matrix, n_boot=1500, seed=2)
    assert first != stats.hierarchical_bootstrap_ci(matrix, n_boot=1500, seed=3)


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.zeros((0, 300)), "empty"),
        (np.zeros((3, 0)), "empty"),
        (np.zeros(300), "2-D"),
        (np.array([[0.0, np.inf]]), "NaN or infinite"),
    ],
)
def test_hierarchical_invalid_inputs_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        stats.hierarchical_bootstrap_ci(bad)


# ---------------------------------------------------------------------------------------------
# paired_bootstrap_test and learned
# ---------------------------------------------------------------------------------------------


def test_paired_clear_shift_has_minimal_p_value():
    base = _reward_matrix(1, 300, seed=5)[0]
    run = np.minimum(base + 0.5, 1.0)
    assert np.all(run >= base) and np.any(run > base)
    result = stats.paired_bootstrap_test(run, base, n_boot=2000, seed=0)
    assert result["diff"] == pytest.approx(np.mean(run - base))
    assert result["p_value"] == 1 / 2001
    assert 0.0 < result["lo"] <= result["diff"] <= result["hi"]
    assert stats.learned(run, base)
    assert not stats.learned(base, run)


def test_paired_no_difference_has_large_p_value():
    # Differences are +1/2 and -1/2 in equal numbers: mean 0 and a symmetric bootstrap
    # distribution, so about half the replicates are <= 0.
    base = np.full(300, 0.5)
    run = base + np.tile([0.5, -0.5], 150)
    result = stats.paired_bootstrap_test(run, base, n_boot=4000, seed=0)
    assert result["diff"] == 0.0
    assert 0.4 < result["p_value"] < 0.7
    assert result["lo"] < 0.0 < result["hi"]
    assert not stats.learned(run, base)


def test_paired_identical_inputs_give_p_one():
    values = _reward_matrix(1, 300, seed=6)[0]
    result = stats.paired_bootstrap_test(values, values, n_boot=999)
    assert result == {"diff": 0.0, "lo": 0.0, "hi": 0.0, "p_value": 1.0}
    assert not stats.learned(values, values)


def test_paired_hand_worked_p_value():
    # d = a - b = [1, -1]: replicate means are 1, 0, -1 with probability 1/4, 1/2, 1/4, so
    # about 3/4 of replicates are <= 0 and p = (k + 1) / (n + 1) is about 0.75.
    result = stats.paired_bootstrap_test([1.0, 0.0], [0.0, 1.0], n_boot=4000, seed=0)
    assert result["diff"] == 0.0
    assert result["p_value"] == pytest.approx(0.75, abs=0.02)
    assert (result["lo"], result["hi"]) == (-1.0, 1.0)


def test_pairing_detects_a_shift_that_overlapping_intervals_hide():
    # Rewards vary a lot across problems; the run improves 20 of 300 problems by 0.5 and is
    # otherwise identical. The two arms' intervals overlap, but the paired test sees the shift.
    base = _reward_matrix(1, 300, seed=8)[0]
    run = base.copy()
    improvable = np.flatnonzero(base <= 0.5)[:20]
    run[improvable] += 0.5
    ci_run = stats.bootstrap_ci(run, n_boot=2000)
    ci_base = stats.bootstrap_ci(base, n_boot=2000)
    assert stats.intervals_overlap(ci_run[1:], ci_base[1:])
    result = stats.paired_bootstrap_test(run, base, n_boot=2000)
    assert result["p_value"] < 0.01
    assert stats.learned(run, base, n_boot=2000)


def test_paired_type_one_error_is_near_alpha():
    # Under H0 (mean difference 0) the test at level 0.05 should reject about 5% of the time.
    rng = np.random.default_rng(77)
    trials = 300
    rejections = sum(
        stats.paired_bootstrap_test(rng.normal(size=60), np.zeros(60), n_boot=500, seed=t)["p_value"] <= 0.05
        for t in range(trials)
    )
    assert 0.01 <= rejections / trials <= 0.11


def test_paired_is_deterministic():
    a, b = _reward_matrix(2, 300, seed=10)
    assert stats.paired_bootstrap_test(a, b, seed=4) == stats.paired_bootstrap_test(a, b, seed=4)


@pytest.mark.parametrize(
    "a, b, match",
    [
        ([0.0, 1.0], [0.0], "same length"),
        ([], [], "empty"),
        ([0.0, np.nan], [0.0, 1.0], "NaN"),
    ],
)
def test_paired_invalid_inputs_raise(a, b, match):
    with pytest.raises(ValueError, match=match):
        stats.paired_bootstrap_test(a, b)


def test_learned_refuses_n_boot_too_small_for_alpha():
    with pytest.raises(ValueError, match="too small"):
        stats.learned([1.0, 1.0], [0.0, 0.0], alpha=0.05, n_boot=10)
    # n_boot = 19 is the smallest that can reach 0.05: p = 1/20 when every replicate is > 0.
    assert stats.learned([1.0, 1.0], [0.0, 0.0], alpha=0.05, n_boot=19)


# ---------------------------------------------------------------------------------------------
# intervals_overlap
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ((0.0, 1.0), (0.5, 2.0), True),  # partial overlap
        ((0.0, 1.0), (1.0, 2.0), True),  # touching endpoints
        ((0.0, 3.0), (1.0, 2.0), True),  # nested
        ((0.2, 0.2), (0.2, 0.2), True),  # identical points
        ((0.0, 1.0), (1.1, 2.0), False),  # disjoint
        ((0.41, 0.47), (0.48, 0.55), False),
    ],
)
def test_intervals_overlap(a, b, expected):
    assert stats.intervals_overlap(a, b) is expected
    assert stats.intervals_overlap(b, a) is expected


@pytest.mark.parametrize("bad", [(1.0, 0.0), (0.0,), (0.0, 1.0, 2.0), (np.nan, 1.0)])
def test_intervals_overlap_invalid_raise(bad):
    with pytest.raises(ValueError):
        stats.intervals_overlap(bad, (0.0, 1.0))


def test_public_api_is_exported():
    for name in stats.__all__:
        assert callable(getattr(stats, name))
