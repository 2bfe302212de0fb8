"""Offline self-test: the split, one batch of chats on the tiny model, the grader and every arm's credit."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def _check_split() -> str:
    from talkmethods.problems import load_gsm8k
    from talkmethods.split import draw_problems, split_sentences

    train_pool, test_pool = load_gsm8k("generated", seed=1, n_generated_train=40, n_generated_test=20)
    train, _, stats = draw_problems(train_pool, test_pool, 20, 10, data_seed=3)
    for rec in train:
        got = list(rec["facts_a"]) + list(rec["facts_b"]) + [rec["shared_question"]]
        want = split_sentences(rec["question"])
        assert sorted(got) == sorted(want), f"{rec['id']}: sentences lost or duplicated"
        assert len(rec["facts_a"]) >= 1 and len(rec["facts_b"]) >= 1, f"{rec['id']}: a seat without facts"
    return f"{len(train)} problems split, every sentence in one seat or shared; eligible {stats['train']['eligible']}"


def _check_grader() -> str:
    from talkmethods.grading import grade_answer

    cases = [
        ("so \\boxed{18}", "18", True),
        ("\\boxed{\\$1,000}", "1000", True),
        ("\\boxed{18.0}", "18", True),
        ("\\boxed{17} no, \\boxed{18}", "18", True),
        ("\\boxed{}", "0", False),
        ("18", "18", False),
    ]
    for text, gold, want in cases:
        assert grade_answer(text, gold) is want, f"grade_answer({text!r}, {gold!r}) != {want}"
    return f"{len(cases)} grader cases"


def _check_chats() -> str:
    import torch

    from talkmethods.engines.plain import PlainGenerator
    from talkmethods.engines.sampling import Sampling
    from talkmethods.models import ModelSpec, load_model, load_tokenizer
    from talkmethods.rollout import play_chats

    spec = ModelSpec("offline-tiny-qwen2")
    tok = load_tokenizer(spec)
    model = load_model(spec, torch.float32)
    problems = [
        {
            "id": f"p{i}",
            "facts_a": [f"Ann has {i + 2} pens."],
            "facts_b": [f"Bob has {i + 5} pens."],
            "shared_question": "How many pens do they have?",
            "gold": str(2 * i + 7),
        }
        for i in range(8)
    ]
    flat = [p for p in problems for _ in range(4)]
    torch.manual_seed(0)
    chats, stats = play_chats(
        PlainGenerator(model, tok), tok, flat, [(False, False)] * len(flat), Sampling(max_new_tokens=6)
    )
    for c in chats:
        assert [t.seat for t in c.turns] == ["A", "B", "A", "B"], "turn order"
        for t in c.turns:
            assert tok.decode(t.completion_ids, skip_special_tokens=True) == t.text, "token ids != text"
        assert c.reward in (0.0, 0.5, 1.0)
        b_prompt = tok.decode(c.turns[1].prompt_ids)
        assert c.problem["facts_a"][0] not in b_prompt, "B's prompt holds A's private fact"
    return f"{len(chats)} chats × 4 turns on the tiny model, longest prompt {stats['longest_prompt']} tokens"


def _check_credit() -> str:
    from talkmethods.credit import CREDIT_RULES

    r = [1.0, 0.0, 0.5, 0.5]
    no_base = [False] * 4
    assert CREDIT_RULES["grpo"](r, no_base).advantages == (0.5, -0.5, 0.0, 0.0)
    assert CREDIT_RULES["raft"](r, no_base).advantages == (1.0, 0.0, 0.0, 0.0)
    mixed = CREDIT_RULES["mixed"](r, [False, False, True, True])
    assert mixed.advantages == (0.5, -0.5, 0.0, 0.0)
    assert mixed.trained_turns[2] == (True, False, True, False), "mixed trains a base B's turns"
    ada = CREDIT_RULES["ada"]([0.0] * 4 + [0.0, 1.0, 0.5, 0.0], [False] * 8)
    assert ada.kept == (0, 1, 5, 6) and ada.advantages == (-0.1875, -0.1875, 0.8125, 0.3125), ada
    return f"credit of {', '.join(sorted(CREDIT_RULES))} on hand-made groups"


CHECKS = {"split": _check_split, "grader": _check_grader, "chats": _check_chats, "credit": _check_credit}


def run_selftest() -> dict:
    """Run every check; never raises for a failed check (the report says which failed)."""
    report = {"checks": [], "passed": True}
    for name, check in CHECKS.items():
        t0 = time.perf_counter()
        try:
            detail, ok = check(), True
        except Exception as err:  # a failed check is reported, with its message, not raised
            detail, ok = f"{type(err).__name__}: {err}", False
        report["checks"].append(
            {"name": name, "passed": ok, "detail": detail, "s": round(time.perf_counter() - t0, 2)}
        )
        report["passed"] &= ok
        log.info("selftest %-7s %s  %s", name, "ok" if ok else "FAILED", detail)
    return report
