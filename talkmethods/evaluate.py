"""Held-out evaluation and cross-play: play chats with chosen seats and compute DESIGN §3's metrics.

Kinds of eval (which seats run the trained adapter):
``eval`` trained A × trained B; ``crossplay`` trained A × base B; ``crossplay_bA`` base A × trained B;
``base`` base A × base B (no adapter at all).
"""

from __future__ import annotations

import functools
import logging
import platform
import re
import subprocess
import time
from pathlib import Path

import torch
from tqdm import tqdm

from talkmethods.dialogue import SEATS
from talkmethods.engines.plain import PlainGenerator
from talkmethods.engines.sampling import Sampling
from talkmethods.grading import extract_boxed
from talkmethods.models import load_model, load_tokenizer, pick_device_and_dtype
from talkmethods.recipe import BASE_KIND, EVAL_KINDS, EvalConfig
from talkmethods.rollout import Chat, play_chats

log = logging.getLogger(__name__)

EVAL_SEATS = {
    kind: spec["seats"] for kind, spec in {**EVAL_KINDS, "base": BASE_KIND}.items()
}  # (A, B) carry the adapter
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def numbers_in(text: str) -> set[str]:
    """The numbers written in ``text``, commas dropped (``1,000`` → ``1000``)."""
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def partner_only_numbers(problem: dict, seat: str) -> set[str]:
    """Numbers that only the partner of ``seat`` held (not in the seat's own facts nor the question)."""
    own = problem["facts_a"] if seat == "A" else problem["facts_b"]
    other = problem["facts_b"] if seat == "A" else problem["facts_a"]
    known = numbers_in(" ".join(own)) | numbers_in(problem["shared_question"])
    return numbers_in(" ".join(other)) - known


def chat_metrics(chats: list[Chat]) -> dict:
    """DESIGN §3's per-eval metrics over a list of graded chats."""
    n = len(chats)
    chars = {f"{s}{1 + i // 2}": sum(len(c.turns[i].text) for c in chats) / n for i, s in enumerate(SEATS)}
    use = {}
    for seat in ("A", "B"):
        hits = total = 0
        for c in chats:
            partner = partner_only_numbers(c.problem, seat)
            said = numbers_in(" ".join(t.text for t in c.turns if t.seat == seat))
            hits += len(partner & said)
            total += len(partner)
        use[seat] = hits / total if total else 0.0
    finals = [c.turns[2] for c in chats] + [c.turns[3] for c in chats]
    return {
        "team_accuracy": sum(c.reward for c in chats) / n,
        "both_right": sum(c.reward == 1.0 for c in chats) / n,
        "a_accuracy": sum(c.a_right for c in chats) / n,
        "b_accuracy": sum(c.b_right for c in chats) / n,
        "no_box_rate": sum(extract_boxed(t.text) is None for t in finals) / len(finals),
        "chars_per_message": chars,
        "chars_per_seat": {s: sum(v for k, v in chars.items() if k[0] == s) / 2 for s in ("A", "B")},
        "partner_fact_use": use,
    }


def per_problem_rewards(chats: list[Chat]) -> dict:
    """Mean team reward per problem, in first-seen order (for paired statistics)."""
    sums: dict[str, list[float]] = {}
    for c in chats:
        sums.setdefault(c.problem["id"], []).append(c.reward)
    return {"ids": list(sums), "rewards": [sum(v) / len(v) for v in sums.values()]}


@functools.cache
def _git_rev() -> str | None:
    """The checkout's short revision, asked once a process (a run's evals share it)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def provenance(wall_s: float, device: torch.device) -> dict:
    """Package versions, git revision, seconds and device of a run."""
    from importlib.metadata import version

    rev = _git_rev()
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})"
    )
    return {
        "versions": {
            "torch": torch.__version__,
            "transformers": version("transformers"),
            "trl": version("trl"),
            "peft": version("peft"),
            "python": platform.python_version(),
        },
        "git": rev,
        "wall_s": round(wall_s, 3),
        "device": name,
    }


def play_eval(
    model,
    tokenizer,
    problems: list[dict],
    kind: str,
    sampling: Sampling,
    chats_per_problem: int,
    batch_chats: int,
    generator_factory=PlainGenerator,
) -> list[Chat]:
    """Play ``chats_per_problem`` chats on every problem with the seats of ``kind``, in batches."""
    seats = EVAL_SEATS[kind]
    flat = [p for p in problems for _ in range(chats_per_problem)]
    generator = generator_factory(model, tokenizer)
    chats: list[Chat] = []
    with tqdm(total=len(flat), desc=f"{kind} chats", unit="chat", dynamic_ncols=True) as bar:
        for start in range(0, len(flat), batch_chats):
            batch = flat[start : start + batch_chats]
            played, _ = play_chats(generator, tokenizer, batch, [seats] * len(batch), sampling)
            chats += played
            bar.update(len(batch))
    return chats


def run_eval(
    kind: str,
    cfg: EvalConfig,
    adapter_dir: str | None,
    problems: list[dict],
    arm: str | None = None,
    train_seed: int | None = None,
) -> dict:
    """Evaluate one model pairing on the held-out problems; returns the eval JSON object."""
    return run_evals([kind], cfg, adapter_dir, problems, arm, train_seed)[kind]


def run_evals(
    kinds: list[str],
    cfg: EvalConfig,
    adapter_dir: str | None,
    problems: list[dict],
    arm: str | None = None,
    train_seed: int | None = None,
) -> dict[str, dict]:
    """Several pairings of one run in one process: the model and adapter load once, then each kind
    plays from the eval seed, so each result is the one ``run_eval(kind)`` gives alone. A process's
    start (imports, loading, compile, graph capture) is paid once instead of once a kind (H100,
    2026-12-05: ~33 s against 17.6 s of playing 600 chats)."""
    if "base" in kinds and len(kinds) > 1:
        raise ValueError("the base eval loads no adapter: run it on its own")
    t0 = time.perf_counter()
    device, dtype = pick_device_and_dtype(cfg.precision)
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, dtype, device)
    if kinds != ["base"]:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=False)
    model.eval()
    from talkmethods.engines import ENGINES

    results = {}
    for kind in kinds:
        torch.manual_seed(cfg.eval_seed)
        chats = play_eval(
            model, tokenizer, problems, kind, cfg.sampling, cfg.chats_per_problem, cfg.batch_chats, ENGINES[cfg.engine]
        )
        results[kind] = _eval_result(kind, chats, cfg, adapter_dir, problems, arm, train_seed)
        # a kind's seconds: the first kind's include the shared start
        results[kind]["provenance"] = {**provenance(time.perf_counter() - t0, device), "played_with": kinds}
        t0 = time.perf_counter()
    return results


def _eval_result(kind, chats, cfg, adapter_dir, problems, arm, train_seed) -> dict:
    samples = [
        {
            "problem_id": c.problem["id"],
            "gold": c.problem["gold"],
            "reward": c.reward,
            "turns": [{"seat": t.seat, "adapter": t.adapter_on, "text": t.text} for t in c.turns],
        }
        for c in chats[: cfg.sample_dialogues * cfg.chats_per_problem : cfg.chats_per_problem]
    ]
    return {
        "kind": kind,
        "arm": arm,
        "seed": train_seed,
        "config": {
            "model": cfg.model.name,
            "adapter": adapter_dir,
            "sampling": vars(cfg.sampling),
            "chats_per_problem": cfg.chats_per_problem,
            "eval_seed": cfg.eval_seed,
            "engine": cfg.engine,
        },
        "counts": {"problems": len(problems), "chats": len(chats)},
        "metrics": chat_metrics(chats),
        "per_problem": per_problem_rewards(chats),
        "samples": samples,
    }


def eval_stage(
    params: dict,
    kind: str,
    problems: str,
    adapter_dir: str | None,
    out: str,
    arm: str | None = None,
    seed: int | None = None,
) -> dict:
    """The eval stage: play the eval chats of ``kind`` on the held-out problems and write the eval JSON."""
    return eval_stages(params, [kind], problems, adapter_dir, [out], arm, seed)[kind]


def eval_stages(
    params: dict,
    kinds: list[str],
    problems: str,
    adapter_dir: str | None,
    outs: list[str],
    arm: str | None = None,
    seed: int | None = None,
) -> dict[str, dict]:
    """The eval stage for several kinds of one run in one process (``eval.one_job_per_run``): each
    kind's JSON to its path in ``outs``, as ``eval_stage`` writes it."""
    from talkmethods.atomic import write_json
    from talkmethods.problems import read_jsonl

    results = run_evals(kinds, EvalConfig.from_params(params), adapter_dir, read_jsonl(problems), arm, seed)
    for kind, out in zip(kinds, outs, strict=True):
        write_json(out, results[kind])
        log.info("%s %s seed %s: team accuracy %.3f", kind, arm, seed, results[kind]["metrics"]["team_accuracy"])
    return results
