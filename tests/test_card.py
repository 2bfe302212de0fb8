"""Tests for talkmethods.card: Learned sentences from synthetic summaries, and the written card."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_aggregate import GOOD_REWARDS, BASE_REWARDS, N_PROBLEMS, make_results  # noqa: E402

from talkmethods.aggregate import summarize  # noqa: E402
from talkmethods.card import OFFLINE_LINE, REFERENCES, learned_sentences, write_card  # noqa: E402

SECTIONS = ["## Recipe", "## Run", "## Result", "## Checks", "## Climb", "## Learned", "## References"]


def _kind(mean, lo, hi, values, beats=None, overlaps_base=True):
    beats = beats if beats is not None else [False] * len(values)
    return {"mean": mean, "lo": lo, "hi": hi,
            "per_seed": [{"seed": 17 + i, "value": v, "p_value": 0.02 if b else 0.4, "beats_base": b}
                         for i, (v, b) in enumerate(zip(values, beats))],
            "seeds_beat_base": sum(beats), "overlaps_base": overlaps_base, "figures": {}}


def synthetic_summary(arms: dict, comparisons: list[dict], base=(0.21, 0.17, 0.25)) -> dict:
    """A summary with just the keys learned_sentences reads.

    ``arms``: name -> (eval kind dict, crossplay kind dict, seeds learned).
    """
    per_arm = {}
    for name, (ev, cp, k) in arms.items():
        per_arm[name] = {"n_seeds": len(ev["per_seed"]), "seeds_learned": k,
                         "kinds": {"eval": ev, "crossplay": cp}}
    return {"alpha": 0.05, "arms": list(arms), "per_arm": per_arm, "comparisons": comparisons,
            "base": {"mean": base[0], "lo": base[1], "hi": base[2]}}


def test_overlapping_intervals_say_needs_more_seeds_with_both_numbers():
    summary = synthetic_summary(
        {"ada": (_kind(0.31, 0.27, 0.35, [0.30, 0.33, 0.30], [True, True, False]), _kind(0.22, 0.18, 0.26, [0.2] * 3), 2),
         "grpo": (_kind(0.29, 0.24, 0.33, [0.28, 0.31, 0.28]), _kind(0.20, 0.16, 0.24, [0.2] * 3), 0)},
        [{"x": "ada", "y": "grpo", "kind": "eval", "poi": 0.67, "lo": 0.11, "hi": 1.0, "overlap": True}])
    sentences = learned_sentences(summary)
    [pair] = [s for s in sentences if "needs more seeds" in s]
    assert "ada (0.31 [0.27, 0.35])" in pair and "grpo (0.29 [0.24, 0.33])" in pair
    assert "P(ada > grpo) = 0.67 [0.11, 1.00]" in pair
    assert not any("is ahead of" in s for s in sentences)
    learned = [s for s in sentences if " learned on " in s]
    assert any(s.startswith("ada learned on 2 of 3 seeds") and "0.21 [0.17, 0.25]" in s for s in learned)
    assert any(s.startswith("grpo learned on 0 of 3 seeds") for s in learned)
    carry = [s for s in sentences if "base partner in seat B" in s]
    assert len(carry) == 2 and all("overlap" in s and "no carry-over" in s for s in carry)


@pytest.mark.parametrize("order", ["winner_first", "winner_second"])
def test_clear_gap_names_the_winner_with_its_numbers(order):
    ada = (_kind(0.45, 0.41, 0.49, [0.44, 0.47, 0.44], [True] * 3, overlaps_base=False),
           _kind(0.34, 0.30, 0.38, [0.34] * 3, [True] * 3, overlaps_base=False), 3)
    grpo = (_kind(0.28, 0.24, 0.33, [0.27, 0.30, 0.27], [True, False, True], overlaps_base=False),
            _kind(0.12, 0.08, 0.15, [0.12] * 3, overlaps_base=False), 2)
    if order == "winner_first":
        arms, comp = {"ada": ada, "grpo": grpo}, {"x": "ada", "y": "grpo", "poi": 1.0, "lo": 0.9, "hi": 1.0}
    else:
        arms, comp = {"grpo": grpo, "ada": ada}, {"x": "grpo", "y": "ada", "poi": 0.0, "lo": 0.0, "hi": 0.1}
    summary = synthetic_summary(arms, [dict(comp, kind="eval", overlap=False)])
    sentences = learned_sentences(summary)
    [pair] = [s for s in sentences if "is ahead of" in s]
    assert pair.startswith("ada (0.45 [0.41, 0.49]) is ahead of grpo (0.28 [0.24, 0.33])")
    assert "P(ada > grpo) = 1.00 [0.90, 1.00]" in pair
    assert not any("needs more seeds" in s for s in sentences)
    carry = {s.split()[0]: s for s in sentences if "base partner in seat B" in s}
    assert "above base × base 0.21 [0.17, 0.25]" in carry["ada"] and "carries over" in carry["ada"]
    assert "0.34 [0.30, 0.38]" in carry["ada"]
    assert "below base × base" in carry["grpo"] and "carries over" not in carry["grpo"]


def test_every_sentence_has_numbers():
    summary = synthetic_summary(
        {"raft": (_kind(0.5, 0.4, 0.6, [0.5]), _kind(0.2, 0.15, 0.25, [0.2]), 1)}, [])
    sentences = learned_sentences(summary)
    assert sentences and all(re.search(r"\d\.\d\d", s) for s in sentences)


@pytest.fixture(scope="module")
def summary_and_root(tmp_path_factory):
    root = make_results(tmp_path_factory.mktemp("R"), arms=("grpo", "ada", "raft"), seeds=(17, 18, 19), steps=12)
    return summarize(root, ["grpo", "ada", "raft"], [17, 18, 19], n_boot=1000, alpha=0.05, seed=0), root


META = {"model": "offline-tiny-qwen2", "data": "generated word problems (64 train / 20 held-out)",
        "device": "cpu (x86_64)",
        "recipe": {"steps": 12, "problems_per_step": 4, "chats_per_problem": 4, "learning_rate": 1e-4, "lora_r": 32,
                   "lora_alpha": 64, "loss_type": "dapo", "beta": 0.0, "num_iterations": 1, "temperature": 1.0,
                   "max_new_tokens": 12, "seeds": [17, 18, 19], "arms": ["grpo", "ada", "raft"]}}


@pytest.mark.parametrize("offline", [True, False])
def test_write_card_sections_and_png(summary_and_root, tmp_path, offline):
    summary, root = summary_and_root
    md, png = tmp_path / "card.md", tmp_path / "card.png"
    write_card(summary, root, md, png, dict(META, offline=offline))
    text = md.read_text()
    first = text.splitlines()[0]
    if offline:
        assert first == OFFLINE_LINE and "say nothing about the methods" in first
    else:
        assert first == "# Talk Methods card" and "say nothing about the methods" not in text
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    result = text[text.index("## Result"):text.index("## Checks")]
    for arm in ("grpo", "ada", "raft"):
        assert re.search(rf"^\| {arm} \| \d\.\d\d \[\d\.\d\d, \d\.\d\d\] \|", result, re.M)
    assert "| ada | 0.88 [" in result and "| 3/3 |" in result and "| 0/3 |" in result
    assert re.search(r"^\| base × base \| 0\.12 \[", result, re.M)
    checks = text[text.index("## Checks"):text.index("## Climb")]
    assert "PASSED" in checks and "split keeps every sentence" in checks and "15 one fact sentence" in checks
    assert "Longest seat prompt in training: 311 tokens" in checks
    climb = text[text.index("## Climb"):text.index("## Learned")]
    assert "](card.png)" in climb and "- ada: 0.10 → 0.60" in climb
    learned = text[text.index("## Learned"):text.index("## References")]
    for s in learned_sentences(summary):
        assert s in learned
    assert "is ahead of" in learned  # ada vs grpo, raft: a clear gap
    assert "needs more seeds" in learned  # grpo vs raft: identical
    for ref in REFERENCES:
        assert ref in text
    assert "arXiv:2108.13264" in text and "arXiv:2510.04996" in text
    assert "CPU seconds" in text
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries


def test_write_card_reads_checks_from_results_dir(summary_and_root, tmp_path):
    summary, root = summary_and_root
    bare = {k: v for k, v in summary.items() if k != "checks"}
    write_card(bare, root, tmp_path / "out" / "card.md", tmp_path / "out" / "figs" / "card.png", dict(META, offline=True))
    text = (tmp_path / "out" / "card.md").read_text()
    assert "](figs/card.png)" in text and "PASSED" in text
    assert sum(GOOD_REWARDS) / N_PROBLEMS > sum(BASE_REWARDS) / N_PROBLEMS
