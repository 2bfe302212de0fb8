"""The results card: ``card.md`` (Recipe, Run, Result, Checks, Climb, Learned, References) and ``card.png``.

Everything on the card comes from a summary made by ``talkmethods.aggregate.summarize`` and a small
``meta`` dict naming what the run was built from. The Learned section is generated from the
numbers by ``learned_sentences`` (a pure function) as a few summary lines: a ranking, what the
tests support, cross-play, cost and messages. Where a gap is not shown by both the intervals and
the probability of improvement it says the gap is within noise and needs more seeds, and it never
states more than the intervals, tests and counts show.

``meta`` keys:
  * ``model``: model name (hub id, local dir or the offline tiny model).
  * ``data``: data source (e.g. "openai/gsm8k (main): train 1,024 / test 300").
  * ``device``: the machine (e.g. "1x NVIDIA H200").
  * ``recipe``: dict of recipe values, e.g. steps, problems_per_step, chats_per_problem,
    learning_rate, lora_r, lora_alpha, loss_type ("dapo"), beta (0), num_iterations (1),
    temperature, max_new_tokens, seeds, arms; any other key is listed as is.
  * ``offline``: True for the offline default; the card's first line and the figure's title then
    say that the numbers are about a toy world (a tiny model warm-started on generated
    running-count problems), not Qwen on GSM8K. With ``warmstart`` set to None they say instead
    that the numbers only exercise the pipeline (an untrained model).
  * ``world`` (optional): the generated world, e.g. "count, short prompt"; Run shows "World: ...".
  * ``warmstart`` (optional): dict of the SFT warm start (e.g. {"steps": 600, "examples": 4096})
    or None; Run shows "Warm start: SFT, ..." when given.
  * ``prompt`` (optional): "short" or "full", the seats' system prompt; Run says when the short
    one replaced the recipe's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from talkmethods.aggregate import KINDS, ResultsError, load_selftest, load_split_stats
from talkmethods.atomic import atomic_path, write_text
from talkmethods.recipe import EVAL_KINDS

log = logging.getLogger(__name__)

__all__ = [
    "OFFLINE_LINE",
    "OFFLINE_TITLE",
    "REFERENCES",
    "KIND_LABELS",
    "learned_sentences",
    "render_card",
    "plot_card",
    "write_card",
]

OFFLINE_LINE = (
    "**Toy world: a small model warm-started (SFT) on generated running-count problems, not Qwen on "
    "GSM8K; the numbers compare the methods on this toy world only.**"
)
OFFLINE_TITLE = (
    "Toy world: a small warm-started model on generated running-count problems, not Qwen on "
    "GSM8K; the numbers compare the methods on this toy world only"
)
# An offline card whose meta says outright that there was no warm start: the tiny model is
# untrained, so its numbers only exercise the pipeline (the old offline default).
OFFLINE_UNTRAINED_LINE = (
    "**Offline, untrained: the numbers on this card exercise the pipeline and say nothing "
    "about the methods** (tiny model with random weights, generated problems)."
)
OFFLINE_UNTRAINED_TITLE = "Offline, untrained: these numbers exercise the pipeline and say nothing about the methods"

KIND_LABELS = {kind: spec["label"] for kind, spec in EVAL_KINDS.items()}

REFERENCES = [
    "Shao et al., DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models (GRPO), "
    "arXiv:2402.03300",
    "Xiong et al., Reinforce-Ada: An Adaptive Sampling Framework for Reinforce-Style LLM Training, arXiv:2510.04996",
    "Dong et al., RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment, arXiv:2304.06767",
    "Lambert, Reinforcement Learning from Human Feedback (evaluation chapter), arXiv:2504.12501",
    "Gao, Schulman, Hilton, Scaling Laws for Reward Model Overoptimization, arXiv:2210.10760",
    "Park et al., MAPoRL: Multi-Agent Post-Co-Training for Collaborative Large Language Models with "
    "Reinforcement Learning, arXiv:2502.18439",
    "Agarwal et al., Deep Reinforcement Learning at the Edge of the Statistical Precipice (interval estimates, "
    "probability of improvement), arXiv:2108.13264",
]

RECIPE_LABELS = [
    ("steps", "Steps"),
    ("problems_per_step", "Problems per step"),
    ("chats_per_problem", "Chats per problem"),
    ("learning_rate", "Learning rate (AdamW)"),
    ("lr_schedule", "Learning-rate schedule"),
    ("lora_r", "LoRA r"),
    ("lora_alpha", "LoRA alpha"),
    ("lora_dropout", "LoRA dropout"),
    ("loss_type", "Loss type (TRL)"),
    ("beta", "KL beta"),
    ("num_iterations", "Updates per generation batch (num_iterations)"),
    ("temperature", "Rollout temperature"),
    ("top_p", "Rollout top_p"),
    ("max_new_tokens", "Max new tokens per turn"),
    ("seeds", "Seeds"),
    ("arms", "Arms"),
]


# ---------------------------------------------------------------------------------------------
# Number formatting.
# ---------------------------------------------------------------------------------------------


def _f(x: Any, digits: int = 2) -> str:
    return "n/a" if x is None else f"{float(x):.{digits}f}"


def _ci(d: dict, digits: int = 2) -> str:
    """``mean [lo, hi]`` of a dict with those keys."""
    return f"{_f(d['mean'], digits)} [{_f(d['lo'], digits)}, {_f(d['hi'], digits)}]"


def _p(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def _level(summary: dict) -> str:
    return f"{100 * (1 - summary['alpha']):g}%"


def _seconds(x: Any) -> str:
    return "n/a" if x is None else f"{float(x):,.0f} s"


# ---------------------------------------------------------------------------------------------
# Learned: a short summary from the numbers.
# ---------------------------------------------------------------------------------------------


def _join(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = list(items)
    return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " and " + items[-1]


def _eval(summary: dict, arm: str) -> dict:
    return summary["per_arm"][arm]["kinds"]["eval"]


def _ranked(summary: dict) -> list[str]:
    """Arms by held-out mean team accuracy, best first; ties keep config order (the sort is stable)."""
    return sorted(summary["arms"], key=lambda a: -_eval(summary, a)["mean"])


def _indistinct(summary: dict) -> bool:
    """Whether two or more arms all show the same held-out mean and interval at card precision."""
    arms = summary["arms"]
    return len(arms) > 1 and len({_ci(_eval(summary, a)) for a in arms}) == 1


def _arm_values(pairs: Sequence[tuple[str, dict]], every: bool = False) -> str:
    """``ada 0.34 [0.30, 0.38] and raft 0.30 [...]``; one shared value is stated once, not per arm.

    Args:
      pairs: (arm, dict with mean/lo/hi) in the order to name them.
      every: The pairs are every arm of the card (then a shared value reads "every arm (...)").
    """
    shown = {_ci(d) for _, d in pairs}
    if len(pairs) > 1 and len(shown) == 1:
        return f"every arm ({shown.pop()})" if every else f"{_join([a for a, _ in pairs])} (all {shown.pop()})"
    return _join([f"{a} {_ci(d)}" for a, d in pairs])


def _ranking_line(summary: dict) -> str:
    """The arms ranked by held-out mean with intervals and seeds learned, base × base for reference.

    When every arm shows the same numbers (e.g. the all-zero card of an untrained model) there is
    no ranking to give, and the line says so instead of ordering ties.
    """
    arms, base = summary["arms"], summary["base"]
    if _indistinct(summary):
        ci = _ci(_eval(summary, arms[0]))
        ref = f"as does base × base {_ci(base)}" if ci == _ci(base) else f"against base × base {_ci(base)}"
        return (
            f"Nothing separates the arms: {_join(arms)} all score {ci} in held-out team accuracy "
            f"(mean [{_level(summary)} interval]), {ref}."
        )
    parts, prev = [], None
    for i, arm in enumerate(_ranked(summary)):
        a = summary["per_arm"][arm]
        learned = f"{a['seeds_learned']}/{a['n_seeds']}" + (" seeds learned" if i == 0 else "")
        text = f"{arm} {_ci(_eval(summary, arm))} ({learned})"
        if prev is not None:  # "=" where the means print alike: the order between them is arbitrary
            text = ("= " if _f(prev) == _f(_eval(summary, arm)["mean"]) else "> ") + text
        parts.append(text)
        prev = _eval(summary, arm)["mean"]
    return (
        f"Ranking by held-out team accuracy (mean [{_level(summary)} interval]): {' '.join(parts)}; "
        f"base × base {_ci(base)} for reference."
    )


def _learned_clause(summary: dict) -> str:
    """Seeds learned per arm (the paired test against base × base), arms that share a count grouped."""
    groups: dict[tuple[int, int], list[str]] = {}
    for arm in _ranked(summary):
        a = summary["per_arm"][arm]
        groups.setdefault((a["seeds_learned"], a["n_seeds"]), []).append(arm)
    test = f"beats base × base in a one-sided paired bootstrap over problems at {_level(summary)}"
    if len(groups) == 1 and len(summary["arms"]) > 1:
        ((k, n),) = groups
        counts = f"no arm on any of its {n} seeds" if k == 0 else f"every arm on {k} of {n} seeds"
    else:
        order = sorted(groups, key=lambda kn: -kn[0] / kn[1])
        counts = ", ".join(
            f"{_join(groups[kn])} on {kn[0]} of {kn[1]}" + (" seeds" if i == 0 else "") for i, kn in enumerate(order)
        )
    return f"Learned ({test}): {counts}."


def _oriented(summary: dict, x: str, y: str) -> dict | None:
    """The comparison of ``x`` and ``y`` as P(x > y) with its interval, or None when the summary has none."""
    for c in summary["comparisons"]:
        if (c["x"], c["y"]) == (x, y):
            return {"poi": c["poi"], "lo": c["lo"], "hi": c["hi"], "overlap": c["overlap"]}
        if (c["x"], c["y"]) == (y, x):  # P(y > x) = 1 - P(x > y), ties counting 1/2; the interval flips with it
            return {"poi": 1 - c["poi"], "lo": 1 - c["hi"], "hi": 1 - c["lo"], "overlap": c["overlap"]}
    return None


def _supported(summary: dict, x: str, y: str, comp: dict) -> bool:
    """Whether ``x`` ahead of ``y`` is a gap the numbers show, not noise.

    Both must hold: the two arms' intervals are apart, and the probability of improvement's
    interval lies above 0.5. Overlap alone is a coarse check (intervals can overlap while a
    difference is real, and the reverse with few seeds), so a gap is called only when both agree.
    """
    return not comp["overlap"] and comp["lo"] > 0.5 and _eval(summary, x)["mean"] > _eval(summary, y)["mean"]


def _poi_text(x: str, y: str, comp: dict) -> str:
    return f"P({x} > {y}) = {_f(comp['poi'])} [{_f(comp['lo'])}, {_f(comp['hi'])}]"


def _noise_reason(noise: Sequence[tuple[str, dict]]) -> str:
    """Why gaps within noise are not called: the intervals overlap, or P's interval reaches 0.5."""
    apart = [o for o, c in noise if not c["overlap"]]
    if not apart:
        return "intervals overlap"
    if len(apart) == len(noise):
        return "intervals apart, but the probability of improvement's interval reaches 0.5"
    return f"intervals overlap, except for {_join(apart)}, where the probability of improvement's interval reaches 0.5"


def _gaps_clause(summary: dict) -> str:
    """The top arm against each other arm (supported, or within noise), then the other pairs in brief."""
    ranked = _ranked(summary)
    top, rest = ranked[0], ranked[1:]
    pairs = [(o, _oriented(summary, top, o)) for o in rest]
    pairs = [(o, c) for o, c in pairs if c is not None]
    if not pairs:
        return ""
    ahead = [(o, c) for o, c in pairs if _supported(summary, top, o, c)]
    noise = [(o, c) for o, c in pairs if not _supported(summary, top, o, c)]
    ahead_text = (
        f"supported over {_join([o for o, _ in ahead])} ({_level(summary)} intervals apart; "
        + ", ".join(_poi_text(top, o, c) for o, c in ahead)
        + ")"
    )
    noise_text = (
        f"within noise over {_join([o for o, _ in noise])}: needs more seeds ({_noise_reason(noise)}; "
        + ", ".join(_poi_text(top, o, c) for o, c in noise)
        + ")"
    )
    if ahead and noise:
        out = f"{top}'s lead is {ahead_text} but {noise_text}."
    else:
        out = f"{top}'s lead is {ahead_text if ahead else noise_text}."

    # Pairs without the top arm: only the supported gaps are named, so that nothing is lost from
    # the old per-pair list without repeating every P(x > y).
    others = []
    for i, x in enumerate(rest):
        for y in rest[i + 1 :]:
            c = _oriented(summary, x, y)
            if c is not None:
                others.append((x, y, c))
    if not others:
        return out
    shown = [f"{x} over {y} ({_poi_text(x, y, c)})" for x, y, c in others if _supported(summary, x, y, c)]
    if not shown:
        return out + " No gap among the other arms is supported."
    tail = "; the others are within noise" if len(shown) < len(others) else ""
    return out + f" Among the other arms, supported: {', '.join(shown)}{tail}."


def _statistics_line(summary: dict) -> str:
    """What the tests support: seeds learned per arm, and the top arm's lead over each other arm."""
    line = _learned_clause(summary)
    # With indistinct arms there is no top arm: the ranking line already says nothing separates them.
    gaps = "" if _indistinct(summary) else _gaps_clause(summary)
    return f"{line} {gaps}" if gaps else line


def _carry_clause(summary: dict, kind: str, with_base: bool = True) -> str | None:
    """One pairing with a base partner across arms, against base × base, arms grouped by verdict.

    Args:
      summary: As for ``learned_sentences``.
      kind: "crossplay" (trained A × base B) or "crossplay_bA" (base A × trained B).
      with_base: Name base × base's interval in the clause (once per line is enough).
    """
    arms = [a for a in _ranked(summary) if kind in summary["per_arm"][a]["kinds"]]
    if not arms:
        return None
    base = summary["base"]
    groups: dict[str, list[tuple[str, dict]]] = {"above": [], "overlap": [], "below": []}
    for arm in arms:
        k = summary["per_arm"][arm]["kinds"][kind]
        verdict = "overlap" if k["overlaps_base"] else "above" if k["lo"] > base["hi"] else "below"
        groups[verdict].append((arm, k))
    every = len(arms) == len(summary["arms"])
    say = {
        "above": ("is above", "are above", ", so the skill carries over to a base partner"),
        "overlap": ("overlaps", "overlap", ", so no carry-over to a base partner is shown"),
        "below": ("is below", "are below", ": the pairing does worse than two base models"),
    }
    parts = []
    for verdict, group in groups.items():
        if group:
            subject = _arm_values(group, every=every and len(group) == len(arms))
            one, many, why = say[verdict]
            verb = one if len(group) == 1 or subject.startswith("every arm") else many
            parts.append(f"{subject} {verb} it{why}")
    label = "Cross-play (trained A × base B)" if kind == "crossplay" else "Base A × trained B"
    ref = f"base × base {_ci(base)}" if with_base else "the same base × base"
    return f"{label} against {ref}: " + "; ".join(parts) + "."


def _crossplay_line(summary: dict) -> str | None:
    clauses = []
    for kind in ("crossplay", "crossplay_bA"):
        clause = _carry_clause(summary, kind, with_base=not clauses)
        if clause:
            clauses.append(clause)
    return " ".join(clauses) or None


def _is_ada(arm: str) -> bool:
    # Reinforce-Ada arms: "ada" and variants such as "ada_mixed" (DESIGN: the next arm to add).
    return arm == "ada" or arm.startswith("ada_")


def _cost_line(summary: dict) -> str | None:
    """Reinforce-Ada's extra sampling (chats drawn per training step) against the other arms."""
    drawn = {a: summary["per_arm"][a].get("train", {}).get("chats_drawn_per_step") for a in summary["arms"]}
    drawn = {a: v for a, v in drawn.items() if v is not None}
    ada = [a for a in drawn if _is_ada(a)]
    others = [a for a in drawn if not _is_ada(a)]
    if not ada or not others:
        return None
    ref = sum(drawn[a] for a in others) / len(others)
    if len({_f(drawn[a], 1) for a in others}) == 1:
        against = f"{_f(ref, 1)} for {_join(others)}"
    else:
        against = ", ".join(f"{a} {_f(drawn[a], 1)}" for a in others) + f" (mean {_f(ref, 1)})"
    ada_text = _join([f"{a} {_f(drawn[a], 1)}" for a in ada])
    ratio = f" ({', '.join(f'{drawn[a] / ref:.2f}×' for a in ada)})" if ref > 0 else ""
    return (
        f"Cost of Reinforce-Ada's adaptive sampling: chats drawn per training step, {ada_text} against "
        f"{against}{ratio}."
    )


def _seat_mean(figures: dict, key: str) -> float | None:
    xs = [figures.get(f"{key}_{s}") for s in ("A", "B")]
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _extremes(summary: dict, key: str, digits: int) -> tuple[str, str, str] | None:
    """(lowest arm and value, highest arm and value, base value) of a seat-averaged figure.

    None where fewer than two arms have the figure or all print the same: then there is no
    difference to report.
    """
    vals = {a: _seat_mean(_eval(summary, a).get("figures") or {}, key) for a in summary["arms"]}
    vals = {a: v for a, v in vals.items() if v is not None}
    if len(vals) < 2 or len({_f(v, digits) for v in vals.values()}) == 1:
        return None
    lo, hi = min(vals, key=vals.get), max(vals, key=vals.get)
    base = _seat_mean(summary["base"], key)
    return f"{lo} {_f(vals[lo], digits)}", f"{hi} {_f(vals[hi], digits)}", _f(base, digits)


def _messages_line(summary: dict) -> str | None:
    """Message length and partner-fact use, only where the arms differ (point means, no intervals)."""
    parts = []
    chars = _extremes(summary, "chars", 0)
    if chars:
        parts.append(f"characters per message from {chars[0]} to {chars[1]} (base × base {chars[2]})")
    use = _extremes(summary, "partner_use", 2)
    if use:
        parts.append(f"partner-fact use from {use[0]} to {use[1]} (base × base {use[2]})")
    if not parts:
        return None
    return "Messages (held-out, mean over seeds and seats; point values without intervals): " + "; ".join(parts) + "."


def learned_sentences(summary: dict) -> list[str]:
    """The Learned section: a few lines summarizing the numbers of ``summary`` (pure; no I/O).

    In order, each line present only where the summary has its numbers:

    1. The arms ranked by held-out mean team accuracy, each with its interval and seeds learned,
       and base × base for reference; "nothing separates the arms" when all print the same.
    2. What the statistics support: seeds learned per arm (paired test against base × base),
       then the top arm's lead over each other arm, "supported" only where the intervals are
       apart and the probability of improvement's interval lies above 0.5, else "within noise:
       needs more seeds"; arms sharing a verdict share a clause.
    3. Cross-play (trained A × base B), then base A × trained B, against base × base.
    4. Reinforce-Ada's extra chats drawn per training step against the other arms.
    5. Message length and partner-fact use, only where the arms differ.

    Args:
      summary: As returned by ``aggregate.summarize`` (only ``alpha``, ``arms``, ``base``,
        ``per_arm`` and ``comparisons`` are read; ``train`` and ``figures`` are optional).

    Returns:
      The lines, without bullets.
    """
    lines = [
        _ranking_line(summary),
        _statistics_line(summary),
        _crossplay_line(summary),
        _cost_line(summary),
        _messages_line(summary),
    ]
    return [s for s in lines if s]


# ---------------------------------------------------------------------------------------------
# card.md
# ---------------------------------------------------------------------------------------------


def _recipe_lines(recipe: dict, cpu: bool = False) -> list[str]:
    def show(v):
        return ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    lines, done = [], {"liger_kernels", "cohort"}  # said below in words
    for key, label in RECIPE_LABELS:
        if key in recipe:
            lines.append(f"- {label}: {show(recipe[key])}")
            done.add(key)
    lines += [f"- {k}: {show(v)}" for k, v in recipe.items() if k not in done]
    if "liger_kernels" in recipe:
        did = (
            "no (train.liger_kernels: false)"
            if not recipe["liger_kernels"]
            else "no: these runs were on a CPU, which runs eager (the switch is on, for a CUDA GPU)"
            if cpu
            else "yes"
        )
        lines.append(f"- Liger kernels (RMSNorm, SwiGLU, RoPE) in the training forward: {did}")
    if "cohort" in recipe:  # how the seeds trained: a cohort's seed is not bitwise its lone run
        lines.append(_seeds_line(recipe["cohort"], recipe.get("arms", [])))
    if recipe.get("loss_type") == "dapo":
        lines.append(DAPO_NOTE)
    return lines


def _seeds_line(cohort, arms) -> str:
    """How the seeds trained: ``train.cohort`` is true (every arm), false, or a list of arms."""
    how = (
        "as one cohort (one process, their chats decoded as one batch, each seed its own adapter, optimizer "
        "and data order; train.cohort)"
    )
    chosen = list(cohort) if isinstance(cohort, (list, tuple)) else []
    together = [a for a in arms if a in chosen] if arms else chosen  # a recipe without its arms: the list as given
    rest = [a for a in arms if a not in together]
    if cohort is True or together and not rest:
        return f"- Seeds trained: an arm's seeds {how}" + (
            f" ({', '.join(together)})" if not arms and together else ""
        )
    if not together:
        return "- Seeds trained: each seed its own run"
    return f"- Seeds trained: {', '.join(together)}: an arm's seeds {how}; {', '.join(rest)}: each seed its own run"


# What TRL's dapo normaliser (the token sum divided by every scored token of the generation batch)
# means for the arms' updates: a reader comparing step sizes across arms needs both facts.
DAPO_NOTE = (
    "- Loss normalisation: `dapo` divides the token sum by every scored token of the step's batch, so "
    "RAFT's unsolved chats (advantage 0) still count in the denominator and shrink its solved chats' "
    "weight, and mixed, whose base-partner B turns are not trained (a quarter of its seat turns), "
    "has ~25% fewer scored tokens a step than GRPO."
)


def _is_cpu(summary: dict, meta: dict) -> bool:
    devices = summary.get("compute", {}).get("devices") or [str(meta.get("device", ""))]
    return all(str(d).lower().startswith("cpu") for d in devices)


def _offline_banner(meta: dict) -> tuple[str, str] | None:
    """(first line of card.md, figure title) for an offline card, or None for a real run.

    ``meta["offline"]`` is the switch. The toy-world banner is the default; only a meta that sets
    ``warmstart`` to None (an offline model that was never trained) gets the untrained one, so the
    card never says "warm-started" of a model that was not.
    """
    if not meta.get("offline"):
        return None
    if "warmstart" in meta and meta["warmstart"] is None:
        return OFFLINE_UNTRAINED_LINE, OFFLINE_UNTRAINED_TITLE
    return OFFLINE_LINE, OFFLINE_TITLE


def _setup_lines(meta: dict) -> list[str]:
    """Run lines on what the model was trained on and prompted with, where ``meta`` says so."""
    lines = []
    if meta.get("world"):
        lines.append(f"- World: {meta['world']}")
    warm = meta.get("warmstart")
    if warm:
        detail = (
            ", ".join(f"{str(k).replace('_', ' ')} {v}" for k, v in warm.items())
            if isinstance(warm, dict)
            else str(warm)
        )
        lines.append(f"- Warm start: SFT, {detail}")
    prompt = meta.get("prompt")
    if prompt == "short":
        # The short prompt departs from the recipe; a reader comparing with Qwen runs must see it.
        lines.append("- Seat prompts: the short system prompt (the toy world's), not the recipe's")
    elif prompt == "full":
        lines.append("- Seat prompts: the recipe's system prompt")
    elif prompt:
        lines.append(f"- Seat prompts: {prompt}")
    return lines


def _run_lines(summary: dict, meta: dict) -> list[str]:
    c = summary["compute"]
    unit = "CPU" if _is_cpu(summary, meta) else "GPU"
    versions = ", ".join(f"{k} {v}" for k, v in sorted((c.get("versions") or {}).items()))
    train = (c["train_gen_s"] or 0.0) + (c["train_train_s"] or 0.0)
    return [
        f"- Model: {meta.get('model', 'n/a')}",
        f"- Data: {meta.get('data', 'n/a')}; {summary['n_problems']} held-out problems",
        *_setup_lines(meta),
        f"- Machine: {meta.get('device', 'n/a')} (eval devices: {', '.join(c['devices'])})",
        f"- {unit} seconds: training {_seconds(train)} (generation {_seconds(c['train_gen_s'])}, updates "
        f"{_seconds(c['train_train_s'])}), evaluation {_seconds(c['eval_wall_s'])}, total {_seconds(c['total_s'])}",
        f"- Software: {versions or 'n/a'}; git {c.get('git') or 'n/a'}",
        f"- Statistics: {summary['n_boot']} bootstrap replicates, {_level(summary)} intervals, stats seed "
        f"{summary['seed']}",
    ]


def _result_lines(summary: dict) -> list[str]:
    seeds = ", ".join(map(str, summary["seeds"]))
    lines = [
        f"| arm | held-out mean [lo, hi] | held-out per seed ({seeds}) | seeds learned | cross-play "
        f"(trained A × base B) | base A × trained B | chats drawn / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in summary["arms"]:
        a = summary["per_arm"][arm]
        k = a["kinds"]
        per_seed = ", ".join(_f(p["value"]) for p in k["eval"]["per_seed"])
        lines.append(
            f"| {arm} | {_ci(k['eval'])} | {per_seed} | {a['seeds_learned']}/{a['n_seeds']} | "
            f"{_ci(k['crossplay'])} | {_ci(k['crossplay_bA'])} | {_f(a['train']['chats_drawn_per_step'], 1)} |"
        )
    lines.append(f"| base × base | {_ci(summary['base'])} | — | — | — | — | — |")
    lines += [
        "",
        f"Team accuracy = mean team reward (A right + B right) / 2 over {summary['n_problems']} held-out problems. "
        f"Arm intervals: {_level(summary)} hierarchical bootstrap over seeds and problems; base × base: bootstrap "
        f"over problems. Learned: held-out beats base × base in a one-sided paired bootstrap over problems at "
        f"{_level(summary)}.",
        "",
        "Messages (held-out, mean over seeds):",
        "",
        "| arm | chars / seat A | chars / seat B | partner-fact use A | partner-fact use B | no-box rate | both right |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in summary["arms"]:
        f = summary["per_arm"][arm]["kinds"]["eval"]["figures"]
        lines.append(
            f"| {arm} | {_f(f['chars_A'], 0)} | {_f(f['chars_B'], 0)} | {_f(f['partner_use_A'])} | "
            f"{_f(f['partner_use_B'])} | {_f(f['no_box_rate'])} | {_f(f['both_right'])} |"
        )
    b = summary["base"]
    lines.append(
        f"| base × base | {_f(b['chars_A'], 0)} | {_f(b['chars_B'], 0)} | {_f(b['partner_use_A'])} | "
        f"{_f(b['partner_use_B'])} | {_f(b['no_box_rate'])} | {_f(b['both_right'])} |"
    )
    return lines


def _checks_lines(summary: dict, checks: dict) -> list[str]:
    st = checks["selftest"]
    items = st.get("checks", [])
    n_ok = sum(bool(c.get("passed")) for c in items)
    lines = [f"Selftest: **{'PASSED' if st['passed'] else 'FAILED'}** ({n_ok} of {len(items)} checks passed)", ""]
    for c in items:
        detail = f": {c['detail']}" if c.get("detail") not in (None, "") else ""
        lines.append(f"- [{'x' if c.get('passed') else ' '}] {c['name']}{detail}")
    lines += [
        "",
        "Split statistics (fact sentences dealt alternately to A and B; the last sentence, the question, goes to both):",
        "",
        "| part | total | eligible | dropped (why) | drawn | sentences A mean (min–max) | sentences B mean (min–max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for part in ("train", "heldout"):
        s = checks["split_stats"][part]
        dropped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in s["dropped"].items()) or "none"
        seat = s.get("sentences_per_seat", {})

        def sps(x, seat=seat):
            d = seat.get(x)
            return f"{_f(d['mean'])} ({d['min']}–{d['max']})" if d else "n/a"

        lines.append(
            f"| {part} | {s['total']} | {s['eligible']} | {dropped} | {s['drawn']} | {sps('a')} | {sps('b')} |"
        )
    prompts = [summary["per_arm"][a]["train"]["longest_prompt"] for a in summary["arms"]]
    prompts = [p for p in prompts if p is not None]
    lines += ["", "Sanity figures:", ""]
    lines.append(f"- Longest seat prompt in training: {max(prompts) if prompts else 'n/a'} tokens")
    nobox = "; ".join(
        f"{a} " + ", ".join(_f(summary["per_arm"][a]["kinds"][k]["figures"]["no_box_rate"]) for k in KINDS)
        for a in summary["arms"]
    )
    lines.append(
        f"- No-box rate of final messages (held-out, cross-play, base A × trained B): {nobox}; "
        f"base × base {_f(summary['base']['no_box_rate'])}"
    )
    zero = "; ".join(f"{a} {_f(summary['per_arm'][a]['train']['zero_adv_share'])}" for a in summary["arms"])
    lines.append(f"- Share of zero-advantage problems per training step (mean): {zero}")
    return lines


def _climb_lines(summary: dict, png_ref: str) -> list[str]:
    lines = [
        f"![Results and training curves]({png_ref})",
        "",
        "Right panel of the figure: mean training reward per step per arm (thin lines: seeds). "
        "First → last mean reward:",
        "",
    ]
    for arm in summary["arms"]:
        t = summary["per_arm"][arm]["train"]
        k = t["window"]
        span = "step" if k == 1 else f"{k} steps"
        lines.append(
            f"- {arm}: {_f(t['first_reward'])} → {_f(t['last_reward'])} (first → last {span}, mean over "
            f"{summary['per_arm'][arm]['n_seeds']} seeds)"
        )
    return lines


def render_card(summary: dict, meta: dict, checks: dict, png_ref: str = "card.png") -> str:
    """The text of card.md for ``summary``; ``checks`` holds ``selftest`` and ``split_stats``."""
    banner = _offline_banner(meta)
    lines = [banner[0], ""] if banner else []
    lines += [
        "# Talk Methods card",
        "",
        "Which RL method best teaches two copies of a model, each holding half of the facts of a GSM8K "
        "problem, to talk their way to a right answer?",
        "",
    ]
    lines += ["## Recipe", ""] + _recipe_lines(meta.get("recipe", {}), cpu=_is_cpu(summary, meta)) + [""]
    lines += ["## Run", ""] + _run_lines(summary, meta) + [""]
    lines += ["## Result", ""] + _result_lines(summary) + [""]
    lines += ["## Checks", ""] + _checks_lines(summary, checks) + [""]
    lines += ["## Climb", ""] + _climb_lines(summary, png_ref) + [""]
    lines += ["## Learned", ""] + [f"- {s}" for s in learned_sentences(summary)] + [""]
    lines += ["## References", ""] + [f"- {r}" for r in REFERENCES]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# card.png
# ---------------------------------------------------------------------------------------------


def plot_card(summary: dict, path: str | os.PathLike, offline: bool = False, title: str | None = None) -> None:
    """Draw card.png to ``path`` (not atomic; ``write_card`` wraps it).

    Args:
      summary: From ``aggregate.summarize``.
      path: Where the PNG goes.
      offline: The card is from an offline run: a red title says what its numbers are about.
      title: That title; ``OFFLINE_TITLE`` when None.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    arms = summary["arms"]
    colors = [f"C{i % 10}" for i in range(len(arms))]
    kind_style = {"eval": ("o", -0.22), "crossplay": ("s", 0.0), "crossplay_bA": ("^", 0.22)}
    fig = Figure(figsize=(14, 5.5), dpi=110, layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1.1, 1])

    base = summary["base"]
    left.axhspan(base["lo"], base["hi"], color="0.85", alpha=0.6, lw=0)
    handles = [Line2D([], [], color="0.35", ls="--", lw=1.2, label=f"base × base {_ci(base)} (band: interval)")]
    for kind in KINDS:
        marker, dx = kind_style[kind]
        for i, (arm, color) in enumerate(zip(arms, colors)):
            k = summary["per_arm"][arm]["kinds"][kind]
            vals = [p["value"] for p in k["per_seed"]]
            n = len(vals)
            jitter = [(j - (n - 1) / 2) * 0.03 for j in range(n)]
            left.scatter(
                [i + dx + 0.09 + t for t in jitter],
                vals,
                s=14,
                color=color,
                alpha=0.5,
                marker=marker,
                edgecolors="none",
            )
            err = [[max(0.0, k["mean"] - k["lo"])], [max(0.0, k["hi"] - k["mean"])]]
            left.errorbar([i + dx], [k["mean"]], yerr=err, fmt=marker, color=color, ms=7, capsize=4, lw=1.6)
        handles.append(Line2D([], [], color="0.2", marker=marker, ls="", ms=7, label=KIND_LABELS[kind]))
    left.axhline(base["mean"], color="0.35", ls="--", lw=1.2)
    left.set_xticks(range(len(arms)), arms)
    left.set_xlim(-0.6, len(arms) - 0.4)
    left.set_ylabel("team accuracy")
    left.set_title(f"Per-seed values (dots) and mean with {_level(summary)} interval")
    left.grid(axis="y", alpha=0.3)
    left.legend(handles=handles, fontsize=8, loc="best")

    for arm, color in zip(arms, colors):
        t = summary["per_arm"][arm]["train"]
        for c in t["curves"]:
            right.plot(c["steps"], c["reward"], color=color, lw=0.8, alpha=0.35)
        mc = t["mean_curve"]
        right.plot(
            mc["steps"],
            mc["reward"],
            color=color,
            lw=2.2,
            label=f"{arm} (mean of {len(t['curves'])} seeds)",
            marker="o" if len(mc["steps"]) < 12 else None,
            ms=3,
        )
    right.set_xlabel("training step")
    right.set_ylabel("mean team reward of the step's rollouts")
    right.set_title("Training curves (thin lines: seeds)")
    right.grid(alpha=0.3)
    right.legend(fontsize=8, loc="best")
    if offline:
        fig.suptitle(title or OFFLINE_TITLE, color="C3", fontsize=11)
    fig.savefig(path, format="png")


def write_card(
    summary: dict,
    results_dir: str | os.PathLike,
    card_md_path: str | os.PathLike,
    card_png_path: str | os.PathLike,
    meta: dict,
) -> None:
    """Write card.md and card.png atomically.

    Args:
      summary: From ``aggregate.summarize`` (or its JSON).
      results_dir: The results directory; its ``selftest.json`` and ``data/split_stats.json`` are
        read when the summary carries no ``checks``.
      card_md_path: Where card.md goes.
      card_png_path: Where card.png goes (card.md links it by its path relative to card.md).
      meta: See the module docstring (model, data, device, recipe, offline, world, warmstart, prompt).

    Raises:
      ResultsError: The checks are neither in the summary nor readable from ``results_dir``.
    """
    results_dir = Path(results_dir)
    checks = summary.get("checks")
    if not checks:
        checks = {
            "selftest": load_selftest(results_dir / "selftest.json"),
            "split_stats": load_split_stats(results_dir / "data" / "split_stats.json"),
        }
    for key in ("selftest", "split_stats"):
        if key not in checks:
            raise ResultsError(f"summary of {results_dir}: checks lack {key!r}")
    md, png = Path(card_md_path), Path(card_png_path)
    png_ref = Path(os.path.relpath(png.resolve(), md.resolve().parent)).as_posix()
    text = render_card(summary, meta, checks, png_ref)
    banner = _offline_banner(meta)
    with atomic_path(png) as tmp:
        plot_card(summary, tmp, offline=banner is not None, title=banner[1] if banner else None)
    write_text(md, text)
    log.info("wrote %s and %s", md, png)


def write_train_curve(log_path: str | os.PathLike, png_path: str | os.PathLike, title: str) -> None:
    """One run's training curve (mean team reward and both-right rate per step) as a PNG, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from talkmethods.aggregate import load_train_log

    lines = load_train_log(Path(log_path))
    steps = [ln["step"] for ln in lines]
    fig, ax = plt.subplots(figsize=(5, 3), dpi=110)
    ax.plot(steps, [ln["reward"] for ln in lines], marker="o", ms=3, label="mean team reward")
    ax.plot(steps, [ln["both_right"] for ln in lines], marker=".", ms=3, ls="--", label="both right")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
