"""The fact split: each seat sees half of a problem's facts, both see the question.

A question is cut into sentences with pySBD (``clean=False``, so no text is altered), and the
few breaks pySBD puts inside a sentence (after "lbs.", "sq.", "a.m." or before a closing quote)
are joined again. The sentence that asks goes to both seats: the last one that ends with "?"
or opens a clause with an ask word ("Calculate ...", "..., how many ..."). Usually that is the
last sentence, but a closing note such as "(There are 2.5 centimeters per inch.)" is a fact.
The other sentences, in their order, are dealt alternately, A the 1st, 3rd, ..., B the 2nd,
4th, .... A problem with fewer than two fact sentences, or with no sentence that asks, is not
eligible. `draw_problems` filters two pools, draws the train and held-out problems with a fixed
``data_seed`` and reports split statistics for the card.
"""

from __future__ import annotations

import logging
import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import pysbd

from talkmethods.atomic import write_json
from talkmethods.problems import DataError, load_gsm8k, write_jsonl

log = logging.getLogger(__name__)

# One segmenter for the module: building it compiles pySBD's rules. clean=False keeps the text
# byte-for-byte, so the seats' sentences rebuild the question (checked on all 8,792 GSM8K problems).
_SEGMENTER = pysbd.Segmenter(language="en", clean=False)

DROP_REASONS = ("one_fact_sentence", "no_fact_sentence", "no_question")

# Abbreviations that never end a sentence: a title or "sq." always has a word after it, so a
# break pySBD puts after one is always wrong ("a 5,200 sq." | "ft. house").
NEVER_FINAL = ("Mr", "Mrs", "Ms", "Dr", "sq", "vs", "approx", "e.g", "i.e", "cf")
# Abbreviations that may end a sentence ("Andy wants to lose 30 lbs." is whole), so a break
# after one stands unless the next piece cannot start a sentence ("30 lbs." | "by his birthday").
MAY_BE_FINAL = (
    "lbs", "lb", "oz", "ft", "in", "yd", "yds", "mi", "hr", "hrs", "min", "mins", "sec", "gal",
    "qt", "tsp", "tbsp", "a.m", "p.m", "St", "Jr", "Sr", "etc", "Ph.D",
)  # fmt: skip
# A time zone after "6:00 a.m." belongs to the time, though it is capitalised ("a.m." | "ET on").
_TIME_ZONES = ("ET", "EST", "EDT", "CT", "CST", "CDT", "MT", "MST", "MDT", "PT", "PST", "PDT",
               "GMT", "UTC", "BST")  # fmt: skip


def _alternatives(words: Sequence[str]) -> str:
    """A regex group matching any of ``words`` literally."""
    return "(?:" + "|".join(re.escape(word) for word in words) + ")"


# "lbs." at the end of a piece as a word of its own: after a space, an opening mark or a digit
# ("8:00a.m."), never the tail of a longer token ("M&Ms." is no "Ms.", "Bills." no "lls.").
_WORD_START = r"(?<![^\s(\"“‘'\d])"
_ENDS_NEVER_FINAL = re.compile(_WORD_START + _alternatives(NEVER_FINAL) + r"\.$", re.I)
_ENDS_MAY_BE_FINAL = re.compile(_WORD_START + _alternatives(MAY_BE_FINAL) + r"\.$", re.I)
# A piece that opens with a closing mark (’ ” ) ], or a straight quote not followed by a word)
# is the tail of the sentence before: pySBD cut '"Maximum weight 600 pounds.' | '", what is ...'.
_OPENS_WITH_CLOSER = re.compile(r"""^(?:[”’)\]}]|["'](?![A-Za-z0-9]))""")
# A piece that opens with a lowercase abbreviation ("a.m to school", "ft. house") continues
# the one before; lowercase only, so "St. Louis has ..." still starts a sentence.
_OPENS_WITH_ABBREVIATION = re.compile(
    "^(?:"
    + "|".join(
        re.escape(a) + (r"\.?" if "." in a else r"\.")  # "a.m" may lose its final dot
        for a in NEVER_FINAL + MAY_BE_FINAL
        if a.islower()
    )
    + r")(?![A-Za-z])"
)
_OPENS_WITH_TIME_ZONE = re.compile("^" + _alternatives(_TIME_ZONES) + r"(?![A-Za-z])")

# The ask words, at the start of a clause: the sentence's start, or after ",", ";", ":" or "."
# (pySBD keeps "... city C. Calculate ..." whole), optionally after "then"/"and"/"so" and a
# preposition ("..., at what time will it be filled"). Measured on GSM8K: every question that
# does not end with "?" opens so ("Calculate ...", "If ..., calculate ...", "Find ...", "How
# much did John spend altogether"); "when", "who" and "which" are left out because they open
# facts ("When he runs he goes 10 MPH.").
_ASK_WORDS = ("calculate", "compute", "find", "determine", "estimate", "work out", "figure out",
              "what", "how")  # fmt: skip
_ASKS = re.compile(
    r"(?:^|[,;:.]\s*|^[(\"“‘']+)(?:(?:then|and|so)\s+)?(?:(?:at|in|by|on|for|to)\s+)?"
    + _alternatives(_ASK_WORDS)
    + r"\b",
    re.I,
)
# Closing marks that may follow a "?" ('... he asked "how much?"', "(how many?)").
_TRAILING_CLOSERS = "\"'”’)]} "


@dataclass(frozen=True)
class FactSplit:
    """One problem's view per seat.

    Attributes:
        facts_a: Seat A's fact sentences (the 1st, 3rd, ... of the problem's facts).
        facts_b: Seat B's fact sentences (the 2nd, 4th, ...).
        question: The asking sentence, shown to both seats.
        n_after: How many of the fact sentences follow the question in the text (a closing
            note such as "(There are 16 ounces in a pound.)"); 0 when the question is last.
    """

    facts_a: tuple[str, ...]
    facts_b: tuple[str, ...]
    question: str
    n_after: int = 0

    def sentence_counts(self) -> dict[str, int]:
        """Return the number of fact sentences per seat: ``{"a": n_a, "b": n_b}``."""
        return {"a": len(self.facts_a), "b": len(self.facts_b)}

    def sentences(self) -> list[str]:
        """Return all sentences in their original order, the question in its place."""
        facts = []
        for i in range(len(self.facts_a) + len(self.facts_b)):
            facts.append(self.facts_a[i // 2] if i % 2 == 0 else self.facts_b[i // 2])
        at = len(facts) - self.n_after
        return facts[:at] + [self.question] + facts[at:]


def _continues(before: str, piece: str) -> bool:
    """Whether pySBD's break between two pieces falls inside a sentence.

    Args:
        before: The text up to the break, stripped.
        piece: The text from the break to pySBD's next break, stripped.

    Returns:
        True when ``before`` ends on an abbreviation that never ends a sentence ("sq."), when
        ``piece`` cannot open one (a closing quote, a lowercase abbreviation such as "a.m"), or
        when ``before`` ends on one that may ("lbs.", "a.m.") and ``piece`` opens lowercase or
        with a time zone. A lowercase opening after an ordinary word is a real sentence with a
        missing capital ("He is paid $5 per period. if he has been working ..."): joining it
        would pull a fact into the shared question, so that break stands.
    """
    if _ENDS_NEVER_FINAL.search(before) or _OPENS_WITH_CLOSER.match(piece):
        return True
    if _OPENS_WITH_ABBREVIATION.match(piece):
        return True
    return bool(_ENDS_MAY_BE_FINAL.search(before)) and (
        piece[:1].islower() or bool(_OPENS_WITH_TIME_ZONE.match(piece))
    )


def _sentence_starts(text: str, segments: Sequence[str]) -> list[int]:
    """Find where each of pySBD's segments starts in ``text`` (an empty list for blank text)."""
    starts, pos = [], 0
    for segment in segments:
        core = segment.strip()
        found = text.find(core, pos) if core else -1
        if found < 0:  # empty, or not verbatim in the text: no boundary to cut at
            continue
        starts.append(found)
        pos = found + len(core)
    if starts:
        starts[0] = 0  # anything pySBD left out before its first sentence stays in the first
    return starts


def _join_inside_breaks(text: str, starts: Sequence[int]) -> list[int]:
    """Drop the sentence starts that fall inside a sentence (see `_continues`)."""
    ends = [*starts[1:], len(text)]
    kept: list[int] = []
    for start, end in zip(starts, ends):
        if not kept or not _continues(text[kept[-1] : start].strip(), text[start:end].strip()):
            kept.append(start)
    return kept


def split_sentences(text: str) -> list[str]:
    """Split text into sentences with pySBD, joining the breaks it puts inside a sentence.

    pySBD picks the boundaries; each sentence is then cut from the original text, from its
    start to the next sentence's start. On GSM8K this equals pySBD's own output (stripped),
    but on odd punctuation pySBD 0.3.4 drops characters (``"a? b? c.??"`` gives
    ``["a? ", "b? ", "c."]``, losing the final ``??``); cutting from the text keeps every
    character, so no part of a fact can vanish from both seats. A boundary that falls inside
    a sentence ("3 lbs." | "of coffee", "600 sq." | "ft.", "6:00 a.m." | "ET on Monday") is
    dropped, so no fact is cut in two.

    Args:
        text: Any text, e.g. a GSM8K question.

    Returns:
        The stripped, non-empty sentences in order; joined they give ``text`` up to whitespace.
    """
    starts = _join_inside_breaks(text, _sentence_starts(text, _SEGMENTER.segment(text)))
    if not starts:
        return [text.strip()] if text.strip() else []
    ends = [*starts[1:], len(text)]
    return [text[start:end].strip() for start, end in zip(starts, ends)]


def asks(sentence: str) -> bool:
    """Whether a sentence asks the question.

    Args:
        sentence: One sentence.

    Returns:
        True when it ends with "?" (closing quotes or brackets may follow) or opens a clause
        with an ask word: "Calculate ...", "Find ...", "If ..., how many ...", "What is ...".
    """
    return sentence.rstrip(_TRAILING_CLOSERS).endswith("?") or bool(_ASKS.search(sentence))


def question_index(sentences: Sequence[str]) -> int | None:
    """Return the index of the sentence that asks: the last one that `asks`, or None if none does.

    The last rather than the first: a problem that asks twice asks its final question last,
    and what follows it is a note ("(Round to the nearest integer.)"), which does not ask.
    """
    return next((i for i in reversed(range(len(sentences))) if asks(sentences[i])), None)


def _deal(sentences: Sequence[str]) -> FactSplit | str:
    """Deal split sentences: the asking one shared, the facts alternate A, B, A, ... in order.

    Returns:
        The split, or the drop reason (one of `DROP_REASONS`) when the problem is ineligible.
    """
    at = question_index(sentences)
    if at is None:
        return "no_question"
    facts = [*sentences[:at], *sentences[at + 1 :]]
    if len(facts) < 2:
        return "one_fact_sentence" if facts else "no_fact_sentence"
    return FactSplit(tuple(facts[0::2]), tuple(facts[1::2]), sentences[at], len(sentences) - 1 - at)


def split_facts(question: str) -> FactSplit | None:
    """Split a problem into the two seats' facts and the shared question.

    Args:
        question: The full problem text.

    Returns:
        The split, or None when the problem is ineligible: fewer than two fact sentences, or
        no sentence that asks (see `drop_reason`).
    """
    split = _deal(split_sentences(question))
    return split if isinstance(split, FactSplit) else None


def drop_reason(question: str) -> str | None:
    """Name why a problem is ineligible (one of `DROP_REASONS`), or None when it is eligible."""
    split = _deal(split_sentences(question))
    return None if isinstance(split, FactSplit) else split


def _seat_stats(counts: list[int]) -> dict[str, float]:
    """Mean, min and max of per-problem sentence counts (zeros when nothing was drawn)."""
    if not counts:
        return {"mean": 0.0, "min": 0, "max": 0}
    return {"mean": statistics.fmean(counts), "min": min(counts), "max": max(counts)}


def _eligible(pool: Sequence[dict]) -> tuple[list[tuple[dict, FactSplit]], dict[str, int]]:
    """Split every problem of a pool; return the eligible ones and the drop counts."""
    eligible, dropped = [], dict.fromkeys(DROP_REASONS, 0)
    for problem in pool:
        split = _deal(split_sentences(problem["question"]))
        if isinstance(split, FactSplit):
            eligible.append((problem, split))
        else:
            dropped[split] += 1
    return eligible, dropped


def _record(problem: dict, split: FactSplit) -> dict:
    """Build the output record of one drawn problem."""
    return {
        "id": f"{problem['source']}-{problem['index']:05d}",
        "question": problem["question"],
        "facts_a": list(split.facts_a),
        "facts_b": list(split.facts_b),
        "shared_question": split.question,
        "gold": problem["gold"],
        "answer": problem["answer"],
    }


def _draw_pool(
    pool: Sequence[dict], n: int, key: str, data_seed: int, exclude: frozenset[str] = frozenset()
) -> tuple[list[dict], dict]:
    """Filter one pool, draw ``n`` problems and describe the result."""
    eligible, dropped = _eligible(pool)
    if exclude:
        kept = [item for item in eligible if " ".join(item[0]["question"].split()) not in exclude]
        dropped["in_train_pool"] = len(eligible) - len(kept)
        eligible = kept
    if len(eligible) < n:
        raise DataError(
            f"{key} = {n} requested, but only {len(eligible)} of the {len(pool)} problems in "
            f"its pool are eligible (a sentence that asks, two or more fact sentences); "
            f"lower {key} or use more data"
        )
    # A fresh Random per pool: the held-out draw does not move when n_train changes.
    drawn = random.Random(data_seed).sample(eligible, n)  # drawn order kept
    records = [_record(problem, split) for problem, split in drawn]
    stats = {
        "total": len(pool),
        "eligible": len(eligible),
        "dropped": dropped,
        "drawn": n,
        "sentences_per_seat": {
            seat: _seat_stats([split.sentence_counts()[seat] for _, split in drawn]) for seat in ("a", "b")
        },
    }
    log.info("%s: %d of %d eligible, dropped %s, drew %d", key, len(eligible), len(pool), dropped, n)
    return records, stats


def draw_problems(
    train_pool: Sequence[dict],
    heldout_pool: Sequence[dict],
    n_train: int,
    n_heldout: int,
    data_seed: int,
) -> tuple[list[dict], list[dict], dict]:
    """Draw the train and held-out problems every arm and seed shares.

    Each pool is filtered to eligible problems (a sentence that asks and two or more fact
    sentences) and sampled without replacement with ``random.Random(data_seed)``, keeping the
    drawn order. Held-out problems whose question text also occurs in the train pool are
    dropped, so the two sets never share a question even when a local data folder overlaps.

    Args:
        train_pool: Problem records (see `talkmethods.problems.parse_problem`).
        heldout_pool: Problem records for evaluation.
        n_train: Number of train problems to draw (config key ``n_train``).
        n_heldout: Number of held-out problems to draw (config key ``n_heldout``).
        data_seed: Seed of the draw; not the training seed.

    Returns:
        ``(train, heldout, stats)``. Records hold ``id`` (``<source>-<index:05d>``),
        ``question``, ``facts_a``, ``facts_b``, ``shared_question``, ``gold`` and ``answer``.
        ``stats`` has a ``"train"`` and a ``"heldout"`` entry with ``total``, ``eligible``,
        ``dropped`` (count per reason: ``one_fact_sentence``, ``no_fact_sentence``,
        ``no_question``, and for the held-out pool ``in_train_pool``), ``drawn`` and
        ``sentences_per_seat`` (``{"a": {"mean", "min", "max"}, "b": {...}}`` over the drawn
        problems).

    Raises:
        DataError: A pool has fewer eligible problems than requested.
    """
    train_texts = frozenset(" ".join(problem["question"].split()) for problem in train_pool)
    train, train_stats = _draw_pool(train_pool, n_train, "n_train", data_seed)
    heldout, heldout_stats = _draw_pool(heldout_pool, n_heldout, "n_heldout", data_seed, train_texts)
    return train, heldout, {"train": train_stats, "heldout": heldout_stats}


def split_stage(params: dict, out_train: str, out_heldout: str, out_stats: str) -> dict:
    """The split stage: load the problems, split facts, draw the train and held-out sets, write them and their statistics."""
    n_gen = max(4 * params["n_train"], 64), max(4 * params["n_heldout"], 64)
    train_pool, test_pool = load_gsm8k(
        params["source"],
        params["local_dir"],
        seed=params["data_seed"],
        n_generated_train=n_gen[0],
        n_generated_test=n_gen[1],
        world=params["world"],
    )
    train, heldout, stats = draw_problems(
        train_pool, test_pool, params["n_train"], params["n_heldout"], params["data_seed"]
    )
    for record in train + heldout:  # the seat prompts' style travels with the problems to every stage
        record["prompt_style"] = params["prompt"]
    stats["params"] = params
    write_jsonl(out_train, train)
    write_jsonl(out_heldout, heldout)
    write_json(out_stats, stats)
    log.info(
        "split: %d train, %d held-out (eligible %d / %d)",
        len(train),
        len(heldout),
        stats["train"]["eligible"],
        stats["heldout"]["eligible"],
    )
    return stats
