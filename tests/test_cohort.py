"""A seed cohort (``training.cohort``): an arm's seeds trained in one process, their chats in one engine call."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import tiny_problems, train_config

from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec, load_model
from talkmethods.training import cohort as cohort_mod
from talkmethods.training.cohort import CohortFailed, Turns, train_cohort

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SEEDS = (17, 18, 19)


def parity_judge(turn, problem) -> bool:
    """A reward the random model earns about half the time, so the adapters move."""
    return turn.completion_ids[0] % 2 == 0


def _cohort_run(tmp_path, steps=2, judge=parity_judge, arm="grpo", **fields):
    cfgs = [
        train_config(
            arm=arm,
            seed=s,
            model=ModelSpec("offline-tiny-qwen2"),
            steps=steps,
            problems_per_step=2,
            micro_batches=1,
            sampling=Sampling(max_new_tokens=4),
            save_every=1,
            engine="fast",
            **fields,
        )
        for s in SEEDS
    ]
    out = {s: tmp_path / f"seed{s}" for s in SEEDS}
    return train_cohort(
        cfgs,
        tiny_problems(8),
        [out[s] / "adapter" for s in SEEDS],
        [out[s] / "train_log.jsonl" for s in SEEDS],
        [tmp_path / "work" / f"seed{s}" for s in SEEDS],
        judge=judge,
    ), out


def _adapter(path):
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_model(ModelSpec("offline-tiny-qwen2"), torch.float32), path)
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _joint_calls(monkeypatch) -> list[dict]:
    """Spy on the cohort's joint engine calls: the list gets, per call, each seed's number of chats."""
    calls = []
    real = cohort_mod.Cohort._play_all

    def spy(self, requests):
        calls.append({n: len(r[0]) for n, r in requests.items()})
        return real(self, requests)

    monkeypatch.setattr(cohort_mod.Cohort, "_play_all", spy)
    return calls


def test_a_cohort_trains_each_seed_on_its_own_chats_from_one_engine_call_a_turn(tmp_path, monkeypatch):
    calls = _joint_calls(monkeypatch)
    results, out = _cohort_run(tmp_path)
    # one joint rollout a step, every seed's 8 chats (2 problems x 4) in it
    assert calls == [{f"seed{s}": 8 for s in SEEDS}] * 2
    assert [r["steps"] for r in results] == [2, 2, 2] and results[0]["cohort"] == ["seed17", "seed18", "seed19"]
    adapters = {s: _adapter(out[s] / "adapter") for s in SEEDS}  # each loads as a lone run's adapter does
    for s in SEEDS:
        logs = [json.loads(line) for line in (out[s] / "train_log.jsonl").read_text().splitlines()]
        assert [line["step"] for line in logs] == [1, 2]
        # the loss scored each seed's rows under that seed's adapter, as its rollout sampled them: step 2's
        # rollout ran on the weights each seed's step 1 left (synced per adapter)
        assert all(line["logp_diff_max"] < 1e-4 for line in logs), logs
        assert any(line["grad_norm"] > 0 for line in logs)
        # a checkpoint holds its seed's adapter only
        ckpt = tmp_path / "work" / f"seed{s}" / "checkpoint-2"
        assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [f"seed{s}"]
    b = {s: torch.cat([p.flatten() for n, p in sorted(adapters[s].items()) if "lora_B" in n]) for s in SEEDS}
    assert all(bool(v.abs().sum() > 0) for v in b.values())  # trained
    assert not torch.equal(b[17], b[18]) and not torch.equal(b[18], b[19])  # each its own


def test_an_ada_cohort_plays_every_seed_s_replays_drawn_ahead_in_one_engine_call(tmp_path, monkeypatch):
    """Reinforce-Ada's seeds as one cohort: each step, every seed's 2 problems x 16 chats (4 rounds drawn
    ahead) in one joint call; each seed counts the chats its rule reached (all 16 where a problem stays
    uniform: a judge that never grades right) and trains on its own 4 kept a problem."""
    calls = _joint_calls(monkeypatch)
    # every group stays uniform, so every row's advantage is 0: keep the rows in the loss (as the benches do)
    # so that each seed's rollout log-probs are still compared with its trainer's
    monkeypatch.setattr("talkmethods.training.trainer.live_rows", lambda rows: (rows, 0))
    results, out = _cohort_run(tmp_path, arm="ada", judge=lambda turn, problem: False)
    assert calls == [{f"seed{s}": 32 for s in SEEDS}] * 2
    assert [r["steps"] for r in results] == [2, 2, 2]
    for s in SEEDS:
        logs = [json.loads(line) for line in (out[s] / "train_log.jsonl").read_text().splitlines()]
        assert [line["chats_drawn"] for line in logs] == [32.0, 32.0], logs  # every round: still uniform
        assert [line["rows"] for line in logs] == [32.0, 32.0], logs  # 2 problems x 4 kept chats x 4 turns
        assert all(line["logp_diff_max"] < 1e-4 for line in logs), logs


def test_a_cohort_that_failed_after_a_checkpoint_resumes_every_seed_from_its_own(tmp_path):
    whole, out = _cohort_run(tmp_path / "whole")
    graded = []

    def breaks_in_step_2(turn, problem):  # 24 chats x 2 seats a step
        graded.append(1)
        if len(graded) > 48:
            raise RuntimeError("the grader broke")
        return parity_judge(turn, problem)

    with pytest.raises(RuntimeError, match="the grader broke"):  # the cause, not another seed's CohortFailed
        _cohort_run(tmp_path / "cut", judge=breaks_in_step_2)
    resumed, cut = _cohort_run(tmp_path / "cut")
    assert [r["resumed_from_step"] for r in resumed] == [1, 1, 1]
    for s in SEEDS:
        want, got = _adapter(out[s] / "adapter"), _adapter(cut[s] / "adapter")
        assert all(torch.allclose(want[n], got[n], atol=1e-6) for n in want), s
        assert len((cut[s] / "train_log.jsonl").read_text().splitlines()) == 2


def test_turns_run_one_seed_at_a_time_in_order_and_the_last_to_ask_plays_for_all():
    seen, played = [], []

    def play_all(requests):
        played.append(dict(requests))
        return {n: r * 10 for n, r in requests.items()}

    turns = Turns(["a", "b", "c"], play_all, lambda name: seen.append(name))
    got = {}

    def seed(name, rounds):
        turns.enter(name)
        for k in range(rounds):
            got.setdefault(name, []).append(turns.play(name, k))
        turns.leave(name)

    threads = [threading.Thread(target=seed, args=(n, 2 if n == "b" else 3)) for n in ("c", "b", "a")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert got == {"a": [0, 10, 20], "b": [0, 10], "c": [0, 10, 20]}
    # b left after two rounds: the third was played for the two still running
    assert [sorted(p) for p in played] == [["a", "b", "c"], ["a", "b", "c"], ["a", "c"]]
    assert seen[:3] == ["a", "b", "c"]  # the turns go in member order, whoever started first


def test_a_failing_seed_stops_the_others_instead_of_leaving_them_waiting():
    turns = Turns(["a", "b"], lambda requests: dict(requests), lambda name: None)
    errors = {}

    def seed(name):
        try:
            turns.enter(name)
            if name == "a":
                raise RuntimeError("seed a broke")
            turns.play(name, 1)
        except Exception as e:  # noqa: BLE001
            errors[name] = e
            turns.fail(name, e)

    threads = [threading.Thread(target=seed, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert str(errors["a"]) == "seed a broke" and isinstance(errors["b"], CohortFailed)
