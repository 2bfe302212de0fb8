"""The speed benchmark's code path, end to end on the CPU through ``snakemake bench`` (offline config: quick, tiny).

The figures it prints on a CPU mean nothing; the test checks that every section runs and reports
what it measured (the guard's greedy equality included), so the GPU run has no untested code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_pipeline import job_counts, snakemake

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench_module(name: str):
    """``bench/<name>.py`` as a module (bench/ is scripts, not a package)."""
    import importlib.util

    path = BENCH / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_snakemake_bench_runs_every_section_and_writes_the_table(tmp_path):
    plan = snakemake(["-n", "bench"], tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert job_counts(plan.stdout + plan.stderr) == {"bench": 1}, "the benchmark needs no other stage"
    res = snakemake(["-j1", "bench"], tmp_path, timeout=900)
    log = tmp_path / "results/logs/bench.log"
    assert res.returncode == 0, (res.stderr[-2000:], log.read_text()[-3000:] if log.exists() else "")
    out = json.loads((tmp_path / "results/bench/speed.json").read_text())
    assert "errors" not in out
    assert out["model"] == "offline-tiny-qwen2" and out["device"].startswith("cpu")
    g = out["guard"]
    assert g["identical"] and g["rows_identical"] == g["rows"] == 8 and g["adapter_changes_output"]
    assert g["eager_rows_identical"] == 8
    assert g["cohort_rows_identical"] == g["stacked_rows_identical"] == 8 and g["cohort_adapters_differ"]
    speed = _bench_module("speed")
    assert speed.guard_error(g) is None
    assert "fast-eager 7/8" in speed.guard_error({**g, "eager_rows_identical": 7})  # a row off fails the bench
    assert "fast 0/8" in speed.guard_error({**g, "rows_identical": 0})
    assert "stacked 5/8" in speed.guard_error({**g, "stacked_rows_identical": 5})
    assert g["logp_max_abs_diff_fp32"] < 1e-4
    f = out["fold"]  # its verdict is not enforced with --quick (a width-64 model is not what it guards)
    assert [r["k"] for r in f["rows"]] == [1, 5, 20]
    assert f["rows"][-1]["engine_share"] > 0.9 and f["rows"][-1]["engine_cos"] > 0.9
    engines = {(r["engine"], r["batch"]) for r in out["decode"]}
    assert engines == {(e, b) for e in ("fast", "plain generate (eager, unmerged LoRA)") for b in (4, 8)}
    assert all(r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in out["decode"])
    arms = {r["arm"] for r in out["arms"]}
    assert arms == {"grpo", "ada", "raft", "mixed"}
    for r in out["arms"]:
        assert r["process"] == "own", "each arm's bench run is its own process, as a real run is"
        assert r["startup_s"] > 0, "its start-up (imports, model, trainer) is measured"
        assert r["rows"] == (24 if r["arm"] == "mixed" else 32)
        assert r["logp_diff_max"] < 1e-4 and r["loss_tokens"] <= r["loss_tokens_padded"]
        assert r["loss_rows"] < r["rows"], "a seat's two turns share a loss row"
    t = out["train_profile"]
    assert t["turns"] == 32 and t["rows"] < 32 and t["wall_s"] > 0 and t["tokens_real"] <= t["tokens_padded"]
    assert out["eval"]["chats"] == 8 and out["eval"]["ms_per_step"] > 0
    assert out["eval"]["startup_s"] > 0, "the eval batch ran in its own process, its start-up measured"
    p = out["projection"]
    assert p["total_min"] > 0 and p["evals"] == 37 and set(p["per_arm"]) == arms
    assert all(v["startup_s"] > 0 for v in p["per_arm"].values()), "each run's start-up is in the projection"
    table = (tmp_path / "results/bench/speed.md").read_text()
    assert "| engine | batch |" in table and "projected full recipe" in table


def test_ab_experiments_say_they_need_a_gpu_instead_of_failing_later():
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the experiments would run")
    script = BENCH / "ab.py"
    out = subprocess.run(
        [sys.executable, str(script), "two-sets", "--out", "/tmp/unused-ab"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_fold_guard_fails_when_the_engine_drops_the_adapter(monkeypatch):
    """The fold section's verdict can fail: an engine that folds the adapter without LoRA's
    ``alpha / r`` scaling (2 in the recipe, so half the effect) trails PEFT and is flagged."""
    import argparse

    from talkmethods.engines.fast import weights
    from talkmethods.models import ModelSpec, load_tokenizer

    speed = _bench_module("speed")
    model_spec = ModelSpec("offline-tiny-qwen2")
    tok = load_tokenizer(model_spec)
    args = argparse.Namespace(lora_r=4)
    good = speed.fold(model_spec, tok, "cpu", args)["rows"][-1]  # k = 20: both carry the whole effect
    assert good["engine_share"] > good["peft_share"] - speed.FOLD_SLACK and good["engine_share"] > 0.95
    real = weights._effective_weight

    def unscaled(linear, adapter):
        weight, bias = real(linear, adapter)
        if not hasattr(linear, "base_layer"):
            return weight, bias
        base = linear.base_layer.weight
        return (base.float() + (weight.float() - base.float()) / 2).to(base.dtype), bias

    monkeypatch.setattr(weights, "_effective_weight", unscaled)
    res = speed.fold(model_spec, tok, "cpu", args)
    assert not res["ok"], res["rows"]
    assert res["rows"][-1]["engine_share"] < res["rows"][-1]["peft_share"] - speed.FOLD_SLACK


def _share(out: Path, *flags: str):
    """bench/share.py --quick (3 steps a run, 2 evals an eval job) with ``flags``, writing under ``out``."""
    import os
    import subprocess
    import sys

    script = BENCH / "share.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--steps", "3", "--evals", "2", *flags, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "share.json").read_text())


def test_share_bench_runs_k_processes_and_reports_a_missing_mps_instead_of_failing(tmp_path):
    """bench/share.py on the CPU: one run, an eval job alone, a run and an eval at once; an MPS
    configuration without the daemon's binary is a reported row, not a crash. (The rates a CPU shows
    mean nothing.)"""
    import shutil

    res = _share(
        tmp_path,
        "--plan",
        "1,eval,raft+eval,2m,grpo,eval-eager,rollout,cohort-rollout,cohort-stacked,cohort-raft",
        "--profile-events",
        "9",
        "--masked-rows",
    )
    one, ev, mix, mps, second, eager, rollout, cohort, stacked, trio = res["rows"]
    # --masked-rows: lone runs keep TRL's masked layout, a cohort does not take it, an eval has no loss rows
    assert one["masked_rows"] == [True] and trio["masked_rows"] == [False] and ev["masked_rows"] == [None]
    assert [r["jobs"] for r in res["rows"]] == [
        ["grpo"],
        ["eval"],
        ["raft", "eval"],
        ["grpo", "grpo"],
        ["grpo"],
        ["eval-eager"],
        ["rollout"],
        ["cohort-rollout"],
        ["cohort-stacked"],
        ["cohort-raft"],
    ]
    assert eager["events"] == [2] and eager["work"] == 1.0  # an eval kind of its own (the same on a CPU)
    assert rollout["events"] == [3] and rollout["interval_s"][0] > 0  # a step's chats, no step: --steps of them
    for row in (cohort, stacked):  # three seeds' chats an event
        assert row["events"] == [3] and row["interval_s"][0] > 0
    assert trio["events"] == [3] and trio["interval_s"][0] > 0 and trio["steps_per_s"] > 0  # a step of three seeds
    # a cohort's LoRA layers run their own backward too, their groups one node each (apply_patches), as a lone run's
    assert trio["lora_backward"] == one["lora_backward"] and one["lora_backward"][0] > 0
    assert trio["lora_groups"] == one["lora_groups"] == [2 * one["lora_backward"][0] // 7]
    # --profile-events past the job's end: the events profiled until then
    assert "training_step" in (tmp_path / "plain_grpo_0.events.txt").read_text()
    assert "play_chats" in (tmp_path / "plain_rollout_0.events.txt").read_text()
    # a job solo'd twice: the projection takes its quicker start (warm compile caches), the slower is kept
    # (counted from the process's start: its imports, then building the job, then its first event)
    starts = [round(r["start_to_first_event_s"][0] + r["import_s"][0], 1) for r in (one, second)]
    assert res["alone_first_event_s"]["grpo"] == min(starts)
    for row in (one, ev, mix):
        assert all(0 < i for i in row["import_s"]), row  # torch and the bench are imported after the clock starts
        assert all(0 < b < f for b, f in zip(row["build_s"], row["start_to_first_event_s"], strict=True)), row
    assert res["first_event_cold_s"] == ({"grpo": max(starts)} if max(starts) > min(starts) else {})
    assert not one["mps"] and mps["mps"]
    assert ev["events"] == [2] and one["events"] == [3]
    for row in (one, ev, mix):  # every job warm: a rate for each
        assert all(s > 0 for s in row["interval_s"]) and len(row["interval_s"]) == row["runs"]
    assert one["steps_per_s"] > 0 and one["overlap_s"] > 0
    # a run's train_log splits its steady step; the split's window sits inside the event interval
    (sp,) = one["step_split"][0].values()
    assert sp["gen_s"] > 0 and sp["train_s"] > 0 and sp["gen_s"] + sp["train_s"] <= 1.1 * one["interval_s"][0]
    assert set(trio["step_split"][0]) == {f"seed{s}/train_log.jsonl" for s in (17, 18, 19)}  # the cohort's runs
    assert ev["step_split"] == [None] and rollout["step_split"] == [None]
    # work is measured against each job alone: grpo's and eval's solos are 1 by definition; raft had no solo
    assert one["work"] == 1.0 and ev["work"] == 1.0 and mix["work"] is None
    assert set(res["alone_interval_s"]) == {
        "grpo",
        "eval",
        "eval-eager",
        "rollout",
        "cohort-rollout",
        "cohort-stacked",
        "cohort-raft",
    }
    if shutil.which("nvidia-cuda-mps-control") is None:
        assert "not found" in mps["error"]
    md = (tmp_path / "share.md").read_text()
    assert "| jobs | MPS |" in md and "| generation s | rest of the step s |" in md
    assert "| cohort-raft | cohort-raft | every seed |" in md and "take turns" in md  # the cohort's step as one
    i, b, f = one["import_s"][0], one["build_s"][0], one["start_to_first_event_s"][0]
    assert f"| {i} + {b} + {round(f - b, 1)} |" in md
    # a later run takes its solos from this one's share.json
    later = _share(
        tmp_path / "later",
        *("--plan", "grpo+eval", "--alone", str(tmp_path / "share.json"), "--profile-build", "--profile-events", "1"),
        "--idle-profile",
    )
    assert later["rows"][0]["work"] > 0 and set(later["alone_from"].values()) == {str(tmp_path / "share.json")}
    # --idle-profile: one more event each, sampled, outside the job's counted events
    assert later["rows"][0]["events"] == [3, 2]
    for idle in later["rows"][0]["idle"]:
        assert idle["samples"] > 10 and idle["wall_s"] > 0 and idle["gpu_idle_s"] is None  # no GPU: host time only
        places = [p for p, _ in idle["host_by_place"]]
        assert places and any(p.startswith(("talkmethods/", "trl/")) for p in places), places
        assert sum(s for _, s in idle["host_by_place"]) <= idle["wall_s"] + 1e-6
    sampled_md = (tmp_path / "later" / "share.md").read_text()
    assert "| grpo + eval | grpo |" in sampled_md and "| grpo + eval | eval |" in sampled_md
    # each job's profiles: its building (imports, model, trainer) and its first event past the warm-up
    built = {p.name: p.read_text() for p in (tmp_path / "later").glob("*.build.txt")}
    stepped = {p.name: p.read_text() for p in (tmp_path / "later").glob("*.events.txt")}
    assert set(built) == {"plain_grpo+eval_0.build.txt", "plain_grpo+eval_1.build.txt"}, built
    train_built, eval_built = (built[n] for n in sorted(built))
    assert "build_trainer" in train_built and "eval_setup" in eval_built and "training_step" not in train_built
    train_steps, eval_steps = (stepped[n] for n in sorted(stepped))
    assert "training_step" in train_steps and "play_eval" in eval_steps and "build_trainer" not in train_steps
    # one device call's mixes priced by another's solos, with no job run; solos also come from the
    # rows of a run cut short before it wrote them out
    cut = {k: v for k, v in res.items() if not k.startswith("alone")}
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    again = _share(
        tmp_path / "again", "--rows", str(tmp_path / "later" / "share.json"), "--alone", str(tmp_path / "cut.json")
    )
    assert again["rows"] == later["rows"] and again["rows_from"] == str(tmp_path / "later" / "share.json")
    assert again["alone_interval_s"] == res["alone_interval_s"]
    assert again["alone_micro_batches"] == {"grpo": one["micro_batches"]}  # the solos' own, not the rows'
    assert not list((tmp_path / "again").glob("*.log")), "--rows starts no job"


def test_share_packed_rows_and_lora_layouts_reach_a_lone_run_and_the_table(tmp_path):
    """--packed-rows: a lone run's loss rows go through ``patches.packed_rows`` (its SDPA-a-row path on a
    CPU); its LoRA layers run their own backward (``patches.lora_own_backward``) unless --autograd-lora,
    and their groups one node each unless --lora-ungrouped. The row records each (the LoRA ones as how many
    layers or groups are on it) and the table says so."""
    res = _share(tmp_path, "--plan", "raft", "--packed-rows")
    (row,) = res["rows"]
    assert row["packed_rows"] == [True] and row["masked_rows"] == [False] and row["events"][0] >= 3
    (switched,) = row["lora_backward"]
    assert switched > 0 and switched % 7 == 0, switched  # the 7 LoRA targets of every layer
    text = (tmp_path / "share.md").read_text()
    assert "packed rows" in text and "LoRA through autograd" not in text
    assert row["lora_groups"] == [2 * switched // 7] and "LoRA ungrouped" not in text  # two groups a decoder layer
    res = _share(tmp_path / "before", "--plan", "raft", "--autograd-lora")
    assert res["rows"][0]["lora_backward"] == [0]
    assert "LoRA through autograd" in (tmp_path / "before" / "share.md").read_text()
    # --lora-ungrouped: q/k/v and gate/up one node a layer, a lone run from its start, a cohort from its second step
    res = _share(tmp_path / "ungrouped", "--plan", "raft,cohort-raft", "--lora-ungrouped")
    assert [r["lora_groups"] for r in res["rows"]] == [[0], [0]]
    assert [r["lora_backward"] for r in res["rows"]] == [[switched], [switched]]
    assert "LoRA ungrouped" in (tmp_path / "ungrouped" / "share.md").read_text()


def test_share_refuses_an_unknown_cohort_arm_before_running_anything(tmp_path):
    """--cohort-arms names arms, or the bench says which name is wrong before any job or read."""
    import subprocess
    import sys

    flags = ("--cohort-arms", "grpo,adda", "--rows", "missing.json", "--out", str(tmp_path))
    bad = subprocess.run(
        [sys.executable, str(BENCH / "share.py"), *flags], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "unknown arm(s) adda" in bad.stderr and "Traceback" not in bad.stderr


def test_share_plan_items_and_the_work_a_configuration_does():
    """The plan's syntax, and work = each job's rate over its rate alone, summed."""
    share = _bench_module("share")
    assert share.parse_plan("1,3m,m:ada+eval,raft", "grpo") == [
        (["grpo"], False),
        (["grpo"] * 3, True),
        (["ada", "eval"], True),
        (["raft"], False),
    ]
    assert share.parse_plan("m:eval+eval-eager", "grpo") == [(["eval", "eval-eager"], True)]
    with pytest.raises(ValueError, match="jobs are"):
        share.parse_plan("grpo+evals", "grpo")
    alone = {"grpo": 4.0, "eval": 20.0}
    # two jobs each at half their solo rate do one GPU's worth; at 0.6 of it, 1.2 GPUs'
    assert share.work({"jobs": ["grpo", "eval"], "interval_s": [8.0, 40.0]}, alone) == 1.0
    assert share.work({"jobs": ["grpo", "eval"], "interval_s": [4 / 0.6, 20 / 0.6]}, alone) == 1.2
    assert share.work({"jobs": ["grpo", "ada"], "interval_s": [8.0, 8.0]}, alone) is None


def test_a_cohort_step_splits_by_its_last_seed_s_generation():
    """A cohort's seeds wait for each other, so its step is split once: the least seed's generation, the rest."""
    share = _bench_module("share")
    runs = {f"seed{s}/train_log.jsonl": {"gen_s": g, "train_s": 4.0} for s, g in ((17, 5.4), (18, 5.3), (19, 4.4))}
    rows = [
        {"jobs": ["cohort-grpo"], "interval_s": [8.4], "step_split": [runs]},
        {"jobs": ["grpo"], "interval_s": [4.0], "step_split": [{"train_log.jsonl": {"gen_s": 2.6, "train_s": 1.3}}]},
        {"jobs": ["cohort-raft"], "error": "out of memory"},
    ]
    assert share._cohort_splits(rows) == [("cohort-grpo", "cohort-grpo", 8.4, {"gen_s": 4.4, "train_s": 4.0})]


def test_share_projects_the_recipe_from_its_solos_and_the_mixes_work():
    """One job at a time: 3 runs an arm of (start to first step + 79 steps) and 37 evals (start to end
    of the first, its steady part scaled to 600 chats); three at a time: that over the mean work of the three-job MPS mixes."""
    share = _bench_module("share")
    alone = {"grpo": 4.0, "ada": 6.0, "raft": 3.0, "mixed": 5.0, "eval": 20.0}
    first = {"grpo": 40.0, "ada": 60.0, "raft": 30.0, "mixed": 50.0, "eval": 45.0}
    one = share.recipe_minutes(alone, first, eval_chats=300)
    runs = 3 * (180 + 79 * 18.0)  # the four arms' first events and steady steps
    assert one["eval_s"] == 65.0 and one["min"] == round((runs + 37 * 65.0) / 60, 1)  # 25 s start-up + 2 x 20
    # the starts beyond a steady event: 3 x (36 + 54 + 27 + 45) for the runs, 37 x 25 for the evals
    assert one["start_min"] == round((3 * 162 + 37 * 25) / 60, 1)
    # a run's three evals in one job: 13 eval starts (12 runs and the base), 24 fewer
    assert one["one_job_per_run_min"] == round((runs + 37 * 65.0 - 24 * 25) / 60, 1)
    assert share.recipe_minutes({k: v for k, v in alone.items() if k != "ada"}, first, 600) is None
    # cohort arms (train.cohort): one job an arm, its event a step of every seed, its start paid once
    co_alone, co_first = (
        {**alone, "cohort-grpo": 9.0, "cohort-raft": 7.0},
        {**first, "cohort-grpo": 50.0, "cohort-raft": 40.0},
    )
    co = share.recipe_minutes(co_alone, co_first, 300, cohort_arms=("raft", "grpo"))
    assert co["cohort_arms"] == ["grpo", "raft"] and co["run_s"]["grpo"] == 50.0 + 79 * 9.0
    co_runs = (50 + 79 * 9.0) + (40 + 79 * 7.0) + 3 * (60 + 79 * 6.0) + 3 * (50 + 79 * 5.0)
    assert co["min"] == round((co_runs + 37 * 65.0) / 60, 1)
    assert co["start_min"] == round((41 + 33 + 3 * 54 + 3 * 45 + 37 * 25) / 60, 1)
    assert share.recipe_minutes(alone, first, 300, cohort_arms=("grpo",)) is None  # no cohort-grpo solo
    assert share.cohort_yaml_arms() == ("grpo", "raft", "mixed")  # cohort.yaml's list
    # the projections a share run writes: with only the uncompiled eval's solo (config.yaml's engine) there
    # is no compiled-eval projection, and the cohort's evals are priced by fast-eager's
    no_eval = {k: v for k, v in co_alone.items() if k != "eval"}
    proj = share.projections(
        [], {**no_eval, "eval-eager": 20.0}, {**co_first, "eval-eager": 45.0}, 300, ("grpo", "raft")
    )
    assert set(proj) == {"eval_eager", "cohort"} and proj["cohort"]["eval_job"] == "eval-eager"
    assert proj["cohort"]["min"] == co["min"]  # the same eval figures under the other name
    assert share.projections([], co_alone, co_first, 300, ())["one_at_a_time"] == one
    assert "cohort" not in share.projections([], co_alone, co_first, 300, ())  # cohort.yaml naming no arm
    assert share.projections([], co_alone, co_first, 300, ("grpo",))["cohort"]["eval_job"] == "eval"
    # the cohort recipe under MPS: its minutes over the mean work of the measured two-job mixes
    pairs = [{"mps": True, "runs": 2, "work": 1.25}, {"mps": True, "runs": 2, "work": 1.35}]
    co_mps = share.projections(pairs, co_alone, co_first, 300, ("grpo", "raft"))["cohort"]["under_mps"]
    assert co_mps == [share.shared_recipe(co["min"], pairs, 2, co["start_min"])]
    assert co_mps[0]["min"] == round(co["min"] / 1.3, 1)
    settings = {"seconds": 60, "micro_batches": 8, "turn_tokens": 256, "eval_chats": 300}
    no_rows = {"settings": settings, "device": "cpu", "rows": []}
    md = share.table({**no_rows, "recipe": {"cohort": {**co, "eval_job": "eval", "under_mps": co_mps}}})
    # arms other than cohort.yaml's (bench/share.py --cohort-arms) are not called cohort.yaml's
    assert f"with `train.cohort`, 2 jobs at a time under MPS: **{co_mps[0]['min']} min**" in md
    assert "cohort.yaml" not in md
    yaml_co = {**co, "cohort_arms": ["grpo", "raft", "mixed"], "eval_job": "eval", "under_mps": co_mps}
    md = share.table({**no_rows, "recipe": {"cohort": yaml_co}})
    assert f"with `cohort.yaml`, 2 jobs at a time under MPS: **{co_mps[0]['min']} min**" in md
    # the evals priced by another eval job's solo (uncompiled maths: a quicker start, a slower eval)
    eager = share.recipe_minutes({**alone, "eval-eager": 22.0}, {**first, "eval-eager": 30.0}, 300, "eval-eager")
    assert eager["eval_s"] == 52.0 and eager["run_s"] == one["run_s"]  # 8 s start-up + 2 x 22
    assert eager["min"] == round((runs + 37 * 52.0) / 60, 1)
    assert share.recipe_minutes(alone, first, 300, "eval-eager") is None  # no such solo
    rows = [
        {"mps": True, "runs": 3, "work": 1.2},
        {"mps": True, "runs": 3, "work": 1.6},
        {"mps": True, "runs": 2, "work": 3.0},  # not a three-job mix
        {"mps": False, "runs": 3, "work": 1.0},  # not under MPS
    ]
    shared = share.shared_recipe(70.0, rows)
    assert shared == {"jobs": 3, "mixes": 2, "work_mean": 1.4, "min": 50.0, "min_range": [43.8, 58.3]}
    assert share.shared_recipe(70.0, rows[3:]) is None
    hidden = share.shared_recipe(70.0, rows, start_min=14.0)  # the starts' 14 min gone, the rest shared
    assert hidden["min_starts_hidden"] == 40.0 and hidden["min"] == shared["min"]
    two = share.shared_recipe(70.0, rows, k=2)  # an 80 GB card holds two jobs
    assert two == {"jobs": 2, "mixes": 1, "work_mean": 3.0, "min": 23.3, "min_range": [23.3, 23.3]}
    recipe = {"one_at_a_time": one, "under_mps": [shared]}
    md = share.table({"settings": settings, "device": "cpu", "rows": [], "recipe": recipe})
    assert f"**{one['min']} min one job at a time**" in md and f"**{shared['min']} min**" in md
    assert "solos (8 micro-batches;" in md  # no solo recorded its own: the run's setting
    # solos from another call at config.yaml's 4 micro-batches, the mixes at 8: the line names the solos'
    solo4 = {"grpo": 4, "ada": 4, "raft": 4, "mixed": 4}
    md = share.table(
        {"settings": settings, "device": "cpu", "rows": [], "recipe": recipe, "alone_micro_batches": solo4}
    )
    assert "solos (4 micro-batches;" in md
    assert f"13 eval starts, not 37): **{one['one_job_per_run_min']} min one job at a time**" in md
    md = share.table(
        {"settings": settings, "device": "cpu", "rows": [], "recipe": {**recipe, "cohort": {**co, "eval_job": "eval"}}}
    )
    assert (
        f"(grpo, raft: an arm's seeds as one job, priced by its cohort solo; the evals by eval's): **{co['min']}" in md
    )
    md = share.table({"settings": settings, "device": "cpu", "rows": [], "recipe": proj})  # no compiled-eval solo
    assert "with the evals on `fast-eager`" in md and "with `train.cohort`" in md and "full recipe from" not in md
    md = share.table({"settings": settings, "device": "cpu", "rows": [], "recipe": {**recipe, "eval_eager": eager}})
    assert f"**{eager['min']} min** one job at a time, **{eager['one_job_per_run_min']} min** with one eval" in md


def test_the_guards_sampler_check_compares_both_triton_samplers_with_the_torch_rule():
    """The GPU guard's sampler section, run under Triton's interpreter on a small vocabulary."""
    pytest.importorskip("triton")
    from test_fast_attention import _interpret

    out = _interpret(
        """
        import json, sys
        sys.path.insert(0, "bench")
        import speed
        print("JSON" + json.dumps(speed._sampler_check(speed.torch.device("cpu"), 3000, draws=3)))
        """
    )
    res = json.loads(out.split("JSON", 1)[1])
    assert res["rows"] == res["top_rows"] == 96
    # bf16 logits: a few rows may sit on a boundary or tie, not more
    assert res["same_tokens"] >= 93 and res["top_same_tokens"] >= 90, res
    assert res["logp_max_abs_diff"] < 1e-4 and res["top_logp_max_abs_diff"] < 1e-4, res


def test_the_training_profile_table_prints_the_liger_sweep_beside_the_patched_steps():
    """The shape ``--train-liger`` wrote on the H200 (2026-12-05): the micro-batch sweep, one count out of
    memory, sits among the patched steps' keys and must not be read as one of them."""
    speed = _bench_module("speed")
    step = {"wall_s": 2.4, "first_step_s": 3.3, "loss": 0.0, "grad_rel_diff": 0.049, "grad_rel_diff_fp32": 0.048}
    kinds = {"matmul": 751.7, "attention": 205.8}
    profile = {
        "arm": "raft",
        "turns": 128,
        "rows": 64,
        "micro_batches": 8,
        "tokens_real": 67570,
        "tokens_padded": 72000,
        "completion_tokens": 32768,
        "wall_s": 2.0,
        "tokens_per_s": 33543,
        "tflops_4n": 207.1,
        "gpu_ms": 1656.4,
        "by_kind_ms": kinds,
        "top": [],
        "eager": {"wall_s": 2.5, "loss": 0.0},
        "eager_pairs": [{"what": "eager, 4 micro-batches vs eager, 8", "grad_rel_diff": 0.0385}],
        "vs_fp32": {"eager, 8 micro-batches": 0.0484, "eager, 4 micro-batches": 0.0489},
        "noise_floor": {"what": "eager, 4 micro-batches vs eager, 8", "grad_rel_diff": 0.0385},
        "liger_rms_norm": step,
        "liger": {**step, "by_kind_ms": kinds, "gpu_ms": 1289.5},
        "liger_micro_batches": {"2": "out of memory", "4": 1.433, "16": 4.289},
        "liger+aligned": {**step, "wall_s": 1.344, "by_kind_ms": {"attention": 69.3}, "gpu_ms": 1265.4},
        "liger+packed": {**step, "wall_s": 1.21, "by_kind_ms": {"attention": 60.1}, "gpu_ms": 1150.2},
        "liger+aligned+lora-bwd": {
            **step,
            "wall_s": 1.3,
            "walls_s": [1.31, 1.3, 1.28],
            "by_kind_ms": {"matmul": 800.5},
            "gpu_ms": 1190.0,
            "top": [{"kernel": "nvjet_sm90_tst_256x160", "ms": 140.2, "calls": 224}],
        },
        "aligned+lora-bwd": {"error": "RuntimeError: no"},
        "compiled_layers": {"error": "AttributeError: 'float' object has no attribute 'to'", "with_liger": True},
    }
    versions = {"torch": "2.11.0", "transformers": "5.23.0"}
    text = speed.table(
        {
            "device": "NVIDIA H200",
            "model": "random",
            "dtype": "bfloat16",
            "versions": versions,
            "train_profile": profile,
        }
    )
    assert "| liger rms_norm (first step 3.3 s) | 2.4 | 4.90e-02 | 4.80e-02 |" in text
    assert "micro batches" not in text  # the sweep is not a table row
    assert "other micro-batch counts: 2: out of memory, 4: 1.433 s, 16: 4.289 s" in text
    assert "| liger+aligned (first step 3.3 s) | 1.344 | 4.90e-02 | 4.80e-02 |" in text
    assert "the liger+aligned step's 1265.4 ms of kernels" in text and "attention 69.3 ms" in text
    assert "| liger+packed (first step 3.3 s) | 1.21 | 4.90e-02 | 4.80e-02 |" in text
    assert "the liger+packed step's 1150.2 ms of kernels (rows as one row, no pads): attention 60.1 ms" in text
    assert "| compiled_layers | failed: AttributeError: 'float' object has no attribute 'to' | | |" in text
    assert "| liger+aligned+lora-bwd (first step 3.3 s) | 1.3 (1.28–1.31) | 4.90e-02 | 4.80e-02 |" in text
    assert (
        "the liger+aligned+lora-bwd step's 1190.0 ms of kernels (rows aligned, each LoRA layer one autograd node): "
        "matmul 800.5 ms; nvjet_sm90_tst_256x160 140.2 ms ×224"
    ) in text
    assert "| aligned+lora-bwd | failed: RuntimeError: no | | |" in text


def test_zero_rows_bench_summarises_each_run_s_step_log(tmp_path, capsys):
    """bench/zero_rows.py: the zero-advantage share is of the rows credited (run + left out); a missing split
    is a clear message, not a traceback."""
    zr = _bench_module("zero_rows")
    logs = [
        {"loss_rows": 4.0, "skipped_rows": 28.0, "gen_s": 0.5, "train_s": 0.1, "reward": 0.25},
        {"loss_rows": 12.0, "skipped_rows": 20.0, "gen_s": 0.7, "train_s": 0.3, "reward": 0.5},
    ]
    left_out = zr.summary("raft", True, logs)
    assert left_out["zero_rows_share"] == 0.75 and left_out["loss_rows"] == 8.0
    assert left_out["train_s"] == pytest.approx(0.2) and left_out["reward"] == 0.375
    every = zr.summary("raft", False, [{**x, "loss_rows": 32.0, "skipped_rows": 0.0} for x in logs])
    assert every["zero_rows_share"] is None and every["loss_rows"] == 32.0
    import sys

    argv = sys.argv
    sys.argv = ["zero_rows.py", "--config", "config.yaml", "--results", str(tmp_path)]
    try:
        assert zr.main() == 2
    finally:
        sys.argv = argv
    assert "no split under" in capsys.readouterr().err
