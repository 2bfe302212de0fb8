"""Tests for talkmethods.grading: the tricky-string table, unit tests, and properties."""

from __future__ import annotations

import ast
import builtins
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from talkmethods import grading
from talkmethods.grading import extract_boxed, grade_answer, parse_number, team_reward

# Bound on pathological inputs (not a performance benchmark).
TIME_BOUND_S = 2.0

# (message, gold, expected verdict). Every row is hand-checked against the pinned rules
# in the grading module docstring.
TRICKY_CASES = [
    # Box position and text around it.
    pytest.param(r"The answer is \boxed{18}.", 18, True, id="period-after-box"),
    pytest.param(r"\boxed{18} is my answer", 18, True, id="box-first-in-message"),
    pytest.param(r"\boxed{18} apples, since 17 + 1 = 18, not 20", 18, True, id="text-after-box"),
    pytest.param(r"$\boxed{18}$", 18, True, id="inline-math"),
    pytest.param("Step 1...\n\\[\n\\boxed{18}\n\\]\n", 18, True, id="display-math"),
    pytest.param(r"So 3 + 4 = 7 \boxed{7} dollars", 7, True, id="equation-before-box"),
    pytest.param(r"\boxed {18}", 18, True, id="space-before-brace"),
    pytest.param(r"\fbox{18}", 18, True, id="fbox"),
    pytest.param(r"\boxed{18}}", 18, True, id="stray-close-brace-after"),
    # Which box counts.
    pytest.param(r"\boxed{17} wait, actually \boxed{18}", 18, True, id="two-boxes-last-wins"),
    pytest.param(r"\boxed{18} wait, actually \boxed{17}", 18, False, id="two-boxes-last-wrong"),
    pytest.param(r"\boxed{5}\boxed{18}", 18, True, id="adjacent-boxes"),
    pytest.param(r"\boxed{18} \boxed{}", 18, False, id="empty-last-box-counts"),
    pytest.param(r"\boxed{18} or maybe \boxed{nineteen}", 18, False, id="unparsable-last-box-counts"),
    pytest.param(r"\boxed{\boxed{18}}", 18, True, id="box-in-box"),
    pytest.param(r"\boxed{}", 0, False, id="empty-box"),
    pytest.param(r"The answer is 18.", 18, False, id="no-box"),
    pytest.param("", 0, False, id="empty-message"),
    pytest.param(r"\boxed{18", 18, False, id="unterminated-box"),
    pytest.param(r"\boxed{17} and then \boxed{18", 17, True, id="unterminated-falls-back"),
    pytest.param(r"\boxed{17} and then \boxed{18", 18, False, id="unterminated-not-read"),
    pytest.param(r"\boxed{\frac{1}{2}", 0.5, False, id="unterminated-outer-box"),
    pytest.param(r"\boxed 18", 18, False, id="box-without-braces"),
    # Number formats.
    pytest.param(r"\boxed{\$1,000}", 1000, True, id="dollar-comma"),
    pytest.param(r"\boxed{1,000}", 1000, True, id="comma-thousands"),
    pytest.param(r"\boxed{1{,}000}", 1000, True, id="latex-comma-group"),
    pytest.param(r"\boxed{1\,000}", 1000, True, id="thin-space-group"),
    pytest.param(r"\boxed{1000}", "1,000", True, id="gold-string-with-comma"),
    pytest.param(r"\boxed{18}", "18", True, id="gold-string"),
    pytest.param(r"\boxed{1,000.50}", 1000.5, True, id="comma-and-decimals"),
    pytest.param(r"\boxed{1,00}", 100, False, id="bad-comma-grouping"),
    pytest.param(r"\boxed{18.0}", 18, True, id="trailing-zero-decimal"),
    pytest.param(r"\boxed{\$18.00}", 18, True, id="dollar-cents"),
    pytest.param(r"\boxed{$18$}", 18, True, id="plain-dollar-signs"),
    pytest.param(r"\boxed{ 42 }", 42, True, id="inner-spaces"),
    pytest.param(r"\boxed{{18}}", 18, True, id="extra-braces"),
    pytest.param(r"\boxed{-12}", -12, True, id="negative"),
    pytest.param(r"\boxed{-5}", 5, False, id="sign-matters"),
    pytest.param("\\boxed{\u22125}", -5, True, id="unicode-minus"),
    pytest.param(r"\boxed{\frac{1}{2}}", 0.5, True, id="frac"),
    pytest.param(r"\boxed{\dfrac{1}{2}}", 0.5, True, id="dfrac"),
    pytest.param(r"\boxed{-\frac{3}{4}}", -0.75, True, id="negative-frac"),
    pytest.param(r"\boxed{\frac{3}{4}}", 0.7, False, id="frac-wrong-value"),
    pytest.param(r"\boxed{3/4}", 0.75, True, id="slash-fraction"),
    pytest.param(r"\boxed{0.5}", "1/2", True, id="gold-string-fraction"),
    pytest.param(r"\boxed{2\frac{1}{2}}", 2.5, False, id="mixed-number-unsupported"),
    pytest.param(r"\boxed{50\%}", 50, True, id="latex-percent"),
    pytest.param(r"\boxed{50%}", 50, True, id="plain-percent"),
    pytest.param(r"\boxed{18 apples}", 18, True, id="unit-word"),
    pytest.param(r"\boxed{\text{18 dollars}}", 18, True, id="text-wrapping-number"),
    pytest.param(r"\boxed{18 \text{ apples}}", 18, True, id="text-unit"),
    pytest.param(r"\boxed{90^\circ}", 90, True, id="degrees"),
    pytest.param(r"\boxed{\text{eighteen}}", 18, False, id="number-in-words"),
    pytest.param(r"\boxed{18 or 19}", 18, False, id="two-numbers-hedge"),
    pytest.param(r"\boxed{x = 18}", 18, True, id="variable-equals"),
    pytest.param(r"\boxed{3 + 4 = 7}", 7, False, id="expression-equals"),
    pytest.param(r"\boxed{2^{10}}", 1024, False, id="power-not-evaluated"),
    # Units after the number: the number is graded (issue 17, item 5).
    pytest.param(r"\boxed{18 km/h}", 18, True, id="unit-slash"),
    pytest.param(r"\boxed{18 \text{ dollars/week}}", 18, True, id="unit-text-slash"),
    pytest.param(r"\boxed{18 \text{ ft}^2}", 18, True, id="unit-text-exponent"),
    pytest.param(r"\boxed{18 cm^3}", 18, True, id="unit-plain-exponent"),
    pytest.param(r"\boxed{\approx 18}", 18, True, id="approx"),
    pytest.param(r"\boxed{\approx 18}", 19, False, id="approx-wrong-value"),
    pytest.param(r"\boxed{x \approx 18}", 18, True, id="variable-approx"),
    pytest.param(r"\boxed{18 \text{ (dollars)}}", 18, True, id="unit-parenthesised"),
    pytest.param(r"\boxed{18 (km/h)}", 18, True, id="unit-parenthesised-slash"),
    pytest.param(r"\boxed{18 \mathrm{m^2}}", 18, True, id="unit-mathrm-exponent"),
    pytest.param(r"\boxed{18 \mathrm{m^{-1}}}", 18, True, id="unit-negative-exponent"),
    pytest.param(r"\boxed{18\,\text{kg}}", 18, True, id="unit-thin-space"),
    pytest.param(r"\boxed{18 m/s^2}", 18, True, id="unit-slash-exponent"),
    pytest.param(r"\boxed{18 \text{ sq ft}}", 18, True, id="unit-two-words"),
    pytest.param(r"\boxed{18 lbs.}", 18, True, id="unit-abbreviation-period"),
    pytest.param(r"\boxed{18 \text{cm}^{3}}", 18, True, id="unit-braced-exponent"),
    pytest.param(r"\boxed{\$18 \text{ per hour}}", 18, True, id="unit-dollar-per-hour"),
    pytest.param(r"\boxed{\$18/\text{hour}}", 18, True, id="unit-slash-on-number"),
    pytest.param(r"\boxed{18 \text{ km}/\text{h}}", 18, True, id="unit-split-text"),
    pytest.param(r"\boxed{18 \mathrm{N \cdot m}}", 18, True, id="unit-cdot"),
    pytest.param("\\boxed{18 m\u00b2}", 18, True, id="unit-superscript-two"),
    pytest.param(r"\boxed{18 km/h}", 19, False, id="unit-wrong-value"),
    # ... but arithmetic, algebra and two numbers stay wrong.
    pytest.param(r"\boxed{18 \text{ hours and } 30}", 18, False, id="unit-then-number"),
    pytest.param(r"\boxed{18 + 2}", 18, False, id="sum-not-unit"),
    pytest.param(r"\boxed{18 - 3}", 18, False, id="difference-not-unit"),
    pytest.param(r"\boxed{18^2}", 18, False, id="power-on-number"),
    pytest.param(r"\boxed{18 ^2}", 18, False, id="spaced-power-on-number"),
    pytest.param(r"\boxed{18 \text{ }^2}", 18, False, id="power-on-empty-text"),
    pytest.param("\\boxed{18\u00b2}", 18, False, id="superscript-on-number"),
    pytest.param(r"\boxed{18/3}", 18, False, id="fraction-not-unit"),
    pytest.param(r"\boxed{18 \times 2}", 18, False, id="product-not-unit"),
    pytest.param(r"\boxed{18 \cdot 2}", 18, False, id="cdot-product-not-unit"),
    pytest.param(r"\boxed{18 km / 3}", 18, False, id="unit-over-number"),
    pytest.param(r"\boxed{18 m^2 3}", 18, False, id="number-after-unit-power"),
    pytest.param(r"\boxed{18x^2}", 18, False, id="algebra-power"),
    pytest.param(r"\boxed{18/x}", 18, False, id="algebra-slash"),
    pytest.param(r"\boxed{18 (19)}", 18, False, id="parenthesised-number"),
    pytest.param(r"\boxed{18 \approx 18}", 18, False, id="number-approx-number"),
    # Tolerance and bad golds.
    pytest.param(r"\boxed{18.0000001}", 18, True, id="within-tolerance"),
    pytest.param(r"\boxed{18.01}", 18, False, id="outside-tolerance"),
    pytest.param(r"\boxed{7}", 8, False, id="plain-wrong"),
    pytest.param(r"\boxed{18}", "eighteen", False, id="unparsable-gold"),
    pytest.param(r"\boxed{nan}", float("nan"), False, id="nan"),
    pytest.param(r"\boxed{inf}", float("inf"), False, id="inf"),
]


@pytest.mark.parametrize(("message", "gold", "expected"), TRICKY_CASES)
def test_tricky_table(message: str, gold: float | str, expected: bool) -> None:
    verdict = grade_answer(message, gold)
    assert isinstance(verdict, bool)
    assert verdict is expected


def test_table_is_large_enough() -> None:
    assert len(TRICKY_CASES) >= 35


# --------------------------------------------------------------------------- extract_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{18}", "18"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"a \boxed{1} b \boxed{2} c", "2"),
        (r"\boxed{}", ""),
        (r"\boxed{ 42 }", " 42 "),
        (r"\boxed  {7}", "7"),
        (r"\fbox{7}", "7"),
        (r"\boxed{\boxed{1}}", "1"),  # the inner box starts last
        (r"\boxed{a} \boxed{b", "a"),  # unterminated last box is skipped
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are literal
        (r"{ \boxed{5}", "5"),  # unclosed brace before the box
        (r"\boxed{5}}}", "5"),
        (r"\boxed 5", None),
        (r"\boxedx{5}", None),
        ("no box here", None),
        ("", None),
        (r"\boxed{", None),
        (r"\boxed{\}", None),  # \} is literal, so the box never closes
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_extract_boxed_non_string() -> None:
    assert extract_boxed(None) is None  # type: ignore[arg-type]
    assert extract_boxed(18) is None  # type: ignore[arg-type]


def test_extract_boxed_deep_nesting() -> None:
    depth = 10_000
    text = r"\boxed{" + "{" * depth + "7" + "}" * depth + "}"
    assert extract_boxed(text) == "{" * depth + "7" + "}" * depth
    nested_boxes = r"\boxed{" * depth + "7" + "}" * depth
    assert extract_boxed(nested_boxes) == "7"


# --------------------------------------------------------------------------- parse_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", 18.0),
        ("  18 ", 18.0),
        ("{18}", 18.0),
        ("18.0", 18.0),
        ("18.", 18.0),
        (".5", 0.5),
        ("-5", -5.0),
        ("- 5", -5.0),
        ("+5", 5.0),
        ("\u22125", -5.0),
        ("1,000", 1000.0),
        ("1,234,567.25", 1234567.25),
        ("1{,}000", 1000.0),
        (r"1\,000", 1000.0),
        (r"\$18", 18.0),
        ("$18", 18.0),
        ("€18", 18.0),
        (r"50\%", 50.0),
        ("50%", 50.0),
        ("50 percent", 50.0),
        (r"\frac{3}{4}", 0.75),
        (r"\dfrac{3}{4}", 0.75),
        (r"\tfrac{3}{4}", 0.75),
        (r"\frac12", 0.5),
        (r"\frac{-3}{4}", -0.75),
        (r"-\frac{3}{4}", -0.75),
        (r"\frac{3}{4} cup", 0.75),
        ("3/4", 0.75),
        ("3 / 4", 0.75),
        ("18 apples", 18.0),
        ("18cm", 18.0),
        (r"\text{18 dollars}", 18.0),
        (r"18 \text{ apples}", 18.0),
        (r"\textbf{18}", 18.0),
        (r"\mathrm{18}", 18.0),
        ("x = 18", 18.0),
        (r"\text{total} = \$18", 18.0),
        (r"90^{\circ}", 90.0),
        ("-0", 0.0),
        ("18 km/h", 18.0),
        ("18 km / h", 18.0),
        ("18/h", 18.0),
        (r"18 \text{ ft}^2", 18.0),
        ("18 m^{-2}", 18.0),
        ("18 kg m/s^2", 18.0),
        (r"18 kg \cdot m/s^2", 18.0),
        ("18 sq. ft.", 18.0),
        ("18 (dollars)", 18.0),
        ("18 (in dollars) per week", 18.0),
        ("18 N/m", 18.0),  # capital N is newtons, not a variable
        ("\u224818", 18.0),  # ≈
        (r"\approx \$18", 18.0),
        (r"\frac{3}{4} cup/day", 0.75),
        ("3/4 km/h", 0.75),
    ],
)
def test_parse_number_accepts(text: str, expected: float) -> None:
    value = parse_number(text)
    assert value is not None
    assert value == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "{}",
        "eighteen",
        "nan",
        "inf",
        "-inf",
        "NaN apples",
        "1e5",  # scientific notation is not a GSM8K answer format
        "1" * 400,  # overflows to inf
        "3/0",
        r"\frac{1}{0}",
        r"\frac{\frac{1}{2}}{3}",
        "1,00",
        "1,0000",
        "18,",
        "1 000",
        "1.000,5",
        "18 or 19",
        r"18 \text{ and } 20",
        "3+4=7",
        "x = 5 = 6",
        "a=1, b=2",
        "2^{10}",
        r"2 \times 3",
        r"2\frac{1}{2}",
        "18²",
        "18½",
        r"\sqrt{4}",
        "(18)",
        "--5",
        "1_000",  # Python's float() would accept this; we do not
        "٣",  # non-ASCII digits are not numbers here
        "18^2",
        "18^{2}",
        "18 + 2",
        "18 * 2",
        "18 \u00b7 2",
        "18 km^",
        "18 km/",
        "18 (km",
        "18 ()",
        "18 ((km))",  # one level of parentheses only
        "18 x/y",
        "18 x\u00b2",
        "18 \u00b2",
        "18 m\u00b2\u00b3",
        "18 m^2.5",
        r"\approx",
        r"\approx\approx 18",
        r"18 \approx",
        r"\approxeq 18",
    ],
)
def test_parse_number_rejects(text: str) -> None:
    assert parse_number(text) is None


def test_parse_number_non_string() -> None:
    assert parse_number(None) is None  # type: ignore[arg-type]
    assert parse_number(18) is None  # type: ignore[arg-type]


# --------------------------------------------------------------------------- grade_answer / team_reward


def test_grade_answer_bad_inputs_never_raise() -> None:
    assert grade_answer(None, 18) is False  # type: ignore[arg-type]
    assert grade_answer(r"\boxed{18}", None) is False  # type: ignore[arg-type]
    assert grade_answer(r"\boxed{1}", True) is False  # bools are not gold numbers
    assert grade_answer(r"\boxed{5}", 10**400) is False  # float() overflows
    assert grade_answer(r"\boxed{5}", object()) is False  # type: ignore[arg-type]


def test_grade_answer_accepts_numeric_gold_types() -> None:
    assert grade_answer(r"\boxed{18}", 18) is True
    assert grade_answer(r"\boxed{18}", 18.0) is True
    assert grade_answer(r"\boxed{-3.5}", -3.5) is True


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [(False, False, 0.0), (True, False, 0.5), (False, True, 0.5), (True, True, 1.0)],
)
def test_team_reward(a: bool, b: bool, expected: float) -> None:
    reward = team_reward(a, b)
    assert isinstance(reward, float)
    assert reward == expected


def test_grade_answer_works_off_the_main_thread() -> None:
    messages = [r"\boxed{18}", r"\boxed{17}", r"\boxed{\frac{1}{2}}"] * 10
    golds = [18, 18, 0.5] * 10
    with ThreadPoolExecutor(max_workers=4) as pool:
        verdicts = list(pool.map(grade_answer, messages, golds))
    assert verdicts == [True, False, True] * 10


def test_no_eval_on_model_output(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("eval/exec must never run on model output")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    for param in TRICKY_CASES:
        message, gold, expected = param.values
        assert grade_answer(message, gold) is expected


def test_module_source_has_no_dynamic_evaluation() -> None:
    tree = ast.parse(Path(grading.__file__).read_text(encoding="utf-8"))
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & {"eval", "exec", "sympify", "parse_expr"}
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"sympy", "math_verify", "latex2sympy2_extended"}


# --------------------------------------------------------------------------- bounded time


def _timed_grade(message: str, gold: float | str) -> tuple[bool, float]:
    start = time.perf_counter()
    verdict = grade_answer(message, gold)
    return verdict, time.perf_counter() - start


@pytest.mark.parametrize(
    ("message", "gold", "expected"),
    [
        pytest.param("word " * 20_000 + r"\boxed{18}", 18, True, id="100kB-prose-then-box"),
        pytest.param(r"\boxed{18}" + " filler" * 15_000, 18, True, id="box-then-100kB"),
        pytest.param(r"\boxed{" * 10_000 + "18" + "}" * 10_000, 18, True, id="10k-nested-boxes"),
        pytest.param(r"\boxed{" + "{" * 10_000 + "18" + "}" * 10_001, 18, True, id="10k-nested-braces"),
        pytest.param(r"\boxed{" * 10_000 + "18", 18, False, id="10k-unclosed-boxes"),
        pytest.param("{" * 100_000, 18, False, id="100kB-open-braces"),
        pytest.param("}" * 100_000, 18, False, id="100kB-close-braces"),
        pytest.param("\\" * 100_000, 18, False, id="100kB-backslashes"),
        pytest.param((r"\boxed{\frac{" * 9_000)[:100_000], 18, False, id="100kB-box-fragments"),
        pytest.param(r"\boxed{" + "1" * 100_000 + "}", 18, False, id="100kB-digits"),
        pytest.param(r"\boxed{" + "1,000" * 20_000 + "}", 18, False, id="100kB-commas"),
        pytest.param(r"\boxed{-" + " " * 100_000 + "x}", 18, False, id="100kB-sign-spaces"),
        pytest.param(r"\boxed{1/" + " " * 100_000 + "#}", 18, False, id="100kB-slash-spaces"),
        pytest.param(r"\boxed{1 a" + " ." * 50_000 + "#}", 18, False, id="100kB-unit-separators"),
        pytest.param(r"\boxed{" + "x " * 50_000 + "= 18}", 18, True, id="100kB-equation-lhs"),
        pytest.param(r"\boxed{" + "^ " * 50_000 + "}", 18, False, id="100kB-carets"),
        pytest.param(r"\boxed{\frac{a}{" + "b" * 100_000 + "}", 18, False, id="100kB-frac-arg"),
        pytest.param(r"\boxed{18 " + "km/" * 33_000 + "#}", 18, False, id="100kB-unit-slashes"),
        pytest.param(r"\boxed{18 a^" + " " * 100_000 + "#}", 18, False, id="100kB-exponent-spaces"),
        pytest.param(r"\boxed{18 a" + " (a" * 33_000 + "#}", 18, False, id="100kB-unclosed-parens"),
        pytest.param(r"\boxed{18 (" + "a " * 50_000 + "#}", 18, False, id="100kB-paren-words"),
        pytest.param(r"\boxed{18 a" + r"\cdot " * 16_000 + "#}", 18, False, id="100kB-cdots"),
        pytest.param(r"\boxed{" + r"\approx " * 12_000 + "18}", 18, False, id="100kB-approx"),
        pytest.param(r"\boxed{18 " + "m^2 " * 25_000 + "}", 18, True, id="100kB-unit-powers"),
        pytest.param(r"\boxed{18 " + "(km) " * 20_000 + "}", 18, True, id="100kB-unit-parens"),
    ],
)
def test_pathological_inputs_are_bounded(message: str, gold: float, expected: bool) -> None:
    verdict, elapsed = _timed_grade(message, gold)
    assert verdict is expected
    assert elapsed < TIME_BOUND_S


# --------------------------------------------------------------------------- properties

FRAGMENTS = [
    r"\boxed{",
    r"\boxed {",
    r"\fbox{",
    r"\boxed",
    "{",
    "}",
    r"\{",
    r"\}",
    "\\",
    r"\frac{",
    r"\dfrac",
    r"\text{",
    r"\$",
    r"\%",
    "%",
    "$",
    "1",
    "18",
    "0",
    ",",
    ".",
    "/",
    "-",
    "\u2212",
    "=",
    " ",
    "\n",
    "x",
    "apples",
    "^",
    r"\circ",
    "nan",
    "inf",
    "e",
    "km",
    "m",
    "x",
    "^2",
    "^{",
    "(",
    ")",
    r"\approx",
    r"\cdot",
    r"\mathrm{",
    "\u00b2",
    "+",
]

fragment_soup = st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join)


@st.composite
def deeply_nested(draw: st.DrawFn) -> str:
    """A box around up to 10,000 levels of (possibly unclosed) openers."""
    depth = draw(
        st.one_of(
            st.integers(min_value=1, max_value=50),
            st.integers(min_value=5_000, max_value=10_000),
            st.just(10_000),
        )
    )
    opener = draw(st.sampled_from(["{", r"\boxed{", r"\frac{", r"\text{", r"\fbox{"]))
    core = draw(st.sampled_from(["18", "", r"\frac{1}{2}", "x", "}{"]))
    closed = draw(st.integers(min_value=0, max_value=depth + 1))
    return r"\boxed{" + opener * depth + core + "}" * closed


@st.composite
def huge_message(draw: st.DrawFn) -> str:
    """About 100 kB built by repeating a random fragment soup, plus an optional box."""
    unit = draw(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=12).map("".join))
    body = (unit * (100_000 // len(unit) + 1))[:100_000]
    tail = draw(st.sampled_from(["", r"\boxed{18}", r"\boxed{18", "}"]))
    return body + tail


gold_values = st.one_of(
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
)


@settings(max_examples=300, deadline=None)
@given(message=st.text(), gold=gold_values)
def test_arbitrary_text_never_raises(message: str, gold: float | str) -> None:
    assert isinstance(grade_answer(message, gold), bool)
    value = parse_number(message)
    assert value is None or math.isfinite(value)


@settings(max_examples=300, deadline=None)
@given(message=fragment_soup, gold=gold_values)
def test_box_fragment_soup_never_raises(message: str, gold: float | str) -> None:
    assert isinstance(grade_answer(message, gold), bool)
    content = extract_boxed(message)
    assert content is None or content in message


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=deeply_nested())
def test_deep_nesting_is_bounded(message: str) -> None:
    verdict, elapsed = _timed_grade(message, 18)
    assert isinstance(verdict, bool)
    assert elapsed < TIME_BOUND_S


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
@given(message=huge_message())
def test_100kb_messages_are_bounded(message: str) -> None:
    verdict, elapsed = _timed_grade(message, 18)
    assert isinstance(verdict, bool)
    assert elapsed < TIME_BOUND_S


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.text(max_size=200),
    content=st.text(max_size=50).filter(lambda c: not set(c) & set("{}\\")),
)
def test_appended_box_is_the_one_extracted(prefix: str, content: str) -> None:
    assert extract_boxed(prefix + r"\boxed{" + content + "}") == content


integers = st.integers(min_value=-(10**15), max_value=10**15)


@settings(max_examples=200, deadline=None)
@given(n=integers)
def test_boxed_integer_matches_itself(n: int) -> None:
    assert grade_answer(f"... \\boxed{{{n}}}", n) is True
    assert grade_answer(f"... \\boxed{{{n}}}", str(n)) is True
    assert grade_answer(f"... \\boxed{{{n}}}", n + 1) is False


@settings(max_examples=200, deadline=None)
@given(n=integers)
def test_boxed_comma_formatted_integer_matches(n: int) -> None:
    formatted = f"{n:,}"
    assert grade_answer(f"... \\boxed{{{formatted}}}", n) is True
    assert grade_answer(f"The total is \\boxed{{\\${formatted}}}.", f"{n:,}") is True


UNIT_SUFFIXES = [
    "km/h",
    r"\text{ dollars/week}",
    r"\text{ ft}^2",
    "cm^3",
    r"\mathrm{m^{-1}}",
    r"\,\text{kg}",
    r"\text{ (dollars)}",
    "m/s^2",
    "lbs.",
    r"N \cdot m",
]
# "km / 3", not "/ 3 km": 0 / 3 is 0, so that tail would grade right against gold 0.
ARITHMETIC_SUFFIXES = ["+ 2", "- 3", "^2", "^{2}", r"\times 2", r"\cdot 2", "km / 3", "x^2", "km 30"]


@settings(max_examples=100, deadline=None)
@given(n=integers, unit=st.sampled_from(UNIT_SUFFIXES))
def test_unit_after_number_grades_the_number(n: int, unit: str) -> None:
    assert grade_answer(f"\\boxed{{{n} {unit}}}", n) is True
    assert grade_answer(f"\\boxed{{\\approx {n} {unit}}}", n) is True
    assert grade_answer(f"\\boxed{{{n} {unit}}}", n + 1) is False


@settings(max_examples=100, deadline=None)
@given(n=integers, tail=st.sampled_from(ARITHMETIC_SUFFIXES))
def test_arithmetic_after_number_is_never_the_number(n: int, tail: str) -> None:
    assert grade_answer(f"\\boxed{{{n} {tail}}}", n) is False
    assert grade_answer(f"\\boxed{{{n}{tail}}}", n) is False
