"""What each seat sees: the rules, its own facts, and the dialogue so far from its own view.

Turns run A1, B1, A2, B2 (DESIGN §1). A seat's own earlier turns are ``assistant`` messages and
its partner's are ``user`` messages, so a prompt never holds the partner's private facts except
through what the partner said. A opens with a fixed user line because a chat template expects
a user message before the first assistant turn.
"""

from __future__ import annotations

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


def system_prompt(seat: str, facts: list[str], question: str) -> str:
    """The rules plus this seat's private facts and the shared question."""
    lines = "\n".join(f"- {f}" for f in facts) or "- (none)"
    return SYSTEM_TEMPLATE.format(seat=seat, facts=lines, question=question)


def seat_messages(problem: dict, turn: int, history: list[str]) -> list[dict]:
    """Chat messages for the seat speaking at ``turn`` (0-based), from its own view.

    Args:
        problem: a problem record with ``facts_a``, ``facts_b`` and ``shared_question``.
        turn: 0..3 for A1, B1, A2, B2.
        history: the texts of turns 0..turn-1.

    Returns:
        A message list for ``tokenizer.apply_chat_template``.
    """
    seat = SEATS[turn]
    facts = problem["facts_a"] if seat == "A" else problem["facts_b"]
    messages = [{"role": "system", "content": system_prompt(seat, facts, problem["shared_question"])}]
    if seat == "A":
        messages.append({"role": "user", "content": OPENING_LINE})
    for i, text in enumerate(history):
        messages.append({"role": "assistant" if SEATS[i] == seat else "user", "content": text})
    return messages
