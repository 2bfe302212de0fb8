"""Zero-advantage rows left out, checked on a device: two GRPO steps, the second with every group solved.

    python bench/zero_rows_check.py [random:qwen2.5-1.5b | offline-tiny-qwen2]

The second step leaves every row out, so its loss runs empty micro-batches only (on a GPU: bf16, Liger,
right-aligned rows, as a run). Runs the two steps with rows left out and with every row in, and prints
each step's loss, grad norm and rows, and how far apart step 1's gradient and the adapter's change over
each step are (relative norm): step 1 differs by floating-point order only, step 2 is Adam's momentum on
zero gradients. Leaving rows out regroups the micro-batches, so the yardstick is a third run with every
row in at twice the micro-batches (the same update, another reduction order): the noise floor. On
this 2-core CPU with the tiny model: 1.2e-5 and 1.1e-5 (2026-12-07).
"""

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import TrainerCallback

from talkmethods.config import load_config, train_params
from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec
from talkmethods.recipe import TrainConfig
from talkmethods.training.build import build_trainer
from talkmethods.training.runs import StepLog

MODEL = sys.argv[1] if len(sys.argv) > 1 else "random:qwen2.5-1.5b"
problems = [
    {
        "id": f"p{i}",
        "facts_a": [f"Zorblax has {17 + i} pebbles.", f"Zorblax keeps them in {3 + i} jars."],
        "facts_b": [f"Quimby has {29 + i} pebbles.", f"Quimby found them near {5 + i} rivers."],
        "shared_question": "How many pebbles do Zorblax and Quimby have together?",
        "gold": str(46 + 2 * i),
    }
    for i in range(8)
]


def run(skip: bool, root: Path, micro_batches: int = 4):
    state = {"step": 0, "w": [], "g": []}

    def judge(turn, problem):
        return True if state["step"] else bool(turn.completion_ids) and turn.completion_ids[0] % 2 == 0

    class Snap(TrainerCallback):
        def on_pre_optimizer_step(self, _a, _s, control, model=None, **k):
            grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
            state["g"].append({n: (g.detach().float().clone() if g is not None else None) for n, g in grads.items()})

        def on_step_end(self, _a, _s, control, model=None, **k):
            state["step"] += 1
            state["w"].append({n: p.detach().float().clone() for n, p in model.named_parameters() if "lora_" in n})

    base = TrainConfig.from_params(train_params(load_config(["config.yaml"]), "grpo", 17))
    cfg = dataclasses.replace(
        base,
        model=ModelSpec(MODEL),
        steps=2,
        problems_per_step=8,
        micro_batches=micro_batches,
        sampling=Sampling(max_new_tokens=16),
        save_every=1000,
        pack_seats=True,
    )
    work = root / f"{'on' if skip else 'off'}-{micro_batches}"
    log_path = work / "steps.jsonl"
    work.mkdir(parents=True)
    trainer = build_trainer(cfg, problems, work, judge=judge, callbacks=[Snap(), StepLog(log_path)])
    trainer.skip_zero_advantage = skip
    before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    logs = [json.loads(x) for x in log_path.read_text().splitlines()]
    w1, w2 = state["w"]
    grad1 = {n: g for n, g in state["g"][0].items() if g is not None}
    return logs, {n: w1[n] - before[n] for n in w1}, {n: w2[n] - w1[n] for n in w1}, grad1


def rel(a, b):
    num = sum(float((a[n] - b[n]).norm() ** 2) for n in b) ** 0.5
    den = sum(float(b[n].norm() ** 2) for n in b) ** 0.5
    return num / den


with tempfile.TemporaryDirectory() as tmp:
    on = run(True, Path(tmp))
    off = run(False, Path(tmp))
    floor = run(False, Path(tmp), micro_batches=8)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "model", MODEL)
for name, (logs, *_) in (("left out", on), ("every row", off), ("every row, 8 micro-batches", floor)):
    for x in logs:
        print(name, {k: x.get(k) for k in ("step", "loss", "grad_norm", "loss_rows", "skipped_rows", "train_s")})
print("relative to every row at 4 micro-batches:  left out | every row at 8 (noise floor)")
for what, i in (("step 1 gradient", 3), ("step 1 change", 1), ("step 2 change (Adam momentum only)", 2)):
    print(f"  {what}: {rel(on[i], off[i]):.3e} | {rel(floor[i], off[i]):.3e}")
print("step 2 change size", f"{sum(float(v.norm() ** 2) for v in on[2].values()) ** 0.5:.3e}")
