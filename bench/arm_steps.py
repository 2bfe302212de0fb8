"""Run a few real training steps of every arm on the Qwen2.5-1.5B architecture with random weights.

The weights are random (the hub is out of reach), so the text is noise and every reward is 0: every
problem is uniform, and Reinforce-Ada replays every problem to its limit (16 chats per problem):
the worst case of its generation cost. Turn length is fixed by max_new_tokens since random weights
rarely emit an end-of-turn token. Writes a JSON per arm and prints a table.

    python bench/arm_steps.py --steps 2 --max-new-tokens 128 --out bench_out/
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default="grpo,ada,raft,mixed")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--model", default="random:qwen2.5-1.5b")
    ap.add_argument("--engine", default="loop")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from talkmethods.engine import ENGINES
    from talkmethods.models import ModelSpec
    from talkmethods.problems import load_gsm8k
    from talkmethods.rollout import Sampling
    from talkmethods.split import draw_problems
    from talkmethods.trainer import StepLog, TrainConfig, build_trainer

    train_pool, test_pool = load_gsm8k("generated", seed=0, n_generated_train=64, n_generated_test=16)
    problems, _, _ = draw_problems(train_pool, test_pool, 32, 4, data_seed=0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for arm in args.arms.split(","):
        cfg = TrainConfig(arm=arm, seed=17, model=ModelSpec(args.model), steps=args.steps,
                          sampling=Sampling(max_new_tokens=args.max_new_tokens), save_every=10_000, engine=args.engine,
                          micro_batches=args.micro_batches)
        log_path = out / f"{arm}_train_log.jsonl"
        log_path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        trainer = build_trainer(cfg, problems, out / f"work_{arm}", callbacks=[StepLog(log_path)],
                                generator_factory=ENGINES[args.engine])
        build_s = time.perf_counter() - t0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        steps = [json.loads(x) for x in log_path.read_text().splitlines()]
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        for s in steps:
            rows.append({"arm": arm, "step": s["step"], "chats": s["chats_drawn"], "rows": s["rows"],
                         "gen_s": round(s["gen_s"], 2), "train_s": round(s["train_s"], 2),
                         "tokens_per_turn": s["tokens_per_turn"], "peak_gib": round(peak, 1) if peak else None,
                         "build_s": round(build_s, 1)})
        (out / "arm_steps.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    (out / "arm_steps.json").write_text(json.dumps({"device": device, "args": vars(args), "rows": rows}, indent=1))
    print(f"device: {device}; model {args.model}; max_new_tokens {args.max_new_tokens}; engine {args.engine}")
    print(f"{'arm':8s} {'step':>4s} {'chats':>5s} {'rows':>5s} {'tok/turn':>8s} {'gen_s':>7s} {'train_s':>7s} {'peak GiB':>8s}")
    for r in rows:
        print(f"{r['arm']:8s} {r['step']:4d} {r['chats']:5.0f} {r['rows']:5.0f} {r['tokens_per_turn']:8.1f} "
              f"{r['gen_s']:7.2f} {r['train_s']:7.2f} {str(r['peak_gib']):>8s}")


if __name__ == "__main__":
    main()
