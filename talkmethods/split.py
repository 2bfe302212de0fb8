"""The fact split: each seat sees half of a problem's facts, both see the question.

A question is cut into sentences with pySBD (``clean=False``, so no text is altered). The
last sentence, the one that asks, goes to both seats; the fact sentences before it are dealt
alternately, A the 1st, 3rd, ..., B the 2nd, 4th, .... A problem with fewer than two fact
sentences is not eligible. `draw_problems` filters two pools, draws the train and held-out
problems with a fixed ``data_seed`` and reports split statistics for the card.
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import pysbd

from talkmethods.problems import DataError

log = logging.getLogger(__name__)

# One segmenter for the module: building it compiles pySBD's rules. clean=False keeps the text
# byte-for-byte, so the seats' sentences rebuild the question (checked on all 8,792 GSM8K problems).
_SEGMENTER = pysbd.Segmenter(language="en", clean=False)

DROP_REASONS = ("one_fact_sentence", "no_fact_sentence")


@dataclass(frozen=True)
class FactSplit:
    """One problem's view per seat.

    Attributes:
        facts_a: Seat A's fact sentences (the 1st, 3rd, ... of the problem).
        facts_b: Seat B's fact sentences (the 2nd, 4th, ...).
        question: The final, asking sentence, shown to both seats.
    """

    facts_a: tuple[str, ...]
    facts_b: tuple[str, ...]
    question: str

    def sentence_counts(self) -> dict[str, int]:
        """Return the number of fact sentences per seat: ``{"a": n_a, "b": n_b}``."""
        return {"a": len(self.facts_a), "b": len(self.facts_b)}

    def sentences(self) -> list[str]:
        """Return all sentences in their original order: facts interleaved, then the question."""
        ordered = []
        for i in range(len(self.facts_a) + len(self.facts_b)):
            ordered.append(self.facts_a[i // 2] if i % 2 == 0 else self.facts_b[i // 2])
        return ordered + [self.question]


def split_sentences(text: str) -> list[str]:
    """Split text into sentences with pySBD.

    pySBD picks the boundaries; each sentence is then cut from the original text, from its
    start to the next sentence's start. On GSM8K this equals pySBD's own output (stripped),
    but on odd punctuation pySBD 0.3.4 drops characters (``"a? b? c.??"`` gives
    ``["a? ", "b? ", "c."]``, losing the final ``??``); cutting from the text keeps every
    character, so no part of a fact can vanish from both seats.

    Args:
        text: Any text, e.g. a GSM8K question.

    Returns:
        The stripped, non-empty sentences in order; joined they give ``text`` up to whitespace.
    """
    starts, pos = [], 0
    for segment in _SEGMENTER.segment(text):
        core = segment.strip()
        found = text.find(core, pos) if core else -1
        if found < 0:  # empty, or not verbatim in the text: no boundary to cut at
            continue
        starts.append(found)
        pos = found + len(core)
    if not starts:
        return [text.strip()] if text.strip() else []
    ends = starts[1:] + [len(text)]
    starts[0] = 0  # anything pySBD left out before its first sentence stays in the first
    return [text[start:end].strip() for start, end in zip(starts, ends)]


def _deal(sentences: Sequence[str]) -> FactSplit | None:
    """Deal already-split sentences: last one shared, facts alternate A, B, A, ...."""
    if len(sentences) < 3:
        return None
    facts = sentences[:-1]
    return FactSplit(tuple(facts[0::2]), tuple(facts[1::2]), sentences[-1])


def split_facts(question: str) -> FactSplit | None:
    """Split a problem into the two seats' facts and the shared question.

    Args:
        question: The full problem text.

    Returns:
        The split, or None when the problem has fewer than two fact sentences (ineligible).
    """
    return _deal(split_sentences(question))


def _drop_reason(n_sentences: int) -> str:
    """Name why a problem with this many sentences is ineligible."""
    return "one_fact_sentence" if n_sentences == 2 else "no_fact_sentence"


def _seat_stats(counts: list[int]) -> dict[str, float]:
    """Mean, min and max of per-problem sentence counts (zeros when nothing was drawn)."""
    if not counts:
        return {"mean": 0.0, "min": 0, "max": 0}
    return {"mean": statistics.fmean(counts), "min": min(counts), "max": max(counts)}


def _eligible(pool: Sequence[dict]) -> tuple[list[tuple[dict, FactSplit]], dict[str, int]]:
    """Split every problem of a pool; return the eligible ones and the drop counts."""
    eligible, dropped = [], dict.fromkeys(DROP_REASONS, 0)
    for problem in pool:
        sentences = split_sentences(problem["question"])
        split = _deal(sentences)
        if split is None:
            dropped[_drop_reason(len(sentences))] += 1
        else:
            eligible.append((problem, split))
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
            f"its pool are eligible (two or more fact sentences); lower {key} or use more data"
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
            seat: _seat_stats([split.sentence_counts()[seat] for _, split in drawn])
            for seat in ("a", "b")
        },
    }
    log.info(
        "%s: %d of %d eligible, dropped %s, drew %d", key, len(eligible), len(pool), dropped, n
    )
    return records, stats


def draw_problems(
    train_pool: Sequence[dict],
    heldout_pool: Sequence[dict],
    n_train: int,
    n_heldout: int,
    data_seed: int,
) -> tuple[list[dict], list[dict], dict]:
    """Draw the train and held-out problems every arm and seed shares.

    Each pool is filtered to eligible problems (two or more fact sentences) and sampled
    without replacement with ``random.Random(data_seed)``, keeping the drawn order. Held-out
    problems whose question text also occurs in the train pool are dropped, so the two sets
    never share a question even when a local data folder overlaps.

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
        ``dropped`` (count per reason: ``one_fact_sentence``, ``no_fact_sentence``, and for
        the held-out pool ``in_train_pool``), ``drawn`` and ``sentences_per_seat``
        (``{"a": {"mean", "min", "max"}, "b": {...}}`` over the drawn problems).

    Raises:
        DataError: A pool has fewer eligible problems than requested.
    """
    train_texts = frozenset(" ".join(problem["question"].split()) for problem in train_pool)
    train, train_stats = _draw_pool(train_pool, n_train, "n_train", data_seed)
    heldout, heldout_stats = _draw_pool(heldout_pool, n_heldout, "n_heldout", data_seed, train_texts)
    return train, heldout, {"train": train_stats, "heldout": heldout_stats}
