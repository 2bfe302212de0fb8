"""Tests for talkmethods.card: the Learned summary from hand-made summaries, the Run lines, and the written card."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_aggregate import BASE_REWARDS, GOOD_REWARDS, N_PROBLEMS, make_results  # noqa: E402

from talkmethods import card  # noqa: E402
from talkmethods.aggregate import summarize  # noqa: E402
from talkmethods.card import OFFLINE_LINE, OFFLINE_TITLE, REFERENCES, learned_sentences, render_card, write_card  # noqa: E402

SECTIONS = ["## Recipe", "## Run", "## Result", "## Checks", "## Climb", "## Learned", "## References"]
MAX_LINES = 6  # the Learned section is a summary, not a list of every comparison


# ---------------------------------------------------------------------------------------------
# Hand-made summaries (only the keys learned_sentences reads).
# ---------------------------------------------------------------------------------------------


def _kind(mean, lo, hi, values=None, beats=None, overlaps_base=True, figures=None):
    values = values if values is not None else [mean] * 3
    beats = beats if beats is not None else [False] * len(values)
    return {
        "mean": mean,
        "lo": lo,
        "hi": hi,
        "per_seed": [
            {"seed": 17 + i, "value": v, "p_value": 0.02 if b else 0.4, "beats_base": bool(b)}
            for i, (v, b) in enumerate(zip(values, beats))
        ],
        "seeds_beat_base": sum(map(bool, beats)),
        "overlaps_base": overlaps_base,
        "figures": figures or {},
    }


def _arm(ev, cp=None, ba=None, drawn=None):
    """An arm entry: held-out ``ev``, optional cross-play kinds and chats drawn per step."""
    kinds = {"eval": ev, **({"crossplay": cp} if cp else {}), **({"crossplay_bA": ba} if ba else {})}
    return {
        "n_seeds": len(ev["per_seed"]),
        "seeds_learned": ev["seeds_beat_base"],
        "kinds": kinds,
        "train": {"chats_drawn_per_step": drawn},
    }


def _comp(x, y, poi, lo, hi, overlap):
    return {"x": x, "y": y, "kind": "eval", "poi": poi, "lo": lo, "hi": hi, "overlap": overlap}


def synthetic_summary(arms: dict, comparisons: list[dict], base=(0.21, 0.17, 0.25), base_figures=None) -> dict:
    """A summary with just the keys learned_sentences reads; ``arms``: name -> ``_arm(...)``."""
    return {
        "alpha": 0.05,
        "arms": list(arms),
        "per_arm": dict(arms),
        "comparisons": comparisons,
        "base": {"mean": base[0], "lo": base[1], "hi": base[2], **(base_figures or {})},
    }


def _figs(chars, use):
    return {"chars_A": chars, "chars_B": chars, "partner_use_A": use, "partner_use_B": use}


def _ranked_arms(line: str) -> list[str]:
    """Arm names in the order the ranking line lists them."""
    body = line.split(":", 1)[1].split(";")[0]
    return re.findall(r"(?:^|[>=] )([a-z_]+) \d", body.strip())


def _check_shape(lines: list[str]) -> None:
    assert 1 <= len(lines) <= MAX_LINES
    assert all(re.search(r"\d", s) for s in lines)  # every line carries the numbers (or counts) it rests on


CLEAR = synthetic_summary(
    {
        "grpo": _arm(
            _kind(0.28, 0.24, 0.32, [0.27, 0.30, 0.27], [1, 0, 1], overlaps_base=False),
            _kind(0.12, 0.08, 0.15, overlaps_base=False),
            drawn=32.0,
        ),
        "ada": _arm(
            _kind(0.45, 0.41, 0.49, [0.44, 0.47, 0.44], [1, 1, 1], overlaps_base=False),
            _kind(0.34, 0.30, 0.38, [0.34] * 3, [1, 1, 1], overlaps_base=False),
            drawn=48.0,
        ),
    },
    [_comp("grpo", "ada", 0.0, 0.0, 0.1, overlap=False)],
)


# ---------------------------------------------------------------------------------------------
# (a) a clear winner.
# ---------------------------------------------------------------------------------------------


def test_clear_winner_is_ranked_first_and_its_lead_is_supported():
    lines = learned_sentences(CLEAR)
    _check_shape(lines)
    ranking, stats = lines[0], lines[1]
    assert ranking.startswith("Ranking by held-out team accuracy")
    assert _ranked_arms(ranking) == ["ada", "grpo"]
    assert "ada 0.45 [0.41, 0.49] (3/3 seeds learned) > grpo 0.28 [0.24, 0.32] (2/3)" in ranking
    assert "base × base 0.21 [0.17, 0.25]" in ranking
    assert "ada on 3 of 3 seeds, grpo on 2 of 3" in stats
    # The comparison is stored as P(grpo > ada); the card turns it round for the winner.
    assert "ada's lead is supported over grpo" in stats and "P(ada > grpo) = 1.00 [0.90, 1.00]" in stats
    assert "within noise" not in " ".join(lines) and "needs more seeds" not in " ".join(lines)
    [carry] = [s for s in lines if s.startswith("Cross-play")]
    assert "ada 0.34 [0.30, 0.38] is above it, so the skill carries over" in carry
    assert "grpo 0.12 [0.08, 0.15] is below it" in carry and "grpo 0.12 [0.08, 0.15] is above" not in carry


def test_cost_line_compares_ada_with_the_others():
    [cost] = [s for s in learned_sentences(CLEAR) if "chats drawn" in s]
    assert "ada 48.0 against 32.0 for grpo (1.50×)" in cost
    no_ada = synthetic_summary(
        {"grpo": _arm(_kind(0.3, 0.2, 0.4), drawn=32.0), "raft": _arm(_kind(0.3, 0.2, 0.4), drawn=32.0)}, []
    )
    assert not any("chats drawn" in s for s in learned_sentences(no_ada))


# ---------------------------------------------------------------------------------------------
# (b) everything within noise.
# ---------------------------------------------------------------------------------------------


def test_everything_within_noise_says_needs_more_seeds_and_claims_no_gap():
    summary = synthetic_summary(
        {
            "grpo": _arm(_kind(0.29, 0.24, 0.33, [0.28, 0.31, 0.28]), _kind(0.20, 0.16, 0.24)),
            "ada": _arm(_kind(0.31, 0.27, 0.35, [0.30, 0.33, 0.30], [1, 1, 0]), _kind(0.22, 0.18, 0.26)),
            "raft": _arm(_kind(0.30, 0.26, 0.34, [0.29, 0.31, 0.30], [0, 1, 0]), _kind(0.21, 0.17, 0.25)),
        },
        [
            _comp("grpo", "ada", 0.33, 0.0, 0.89, True),
            _comp("grpo", "raft", 0.44, 0.0, 1.0, True),
            _comp("ada", "raft", 0.67, 0.11, 1.0, True),
        ],
    )
    lines = learned_sentences(summary)
    _check_shape(lines)
    assert _ranked_arms(lines[0]) == ["ada", "raft", "grpo"]
    stats = lines[1]
    assert "ada on 2 of 3 seeds, raft on 1 of 3, grpo on 0 of 3" in stats
    assert "ada's lead is within noise over raft and grpo: needs more seeds (intervals overlap;" in stats
    assert "P(ada > raft) = 0.67 [0.11, 1.00]" in stats and "P(ada > grpo) = 0.67 [0.11, 1.00]" in stats
    assert "lead is supported" not in stats and "No gap among the other arms is supported" in stats
    [carry] = [s for s in lines if s.startswith("Cross-play")]
    assert "overlap it, so no carry-over to a base partner is shown" in carry and "carries over" not in carry


def test_intervals_apart_but_probability_of_improvement_reaching_half_is_still_noise():
    summary = synthetic_summary(
        {"ada": _arm(_kind(0.40, 0.36, 0.44)), "grpo": _arm(_kind(0.30, 0.26, 0.34))},
        [_comp("ada", "grpo", 0.78, 0.44, 1.0, overlap=False)],
    )
    stats = learned_sentences(summary)[1]
    assert "within noise over grpo: needs more seeds" in stats and "reaches 0.5" in stats
    assert "lead is supported" not in stats


# ---------------------------------------------------------------------------------------------
# (c) all zero: the old offline card.
# ---------------------------------------------------------------------------------------------


def test_all_zero_says_nothing_separates_the_arms():
    zero = _kind(0.0, 0.0, 0.0, [0.0] * 3, [0] * 3)
    arms = ("grpo", "ada", "raft", "mixed")
    summary = synthetic_summary(
        {a: _arm(zero, zero, zero, drawn=96.0 if a == "ada" else 32.0) for a in arms},
        [_comp(x, y, 0.5, 0.5, 0.5, True) for i, x in enumerate(arms) for y in arms[i + 1 :]],
        base=(0.0, 0.0, 0.0),
    )
    for a in arms:  # identical message figures: no difference to report
        summary["per_arm"][a]["kinds"]["eval"]["figures"] = _figs(40.0, 0.0)
    lines = learned_sentences(summary)
    _check_shape(lines)
    text = " ".join(lines)
    assert lines[0].startswith("Nothing separates the arms: grpo, ada, raft and mixed all score 0.00 [0.00, 0.00]")
    assert "as does base × base 0.00 [0.00, 0.00]" in lines[0]
    assert " > " not in text and "Ranking" not in text and "lead" not in text and "supported" not in text
    assert "no arm on any of its 3 seeds" in lines[1]
    assert "every arm (0.00 [0.00, 0.00]) overlaps it" in text and "carries over" not in text
    assert not any(s.startswith("Messages") for s in lines)


# ---------------------------------------------------------------------------------------------
# (d) mixed verdicts.
# ---------------------------------------------------------------------------------------------


def _mixed_summary():
    fig = {"grpo": _figs(180.0, 0.5), "ada": _figs(200.0, 0.6), "raft": _figs(91.0, 0.2), "mixed": _figs(210.0, 0.45)}
    evals = {
        "grpo": _kind(0.30, 0.22, 0.37, [0.33, 0.35, 0.22], [1, 1, 0], False),
        "ada": _kind(0.38, 0.33, 0.43, [0.36, 0.40, 0.38], [1, 1, 1], False),
        "raft": _kind(0.27, 0.25, 0.29, [0.26, 0.27, 0.28], [1, 1, 1], False),
        "mixed": _kind(0.20, 0.18, 0.22, [0.19, 0.20, 0.21], [0, 0, 0], True),
    }
    arms = {}
    for a, ev in evals.items():
        ev["figures"] = fig[a]
        cp = _kind(0.27, 0.25, 0.30, overlaps_base=False) if a == "ada" else _kind(0.23, 0.20, 0.26)
        arms[a] = _arm(ev, cp, _kind(0.22, 0.18, 0.26), drawn=47.3 if a == "ada" else 32.0)
    comps = [
        _comp("grpo", "ada", 0.22, 0.0, 0.67, True),
        _comp("grpo", "raft", 0.67, 0.22, 1.0, True),
        _comp("grpo", "mixed", 1.0, 1.0, 1.0, False),
        _comp("ada", "raft", 1.0, 1.0, 1.0, False),
        _comp("ada", "mixed", 1.0, 1.0, 1.0, False),
        _comp("raft", "mixed", 1.0, 1.0, 1.0, False),
    ]
    return synthetic_summary(arms, comps, base=(0.21, 0.18, 0.24), base_figures={**_figs(310.0, 0.3)})


def test_mixed_verdicts_group_arms_that_share_one():
    lines = learned_sentences(_mixed_summary())
    _check_shape(lines)
    assert _ranked_arms(lines[0]) == ["ada", "grpo", "raft", "mixed"]
    stats = lines[1]
    assert "ada and raft on 3 of 3 seeds, grpo on 2 of 3, mixed on 0 of 3" in stats
    assert "ada's lead is supported over raft and mixed" in stats
    assert "but within noise over grpo: needs more seeds" in stats
    assert "P(ada > grpo) = 0.78 [0.33, 1.00]" in stats
    # grpo and raft over mixed are supported; grpo over raft is not and is left unnamed.
    assert "Among the other arms, supported: grpo over mixed" in stats and "raft over mixed" in stats
    assert "grpo over raft" not in stats and "the others are within noise" in stats
    assert stats.count("P(") == 5  # one per named gap, not one per pair of arms
    carry = [s for s in lines if s.startswith("Cross-play")][0]
    assert "ada 0.27 [0.25, 0.30] is above it" in carry
    assert "grpo, raft and mixed (all 0.23 [0.20, 0.26]) overlap it" in carry
    assert "Base A × trained B against the same base × base: every arm (0.22 [0.18, 0.26]) overlaps it" in carry
    [cost] = [s for s in lines if "chats drawn" in s]
    assert "ada 47.3 against 32.0 for grpo, raft and mixed (1.48×)" in cost
    [msg] = [s for s in lines if s.startswith("Messages")]
    assert "from raft 91 to mixed 210 (base × base 310)" in msg and "from raft 0.20 to ada 0.60" in msg
    assert "without intervals" in msg


def test_ties_in_the_ranking_print_as_equal():
    summary = synthetic_summary(
        {
            "grpo": _arm(_kind(0.30, 0.2, 0.4)),
            "raft": _arm(_kind(0.30, 0.25, 0.35)),
            "mixed": _arm(_kind(0.10, 0.05, 0.15)),
        },
        [],
    )
    ranking = learned_sentences(summary)[0]
    assert "grpo 0.30 [0.20, 0.40] (0/3 seeds learned) = raft 0.30 [0.25, 0.35] (0/3) > mixed" in ranking


def test_single_arm_without_comparisons():
    summary = synthetic_summary(
        {"raft": _arm(_kind(0.5, 0.4, 0.6, [0.5], [1], overlaps_base=False), _kind(0.2, 0.15, 0.25))}, []
    )
    lines = learned_sentences(summary)
    _check_shape(lines)
    assert lines[0].startswith("Ranking") and "raft 0.50 [0.40, 0.60] (1/1 seeds learned)" in lines[0]
    assert "raft on 1 of 1 seeds" in lines[1] and "lead" not in lines[1]


def test_learned_sentences_is_pure():
    summary = _mixed_summary()
    before = repr(summary)
    assert learned_sentences(summary) == learned_sentences(summary)
    assert repr(summary) == before


# ---------------------------------------------------------------------------------------------
# The written card.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def summary_and_root(tmp_path_factory):
    root = make_results(tmp_path_factory.mktemp("R"), arms=("grpo", "ada", "raft"), seeds=(17, 18, 19), steps=12)
    return summarize(root, ["grpo", "ada", "raft"], [17, 18, 19], n_boot=1000, alpha=0.05, seed=0), root


META = {
    "model": "offline-tiny-qwen2",
    "data": "generated word problems (64 train / 20 held-out)",
    "device": "cpu (x86_64)",
    "recipe": {
        "steps": 12,
        "problems_per_step": 4,
        "chats_per_problem": 4,
        "learning_rate": 1e-4,
        "lora_r": 32,
        "lora_alpha": 64,
        "loss_type": "dapo",
        "beta": 0.0,
        "num_iterations": 1,
        "temperature": 1.0,
        "max_new_tokens": 12,
        "seeds": [17, 18, 19],
        "arms": ["grpo", "ada", "raft"],
    },
}


def _section(text: str, name: str) -> str:
    start = text.index(f"## {name}")
    return text[start : text.index("\n## ", start + 1)]


@pytest.mark.parametrize("offline", [True, False])
def test_write_card_sections_and_png(summary_and_root, tmp_path, offline):
    summary, root = summary_and_root
    md, png = tmp_path / "card.md", tmp_path / "card.png"
    write_card(summary, root, md, png, dict(META, offline=offline))
    text = md.read_text()
    first = text.splitlines()[0]
    if offline:
        assert first == OFFLINE_LINE and "toy world" in first and "not Qwen on GSM8K" in first
        assert first.startswith("**Toy world")  # tests/test_pipeline.py checks this prefix
    else:
        assert first == "# Talk Methods card" and "toy world" not in text
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    result = text[text.index("## Result") : text.index("## Checks")]
    for arm in ("grpo", "ada", "raft"):
        assert re.search(rf"^\| {arm} \| \d\.\d\d \[\d\.\d\d, \d\.\d\d\] \|", result, re.M)
    assert "| ada | 0.88 [" in result and "| 3/3 |" in result and "| 0/3 |" in result
    assert re.search(r"^\| base × base \| 0\.12 \[", result, re.M)
    checks = text[text.index("## Checks") : text.index("## Climb")]
    assert "PASSED" in checks and "split keeps every sentence" in checks and "15 one fact sentence" in checks
    assert "Longest seat prompt in training: 311 tokens" in checks
    climb = text[text.index("## Climb") : text.index("## Learned")]
    assert "](card.png)" in climb and "- ada: 0.10 → 0.60" in climb
    learned = text[text.index("## Learned") : text.index("## References")]
    lines = learned_sentences(summary)
    assert [ln for ln in learned.splitlines() if ln.startswith("- ")] == [f"- {s}" for s in lines]
    assert len(lines) <= MAX_LINES and _ranked_arms(lines[0])[0] == "ada"
    assert "ada's lead is supported over grpo and raft" in learned  # ada: a clear gap
    assert "No gap among the other arms is supported" in learned  # grpo and raft: identical
    assert "ada 40.0 against 32.0 for grpo and raft (1.25×)" in learned
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
    write_card(
        bare, root, tmp_path / "out" / "card.md", tmp_path / "out" / "figs" / "card.png", dict(META, offline=True)
    )
    text = (tmp_path / "out" / "card.md").read_text()
    assert "](figs/card.png)" in text and "PASSED" in text
    assert sum(GOOD_REWARDS) / N_PROBLEMS > sum(BASE_REWARDS) / N_PROBLEMS


# ---------------------------------------------------------------------------------------------
# Run section and the offline banner.
# ---------------------------------------------------------------------------------------------


def test_run_shows_world_warm_start_and_short_prompt(summary_and_root):
    summary, _ = summary_and_root
    meta = dict(
        META, offline=True, world="count, short prompt", warmstart={"steps": 600, "examples": 4096}, prompt="short"
    )
    run = _section(render_card(summary, meta, summary["checks"]), "Run")
    lines = run.splitlines()
    assert "- World: count, short prompt" in lines
    assert "- Warm start: SFT, steps 600, examples 4096" in lines
    [prompt] = [ln for ln in lines if ln.startswith("- Seat prompts:")]
    assert "short system prompt" in prompt and "not the recipe's" in prompt
    data = next(i for i, ln in enumerate(lines) if ln.startswith("- Data:"))
    assert lines.index("- World: count, short prompt") == data + 1  # what the model saw sits with the data


def test_run_without_the_optional_keys_has_no_such_lines(summary_and_root):
    summary, _ = summary_and_root
    run = _section(render_card(summary, dict(META, offline=False), summary["checks"]), "Run")
    assert "World:" not in run and "Warm start:" not in run and "Seat prompts:" not in run
    full = _section(render_card(summary, dict(META, prompt="full", warmstart=None), summary["checks"]), "Run")
    assert "- Seat prompts: the recipe's system prompt" in full and "short" not in full
    assert "Warm start:" not in full


def test_offline_banner_line_and_figure_title(summary_and_root, tmp_path, monkeypatch):
    summary, root = summary_and_root
    titles = []
    real = card.plot_card
    monkeypatch.setattr(
        card,
        "plot_card",
        lambda s, p, offline=False, title=None: (
            titles.append((offline, title)),
            real(s, p, offline=offline, title=title),
        ),
    )
    write_card(
        summary, root, tmp_path / "a.md", tmp_path / "a.png", dict(META, offline=True, warmstart={"steps": 600})
    )
    write_card(summary, root, tmp_path / "b.md", tmp_path / "b.png", dict(META, offline=False))
    assert titles == [(True, OFFLINE_TITLE), (False, None)]
    assert "toy world" in OFFLINE_TITLE and "not Qwen on GSM8K" in OFFLINE_TITLE
    assert (tmp_path / "a.md").read_text().splitlines()[0] == OFFLINE_LINE


def test_offline_without_a_warm_start_does_not_claim_one(summary_and_root):
    summary, _ = summary_and_root
    first = render_card(summary, dict(META, offline=True, warmstart=None), summary["checks"]).splitlines()[0]
    assert first != OFFLINE_LINE and "warm-started" not in first and "say nothing about the methods" in first


def test_recipe_states_what_dapo_normalisation_means_for_raft_and_mixed(summary_and_root):
    summary, _ = summary_and_root
    meta = dict(META, recipe={"loss_type": "dapo", "beta": 0.0})
    recipe = _section(render_card(summary, meta, summary["checks"]), "Recipe")
    assert "RAFT's unsolved chats (advantage 0) still count in the denominator" in recipe
    assert "~25% fewer scored tokens" in recipe
    other = _section(render_card(summary, dict(META, recipe={"loss_type": "grpo"}), summary["checks"]), "Recipe")
    assert "denominator" not in other


def test_recipe_says_whether_the_runs_used_liger_kernels_not_only_the_switch(summary_and_root):
    """train.liger_kernels: true runs eager on a CPU; the card says what its runs did, not the raw switch."""
    summary, _ = summary_and_root

    def liger_lines(summary, **meta):
        recipe = _section(render_card(summary, dict(META, **meta), summary["checks"]), "Recipe")
        return [line for line in recipe.splitlines() if "liger" in line.lower()]

    assert liger_lines(summary, recipe={"liger_kernels": True}) == [
        "- Liger kernels (RMSNorm, SwiGLU, RoPE) in the training forward: no: these runs were on a CPU, "
        "which runs eager (the switch is on, for a CUDA GPU)"
    ]
    on_gpu = dict(summary, compute={**summary.get("compute", {}), "devices": ["NVIDIA H200"]})
    assert liger_lines(on_gpu, device="cuda", recipe={"liger_kernels": True}) == [
        "- Liger kernels (RMSNorm, SwiGLU, RoPE) in the training forward: yes"
    ]
    assert liger_lines(summary, recipe={"liger_kernels": False}) == [
        "- Liger kernels (RMSNorm, SwiGLU, RoPE) in the training forward: no (train.liger_kernels: false)"
    ]


def test_recipe_says_whether_the_seeds_trained_as_a_cohort(summary_and_root):
    """train.cohort: a cohort's seed is not bitwise its lone run; the card says which mode trained the rows."""
    summary, _ = summary_and_root

    def seed_lines(cohort):
        meta = dict(META, recipe={"cohort": cohort, "arms": ["grpo", "ada", "raft"]})
        recipe = _section(render_card(summary, meta, summary["checks"]), "Recipe")
        return [line for line in recipe.splitlines() if line.startswith("- Seeds trained")]

    assert seed_lines(False) == seed_lines([]) == ["- Seeds trained: each seed its own run"]
    assert len(seed_lines(True)) == 1 and "one cohort" in seed_lines(True)[0]
    assert seed_lines(["raft", "ada", "grpo"]) == seed_lines(True)
    (some,) = seed_lines(["raft", "grpo"])  # train.cohort names some arms: the card names both groups
    assert some.startswith("- Seeds trained: grpo, raft: an arm's seeds as one cohort") and some.endswith(
        "; ada: each seed its own run"
    )
    bare = _section(render_card(summary, dict(META, recipe={"cohort": ["raft"]}), summary["checks"]), "Recipe")
    assert "as one cohort" in bare and bare.count("(raft)") == 1  # no arms in the recipe: the list as given
