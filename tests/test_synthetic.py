"""Tests for talkmethods.synthetic: determinism, eligibility, and answers solved independently."""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

import pytest

from talkmethods.problems import load_jsonl_problems, write_jsonl
from talkmethods.split import split_facts, split_sentences
from talkmethods.synthetic import TEMPLATES, generate_problems

N = 600


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return generate_problems(N, seed=11)


def _ints(pattern: str, sentences: list[str]) -> list[int]:
    """Every integer captured by ``pattern`` across the sentences, in order."""
    return [int(m) for s in sentences for m in re.findall(pattern, s)]


def _one(pattern: str, sentences: list[str]) -> int:
    (value,) = _ints(pattern, sentences)
    return value


def _solve_collecting(facts: list[str]) -> int:
    counts = [int(re.fullmatch(r"\w+ collects (\d+) [\w ]+\.", facts[0]).group(1))]
    for fact in facts[1:]:
        prev = counts[-1]
        if m := re.search(r"collects (\d+) more ", fact):
            counts.append(prev + int(m.group(1)))
        elif m := re.search(r"collects (\d+) fewer ", fact):
            counts.append(prev - int(m.group(1)))
        elif "twice as many" in fact:
            counts.append(2 * prev)
        else:
            assert "half as many" in fact and prev % 2 == 0
            counts.append(prev // 2)
    return sum(counts)


def _solve_sharing(facts: list[str]) -> int:
    gathered = sum(_ints(r"(?:has|buys|gives \w+) (\d+) ", facts))
    kept = gathered - sum(_ints(r"eats (\d+) ", facts))
    friends = _one(r"among (\d+) friends", facts)
    assert kept % friends == 0
    return kept // friends


def _solve(question: str, facts: list[str]) -> int:
    """Solve a generated problem from its text alone, by template-specific reading."""
    if question.startswith("How many dollars") and "store with $" in facts[0]:
        items = [m for f in facts for m in re.findall(r"buys (\d+) [\w ]+ that cost \$(\d+) each", f)]
        bill = sum(int(qty) * int(price) for qty, price in items)
        return _one(r"store with \$(\d+)\.", facts) - bill - sum(_ints(r"pays \$(\d+) for", facts))
    if question.startswith("How many dollars"):
        earned = _one(r"earns \$(\d+) per hour", facts) * sum(_ints(r"works (\d+) hours", facts))
        return earned - sum(_ints(r"spends \$(\d+)", facts))
    if question.endswith("do they collect altogether?"):
        return _solve_collecting(facts)
    if question.endswith("does each friend get?"):
        return _solve_sharing(facts)
    if question.endswith("travel in all?"):
        speed = _one(r"at (\d+) miles per hour", facts)
        return speed * sum(_ints(r"for (\d+) hours", facts)) + sum(_ints(r"(\d+) more miles", facts))
    assert question.endswith("left at the end of the day?"), question
    made = _one(r"makes (\d+) trays", facts) * _one(r"holds (\d+) ", facts)
    return made - _one(r"sells (\d+) ", facts) - sum(_ints(r"gives (\d+) ", facts))


_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _arith(expr: str) -> Fraction:
    """Value of a calculator mark like ``3*4`` (integers and + - * / only; no eval)."""

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            return _ARITH[type(node.op)](value(node.left), value(node.right))  # exact: Fractions
        raise AssertionError(f"unexpected calculator expression {expr!r}")

    return value(ast.parse(expr, mode="eval").body)


def test_deterministic_by_seed(rows):
    assert generate_problems(N, seed=11) == rows
    assert generate_problems(N, seed=12) != rows
    assert generate_problems(0, seed=11) == []


def test_negative_n_is_refused():
    with pytest.raises(ValueError, match="n must be >= 0"):
        generate_problems(-1, seed=0)


def test_rows_have_gsm8k_fields_and_distinct_questions(rows):
    assert all(set(row) == {"question", "answer"} for row in rows)
    assert len({row["question"] for row in rows}) == N


def test_every_template_is_used(rows):
    endings = [
        "have left?",
        "collect altogether?",
        "earn that week?",
        "each friend get?",
        "travel in all?",
        "end of the day?",
    ]
    assert len(endings) == len(TEMPLATES)
    for ending in endings:
        assert sum(row["question"].endswith(ending) for row in rows) >= N // 20, ending


def test_every_problem_is_eligible_with_3_to_5_facts(rows):
    for row in rows:
        sentences = split_sentences(row["question"])
        assert 4 <= len(sentences) <= 6, sentences
        assert all(s.endswith(".") for s in sentences[:-1])
        assert sentences[-1].startswith("How many ") and sentences[-1].endswith("?")
        assert " ".join(sentences) == row["question"]  # pySBD cuts exactly at the facts
        split = split_facts(row["question"])
        assert split is not None and split.facts_b


def test_answers_are_correct(rows):
    for row in rows:
        sentences = split_sentences(row["question"])
        gold = row["answer"].rpartition("####")[2].strip()
        assert re.fullmatch(r"\d+", gold), row["answer"]
        assert _solve(sentences[-1], sentences[:-1]) == int(gold), row
        numbers = [int(n) for n in re.findall(r"\d+", row["question"])]
        assert max(numbers) <= 200 and int(gold) <= 1000


def test_worked_solutions_check_out(rows):
    for row in rows:
        marks = re.findall(r"<<([^=>]+)=(\d+)>>(\d+)", row["answer"])
        assert marks, row["answer"]
        known = {int(n) for n in re.findall(r"\d+", row["question"])} | {2}  # "twice", "half"
        for expr, result, shown in marks:
            assert _arith(expr) == int(result) == int(shown), (expr, result)
            assert {int(n) for n in re.findall(r"\d+", expr)} <= known, (expr, row)
            known.add(int(result))
        assert row["answer"].endswith(f"#### {marks[-1][1]}")


def test_generated_rows_load_as_gsm8k(tmp_path, rows):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, rows[:50])
    loaded = load_jsonl_problems(path)
    assert [p["gold"] for p in loaded] == [r["answer"].rpartition("#### ")[2] for r in rows[:50]]


# The count world (the offline default): one person's running count.

COUNT_RE = {
    "start": re.compile(r"^(\w+) has (\d) (\w+)\.$"),
    "gain": re.compile(r"^(?:She|He) (?:gets|finds|buys) (\d) more (\w+)\.$"),
    "loss": re.compile(r"^(?:She|He) (?:gives away|eats|loses) (\d) (\w+)\.$"),
}


@pytest.fixture(scope="module")
def counts():
    return generate_problems(2000, seed=5, world="count")


def _count_value(sentences: list[str]) -> int:
    """The running count read back from the fact sentences (independent of the generator)."""
    name, start, thing = COUNT_RE["start"].match(sentences[0]).groups()
    value = int(start)
    for s in sentences[1:]:
        if m := COUNT_RE["gain"].match(s):
            value += int(m[1])
        else:
            m = COUNT_RE["loss"].match(s)
            assert m, s
            value -= int(m[1])
        assert value >= 0 and m[2] == thing, s  # never below zero, one kind of thing
    return value


def test_count_world_answers_read_back_from_the_text(counts):
    n_facts = {2: 0, 3: 0, 4: 0}
    for row in counts:
        sentences = split_sentences(row["question"])
        assert " ".join(sentences) == row["question"]
        facts, question = sentences[:-1], sentences[-1]
        n_facts[len(facts)] += 1
        assert re.fullmatch(r"How many \w+ does \w+ have now\?", question)
        gold = int(row["answer"].rpartition("####")[2])
        assert gold == _count_value(facts) and 0 <= gold <= 36
        split = split_facts(row["question"])
        assert split.facts_a and split.facts_b  # every answer needs both seats' facts
    assert min(n_facts.values()) > 400, n_facts  # a spread of difficulty: 2, 3 and 4 facts


def test_count_world_scratchpad_is_one_two_operand_step_per_change(counts):
    for row in counts[:300]:
        marks = re.findall(r"^(\d+) ([+-]) (\d) = <<\1\2\3=(\d+)>>\4$", row["answer"], flags=re.M)
        facts = split_sentences(row["question"])[:-1]
        assert len(marks) == len(facts) - 1, row["answer"]
        assert int(marks[-1][3]) == int(row["answer"].rpartition("####")[2])


def test_unknown_world_is_refused():
    with pytest.raises(ValueError, match="world must be one of count, templates"):
        generate_problems(3, seed=0, world="nope")
