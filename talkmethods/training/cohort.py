"""A seed cohort: an arm's seeds trained in one process, their rollouts decoded as one batch.

Each seed is its own ``TalkTrainer`` (its own adapter in one PEFT model, its own optimizer, scheduler,
clipping, data order and checkpoints), running TRL's own ``train()`` in its own thread. The threads
take turns, in seed order, so only one touches the model at a time; at the rollout they meet: the
last to arrive plays every seed's chats in one engine call (each seed's rows on its own adapter:
``engines.fast``'s stacked batch) and each trainer takes its own chats back. One weight read of the
base model serves three seeds' decode steps (H100: 1.71 s a seed's step of chats against 2.91 alone,
docs/h200_2026-12-04.md round ten).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from talkmethods.atomic import atomic_path
from talkmethods.credit import ARM_PLANS
from talkmethods.rollout import judge_by_gold
from talkmethods.training.runs import jsonable


class CohortFailed(RuntimeError):
    """Another seed of the cohort failed: this one stops with it."""


class Turns:
    """The turnstile and the rendezvous of a cohort's threads.

    ``members`` take turns in their order: a thread runs only while it holds the turn. ``play`` hands
    the turn on and waits; when every member still running has asked, the last one plays all the
    requests with ``play_all`` (holding the turn) and the turn goes back to the first member. ``leave``
    (a run that ended) and ``fail`` (one that raised) keep the others from waiting for it.
    ``on_turn(name)`` runs whenever ``name`` gets the turn (the cohort: ``set_adapter``).
    """

    def __init__(self, members: list[str], play_all: Callable[[dict], dict], on_turn: Callable[[str], None]):
        self.members = list(members)
        self.play_all, self.on_turn = play_all, on_turn
        self._cond = threading.Condition()
        self._turn: str | None = self.members[0] if self.members else None
        self._requests: dict[str, object] = {}
        self._results: dict[str, object] = {}
        self._error: BaseException | None = None

    def enter(self, name: str) -> None:
        """Wait for ``name``'s first turn (a thread's start)."""
        with self._cond:
            self._wait_for(name)

    def play(self, name: str, request):
        """``name``'s request into the next joint rollout; returns its result, with the turn back."""
        with self._cond:
            self._requests[name] = request
            self._pass_turn(name)
            self._wait_for(name, result=True)
            return self._results.pop(name)

    def leave(self, name: str) -> None:
        """``name``'s run ended: the others stop waiting for it."""
        with self._cond:
            if name in self.members:
                self.members.remove(name)
            if self._turn == name:
                self._pass_turn(name)
            self._cond.notify_all()

    def fail(self, name: str, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            if name in self.members:
                self.members.remove(name)
            self._cond.notify_all()

    # -- under the condition's lock -----------------------------------------------------------

    def _pass_turn(self, name: str) -> None:
        """The turn to the next member in order that has not asked; with none left, play them all."""
        waiting = [m for m in self.members if m not in self._requests]
        if waiting:
            after = (
                [m for m in waiting if self.members.index(m) > self.members.index(name)]
                if name in self.members
                else []
            )
            self._turn = (after or waiting)[0]
        elif self._requests:
            self._turn = None
            try:
                self._results.update(self.play_all(dict(self._requests)))
            except BaseException as e:  # noqa: BLE001 - every thread must see it, then it propagates
                self._error = e
                self._cond.notify_all()
                raise
            self._requests.clear()
            self._turn = self.members[0] if self.members else None
        else:
            self._turn = None
        self._cond.notify_all()

    def _wait_for(self, name: str, result: bool = False) -> None:
        while True:
            if self._error is not None:
                raise CohortFailed(f"seed {name} stops: another seed of its cohort failed ({self._error!r})")
            if self._turn == name and (not result or name in self._results):
                break
            self._cond.wait()
        self.on_turn(name)


class Cohort:
    """A cohort's shared rollout: one engine over the shared model, and ``chats_of(name)``, the
    ``rollout.play_chats`` a seed's trainer calls, meeting the other seeds' calls in one."""

    def __init__(self, model, tokenizer, names: list[str], generator_factory):
        self.model, self.tokenizer, self.names = model, tokenizer, list(names)
        self.generator = generator_factory(model, tokenizer)
        self.turns = Turns(self.names, self._play_all, lambda name: model.set_adapter(name))

    def chats_of(self, name: str):
        def play(generator, tokenizer, problems, seats, sampling, judge):
            return self.turns.play(name, (problems, seats, sampling, judge))

        return play

    def _play_all(self, requests: dict) -> dict:
        """Every waiting seed's chats in one ``play_chats``: a seed's trained seats on its adapter."""
        from talkmethods.rollout import play_chats

        names = [n for n in self.names if n in requests]
        samplings = {requests[n][2] for n in names}
        if len(samplings) != 1:
            raise ValueError(f"a cohort's seeds must sample alike, got {samplings}")
        flat, seats = [], []
        for n in names:
            problems, own, _, _ = requests[n]
            flat += problems
            seats += [(n if a else False, n if b else False) for a, b in own]
        chats, stats = play_chats(self.generator, self.tokenizer, flat, seats, samplings.pop(), requests[names[0]][3])
        out, start = {}, 0
        for n in names:
            mine = chats[start : start + len(requests[n][0])]
            start += len(mine)
            for chat in mine:  # the seed's own view: its adapter is "the adapter"
                chat.a_adapter, chat.b_adapter = chat.a_adapter == n, chat.b_adapter == n
                for turn in chat.turns:
                    turn.adapter_on = turn.adapter_on == n
            out[n] = (mine, dict(stats))  # the joint call's time and lengths: the seeds' shared rollout
        return out


def adapter_name(seed: int) -> str:
    return f"seed{seed}"


def train_cohort(
    cfgs: list,
    problems: list[dict],
    adapter_dirs: list[Path],
    log_paths: list[Path],
    work_dirs: list[Path],
    judge=judge_by_gold,
    callbacks: list[list] | None = None,
) -> list[dict]:
    """Train an arm's seeds (``cfgs``, alike but for the seed) as one cohort in this process.

    Each seed writes what its lone run (``build.train_run``) writes: its adapter (as PEFT's single
    ``default`` adapter) and step log, atomically at its end, and resumable checkpoints of its own
    adapter in its ``work_dir``, which a restarted cohort resumes from (a lone run's are not taken up,
    nor a cohort's by a lone run: the run key says which). ``callbacks``: more Trainer callbacks, a
    list a seed (the benches').
    """
    from dataclasses import replace

    from peft import get_peft_model

    from talkmethods.engines import ENGINES
    from talkmethods.models import load_model, pick_device_and_dtype
    from talkmethods.training.build import build_trainer, lora_config
    from talkmethods.training.patches import apply_patches
    from talkmethods.training.runs import StepLog, checkpoint_step, last_checkpoint, run_key, truncate_log

    first = cfgs[0]
    if any(replace(c, seed=first.seed) != first for c in cfgs):
        raise ValueError("a cohort's runs differ only in their seed")
    if ARM_PLANS[first.arm].replay and not first.ada_draw_ahead:
        raise ValueError("a cohort plays Reinforce-Ada's replays drawn ahead: set train.ada_draw_ahead: true")
    names = [adapter_name(c.seed) for c in cfgs]
    device, dtype = pick_device_and_dtype(first.precision)
    model = None
    for cfg, name in zip(cfgs, names, strict=True):
        torch.manual_seed(cfg.seed)  # each seed's LoRA initialised from its own seed
        if model is None:
            model = get_peft_model(load_model(first.model, dtype, device), lora_config(cfg), adapter_name=name)
        else:
            model.add_adapter(name, lora_config(cfg))
    starts, trainers = [], []
    for i, (cfg, name, work_dir) in enumerate(zip(cfgs, names, work_dirs, strict=True)):
        work_dir.mkdir(parents=True, exist_ok=True)
        last = last_checkpoint(work_dir, {**run_key(cfg, problems), "cohort": names})
        starts.append((last, checkpoint_step(last) if last else 0))
        truncate_log(work_dir / "train_log.jsonl", starts[-1][1])
        model.set_adapter(name)
        trainers.append(
            build_trainer(
                cfg,
                problems,
                work_dir,
                judge=judge,
                callbacks=[StepLog(work_dir / "train_log.jsonl"), *(callbacks[i] if callbacks else [])],
                peft_model=model,
                adapter=name,
            )
        )
    liger = first.liger_kernels and device.type == "cuda"
    fused = apply_patches(model, liger=liger)
    cohort = Cohort(model, trainers[0].processing_class, names, ENGINES[first.engine])
    for t in trainers:
        t.cohort, t.liger, t.lora_layers_fused = cohort, liger, fused
    results: list = [None] * len(cfgs)
    errors: list = [None] * len(cfgs)

    def run(i: int) -> None:
        cfg, name, trainer, (last, resumed_from) = cfgs[i], names[i], trainers[i], starts[i]
        try:
            cohort.turns.enter(name)
            t0 = time.perf_counter()
            if last and resumed_from >= cfg.steps:  # finished; its outputs were not written (build.train_run)
                model.load_adapter(str(last / name), name, is_trainable=True)
                trainer.state.global_step = resumed_from
            else:
                trainer.train(resume_from_checkpoint=str(last) if last else None)
            with atomic_path(adapter_dirs[i]) as tmp:  # the seed's adapter alone, as a lone run's ``default``
                model.save_pretrained(str(tmp), selected_adapters=[name])
                for f in (tmp / name).iterdir():
                    f.rename(tmp / f.name)
                (tmp / name).rmdir()
            with atomic_path(log_paths[i]) as tmp:
                shutil.copyfile(work_dirs[i] / "train_log.jsonl", tmp)
            results[i] = {
                "resumed_from_step": resumed_from,
                "train_wall_s": time.perf_counter() - t0,
                "steps": trainer.state.global_step,
                "cohort": names,
                "config": jsonable(asdict(cfg)),
            }
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, after the others are told
            errors[i] = e
            cohort.turns.fail(name, e)
        else:
            cohort.turns.leave(name)

    threads = [threading.Thread(target=run, args=(i,), name=names[i]) for i in range(len(cfgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cause = next((e for e in errors if e is not None and not isinstance(e, CohortFailed)), None)
    if cause is not None or any(errors):
        raise cause or next(e for e in errors if e is not None)
    return results


def train_cohort_stage(
    params: list[dict], problems: str, adapter_dirs: list[str], log_paths: list[str], work_dirs: list[str]
) -> list[dict]:
    """The cohort train stage (``train.cohort``): an arm's seeds from a rule's plain ``params``, one a seed."""
    from talkmethods.problems import read_jsonl
    from talkmethods.recipe import TrainConfig

    return train_cohort(
        [TrainConfig.from_params(p) for p in params],
        read_jsonl(problems),
        [Path(p) for p in adapter_dirs],
        [Path(p) for p in log_paths],
        [Path(p) for p in work_dirs],
    )
