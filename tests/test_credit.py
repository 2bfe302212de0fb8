"""Tests for talkmethods.credit: every arm's credit rule on hand-computed groups, and Ada's replays.

All expected numbers below are worked out by hand from DESIGN §2 (the arms table), not by calling
the code under test.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talkmethods.credit import (
    A_TURNS_ONLY,
    ALL_TURNS,
    ARM_PLANS,
    CREDIT_RULES,
    Credit,
    ada,
    draw_with_replays,
    grpo,
    is_uniform,
    mixed,
    raft,
)

F, T = False, True
ALL = (True, True, True, True)
A_ONLY = (True, False, True, False)  # A1, A2 trained; B1, B2 (the base model's) not


def approx(xs):
    return pytest.approx(list(xs), abs=1e-12)


# --------------------------------------------------------------------------------------- grpo


def test_grpo_mixed_rewards_minus_the_mean():
    c = grpo([1.0, 0.0, 0.5, 0.5], [F, F, F, F])
    assert c.kept == (0, 1, 2, 3)
    assert list(c.advantages) == approx([0.5, -0.5, 0.0, 0.0])  # mean 0.5, no std division
    assert c.trained_turns == (ALL, ALL, ALL, ALL)


def test_grpo_no_std_division():
    # mean 0.25; with a std division the advantages would be about ±1.73/0.58, not these.
    c = grpo([1.0, 0.0, 0.0, 0.0], [F] * 4)
    assert list(c.advantages) == approx([0.75, -0.25, -0.25, -0.25])


@pytest.mark.parametrize("r", [0.0, 0.5, 1.0])
def test_grpo_uniform_group_is_all_zero(r):
    c = grpo([r] * 4, [F] * 4)
    assert c.kept == (0, 1, 2, 3)
    assert list(c.advantages) == [0.0, 0.0, 0.0, 0.0]


# --------------------------------------------------------------------------------------- raft


def test_raft_only_a_full_solve_gets_credit():
    c = raft([1.0, 0.0, 0.5, 1.0], [F] * 4)
    assert c.kept == (0, 1, 2, 3)
    assert list(c.advantages) == [1.0, 0.0, 0.0, 1.0]  # 0.5 (one seat right) gets nothing
    assert c.trained_turns == (ALL,) * 4


def test_raft_has_no_baseline():
    # All solved: RAFT still gives 1 to each (SFT on the successes); GRPO would give 0.
    assert list(raft([1.0] * 4, [F] * 4).advantages) == [1.0] * 4
    assert list(raft([0.5] * 4, [F] * 4).advantages) == [0.0] * 4


# -------------------------------------------------------------------------------------- mixed


def test_mixed_same_advantages_as_grpo_but_base_b_turns_untrained():
    rewards, b_base = [1.0, 0.0, 0.5, 0.5], [F, F, T, T]
    c = mixed(rewards, b_base)
    assert c.kept == (0, 1, 2, 3)
    assert list(c.advantages) == approx([0.5, -0.5, 0.0, 0.0])  # baseline over ALL 4 chats
    assert c.trained_turns == (ALL, ALL, A_ONLY, A_ONLY)


def test_trained_turns_follow_b_base_not_position():
    c = mixed([0.0, 1.0, 0.0, 1.0], [T, F, F, T])
    assert list(c.advantages) == approx([-0.5, 0.5, -0.5, 0.5])
    assert c.trained_turns == (A_ONLY, ALL, ALL, A_ONLY)
    assert A_TURNS_ONLY == A_ONLY and ALL_TURNS == ALL


# ---------------------------------------------------------------------------------------- ada


def test_ada_four_drawn_keeps_all_baseline_mean_of_four():
    c = ada([1.0, 0.0, 0.5, 0.5], [F] * 4)
    assert c.kept == (0, 1, 2, 3)
    assert list(c.advantages) == approx([0.5, -0.5, 0.0, 0.0])
    assert c.trained_turns == (ALL,) * 4


def test_ada_eight_drawn_two_highest_two_lowest_baseline_over_all_eight():
    # Round 0 uniform (all 0), round 1 mixed. Sum = 2.5 over 8 chats -> baseline 0.3125.
    rewards = [0, 0, 0, 0, 1, 0.5, 0, 1]
    c = ada([float(r) for r in rewards], [F] * 8)
    # highest: the two 1s (draw 4, 7); lowest: five 0s tie -> earliest draws 0, 1.
    assert c.kept == (0, 1, 4, 7)
    assert list(c.advantages) == approx([-0.3125, -0.3125, 0.6875, 0.6875])
    assert c.trained_turns == (ALL,) * 4


def test_ada_twelve_drawn_ties_by_draw_order_with_half_rewards():
    # Rounds 0 and 1 uniform at 0.5; round 2 = [0.5, 1, 0, 0.5]. Sum 6 over 12 -> baseline 0.5.
    rewards = [0.5] * 8 + [0.5, 1.0, 0.0, 0.5]
    c = ada(rewards, [F] * 12)
    # highest: 1.0 (draw 9), then the earliest 0.5 (draw 0);
    # lowest: 0.0 (draw 10), then the earliest 0.5 not already kept (draw 1).
    assert c.kept == (0, 1, 9, 10)
    assert list(c.advantages) == approx([0.0, 0.0, 0.5, -0.5])


def test_ada_twelve_drawn_baseline_is_every_chat_not_the_kept_ones():
    rewards = [0.0] * 8 + [0.5, 0.0, 0.5, 0.0]  # sum 1 over 12 -> baseline 1/12
    c = ada(rewards, [F] * 12)
    assert c.kept == (0, 1, 8, 10)
    # Kept mean would be 0.25 (advantages ±0.25); the recipe subtracts the mean of all 12.
    assert list(c.advantages) == approx([-1 / 12, -1 / 12, 5 / 12, 5 / 12])


@pytest.mark.parametrize("r", [0.0, 0.5, 1.0])
def test_ada_uniform_after_sixteen_keeps_first_four_with_zero_advantage(r):
    c = ada([r] * 16, [F] * 16)
    assert c.kept == (0, 1, 2, 3)
    assert list(c.advantages) == [0.0] * 4


def test_ada_mixed_partner_trained_turns_follow_the_kept_chats():
    # ada_mixed: base B in draws 2, 3 of every 4. Eight drawn, rewards chosen so draws 2 and 5 are kept.
    rewards = [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # sum 2 / 8 -> baseline 0.25
    b_base = [F, F, T, T, F, F, T, T]
    c = CREDIT_RULES["ada_mixed"](rewards, b_base)
    assert c.kept == (0, 1, 2, 5)
    assert list(c.advantages) == approx([-0.25, -0.25, 0.75, 0.75])
    assert c.trained_turns == (ALL, ALL, A_ONLY, ALL)


@settings(max_examples=200, deadline=None)
@given(
    rounds=st.integers(min_value=1, max_value=4),
    data=st.data(),
)
def test_ada_properties(rounds, data):
    """Any draw: at most 4 kept, distinct, sorted, and advantage = r - mean(every drawn r)."""
    n = 4 * rounds
    rewards = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n))
    c = ada(rewards, [F] * n)
    assert len(c.kept) == 4 and list(c.kept) == sorted(set(c.kept))
    mean = sum(rewards) / n
    assert list(c.advantages) == approx([rewards[i] - mean for i in c.kept])
    kept_r = sorted(rewards[i] for i in c.kept)
    rest = [rewards[i] for i in range(n) if i not in c.kept]
    if rest:  # the 2 highest kept are >= everything dropped; the 2 lowest are <= it
        assert kept_r[-2] >= max(rest) and kept_r[1] <= min(rest)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=4, max_size=4))
def test_grpo_advantages_sum_to_zero(rewards):
    assert abs(sum(grpo(rewards, [F] * 4).advantages)) < 1e-12


# ------------------------------------------------------------------------ tables of the arms


def test_credit_rules_and_arm_plans_name_the_same_arms():
    assert set(CREDIT_RULES) == set(ARM_PLANS)
    assert {"grpo", "ada", "raft", "mixed", "ada_mixed"} <= set(CREDIT_RULES)


def test_arm_plans_match_the_design_table():
    assert ARM_PLANS["grpo"].replay is False and ARM_PLANS["grpo"].base_b_per_4 == 0
    assert ARM_PLANS["raft"].replay is False and ARM_PLANS["raft"].base_b_per_4 == 0
    assert ARM_PLANS["ada"].replay is True and ARM_PLANS["ada"].base_b_per_4 == 0
    assert ARM_PLANS["mixed"].replay is False and ARM_PLANS["mixed"].base_b_per_4 == 2
    assert ARM_PLANS["ada_mixed"].replay is True and ARM_PLANS["ada_mixed"].base_b_per_4 == 2


def test_every_rule_returns_one_advantage_and_mask_per_kept_chat():
    for name, rule in CREDIT_RULES.items():
        c = rule([1.0, 0.0, 0.5, 0.0], [F, F, T, T])
        assert isinstance(c, Credit), name
        assert len(c.kept) == len(c.advantages) == len(c.trained_turns), name


def test_is_uniform():
    assert is_uniform([0.5, 0.5, 0.5, 0.5]) and is_uniform([])
    assert not is_uniform([0.5, 0.5, 0.5, 1.0])


# -------------------------------------------------------------------------- draw_with_replays


class ScriptedDraw:
    """A fake ``draw``: per problem, the rewards of each successive round; records every call."""

    def __init__(self, script: dict[int, list[list[float]]]):
        self.script = script
        self.calls: list[list[int]] = []
        self.round_of = {p: 0 for p in script}

    def __call__(self, indices: list[int]) -> list[list[float]]:
        self.calls.append(list(indices))
        out = []
        for p in indices:
            out.append(self.script[p][self.round_of[p]])
            self.round_of[p] += 1
        return out


def test_replays_are_batched_one_call_per_round_and_capped_at_three():
    draw = ScriptedDraw(
        {
            0: [[1, 0, 0, 0]],  # mixed at once: never replayed
            1: [[0, 0, 0, 0], [0, 0, 1, 0]],  # uniform, then mixed: one replay
            2: [[1, 1, 1, 1]] * 5,  # uniform forever: 3 replays, then stop (a 5th round is never asked)
            3: [[0.5] * 4, [0.5] * 4, [1, 0.5, 0.5, 0.5]],  # mixed after two replays
        }
    )
    drawn = draw_with_replays(draw, 4)
    assert draw.calls == [[0, 1, 2, 3], [1, 2, 3], [2, 3], [2]]
    assert drawn[0] == [1, 0, 0, 0]
    assert drawn[1] == [0, 0, 0, 0, 0, 0, 1, 0]  # draw order: round 0 then round 1
    assert drawn[2] == [1] * 16
    assert drawn[3] == [0.5] * 8 + [1, 0.5, 0.5, 0.5]


def test_replays_stop_as_soon_as_nothing_is_uniform():
    draw = ScriptedDraw({0: [[1, 0, 0, 0]], 1: [[0.5, 0, 0, 0]]})
    assert draw_with_replays(draw, 2) == [[1, 0, 0, 0], [0.5, 0, 0, 0]]
    assert draw.calls == [[0, 1]]


def test_uniform_means_every_chat_so_far_not_only_the_last_round():
    # Round 0 all 0, round 1 all 1: the eight chats differ, so no third round.
    draw = ScriptedDraw({0: [[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 1]]})
    assert draw_with_replays(draw, 1) == [[0, 0, 0, 0, 1, 1, 1, 1]]
    assert draw.calls == [[0], [0]]


def test_no_replays_when_max_replays_is_zero():
    draw = ScriptedDraw({0: [[1, 1, 1, 1]], 1: [[0, 0, 0, 0]]})
    assert draw_with_replays(draw, 2, max_replays=0) == [[1, 1, 1, 1], [0, 0, 0, 0]]
    assert draw.calls == [[0, 1]]


def test_replays_then_ada_credit_end_to_end():
    draw = ScriptedDraw({0: [[0, 0, 0, 0], [0, 1, 0.5, 0]]})
    (rewards,) = draw_with_replays(draw, 1)
    c = ada(rewards, [F] * len(rewards))
    # 8 drawn, sum 1.5 -> baseline 0.1875; highest: draws 5 (1.0) and 6 (0.5); lowest: draws 0, 1.
    assert c.kept == (0, 1, 5, 6)
    assert list(c.advantages) == approx([-0.1875, -0.1875, 0.8125, 0.3125])


def test_draw_returning_the_wrong_count_is_an_error():
    with pytest.raises(AssertionError, match="expected 4"):
        draw_with_replays(lambda idx: [[1.0, 0.0, 0.0]] * len(idx), 1)


# ------------------------------------------------------------------ draw_with_replays, ahead


class QueueDraw:
    """A fake ``draw`` returning chats (problem, round, k) with scripted rewards: round r of problem p
    is the r-th time p is asked for, whichever call asks, so ahead and round-by-round draws see the same chats."""

    def __init__(self, script: dict[int, list[list[float]]]):
        self.script = script
        self.calls: list[list[int]] = []
        self.asked = {p: 0 for p in script}

    def __call__(self, indices: list[int]) -> list[list[tuple[int, int, int, float]]]:
        self.calls.append(list(indices))
        out = []
        for p in indices:
            r = self.asked[p]
            self.asked[p] += 1
            out.append([(p, r, k, reward) for k, reward in enumerate(self.script[p][r])])
        return out


def chat_reward(chat: tuple[int, int, int, float]) -> float:
    return chat[3]


SCRIPT = {
    0: [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]],  # mixed at once
    1: [[0, 0, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]],  # one replay
    2: [[1, 1, 1, 1]] * 4,  # uniform after every replay
    3: [[0.5] * 4, [0.5] * 4, [1, 0.5, 0.5, 0.5], [0.5] * 4],  # two replays
}


def test_ahead_calls_draw_once_with_every_round_of_every_problem():
    draw = QueueDraw(SCRIPT)
    draw_with_replays(draw, 4, reward=chat_reward, ahead=True)
    assert draw.calls == [[0, 1, 2, 3] * 4]


def test_ahead_reaches_the_same_chats_as_round_by_round():
    seq, ahead = QueueDraw(SCRIPT), QueueDraw(SCRIPT)
    by_round = draw_with_replays(seq, 4, reward=chat_reward)
    drawn_ahead = draw_with_replays(ahead, 4, reward=chat_reward, ahead=True)
    assert drawn_ahead == by_round
    assert seq.calls == [[0, 1, 2, 3], [1, 2, 3], [2, 3], [2]]
    # the chats themselves, in draw order, not only their rewards
    assert [(p, r) for p, r, _, _ in drawn_ahead[1]] == [(1, 0)] * 4 + [(1, 1)] * 4


def test_ahead_drops_the_rounds_the_rule_never_reaches():
    drawn = draw_with_replays(QueueDraw(SCRIPT), 4, reward=chat_reward, ahead=True)
    rounds = [sorted({r for _, r, _, _ in chats}) for chats in drawn]
    assert rounds == [[0], [0, 1], [0, 1, 2, 3], [0, 1, 2]]
    assert [len(chats) for chats in drawn] == [4, 8, 16, 12]  # of 64 played


def test_ahead_with_no_replays_is_one_round_as_before():
    seq, ahead = QueueDraw(SCRIPT), QueueDraw(SCRIPT)
    assert draw_with_replays(ahead, 4, max_replays=0, reward=chat_reward, ahead=True) == draw_with_replays(
        seq, 4, max_replays=0, reward=chat_reward
    )
    assert ahead.calls == seq.calls == [[0, 1, 2, 3]]


def test_ahead_returns_rewards_when_draw_returns_rewards():
    draw = ScriptedDraw({0: [[0, 0, 0, 0], [0, 1, 0.5, 0], [1, 1, 1, 1], [0, 0, 0, 0]]})
    assert draw_with_replays(draw, 1, ahead=True) == [[0, 0, 0, 0, 0, 1, 0.5, 0]]
    assert draw.calls == [[0, 0, 0, 0]]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(min_value=1, max_value=5), max_replays=st.integers(min_value=0, max_value=3))
def test_ahead_and_round_by_round_agree_on_any_script(data, n, max_replays):
    rounds = st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=4, max_size=4)
    script = {p: data.draw(st.lists(rounds, min_size=1 + max_replays, max_size=1 + max_replays)) for p in range(n)}
    by_round = draw_with_replays(QueueDraw(script), n, max_replays=max_replays, reward=chat_reward)
    assert draw_with_replays(QueueDraw(script), n, max_replays=max_replays, reward=chat_reward, ahead=True) == by_round


def test_mixed_partners_are_chosen_within_each_problem():
    """6 chats a problem: 3 base Bs in every problem (counting across problems gave 2, 4, 2)."""
    from talkmethods.credit import seat_plan

    plan = seat_plan(18, 6, 2)
    for p in range(3):
        group = plan[6 * p : 6 * p + 6]
        assert [b for _, b in group] == [True, True, True, False, False, False]
        assert all(a for a, _ in group)
    assert seat_plan(8, 4, 2) == [(True, True), (True, True), (True, False), (True, False)] * 2
    assert seat_plan(4, 4, 0) == [(True, True)] * 4
    assert [b for _, b in seat_plan(8, 8, 2)] == [True] * 4 + [False] * 4  # a replay round of 8 likewise


@pytest.mark.parametrize("group", [1, 2, 3, 5, 7])
def test_a_group_the_mixed_split_does_not_fit_is_refused(group):
    from talkmethods.credit import seat_plan

    if group * 2 % 4:
        with pytest.raises(ValueError, match="cannot give 2 of every 4 a base partner"):
            seat_plan(group, group, 2)
    else:
        assert sum(not b for _, b in seat_plan(group, group, 2)) == group // 2
