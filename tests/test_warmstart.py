"""The warm start: its SFT rows are the RL trainer's rows, its slips, and a small run that saves a loadable model.

Whether the warm start lands the base in its accuracy band is checked on the offline DAG
(tests/test_pipeline.py::test_warm_start_lands_the_base_in_its_band): that run trains it anyway.
"""

from __future__ import annotations

import json

import pytest

from talkmethods.dialogue import ideal_dialogue
from talkmethods.grading import grade_answer
from talkmethods.problems import parse_problem
from talkmethods.rollout import seat_prompts
from talkmethods.split import split_facts
from talkmethods.synthetic import generate_problems
from talkmethods.warmstart import (
    WarmStartConfig,
    build_model,
    draw_slips,
    ideal_chat,
    sft_rows,
    warm_start,
    world_tokenizer,
)


def count_problems(n: int, seed: int = 3, style: str = "short") -> list[dict]:
    out = []
    for i, row in enumerate(generate_problems(n, seed, "count")):
        p = parse_problem(row, f"row {i}", "synthetic-train", i)
        split = split_facts(p["question"])
        out.append(
            {
                "id": f"p{i}",
                "facts_a": list(split.facts_a),
                "facts_b": list(split.facts_b),
                "shared_question": split.question,
                "gold": p["gold"],
                "answer": p["answer"],
                "prompt_style": style,
            }
        )
    return out


CFG = WarmStartConfig(
    vocab="compact",
    hidden=32,
    layers=1,
    heads=2,
    kv_heads=1,
    intermediate=64,
    steps=30,
    batch_size=8,
    learning_rate=3e-3,
    warmup_steps=2,
    slip_rate=0.3,
    seed=0,
    precision="fp32",
)


@pytest.fixture(scope="module")
def problems():
    return count_problems(40)


@pytest.fixture(scope="module")
def tokenizer(problems):
    return world_tokenizer(CFG, problems)


def test_sft_rows_train_exactly_each_seats_own_messages(problems, tokenizer):
    rows = sft_rows(problems[:6], tokenizer)
    assert len(rows) == 12  # one packed row per seat and problem
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for k, row in enumerate(rows):
        problem, seat = problems[k // 2], "AB"[k % 2]
        a1, b1, a2, b2 = ideal_dialogue(problem)
        own = (a1, a2) if seat == "A" else (b1, b2)
        ids, mask = row["input_ids"], row["completion_mask"]
        trained = [t for t, m in zip(ids, mask, strict=True) if m]
        assert trained.count(end) == 2  # each of the two turns ends on <|im_end|>, which is trained
        expected = tokenizer(own[0], add_special_tokens=False)["input_ids"] + [end]
        expected += tokenizer(own[1], add_special_tokens=False)["input_ids"] + [end]
        assert trained == expected


def test_sft_tokens_are_the_rollouts_tokens(problems, tokenizer):
    """A seat's second prompt in SFT is what the rollout builds from the same turns: SFT and RL see the same ids."""
    chat = ideal_chat(problems[0], tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    from talkmethods.dialogue import seat_messages

    texts = [t.text for t in chat.turns]
    for turn in (2, 3):
        rebuilt = seat_prompts(
            tokenizer, [(seat_messages(chat.problem, turn, texts[:turn]), chat.turns[turn - 2])], {end}
        )[0]
        assert rebuilt == chat.turns[turn].prompt_ids
        first = chat.turns[turn - 2]
        assert rebuilt[: len(first.prompt_ids) + len(first.completion_ids)] == first.prompt_ids + first.completion_ids


def test_slips_hit_one_seat_at_the_stated_rate(problems):
    assert draw_slips(problems, 0.0, seed=1) == [None] * len(problems)
    assert all(s is not None for s in draw_slips(problems, 1.0, seed=1))
    assert draw_slips(problems, 0.3, seed=1) == draw_slips(problems, 0.3, seed=1)
    many = count_problems(2000, seed=9)
    share = sum(s is not None for s in draw_slips(many, 0.3, seed=2)) / len(many)
    assert 0.26 < share < 0.34, share
    for problem, slip in zip(problems, draw_slips(problems, 1.0, seed=1), strict=True):
        a2, b2 = ideal_dialogue(problem, slip)[2:]
        wrong, right = (a2, b2) if slip[0] == "A" else (b2, a2)
        assert grade_answer(right, problem["gold"]) and not grade_answer(wrong, problem["gold"]), (slip, a2, b2)


def test_model_vocabulary_follows_the_tokenizer(tokenizer):
    assert build_model(CFG, tokenizer).config.vocab_size == len(tokenizer) < 600
    full = WarmStartConfig(**{**CFG.__dict__, "vocab": "full", "hidden": 8, "heads": 2, "intermediate": 8})
    from talkmethods.models import QWEN25_VOCAB, offline_qwen_tokenizer

    assert build_model(full, offline_qwen_tokenizer()).config.vocab_size == QWEN25_VOCAB


def test_a_small_warm_start_saves_a_model_that_loads_and_learned(problems, tmp_path):
    import torch

    from talkmethods.models import ModelSpec, load_model, load_tokenizer

    stats = warm_start(CFG, problems, tmp_path / "model")
    assert stats["loss_last"] < stats["loss_first"] and stats["rows"] == 2 * len(problems)
    json.dumps(stats)  # the card's input
    spec = ModelSpec(str(tmp_path / "model"))
    tok, model = load_tokenizer(spec), load_model(spec, torch.float32)
    assert model.config.vocab_size == len(tok) == stats["vocab_rows"]
    assert tok.padding_side == "left" and tok.eos_token == "<|im_end|>"
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically: nothing half-made beside it
