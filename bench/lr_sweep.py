"""LoRA learning-rate sweep for one arm on a config's world (what world-gpu.yaml's rate was chosen from).

    python bench/lr_sweep.py --config config.yaml --config world-gpu.yaml --lr 3e-4 1e-3 2e-3 --steps 150

Needs the config's split and warm start already made (``snakemake --configfile world-gpu.yaml
results/base/eval.json``). Trains one run per rate (in parallel processes; on a GPU they share it),
evaluates each adapter on the held-out problems, and prints a table: rate, training reward over the
first and last fifth of the steps, held-out team accuracy, policy entropy and tokens per turn.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(args) -> None:
    """Train and evaluate one rate (a child process)."""
    from talkmethods import config as C
    from talkmethods.evaluate import eval_stage, train_stage

    cfg = C.load_config(args.config)
    params = C.train_params(cfg, args.arm, 17)
    params.update(steps=args.steps, learning_rate=args.one, save_every=10**6)
    out = Path(args.out) / f"lr{args.one:g}"
    train_stage(
        params, "results/data/train.jsonl", str(out / "adapter"), str(out / "train_log.jsonl"), str(out / "ck")
    )
    eval_stage(
        C.eval_params(cfg),
        "eval",
        "results/data/heldout.jsonl",
        str(out / "adapter"),
        str(out / "eval.json"),
        arm=args.arm,
        seed=17,
    )


def summarise(out: Path, rates: list[float]) -> str:
    rows = [
        "| lr | reward, first fifth | reward, last fifth | held-out team accuracy | entropy first → last | tokens / turn last |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for lr in rates:
        d = out / f"lr{lr:g}"
        try:
            log = [json.loads(x) for x in (d / "train_log.jsonl").read_text().splitlines()]
            acc = json.loads((d / "eval.json").read_text())["metrics"]["team_accuracy"]
        except (OSError, ValueError, KeyError):
            rows.append(f"| {lr:g} | failed | | | | |")
            continue
        k = max(len(log) // 5, 1)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        rows.append(
            f"| {lr:g} | {mean([x['reward'] for x in log[:k]]):.3f} | {mean([x['reward'] for x in log[-k:]]):.3f} "
            f"| {acc:.3f} | {log[0]['entropy']:.2f} → {log[-1]['entropy']:.2f} | {log[-1]['tokens_per_turn']:.1f} |"
        )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--lr", type=float, nargs="+", default=[3e-4, 1e-3, 2e-3])
    ap.add_argument("--arm", default="grpo")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default="results/lr_sweep")
    ap.add_argument("--one", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        one(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for lr in args.lr:
        cmd = [
            sys.executable,
            __file__,
            *sum((["--config", c] for c in args.config), []),
            "--arm",
            args.arm,
            "--steps",
            str(args.steps),
            "--out",
            str(out),
            "--one",
            str(lr),
        ]
        log = open(out / f"lr{lr:g}.log", "w")
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                },
            )
        )
    for p in procs:
        p.wait()
    table = summarise(out, args.lr)
    (out / "sweep.md").write_text(table + "\n")
    sys.stdout.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
