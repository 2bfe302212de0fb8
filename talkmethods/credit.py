"""The arms' credit rules, side by side, and Reinforce-Ada's replay loop.

Every rule is pure: the team rewards of all chats drawn for ONE problem (in draw order) and which
of them ran seat B without the adapter go in; which chats are kept, one advantage per kept chat,
and which of its four turns are trained come out. A chat's advantage is copied to each of its
trained turns. No rule divides by a standard deviation: the recipe says "minus the mean".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

ALL_TURNS = (True, True, True, True)
A_TURNS_ONLY = (True, False, True, False)  # A1, A2; B1, B2 came from the untrained base

T = TypeVar("T")  # what ``draw`` returns per chat: its reward, or the chat itself


@dataclass(frozen=True)
class Credit:
    """Credit for one problem group.

    Attributes:
        kept: indices (draw order) of the chats that become training rows.
        advantages: one advantage per kept chat.
        trained_turns: per kept chat, which of A1, B1, A2, B2 are trained.
    """

    kept: tuple[int, ...]
    advantages: tuple[float, ...]
    trained_turns: tuple[tuple[bool, bool, bool, bool], ...]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _turns(b_base: Sequence[bool], kept: Sequence[int]) -> tuple[tuple[bool, bool, bool, bool], ...]:
    """Turns are trained when the adapter spoke them: a base B's turns never are."""
    return tuple(A_TURNS_ONLY if b_base[i] else ALL_TURNS for i in kept)


def grpo(rewards: Sequence[float], b_base: Sequence[bool]) -> Credit:
    """GRPO without std: A_i = r_i − mean(r over the problem's chats)."""
    kept = tuple(range(len(rewards)))
    baseline = _mean(rewards)
    return Credit(kept, tuple(r - baseline for r in rewards), _turns(b_base, kept))


def raft(rewards: Sequence[float], b_base: Sequence[bool]) -> Credit:
    """RAFT (reward-ranked fine-tuning): A_i = 1 if the team solved the chat outright (r_i = 1), else 0."""
    kept = tuple(range(len(rewards)))
    return Credit(kept, tuple(1.0 if r == 1.0 else 0.0 for r in rewards), _turns(b_base, kept))


def mixed(rewards: Sequence[float], b_base: Sequence[bool]) -> Credit:
    """Mixed partners: A_i = r_i − mean(r), as GRPO; B's turns are trained only where B ran the adapter.

    The rollout decides which chats have a base B (2 of every 4); their B turns get no row.
    """
    return grpo(rewards, b_base)


def ada(rewards: Sequence[float], b_base: Sequence[bool], keep: int = 4) -> Credit:
    """Reinforce-Ada: keep the ``keep/2`` highest-r and ``keep/2`` lowest-r chats; A_i = r_i − mean(r of EVERY chat drawn).

    Ties break by draw order (earlier first). With only ``keep`` chats drawn all are kept; a problem
    still uniform after every replay keeps its first ``keep`` chats, all with advantage 0.
    """
    order = range(len(rewards))
    if len(rewards) <= keep:
        kept = tuple(order)
    else:
        high = sorted(order, key=lambda i: (-rewards[i], i))[: keep // 2]
        low = sorted((i for i in order if i not in high), key=lambda i: (rewards[i], i))[: keep - keep // 2]
        kept = tuple(sorted(high + low))
    baseline = _mean(rewards)  # every chat drawn, not only the kept ones
    return Credit(kept, tuple(rewards[i] - baseline for i in kept), _turns(b_base, kept))


CREDIT_RULES: dict[str, Callable[..., Credit]] = {
    "grpo": grpo,
    "ada": ada,
    "raft": raft,
    "mixed": mixed,
    "ada_mixed": ada,
}


@dataclass(frozen=True)
class ArmPlan:
    """How an arm draws chats: replays (Reinforce-Ada) and how many of every 4 chats have a base B."""

    replay: bool
    base_b_per_4: int


ARM_PLANS: dict[str, ArmPlan] = {
    "grpo": ArmPlan(replay=False, base_b_per_4=0),
    "ada": ArmPlan(replay=True, base_b_per_4=0),
    "raft": ArmPlan(replay=False, base_b_per_4=0),
    "mixed": ArmPlan(replay=False, base_b_per_4=2),
    "ada_mixed": ArmPlan(replay=True, base_b_per_4=2),
}


def seat_plan(n_chats: int, group: int, base_b_per_4: int) -> list[tuple[bool, bool]]:
    """(A trained?, B trained?) per chat: within each problem's ``group`` chats, the last ``group·base_b_per_4/4`` have a base B.

    Chats come problem by problem, ``group`` at a time (a replay round too), so the share of base
    partners holds for every problem, not only on average over the step.

    Raises:
        ValueError: ``group`` chats cannot be split in the arm's ratio (e.g. 2 of 4 base Bs with 5 chats).
    """
    if (group * base_b_per_4) % 4:
        raise ValueError(
            f"{group} chats per problem cannot give {base_b_per_4} of every 4 a base partner: "
            f"use a multiple of {4 // math.gcd(4, base_b_per_4)} chats per problem"
        )
    trained_b = group - group * base_b_per_4 // 4
    return [(True, k % group < trained_b) for k in range(n_chats)]


def is_uniform(rewards: Sequence[float]) -> bool:
    """True when every chat drawn so far scored the same."""
    return len(set(rewards)) <= 1


def draw_with_replays(
    draw: Callable[[list[int]], list[list[T]]],
    n_problems: int,
    per_round: int = 4,
    max_replays: int = 3,
    reward: Callable[[T], float] = lambda r: r,
    ahead: bool = False,
) -> list[list[T]]:
    """Reinforce-Ada's sampling: replay every problem whose chats all scored the same.

    Round 0 draws ``per_round`` chats for every problem; each later round (at most ``max_replays``)
    draws ``per_round`` more for each problem still uniform, all such problems in ONE ``draw`` call
    so the replays batch together.

    ``ahead=True`` draws every round of every problem up front in ONE ``draw`` call, then walks the
    rounds by the same rule; the rounds of a problem that the rule never reaches are discarded unseen.
    The reached chats have the same distribution as when drawn round by round: within a step the
    policy does not change, so each round of a problem is an independent draw from the same
    distribution whenever it is played, and whether round k is reached depends only on rounds 0..k-1
    of that problem, never on round k itself. A GPU decodes one batch of ``1 + max_replays`` times
    the chats far faster than ``1 + max_replays`` batches one after another; the price is the chats
    of unreached rounds.

    Args:
        draw: ``draw(problem_indices)`` plays ``per_round`` chats for each listed problem (an index may
            repeat) and returns them (rewards, or items ``reward`` scores), one list per index, in order.
        n_problems: problems in the step.
        per_round: chats per problem per round.
        max_replays: rounds after the first.
        reward: an item's team reward (the default: the items are the rewards).
        ahead: draw all ``1 + max_replays`` rounds in one call (see above).

    Returns:
        Per problem, the items of every round the rule reached, in draw order.
    """
    rounds = 1 + max_replays
    if ahead:  # entry r * n_problems + p of the one call is round r of problem p
        played = draw(list(range(n_problems)) * rounds)
        assert len(played) == rounds * n_problems, (
            f"draw returned {len(played)} groups, expected {rounds * n_problems}"
        )
    drawn: list[list[T]] = [[] for _ in range(n_problems)]
    todo = list(range(n_problems))
    for r in range(rounds):
        groups = [played[r * n_problems + p] for p in todo] if ahead else draw(todo)
        for p, group in zip(todo, groups, strict=True):
            assert len(group) == per_round, f"draw returned {len(group)} chats, expected {per_round}"
            drawn[p].extend(group)
        todo = [p for p in todo if is_uniform([reward(x) for x in drawn[p]])]
        if not todo:
            break
    return drawn
