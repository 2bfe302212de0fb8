"""Runs sharing one GPU: K jobs at once, as K processes, with and without CUDA MPS.

Each job is a real recipe job in its own process, as Snakemake starts them: a training run of an arm
(TalkTrainer on the fast engine, random weights in the model's architecture, every turn at full
length) or an eval (600 chats of the held-out set on the eval sampling, repeated). A run's decode at
batch 32 leaves most of the chip idle while its training step is compute-bound, so K jobs might
overlap one's decode with another's training. Without MPS the GPU time-slices processes (kernels of
two processes never run at once); with MPS (``nvidia-cuda-mps-control -d``, a user-space daemon: no
setting of the card changes) their kernels can.

What counts is the work all jobs do together. A job's rate is one over its mean time between events
(a training step, an eval) past its warm-up; its **work** is that rate over the rate of the same job
alone on the GPU (a configuration of the plan). Summed over the jobs, that is how many GPUs' worth of
work the configuration does: the factor by which running its jobs together shortens the recipe. The
throughput in steps a second is summed over the window where every job is past its warm-up and none
has finished. Prints a table and writes ``share.json``.

    python bench/share.py --out results/share                                   # K grpo runs: 1, 2, 3 (CUDA GPU)
    python bench/share.py --plan ada,mixed,eval,m:grpo+ada+raft,m:mixed+eval+raft --seconds 150
    python bench/share.py --out /tmp/s --quick --plan 1,2                       # the same code, tiny, on a CPU

A plan item is ``K`` or ``Km`` (K runs of ``--arm``, ``m``: under MPS) or jobs joined by ``+``
(arms, ``eval``, ``eval-eager``: an eval with the engine's maths uncompiled, or ``rollout``: a training
step's chats without the step), with ``m:`` in front for MPS. ``--seconds`` runs every job of a configuration
until that many seconds after the configuration started (instead of ``--steps`` steps and
``--evals`` evals), so that jobs of different lengths overlap to the end.
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

import talkmethods  # noqa: E402, F401  (its allocator default: the workers inherit it, before torch)

log = logging.getLogger("share")
T_PROCESS = time.time()  # a worker's start, before torch and the project are imported
# a job's first events pay compile, graph capture and the allocator's growth
WARMUP = {"train": 2, "eval": 1, "rollout": 2}
ARMS = ("grpo", "ada", "raft", "mixed")
# an eval job's engine (eval.engine): eval-eager plays on fast-eager (the maths uncompiled, CUDA graphs kept),
# to show what torch.compile costs a fresh process's start against what it saves in the steady decode
EVALS = {"eval": "fast", "eval-eager": "fast-eager"}
# a training step's chats alone (8 problems x 4 chats, A B A B, the training sampling, the fast engine) and
# no training: under MPS, how much of K runs' decoding overlaps, apart from their training steps
ROLLOUT = "rollout"
# the three seeds of a cohort: each seed's step of chats on its own adapter, all in one engine call, as one
# batch per adapter's merged copy decoded together on their own streams (cohort-rollout), or as one batch
# over the base weights with the adapters' LoRA as batched products (cohort-stacked); an event is three
# seeds' rollouts. Values: (seeds, stacked)
ROLLOUTS = {ROLLOUT: (1, False), "cohort-rollout": (3, False), "cohort-stacked": (3, True)}
# an arm's three seeds trained as one cohort (train.cohort): an event is a step of all three
COHORTS = {f"cohort-{arm}": arm for arm in ARMS}
_PROFILE = None  # a worker's cProfile of its building (--profile-build)


def _kind(job: str) -> str:
    return "eval" if job in EVALS else ROLLOUT if job in ROLLOUTS else "train"


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.time() > deadline


class IdleSampler:
    """One event's host timeline: every ``period`` s, whether the GPU had work queued and where the main thread was.

    The GPU counts as idle when every stream the job decodes and trains on has finished its work
    (``Stream.query``): the step then waits on the host, and the main thread's stack says on what. The
    sampled event is run after the measured ones and is not counted in the job's rate. ``streams``
    returns the streams (none on a CPU: host time by place only)."""

    LIBRARIES = ("talkmethods/", "bench/", "trl/", "transformers/", "peft/", "accelerate/", "liger_kernel/")

    def __init__(self, streams, period: float = 0.002):
        import threading

        self.streams, self.period, self.main = streams, period, threading.get_ident()
        self.samples: list[tuple[bool | None, str, str]] = []
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = self.t1 = 0.0

    def _run(self) -> None:
        while not self._halt.wait(self.period):
            frame = sys._current_frames().get(self.main)
            # no query while the main thread captures a CUDA graph (a query from any thread invalidates it)
            streams = [] if self._capturing(frame) else self.streams()
            idle = all(s.query() for s in streams) if streams else None
            self.samples.append((idle, self._where(frame, ()), self._where(frame, self.LIBRARIES)))

    @staticmethod
    def _capturing(frame) -> bool:
        while frame is not None:
            if frame.f_code.co_filename.endswith("cuda/graphs.py") or frame.f_code.co_name == "_graph_for":
                return True
            frame = frame.f_back
        return False

    @staticmethod
    def _where(frame, places: tuple[str, ...]) -> str:
        """The innermost frame (in one of ``places``, if given) as ``package/file.py:function``."""
        while frame is not None:
            path = frame.f_code.co_filename
            hit = next((p for p in places if p in path), None) if places else ""
            if hit is not None:
                short = path[path.index(hit) :] if hit else "/".join(Path(path).parts[-2:])
                return f"{short}:{frame.f_code.co_name}"
            frame = frame.f_back
        return "?"

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self._thread.start()

    def stop(self) -> dict:
        self.t1 = time.perf_counter()
        self._halt.set()
        self._thread.join()
        n = max(len(self.samples), 1)
        per = (self.t1 - self.t0) / n  # seconds a sample stands for

        def top(rows, k: int = 15) -> list:
            acc: dict[str, float] = {}
            for key in rows:
                acc[key] = acc.get(key, 0.0) + per
            return [[key, round(v, 3)] for key, v in sorted(acc.items(), key=lambda kv: -kv[1])[:k]]

        idle = [s for s in self.samples if s[0]]
        known = any(s[0] is not None for s in self.samples)
        return {
            "wall_s": round(self.t1 - self.t0, 3),
            "samples": len(self.samples),
            "gpu_idle_s": round(len(idle) * per, 3) if known else None,
            "idle_by_place": top(s[2] for s in idle),
            "idle_by_frame": top(s[1] for s in idle),
            "host_by_place": top(s[2] for s in self.samples),
        }


def worker(args) -> None:
    """One job; writes each event's end time (wall clock, shared by all jobs) and peak memory."""
    if args.profile_build:  # where a job's building goes: the heaviest calls until its first event starts
        import cProfile

        global _PROFILE
        _PROFILE = cProfile.Profile()
        _PROFILE.enable()
    import torch

    speed = _speed()
    t_start = time.time()
    deadline = args.deadline
    ends: list[float] = []
    step_logs: dict[str, list[dict]] = {}  # a training job's train_log lines, by run
    cuda = torch.cuda.is_available()
    own_backward = 0  # a lone run's LoRA layers on patches.lora_own_backward (0 with --autograd-lora)
    groups = 0  # its LoRA groups on one node each (patches.lora_groups; 0 with --lora-ungrouped)

    def event():
        if cuda:
            torch.cuda.synchronize()
        ends.append(time.time())
        _profile_events(args, len(ends) - WARMUP[_kind(args.job)])

    if args.job in EVALS:
        from talkmethods.engines import ENGINES
        from talkmethods.evaluate import play_eval
        from talkmethods.models import ModelSpec, load_tokenizer, pick_device_and_dtype

        spec = ModelSpec(args.model)
        device, dtype = pick_device_and_dtype()
        tokenizer = load_tokenizer(spec)
        model, sampling, flat = speed.eval_setup(spec, device, dtype, args, speed.bench_problems()[1])
        t_built = time.time()
        _end_profile(args)
        liger = micro_batches = None  # training settings: an eval has neither
        engine = ENGINES[EVALS[args.job]]

        last: dict = {}

        def built(m, t):  # each eval builds its engine, as an eval job does; the last is kept
            last["engine"] = engine(m, t)
            return last["engine"]

        def one_eval(factory=built):
            play_eval(model, tokenizer, flat, "eval", sampling, speed.EVAL_CHATS_PER_PROBLEM, args.eval_chats, factory)

        while (len(ends) < args.evals) if deadline is None else (not _past(deadline) or len(ends) <= WARMUP["eval"]):
            one_eval()
            event()
        # the sampled eval reuses the last engine, its graphs captured: a stream query from the sampler's
        # thread during a capture would invalidate it (H100, 2026-12-06), so this eval captures nothing
        idle = _sampled(
            args,
            lambda: one_eval(lambda m, t: last["engine"]),
            lambda: _streams_of(last["engine"]),
        )
    elif args.job in ROLLOUTS:
        from talkmethods.engines.fast.generator import FastGenerator
        from talkmethods.models import ModelSpec, load_tokenizer, pick_device_and_dtype
        from talkmethods.rollout import play_chats

        spec = ModelSpec(args.model)
        device, dtype = pick_device_and_dtype()
        tokenizer = load_tokenizer(spec)
        problems = speed.bench_problems()[0]
        model, _, _ = speed.eval_setup(spec, device, dtype, args, problems)  # a LoRA that changes outputs
        seeds, stacked = ROLLOUTS[args.job]
        names = [True] + [speed.add_adapter(model, f"seed{k}", args.lora_r, k, 0.01) for k in range(1, seeds)]
        cfg = speed._train_config("grpo", spec, argparse.Namespace(**{**_bench_sizes(args), "micro_batches": 1}), 1)
        problems = problems[: cfg.problems_per_step]
        chats = [p for p in problems for _ in range(cfg.chats_per_problem)] * len(names)
        seats = [(name, name) for name in names for _ in range(len(chats) // len(names))]
        generator = FastGenerator(model, tokenizer, stack_adapters=stacked)
        t_built = time.time()
        _end_profile(args)
        liger = micro_batches = None

        def one_rollout():
            play_chats(generator, tokenizer, chats, seats, cfg.sampling)

        while (len(ends) < args.steps) if deadline is None else (not _past(deadline) or len(ends) <= WARMUP[ROLLOUT]):
            one_rollout()
            event()
        idle = _sampled(args, one_rollout, lambda: _streams_of(generator))
    else:
        from transformers import TrainerCallback

        from talkmethods.engines import ENGINES
        from talkmethods.models import ModelSpec
        from talkmethods.training.build import build_trainer

        spec = ModelSpec(args.model)
        problems, _ = speed.bench_problems()  # the speed bench's own
        bench_args = argparse.Namespace(**_bench_sizes(args))
        steps = args.steps + bool(args.idle_profile) if deadline is None else 10_000  # the deadline ends it
        cfg = speed._train_config(COHORTS.get(args.job, args.job), spec, bench_args, steps=steps)
        holder: dict = {}

        def streams():
            return _streams_of(getattr(holder.get("trainer"), "_generator", None))

        class StepEnds(TrainerCallback):
            def on_step_end(self, _args, state, control, **k):
                if "sampler" in holder:  # the sampled step (--idle-profile): not one of the job's events
                    if cuda:
                        torch.cuda.synchronize()
                    holder["idle"] = holder.pop("sampler").stop()
                    control.should_training_stop = True
                    return
                event()
                done = _past(deadline) if deadline is not None else len(ends) >= args.steps
                if done and len(ends) > WARMUP["train"]:
                    if args.idle_profile and "idle" not in holder:
                        holder["sampler"] = IdleSampler(streams)
                        holder["sampler"].start()
                    else:
                        control.should_training_stop = True

        class CohortStepEnds(TrainerCallback):
            """A cohort's event: its last seed's step end (the three seeds' steps done); all stop together."""

            def __init__(self, last: bool):
                self.last = last

            def on_step_end(self, _args, state, control, **k):
                if "own_backward" not in holder:  # the cohort's LoRA layers on their own backward (apply_patches)
                    model = k["model"]
                    holder["own_backward"] = sum(bool(m.__dict__.get("_own_backward")) for m in model.modules())
                    if args.lora_ungrouped:  # from the second step (the first is a warm-up, not an event)
                        from talkmethods.training.patches import lora_groups

                        lora_groups(model, on=False)
                    holder["groups"] = sum("_lora_group" in m.__dict__ for m in model.modules())
                if self.last and not holder.get("stop"):
                    event()
                    done = _past(deadline) if deadline is not None else len(ends) >= args.steps
                    holder["stop"] = done and len(ends) > WARMUP["train"]
                control.should_training_stop = bool(holder.get("stop"))

        # random weights score 0 everywhere, so every row's advantage is 0 and the trainer would leave them all
        # out of the loss (training.rows.live_rows): steps that train nothing. The bench trains every row, the
        # worst case (a learning model's groups with signal are fewer), as every round before.
        import talkmethods.training.trainer as talk_trainer

        talk_trainer.live_rows = lambda rows: (rows, 0)
        work = Path(tempfile.mkdtemp(prefix="talkmethods-share-"))
        if args.job in COHORTS:  # the three seeds in this process: train_cohort, its outputs in the scratch dir
            from dataclasses import replace

            from talkmethods.training.cohort import train_cohort

            seeds = (17, 18, 19)
            log_paths = [work / f"seed{s}" / "train_log.jsonl" for s in seeds]
            t_built = time.time()  # the cohort builds inside train_cohort: its building counts in the first event
            _end_profile(args)
            train_cohort(
                [replace(cfg, seed=s) for s in seeds],
                problems,
                [work / f"seed{s}" / "adapter" for s in seeds],
                log_paths,
                [work / "ckpt" / f"seed{s}" for s in seeds],
                callbacks=[[CohortStepEnds(s == seeds[-1])] for s in seeds],
            )
            liger, micro_batches = cfg.liger_kernels and cuda, cfg.micro_batches  # --idle-profile: lone runs only
            own_backward, groups = holder.get("own_backward", 0), holder.get("groups", 0)
        else:
            from talkmethods.training.runs import StepLog

            log_paths = [work / "train_log.jsonl"]
            trainer = holder["trainer"] = build_trainer(
                cfg,
                problems,
                work,
                callbacks=[StepEnds(), StepLog(log_paths[0])],
                generator_factory=ENGINES["fast"],
            )
            trainer.right_align_rows = not args.masked_rows  # --masked-rows: TRL's layout under a mask (before)
            trainer.pack_rows = args.packed_rows  # --packed-rows: a micro-batch's rows as one row, no pads (after)
            from talkmethods.training.patches import lora_own_backward

            # each LoRA layer one autograd node (patches.lora_own_backward, on in every trainer); --autograd-lora: the before
            switched = lora_own_backward(trainer.model, on=not args.autograd_lora)
            own_backward = 0 if args.autograd_lora else switched
            from talkmethods.training.patches import lora_groups

            # q/k/v and gate/up one node each (patches.lora_groups, on in every trainer); --lora-ungrouped: the before
            grouped = lora_groups(trainer.model, on=not args.lora_ungrouped)
            groups = 0 if args.lora_ungrouped or args.autograd_lora else grouped  # (groups act on the own backward)
            t_built = time.time()
            _end_profile(args)
            trainer.train()
            liger, micro_batches = trainer.liger, cfg.micro_batches
        idle = holder.get("idle")
        # each step's own split (the run's train_log: generation and the rest of its step), beside the events
        step_logs = {
            str(p.relative_to(work)): [json.loads(line) for line in p.read_text().splitlines()]
            for p in log_paths
            if p.exists()  # a run stopped before its first step has none
        }
        shutil.rmtree(work, ignore_errors=True)
        if any(line.get("skipped_rows") for lines in step_logs.values() for line in lines):
            raise RuntimeError("a step left rows out of its loss: the bench prices every row trained")
    if args.profile_events:  # a deadline that came before N events: the events profiled so far
        _end_profile(args, top=70, suffix=".events.txt")
    out = {
        "job": args.job,
        "liger": liger,
        "masked_rows": (bool(args.masked_rows) and args.job not in COHORTS) if micro_batches is not None else None,
        "packed_rows": (bool(args.packed_rows) and args.job not in COHORTS) if micro_batches is not None else None,
        "lora_backward": own_backward if micro_batches is not None else None,  # its LoRA layers on their own backward
        "lora_groups": groups if micro_batches is not None else None,
        "micro_batches": micro_batches,
        "process_start": T_PROCESS,
        "start": t_start,
        "built": t_built,
        "ends": ends,
        "idle": idle,
        "step_logs": step_logs,
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1) if cuda else None,
    }
    Path(args.result).write_text(json.dumps(out))


def _streams_of(engine) -> list:
    """The streams a job's GPU work runs on: the default one and the engine's decode streams (none on a CPU)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.default_stream(), *getattr(engine, "_streams", [])]


def _sampled(args, play, streams) -> dict | None:
    """``--idle-profile``: one more event under an ``IdleSampler`` (not counted in the job's rate)."""
    if not args.idle_profile:
        return None
    import torch

    sampler = IdleSampler(streams)
    sampler.start()
    play()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return sampler.stop()


def _bench_sizes(args) -> dict:
    """The speed bench's training sizes from this bench's flags (``speed._train_config``'s ``args``)."""
    return {
        "turn_tokens": args.turn_tokens,
        "micro_batches": args.micro_batches,
        "lora_r": args.lora_r,
        "problems_per_step": args.problems_per_step,
        "ada_draw_ahead": True,
        "pack_seats": True,
    }


def _end_profile(args, top: int = 45, suffix: str = ".build.txt") -> None:
    """Write the running profile beside the job's result (``<result><suffix>``): calls by cumulative time."""
    global _PROFILE
    if _PROFILE is None:
        return
    import io
    import pstats

    _PROFILE.disable()
    text = io.StringIO()
    pstats.Stats(_PROFILE, stream=text).sort_stats("cumulative").print_stats(top)
    Path(args.result).with_suffix(suffix).write_text(text.getvalue())
    _PROFILE = None


def _profile_events(args, past_warmup: int) -> None:
    """``--profile-events N``: cProfile the N events after the warm-up (host time: where a steady step's
    wall clock goes beyond the GPU's, e.g. waiting on it, tokenising, TRL's bookkeeping), ``<result>.events.txt``."""
    global _PROFILE
    if not args.profile_events:
        return
    if past_warmup == 0:
        import cProfile

        _PROFILE = cProfile.Profile()
        _PROFILE.enable()
    elif past_warmup == args.profile_events:
        _end_profile(args, top=70, suffix=".events.txt")


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


def interval(result: dict) -> float | None:
    """A job's mean seconds between events past its warm-up (None if it had too few)."""
    t = result["ends"][WARMUP[_kind(result["job"])] - 1 :]
    return sum(b - a for a, b in zip(t, t[1:], strict=False)) / (len(t) - 1) if len(t) > 1 else None


def throughput(results: list[dict]) -> dict:
    """Training steps a second summed over the runs, in the window where all are warm and none has finished."""
    lo = max(r["ends"][WARMUP[_kind(r["job"])] - 1] for r in results)
    hi = min(r["ends"][-1] for r in results)
    per_job = [None if (s := interval(r)) is None else round(s, 2) for r in results]
    if hi <= lo:
        return {"overlap_s": 0.0, "steps_per_s": None, "interval_s": per_job}
    n = sum(sum(1 for t in r["ends"] if lo < t <= hi) for r in results if _kind(r["job"]) == "train")
    return {"overlap_s": round(hi - lo, 1), "steps": n, "steps_per_s": round(n / (hi - lo), 4), "interval_s": per_job}


def work(row: dict, alone: dict[str, float]) -> float | None:
    """GPUs' worth of work a configuration does: each job's rate over its rate alone, summed (None if a job has no solo)."""
    if any(j not in alone for j in row["jobs"]) or any(s is None for s in row["interval_s"]):
        return None
    return round(sum(alone[j] / s for j, s in zip(row["jobs"], row["interval_s"], strict=True)), 3)


def _speed():
    """bench/speed.py, for the recipe's size and the eval setup (heavy imports: only where used)."""
    sys.path.insert(0, str(REPO / "bench"))
    import speed

    return speed


def recipe_minutes(
    alone: dict[str, float],
    first: dict[str, float],
    eval_chats: int,
    eval_job: str = "eval",
    cohort_arms: tuple[str, ...] = (),
) -> dict | None:
    """The full recipe's minutes one job at a time, from the jobs' solo rates: each run its start-up and
    first step (``first``: start to first event, with the machine's compile caches warm) plus 79 steady steps; each eval its start-up and first
    eval, scaled to 600 chats. ``eval_job``: whose solo prices the evals (``eval-eager``: uncompiled maths).
    ``cohort_arms``: these arms' seeds train as one job (train.cohort), priced by their ``cohort-<arm>`` solo
    (an event: a step of every seed), once for all seeds. None unless every job priced has a solo."""
    jobs = {a: f"cohort-{a}" if a in cohort_arms else a for a in ARMS}
    if any(j not in alone or j not in first for j in (*jobs.values(), eval_job)):
        return None
    speed = _speed()
    runs = {a: 1 if a in cohort_arms else speed.RECIPE_SEEDS for a in ARMS}  # training jobs an arm
    run_s = {a: first[j] + (speed.RECIPE_STEPS - 1) * alone[j] for a, j in jobs.items()}
    eval_s = first[eval_job] + alone[eval_job] * (speed.RECIPE_EVAL_CHATS / eval_chats - 1)  # start-up is not per chat
    n_evals = speed.recipe_evals(len(ARMS))
    total = sum(runs[a] * run_s[a] for a in ARMS) + n_evals * eval_s
    # a job's start: its first event's time beyond a steady one (imports, building, compile, capture)
    eval_start = first[eval_job] - alone[eval_job]
    start = sum(runs[a] * (first[j] - alone[j]) for a, j in jobs.items()) + n_evals * eval_start
    # eval.one_job_per_run: a run's three kinds in one process, so one eval start a run (and the base's)
    saved = (n_evals - speed.recipe_eval_jobs_one_per_run(len(ARMS))) * eval_start
    return {
        "run_s": {a: round(v, 1) for a, v in run_s.items()},  # a cohort arm's: its one job's, every seed
        **({"cohort_arms": [a for a in ARMS if a in cohort_arms]} if cohort_arms else {}),
        "eval_s": round(eval_s, 1),
        "min": round(total / 60, 1),
        "start_min": round(start / 60, 1),
        "one_job_per_run_min": round((total - saved) / 60, 1),
    }


def projections(rows: list[dict], alone: dict, first: dict, eval_chats: int, cohort_arms: tuple[str, ...]) -> dict:
    """Every recipe projection these solos allow: one job at a time (and under MPS, from the mixes' work)
    with the compiled eval, with the uncompiled eval, and with ``cohort_arms`` as one job each."""
    recipe = {}
    ks = sorted({r["runs"] for r in rows if r["mps"] and r["runs"] > 1})
    solo = recipe_minutes(alone, first, eval_chats)
    if solo:
        under = [x for k in ks if (x := shared_recipe(solo["min"], rows, k, solo["start_min"]))]
        recipe.update(one_at_a_time=solo, under_mps=under)
    eager = recipe_minutes(alone, first, eval_chats, "eval-eager")
    if eager:  # the same runs, the evals priced by the uncompiled eval's solo
        recipe["eval_eager"] = eager
    # the cohort arms' evals priced by config.yaml's engine (fast-eager) where its solo ran, else the compiled eval's
    ev = "eval-eager" if "eval-eager" in alone else "eval"
    cohort = recipe_minutes(alone, first, eval_chats, ev, cohort_arms=cohort_arms) if cohort_arms else None
    if cohort:  # and its jobs k at a time under MPS, by the same mixes' work
        under = [x for k in ks if (x := shared_recipe(cohort["min"], rows, k, cohort["start_min"]))]
        recipe["cohort"] = {**cohort, "eval_job": ev, "under_mps": under}
    return recipe


def cohort_yaml_arms() -> tuple[str, ...]:
    """The arms cohort.yaml trains as one job each (its train.cohort)."""
    import yaml

    chosen = yaml.safe_load((REPO / "cohort.yaml").read_text())["train"]["cohort"]
    return tuple(ARMS) if chosen is True else tuple(chosen or ())


def shared_recipe(solo_min: float, rows: list[dict], k: int = 3, start_min: float | None = None) -> dict | None:
    """The recipe with its jobs ``k`` at a time under MPS (3 on a 141 GB H200, 2 on an 80 GB card): the
    solo minutes over the work of the measured k-job MPS mixes (mean, and the range between the worst and
    best mix). Every mix weighs the same, whatever share of the recipe its jobs are: an estimate, not a
    scheduled sweep.

    ``start_min`` (the solos' starts beyond a steady event) adds a bound: the recipe if every job's start
    hid entirely behind the other jobs' work (its imports and building leave the GPU idle; the mixes
    measured started their jobs together, so they do not show how much of it hides)."""
    works = [r["work"] for r in rows if r["mps"] and r["runs"] == k and r.get("work")]
    if not works:
        return None
    mean = sum(works) / len(works)
    out = {
        "jobs": k,
        "mixes": len(works),
        "work_mean": round(mean, 3),
        "min": round(solo_min / mean, 1),
        "min_range": [round(solo_min / max(works), 1), round(solo_min / min(works), 1)],
    }
    if start_min is not None:
        out["min_starts_hidden"] = round((solo_min - start_min) / mean, 1)
    return out


def run_config(jobs: list[str], mps: bool, args, out: Path) -> dict:
    """The jobs started together (with MPS if asked); their rates and memory."""
    env = dict(os.environ)
    row = {"runs": len(jobs), "mps": mps, "jobs": jobs}
    if mps:
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(out / "mps_pipe")
        env["CUDA_MPS_LOG_DIRECTORY"] = str(out / "mps_log")
        err = _mps(True, env)
        if err:
            return {**row, "error": f"MPS: {err}"}
    tag = ("mps_" if mps else "plain_") + "+".join(jobs)
    deadline = None if args.seconds is None else time.time() + args.seconds
    try:
        procs, files = [], []
        for i, job in enumerate(jobs):
            f = out / f"{tag}_{i}.json"
            f.unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--worker", "--job", job, "--result", str(f)] + _passthrough(args)
            if deadline is not None:
                cmd += ["--deadline", repr(deadline)]
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
        "liger": [r["liger"] for r in results],
        "masked_rows": [r.get("masked_rows") for r in results],
        "packed_rows": [r.get("packed_rows") for r in results],
        "lora_backward": [r.get("lora_backward") for r in results],
        "lora_groups": [r.get("lora_groups") for r in results],
        "micro_batches": args.micro_batches,
        "events": [len(r["ends"]) for r in results],
        "peak_allocated_gib": [r["peak_allocated_gib"] for r in results],
        "peak_reserved_gib": [r["peak_reserved_gib"] for r in results],
        "start_to_first_event_s": [round(r["ends"][0] - r["start"], 1) for r in results],
        # where a job's start goes: importing torch and the bench, building (tokenizer, model, trainer),
        # then the first event's own extra (compile, graph capture) beyond a steady one
        "import_s": [round(r["start"] - r["process_start"], 1) for r in results],
        "idle": [r.get("idle") for r in results],
        "build_s": [round(r["built"] - r["start"], 1) for r in results],
        # a training job's steady steps as its train_log splits them: generation, and the rest of the step
        # (what the log's step window leaves out of the event interval is the step's time outside it)
        "step_split": [_step_split(r.get("step_logs", {})) for r in results],
    }


def _step_split(logs: dict[str, list[dict]]) -> dict | None:
    """{run: mean gen_s and train_s over its steps past the warm-up}; None for an eval or rollout job."""
    out = {}
    for run, lines in logs.items():
        steady = [x for x in lines if x["step"] > WARMUP["train"]]
        if steady:
            out[run] = {k: round(sum(x[k] or 0.0 for x in steady) / len(steady), 3) for k in ("gen_s", "train_s")}
    return out or None


def _cohort_splits(rows: list[dict]) -> list[tuple[str, str, float, dict]]:
    """A cohort job's step as one: (jobs, job, event interval, {gen_s: least seed's, train_s: the rest})."""
    out = []
    for r in rows:
        if "error" in r:
            continue
        for j, i, runs in zip(r["jobs"], r["interval_s"], r.get("step_split") or [], strict=False):
            if j in COHORTS and runs and i:
                gen = min(sp["gen_s"] for sp in runs.values())
                out.append((" + ".join(r["jobs"]), j, i, {"gen_s": gen, "train_s": round(i - gen, 3)}))
    return out


def _passthrough(args) -> list[str]:
    flags = ("model", "steps", "evals", "eval_chats", "micro_batches", "turn_tokens", "lora_r", "problems_per_step")
    return (
        [x for f in flags for x in (f"--{f.replace('_', '-')}", str(getattr(args, f)))]
        + (["--profile-build"] if args.profile_build else [])
        + (["--profile-events", str(args.profile_events)] if args.profile_events else [])
        + (["--idle-profile"] if args.idle_profile else [])
        + (["--masked-rows"] if args.masked_rows else [])
        + (["--packed-rows"] if args.packed_rows else [])
        + (["--autograd-lora"] if args.autograd_lora else [])
        + (["--lora-ungrouped"] if args.lora_ungrouped else [])
    )


def parse_plan(plan: str, arm: str) -> list[tuple[list[str], bool]]:
    """``1,2m,m:grpo+eval`` → [([arm], False), ([arm, arm], True), (['grpo', 'eval'], True)]."""
    configs = []
    for item in plan.split(","):
        mps = item.startswith("m:") or (item[:-1].isdigit() and item.endswith("m"))
        body = item.removeprefix("m:")
        if body.rstrip("m").isdigit():
            jobs = [arm] * int(body.rstrip("m"))
        else:
            jobs = body.split("+")
        bad = [j for j in jobs if j not in (*ARMS, *EVALS, *ROLLOUTS, *COHORTS)]
        if bad or not jobs:
            raise ValueError(
                f"plan item {item!r}: jobs are {', '.join((*ARMS, *EVALS, *ROLLOUTS, *COHORTS))} (got {bad or 'none'})"
            )
        configs.append((jobs, mps))
    return configs


def table(res: dict) -> str:
    s = res["settings"]
    run = (
        f"{s['seconds']} s a configuration"
        if s["seconds"]
        else f"{s['steps']} steps a run, {s['evals']} evals an eval job"
    )
    lines = [
        f"jobs sharing one GPU: {res['device']}; {run}, {s['micro_batches']} micro-batches, turns of "
        f"{s['turn_tokens']} tokens, evals of {s['eval_chats']} chats; a job's rate past its first "
        f"{WARMUP['train']} steps / {WARMUP['eval']} eval; work = the sum of each job's rate over its rate alone",
        "",
        "| jobs | MPS | training forward | work (GPUs' worth) | steps/s, all runs | s an event, each job | start s, each job: imports + build + first event | peak GiB each (allocated / reserved) | overlap s |",
        "|---|---|---|---:|---:|---|---|---|---:|",
    ]
    for r in res["rows"]:
        jobs = " + ".join(r["jobs"])
        if "error" in r:
            lines.append(f"| {jobs} | {'yes' if r['mps'] else 'no'} | | failed: {r['error'][:300]} | | | | | |")
            continue
        fwd = ", ".join(sorted({"Liger" if lg else "eager" for lg in r["liger"] if lg is not None})) or "—"
        if any(r.get("masked_rows") or []):
            fwd += ", masked rows"
        if any(r.get("packed_rows") or []):
            fwd += ", packed rows"
        if 0 in (r.get("lora_backward") or []):
            fwd += ", LoRA through autograd"
        if 0 in (r.get("lora_groups") or []):
            fwd += ", LoRA ungrouped"
        mem = ", ".join(f"{a} / {b}" for a, b in zip(r["peak_allocated_gib"], r["peak_reserved_gib"], strict=True))
        start = (
            ", ".join(
                f"{i} + {b} + {round(f - b, 1)}"
                for i, b, f in zip(r["import_s"], r["build_s"], r["start_to_first_event_s"], strict=True)
            )
            if "build_s" in r
            else "— + " + ", ".join(map(str, r["start_to_first_event_s"]))  # rows before the breakdown
        )
        lines.append(
            f"| {jobs} | {'yes' if r['mps'] else 'no'} | {fwd} | {r.get('work') or '—'} | {r['steps_per_s'] or '—'} | "
            f"{', '.join(map(str, r['interval_s']))} | {start} | {mem} | {r['overlap_s']} |"
        )
    split = [
        (" + ".join(r["jobs"]), j, i, run, sp)
        for r in res["rows"]
        if "error" not in r
        for j, i, runs in zip(r["jobs"], r["interval_s"], r.get("step_split") or [], strict=False)
        for run, sp in (runs or {}).items()
    ]
    if split:
        lines += [
            "",
            "a steady step as each run's train_log splits it (from the step's start to its log line):",
            "",
            "| jobs | job | run | generation s | rest of the step s | sum | s an event |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {jobs} | {j} | {run} | {sp['gen_s']} | {sp['train_s']} | {round(sp['gen_s'] + sp['train_s'], 2)} | {i} |"
            for jobs, j, i, run, sp in split
        ]
        cohorts = _cohort_splits(res["rows"])
        lines += [
            f"| {jobs} | {j} | every seed | {c['gen_s']} | {c['train_s']} | {i} | {i} |" for jobs, j, i, c in cohorts
        ]
        if cohorts:
            lines += [
                "",
                "A cohort's seeds take turns: a seed's own window also holds its wait for the others (at each "
                "shared engine call, and while they train), so its split overstates both parts. Its 'every seed' "
                "row: generation = the least of its seeds' (the last seed to reach the shared calls waits for "
                "none), the rest of the step = the event less that (every seed's training, one after another).",
            ]
    sampled = [
        (" + ".join(r["jobs"]), j, i)
        for r in res["rows"]
        for j, i in zip(r["jobs"], r.get("idle") or [], strict=False)
        if i
    ]
    if sampled:
        lines += ["", "a sampled event past the measured ones (--idle-profile; 2 ms samples):", ""]
        lines += [
            "| configuration | job | wall s | GPU idle s | where the GPU waited most (s) | where the host was most (s) |"
        ]
        lines += ["|---|---|---:|---:|---|---|"]
        for config, job, i in sampled:
            where = "; ".join(f"{p} {t}" for p, t in i["idle_by_place"][:3]) or "—"
            host = "; ".join(f"{p} {t}" for p, t in i["host_by_place"][:3])
            idle = (
                "—" if i["gpu_idle_s"] is None else f"{i['gpu_idle_s']} ({100 * i['gpu_idle_s'] / i['wall_s']:.0f}%)"
            )
            lines.append(f"| {config} | {job} | {i['wall_s']} | {idle} | {where} | {host} |")
    rec = res.get("recipe", {})
    if rec:
        lines.append("")
    if "one_at_a_time" in rec:
        one = rec["one_at_a_time"]
        lines += [
            f"full recipe from these solos ({_solo_mb(res, s)} micro-batches; a run: start to first step + "
            f"{_speed().RECIPE_STEPS - 1} steady steps; an eval on the compiled `fast` engine: start to end of its first): "
            f"**{one['min']} min one job at a time** "
            f"(runs {', '.join(f'{a} {v:.0f} s' for a, v in one['run_s'].items())}; eval {one['eval_s']:.0f} s), "
            f"of which {one['start_min']} min are the jobs' starts beyond a steady event",
        ]
        if "one_job_per_run_min" in one:
            lines.append(
                f"with `eval.one_job_per_run: true` (a run's three evals in one process: "
                f"{_speed().recipe_eval_jobs_one_per_run(len(ARMS))} eval starts, not {_speed().recipe_evals(len(ARMS))}): "
                f"**{one['one_job_per_run_min']} min one job at a time** (arithmetic on these solos, not a run)"
            )
    if "cohort" in rec:
        co = rec["cohort"]
        # cohort.yaml's arms, or others priced with --cohort-arms
        label = "`cohort.yaml`" if tuple(co["cohort_arms"]) == cohort_yaml_arms() else "`train.cohort`"
        lines.append(
            f"with {label} ({', '.join(co['cohort_arms'])}: an arm's seeds as one job, priced by its "
            f"cohort solo; the evals by {co['eval_job']}'s): **{co['min']} min one job at a time**, "
            f"**{co['one_job_per_run_min']} min** with one eval job a run too "
            f"(runs {', '.join(f'{a} {v:.0f} s' for a, v in co['run_s'].items())}; "
            "a cohort arm's: its one job; arithmetic on these solos, not a run)"
        )
        lines += [
            f"with {label}, {u['jobs']} jobs at a time under MPS: **{u['min']} min** at the mean work of the "
            f"{u['mixes']} {u['jobs']}-job mixes measured ({u['work_mean']}; {u['min_range'][0]}–{u['min_range'][1]} min)"
            for u in co.get("under_mps", [])
        ]
    if "eval_eager" in rec:
        eager = rec["eval_eager"]
        lines.append(
            f"with the evals on `fast-eager` (config.yaml's eval.engine: the maths uncompiled; eval-eager's solo, "
            f"{eager['eval_s']:.0f} s start to end): "
            f"**{eager['min']} min** one job at a time, **{eager['one_job_per_run_min']} min** with one eval "
            "job a run too (arithmetic on these solos, not a run)"
        )
    if rec and res.get("first_event_cold_s"):
        lines.append(
            "start to first event, a job's slowest solo (cold compile caches) → its quickest, which the "
            "projection takes: "
            + ", ".join(f"{j} {t} → {res['alone_first_event_s'][j]} s" for j, t in res["first_event_cold_s"].items())
        )
    for shared in rec.get("under_mps", []):
        lo, hi = shared["min_range"]
        k = shared["jobs"]
        lines.append(
            f"{k} jobs at a time under MPS: **{shared['min']} min** at the mean work of the "
            f"{shared['mixes']} {k}-job mixes measured ({shared['work_mean']}; {lo}–{hi} min between the "
            "best and worst mix)"
            + (
                f"; {shared['min_starts_hidden']} min if every start hid behind other jobs' work (a bound, not measured)"
                if "min_starts_hidden" in shared
                else ""
            )
        )
    return "\n".join(lines)


def _solo_mb(res: dict, settings: dict) -> str:
    """The micro-batches the arms' solos ran at (an ``--alone`` file's may differ from this run's)."""
    mbs = sorted({m for m in res.get("alone_micro_batches", {}).values() if m})
    return ", ".join(map(str, mbs)) or str(settings["micro_batches"])


def _note_solo(
    row: dict, alone: dict[str, float], first: dict[str, float], cold: dict | None = None, mb: dict | None = None
) -> None:
    """A job that ran by itself, without MPS: its interval (the first such row's) and its start to first
    event, the least of its rows (``cold``: the most). A process's first event pays for torch.compile and
    Triton's kernels unless an earlier process on the machine left them in the on-disk caches (H100,
    2026-12-05: an eval's first 600 chats 85 s cold against 20 s steady), and a recipe pays that once a
    machine, not once a job: run a job's solo twice (``--plan eval,eval``) and the projection takes the warm one."""
    if "error" not in row and len(row["jobs"]) == 1 and not row["mps"] and row["interval_s"][0]:
        # from the process's start where the row has it (rows before 2026-12-05 timed from after the imports)
        job, t = row["jobs"][0], round(row["start_to_first_event_s"][0] + row.get("import_s", [0.0])[0], 1)
        alone.setdefault(job, row["interval_s"][0])
        if mb is not None and job in ARMS:  # the micro-batches its rate was measured at
            mb.setdefault(job, row.get("micro_batches"))
        first[job] = min(first.get(job, t), t)
        if cold is not None:
            cold[job] = max(cold.get(job, t), t)


def _device() -> str:
    import platform

    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.machine()})"


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("out", "result", "worker", "job", "deadline", "rows")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/share")
    ap.add_argument("--model", default="random:qwen2.5-1.5b")
    ap.add_argument("--arm", default="grpo", choices=ARMS, help="the arm of a plan item that is a bare count")
    ap.add_argument("--steps", type=int, default=None, help="training steps a run (without --seconds)")
    ap.add_argument("--evals", type=int, default=None, help="evals an eval job plays (without --seconds)")
    ap.add_argument(
        "--seconds", type=float, default=None, help="run every job this long from the configuration's start"
    )
    ap.add_argument("--eval-chats", type=int, default=None)
    ap.add_argument("--micro-batches", type=int, default=8, help="8: three runs' peaks fit one 141 GB GPU")
    ap.add_argument("--turn-tokens", type=int, default=None)
    ap.add_argument("--lora-r", type=int, default=None)
    ap.add_argument("--problems-per-step", type=int, default=None)
    ap.add_argument(
        "--masked-rows",
        action="store_true",
        help="lone training jobs keep TRL's left-padded loss rows under an attention mask (the layout before "
        "patches.right_aligned_rows): the 'before' of a same-card A/B",
    )
    ap.add_argument(
        "--packed-rows",
        action="store_true",
        help="lone training jobs run each micro-batch's loss rows as one row of real tokens (patches.packed_rows: "
        "varlen attention, no pads); cohorts keep their layout",
    )
    ap.add_argument(
        "--autograd-lora",
        action="store_true",
        help="lone training jobs run LoRA's backward through autograd's graph (the layout before "
        "patches.lora_own_backward): the 'before' of a same-card A/B; cohorts keep the adopted node",
    )
    ap.add_argument(
        "--lora-ungrouped",
        action="store_true",
        help="training jobs run q/k/v and gate/up as one LoRA node a layer (the layout before "
        "patches.lora_groups; a cohort from its second step): the 'before' of a same-card A/B",
    )
    ap.add_argument(
        "--plan",
        default="1,2m,3m,2",
        help="comma-separated configurations: K runs of --arm ('Km': under MPS) or jobs joined by + "
        "('m:' in front: under MPS); default 1,2m,3m,2",
    )
    ap.add_argument(
        "--alone",
        help="a share.json of an earlier run: its jobs' rates alone serve this run's work figures "
        "(this run's own solos take precedence)",
    )
    ap.add_argument(
        "--rows",
        help="a share.json whose configurations are reported again instead of run (no job starts): with "
        "--alone, the mixes of one device call priced by the solos of another",
    )
    ap.add_argument(
        "--cohort-arms",
        help="comma-separated arms priced as one job a cohort (their cohort-<arm> solos) in the recipe's cohort "
        "projection; default cohort.yaml's train.cohort. Reprices saved rows with --rows",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the offline model: checks the code path")
    ap.add_argument(
        "--profile-build",
        action="store_true",
        help="profile each job's building (cProfile): <job>.build.txt beside its result",
    )
    ap.add_argument(
        "--profile-events",
        type=int,
        default=0,
        help="cProfile this many events after each job's warm-up: <job>.events.txt",
    )
    ap.add_argument(
        "--idle-profile",
        action="store_true",
        help="one more event per job, sampled every 2 ms: GPU idle time and where the host was (share.json's idle)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    q = args.quick
    if q and args.model == "random:qwen2.5-1.5b":
        args.model = "offline-tiny-qwen2"
    args.steps = args.steps or (4 if q else 8)
    args.evals = args.evals or 3
    args.eval_chats = args.eval_chats or (8 if q else 600)
    args.turn_tokens = args.turn_tokens or (8 if q else 256)
    args.lora_r = args.lora_r or (4 if q else 32)
    args.problems_per_step = args.problems_per_step or (2 if q else 8)
    if q:
        args.micro_batches = 1
    if args.steps <= WARMUP["train"] or args.evals <= WARMUP["eval"]:
        ap.error(
            f"--steps must exceed {WARMUP['train']} and --evals {WARMUP['eval']}: the warm-up (got {args.steps}, {args.evals})"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.worker:
        worker(args)
        return
    try:
        plan = parse_plan(args.plan, args.arm)
    except ValueError as err:
        ap.error(str(err))
    cohort_arms = (
        cohort_yaml_arms() if args.cohort_arms is None else tuple(a for a in args.cohort_arms.split(",") if a)
    )
    if unknown := [a for a in cohort_arms if a not in ARMS]:
        ap.error(f"--cohort-arms: unknown arm(s) {', '.join(unknown)} (arms: {', '.join(ARMS)})")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    alone: dict[str, float] = {}  # a job's interval when it had the GPU to itself
    first: dict[str, float] = {}  # ... and its seconds from start to first event (start-up and warm-up)
    cold: dict[str, float] = {}  # ... the most of those: where the machine's compile caches were cold
    solo_mb: dict[str, int] = {}  # ... and the micro-batches an arm's solo ran at
    earlier = json.loads(Path(args.alone).read_text()) if args.alone else {}
    if args.rows:
        res = json.loads(Path(args.rows).read_text())
        res = {"device": res["device"], "settings": res["settings"], "rows": res["rows"], "rows_from": args.rows}
        for row in res["rows"]:
            _note_solo(row, alone, first, cold, solo_mb)
    else:
        res = {"device": _device(), "settings": _settings(args), "rows": []}
        for jobs, mps in plan:
            t0 = time.time()
            row = run_config(jobs, mps, args, out)
            row["wall_s"] = round(time.time() - t0, 1)
            _note_solo(row, alone, first, cold, solo_mb)
            log.info("%s", row)
            res["rows"].append(row)
            (out / "share.json").write_text(json.dumps(res, indent=1))
    own = set(alone)
    e_alone, e_first = dict(earlier.get("alone_interval_s", {})), dict(earlier.get("alone_first_event_s", {}))
    e_mb = dict(earlier.get("alone_micro_batches", {}))
    for row in earlier.get("rows", []):  # an earlier run cut short wrote its rows but not its solos
        _note_solo(row, e_alone, e_first, mb=e_mb)
    alone = {**e_alone, **alone}
    first = {**e_first, **first}
    for row in res["rows"]:
        if "error" not in row:
            row["work"] = work(row, alone)
    res["alone_interval_s"] = alone
    res["alone_first_event_s"] = first
    res["alone_micro_batches"] = {**e_mb, **solo_mb}
    # this run's jobs solo'd more than once, where the slowest start was slower than the quickest
    res["first_event_cold_s"] = {j: t for j, t in cold.items() if t > first[j]}
    res["alone_from"] = {j: (args.rows or "this run") if j in own else args.alone for j in alone}
    recipe = projections(res["rows"], alone, first, res["settings"]["eval_chats"], cohort_arms)
    if recipe:
        res["recipe"] = recipe
    (out / "share.json").write_text(json.dumps(res, indent=1))
    print(table(res))
    (out / "share.md").write_text(table(res) + "\n")
    if any("error" in r and not r["mps"] for r in res["rows"]):
        sys.exit("share: a configuration without MPS failed (see share.json)")


if __name__ == "__main__":
    main()
