"""Command line: every stage runs on its own, outside Snakemake.

    python -m talkmethods split    --config config.yaml [--config offline.yaml] [--results results]
    python -m talkmethods warmstart --config ...   (configs with model.warmstart)
    python -m talkmethods train    --config ... --arm raft --seed 17
    python -m talkmethods train    --config config.yaml --config cohort.yaml --arm raft   # the arm's seeds as one cohort
    python -m talkmethods eval     --config ... --kind eval|crossplay|crossplay_bA|base|all [--arm --seed]
                                   (all: the run's three kinds in one process, as eval.one_job_per_run)
    python -m talkmethods selftest [--out results/selftest.json]

Bad config, bad data or a missing model end with one line naming the cause, not a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from talkmethods.atomic import write_json
from talkmethods.errors import friendly_errors
from talkmethods.recipe import RUN_EVAL_KINDS


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="talkmethods", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    for name in ("split", "warmstart", "train", "eval"):
        p = sub.add_parser(name)
        p.add_argument("--config", action="append", default=None, help="config files; later ones override")
        p.add_argument("--results", default="results")
        if name in ("train", "eval"):
            p.add_argument("--arm")
            p.add_argument("--seed", type=int)
        if name == "eval":
            p.add_argument("--kind", default="eval", choices=[*RUN_EVAL_KINDS, "base", "all"])
    p = sub.add_parser("selftest")
    p.add_argument("--out", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    with friendly_errors():
        return _run(args)


def _run(args) -> int:
    from talkmethods import config as C

    if args.stage == "selftest":
        from talkmethods.selftest import run_selftest

        report = run_selftest()
        if args.out:
            write_json(args.out, report)
        for c in report["checks"]:
            sys.stdout.write(f"{'ok    ' if c['passed'] else 'FAILED'} {c['name']:7s} {c['detail']}\n")
        return 0 if report["passed"] else 1
    cfg = C.load_config(args.config or ["config.yaml"])
    r = Path(args.results)
    if args.stage == "split":
        from talkmethods.split import split_stage

        split_stage(C.split_params(cfg), r / "data/train.jsonl", r / "data/heldout.jsonl", r / "data/split_stats.json")
        return 0
    if args.stage == "warmstart":
        params = C.warmstart_params(cfg)
        if params is None:
            raise C.ConfigError("config: model.warmstart is null: this config has no warm start to run")
        _exists(r / "data/train.jsonl", "run `python -m talkmethods split` with the same --config and --results first")
        from talkmethods.warmstart import warmstart_stage

        warmstart_stage(params, r / "data/train.jsonl", r / C.WARMSTART_MODEL, r / "warmstart/stats.json")
        return 0
    warm = "run `python -m talkmethods warmstart` with the same --config and --results first"
    if args.stage == "train":
        _need(args, "arm")
        cohort = C.trains_as_cohort(cfg, args.arm)  # the arm may be one the config's arms leave out
        _need(args, *([] if cohort else ["seed"]))
        if cohort and args.seed is not None:
            raise C.ConfigError(f"train.cohort trains every seed of {args.arm} as one cohort: leave --seed out")
        _exists(r / "data/train.jsonl", "run `python -m talkmethods split` with the same --config and --results first")
        if cfg["model"]["warmstart"]:
            _exists(r / C.WARMSTART_MODEL, warm)
        ckpt = Path(cfg["checkpoint_dir"]) / args.arm
        if cohort:  # an arm's seeds in one process (training.cohort)
            from talkmethods.training.cohort import train_cohort_stage

            seeds = cfg["seeds"]
            train_cohort_stage(
                [C.train_params(cfg, args.arm, s, str(r)) for s in seeds],
                r / "data/train.jsonl",
                [r / args.arm / f"seed{s}" / "adapter" for s in seeds],
                [r / args.arm / f"seed{s}" / "train_log.jsonl" for s in seeds],
                [ckpt / f"seed{s}" for s in seeds],
            )
            return 0
        run = r / args.arm / f"seed{args.seed}"
        from talkmethods.training.build import train_stage

        train_stage(
            C.train_params(cfg, args.arm, args.seed, str(r)),
            r / "data/train.jsonl",
            run / "adapter",
            run / "train_log.jsonl",
            ckpt / f"seed{args.seed}",
        )
        return 0
    _exists(r / "data/heldout.jsonl", "run `python -m talkmethods split` with the same --config and --results first")
    if cfg["model"]["warmstart"]:
        _exists(r / C.WARMSTART_MODEL, warm)
    from talkmethods.evaluate import eval_stage, eval_stages

    if args.kind == "base":
        eval_stage(C.eval_params(cfg, str(r)), "base", r / "data/heldout.jsonl", None, r / "base/eval.json")
        return 0
    _need(args, "arm", "seed")
    run = r / args.arm / f"seed{args.seed}"
    _exists(run / "adapter", f"train it first: `python -m talkmethods train --arm {args.arm} --seed {args.seed}`")
    kinds = list(RUN_EVAL_KINDS) if args.kind == "all" else [args.kind]
    eval_stages(
        C.eval_params(cfg, str(r)),
        kinds,
        r / "data/heldout.jsonl",
        str(run / "adapter"),
        [run / f"{kind}.json" for kind in kinds],
        arm=args.arm,
        seed=args.seed,
    )
    return 0


def _need(args, *names):
    missing = [n for n in names if getattr(args, n) is None]
    if missing:
        raise SystemExit(f"talkmethods {args.stage}: missing --{' --'.join(missing)}")
    if "arm" in names:
        from talkmethods.config import ConfigError, schema

        allowed = schema()["properties"]["arms"]["items"]["enum"]
        if args.arm not in allowed:
            raise ConfigError(f"--arm {args.arm!r} is not valid; allowed: {', '.join(allowed)}")
    if "seed" in names and args.seed < 0:
        from talkmethods.config import ConfigError

        raise ConfigError(f"--seed {args.seed} is not valid; expected an integer >= 0 (as in seeds)")


def _exists(path: Path, hint: str) -> None:
    """An input another stage writes: say which stage to run instead of a FileNotFoundError traceback."""
    if not path.exists():
        from talkmethods.problems import DataError

        raise DataError(f"{path}: not found; {hint}")


if __name__ == "__main__":
    sys.exit(main())
