"""What each seat sees (both prompt styles) and the ideal dialogue the warm start teaches."""

from __future__ import annotations

import pytest

from talkmethods.dialogue import OPENING_LINE, ideal_dialogue, seat_messages, system_prompt
from talkmethods.grading import grade_answer

PROBLEM = {
    "facts_a": ["Ben has 8 apples.", "He gets 6 more apples."],
    "facts_b": ["He gives away 4 apples."],
    "shared_question": "How many apples does Ben have now?",
    "answer": "8 - 4 = <<8-4=4>>4\n4 + 6 = <<4+6=10>>10\n#### 10",
    "gold": "10",
}


def test_ideal_dialogue_shares_facts_then_both_seats_work_and_box_the_gold():
    a1, b1, a2, b2 = ideal_dialogue(PROBLEM)
    assert a1 == "Ben has 8 apples. He gets 6 more apples."
    assert b1 == "He gives away 4 apples."
    assert a2 == b2 == "8 - 4 = 4. 4 + 6 = 10. \\boxed{10}"
    assert grade_answer(a2, PROBLEM["gold"]) and grade_answer(b2, PROBLEM["gold"])


def test_ideal_dialogue_of_a_template_problem_keeps_its_sentences():
    problem = {**PROBLEM, "answer": "The pens cost 3 x 4 = <<3*4=12>>12 dollars.\n#### 12", "gold": "12"}
    assert ideal_dialogue(problem)[2] == "The pens cost 3 x 4 = 12 dollars. \\boxed{12}"


@pytest.mark.parametrize("style", ["full", "short"])
def test_each_seat_sees_only_its_facts_in_both_styles(style):
    problem = {**PROBLEM, "prompt_style": style}
    dialogue = ideal_dialogue(problem)
    a2 = seat_messages(problem, 2, dialogue[:2])
    b2 = seat_messages(problem, 3, dialogue[:3])
    assert a2[0]["content"] == system_prompt("A", PROBLEM["facts_a"], PROBLEM["shared_question"], style)
    assert "He gives away" not in a2[0]["content"] and "Ben has 8" not in b2[0]["content"]
    assert PROBLEM["shared_question"] in a2[0]["content"] and PROBLEM["shared_question"] in b2[0]["content"]
    assert [m["role"] for m in a2] == ["system", "user", "assistant", "user"] and a2[1]["content"] == OPENING_LINE
    assert [m["role"] for m in b2] == ["system", "user", "assistant", "user"]
    assert "\\boxed{number}" in a2[0]["content"]


def test_short_prompt_is_short_and_absent_style_is_the_recipes():
    short = system_prompt("A", PROBLEM["facts_a"], PROBLEM["shared_question"], "short")
    full = system_prompt("A", PROBLEM["facts_a"], PROBLEM["shared_question"], "full")
    assert len(short) < len(full) / 2
    assert seat_messages(PROBLEM, 0, [])[0]["content"] == full  # records without prompt_style: the recipe's
