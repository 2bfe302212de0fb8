"""Tests for talkmethods.aggregate on a tiny synthetic results directory."""

from __future__ import annotations

import copy
import csv
import json
import random
from pathlib import Path

import pytest

from talkmethods import aggregate
from talkmethods.aggregate import CSV_COLUMNS, ResultsError, summarize, validate_eval, write_summary

N_PROBLEMS = 20
IDS = [f"gsm8k-test-{i:05d}" for i in range(N_PROBLEMS)]
# Base x base: 0.5 on every fourth problem, else 0 (mean 0.125).
BASE_REWARDS = [0.5 if i % 4 == 0 else 0.0 for i in range(N_PROBLEMS)]
# A clearly better run: 1.0 on 15 of 20 problems.
GOOD_REWARDS = [1.0 if i % 4 else 0.5 for i in range(N_PROBLEMS)]
N_BOOT = 1000


def eval_obj(kind: str, rewards, arm=None, seed=None, ids=IDS) -> dict:
    """An eval JSON shaped like evaluate.run_eval's, with team accuracy = mean(rewards)."""
    acc = sum(rewards) / len(rewards)
    return {
        "kind": kind,
        "arm": arm,
        "seed": seed,
        "config": {
            "model": "offline-tiny-qwen2",
            "adapter": None if kind == "base" else f"/r/{arm}/seed{seed}/adapter",
            "sampling": {
                "max_new_tokens": 12,
                "temperature": 0.7,
                "top_p": 0.8,
                "top_k": 20,
                "max_prompt_tokens": 2048,
            },
            "chats_per_problem": 2,
            "eval_seed": 0,
        },
        "counts": {"problems": len(ids), "chats": 2 * len(ids)},
        "metrics": {
            "team_accuracy": acc,
            "both_right": acc / 2,
            "a_accuracy": acc,
            "b_accuracy": acc,
            "no_box_rate": 0.25,
            "chars_per_message": {"A1": 100.0, "B1": 90.0, "A2": 60.0, "B2": 50.0},
            "chars_per_seat": {"A": 80.0, "B": 70.0},
            "partner_fact_use": {"A": 0.4, "B": 0.3},
        },
        "per_problem": {"ids": list(ids), "rewards": list(rewards)},
        "samples": [
            {
                "problem_id": ids[0],
                "gold": "18",
                "reward": rewards[0],
                "turns": [
                    {"seat": s, "adapter": kind != "base", "text": "I hold 3 apples."} for s in ("A", "B", "A", "B")
                ],
            }
        ],
        "provenance": {
            "versions": {"torch": "2.9.0", "python": "3.11.2"},
            "git": "abc1234",
            "wall_s": 12.5,
            "device": "cpu (x86_64)",
        },
    }


def train_lines(steps: int, start: float, end: float, drawn: float = 32.0) -> list[dict]:
    out = []
    for i in range(steps):
        r = start + (end - start) * i / max(1, steps - 1)
        out.append(
            {
                "step": i + 1,
                "reward": r,
                "both_right": r / 2,
                "chats_drawn": drawn,
                "zero_adv_share": 0.25,
                "tokens_per_turn": 10.0,
                "entropy": 1.5,
                "loss": 0.01,
                "grad_norm": 0.5,
                "rows": 128,
                "longest_prompt": 300 + i,
                "gen_s": 2.0,
                "train_s": 1.0,
            }
        )
    return out


def write_eval(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def make_results(root: Path, arms=("grpo", "ada"), seeds=(17, 18), rewards=None, steps=5) -> Path:
    """Write a results dir: base eval, 3 evals + a train log per arm x seed, split stats, selftest.

    ``rewards(arm, seed, kind)`` gives a run's per-problem rewards in IDS order (default: ada
    clearly better than base on held-out, grpo equal to base).
    """
    if rewards is None:

        def rewards(arm, seed, kind):
            return GOOD_REWARDS if (arm == "ada" and kind == "eval") else BASE_REWARDS

    write_eval(root / "base" / "eval.json", eval_obj("base", BASE_REWARDS))
    for arm in arms:
        for s in seeds:
            d = root / arm / f"seed{s}"
            for kind, name in aggregate.KIND_FILES.items():
                write_eval(d / name, eval_obj(kind, rewards(arm, s, kind), arm=arm, seed=s))
            lines = train_lines(steps, 0.1, 0.6 if arm == "ada" else 0.2, drawn=40.0 if arm == "ada" else 32.0)
            (d / "train_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    split = {
        part: {
            "total": 100,
            "eligible": 80,
            "dropped": {"one_fact_sentence": 15, "no_fact_sentence": 5},
            "drawn": 40 if part == "train" else N_PROBLEMS,
            "sentences_per_seat": {"a": {"mean": 1.6, "min": 1, "max": 3}, "b": {"mean": 1.2, "min": 1, "max": 2}},
        }
        for part in ("train", "heldout")
    }
    write_eval(root / "data" / "split_stats.json", split)
    write_eval(
        root / "selftest.json",
        {
            "passed": True,
            "checks": [
                {"name": "split keeps every sentence", "passed": True, "detail": "80 problems"},
                {"name": "grading of tricky strings", "passed": True, "detail": ""},
            ],
        },
    )
    return root


def _summary(root, arms=("grpo", "ada"), seeds=(17, 18), **kw):
    return summarize(root, list(arms), list(seeds), n_boot=N_BOOT, alpha=0.05, seed=0, **kw)


def _row(summary, arm, seed, kind):
    [row] = [r for r in summary["rows"] if r["arm"] == arm and r["seed"] == seed and r["kind"] == kind]
    return row


# ---------------------------------------------------------------------------------------------


def test_schema_accepts_run_eval_shape_and_base_nulls():
    validate_eval(eval_obj("base", BASE_REWARDS))
    validate_eval(eval_obj("eval", GOOD_REWARDS, arm="ada", seed=17))


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda o: o["metrics"].pop("team_accuracy"), "/metrics"),
        (lambda o: o["metrics"].__setitem__("no_box_rate", 1.5), "/metrics/no_box_rate"),
        (lambda o: o.__setitem__("kind", "heldout"), "/kind"),
        (lambda o: o["per_problem"]["rewards"].__setitem__(3, "high"), "/per_problem/rewards/3"),
        (lambda o: o.__setitem__("arm", None), "/arm"),  # a trained kind must name its arm
    ],
)
def test_validate_eval_names_the_bad_field(mutate, where):
    obj = eval_obj("eval", GOOD_REWARDS, arm="ada", seed=17)
    mutate(obj)
    with pytest.raises(ResultsError, match="not a valid eval JSON") as info:
        validate_eval(obj, "some/eval.json")
    assert "some/eval.json" in str(info.value) and where in str(info.value)


def test_validate_eval_rejects_ids_rewards_length_mismatch():
    obj = eval_obj("eval", GOOD_REWARDS, arm="ada", seed=17)
    obj["per_problem"]["rewards"].pop()
    with pytest.raises(ResultsError, match="20 ids but 19 rewards"):
        validate_eval(obj, "x.json")


def test_csv_rows_and_columns(tmp_path):
    root = make_results(tmp_path / "R")
    summary = _summary(root)
    csv_path, json_path = tmp_path / "out" / "summary.csv", tmp_path / "out" / "summary.json"
    write_summary(summary, csv_path, json_path)
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_COLUMNS
        rows = list(reader)
    assert len(rows) == 2 * 2 * 3 + 1
    keys = [(r["arm"], r["seed"], r["kind"]) for r in rows]
    assert keys[-1] == ("base", "", "base")
    assert set(keys[:-1]) == {
        (a, str(s), k) for a in ("grpo", "ada") for s in (17, 18) for k in ("eval", "crossplay", "crossplay_bA")
    }
    for r in rows:
        if r["kind"] == "eval":
            assert r["learned"] in ("True", "False") and r["p_value"]
        else:
            assert r["learned"] == ""
    ada = next(r for r in rows if r["arm"] == "ada" and r["kind"] == "eval")
    assert float(ada["team_accuracy"]) == pytest.approx(sum(GOOD_REWARDS) / N_PROBLEMS)
    assert float(ada["chars_A"]) == 80.0 and float(ada["partner_use_B"]) == 0.3
    assert float(ada["chats_drawn_per_step"]) == 40.0
    assert float(ada["gen_s"]) == 10.0 and float(ada["train_s"]) == 5.0  # 5 steps x 2 s / 1 s
    base = rows[-1]
    assert float(base["team_accuracy"]) == pytest.approx(0.125) and base["gen_s"] == ""
    again = json.loads(json_path.read_text())
    assert again["rows"] == json.loads(json.dumps(summary["rows"]))


def test_learned_on_better_run_not_on_equal_run(tmp_path):
    summary = _summary(make_results(tmp_path))
    for s in (17, 18):
        assert _row(summary, "ada", s, "eval")["learned"] is True
        assert _row(summary, "ada", s, "eval")["p_value"] <= 0.05
        assert _row(summary, "grpo", s, "eval")["learned"] is False
        assert _row(summary, "grpo", s, "eval")["p_value"] == 1.0  # identical rewards: every diff is 0
    assert summary["per_arm"]["ada"]["seeds_learned"] == 2
    assert summary["per_arm"]["grpo"]["seeds_learned"] == 0
    assert summary["per_arm"]["ada"]["n_seeds"] == 2


def test_per_arm_intervals_comparisons_and_train(tmp_path):
    summary = _summary(make_results(tmp_path))
    ada, grpo = summary["per_arm"]["ada"]["kinds"]["eval"], summary["per_arm"]["grpo"]["kinds"]["eval"]
    assert ada["mean"] == pytest.approx(0.875) and ada["lo"] <= ada["mean"] <= ada["hi"]
    assert [p["seed"] for p in ada["per_seed"]] == [17, 18]
    assert grpo["overlaps_base"] is True and ada["overlaps_base"] is False
    [comp] = summary["comparisons"]
    assert (comp["x"], comp["y"], comp["kind"]) == ("grpo", "ada", "eval")
    assert comp["poi"] == 0.0 and comp["overlap"] is False
    train = summary["per_arm"]["ada"]["train"]
    assert train["first_reward"] == pytest.approx(0.1) and train["last_reward"] == pytest.approx(0.6)
    assert train["longest_prompt"] == 304 and len(train["curves"]) == 2
    assert train["mean_curve"]["steps"] == [1, 2, 3, 4, 5]
    assert summary["checks"]["selftest"]["passed"] is True
    assert summary["n_problems"] == N_PROBLEMS


def test_deterministic_for_a_seed(tmp_path):
    root = make_results(tmp_path)
    a, b = _summary(root), _summary(root)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c = summarize(root, ["grpo", "ada"], [17, 18], n_boot=N_BOOT, alpha=0.05, seed=1)
    assert c["per_arm"]["ada"]["kinds"]["eval"]["mean"] == a["per_arm"]["ada"]["kinds"]["eval"]["mean"]


def test_alignment_by_problem_id(tmp_path):
    """A run equal to base problem by problem, written in shuffled order, matches base exactly."""

    def rewards(arm, seed, kind):
        return [0.5 if i % 3 == 0 else 1.0 for i in range(N_PROBLEMS)] if arm == "ada" else BASE_REWARDS

    root = make_results(tmp_path / "plain", rewards=rewards)
    shuffled = make_results(tmp_path / "shuffled", rewards=rewards)
    for name in ("eval.json", "crossplay.json"):
        path = shuffled / "grpo" / "seed17" / name
        obj = json.loads(path.read_text())
        pairs = list(zip(obj["per_problem"]["ids"], obj["per_problem"]["rewards"]))
        random.Random(3).shuffle(pairs)
        assert [p[0] for p in pairs] != IDS
        obj["per_problem"] = {"ids": [p[0] for p in pairs], "rewards": [p[1] for p in pairs]}
        path.write_text(json.dumps(obj))
    a, b = _summary(root), _summary(shuffled)
    row = _row(b, "grpo", 17, "eval")
    assert row["p_value"] == 1.0 and row["learned"] is False  # misaligned pairs would give nonzero diffs
    assert a["per_arm"]["grpo"]["kinds"] == b["per_arm"]["grpo"]["kinds"]
    assert a["rows"] == b["rows"]


def test_problem_ids_differing_from_base_is_a_clear_error(tmp_path):
    root = make_results(tmp_path)
    path = root / "ada" / "seed18" / "crossplay_bA.json"
    obj = json.loads(path.read_text())
    obj["per_problem"]["ids"][0] = "gsm8k-test-99999"
    path.write_text(json.dumps(obj))
    with pytest.raises(ResultsError, match="problem ids differ") as info:
        _summary(root)
    assert str(path) in str(info.value) and "gsm8k-test-99999" in str(info.value)


@pytest.mark.parametrize(
    "rel",
    [
        "grpo/seed18/crossplay.json",
        "base/eval.json",
        "ada/seed17/train_log.jsonl",
        "selftest.json",
        "data/split_stats.json",
    ],
)
def test_missing_file_is_a_clear_error(tmp_path, rel):
    root = make_results(tmp_path)
    (root / rel).unlink()
    with pytest.raises(ResultsError, match="missing") as info:
        _summary(root)
    assert str(root / rel) in str(info.value)


def test_schema_invalid_eval_names_path_and_field(tmp_path):
    root = make_results(tmp_path)
    path = root / "ada" / "seed17" / "eval.json"
    obj = json.loads(path.read_text())
    del obj["metrics"]["chars_per_seat"]
    path.write_text(json.dumps(obj))
    with pytest.raises(ResultsError, match="not a valid eval JSON") as info:
        _summary(root)
    assert str(path) in str(info.value) and "chars_per_seat" in str(info.value)


def test_wrong_kind_or_seed_in_file_is_a_clear_error(tmp_path):
    root = make_results(tmp_path)
    src = root / "grpo" / "seed17" / "eval.json"
    (root / "grpo" / "seed17" / "crossplay.json").write_text(src.read_text())
    with pytest.raises(ResultsError, match="expected kind 'crossplay'"):
        _summary(root)
    root2 = make_results(tmp_path / "two")
    (root2 / "grpo" / "seed18" / "eval.json").write_text(src.read_text())
    with pytest.raises(ResultsError, match="expected seed 18"):
        _summary(root2)


def test_not_json_and_bad_train_log_lines(tmp_path):
    root = make_results(tmp_path)
    path = root / "grpo" / "seed17" / "eval.json"
    path.write_text("{not json")
    with pytest.raises(ResultsError, match="cannot read") as info:
        _summary(root)
    assert str(path) in str(info.value)
    root2 = make_results(tmp_path / "two")
    log_path = root2 / "ada" / "seed18" / "train_log.jsonl"
    log_path.write_text(log_path.read_text() + '{"step": 6}\n')
    with pytest.raises(ResultsError, match=r"train_log.jsonl:6: 'reward' must be a number"):
        _summary(root2)


def test_train_log_nulls_and_resumed_steps(tmp_path):
    path = tmp_path / "train_log.jsonl"
    lines = train_lines(3, 0.0, 1.0)
    lines[1]["gen_s"] = None
    lines.append(dict(lines[2], reward=0.9))  # a resumed run rewrote step 3
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    t = aggregate.train_summary(aggregate.load_train_log(path))
    assert t["steps"] == [1, 2, 3] and t["reward"][-1] == 0.9
    assert t["gen_s"] == 4.0 and t["train_s"] == 3.0


def test_bad_arguments(tmp_path):
    root = make_results(tmp_path)
    with pytest.raises(ValueError, match="arms"):
        summarize(root, [], [17], n_boot=N_BOOT)
    with pytest.raises(ValueError, match="n_boot"):
        summarize(root, ["ada"], [17], n_boot=5)
    # A single arm and seed still summarizes (no comparisons).
    s = summarize(root, ["ada"], [17], n_boot=N_BOOT)
    assert s["comparisons"] == [] and len(s["rows"]) == 4
    assert copy.deepcopy(s) == s
