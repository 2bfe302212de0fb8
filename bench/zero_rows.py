"""Zero-advantage rows left out of the loss (``training.rows.live_rows``) against every row run, on a model that learns.

    python bench/zero_rows.py --config config.yaml --config offline.yaml --results demo/results --steps 20

Needs the config's split and warm start (``make demo`` leaves them in ``demo/results``; or
``python -m talkmethods split`` and ``warmstart`` with the same configs). Trains each arm's seed-17
run twice as the train stage does: first with the zero-advantage rows left out (the trainer's
default), then with every row in the loss (the share and speed benches' setting, since random
weights score 0 everywhere). The update is the same either way (tests/test_trainer.py); the runs
drift apart after their first step only by floating-point order, so each is summarised on its own.
Prints per arm and setting: the share of credited rows that had zero advantage, the rows the loss
ran a step, and the median seconds a step of generation and of the rest (the step log's gen_s and
train_s), with the device it ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path


def run(config: list[str], results: Path, arm: str, steps: int, skip: bool, out: Path) -> list[dict]:
    import talkmethods.training.trainer as talk_trainer
    from talkmethods import config as C
    from talkmethods.training.build import train_stage
    from talkmethods.training.rows import live_rows

    talk_trainer.live_rows = live_rows if skip else (lambda rows: (rows, 0))
    try:
        cfg = C.load_config(config)
        params = C.train_params(cfg, arm, 17, str(results))
        params.update(steps=steps, save_every=10**6)
        tag = out / f"{arm}_{'left_out' if skip else 'every_row'}"
        train_stage(
            params,
            str(results / "data/train.jsonl"),
            str(tag / "adapter"),
            str(tag / "train_log.jsonl"),
            str(tag / "ck"),
        )
    finally:
        talk_trainer.live_rows = live_rows
    return [json.loads(x) for x in (tag / "train_log.jsonl").read_text().splitlines()]


def summary(arm: str, skip: bool, logs: list[dict]) -> dict:
    credited = sum(x["loss_rows"] + x.get("skipped_rows", 0) for x in logs)
    return {
        "arm": arm,
        "rows": "left out" if skip else "every row",
        "steps": len(logs),
        "zero_rows_share": round(sum(x.get("skipped_rows", 0) for x in logs) / credited, 3) if skip else None,
        "loss_rows": round(statistics.mean(x["loss_rows"] for x in logs), 1),
        "gen_s": round(statistics.median(x["gen_s"] for x in logs), 3),
        "train_s": round(statistics.median(x["train_s"] for x in logs), 3),
        "reward": round(statistics.mean(x["reward"] for x in logs), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--results", default="results", help="where the config's split and warm start are")
    ap.add_argument("--arms", default="raft,grpo")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None, help="a JSON of the table (default: none)")
    args = ap.parse_args()
    results = Path(args.results)
    if not (results / "data/train.jsonl").exists():
        sys.stderr.write(f"no split under {results}: run the config's split and warm start first (see --help)\n")
        return 2
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory(prefix="talkmethods-zero-rows-") as tmp:
        for arm in args.arms.split(","):
            for skip in (True, False):  # the lever first: any warm-up in this process favours the every-row run
                rows.append(summary(arm, skip, run(args.config, results, arm, args.steps, skip, Path(tmp))))
    sys.stdout.write(f"zero-advantage rows, {args.steps} steps a run, seed 17, {device}, configs {args.config}\n\n")
    sys.stdout.write(
        "| arm | rows in the loss | zero-advantage share | loss rows a step | gen s (median) | train s (median) | mean reward |\n"
    )
    sys.stdout.write("|---|---|---:|---:|---:|---:|---:|\n")
    for r in rows:
        share = "" if r["zero_rows_share"] is None else f"{r['zero_rows_share']:.3f}"
        sys.stdout.write(
            f"| {r['arm']} | {r['rows']} | {share} | {r['loss_rows']} | {r['gen_s']} | {r['train_s']} | {r['reward']} |\n"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "steps": args.steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
