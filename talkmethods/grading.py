"""Answer grader: a message is right iff its LAST complete ``\\boxed{...}`` parses to a
plain number equal to the gold answer within an absolute tolerance of 1e-6.

Only numeric literals are understood (integers, decimals, ``1,000``-style grouping,
``\\frac{a}{b}``, ``a/b``, with ``$``/``%``/unit words ignored); nothing is ever evaluated,
so no ``eval``, ``exec`` or ``sympify`` touches model output.

Why a hand-written parser instead of math-verify 0.9.0 (``parse`` + ``verify`` run on the
tricky strings of ``tests/test_grading.py``): it gave wrong verdicts for this task (it merges
``\\boxed{17} wait, actually \\boxed{18}`` into the set ``{17, 18}``, reads
``\\text{18 dollars}`` as the symbol ``18dollars``, misses ``\\boxed {18}``, accepts an
unterminated ``\\boxed{\\frac{1}{2}``, and falls back to a bare "18" when there is no box);
its timeouts use ``signal.alarm`` and raise ``ValueError`` off the main thread, while
with timeouts disabled ``\\boxed{9^{9^{9^{9}}}}`` hangs the whole process (>90 s, GIL
held); 10,000-deep braces take its full 5 s timeout; and its plain-expression path
calls sympy ``parse_expr`` (which uses ``eval``) on model output. GSM8K gold answers are
plain numbers, so a small linear-time parser is both sufficient and safe.

Pinned rules:
    * Box selection: among the ``\\boxed{`` / ``\\boxed {`` / ``\\fbox{`` whose braces
      close, the one whose command starts last wins, even if its content is empty or
      unparsable (so ``\\boxed{18} \\boxed{}`` is wrong: no hedging with extra boxes).
      An unterminated box is ignored, so an earlier complete box can still count.
      ``\\{`` and ``\\}`` are literal braces, not grouping. A box without braces
      (``\\boxed 5``) is not a box.
    * Equations: ``x = 18`` and ``\\text{total} = 18`` are read as 18 (one ``=``, the
      left side is letters only); ``3 + 4 = 7`` is unparsable (None).
    * Mixed numbers (``2\\frac{1}{2}``), powers, products and other expressions are
      unparsable (None); they never occur as GSM8K gold answers.
    * Units after the number are ignored, the number is graded: ``18 km/h``,
      ``18 \\text{ ft}^2``, ``18 cm^3``, ``18 \\mathrm{m^{-1}}``, ``18 m²``, ``18 N \\cdot m``,
      ``18 \\text{ (dollars)}``, ``\\$18/\\text{hour}``. A unit is letter words, each with an
      optional integer exponent, joined by spaces, ``.``, ``-``, ``/`` or ``\\cdot``, plus
      parenthesised groups of those; it must start with a letter, ``(`` or ``/``. So an
      exponent, slash or operator straight on the number stays arithmetic and unparsable:
      ``18^2``, ``18 + 2``, ``18 - 3``, ``18 \\times 2``, ``18 \\cdot 2`` are None and
      ``18/3`` is the fraction 6. A unit holding a digit other than an exponent is refused
      (``18 \\text{ hours and } 30`` means 18.5 hours, not 18), and so is a unit where a lone
      ``x``/``y``/``z``/``n`` carries a power or a slash (``18x^2``, ``18/x``: algebra).
    * ``\\approx 18`` (or ``≈ 18``) is read as 18, and ``x \\approx 18`` like ``x = 18``.
"""

from __future__ import annotations

import logging
import math
import numbers
import re

log = logging.getLogger(__name__)

ABS_TOL = 1e-6
"""Absolute tolerance used by :func:`grade_answer`."""

# A box opener (command, optional spaces, "{"), an escaped literal brace, or a brace.
_BRACE_TOKEN_RE = re.compile(r"(?P<box>\\(?:boxed|fbox)\s*\{)|(?P<escaped>\\[{}])|(?P<open>\{)|(?P<close>\})")

# Commands whose name is dropped (their braced argument, if any, is kept as plain text).
_DROP_COMMANDS_RE = re.compile(
    r"\\(?:boxed|fbox|text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox"
    r"|displaystyle|textstyle|left|right|quad|qquad|mathdollar|textdollar|euro)(?![A-Za-z])"
)
# Degree signs and LaTeX spacing / escapes that carry no numeric meaning.
_DEGREE_RE = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)")
_THIN_SPACE_GROUP_RE = re.compile(r"(?<=[0-9])\\,(?=[0-9]{3}(?![0-9]))")  # 1\,000
_SPACING_RE = re.compile(r"\\[,;:! ]|~")
_CURRENCY_RE = re.compile(r"\\\$|\\%|[$%€£¥]")
# \frac{a}{b}, \dfrac{a}{b}, \tfrac{a}{b}, and the TeX shorthand \frac12.
_FRAC_BRACED_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_DIGITS_RE = re.compile(r"\\[dt]?frac\s*([0-9])\s*([0-9])")
# Left-hand side of "x = 18": letters, underscores, spaces only.
_LHS_RE = re.compile(r"\s*[^\W\d]+(?:\s+[^\W\d]+)*\s*")

# "\approx 18" hedges on precision, not on the answer: a leading sign is dropped, and
# any other one reads as "=" so that "x \approx 18" follows the equation rule.
_LEADING_APPROX_RE = re.compile(r"^\s*(?:\\approx(?![A-Za-z])|≈)")
_APPROX_RE = re.compile(r"\\approx(?![A-Za-z])|≈")
# "N \cdot m" is a compound unit; a middle dot is only ever allowed between unit words.
_CDOT_RE = re.compile(r"\\cdot(?![A-Za-z])")

_NUM = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]*)?|\.[0-9]+"
# A unit (see the module docstring). Every piece is told apart from its neighbours by
# its first character (a letter, "^", "(", or a separator), so no run of text can be
# split two ways and matching stays linear. Braces are spaces by the time this runs,
# so "m^{-1}" arrives as "m^ -1 ".
_UNIT_WORD = r"[^\W\d_]+"
_UNIT_EXP = r"\s*\^\s*(?:-\s*)?[0-9]+"  # only ever after a word, never on the number
_UNIT_TERM = _UNIT_WORD + r"(?:" + _UNIT_EXP + r")?"
_UNIT_SEP_CHARS = r"[\s.'’/·-]"
_UNIT_TERMS = _UNIT_TERM + r"(?:" + _UNIT_SEP_CHARS + r"+" + _UNIT_TERM + r")*"
_UNIT_PAREN = r"\(\s*" + _UNIT_TERMS + r"\s*\)"  # "(dollars)", "(km/h)"; one level
_UNIT = (
    r"(?:/\s*)?(?:"
    + _UNIT_TERM
    + r"|"
    + _UNIT_PAREN
    + r")"  # "18/hour", "18 km", "18 (kg)"
    + r"(?:"
    + _UNIT_SEP_CHARS
    + r"+"
    + _UNIT_TERM
    + r"|"
    + _UNIT_SEP_CHARS
    + r"*"
    + _UNIT_PAREN
    + r")*"
)
# Applied with fullmatch to a stripped string. Adjacent whitespace runs are never both
# optional-and-unbounded, so matching stays linear even on adversarial input.
_NUMBER_RE = re.compile(
    r"(?:(?P<sign>[+-])\s*)?(?P<num>" + _NUM + r")"
    r"(?:\s*/\s*(?:(?P<dsign>[+-])\s*)?(?P<den>" + _NUM + r"))?"
    # Optional trailing unit ("apples", "percent", "km/h", "ft^2", "(dollars)").
    r"(?:\s*(?P<unit>" + _UNIT + r"))?[\s.]*"
)
_UNIT_WORD_RE = re.compile(_UNIT_WORD)
# Lone letters that, under a power or a slash, are algebra rather than a unit.
_ALGEBRA_VARIABLES = frozenset("xyzn")
_SUPERSCRIPT_POWERS = "²³"

_UNICODE_MINUSES = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})


def extract_boxed(text: str) -> str | None:
    """Returns the content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``).

    Braces inside the box must balance (``\\boxed{\\frac{1}{2}}`` gives
    ``\\frac{1}{2}``); ``\\{``/``\\}`` are literal and do not count. "Last" means the
    complete box whose command starts latest; unterminated boxes are skipped. Runs in
    one linear pass with an explicit stack (no recursion, no backtracking regex), so
    100 kB inputs and 10,000-deep nesting are fine.

    Args:
        text: Any string, typically a model message.

    Returns:
        The raw content between the box's braces (possibly empty), or None when the
        text holds no complete box.
    """
    if not isinstance(text, str):
        return None
    # Stack of (box_command_start or -1, content_start) for each open brace.
    stack: list[tuple[int, int]] = []
    best_start = -1
    best: tuple[int, int] | None = None
    for m in _BRACE_TOKEN_RE.finditer(text):
        kind = m.lastgroup
        if kind == "close":
            if stack:  # a stray "}" with nothing open is ignored
                box_start, content_start = stack.pop()
                if box_start > best_start:
                    best_start = box_start
                    best = (content_start, m.start())
        elif kind == "open":
            stack.append((-1, m.end()))
        elif kind == "box":
            stack.append((m.start(), m.end()))
        # kind == "escaped": a literal brace, not grouping
    if best is None:
        return None
    return text[best[0] : best[1]]


def _is_unit(unit: str) -> bool:
    """Checks the unit that :data:`_NUMBER_RE` matched after a number.

    The regex admits any letters, and Python counts ``²`` and ``½`` as letters, so the
    numeric characters are vetted here: a superscript ``²``/``³`` may follow a letter
    (``m²`` is a unit) but never the number itself (``18²`` is a power, ``18½`` a mixed
    number). ASCII digits reach here only as regex-checked exponents on unit words.
    Powers and slashes on a lone ``x``/``y``/``z``/``n`` are algebra (``18x^2``,
    ``18/x``), not units.

    Args:
        unit: The matched unit text, e.g. ``"km/h"`` or ``"ft ^2"``.

    Returns:
        True when the number before it may be graded on its own.
    """
    previous = ""
    for ch in unit:
        if ch.isnumeric() and not ("0" <= ch <= "9"):
            if ch not in _SUPERSCRIPT_POWERS or not previous.isalpha():
                return False
        previous = ch
    if not any(op in unit for op in "^/" + _SUPERSCRIPT_POWERS):
        return True
    words = _UNIT_WORD_RE.findall(unit)
    return not any(w.rstrip(_SUPERSCRIPT_POWERS) in _ALGEBRA_VARIABLES for w in words)


def _resolve_approx(t: str) -> str:
    """Drops a leading ``\\approx``/``≈`` and turns any other one into ``=``.

    Args:
        t: Partly normalised box content.

    Returns:
        ``t`` with approximation signs resolved.
    """
    t = _LEADING_APPROX_RE.sub("", t, count=1)
    return _APPROX_RE.sub("=", t)


def _plain_number(num: str) -> float:
    """Converts a regex-validated numeric literal like ``1,000.50`` to float."""
    return float(num.replace(",", ""))


def parse_number(s: str) -> float | None:
    """Parses the numeric value of a boxed answer, without evaluating anything.

    Accepts e.g. ``18``, `` 18.0 ``, ``{18}``, ``-5``, ``−5`` (unicode minus),
    ``1,000``, ``1{,}000``, ``1\\,000``, ``\\$18``, ``$18``, ``50\\%``, ``50%``, ``\\frac{3}{4}``,
    ``\\dfrac{3}{4}``, ``-\\frac{3}{4}``, ``3/4``, ``18 apples``, ``\\text{18 dollars}``,
    ``18 \\text{ apples}``, ``18 km/h``, ``18 \\text{ ft}^2``, ``\\approx 18``, ``x = 18``.
    A percentage is read as its number (``50%`` is 50), matching how GSM8K writes gold
    answers.

    Args:
        s: The content of a box (or a gold answer string).

    Returns:
        The finite float value, or None if ``s`` is not a single plain number (empty,
        words only, several numbers, expressions, division by zero, nan/inf, ...).
        Never raises.
    """
    try:
        if not isinstance(s, str):
            return None
        t = s.translate(_UNICODE_MINUSES).replace("{,}", ",")
        t = _DEGREE_RE.sub("", t)
        t = _THIN_SPACE_GROUP_RE.sub("", t)
        t = _SPACING_RE.sub(" ", t)
        t = _CURRENCY_RE.sub("", t)
        t = _DROP_COMMANDS_RE.sub("", t)
        # Spaces around the result keep "2\frac{1}{2}" from becoming "21/2".
        t = _FRAC_BRACED_RE.sub(r" \1/\2 ", t)
        t = _FRAC_DIGITS_RE.sub(r" \1/\2 ", t)
        t = t.replace("{", " ").replace("}", " ")
        t = _CDOT_RE.sub(" · ", t)
        t = _resolve_approx(t)
        if "=" in t:
            lhs, _, rhs = t.partition("=")
            if "=" in rhs or not _LHS_RE.fullmatch(lhs):
                return None
            t = rhs
        m = _NUMBER_RE.fullmatch(t.strip())
        if m is None or (m["unit"] and not _is_unit(m["unit"])):
            return None  # no number, or a "unit" such as ², ½ or x^2 that is really numeric
        value = _plain_number(m["num"])
        if m["sign"] == "-":
            value = -value
        if m["den"] is not None:
            den = _plain_number(m["den"])
            if m["dsign"] == "-":
                den = -den
            if den == 0:
                return None
            value = value / den
        if not math.isfinite(value):
            return None
        return value + 0.0  # normalise -0.0 to 0.0
    except Exception:  # noqa: BLE001 - the grader must never raise on model output
        log.debug("parse_number failed on %.80r", s, exc_info=True)
        return None


def _gold_value(gold: float | str) -> float | None:
    """Converts a gold answer (number or string like ``"1,000"``) to a finite float."""
    if isinstance(gold, str):
        return parse_number(gold)
    if isinstance(gold, bool) or not isinstance(gold, numbers.Real):
        return None
    value = float(gold)  # may raise OverflowError for huge ints; caught by the caller
    return value if math.isfinite(value) else None


def grade_answer(message: str, gold: float | str) -> bool:
    """Grades one message against a gold answer.

    Args:
        message: The model's message; its last complete box is the answer.
        gold: The gold answer, a number or a numeric string such as ``"1,000"``.

    Returns:
        True iff the last complete box parses to a number within 1e-6 of ``gold``.
        False when there is no box, the box or the gold is unparsable, or anything
        goes wrong; never raises.
    """
    try:
        gold_value = _gold_value(gold)
        if gold_value is None:
            log.warning("grade_answer: unparsable gold answer %.80r", gold)
            return False
        content = extract_boxed(message)
        if content is None:
            return False
        value = parse_number(content)
        if value is None:
            return False
        return abs(value - gold_value) <= ABS_TOL
    except Exception:  # noqa: BLE001 - the grader must never raise on model output
        log.debug("grade_answer failed", exc_info=True)
        return False


def team_reward(a_right: bool, b_right: bool) -> float:
    """Returns the shared team reward: the fraction of the two agents that are right.

    Args:
        a_right: Whether agent A's answer is right.
        b_right: Whether agent B's answer is right.

    Returns:
        ``(a_right + b_right) / 2``: 0.0, 0.5 or 1.0.
    """
    return (float(bool(a_right)) + float(bool(b_right))) / 2.0
