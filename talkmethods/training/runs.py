"""One run's files: the step log, the run key, and which checkpoint a (re)started run resumes from."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import TrainerCallback

from talkmethods.atomic import write_json, write_text

if TYPE_CHECKING:
    from talkmethods.recipe import TrainConfig

log = logging.getLogger(__name__)


class StepLog(TrainerCallback):
    """Writes one JSON line per optimizer step (and one log line) to ``path``."""

    KEYS = {
        "talk/reward": "reward",
        "talk/both_right": "both_right",
        "talk/chats_drawn": "chats_drawn",
        "talk/chats_generated": "chats_generated",
        "talk/zero_adv_share": "zero_adv_share",
        "talk/tokens_per_turn": "tokens_per_turn",
        "entropy": "entropy",
        "loss": "loss",
        "grad_norm": "grad_norm",
        "talk/rows": "rows",
        "talk/loss_rows": "loss_rows",
        "talk/skipped_rows": "skipped_rows",
        "talk/longest_prompt": "longest_prompt",
        "timing/gen_s": "gen_s",
        "talk/logp_diff_max": "logp_diff_max",
        "talk/logp_diff_mean": "logp_diff_mean",
        "talk/logp_kl": "logp_kl",
        "talk/loss_tokens": "loss_tokens",
        "talk/loss_tokens_padded": "loss_tokens_padded",
    }

    def __init__(self, path: Path):
        self.path = path
        self._t0 = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "talk/reward" not in logs:
            return
        line = {"step": state.global_step}
        line.update({short: logs.get(key) for key, short in self.KEYS.items()})
        line["train_s"] = max(time.perf_counter() - self._t0 - (line["gen_s"] or 0.0), 0.0)
        with open(self.path, "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
        log.info(
            "step %d reward %.3f chats %d gen %.1fs train %.1fs",
            line["step"],
            line["reward"],
            line["chats_drawn"],
            line["gen_s"],
            line["train_s"],
        )


def truncate_log(path: Path, last_step: int) -> None:
    """Keep the log lines of steps <= last_step (a resumed run rewrites the steps after its checkpoint).

    A line cut short by a kill is dropped (it belongs to a step after the checkpoint); the rewrite is atomic.
    """
    if not path.exists():
        return
    keep = []
    for ln in path.read_text().splitlines():
        try:
            if json.loads(ln)["step"] <= last_step:
                keep.append(ln)
        except (ValueError, KeyError, TypeError):
            continue
    write_text(path, "".join(k + "\n" for k in keep))


RUN_KEY = "run_key.json"  # in the work dir: which config and problems its checkpoints belong to


def run_key(cfg: TrainConfig, problems: list[dict]) -> dict:
    """What a checkpoint is only valid for: the whole TrainConfig and the exact problems."""
    blob = json.dumps(problems, sort_keys=True, ensure_ascii=False).encode()
    return json.loads(
        json.dumps({"config": jsonable(asdict(cfg)), "problems_sha256": hashlib.sha256(blob).hexdigest()})
    )


def checkpoint_step(path: Path) -> int | None:
    m = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(m[1]) if m and path.is_dir() else None


def _complete(ckpt: Path) -> bool:
    """Trainer._save_checkpoint writes trainer_state.json last: without a whole one, a kill cut the save."""
    try:
        return json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == checkpoint_step(ckpt)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def last_checkpoint(work_dir: Path, key: dict) -> Path | None:
    """The newest complete checkpoint in ``work_dir`` made for ``key``, or None (start afresh).

    Checkpoints cut by a kill mid-save are deleted. Checkpoints of another config or other problems
    (``run_key.json`` differs or is missing) are deleted with the live log, so an edited recipe
    never resumes from a stale run. ``key`` is then recorded for this run.
    """
    ckpts = sorted((s, p) for p in work_dir.glob("checkpoint-*") if (s := checkpoint_step(p)) is not None)
    key_path = work_dir / RUN_KEY
    try:
        same_run = json.loads(key_path.read_text()) == key
    except (OSError, ValueError):
        same_run = False
    if ckpts and not same_run:
        log.warning("%s holds checkpoints of another config or other problems: starting afresh", work_dir)
        for _, p in ckpts:
            shutil.rmtree(p)
        (work_dir / "train_log.jsonl").unlink(missing_ok=True)
        ckpts = []
    write_json(key_path, key)
    last = None
    for _, p in reversed(ckpts):
        if last is None and _complete(p):
            last = p
        elif not _complete(p):
            log.warning("deleting %s: cut short by a kill while it was being saved", p)
            shutil.rmtree(p)
    return last


def jsonable(obj):
    """``obj`` with tuples as lists and non-finite floats as None (JSON has neither)."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
