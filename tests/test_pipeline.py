"""The Snakemake DAG: planning, lint, and the whole offline default end to end (what `make demo` runs).

The end-to-end run is the slow part of the suite (the full offline default, every arm × seed, on the
CPU); it runs once per session in a copy of the workflow, so touching a script there leaves the
repository alone.
"""

from __future__ import annotations

import json
import modulefinder
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = [
    "Snakefile",
    "config.yaml",
    "offline.yaml",
    "cohort.yaml",
    "rules",
    "workflow_scripts",
    "envs",
    "report",
    "bench",
    "talkmethods",
]
ARMS, SEEDS, KINDS = ["grpo", "ada", "raft", "mixed"], [17, 18, 19], ["eval", "crossplay", "crossplay_bA"]
OFFLINE = yaml.safe_load((REPO / "offline.yaml").read_text())
STEPS = OFFLINE["train"]["steps"]
# Held-out base x base team accuracy of the warm-started offline model (seeded; 100 problems x 2 chats at
# the rollout temperature). Measured 0.33 on the CPU; the band leaves room for a standard error of ~0.03
# and for float32 differences between machines, and still fails a warm start that did not take (~0).
BASE_BAND = (0.15, 0.50)
# A one-thread-per-job run, as `make demo` does it.
CPU_THREADS = ["--set-threads", "train=1", "eval_run=1", "eval_base=1"]


def snakemake(
    args: list[str],
    workdir: Path,
    snakefile: Path = REPO / "Snakefile",
    timeout: int = 600,
    overlays: tuple[Path, ...] = (),
):
    """Run snakemake on the offline default (plus ``overlays``) in ``workdir``; returns the CompletedProcess."""
    configs = [str(snakefile.parent / "offline.yaml"), *map(str, overlays)]
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(snakefile),
        "--directory",
        str(workdir),
        *args,
        "--configfile",
        *configs,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=workdir)


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run as {rule: count}."""
    if "Nothing to be done" in output:
        return {}
    table = output.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    rows = [ln.split() for ln in table.splitlines()[3:] if ln.strip()]
    return {r[0]: int(r[1]) for r in rows if len(r) == 2 and r[0] != "total"}


def test_dry_run_plans_every_stage(tmp_path):
    res = snakemake(["-n", "results/card.png"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    n = len(ARMS) * len(SEEDS)
    assert job_counts(res.stdout + res.stderr) == {
        "split": 1,
        "selftest": 1,
        "warmstart": 1,
        "train": n,
        "eval_run": 3 * n,
        "eval_base": 1,
        "train_curve": n,
        "aggregate": 1,
        "card": 1,
    }


def test_the_real_recipe_plans_no_warm_start(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(tmp_path),
        "-n",
        "results/card.png",
        "--configfile",
        str(REPO / "config.yaml"),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    counts = job_counts(res.stdout + res.stderr)
    assert counts["train"] == 12 and "warmstart" not in counts, counts


def test_one_run_target_builds_that_run_and_nothing_else(tmp_path):
    res = snakemake(["-n", "results/raft/seed17/eval.json"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert job_counts(res.stdout + res.stderr) == {"split": 1, "warmstart": 1, "train": 1, "eval_run": 1}


def test_one_job_per_run_plans_one_eval_job_a_run(tmp_path):
    """eval.one_job_per_run: a run's three kinds in one job, for the card and for one kind's target alike."""
    overlay = tmp_path / "one_job.yaml"
    overlay.write_text("eval:\n  one_job_per_run: true\n")
    res = snakemake(["-n", "results/card.png"], tmp_path, overlays=(overlay,))
    assert res.returncode == 0, res.stderr[-3000:]
    counts = job_counts(res.stdout + res.stderr)
    n = len(ARMS) * len(SEEDS)
    assert counts["eval_run_kinds"] == n and "eval_run" not in counts and counts["eval_base"] == 1, counts
    res = snakemake(["-n", "results/raft/seed17/eval.json"], tmp_path, overlays=(overlay,))
    assert res.returncode == 0, res.stderr[-3000:]
    assert job_counts(res.stdout + res.stderr) == {"split": 1, "warmstart": 1, "train": 1, "eval_run_kinds": 1}


def test_a_cohort_overlay_plans_one_training_job_an_arm(tmp_path):
    """cohort.yaml (train.cohort: grpo, raft, mixed): those arms' seeds as one job each, ada's a job a seed;
    the evals (one job a run: eval.one_job_per_run) and curves stay a run's each. A one-seed target of a
    cohort arm trains the arm's three."""
    overlays = (REPO / "cohort.yaml",)
    res = snakemake(["-n", "results/card.png"], tmp_path, overlays=overlays)
    assert res.returncode == 0, res.stderr[-3000:]
    counts = job_counts(res.stdout + res.stderr)
    n = len(ARMS) * len(SEEDS)
    assert counts["train_cohort"] == len(ARMS) - 1 and counts["train"] == len(SEEDS), counts
    assert counts["eval_run_kinds"] == n and "eval_run" not in counts and counts["train_curve"] == n, counts
    res = snakemake(["-n", "results/raft/seed17/eval.json"], tmp_path, overlays=overlays)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert job_counts(out) == {"split": 1, "warmstart": 1, "train_cohort": 1, "eval_run_kinds": 1}
    assert all(f"results/raft/seed{s}/adapter" in out for s in SEEDS)
    res = snakemake(["-n", "results/ada/seed18/eval.json"], tmp_path, overlays=overlays)  # not in the list
    assert res.returncode == 0, res.stderr[-3000:]
    assert job_counts(res.stdout + res.stderr) == {"split": 1, "warmstart": 1, "train": 1, "eval_run_kinds": 1}
    every = tmp_path / "every.yaml"  # train.cohort: true, every arm
    every.write_text("train: {cohort: true}\n")
    res = snakemake(["-n", "results/card.png"], tmp_path, overlays=(every,))
    assert res.returncode == 0, res.stderr[-3000:]
    counts = job_counts(res.stdout + res.stderr)
    assert counts["train_cohort"] == len(ARMS) and "train" not in counts, counts


def test_arm_target_trains_and_evaluates_all_its_seeds(tmp_path):
    res = snakemake(["-n", "arm_raft"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert job_counts(res.stdout + res.stderr) == {
        "split": 1,
        "warmstart": 1,
        "train": 3,
        "eval_run": 9,
        "arm_raft": 1,
    }


def test_arms_and_seeds_come_from_config(tmp_path):
    overlay = tmp_path / "five.yaml"
    overlay.write_text("arms: [grpo, ada_mixed]\nseeds: [1, 2, 3, 4, 5]\n")
    res = snakemake(["-n", "results/card.png"], tmp_path, overlays=(overlay,))
    assert res.returncode == 0, res.stderr[-3000:]
    counts = job_counts(res.stdout + res.stderr)
    assert counts["train"] == 10 and counts["eval_run"] == 30, counts


def test_lint_is_clean(tmp_path):
    res = snakemake(["--lint"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Congratulations" in res.stdout + res.stderr


def test_the_suites_snakemake_runs_meet_the_scontrol_stand_in():
    """Every Snakemake start runs the SLURM plugin's ``scontrol show config``; the suite's runs must get
    conftest's stand-in (an answer at once), not a client that waits 9-59 s for a controller that is not there."""
    from conftest import NO_SLURM

    assert shutil.which("scontrol") == os.path.join(NO_SLURM, "scontrol")
    res = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=5)
    assert res.returncode == 1 and "no SLURM controller" in res.stderr


def test_dag_prints_dot_without_graphviz(tmp_path):
    res = snakemake(["results/card.png", "--dag"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.lstrip().startswith("digraph") and "train" in res.stdout


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The whole offline default, built once from nothing in a copy of the workflow."""
    root = tmp_path_factory.mktemp("e2e")
    wf = root / "workflow"
    wf.mkdir()
    for name in WORKFLOW_FILES:
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(
            src, wf / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if src.is_dir() else {})
        )
    run = root / "run"
    run.mkdir()
    t0 = time.perf_counter()
    res = snakemake(
        ["-j2", "--cores", "2", "results/card.md", "results/card.png", *CPU_THREADS],
        run,
        wf / "Snakefile",
        timeout=3600,
    )
    wall = time.perf_counter() - t0
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    sys.stderr.write(f"\noffline default end to end: {wall:.0f} s\n")
    return wf, run


@pytest.mark.slow
def test_end_to_end_builds_the_card(demo):
    _, run = demo
    results = run / "results"
    card = (results / "card.md").read_text()
    assert card.splitlines()[0].startswith("**Toy world"), card.splitlines()[0]
    for section in ("## Recipe", "## Run", "## Result", "## Checks", "## Climb", "## Learned", "## References"):
        assert section in card
    assert (results / "card.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for arm in ARMS:
        assert re.search(rf"^\| {arm} \|", card, re.M), f"no row for {arm}"
        for seed in SEEDS:
            run_dir = results / arm / f"seed{seed}"
            assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
            log = [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()]
            assert [x["step"] for x in log] == list(range(1, STEPS + 1))
            rewards = [x["reward"] for x in log]
            assert len(set(rewards)) > 1 and max(rewards) > 0, (arm, seed, rewards)  # a curve that moves
    assert json.loads((results / "selftest.json").read_text())["passed"] is True


@pytest.mark.slow
def test_warm_start_lands_the_base_in_its_band(demo):
    """The warm start takes the tiny model from ~0 (a random model never boxes a right answer) to a base
    that is partly right, with partial credit common: where the arms' signals differ."""
    _, run = demo
    results = run / "results"
    stats = json.loads((results / "warmstart/stats.json").read_text())
    assert stats["vocab_rows"] < 1000 and stats["loss_last"] < stats["loss_first"] / 10, stats
    base = json.loads((results / "base/eval.json").read_text())["metrics"]
    assert BASE_BAND[0] <= base["team_accuracy"] <= BASE_BAND[1], base
    partial = base["a_accuracy"] + base["b_accuracy"] - 2 * base["both_right"]  # chats with exactly one seat right
    assert partial >= 0.15 and base["no_box_rate"] < 0.2, base
    card = (results / "card.md").read_text()
    assert re.search(r"^\| base × base \| 0\.[1-9]", card, re.M), "the card shows a non-zero base accuracy"
    turns = [
        len(t["text"]) for s in json.loads((results / "base/eval.json").read_text())["samples"] for t in s["turns"]
    ]
    assert max(turns) < 150, turns  # turns end on <|im_end|> well before the 64-token cap


@pytest.mark.slow
def test_eval_jsons_validate_against_the_schema(demo):
    _, run = demo
    schema = json.loads((REPO / "talkmethods/schemas/eval.schema.json").read_text())
    paths = [run / "results/base/eval.json"] + [
        run / f"results/{a}/seed{s}/{k}.json" for a in ARMS for s in SEEDS for k in KINDS
    ]
    for p in paths:
        obj = json.loads(p.read_text())
        jsonschema.validate(obj, schema)
        assert obj["counts"]["chats"] == 2 * obj["counts"]["problems"], p


@pytest.mark.slow
def test_one_eval_job_a_run_writes_what_three_jobs_wrote(demo, tmp_path):
    """eval.one_job_per_run on a built run: one job, one process, the three kinds' JSONs, each with the
    chats, metrics and samples its own job wrote (each kind plays from the eval seed)."""
    wf, run = demo
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    overlay = tmp_path / "one_job.yaml"
    overlay.write_text("eval:\n  one_job_per_run: true\n")
    paths = [copy / f"results/raft/seed17/{k}.json" for k in KINDS]
    alone = [json.loads(p.read_text()) for p in paths]
    for p in paths:
        p.unlink()
    res = snakemake(
        ["-j1", "--cores", "1", "results/raft/seed17/eval.json", "--set-threads", "eval_run_kinds=1"],
        copy,
        wf / "Snakefile",
        overlays=(overlay,),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert job_counts(res.stdout + res.stderr) == {"eval_run_kinds": 1}
    for kind, before, p in zip(KINDS, alone, paths, strict=True):
        after = json.loads(p.read_text())
        assert after["provenance"]["played_with"] == KINDS
        for key in ("kind", "arm", "seed", "config", "counts", "metrics", "per_problem", "samples"):
            assert after[key] == before[key], (kind, key)
    # the flag is no eval parameter: with it or without, no eval reruns (the three new files make the
    # aggregate and the card stale, nothing else)
    for overlays in ((overlay,), ()):
        res = snakemake(["-n", "results/card.png"], copy, wf / "Snakefile", overlays=overlays)
        assert res.returncode == 0, res.stderr[-3000:]
        assert job_counts(res.stdout + res.stderr) == {"aggregate": 1, "card": 1}, res.stdout[-2000:]


@pytest.mark.slow
def test_rerun_plans_only_what_went_stale(demo):
    wf, run = demo
    res = snakemake(["-n", "results/card.png"], run, wf / "Snakefile")
    assert res.returncode == 0 and job_counts(res.stdout + res.stderr) == {}, res.stdout[-2000:]
    script = wf / "workflow_scripts" / "aggregate.py"
    later = time.time() + 5
    os.utime(script, (later, later))
    res = snakemake(["-n", "results/card.png"], run, wf / "Snakefile")
    assert job_counts(res.stdout + res.stderr) == {"aggregate": 1, "card": 1}, res.stdout[-3000:]
    # a param edit (the eval sampling temperature) reruns every eval and what follows, no training
    overlay = run / "hotter.yaml"
    overlay.write_text("eval:\n  temperature: 0.9\n")
    res = snakemake(["-n", "results/card.png"], run, wf / "Snakefile", overlays=(overlay,))
    counts = job_counts(res.stdout + res.stderr)
    assert "train" not in counts and "split" not in counts, counts
    assert counts["eval_run"] == 36 and counts["eval_base"] == 1, counts
    # one arm switched to a cohort (train.cohort: [raft]): its seeds retrain as one job (another decode
    # batch, so other samples: the lone runs' adapters are not the cohort's), and only raft's stages follow
    overlay.write_text("train:\n  cohort: [raft]\n")
    res = snakemake(["-n", "results/card.png"], run, wf / "Snakefile", overlays=(overlay,))
    assert res.returncode == 0, res.stderr[-3000:]
    counts = job_counts(res.stdout + res.stderr)
    assert counts == {"train_cohort": 1, "eval_run": 9, "train_curve": 3, "aggregate": 1, "card": 1}, counts
    # an SFT edit reruns the warm start and everything downstream of it, and nothing else
    overlay.write_text("model:\n  warmstart:\n    steps: 650\n")
    res = snakemake(["-n", "results/card.png"], run, wf / "Snakefile", overlays=(overlay,))
    counts = job_counts(res.stdout + res.stderr)
    assert counts == {
        "warmstart": 1,
        "train": 12,
        "eval_run": 36,
        "eval_base": 1,
        "train_curve": 12,
        "aggregate": 1,
        "card": 1,
    }, counts


def _rule_scripts(wf: Path) -> dict[str, str]:
    """{rule: its script under workflow_scripts/}, ``use rule … as …`` included."""
    text = "\n".join(p.read_text() for p in sorted((wf / "rules").glob("*.smk")))
    scripts = {}
    for m in re.finditer(r"^rule (\w+):(.*?)(?=^rule |^use rule |\Z)", text, re.S | re.M):
        found = re.search(r'script:\s*"\.\./workflow_scripts/(\w+\.py)"', m.group(2))
        if found:
            scripts[m.group(1)] = found.group(1)
    for m in re.finditer(r"^use rule (\w+) as (\w+)", text, re.M):
        scripts[m.group(2)] = scripts[m.group(1)]
    return scripts


def _planned(output: str) -> dict[str, list[str]]:
    """{rule: [the reason line of each planned job]} of a dry run."""
    jobs: dict[str, list[str]] = {}
    for block in re.split(r"^(?:local)?rule ", output, flags=re.M)[1:]:
        reason = re.search(r"^\s*reason: (.*)$", block, re.M)
        jobs.setdefault(block.split(":", 1)[0].strip(), []).append(reason.group(1) if reason else "")
    return jobs


def _downstream(wf: Path, run: Path) -> dict[str, set[str]]:
    """{rule: itself and every rule downstream of it} from the rule graph."""
    dot = snakemake(["results/card.png", "--rulegraph", "dot"], run, wf / "Snakefile").stdout
    names = dict(re.findall(r"^\s*(\d+)\[label = \"(\w+)\"", dot, re.M))
    edges = [(names[a], names[b]) for a, b in re.findall(r"^\s*(\d+) -> (\d+)", dot, re.M)]
    down = {rule: {rule} for rule in names.values()}
    for _ in names:
        for a, b in edges:
            down[a] |= down[b]
    return down


@pytest.mark.slow
def test_editing_a_module_reruns_exactly_the_stages_that_import_it(demo):
    """Rule code inputs track the code: for every package module, editing it plans exactly the stages
    whose script imports it, directly or not (lazy imports inside functions included), and what lies
    downstream. The expectation comes from the standard library's ``modulefinder`` (bytecode), not from
    the rules' own AST walk. Each module is edited, the DAG planned, and the edit undone (Snakemake keeps
    small inputs' checksums, so a touch alone reruns nothing and the restored bytes are up to date)."""
    wf, run = demo
    scripts = _rule_scripts(wf)
    closure = {}
    for rule, script in scripts.items():
        finder = modulefinder.ModuleFinder(path=[str(wf), str(wf / "workflow_scripts")])
        finder.run_script(str(wf / "workflow_scripts" / script))
        closure[rule] = set(finder.modules)
    down = _downstream(wf, run)
    assert {"split", "selftest", "warmstart", "train", "eval_run", "eval_base", "aggregate", "card"} <= set(down)
    before = set(_planned(snakemake(["-n", "results/card.png"], run, wf / "Snakefile").stdout))  # e.g. earlier edits
    checked = 0
    for path in sorted((wf / "talkmethods").rglob("*.py")):
        rel = path.relative_to(wf).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        text = path.read_text()
        path.write_text(text + "\n# edited by the test\n")
        try:
            res = snakemake(["-n", "results/card.png"], run, wf / "Snakefile")
        finally:
            path.write_text(text)
        assert res.returncode == 0, res.stderr[-2000:]
        jobs = _planned(res.stdout)
        want = {rule for rule in down if rule in closure and name in closure[rule]}
        direct = {rule for rule, reasons in jobs.items() if any(str(path) in r for r in reasons)}
        roots = {r for r in want if not any(r in down[o] for o in want - {r})}  # no edited stage upstream
        assert roots <= direct <= want, (name, direct, want)
        assert set(jobs) == before.union(*(down[r] for r in want)), (name, sorted(jobs), sorted(want))
        checked += bool(want)
    assert checked >= 20, checked  # most modules feed some stage


@pytest.mark.slow
def test_report_bundles_card_and_curves(demo):
    wf, run = demo
    res = snakemake(["--report", "results/report.html"], run, wf / "Snakefile")
    assert res.returncode == 0, res.stderr[-3000:]
    html = (run / "results/report.html").read_text(errors="replace")
    assert "card.png" in html and "train_curve.png" in html


def test_every_gpu_rule_has_its_own_slurm_resources():
    """The SLURM profile's defaults (30 min, 2000 MB) would kill any GPU job: each GPU rule, ``use rule``
    copies included, is named under set-resources."""
    text = "\n".join(p.read_text() for p in sorted((REPO / "rules").glob("*.smk")))
    gpu_rules = {
        m.group(1)
        for m in re.finditer(r"^rule (\w+):(.*?)(?=^rule |^use rule |^\S|\Z)", text, re.S | re.M)
        if re.search(r"^\s+gpu=1,", m.group(2), re.M)
    }
    gpu_rules |= {m.group(2) for m in re.finditer(r"^use rule (\w+) as (\w+)", text, re.M) if m.group(1) in gpu_rules}
    assert {"train", "train_cohort", "eval_base"} <= gpu_rules, gpu_rules
    profile = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    assert gpu_rules <= set(profile["set-resources"]), gpu_rules - set(profile["set-resources"])
    assert all(profile["set-resources"][r]["gpu"] == 1 for r in gpu_rules)
