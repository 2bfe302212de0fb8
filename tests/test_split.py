"""Tests for talkmethods.split: hand-made cases, hypothesis properties, all 8,792 GSM8K problems."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talkmethods import split as split_module
from talkmethods.problems import DataError, load_gsm8k, write_jsonl
from talkmethods.split import FactSplit, draw_problems, split_facts, split_sentences

# CI clones the repo to $d/p with the shared folder at $d/shared: the same layout as here.
GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"

# Measured with pySBD 0.3.4 (clean=False), last sentence = question; matches DESIGN.md.
ELIGIBLE = {"train": 5865, "test": 1057}
ONE_FACT = {"train": 1524, "test": 244}
NO_FACT = {"train": 84, "test": 18}


def _squash(text: str) -> str:
    """Drop all whitespace, for 'equal modulo whitespace'."""
    return "".join(text.split())


def _assert_partition(text: str, split: FactSplit | None, sentences: list[str]) -> None:
    """Every sentence is in exactly one seat or is the question, in order, nothing lost."""
    if len(sentences) < 3:
        assert split is None
        return
    assert split is not None
    assert split.sentences() == sentences
    assert split.facts_a == tuple(sentences[0:-1:2])
    assert split.facts_b == tuple(sentences[1:-1:2])
    assert split.question == sentences[-1]
    assert Counter(split.facts_a + split.facts_b + (split.question,)) == Counter(sentences)
    assert _squash("".join(split.sentences())) == _squash(text)


def _assert_in_order(text: str, sentences: list[str]) -> None:
    """Sentences are verbatim slices of text, in order, with only whitespace between them."""
    pos = 0
    for sentence in sentences:
        found = text.find(sentence, pos)
        assert found >= 0, (sentence, text)
        assert not text[pos:found].strip(), (text[pos:found], text)
        pos = found + len(sentence)
    assert not text[pos:].strip()


# ---- hand-made cases ---------------------------------------------------------------------


def test_split_sentences_strips_and_drops_empty():
    assert split_sentences("  Ava has 3 pens.   Ben has 2.  \n") == ["Ava has 3 pens.", "Ben has 2."]
    assert split_sentences("") == []
    assert split_sentences("   \n ") == []


def test_money_decimal_is_not_a_boundary():
    split = split_facts("Ava pays $2.50 for a pen. Ben pays $1.25 for a cup. How much do they pay?")
    assert split == FactSplit(
        ("Ava pays $2.50 for a pen.",), ("Ben pays $1.25 for a cup.",), "How much do they pay?"
    )


def test_title_abbreviations_are_not_boundaries():
    split = split_facts("Mr. Smith has 3 dogs. Mrs. Jones has 2 cats. How many pets do they have?")
    assert split is not None
    assert split.facts_a == ("Mr. Smith has 3 dogs.",)
    assert split.facts_b == ("Mrs. Jones has 2 cats.",)


def test_decimal_hours_are_not_boundaries():
    split = split_facts("Lena works 3.5 hours a day. She earns $12 an hour. How much does she earn?")
    assert split is not None
    assert split.sentences() == [
        "Lena works 3.5 hours a day.",
        "She earns $12 an hour.",
        "How much does she earn?",
    ]


def test_real_gsm8k_first_rows():
    # GSM8K train line 1 has one fact sentence; line 2 has two.
    natalia = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. How many clips did Natalia sell altogether in April and May?"
    )
    assert split_facts(natalia) is None
    weng = (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?"
    )
    assert split_facts(weng) == FactSplit(
        ("Weng earns $12 an hour for babysitting.",),
        ("Yesterday, she just did 50 minutes of babysitting.",),
        "How much did she earn?",
    )


def test_text_pysbd_drops_is_kept():
    # pySBD 0.3.4 itself returns ['a? ', 'b? ', 'c.'] here: the final '??' would be lost.
    assert split_sentences("a? b? c.??") == ["a?", "b?", "c.??"]
    assert split_sentences("Is it M.?? Yes.") == ["Is it M.", "?? Yes."]


class _FakeSegmenter:
    """Stands in for pySBD to exercise the guards that real GSM8K never triggers."""

    def __init__(self, segments: list[str]):
        self.segments = segments

    def segment(self, text: str) -> list[str]:
        return self.segments


@pytest.mark.parametrize(
    ("segments", "expected"),
    [
        (["b. ", "c?"], ["a. b.", "c?"]),  # text before the first segment joins it
        ([], ["a. b. c?"]),  # no segments for non-blank text: one sentence
        (["a. ", "B, altered. ", "c?"], ["a. b.", "c?"]),  # not verbatim: no cut there
        (["a. ", "  ", "b. c?"], ["a.", "b. c?"]),  # blank segments are no boundary
    ],
)
def test_boundaries_are_cut_from_the_text(monkeypatch, segments, expected):
    monkeypatch.setattr(split_module, "_SEGMENTER", _FakeSegmenter(segments))
    assert split_module.split_sentences("a. b. c?") == expected


@pytest.mark.parametrize(
    "text",
    ["", "How many apples are there?", "Ava has 3 apples. How many apples does she have?"],
)
def test_fewer_than_two_facts_is_ineligible(text):
    assert split_facts(text) is None


def test_alternation_order_and_counts():
    text = "F1 is one. F2 is two. F3 is three. F4 is four. F5 is five. What is the sum?"
    split = split_facts(text)
    assert split is not None
    assert split.facts_a == ("F1 is one.", "F3 is three.", "F5 is five.")
    assert split.facts_b == ("F2 is two.", "F4 is four.")
    assert split.question == "What is the sum?"
    assert split.sentence_counts() == {"a": 3, "b": 2}
    assert split.sentences() == split_sentences(text)


def test_fact_split_is_frozen():
    split = FactSplit(("a.",), ("b.",), "q?")
    with pytest.raises(dataclasses.FrozenInstanceError):
        split.question = "other?"  # type: ignore[misc]


# ---- draw_problems on small pools ----------------------------------------------------------


def _pool(source: str, n_two: int, n_one: int = 0, n_none: int = 0, start: int = 0) -> list[dict]:
    """A pool of hand-made problems: n_two eligible, n_one with one fact, n_none with none."""
    shapes = [2] * n_two + [1] * n_one + [0] * n_none
    pool = []
    for index, n_facts in enumerate(shapes, start=start):
        facts = [f"Box {index} holds {k + 2} pens." for k in range(n_facts)]
        question = f"How many pens are in box {index}?"
        pool.append(
            {
                "source": source,
                "index": index,
                "question": " ".join([*facts, question]),
                "answer": f"Add them.\n#### {index}",
                "gold": str(index),
            }
        )
    return pool


def test_draw_records_stats_and_order():
    train_pool = _pool("t-train", n_two=10, n_one=3, n_none=2)
    heldout_pool = _pool("t-test", n_two=6, n_one=1, start=100)
    train, heldout, stats = draw_problems(train_pool, heldout_pool, 4, 2, data_seed=5)
    # Drawn order is the order random.Random(data_seed).sample gives over the eligible list.
    expected = random.Random(5).sample(range(10), 4)
    assert [r["id"] for r in train] == [f"t-train-{i:05d}" for i in expected]
    assert train[0] == {
        "id": f"t-train-{expected[0]:05d}",
        "question": train_pool[expected[0]]["question"],
        "facts_a": [f"Box {expected[0]} holds 2 pens."],
        "facts_b": [f"Box {expected[0]} holds 3 pens."],
        "shared_question": f"How many pens are in box {expected[0]}?",
        "gold": str(expected[0]),
        "answer": f"Add them.\n#### {expected[0]}",
    }
    assert stats["train"] == {
        "total": 15,
        "eligible": 10,
        "dropped": {"one_fact_sentence": 3, "no_fact_sentence": 2},
        "drawn": 4,
        "sentences_per_seat": {
            "a": {"mean": 1.0, "min": 1, "max": 1},
            "b": {"mean": 1.0, "min": 1, "max": 1},
        },
    }
    assert stats["heldout"]["eligible"] == 6
    assert stats["heldout"]["dropped"] == {
        "one_fact_sentence": 1,
        "no_fact_sentence": 0,
        "in_train_pool": 0,
    }
    assert len(heldout) == 2


def test_draw_is_deterministic_by_seed():
    pools = (_pool("a", 30), _pool("b", 30, start=100))
    first = draw_problems(*pools, 10, 5, data_seed=1)
    assert draw_problems(*pools, 10, 5, data_seed=1) == first
    assert draw_problems(*pools, 10, 5, data_seed=2)[0] != first[0]
    # The held-out draw does not move when n_train changes.
    assert draw_problems(*pools, 12, 5, data_seed=1)[1] == first[1]


def test_draw_drops_heldout_questions_seen_in_train():
    train_pool = _pool("tr", 5)
    heldout_pool = _pool("te", 5, start=3)  # indices 3, 4 repeat train questions
    _, heldout, stats = draw_problems(train_pool, heldout_pool, 5, 3, data_seed=0)
    assert stats["heldout"]["dropped"]["in_train_pool"] == 2
    assert stats["heldout"]["eligible"] == 3
    assert {r["id"] for r in heldout} == {"te-00005", "te-00006", "te-00007"}


@pytest.mark.parametrize(
    ("n_train", "n_heldout", "key", "requested", "eligible"),
    [(9, 2, "n_train", 9, 8), (2, 7, "n_heldout", 7, 4)],
)
def test_draw_too_few_eligible_names_key_and_counts(n_train, n_heldout, key, requested, eligible):
    train_pool = _pool("tr", 8, n_one=5)
    heldout_pool = _pool("te", 4, n_none=3, start=50)
    with pytest.raises(DataError) as err:
        draw_problems(train_pool, heldout_pool, n_train, n_heldout, data_seed=0)
    message = str(err.value)
    assert key in message
    assert f"{requested} requested" in message
    assert f"only {eligible} of" in message


# ---- properties on generated text ------------------------------------------------------------

_SUBJECTS = ("Ava", "Mr. Smith", "Mrs. Lee", "Dr. Brown", "The shop", "Her brother", "Each box")
_PHRASES = (
    "pays $2.50 for a pen",
    "works 3.5 hours a day",
    "has 12 apples",
    "buys 3 pens at $1.25 each",
    "walks 2.5 miles to school",
    "sells 1,200 cards in May",
    "gives away 40% of the cakes",
    "reads 20 pages",
)
_ENDS = (".", "?", "!")

sentence_strategy = st.builds(
    lambda subject, phrase, tail, end: f"{subject} {phrase}{tail}{end}",
    st.sampled_from(_SUBJECTS),
    st.sampled_from(_PHRASES),
    st.sampled_from(("", ", and then rests", " on Monday")),
    st.sampled_from(_ENDS),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(sentence_strategy, min_size=1, max_size=8),
    st.sampled_from((" ", "  ", "\n", " \n ")),
)
def test_generated_sentences_each_land_in_one_seat(sentences, glue):
    text = glue.join(sentences)
    assert split_sentences(text) == sentences
    _assert_partition(text, split_facts(text), sentences)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=200))
def test_any_text_splits_into_a_partition(text):
    sentences = split_sentences(text)
    _assert_partition(text, split_facts(text), sentences)


# ---- all 8,792 real GSM8K problems ------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_pools() -> tuple[list[dict], list[dict]]:
    if not (GSM8K_DIR / "train.jsonl").is_file() or not (GSM8K_DIR / "test.jsonl").is_file():
        pytest.fail(
            f"real GSM8K not found at {GSM8K_DIR} (train.jsonl, test.jsonl): the tests expect "
            "the shared data folder beside the repository, at ../shared/data/gsm8k"
        )
    return load_gsm8k("local", GSM8K_DIR)


def test_every_real_problem_splits_into_a_partition(gsm8k_pools):
    train, test = gsm8k_pools
    assert (len(train), len(test)) == (7473, 1319)
    counts: Counter[tuple[str, str]] = Counter()
    for name, pool in (("train", train), ("test", test)):
        for problem in pool:
            text = problem["question"]
            sentences = split_sentences(text)
            _assert_in_order(text, sentences)
            _assert_partition(text, split_facts(text), sentences)
            n_facts = len(sentences) - 1
            counts[name, "eligible" if n_facts >= 2 else "one" if n_facts == 1 else "none"] += 1
    for name in ("train", "test"):
        assert counts[name, "eligible"] == ELIGIBLE[name]
        assert counts[name, "one"] == ONE_FACT[name]
        assert counts[name, "none"] == NO_FACT[name]
    # DESIGN.md: 6,922 of 8,792 eligible, 1,768 with one fact sentence, 102 with none.
    assert sum(ELIGIBLE.values()) == 6922
    assert sum(ONE_FACT.values()) == 1768
    assert sum(NO_FACT.values()) == 102


def test_real_draw_is_disjoint_and_stable(gsm8k_pools, tmp_path):
    train_pool, test_pool = gsm8k_pools
    train, heldout, stats = draw_problems(train_pool, test_pool, 1024, 300, data_seed=0)
    assert (len(train), len(heldout)) == (1024, 300)
    assert stats["train"]["eligible"] == ELIGIBLE["train"]
    assert stats["heldout"]["eligible"] == ELIGIBLE["test"]
    assert stats["train"]["dropped"] == {
        "one_fact_sentence": ONE_FACT["train"],
        "no_fact_sentence": NO_FACT["train"],
    }
    ids = [r["id"] for r in train + heldout]
    assert len(set(ids)) == 1324
    assert all(i.startswith("gsm8k-train-") for i in ids[:1024])
    assert all(i.startswith("gsm8k-test-") for i in ids[1024:])
    assert not {r["question"] for r in train} & {r["question"] for r in heldout}
    for record in train + heldout:
        assert len(record["facts_a"]) >= 1 and len(record["facts_b"]) >= 1
        assert record["gold"].lstrip("-").isdigit()

    again = draw_problems(train_pool, test_pool, 1024, 300, data_seed=0)
    for name, records in (("1", (train, heldout)), ("2", again[:2])):
        write_jsonl(tmp_path / name / "train.jsonl", records[0])
        write_jsonl(tmp_path / name / "heldout.jsonl", records[1])
    for file in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / "1" / file).read_bytes() == (tmp_path / "2" / file).read_bytes()
    assert again[2] == stats
