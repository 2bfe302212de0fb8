"""Bad config and bad input: one clear line naming the key (and what is allowed), before any job starts.

Every bad value is tried twice: through ``talkmethods.config.validate_config`` and through a dry run
(``snakemake -n``) of the real Snakefile with the value in an overlay ``--configfile``. A value that
only the data can reveal (more train problems than eligible ones) is tried through the split stage
and its command line. The Snakemake runs start in parallel: each spends most of its time waiting
(Snakemake's start-up), not computing.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from talkmethods.config import ConfigError, merge, validate_config

REPO = Path(__file__).resolve().parents[1]
TARGET = "results/grpo/seed17/train_log.jsonl"
ARMS = "grpo, ada, raft, mixed, ada_mixed"


def base_config() -> dict:
    """What the offline default runs with: config.yaml overlaid by offline.yaml."""
    return merge(
        yaml.safe_load((REPO / "config.yaml").read_text()), yaml.safe_load((REPO / "offline.yaml").read_text())
    )


# id: (overlay YAML, key the message must name, fragments naming what is allowed)
BAD = {
    "unknown-arm": ("arms: [grpo, ppo]", "arms.1", ["'ppo'", f"allowed: {ARMS}"]),
    "negative-lr": (
        "train: {learning_rate: -1.0e-4}",
        "train.learning_rate",
        ["-0.0001", "expected number (exclusiveMinimum 0, maximum 1)"],
    ),
    "non-numeric-lr": ("train: {learning_rate: fast}", "train.learning_rate", ["'fast'", "expected number"]),
    "nan-lr": ("train: {learning_rate: .nan}", "train.learning_rate", ["nan", "expected a finite number"]),
    "seed-not-integer": ("seeds: [17, x]", "seeds.1", ["'x'", "expected integer (minimum 0)"]),
    "seed-fraction": ("seeds: [17, 1.5]", "seeds.1", ["1.5", "expected integer"]),
    "seeds-not-list": ("seeds: 17", "seeds", ["expected array"]),
    "missing-model-dir": ("model: {name: ./no/such/dir}", "model.name", ["no such directory", "offline-tiny-qwen2"]),
    "zero-turn-length": ("train: {max_new_tokens: 0}", "train.max_new_tokens", ["expected integer (minimum 1)"]),
    "zero-eval-turn-length": ("eval: {max_new_tokens: 0}", "eval.max_new_tokens", ["expected integer (minimum 1)"]),
    "unknown-top-level-key": (
        "trian: {steps: 3}",
        "'trian'",
        ["allowed keys: arms, bench, checkpoint_dir, data, eval"],
    ),
    "unknown-train-key": ("train: {stepz: 3}", "'stepz'", ["allowed keys:", "steps"]),
    "local-missing-dir": (
        "data: {source: local, local_dir: ./no/such/data}",
        "data.local_dir",
        ["no such directory", "data.source: local"],
    ),
    "local-unset-dir": ("data: {source: local}", "data.local_dir", ["no such directory"]),
    "n-train-over-hub": ("data: {source: hub, n_train: 8000}", "data.n_train", ["7473", "lower data.n_train"]),
    "warmstart-with-hub-model": (
        "model: {name: Qwen/Qwen2.5-1.5B-Instruct}",
        "model.warmstart",
        ["model.name: offline-tiny-qwen2", "model.warmstart: null"],
    ),
    "warmstart-heads": ("model: {warmstart: {heads: 3}}", "model.warmstart", ["multiple of heads"]),
    "warmstart-slip-rate": ("model: {warmstart: {slip_rate: 1.5}}", "model.warmstart.slip_rate", ["maximum 1"]),
    "unknown-world": ("data: {world: chess}", "data.world", ["allowed: count, templates"]),
    "train-top-p": ("train: {top_p: 0.9}", "train.top_p", ["softmax(logits / temperature)", "train.top_p: 1.0"]),
    "train-rep-penalty": (
        "train: {repetition_penalty: 1.05}",
        "train.repetition_penalty",
        ["softmax(logits / temperature)"],
    ),
    "eval-rep-penalty-fast": ("eval: {repetition_penalty: 1.05}", "eval.repetition_penalty", ["eval.engine: plain"]),
    "cohort-unknown-arm": ("train: {cohort: [grpo, ppo]}", "train.cohort.1", ["'ppo'", f"allowed: {ARMS}"]),
    "cohort-not-arms": (
        "train: {cohort: yes please}",
        "train.cohort",
        ["'yes please'", "expected ['boolean', 'array']"],
    ),
}


@pytest.mark.parametrize(
    "cohort, together",
    [
        (False, []),
        ([], []),
        (True, ["grpo", "ada", "raft", "mixed"]),
        (["mixed", "raft", "ada_mixed"], ["raft", "mixed"]),
    ],
)
def test_cohort_arms_are_the_configs_arms_that_train_cohort_names(cohort, together):
    """train.cohort: true (every arm), false (none) or a list; in the config's order, only arms it runs."""
    from talkmethods.config import cohort_arms, trains_as_cohort

    cfg = base_config()
    cfg["train"]["cohort"] = cohort
    validate_config(cfg)
    assert cfg["arms"] == ["grpo", "ada", "raft", "mixed"] and cohort_arms(cfg) == together
    # the CLI may train an arm the config's arms leave out: train.cohort decides for it as for the others
    assert trains_as_cohort(cfg, "ada_mixed") == (cohort is True or "ada_mixed" in (cohort or []))


def _one_error_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def test_offline_default_and_real_recipe_are_valid():
    validate_config(base_config())
    validate_config(yaml.safe_load((REPO / "config.yaml").read_text()))


def test_the_shared_gpu_overlay_changes_only_the_micro_batches():
    """shared-gpu.yaml (three runs under MPS) keeps the recipe but for how a step is cut into micro-batches."""
    from talkmethods.config import load_config

    real = load_config([str(REPO / "config.yaml")])
    shared = load_config([str(REPO / "config.yaml"), str(REPO / "shared-gpu.yaml")])
    assert shared["train"]["micro_batches"] == 8 != real["train"]["micro_batches"]
    assert {**shared["train"], "micro_batches": real["train"]["micro_batches"]} == real["train"]
    assert {k: v for k, v in shared.items() if k != "train"} == {k: v for k, v in real.items() if k != "train"}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_validate_config_names_the_key(case, tmp_path, monkeypatch):
    overlay, key, fragments = BAD[case]
    monkeypatch.chdir(tmp_path)  # relative paths resolve as in a Snakemake --directory
    with pytest.raises(ConfigError) as err:
        validate_config(merge(base_config(), yaml.safe_load(overlay)))
    message = str(err.value)
    assert "\n" not in message and message.startswith("config: ")
    assert key in message
    for fragment in fragments:
        assert fragment in message


def _local_dir(root: Path, n_train_eligible: int, n_train_ineligible: int, n_test: int) -> Path:
    """A GSM8K-style folder: eligible problems have 3 fact sentences, ineligible ones a single fact."""
    root.mkdir(parents=True, exist_ok=True)

    def eligible(i: int, who: str) -> dict:
        q = f"{who} {i} has {i + 2} pens. {who} {i} buys {i + 3} more. {who} {i} finds {i + 4}. How many pens now?"
        return {"question": q, "answer": f"so\n#### {3 * i + 9}"}

    def single(i: int) -> dict:
        return {"question": f"Lone {i} has {i + 5} cups. How many cups?", "answer": f"#### {i + 5}"}

    train = [eligible(i, "Ava") for i in range(n_train_eligible)] + [single(i) for i in range(n_train_ineligible)]
    test = [eligible(i, "Ben") for i in range(n_test)]
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_more_train_problems_than_rows_fails_in_validation(tmp_path):
    data = _local_dir(tmp_path / "gsm", 3, 0, 4)
    cfg = merge(base_config(), {"data": {"source": "local", "local_dir": str(data), "n_train": 5, "n_heldout": 2}})
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert str(err.value) == (
        f"config: data.n_train = 5 is more than the 3 problems in {data / 'train.jsonl'} (and only the eligible "
        "ones, with two or more fact sentences, count): lower data.n_train"
    )


def test_more_train_problems_than_eligible_ones_fails_in_the_split(tmp_path):
    """Enough rows, too few eligible: only the split can tell; it fails with a DataError naming n_train."""
    from talkmethods.config import split_params
    from talkmethods.problems import DataError
    from talkmethods.split import split_stage

    data = _local_dir(tmp_path / "gsm", 3, 3, 4)
    cfg = merge(base_config(), {"data": {"source": "local", "local_dir": str(data), "n_train": 5, "n_heldout": 2}})
    validate_config(cfg)  # 6 rows >= 5: the cheap check passes
    out = tmp_path / "results/data"
    with pytest.raises(DataError) as err:
        split_stage(split_params(cfg), out / "train.jsonl", out / "heldout.jsonl", out / "split_stats.json")
    assert str(err.value) == (
        "n_train = 5 requested, but only 3 of the 6 problems in its pool are eligible "
        "(a sentence that asks, two or more fact sentences); lower n_train or use more data"
    )
    assert not out.exists()  # nothing half-written


def _cli(args: list[str], cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "talkmethods", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_cli_split_on_broken_local_jsonl_and_on_too_few_eligible(tmp_path):
    """`python -m talkmethods split`: a broken jsonl line, then too few eligible problems; one line each, exit 2."""
    broken = _local_dir(tmp_path / "broken", 4, 0, 4)
    lines = (broken / "train.jsonl").read_text().splitlines()
    lines[2] = lines[2][:25]  # a line cut mid-object
    (broken / "train.jsonl").write_text("\n".join(lines) + "\n")
    few = _local_dir(tmp_path / "few", 3, 3, 4)
    for name, folder in (("broken", broken), ("few", few)):
        (tmp_path / f"{name}.yaml").write_text(
            yaml.safe_dump(
                {
                    "data": {
                        "source": "local",
                        "local_dir": str(folder),
                        "n_train": 4 if name == "broken" else 5,
                        "n_heldout": 2,
                    }
                }
            )
        )
    cfg = ["--config", str(REPO / "config.yaml"), "--config", str(REPO / "offline.yaml")]
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "talkmethods",
                "split",
                *cfg,
                "--config",
                f"{name}.yaml",
                "--results",
                f"res_{name}",
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
        )
        for name in ("broken", "few")
    }
    out = {name: p.communicate(timeout=180) for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 2, out[name][1][-3000:]
        assert "Traceback" not in out[name][1]
        assert not (tmp_path / f"res_{name}").exists()
    line = _one_error_line(out["broken"][1])
    assert line.startswith(f"error: {broken / 'train.jsonl'}, line 3: broken JSON (")
    assert _one_error_line(out["few"][1]) == (
        "error: n_train = 5 requested, but only 3 of the 6 problems in its pool are eligible (a sentence that asks, "
        "two or more fact sentences); lower n_train or use more data"
    )


def test_cli_bad_arguments_and_missing_inputs_name_the_fix(tmp_path, monkeypatch, capsys):
    """In-process: an unknown --arm, training before the split, evaluating an untrained run."""
    from talkmethods.cli import main

    monkeypatch.chdir(tmp_path)
    cfg = ["--config", str(REPO / "config.yaml"), "--config", str(REPO / "offline.yaml")]
    cases = [
        (["train", *cfg, "--arm", "ppo", "--seed", "17"], f"error: --arm 'ppo' is not valid; allowed: {ARMS}"),
        (
            ["train", *cfg, "--arm", "grpo", "--seed", "17"],
            "error: results/data/train.jsonl: not found; run `python -m talkmethods split` with the same --config "
            "and --results first",
        ),
    ]
    cohort = [*cfg, "--config", str(REPO / "cohort.yaml")]
    cases += [
        (
            ["train", *cohort, "--arm", "grpo", "--seed", "17"],
            "error: train.cohort trains every seed of grpo as one cohort: leave --seed out",
        ),
        (
            ["train", *cohort, "--arm", "grpo"],
            "error: results/data/train.jsonl: not found; run `python -m talkmethods split` with the same --config "
            "and --results first",
        ),
    ]
    with pytest.raises(SystemExit, match="talkmethods train: missing --seed"):  # cohort.yaml leaves ada a run a seed
        main(["train", *cohort, "--arm", "ada"])
    (tmp_path / "results/data").mkdir(parents=True)
    (tmp_path / "results/data/heldout.jsonl").write_text("{}\n")
    no_warm = (
        "error: results/warmstart/model: not found; run `python -m talkmethods warmstart` with the same "
        "--config and --results first"
    )
    for argv in (["eval", *cfg, "--kind", "base"], ["eval", *cfg, "--kind", "eval", "--arm", "grpo", "--seed", "17"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert _one_error_line(capsys.readouterr().err) == no_warm  # the offline default's evals need the warm start
    (tmp_path / "results/warmstart/model").mkdir(parents=True)
    cases.append(
        (
            ["eval", *cfg, "--kind", "eval", "--arm", "grpo", "--seed", "17"],
            "error: results/grpo/seed17/adapter: not found; train it first: "
            "`python -m talkmethods train --arm grpo --seed 17`",
        )
    )
    for argv, expected in cases:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert _one_error_line(err) == expected


def _snakemake(workdir: Path, overlay: Path, dry: bool = True) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "-j1",
        *(["-n"] if dry else []),
        TARGET,
        "--configfile",
        str(REPO / "offline.yaml"),
        str(overlay),
    ]
    return subprocess.Popen(
        cmd,
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_snakemake_refuses_each_bad_config_before_any_job(tmp_path):
    """`snakemake -n` with each bad overlay: non-zero exit, the key in stderr, no traceback, no results/.

    One case (unknown arm) also runs for real (no -n): it too stops before any job starts. The split
    job's own failure (too few eligible problems) is a real run: Snakemake reports the job's one line.
    """
    runs = {}
    for case, (overlay, _, _) in BAD.items():
        d = tmp_path / case
        d.mkdir()
        (d / "bad.yaml").write_text(overlay + "\n")
        runs[case] = _snakemake(d, d / "bad.yaml")
    real = tmp_path / "unknown-arm-real"
    real.mkdir()
    (real / "bad.yaml").write_text(BAD["unknown-arm"][0] + "\n")
    runs["unknown-arm-real"] = _snakemake(real, real / "bad.yaml", dry=False)
    few = tmp_path / "few-eligible"
    data = _local_dir(few / "gsm", 3, 3, 4)
    (few / "bad.yaml").write_text(
        yaml.safe_dump({"data": {"source": "local", "local_dir": str(data), "n_train": 5, "n_heldout": 2}})
    )
    runs["few-eligible"] = _snakemake(few, few / "bad.yaml", dry=False)
    results = {case: (p.communicate(timeout=400), p.returncode) for case, p in runs.items()}

    for case, ((_stdout, stderr), rc) in results.items():
        if case == "few-eligible":
            continue
        _, key, fragments = BAD[case.removesuffix("-real")]
        assert rc != 0, (case, stderr[-2000:])
        assert "Traceback" not in stderr, (case, stderr[-3000:])
        line = _one_error_line(stderr)
        assert key in line, (case, line)
        assert all(f in line for f in fragments), (case, line)
        assert not (tmp_path / case / "results").exists(), case

    (stdout, stderr), rc = results["few-eligible"]
    assert rc != 0, stderr[-3000:]
    assert "Error in rule split" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    log = (few / "results/logs/split.log").read_text()  # where Snakemake sends the user ("check log file(s)")
    assert "Traceback" not in log
    assert "ERROR talkmethods: error: n_train = 5 requested" in log, log
    assert _one_error_line(stderr) == (
        "error: n_train = 5 requested, but only 3 of the 6 problems in its pool are eligible (a sentence that asks, "
        "two or more fact sentences); lower n_train or use more data"
    )
    assert not (few / "results/data/train.jsonl").exists()


def test_config_module_does_not_import_torch():
    """Snakemake imports talkmethods.config to check the config: keep that cheap (no torch)."""
    from talkmethods import config, models

    assert config.OFFLINE_MODEL == models.OFFLINE_MODEL
    code = "import sys, talkmethods.config; print('torch' in sys.modules)"
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert res.stdout.strip() == "False", res.stderr


def test_validate_config_reports_the_first_error_deterministically():
    """Two bad keys: always the same one is reported (sorted by path)."""
    cfg = merge(base_config(), {"train": {"learning_rate": -1.0, "steps": 0}, "arms": ["ppo"]})
    messages = set()
    for _ in range(3):
        with pytest.raises(ConfigError) as err:
            validate_config(copy.deepcopy(cfg))
        messages.add(str(err.value))
    assert len(messages) == 1


def test_a_model_dir_that_holds_no_model_is_one_line_naming_model_name(tmp_path):
    """model.name is a directory (validation passes) but holds no tokenizer/model: ModelError, not a ValueError."""
    import torch

    from talkmethods.errors import UserError
    from talkmethods.models import ModelError, ModelSpec, load_model, load_tokenizer

    empty, odd = tmp_path / "empty", tmp_path / "odd"
    empty.mkdir()
    odd.mkdir()
    (odd / "config.json").write_text('{"model_type": "nonsense"}')
    validate_config(merge(base_config(), {"model": {"name": str(empty), "warmstart": None}}))
    for folder in (empty, odd):
        for load, what in (
            (lambda s: load_tokenizer(s), "tokenizer"),
            (lambda s: load_model(s, torch.float32), "causal LM"),
        ):
            with pytest.raises(ModelError) as err:
                load(ModelSpec(str(folder)))
            message = str(err.value)
            assert "\n" not in message and issubclass(ModelError, UserError)
            assert message.startswith(f"model.name={str(folder)!r}: the directory holds no loadable {what} (")
            assert message.endswith("or use 'offline-tiny-qwen2'.")


def test_engines_in_the_schema_are_the_engines_the_code_has():
    from talkmethods.engines import ENGINES

    schema = yaml.safe_load((Path(__file__).parents[1] / "talkmethods/schemas/config.schema.yaml").read_text())
    for section in ("train", "eval"):
        assert set(schema["properties"][section]["properties"]["engine"]["enum"]) == set(ENGINES)


def test_one_arm_table_and_one_eval_kind_table():
    """The schema's arms are credit.py's (one credit rule and one draw plan each); the rules, the
    aggregate and the card read their eval kinds from recipe.EVAL_KINDS."""
    from talkmethods.aggregate import KIND_FILES, KINDS
    from talkmethods.card import KIND_LABELS
    from talkmethods.credit import ARM_PLANS, CREDIT_RULES
    from talkmethods.evaluate import EVAL_SEATS
    from talkmethods.recipe import EVAL_KINDS

    schema = yaml.safe_load((Path(__file__).parents[1] / "talkmethods/schemas/config.schema.yaml").read_text())
    assert set(schema["properties"]["arms"]["items"]["enum"]) == set(CREDIT_RULES) == set(ARM_PLANS)
    assert tuple(KINDS) == tuple(EVAL_KINDS) == tuple(KIND_FILES) == tuple(KIND_LABELS)
    assert set(EVAL_SEATS) == {*EVAL_KINDS, "base"}
    common = (Path(__file__).parents[1] / "rules/common.smk").read_text()
    assert "EVAL_KINDS = list(tm_recipe.RUN_EVAL_KINDS)" in common


def test_every_key_the_code_reads_is_required_and_the_dataclasses_have_no_defaults():
    """Defaults live only in config.yaml: dropping any key of it is a config error naming that key, and
    the recipe's dataclasses take every field from it."""
    import dataclasses

    from talkmethods.recipe import EvalConfig, TrainConfig

    for cls in (TrainConfig, EvalConfig):
        assert all(
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            for f in dataclasses.fields(cls)
        ), cls
    full = base_config()
    for section in ("model", "data", "train", "eval", "stats", "bench"):
        for key in full[section]:
            cfg = copy.deepcopy(full)
            del cfg[section][key]
            with pytest.raises(ConfigError) as err:
                validate_config(cfg)
            assert key in str(err.value), (section, key, str(err.value))
