"""Runs sharing one GPU: K training runs at once, as K processes, with and without CUDA MPS.

Each run is a real recipe run (TalkTrainer on the fast engine, random weights in the model's
architecture, every turn at full length) in its own process, as Snakemake starts them. A run's decode
at batch 32 leaves most of the chip idle while its training step is compute-bound, so K runs might
overlap one's decode with another's training. Without MPS the GPU time-slices processes (kernels of
two processes never run at once); with MPS (``nvidia-cuda-mps-control -d``, a user-space daemon: no
setting of the card changes) their kernels can. What counts is the throughput of all runs together:
steps a second, summed over the runs, in the window where every run is past its warm-up and none has
finished. Prints a table and writes ``share.json``.

    python bench/share.py --out results/share                       # K = 1, 2, 3 (CUDA GPU)
    python bench/share.py --out /tmp/s --quick --plan 1,2           # the same code, tiny, on a CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

log = logging.getLogger("share")
WARMUP_STEPS = 2  # a run's first steps pay compile, graph capture and the allocator's growth


def worker(args) -> None:
    """One training run; writes each step's end time (wall clock, shared by all runs) and peak memory."""
    import torch
    from transformers import TrainerCallback

    from talkmethods.engines import ENGINES
    from talkmethods.models import ModelSpec
    from talkmethods.training.build import build_trainer

    sys.path.insert(0, str(REPO / "bench"))
    import speed

    t_start = time.time()
    spec = ModelSpec(args.model)
    problems, _ = speed.bench_problems()  # the speed bench's own
    bench_args = argparse.Namespace(
        turn_tokens=args.turn_tokens,
        micro_batches=args.micro_batches,
        lora_r=args.lora_r,
        problems_per_step=args.problems_per_step,
        ada_draw_ahead=True,
        pack_seats=True,
    )
    cfg = speed._train_config(args.arm, spec, bench_args, steps=args.steps)
    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.time())

    work = Path(tempfile.mkdtemp(prefix="talkmethods-share-"))
    trainer = build_trainer(cfg, problems, work, callbacks=[StepEnds()], generator_factory=ENGINES["fast"])
    t_built = time.time()
    trainer.train()
    cuda = torch.cuda.is_available()
    out = {
        "arm": args.arm,
        "liger": trainer.liger,
        "micro_batches": cfg.micro_batches,
        "start": t_start,
        "built": t_built,
        "step_ends": ends,
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1) if cuda else None,
    }
    Path(args.result).write_text(json.dumps(out))
    shutil.rmtree(work, ignore_errors=True)


def _mps(start: bool, env: dict) -> str | None:
    """Start or stop the MPS control daemon for this bench's pipe directory; an error string if it can't."""
    exe = shutil.which("nvidia-cuda-mps-control") or shutil.which(
        "nvidia-cuda-mps-control", path="/usr/local/nvidia/bin:/usr/bin:/usr/local/cuda/bin"
    )
    if exe is None:
        return "nvidia-cuda-mps-control not found"
    if start:
        for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            Path(env[key]).mkdir(parents=True, exist_ok=True)
        r = subprocess.run([exe, "-d"], env=env, capture_output=True, text=True)
        time.sleep(1.0)
    else:
        r = subprocess.run([exe], input="quit\n", env=env, capture_output=True, text=True)
        time.sleep(1.0)
    return None if r.returncode == 0 else f"rc {r.returncode}: {r.stderr.strip()[:500]}"


def throughput(results: list[dict]) -> dict:
    """Steps a second summed over the runs, in the window where all are warm and none has finished."""
    lo = max(r["step_ends"][WARMUP_STEPS - 1] for r in results)
    hi = min(r["step_ends"][-1] for r in results)
    per_run = []
    for r in results:
        t = r["step_ends"][WARMUP_STEPS - 1 :]
        per_run.append(round(sum(b - a for a, b in zip(t, t[1:], strict=False)) / max(len(t) - 1, 1), 2))
    if hi <= lo:
        return {"overlap_s": 0.0, "steps_per_s": None, "step_s_per_run": per_run}
    n = sum(sum(1 for t in r["step_ends"] if lo < t <= hi) for r in results)
    return {
        "overlap_s": round(hi - lo, 1),
        "steps": n,
        "steps_per_s": round(n / (hi - lo), 4),
        "step_s_per_run": per_run,
    }


def run_config(k: int, mps: bool, args, out: Path) -> dict:
    """K runs started together (with MPS if asked); their throughput and memory."""
    env = dict(os.environ)
    row = {"runs": k, "mps": mps, "arm": args.arm}
    if mps:
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(out / "mps_pipe")
        env["CUDA_MPS_LOG_DIRECTORY"] = str(out / "mps_log")
        err = _mps(True, env)
        if err:
            return {**row, "error": f"MPS: {err}"}
    try:
        procs, files = [], []
        for i in range(k):
            f = out / f"k{k}_{'mps' if mps else 'plain'}_{i}.json"
            f.unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--worker", "--result", str(f)] + _passthrough(args)
            logf = open(out / f"{f.stem}.log", "w")  # noqa: SIM115 (closed below)
            procs.append((subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT), logf))
            files.append(f)
        rcs = []
        for p, logf in procs:
            rcs.append(p.wait())
            logf.close()
    finally:
        if mps:
            _mps(False, env)
    if any(rcs):
        tail = (out / f"{files[rcs.index(next(r for r in rcs if r))].stem}.log").read_text()[-1500:]
        return {**row, "error": f"worker exit codes {rcs}: {tail}"}
    results = [json.loads(f.read_text()) for f in files]
    return {
        **row,
        **throughput(results),
        "liger": results[0]["liger"],
        "micro_batches": results[0]["micro_batches"],
        "peak_allocated_gib": [r["peak_allocated_gib"] for r in results],
        "peak_reserved_gib": [r["peak_reserved_gib"] for r in results],
        "start_to_first_step_s": [round(r["step_ends"][0] - r["start"], 1) for r in results],
    }


def _passthrough(args) -> list[str]:
    return [
        "--model",
        args.model,
        "--arm",
        args.arm,
        "--steps",
        str(args.steps),
        "--micro-batches",
        str(args.micro_batches),
        "--turn-tokens",
        str(args.turn_tokens),
        "--lora-r",
        str(args.lora_r),
        "--problems-per-step",
        str(args.problems_per_step),
    ]


def table(res: dict) -> str:
    lines = [
        f"runs sharing one GPU: {res['device']}; {res['settings']['arm']}, {res['settings']['steps']} steps a run, "
        f"{res['settings']['micro_batches']} micro-batches, turns of {res['settings']['turn_tokens']} tokens; "
        f"throughput over the window where every run is past its first {WARMUP_STEPS} steps and none has finished",
        "",
        "| runs | MPS | training forward | steps/s, all runs | vs one run | s a step, each run | peak GiB each (allocated / reserved) | overlap s |",
        "|---:|---|---|---:|---:|---|---|---:|",
    ]
    one = next((r.get("steps_per_s") for r in res["rows"] if r["runs"] == 1 and r.get("steps_per_s")), None)
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['runs']} | {'yes' if r['mps'] else 'no'} | | failed: {r['error'][:300]} | | | | |")
            continue
        sps = r["steps_per_s"]
        gain = f"{sps / one:.2f}×" if sps and one else "—"
        mem = ", ".join(f"{a} / {b}" for a, b in zip(r["peak_allocated_gib"], r["peak_reserved_gib"], strict=True))
        lines.append(
            f"| {r['runs']} | {'yes' if r['mps'] else 'no'} | {'Liger' if r['liger'] else 'eager'} | "
            f"{sps if sps else '—'} | {gain} | "
            f"{', '.join(map(str, r['step_s_per_run']))} | {mem} | {r['overlap_s']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/share")
    ap.add_argument("--model", default="random:qwen2.5-1.5b")
    ap.add_argument("--arm", default="grpo")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--micro-batches", type=int, default=8, help="8: three runs' peaks fit one 141 GB GPU")
    ap.add_argument("--turn-tokens", type=int, default=None)
    ap.add_argument("--lora-r", type=int, default=None)
    ap.add_argument("--problems-per-step", type=int, default=None)
    ap.add_argument(
        "--plan",
        default="1,2m,3m,2",
        help="comma-separated configurations: K runs at once, 'm' for under MPS (default 1,2m,3m,2)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the offline model: checks the code path")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    q = args.quick
    if q and args.model == "random:qwen2.5-1.5b":
        args.model = "offline-tiny-qwen2"
    args.steps = args.steps or (4 if q else 8)
    args.turn_tokens = args.turn_tokens or (8 if q else 256)
    args.lora_r = args.lora_r or (4 if q else 32)
    args.problems_per_step = args.problems_per_step or (2 if q else 8)
    if q:
        args.micro_batches = 1
    if args.steps <= WARMUP_STEPS:
        ap.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps (got {args.steps})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.worker:
        worker(args)
        return

    import platform

    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.machine()})"
    res = {
        "device": device,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "result")},
        "rows": [],
    }
    for item in args.plan.split(","):
        k, mps = int(item.rstrip("m")), item.endswith("m")
        t0 = time.time()
        row = run_config(k, mps, args, out)
        row["wall_s"] = round(time.time() - t0, 1)
        log.info("%s", row)
        res["rows"].append(row)
        (out / "share.json").write_text(json.dumps(res, indent=1))
    print(table(res))
    (out / "share.md").write_text(table(res) + "\n")
    if any("error" in r and not r["mps"] for r in res["rows"]):
        sys.exit("share: a configuration without MPS failed (see share.json)")


if __name__ == "__main__":
    main()
