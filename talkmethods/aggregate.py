"""Collect every eval, cross-play and training log of a results directory into one summary.

Layout read (all under a results directory ``R``)::

    R/base/eval.json                          kind "base": base A x base B
    R/{arm}/seed{seed}/eval.json              kind "eval": trained A x trained B (held-out)
    R/{arm}/seed{seed}/crossplay.json         kind "crossplay": trained A x base B
    R/{arm}/seed{seed}/crossplay_bA.json      kind "crossplay_bA": base A x trained B
    R/{arm}/seed{seed}/train_log.jsonl        one line per optimizer step (training.runs.StepLog)
    R/data/split_stats.json                   split.draw_problems' statistics
    R/selftest.json                           {"passed": bool, "checks": [{name, passed, detail}]}

``summarize`` returns a JSON-ready dict (see its docstring); ``write_summary`` writes its rows as CSV
and the whole dict as JSON, both atomically. DESIGN §3: a run *learned* when its held-out team
accuracy beats base x base in a one-sided paired bootstrap over problems (paired by problem id);
per arm, the mean comes with a hierarchical bootstrap interval over seeds and problems; arms are
compared by the probability of improvement over per-seed held-out team accuracy.

Every random draw is seeded from the ``seed`` argument and a stable name of what is being
estimated, so the summary is the same on every call and adding an arm does not move the numbers
of the others. A missing or malformed input raises ``ResultsError`` naming the file.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import zlib
from collections.abc import Iterable, Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from talkmethods import stats
from talkmethods.atomic import write_json, write_text
from talkmethods.recipe import EVAL_KINDS, RUN_EVAL_KINDS

log = logging.getLogger(__name__)

__all__ = [
    "CSV_COLUMNS",
    "KINDS",
    "ResultsError",
    "eval_schema",
    "validate_eval",
    "load_eval",
    "load_train_log",
    "load_split_stats",
    "load_selftest",
    "train_summary",
    "summarize",
    "write_summary",
]

SUMMARY_FORMAT = "talkmethods.summary/1"
KINDS = RUN_EVAL_KINDS
"""Trained eval kinds read per arm and seed, in card order."""
KIND_FILES = {kind: spec["file"] for kind, spec in EVAL_KINDS.items()}
FIGURES = [
    "team_accuracy",
    "both_right",
    "a_accuracy",
    "b_accuracy",
    "no_box_rate",
    "chars_A",
    "chars_B",
    "partner_use_A",
    "partner_use_B",
]
"""The per-eval figures of a CSV row, in column order."""
CSV_COLUMNS = ["arm", "seed", "kind", *FIGURES, "learned", "p_value", "chats_drawn_per_step", "gen_s", "train_s"]


class ResultsError(ValueError):
    """A results file is missing or malformed; the message names the file and what is wrong."""


# ---------------------------------------------------------------------------------------------
# Reading and checking inputs.
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def eval_schema() -> dict:
    """The eval JSON schema (talkmethods/schemas/eval.schema.json, draft 2020-12)."""
    return json.loads(resources.files("talkmethods.schemas").joinpath("eval.schema.json").read_text())


def _pointer(path: Iterable) -> str:
    return "/" + "/".join(str(p) for p in path) if path else "(top level)"


def validate_eval(obj: Any, where: str | os.PathLike = "eval JSON") -> None:
    """Check ``obj`` against the eval schema and the checks a schema cannot state.

    Args:
      obj: A parsed eval JSON object (as ``evaluate.run_eval`` returns it).
      where: What to call it in the error message, usually its path.

    Raises:
      ResultsError: naming ``where``, the JSON location of the first problem and what is wrong
        (plus how many other problems there are).
    """
    import jsonschema

    validator = jsonschema.Draft202012Validator(eval_schema())
    errors = sorted(validator.iter_errors(obj), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        e = errors[0]
        more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        raise ResultsError(f"{where}: not a valid eval JSON: at {_pointer(e.absolute_path)}: {e.message}{more}")
    ids, rewards = obj["per_problem"]["ids"], obj["per_problem"]["rewards"]
    if len(ids) != len(rewards):
        raise ResultsError(
            f"{where}: not a valid eval JSON: per_problem has {len(ids)} ids but {len(rewards)} rewards"
        )


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise ResultsError(f"{path}: missing {what}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path}: cannot read {what}: {exc}") from exc


def load_eval(
    path: str | os.PathLike, kind: str | None = None, arm: str | None = None, seed: int | None = None
) -> dict:
    """Read and validate one eval JSON; check that it is the ``kind``/``arm``/``seed`` its path says.

    Raises:
      ResultsError: The file is missing, not JSON, not a valid eval JSON, or of another kind,
        arm or seed than expected.
    """
    path = Path(path)
    obj = _read_json(path, f"eval JSON ({kind or 'any kind'})")
    validate_eval(obj, path)
    for key, want in (("kind", kind), ("arm", arm), ("seed", seed)):
        if want is not None and obj[key] != want:
            raise ResultsError(f"{path}: expected {key} {want!r} but the file says {obj[key]!r}")
    return obj


def load_train_log(path: str | os.PathLike) -> list[dict]:
    """Read a train_log.jsonl: one JSON object per step, sorted by step (the last line of a step wins).

    Raises:
      ResultsError: The file is missing or empty, a line is not a JSON object, or lacks an integer
        ``step`` or a numeric ``reward``.
    """
    path = Path(path)
    if not path.is_file():
        raise ResultsError(f"{path}: missing train log")
    by_step: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ResultsError(f"{path}:{n}: not a JSON line: {exc}") from exc
        if not isinstance(obj, dict):
            raise ResultsError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
        step, reward = obj.get("step"), obj.get("reward")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ResultsError(f"{path}:{n}: 'step' must be an integer; got {step!r}")
        if not _is_number(reward):
            raise ResultsError(f"{path}:{n}: 'reward' must be a number; got {reward!r}")
        by_step[step] = obj
    if not by_step:
        raise ResultsError(f"{path}: train log has no steps")
    return [by_step[s] for s in sorted(by_step)]


def load_split_stats(path: str | os.PathLike) -> dict:
    """Read R/data/split_stats.json (a dict with "train" and "heldout" entries)."""
    path = Path(path)
    obj = _read_json(path, "split statistics")
    if not isinstance(obj, dict):
        raise ResultsError(f"{path}: expected a JSON object with 'train' and 'heldout'")
    for part in ("train", "heldout"):
        entry = obj.get(part)
        if not isinstance(entry, dict):
            raise ResultsError(f"{path}: missing the {part!r} entry")
        for key in ("total", "eligible", "dropped", "drawn"):
            if key not in entry:
                raise ResultsError(f"{path}: {part}: missing {key!r}")
        if not isinstance(entry["dropped"], dict):
            raise ResultsError(f"{path}: {part}.dropped must map reasons to counts")
    return obj


def load_selftest(path: str | os.PathLike) -> dict:
    """Read R/selftest.json (``passed`` and a list of ``checks`` with name, passed, detail)."""
    path = Path(path)
    obj = _read_json(path, "selftest result")
    if not isinstance(obj, dict) or not isinstance(obj.get("passed"), bool):
        raise ResultsError(f"{path}: expected a JSON object with a boolean 'passed'")
    checks = obj.get("checks", [])
    if not isinstance(checks, list) or not all(isinstance(c, dict) and "name" in c and "passed" in c for c in checks):
        raise ResultsError(f"{path}: 'checks' must be a list of objects with 'name' and 'passed'")
    return obj


# ---------------------------------------------------------------------------------------------
# Small helpers.
# ---------------------------------------------------------------------------------------------


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mean(values: Iterable[Any]) -> float | None:
    """Mean of the finite numbers in ``values``; None when there are none."""
    xs = [float(v) for v in values if _is_number(v)]
    return sum(xs) / len(xs) if xs else None


def _total(values: Iterable[Any]) -> float | None:
    xs = [float(v) for v in values if _is_number(v)]
    return sum(xs) if xs else None


def _rng(seed: int, *name: Any) -> np.random.Generator:
    """A generator fixed by ``seed`` and a stable name (crc32, not Python's salted hash)."""
    key = zlib.crc32("/".join(map(str, name)).encode())
    return np.random.default_rng([int(seed), key])


def _figures(obj: dict) -> dict:
    """The CSV figures of one eval JSON."""
    m = obj["metrics"]
    return {
        "team_accuracy": m["team_accuracy"],
        "both_right": m["both_right"],
        "a_accuracy": m["a_accuracy"],
        "b_accuracy": m["b_accuracy"],
        "no_box_rate": m["no_box_rate"],
        "chars_A": m["chars_per_seat"]["A"],
        "chars_B": m["chars_per_seat"]["B"],
        "partner_use_A": m["partner_fact_use"]["A"],
        "partner_use_B": m["partner_fact_use"]["B"],
    }


def _aligned(obj: dict, path: Path, ref_ids: Sequence[str], ref_path: Path) -> np.ndarray:
    """Per-problem rewards of ``obj`` in the order of ``ref_ids`` (the base eval's problems)."""
    by_id = dict(zip(obj["per_problem"]["ids"], obj["per_problem"]["rewards"]))
    missing = [i for i in ref_ids if i not in by_id]
    extra = sorted(set(by_id) - set(ref_ids))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of its problems missing (e.g. {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} problems not in the base eval (e.g. {extra[:3]})")
        raise ResultsError(f"{path}: problem ids differ from {ref_path}: " + "; ".join(parts))
    return np.array([by_id[i] for i in ref_ids], dtype=float)


def _window(n_steps: int) -> int:
    """Steps averaged at each end of a training curve: a tenth of the run, at least one."""
    return max(1, round(n_steps / 10))


def train_summary(lines: Sequence[dict]) -> dict:
    """Figures of one training run from its step log (see ``load_train_log``).

    Returns:
      Dict with ``steps`` and ``reward`` (the curve), ``chats_drawn_per_step`` and
      ``zero_adv_share`` (means over steps), ``gen_s`` and ``train_s`` (totals), ``longest_prompt``
      (max), ``window`` (k) and ``first_reward``/``last_reward`` (mean reward of the first/last k
      steps). Figures missing from every line are None.
    """
    rewards = [float(x["reward"]) for x in lines]
    k = _window(len(lines))
    prompts = [x.get("longest_prompt") for x in lines if _is_number(x.get("longest_prompt"))]
    return {
        "steps": [int(x["step"]) for x in lines],
        "reward": rewards,
        "chats_drawn_per_step": _mean(x.get("chats_drawn") for x in lines),
        "zero_adv_share": _mean(x.get("zero_adv_share") for x in lines),
        "gen_s": _total(x.get("gen_s") for x in lines),
        "train_s": _total(x.get("train_s") for x in lines),
        "longest_prompt": max(prompts) if prompts else None,
        "window": k,
        "first_reward": sum(rewards[:k]) / k,
        "last_reward": sum(rewards[-k:]) / k,
    }


def _mean_curve(curves: Sequence[dict]) -> dict:
    """Mean reward per step over the seeds that logged that step."""
    per_step: dict[int, list[float]] = {}
    for c in curves:
        for s, r in zip(c["steps"], c["reward"]):
            per_step.setdefault(s, []).append(r)
    steps = sorted(per_step)
    return {"steps": steps, "reward": [sum(per_step[s]) / len(per_step[s]) for s in steps]}


# ---------------------------------------------------------------------------------------------
# The summary.
# ---------------------------------------------------------------------------------------------


def summarize(
    results_dir: str | os.PathLike,
    arms: Sequence[str],
    seeds: Sequence[int],
    n_boot: int = 10_000,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict:
    """Summarize every eval and training run of ``results_dir`` (layout in the module docstring).

    Args:
      results_dir: The results directory R.
      arms: Arms to read, in card order (config ``arms``).
      seeds: Training seeds to read (config ``seeds``).
      n_boot: Bootstrap replicates for every interval and test.
      alpha: Level: two-sided ``1 - alpha`` intervals; one-sided level of "learned".
      seed: Non-negative int fixing every bootstrap draw.

    Returns:
      A JSON-ready dict:

      * ``format``, ``results_dir``, ``arms``, ``seeds``, ``kinds`` (``["eval", "crossplay",
        "crossplay_bA"]``), ``n_boot``, ``alpha``, ``seed``, ``n_problems``, ``columns``.
      * ``rows``: the CSV rows (dicts keyed by ``columns``): one per arm x seed x kind, then the
        base row (arm "base", kind "base"). ``learned`` (bool) only on kind eval; ``p_value`` is
        the one-sided paired-bootstrap p-value of "this eval beats base x base" (every trained
        kind); ``chats_drawn_per_step`` (mean), ``gen_s``/``train_s`` (totals) come from the run's
        train log. Not-applicable cells are None.
      * ``base``: base x base ``mean``/``lo``/``hi`` (bootstrap over problems), its figures,
        ``wall_s`` and ``device``.
      * ``per_arm[arm]``: ``n_seeds``, ``seeds_learned`` (k of n), ``kinds[kind]`` with ``mean``,
        ``lo``, ``hi`` (hierarchical bootstrap over seeds and problems of the S x P reward
        matrix aligned by problem id), ``per_seed`` (list of {seed, value, p_value,
        beats_base}), ``seeds_beat_base``, ``overlaps_base`` (interval meets base x base's) and
        ``figures`` (per-seed means of the CSV figures); ``train`` with ``chats_drawn_per_step``,
        ``zero_adv_share``, ``gen_s``, ``train_s``, ``longest_prompt``, ``window``,
        ``first_reward``, ``last_reward`` (means over seeds of ``train_summary``'s), ``curves``
        (list of {seed, steps, reward}) and ``mean_curve`` ({steps, reward}).
      * ``comparisons``: for every pair of arms (x before y in ``arms``) on held-out team
        accuracy: ``x``, ``y``, ``kind`` ("eval"), ``poi`` = P(x > y) over per-seed values with
        ``lo``/``hi`` (bootstrap over runs), ``overlap`` (the two arms' intervals meet).
      * ``checks``: ``selftest`` and ``split_stats`` as read.
      * ``compute``: ``train_gen_s``, ``train_train_s``, ``eval_wall_s``, ``total_s``, ``devices``
        (eval devices seen), ``versions`` and ``git`` (of the base eval).

    Raises:
      ResultsError: A file is missing or malformed, or its problems differ from the base eval's.
      ValueError: ``arms``/``seeds`` empty or repeated, or ``n_boot``/``alpha`` out of range.
    """
    root = Path(results_dir)
    arms, seeds = list(arms), [int(s) for s in seeds]
    if not arms or len(set(arms)) != len(arms):
        raise ValueError(f"arms must be a non-empty list without repeats; got {arms}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be a non-empty list without repeats; got {seeds}")
    if "base" in arms:
        raise ValueError("'base' is the base x base reference, not an arm")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; got {seed!r}")
    if not 1.0 / (n_boot + 1) <= alpha < 1.0:
        raise ValueError(f"n_boot={n_boot} with alpha={alpha}: need 1/(n_boot+1) <= alpha < 1")

    base_path = root / "base" / "eval.json"
    base_obj = load_eval(base_path, kind="base")
    base_ids = list(base_obj["per_problem"]["ids"])
    base_rewards = np.array(base_obj["per_problem"]["rewards"], dtype=float)
    b_ci = stats.bootstrap_ci(base_rewards, n_boot=n_boot, alpha=alpha, seed=_rng(seed, "base"))
    base = {
        "mean": b_ci.mean,
        "lo": b_ci.lo,
        "hi": b_ci.hi,
        **_figures(base_obj),
        "wall_s": base_obj["provenance"]["wall_s"],
        "device": base_obj["provenance"]["device"],
    }

    checks = {
        "selftest": load_selftest(root / "selftest.json"),
        "split_stats": load_split_stats(root / "data" / "split_stats.json"),
    }

    rows: list[dict] = []
    per_arm: dict[str, dict] = {}
    eval_wall = [base_obj["provenance"]["wall_s"]]
    devices = {base_obj["provenance"]["device"]}
    for arm in arms:
        runs = {}
        for s in seeds:
            run_dir = root / arm / f"seed{s}"
            train = train_summary(load_train_log(run_dir / "train_log.jsonl"))
            evals = {}
            for kind in KINDS:
                path = run_dir / KIND_FILES[kind]
                obj = load_eval(path, kind=kind, arm=arm, seed=s)
                evals[kind] = (obj, _aligned(obj, path, base_ids, base_path))
                eval_wall.append(obj["provenance"]["wall_s"])
                devices.add(obj["provenance"]["device"])
            runs[s] = (train, evals)

        kinds_out = {}
        for kind in KINDS:
            per_seed = []
            for s in seeds:
                obj, rewards = runs[s][1][kind]
                test = stats.paired_bootstrap_test(
                    rewards, base_rewards, n_boot=n_boot, alpha=alpha, seed=_rng(seed, "paired", arm, s, kind)
                )
                beats = bool(test["p_value"] <= alpha)
                per_seed.append(
                    {
                        "seed": s,
                        "value": obj["metrics"]["team_accuracy"],
                        "p_value": test["p_value"],
                        "beats_base": beats,
                    }
                )
                train = runs[s][0]
                rows.append(
                    {
                        "arm": arm,
                        "seed": s,
                        "kind": kind,
                        **_figures(obj),
                        "learned": beats if kind == "eval" else None,
                        "p_value": test["p_value"],
                        "chats_drawn_per_step": train["chats_drawn_per_step"],
                        "gen_s": train["gen_s"],
                        "train_s": train["train_s"],
                    }
                )
            matrix = np.stack([runs[s][1][kind][1] for s in seeds])
            ci = stats.hierarchical_bootstrap_ci(
                matrix, n_boot=n_boot, alpha=alpha, seed=_rng(seed, "hierarchical", arm, kind)
            )
            figs = [_figures(runs[s][1][kind][0]) for s in seeds]
            kinds_out[kind] = {
                "mean": ci.mean,
                "lo": ci.lo,
                "hi": ci.hi,
                "per_seed": per_seed,
                "seeds_beat_base": sum(p["beats_base"] for p in per_seed),
                "overlaps_base": stats.intervals_overlap((ci.lo, ci.hi), (b_ci.lo, b_ci.hi)),
                "figures": {f: _mean(fg[f] for fg in figs) for f in FIGURES},
            }

        trains = [runs[s][0] for s in seeds]
        curves = [{"seed": s, "steps": runs[s][0]["steps"], "reward": runs[s][0]["reward"]} for s in seeds]
        prompts = [t["longest_prompt"] for t in trains if t["longest_prompt"] is not None]
        per_arm[arm] = {
            "n_seeds": len(seeds),
            "seeds_learned": kinds_out["eval"]["seeds_beat_base"],
            "kinds": kinds_out,
            "train": {
                "chats_drawn_per_step": _mean(t["chats_drawn_per_step"] for t in trains),
                "zero_adv_share": _mean(t["zero_adv_share"] for t in trains),
                "gen_s": _total(t["gen_s"] for t in trains),
                "train_s": _total(t["train_s"] for t in trains),
                "longest_prompt": max(prompts) if prompts else None,
                "window": min(t["window"] for t in trains),
                "first_reward": _mean(t["first_reward"] for t in trains),
                "last_reward": _mean(t["last_reward"] for t in trains),
                "curves": curves,
                "mean_curve": _mean_curve(curves),
            },
        }

    rows.append(
        {
            "arm": "base",
            "seed": None,
            "kind": "base",
            **_figures(base_obj),
            "learned": None,
            "p_value": None,
            "chats_drawn_per_step": None,
            "gen_s": None,
            "train_s": None,
        }
    )

    comparisons = []
    for i, x in enumerate(arms):
        for y in arms[i + 1 :]:
            kx, ky = per_arm[x]["kinds"]["eval"], per_arm[y]["kinds"]["eval"]
            poi = stats.probability_of_improvement_ci(
                [p["value"] for p in kx["per_seed"]],
                [p["value"] for p in ky["per_seed"]],
                n_boot=n_boot,
                alpha=alpha,
                seed=_rng(seed, "poi", x, y),
            )
            comparisons.append(
                {
                    "x": x,
                    "y": y,
                    "kind": "eval",
                    "poi": poi.mean,
                    "lo": poi.lo,
                    "hi": poi.hi,
                    "overlap": stats.intervals_overlap((kx["lo"], kx["hi"]), (ky["lo"], ky["hi"])),
                }
            )

    gen = _total(per_arm[a]["train"]["gen_s"] for a in arms)
    trn = _total(per_arm[a]["train"]["train_s"] for a in arms)
    ev = _total(eval_wall) or 0.0
    summary = {
        "format": SUMMARY_FORMAT,
        "results_dir": str(root),
        "arms": arms,
        "seeds": seeds,
        "kinds": list(KINDS),
        "n_boot": int(n_boot),
        "alpha": float(alpha),
        "seed": int(seed),
        "n_problems": len(base_ids),
        "columns": list(CSV_COLUMNS),
        "rows": rows,
        "base": base,
        "per_arm": per_arm,
        "comparisons": comparisons,
        "checks": checks,
        "compute": {
            "train_gen_s": gen,
            "train_train_s": trn,
            "eval_wall_s": ev,
            "total_s": (gen or 0.0) + (trn or 0.0) + ev,
            "devices": sorted(devices),
            "versions": base_obj["provenance"]["versions"],
            "git": base_obj["provenance"]["git"],
        },
    }
    log.info("summarized %d arms x %d seeds on %d problems from %s", len(arms), len(seeds), len(base_ids), root)
    return summary


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def summary_csv(summary: dict) -> str:
    """The summary's rows as CSV text (header ``CSV_COLUMNS``; empty cell for None)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = summary.get("columns", CSV_COLUMNS)
    writer.writerow(columns)
    for row in summary["rows"]:
        writer.writerow([_cell(row.get(c)) for c in columns])
    return buf.getvalue()


def write_summary(summary: dict, csv_path: str | os.PathLike, json_path: str | os.PathLike) -> None:
    """Write the rows as CSV to ``csv_path`` and the whole summary as JSON to ``json_path``, atomically."""
    write_text(csv_path, summary_csv(summary))
    write_json(json_path, summary)
    log.info("wrote %s and %s", csv_path, json_path)
