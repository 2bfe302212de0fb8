"""Offline GSM8K-shaped word problems for the default run (no network, no downloads).

Two worlds. ``count`` (the offline default): one person's running count over 2, 3 or 4 facts,
numbers 1-9, answers 0-36. Its facts are dealt across the seats, so the answer needs both, and its
worked solution is the two-operand scratchpad the warm start teaches (``4 + 5 = 9. 9 - 3 = 6.``):
a tiny model learns it from a few hundred SFT steps, so RL starts from a base that is partly right
(DESIGN §1b). ``templates``: six harder GSM8K-like templates (shopping, wages, travel, ...), kept as
an optional tier.

`generate_problems` returns rows with GSM8K's fields: ``question`` (3-5 fact sentences, then
one asking sentence) and ``answer`` (a short worked solution with GSM8K's ``<<a*b=c>>``
calculator marks, ending in ``#### N``). Each template draws small integers, computes every
intermediate value in Python (no strings are evaluated) and writes the text from them, so
the gold is right by construction. Facts are plain sentences that pySBD splits exactly,
so every generated problem is eligible for the fact split.
"""

from __future__ import annotations

import logging
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

_NAMES = {
    "f": ("Ava", "Mia", "Emma", "Nora", "Lily", "Zoe", "Ruth", "Maya", "Ella", "Ivy", "Rosa", "Lena"),
    "m": ("Liam", "Noah", "Owen", "Leo", "Sam", "Omar", "Ben", "Jack", "Theo", "Ravi", "Eli", "Hugo"),
}
_PRONOUNS = {"f": ("She", "she", "her", "her"), "m": ("He", "he", "his", "him")}
_SHOP_ITEMS = ("notebooks", "pens", "apples", "candles", "socks", "mugs", "books", "plates")
_COLLECTED = ("apples", "shells", "acorns", "pears", "stones", "plums", "leaves", "pine cones")
_SHARED = ("cookies", "stickers", "marbles", "crayons", "cards", "grapes", "beads", "balloons")
_VEHICLES = ("bus", "train", "truck", "boat", "van", "tractor")
_BAKED = ("muffins", "rolls", "bagels", "cupcakes", "buns", "tarts")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
_SHOWN = {"+": "+", "-": "-", "*": "x", "/": "/"}


@dataclass(frozen=True)
class _Person:
    """A named person and the pronouns the templates need."""

    name: str
    She: str  # noqa: N815 - sentence-initial form reads best in the f-strings
    she: str
    her: str  # possessive
    them: str  # object

    @classmethod
    def draw(cls, rng: random.Random, avoid: Sequence[str] = ()) -> _Person:
        """Draw a person whose name is not in ``avoid``."""
        sex = rng.choice(("f", "m"))
        name = rng.choice([n for n in _NAMES[sex] if n not in avoid])
        return cls(name, *_PRONOUNS[sex])


def _calc(a: int, op: str, b: int) -> tuple[int, str]:
    """Compute ``a op b`` and write it GSM8K-style: ``3 x 4 = <<3*4=12>>12``."""
    if op == "/" and a % b:
        raise ValueError(f"{a} / {b} is not an integer")  # templates only divide exactly
    value = _OPS[op](a, b)
    return value, f"{a} {_SHOWN[op]} {b} = <<{a}{op}{b}={value}>>{value}"


def _total(values: Sequence[int]) -> tuple[int, str]:
    """Add values and write the sum GSM8K-style: ``2 + 3 + 4 = <<2+3+4=9>>9``."""
    value = sum(values)
    shown, marked = " + ".join(map(str, values)), "+".join(map(str, values))
    return value, f"{shown} = <<{marked}={value}>>{value}"


# A template returns (fact sentences, question sentence, solution lines, answer).
Template = Callable[[random.Random], tuple[list[str], str, list[str], int]]


def _shopping(rng: random.Random) -> tuple[list[str], str, list[str], int]:
    """Money left after buying a few items at a unit price."""
    p = _Person.draw(rng)
    facts, steps, costs = [], [], []
    for item in rng.sample(_SHOP_ITEMS, rng.randint(2, 3)):
        qty, price = rng.randint(2, 6), rng.randint(1, 9)
        cost, shown = _calc(qty, "*", price)
        facts.append(f"{p.She} buys {qty} {item} that cost ${price} each.")
        steps.append(f"The {item} cost {shown} dollars.")
        costs.append(cost)
    if len(costs) == 2 and rng.random() < 0.5:
        fee = rng.randint(1, 4)
        facts.append(f"{p.She} also pays ${fee} for a bag.")
        costs.append(fee)
    spent, shown = _total(costs)
    steps.append(f"{p.name} spends {shown} dollars in all.")
    money = 5 * (spent // 5 + rng.randint(1, 6))  # a round sum that covers the bill
    left, shown = _calc(money, "-", spent)
    steps.append(f"{p.She} has {shown} dollars left.")
    facts.insert(0, f"{p.name} goes to the store with ${money}.")
    return facts, f"How many dollars does {p.name} have left?", steps, left


def _collecting(rng: random.Random) -> tuple[list[str], str, list[str], int]:
    """Named people collect things, each relative to the one before."""
    names = rng.sample(_NAMES["f"] + _NAMES["m"], rng.randint(3, 5))
    thing = rng.choice(_COLLECTED)
    counts = [rng.randint(6, 30)]
    facts = [f"{names[0]} collects {counts[0]} {thing}."]
    steps = []
    for name, before in zip(names[1:], names):
        prev = counts[-1]
        kinds = ["more"] + ["fewer"] * (prev >= 6) + ["twice"] * (prev <= 25)
        kinds += ["half"] * (prev % 2 == 0 and prev >= 6)
        kind = rng.choice(kinds)
        if kind == "more":
            diff = rng.randint(2, 10)
            count, shown = _calc(prev, "+", diff)
            facts.append(f"{name} collects {diff} more {thing} than {before}.")
        elif kind == "fewer":
            diff = rng.randint(2, prev - 3)
            count, shown = _calc(prev, "-", diff)
            facts.append(f"{name} collects {diff} fewer {thing} than {before}.")
        elif kind == "twice":
            count, shown = _calc(prev, "*", 2)
            facts.append(f"{name} collects twice as many {thing} as {before}.")
        else:
            count, shown = _calc(prev, "/", 2)
            facts.append(f"{name} collects half as many {thing} as {before}.")
        steps.append(f"{name} collects {shown} {thing}.")
        counts.append(count)
    total, shown = _total(counts)
    steps.append(f"Together they collect {shown} {thing}.")
    return facts, f"How many {thing} do they collect altogether?", steps, total


def _wages(rng: random.Random) -> tuple[list[str], str, list[str], int]:
    """Hours worked on a few days times an hourly rate, maybe minus a spend."""
    p = _Person.draw(rng)
    rate = rng.randint(8, 20)
    days = sorted(rng.sample(range(len(_DAYS)), rng.randint(2, 3)))
    hours = [rng.randint(2, 8) for _ in days]
    facts = [f"{p.name} earns ${rate} per hour at {p.her} job."]
    facts += [f"On {_DAYS[day]}, {p.she} works {h} hours." for day, h in zip(days, hours)]
    worked, shown = _total(hours)
    steps = [f"{p.name} works {shown} hours."]
    earned, shown = _calc(worked, "*", rate)
    steps.append(f"{p.She} earns {shown} dollars.")
    if rng.random() < 0.5:
        spent = rng.randint(5, min(40, earned - 1))
        facts.append(f"{p.She} spends ${spent} on lunch that week.")
        left, shown = _calc(earned, "-", spent)
        steps.append(f"After lunch {p.she} has {shown} dollars.")
        return facts, f"How many dollars does {p.name} have left at the end of the week?", steps, left
    return facts, f"How many dollars does {p.name} earn that week?", steps, earned


def _sharing(rng: random.Random) -> tuple[list[str], str, list[str], int]:
    """Gather things from a few sources, maybe eat some, share the rest equally."""
    p = _Person.draw(rng)
    friend = _Person.draw(rng, avoid=(p.name,))
    thing = rng.choice(_SHARED)
    n_friends, each = rng.randint(2, 6), rng.randint(3, 9)
    eaten = rng.randint(2, 5) if rng.random() < 0.5 else 0
    remaining = n_friends * each + eaten
    n_parts = rng.randint(2, 3)
    parts = []
    for i in range(n_parts - 1):  # every part at least 2, summing to `remaining`
        part = rng.randint(2, remaining - 2 * (n_parts - 1 - i))
        parts.append(part)
        remaining -= part
    parts.append(remaining)
    facts = [f"{p.name} has {parts[0]} {thing}.", f"{p.She} buys {parts[1]} more {thing}."]
    if n_parts == 3:
        facts.append(f"{friend.name} gives {p.them} {parts[2]} {thing}.")
    total, shown = _total(parts)
    steps = [f"{p.name} has {shown} {thing}."]
    if eaten:
        facts.append(f"{p.She} eats {eaten} of the {thing}.")
        total, shown = _calc(total, "-", eaten)
        steps.append(f"After eating, {p.she} has {shown} {thing}.")
    shared = "the rest" if eaten else "them all"
    facts.append(f"{p.She} shares {shared} equally among {n_friends} friends.")
    share, shown = _calc(total, "/", n_friends)
    steps.append(f"Each friend gets {shown} {thing}.")
    return facts, f"How many {thing} does each friend get?", steps, share


def _travel(rng: random.Random) -> tuple[list[str], str, list[str], int]:
    """Distance from a speed and hours driven, maybe plus a last stretch."""
    vehicle = rng.choice(_VEHICLES)
    speed, morning, afternoon = 5 * rng.randint(3, 12), rng.randint(1, 4), rng.randint(1, 4)
    facts = [
        f"A {vehicle} travels at {speed} miles per hour.",
        f"It travels for {morning} hours in the morning.",
        f"It travels for {afternoon} hours in the afternoon.",
    ]
    hours, shown = _total([morning, afternoon])
    steps = [f"The {vehicle} travels for {shown} hours."]
    distance, shown = _calc(hours, "*", speed)
    steps.append(f"In those hours it covers {shown} miles.")
    if rng.random() < 0.5:
        extra = rng.randint(2, 20)
        facts.append(f"In the evening, it travels {extra} more miles.")
        distance, shown = _calc(distance, "+", extra)
        steps.append(f"With the evening it covers {shown} miles.")
    return facts, f"How many miles does the {vehicle} travel in all?", steps, distance


def _bakery(rng: random.Random) -> tuple[list[str], str, list[str], int]:
    """Trays baked times tray size, minus what is sold and given away."""
    goods = rng.choice(_BAKED)
    trays, per_tray = rng.randint(2, 6), rng.randint(6, 12)
    made, shown = _calc(trays, "*", per_tray)
    steps = [f"The bakery makes {shown} {goods}."]
    sold = rng.randint(made // 3, made - 3)
    facts = [
        f"A bakery makes {trays} trays of {goods} each day.",
        f"Each tray holds {per_tray} {goods}.",
        f"The bakery sells {sold} {goods} each day.",
    ]
    left, shown = _calc(made, "-", sold)
    steps.append(f"After selling, {shown} {goods} are left.")
    if rng.random() < 0.5:
        given = rng.randint(2, left - 1)
        facts.append(f"It gives {given} {goods} to a shelter each day.")
        left, shown = _calc(left, "-", given)
        steps.append(f"After the gift, {shown} {goods} are left.")
    return facts, f"How many {goods} are left at the end of the day?", steps, left


_GAINS = ("{She} gets {k} more {thing}.", "{She} finds {k} more {thing}.", "{She} buys {k} more {thing}.")
_LOSSES = ("{She} gives away {k} {thing}.", "{She} eats {k} {thing}.", "{She} loses {k} {thing}.")
_COUNTED = ("apples", "pears", "plums", "cards", "shells", "stamps", "beads", "coins")


def _running_count(rng: random.Random) -> tuple[list[str], str, list[str], int]:
    """One person's count after 1-3 changes of 1-9 each (2-4 facts); never below 0, so at most 36."""
    p, thing = _Person.draw(rng), rng.choice(_COUNTED)
    count = rng.randint(1, 9)
    facts, steps = [f"{p.name} has {count} {thing}."], []
    for _ in range(rng.randint(1, 3)):
        k = rng.randint(1, 9)
        gain = count < k or rng.random() < 0.5  # a loss larger than the count is never drawn
        before, count = count, count + k if gain else count - k
        facts.append(rng.choice(_GAINS if gain else _LOSSES).format(She=p.She, k=k, thing=thing))
        op = "+" if gain else "-"
        steps.append(f"{before} {op} {k} = <<{before}{op}{k}={count}>>{count}")
    return facts, f"How many {thing} does {p.name} have now?", steps, count


TEMPLATES: dict[str, Template] = {
    "shopping": _shopping,
    "collecting": _collecting,
    "wages": _wages,
    "sharing": _sharing,
    "travel": _travel,
    "bakery": _bakery,
}


WORLDS: dict[str, dict[str, Template]] = {"count": {"count": _running_count}, "templates": TEMPLATES}


def generate_problems(n: int, seed: int, world: str = "templates") -> list[dict]:
    """Generate ``n`` distinct GSM8K-shaped problems, deterministically.

    Args:
        n: Number of problems.
        seed: Seed of the generator; the same seed gives the same problems in the same order.
        world: ``"count"`` (running counts) or ``"templates"`` (the harder tier); see ``WORLDS``.

    Returns:
        Rows ``{"question": str, "answer": str}``; ``answer`` is a worked solution ending in
        ``#### N`` with N a non-negative integer. No two questions are equal, so any split of
        the list into train and test pools is disjoint.

    Raises:
        ValueError: ``n`` is negative, or too large for the templates to give distinct questions.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if world not in WORLDS:
        raise ValueError(f"world must be one of {', '.join(WORLDS)}, got {world!r}")
    templates = WORLDS[world]
    rng = random.Random(seed)
    names = list(templates)
    rows, seen = [], set()
    for _ in range(50 * n + 100):  # duplicates are rare; the cap only guards an absurd n
        if len(rows) == n:
            break
        facts, question, steps, answer = templates[rng.choice(names)](rng)
        text = " ".join([*facts, question])
        if text in seen:
            continue
        seen.add(text)
        rows.append({"question": text, "answer": "\n".join([*steps, f"#### {answer}"])})
    if len(rows) < n:
        raise ValueError(f"could only generate {len(rows)} distinct problems of {n} requested")
    log.info("generated %d synthetic %s problems (seed %d)", n, world, seed)
    return rows
