"""The results card: ``card.md`` (Recipe, Run, Result, Checks, Climb, Learned, References) and ``card.png``.

Everything on the card comes from a summary made by ``talkmethods.aggregate.summarize`` and a small
``meta`` dict naming what the run was built from. The Learned section is generated from the
numbers by ``learned_sentences`` (a pure function): where two arms' intervals overlap it says the
gap needs more seeds, and it never states more than the intervals, tests and counts show.

``meta`` keys:
  * ``model``: model name (hub id, local dir or the offline tiny model).
  * ``data``: data source (e.g. "openai/gsm8k (main): train 1,024 / test 300").
  * ``device``: the machine (e.g. "1x NVIDIA H200").
  * ``recipe``: dict of recipe values, e.g. steps, problems_per_step, chats_per_problem,
    learning_rate, lora_r, lora_alpha, loss_type ("dapo"), beta (0), num_iterations (1),
    temperature, max_new_tokens, seeds, arms; any other key is listed as is.
  * ``offline``: True for the offline default; the card's first line then says that its numbers
    exercise the pipeline and say nothing about the methods.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from talkmethods.aggregate import KINDS, ResultsError, load_selftest, load_split_stats
from talkmethods.atomic import atomic_path, write_text

log = logging.getLogger(__name__)

__all__ = ["OFFLINE_LINE", "REFERENCES", "KIND_LABELS", "learned_sentences", "render_card", "plot_card",
           "write_card"]

OFFLINE_LINE = ("**Offline default: the numbers on this card exercise the pipeline and say nothing about the "
                "methods** (tiny model, generated problems).")

KIND_LABELS = {
    "eval": "held-out (trained A × trained B)",
    "crossplay": "cross-play (trained A × base B)",
    "crossplay_bA": "base A × trained B",
}

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
# Learned: sentences from the numbers.
# ---------------------------------------------------------------------------------------------


def _pair_sentence(summary: dict, comp: dict) -> str:
    x, y = comp["x"], comp["y"]
    ex, ey = (summary["per_arm"][a]["kinds"]["eval"] for a in (x, y))
    nx, ny = summary["per_arm"][x]["n_seeds"], summary["per_arm"][y]["n_seeds"]
    poi = f"P({x} > {y}) = {_f(comp['poi'])} [{_f(comp['lo'])}, {_f(comp['hi'])}]"
    if comp["overlap"]:
        return (f"The gap between {x} ({_ci(ex)}) and {y} ({_ci(ey)}) in held-out team accuracy needs more "
                f"seeds: the {_level(summary)} intervals overlap ({poi}, over {nx} and {ny} seeds).")
    if ex["mean"] >= ey["mean"]:
        win, lose, ew, el, p, lo, hi = x, y, ex, ey, comp["poi"], comp["lo"], comp["hi"]
    else:  # P(y > x) = 1 - P(x > y), ties counting 1/2; the interval flips with it.
        win, lose, ew, el, p, lo, hi = y, x, ey, ex, 1 - comp["poi"], 1 - comp["hi"], 1 - comp["lo"]
    return (f"{win} ({_ci(ew)}) is ahead of {lose} ({_ci(el)}) in held-out team accuracy: the "
            f"{_level(summary)} intervals do not overlap, and the probability of improvement "
            f"P({win} > {lose}) = {_f(p)} [{_f(lo)}, {_f(hi)}] over {nx} and {ny} seeds.")


def _learned_sentence(summary: dict, arm: str) -> str:
    a = summary["per_arm"][arm]
    ps = a["kinds"]["eval"]["per_seed"]
    detail = "; ".join(f"seed {p['seed']}: {_f(p['value'])}, {_p(p['p_value'])}" for p in ps)
    return (f"{arm} learned on {a['seeds_learned']} of {a['n_seeds']} seeds (held-out team accuracy above "
            f"base × base {_ci(summary['base'])} in a one-sided paired bootstrap over problems at "
            f"{_level(summary)}; {detail}).")


def _carry_sentence(summary: dict, arm: str, kind: str) -> str:
    k = summary["per_arm"][arm]["kinds"][kind]
    n = summary["per_arm"][arm]["n_seeds"]
    base = summary["base"]
    where = "with a base partner in seat B (trained A × base B)" if kind == "crossplay" else \
        "with a base partner in seat A (base A × trained B)"
    seeds = f"it beats base × base on {k['seeds_beat_base']} of {n} seeds"
    if k["overlaps_base"]:
        return (f"{arm} {where} scores {_ci(k)} against base × base {_ci(base)}: the intervals overlap, so no "
                f"carry-over to a base partner is shown ({seeds}).")
    if k["lo"] > base["hi"]:
        return (f"{arm} {where} scores {_ci(k)}, above base × base {_ci(base)}: the skill carries over to a "
                f"base partner ({seeds}).")
    return (f"{arm} {where} scores {_ci(k)}, below base × base {_ci(base)}: the pairing does worse than two "
            f"base models ({seeds}).")


def learned_sentences(summary: dict) -> list[str]:
    """The Learned section's claims, generated from the numbers of ``summary`` (pure; no I/O).

    In order: one sentence per pair of arms on held-out team accuracy ("needs more seeds" where
    the intervals overlap; otherwise the winner with both intervals and its probability of
    improvement), then per arm the seeds learned (k of n, with each seed's value and p-value),
    then per arm the carry-over of cross-play (trained A × base B) and of base A × trained B
    against base × base. Every sentence carries the numbers it rests on.

    Args:
      summary: As returned by ``aggregate.summarize`` (only ``alpha``, ``arms``, ``base``,
        ``per_arm`` and ``comparisons`` are read).
    """
    out = [_pair_sentence(summary, c) for c in summary["comparisons"]]
    out += [_learned_sentence(summary, arm) for arm in summary["arms"]]
    for arm in summary["arms"]:
        for kind in ("crossplay", "crossplay_bA"):
            if kind in summary["per_arm"][arm]["kinds"]:
                out.append(_carry_sentence(summary, arm, kind))
    return out


# ---------------------------------------------------------------------------------------------
# card.md
# ---------------------------------------------------------------------------------------------


def _recipe_lines(recipe: dict) -> list[str]:
    def show(v):
        return ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    lines, done = [], set()
    for key, label in RECIPE_LABELS:
        if key in recipe:
            lines.append(f"- {label}: {show(recipe[key])}")
            done.add(key)
    lines += [f"- {k}: {show(v)}" for k, v in recipe.items() if k not in done]
    return lines


def _is_cpu(summary: dict, meta: dict) -> bool:
    devices = summary.get("compute", {}).get("devices") or [str(meta.get("device", ""))]
    return all(str(d).lower().startswith("cpu") for d in devices)


def _run_lines(summary: dict, meta: dict) -> list[str]:
    c = summary["compute"]
    unit = "CPU" if _is_cpu(summary, meta) else "GPU"
    versions = ", ".join(f"{k} {v}" for k, v in sorted((c.get("versions") or {}).items()))
    train = (c["train_gen_s"] or 0.0) + (c["train_train_s"] or 0.0)
    return [
        f"- Model: {meta.get('model', 'n/a')}",
        f"- Data: {meta.get('data', 'n/a')}; {summary['n_problems']} held-out problems",
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
        lines.append(f"| {arm} | {_ci(k['eval'])} | {per_seed} | {a['seeds_learned']}/{a['n_seeds']} | "
                     f"{_ci(k['crossplay'])} | {_ci(k['crossplay_bA'])} | {_f(a['train']['chats_drawn_per_step'], 1)} |")
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
        lines.append(f"| {arm} | {_f(f['chars_A'], 0)} | {_f(f['chars_B'], 0)} | {_f(f['partner_use_A'])} | "
                     f"{_f(f['partner_use_B'])} | {_f(f['no_box_rate'])} | {_f(f['both_right'])} |")
    b = summary["base"]
    lines.append(f"| base × base | {_f(b['chars_A'], 0)} | {_f(b['chars_B'], 0)} | {_f(b['partner_use_A'])} | "
                 f"{_f(b['partner_use_B'])} | {_f(b['no_box_rate'])} | {_f(b['both_right'])} |")
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

        def sps(x):
            d = seat.get(x)
            return f"{_f(d['mean'])} ({d['min']}–{d['max']})" if d else "n/a"

        lines.append(f"| {part} | {s['total']} | {s['eligible']} | {dropped} | {s['drawn']} | {sps('a')} | {sps('b')} |")
    prompts = [summary["per_arm"][a]["train"]["longest_prompt"] for a in summary["arms"]]
    prompts = [p for p in prompts if p is not None]
    lines += ["", "Sanity figures:", ""]
    lines.append(f"- Longest seat prompt in training: {max(prompts) if prompts else 'n/a'} tokens")
    nobox = "; ".join(
        f"{a} " + ", ".join(_f(summary["per_arm"][a]["kinds"][k]["figures"]["no_box_rate"]) for k in KINDS)
        for a in summary["arms"])
    lines.append(f"- No-box rate of final messages (held-out, cross-play, base A × trained B): {nobox}; "
                 f"base × base {_f(summary['base']['no_box_rate'])}")
    zero = "; ".join(f"{a} {_f(summary['per_arm'][a]['train']['zero_adv_share'])}" for a in summary["arms"])
    lines.append(f"- Share of zero-advantage problems per training step (mean): {zero}")
    return lines


def _climb_lines(summary: dict, png_ref: str) -> list[str]:
    lines = [f"![Results and training curves]({png_ref})", "",
             "Right panel of the figure: mean training reward per step per arm (thin lines: seeds). "
             "First → last mean reward:", ""]
    for arm in summary["arms"]:
        t = summary["per_arm"][arm]["train"]
        k = t["window"]
        span = "step" if k == 1 else f"{k} steps"
        lines.append(f"- {arm}: {_f(t['first_reward'])} → {_f(t['last_reward'])} (first → last {span}, mean over "
                     f"{summary['per_arm'][arm]['n_seeds']} seeds)")
    return lines


def render_card(summary: dict, meta: dict, checks: dict, png_ref: str = "card.png") -> str:
    """The text of card.md for ``summary``; ``checks`` holds ``selftest`` and ``split_stats``."""
    lines = [OFFLINE_LINE, ""] if meta.get("offline") else []
    lines += ["# Talk Methods card", "",
              "Which RL method best teaches two copies of a model, each holding half of the facts of a GSM8K "
              "problem, to talk their way to a right answer?", ""]
    lines += ["## Recipe", ""] + _recipe_lines(meta.get("recipe", {})) + [""]
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


def plot_card(summary: dict, path: str | os.PathLike, offline: bool = False) -> None:
    """Draw card.png to ``path`` (not atomic; ``write_card`` wraps it)."""
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
            left.scatter([i + dx + 0.09 + t for t in jitter], vals, s=14, color=color, alpha=0.5, marker=marker,
                         edgecolors="none")
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
        right.plot(mc["steps"], mc["reward"], color=color, lw=2.2, label=f"{arm} (mean of {len(t['curves'])} seeds)",
                   marker="o" if len(mc["steps"]) < 12 else None, ms=3)
    right.set_xlabel("training step")
    right.set_ylabel("mean team reward of the step's rollouts")
    right.set_title("Training curves (thin lines: seeds)")
    right.grid(alpha=0.3)
    right.legend(fontsize=8, loc="best")
    if offline:
        fig.suptitle("Offline default: these numbers exercise the pipeline and say nothing about the methods",
                     color="C3", fontsize=11)
    fig.savefig(path, format="png")


def write_card(summary: dict, results_dir: str | os.PathLike, card_md_path: str | os.PathLike,
               card_png_path: str | os.PathLike, meta: dict) -> None:
    """Write card.md and card.png atomically.

    Args:
      summary: From ``aggregate.summarize`` (or its JSON).
      results_dir: The results directory; its ``selftest.json`` and ``data/split_stats.json`` are
        read when the summary carries no ``checks``.
      card_md_path: Where card.md goes.
      card_png_path: Where card.png goes (card.md links it by its path relative to card.md).
      meta: See the module docstring (model, data, device, recipe, offline).

    Raises:
      ResultsError: The checks are neither in the summary nor readable from ``results_dir``.
    """
    results_dir = Path(results_dir)
    checks = summary.get("checks")
    if not checks:
        checks = {"selftest": load_selftest(results_dir / "selftest.json"),
                  "split_stats": load_split_stats(results_dir / "data" / "split_stats.json")}
    for key in ("selftest", "split_stats"):
        if key not in checks:
            raise ResultsError(f"summary of {results_dir}: checks lack {key!r}")
    md, png = Path(card_md_path), Path(card_png_path)
    png_ref = Path(os.path.relpath(png.resolve(), md.resolve().parent)).as_posix()
    text = render_card(summary, meta, checks, png_ref)
    with atomic_path(png) as tmp:
        plot_card(summary, tmp, offline=bool(meta.get("offline")))
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
