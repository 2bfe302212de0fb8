"""Every pipeline stage as a plain function of plain values: Snakemake scripts and the CLI both call these."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from talkmethods.atomic import write_json
from talkmethods.models import ModelSpec
from talkmethods.engines.sampling import Sampling

log = logging.getLogger(__name__)


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def split_stage(params: dict, out_train: str, out_heldout: str, out_stats: str) -> dict:
    """Load the problems, split facts, draw the train and held-out sets, write them and their statistics."""
    from talkmethods.problems import load_gsm8k, write_jsonl
    from talkmethods.split import draw_problems

    n_gen = max(4 * params["n_train"], 64), max(4 * params["n_heldout"], 64)
    train_pool, test_pool = load_gsm8k(params["source"], params.get("local_dir"), seed=params["data_seed"],
                                       n_generated_train=n_gen[0], n_generated_test=n_gen[1],
                                       world=params["world"])
    train, heldout, stats = draw_problems(train_pool, test_pool, params["n_train"], params["n_heldout"],
                                          params["data_seed"])
    for record in train + heldout:  # the seat prompts' style travels with the problems to every stage
        record["prompt_style"] = params["prompt"]
    stats["params"] = params
    write_jsonl(out_train, train)
    write_jsonl(out_heldout, heldout)
    write_json(out_stats, stats)
    log.info("split: %d train, %d held-out (eligible %d / %d)", len(train), len(heldout),
             stats["train"]["eligible"], stats["heldout"]["eligible"])
    return stats


def warmstart_stage(params: dict, problems: str, out_model: str, out_stats: str) -> dict:
    """Warm-start the base model on the train problems' ideal dialogues; write the model dir and its statistics."""
    from talkmethods.warmstart import WarmStartConfig, warm_start

    stats = warm_start(WarmStartConfig(**params), read_jsonl(problems), out_model)
    write_json(out_stats, stats)
    log.info("warm start: loss %s -> %s in %.0f s", stats["loss_first"], stats["loss_last"], stats["wall_s"])
    return stats


def train_config(params: dict):
    """TrainConfig from a rule's plain ``params``."""
    from talkmethods.training.build import TrainConfig

    p = dict(params)
    p["model"] = ModelSpec(**p["model"])
    p["sampling"] = Sampling(**p["sampling"])
    return TrainConfig(**p)


def train_stage(params: dict, problems: str, adapter_dir: str, log_path: str, work_dir: str) -> dict:
    """Train one (arm, seed) run, resuming from ``work_dir`` if it holds a checkpoint."""
    from talkmethods.training.build import train_run

    cfg = train_config(params)
    return train_run(cfg, read_jsonl(problems), Path(adapter_dir), Path(log_path), Path(work_dir))


def eval_stage(params: dict, kind: str, problems: str, adapter_dir: str | None, out: str,
               arm: str | None = None, seed: int | None = None) -> dict:
    """Play the eval chats of ``kind`` on the held-out problems and write the eval JSON."""
    from talkmethods.evaluate import run_eval

    result = run_eval(
        kind, ModelSpec(**params["model"]), adapter_dir, read_jsonl(problems), Sampling(**params["sampling"]),
        params["chats_per_problem"], params["batch_chats"], params["sample_dialogues"], params["eval_seed"],
        params.get("precision", "auto"), arm=arm, train_seed=seed, engine=params.get("engine", "fast"),
    )
    write_json(out, result)
    log.info("%s %s seed %s: team accuracy %.3f", kind, arm, seed, result["metrics"]["team_accuracy"])
    return result
