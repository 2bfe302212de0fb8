"""What each seat sees: the rules, its own facts, and the dialogue so far from its own view.

Turns run A1, B1, A2, B2 (DESIGN §1). A seat's own earlier turns are ``assistant`` messages and
its partner's are ``user`` messages, so a prompt never holds the partner's private facts except
through what the partner said. A opens with a fixed user line because a chat template expects
a user message before the first assistant turn.
"""

from __future__ import annotations

import re

SEATS = ("A", "B", "A", "B")  # seat of turns 1..4
FINAL_TURNS = (2, 3)  # 0-based indices of A2 and B2, the messages that are graded
OPENING_LINE = "You speak first. Share your facts with your partner."

SYSTEM_TEMPLATE = (
    "You are seat {seat} in a two-person team solving a math word problem. You hold only some of "
    "the facts; your partner holds the rest. You each write two messages, taking turns. Share what "
    "you know, use what your partner tells you, and work the problem out together. End your final "
    "(second) message with the answer as \\boxed{{number}}.\n\n"
    "Your facts:\n{facts}\n\nThe question: {question}"
)

# The offline world's short prompt (``data.prompt: short``): the same rules in a few words. A tiny
# model learns the world far faster with it (DESIGN §1b: 0.20 against 0.107 team accuracy after
# 450 SFT steps with the full prompt), and the card says which prompt was used.
SHORT_SYSTEM_TEMPLATE = (
    "Seat {seat}. Your facts:\n{facts}\nQuestion: {question}\n"
    "Share your facts. End your second message with \\boxed{{number}}."
)
PROMPTS = {"full": SYSTEM_TEMPLATE, "short": SHORT_SYSTEM_TEMPLATE}


def system_prompt(seat: str, facts: list[str], question: str, style: str = "full") -> str:
    """The rules plus this seat's private facts and the shared question, in the ``style`` of ``PROMPTS``."""
    lines = "\n".join(f"- {f}" for f in facts) or "- (none)"
    return PROMPTS[style].format(seat=seat, facts=lines, question=question)


def seat_messages(problem: dict, turn: int, history: list[str]) -> list[dict]:
    """Chat messages for the seat speaking at ``turn`` (0-based), from its own view.

    Args:
        problem: a problem record with ``facts_a``, ``facts_b`` and ``shared_question`` (and
            ``prompt_style``, the system prompt's style, ``full`` when absent).
        turn: 0..3 for A1, B1, A2, B2.
        history: the texts of turns 0..turn-1.

    Returns:
        A message list for ``tokenizer.apply_chat_template``.
    """
    seat = SEATS[turn]
    facts = problem["facts_a"] if seat == "A" else problem["facts_b"]
    style = problem.get("prompt_style", "full")
    messages = [{"role": "system", "content": system_prompt(seat, facts, problem["shared_question"], style)}]
    if seat == "A":
        messages.append({"role": "user", "content": OPENING_LINE})
    for i, text in enumerate(history):
        messages.append({"role": "assistant" if SEATS[i] == seat else "user", "content": text})
    return messages


_CALC_MARK = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations
_COUNT_STEP = re.compile(r"(\d+) ([+-]) (\d+) = <<[^>]*>>\d+")  # a running count's step: "8 - 4 = <<8-4=4>>4"


def _scratchpad(start: int, changes: list[tuple[str, int]], slip: tuple[int, int] | None = None) -> tuple[str, int]:
    """A running count worked one two-operand step at a time (``8 - 4 = 4. 4 + 6 = 10.``) and its result.

    ``slip`` = (step, error): that step's result is off by ``error`` and the rest carries it on.
    """
    steps, value = [], start
    for i, (op, k) in enumerate(changes):
        before, value = value, value + k if op == "+" else value - k
        if slip is not None and slip[0] == i:
            value += slip[1]
        steps.append(f"{before} {op} {k} = {value}.")
    return " ".join(steps), value


def ideal_dialogue(problem: dict, slip: tuple[str, int, int] | None = None) -> list[str]:
    """The four messages of a good chat, the warm start's SFT target.

    Each seat first states its own facts verbatim; then each final message works the problem and
    boxes its result. A2 follows the worked solution (GSM8K's lines, calculator marks dropped, e.g.
    ``4 + 5 = 9. 9 - 3 = 6.``). On a running count B2 works it in its own order (the start, its own
    changes, then A's), so B computes rather than copies A2, and ``slip`` = (seat, step, error) puts
    one arithmetic slip into that seat's working (its box then carries the error). A warm start
    taught only perfect dialogues learns to copy A's answer: both seats right or both wrong, and
    partial credit (one seat right), where the arms' signals differ, vanishes as it converges. With
    a share of single-seat slips in its data, each seat slips on its own and RL has them to remove.
    Other problems' B2 repeats A2's working and ``slip`` is ignored.

    Args:
        problem: a record with ``facts_a``, ``facts_b``, ``answer`` (ending ``#### N``) and ``gold``.
        slip: ``("A" | "B", step index, nonzero error)``, or None for a perfect dialogue.

    Returns:
        The texts of A1, B1, A2, B2.
    """
    lines = [ln.strip() for ln in problem["answer"].rpartition("####")[0].splitlines() if ln.strip()]
    box = f"\\boxed{{{problem['gold']}}}"
    final = " ".join(_CALC_MARK.sub("", ln).rstrip(".") + "." for ln in lines) + f" {box}"
    finals = {"A": final.strip(), "B": final.strip()}
    counts = [_COUNT_STEP.fullmatch(ln) for ln in lines]
    if counts and all(counts):
        start, changes = int(counts[0][1]), [(m[2], int(m[3])) for m in counts]  # change i is fact i + 1
        orders = {"A": changes, "B": changes[0::2] + changes[1::2]}  # B holds the odd facts: its own first
        for seat, order in orders.items():
            steps, value = _scratchpad(start, order, slip[1:] if slip and slip[0] == seat else None)
            finals[seat] = f"{steps} \\boxed{{{value}}}"
    return [" ".join(problem["facts_a"]), " ".join(problem["facts_b"]), finals["A"], finals["B"]]
