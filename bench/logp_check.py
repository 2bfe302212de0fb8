"""Calibrate the rollout-vs-trainer log-prob check on a trained model: fresh rollouts against stale ones.

    python bench/logp_check.py --config config.yaml --config world-gpu.yaml --steps 30

Needs the config's split and warm start (``snakemake --configfile world-gpu.yaml results/warmstart/stats.json``).
Trains the same GRPO run twice: once as the pipeline does (the rollout engine refreshes its weights
after every optimizer step) and once with a stale engine that keeps the weights of step 0, so its
rollouts come from an adapter k steps old. Prints per step the mean and max |log-prob gap| and the KL
estimate of each; the warning threshold (``training.trainer.KL_TOLERANCE``) sits between the two.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def run(config: list[str], steps: int, stale: bool, out: Path) -> list[dict]:
    import talkmethods.engines as E
    from talkmethods import config as C
    from talkmethods.training.build import train_stage

    if stale:
        fast = E.ENGINES["fast"]

        def frozen(model, tok):
            gen = fast(model, tok)
            sync, calls = gen.sync_weights, []

            def sync_once():  # the first refresh (before step 1) only: later rollouts use step-0 weights
                if not calls:
                    calls.append(1)
                    sync()

            gen.sync_weights = sync_once
            return gen

        E.ENGINES["fast"] = frozen
    cfg = C.load_config(config)
    params = C.train_params(cfg, "grpo", 17)
    params.update(steps=steps, save_every=10**6)
    tag = out / ("stale" if stale else "fresh")
    train_stage(
        params, "results/data/train.jsonl", str(tag / "adapter"), str(tag / "train_log.jsonl"), str(tag / "ck")
    )
    return [json.loads(x) for x in (tag / "train_log.jsonl").read_text().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stale", action="store_true")
    ap.add_argument("--out", default="results/logp_check")
    args = ap.parse_args()
    logs = run(args.config, args.steps, args.stale, Path(args.out))
    sys.stdout.write(f"{'stale' if args.stale else 'fresh'}: step, mean |gap|, max |gap|, KL estimate\n")
    for row in logs:
        sys.stdout.write(
            f"{row['step']:4d} {row['logp_diff_mean']:.2e} {row['logp_diff_max']:.2e} {row['logp_kl']:.2e}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
