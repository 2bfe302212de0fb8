"""Config checking: the JSON schema, plus the checks a schema cannot state, with one clear message."""

from __future__ import annotations

import math
import os
from importlib import resources

import yaml

from talkmethods.errors import UserError

OFFLINE_MODEL = "offline-tiny-qwen2"  # = talkmethods.models.OFFLINE_MODEL (not imported: that pulls in torch)
WARMSTART_MODEL = "warmstart/model"  # under the results dir: the warm-started base model (rule warmstart)
GSM8K_ROWS = {"n_train": 7473, "n_heldout": 1319}  # openai/gsm8k (main): rows of train and test


class ConfigError(UserError, ValueError):
    """A config value is wrong; the message names the key and what is allowed."""


def schema() -> dict:
    """The config schema (talkmethods/schemas/config.schema.yaml)."""
    return yaml.safe_load(resources.files("talkmethods.schemas").joinpath("config.schema.yaml").read_text())


def _where(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def _allowed(error) -> str:
    s = error.schema
    if "enum" in s:
        return f"allowed: {', '.join(map(str, s['enum']))}"
    if "type" in s:
        bounds = [f"{k} {s[k]}" for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum") if k in s]
        return f"expected {s['type']}" + (f" ({', '.join(bounds)})" if bounds else "")
    return ""


def validate_config(config: dict) -> None:
    """Raise ConfigError naming the first bad key; return None when the config is good."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.path), list(map(str, e.path))))
    if errors:
        e = errors[0]
        key = _where(e.absolute_path)
        if e.validator == "additionalProperties":
            allowed = ", ".join(sorted(e.schema.get("properties", {})))
            raise ConfigError(f"config: unknown key under {key}: {e.message} (allowed keys: {allowed})")
        if e.validator == "required":
            raise ConfigError(f"config: {key}: {e.message}")
        value = e.instance
        raise ConfigError(f"config: {key} = {value!r} is not valid: {e.message}; {_allowed(e)}".rstrip("; "))
    _check_finite(config, [])
    name = config["model"]["name"]
    looks_local = name.startswith((".", "/", "~")) or os.sep in name and not _hub_id(name)
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(
            f"config: model.name = {name!r}: no such directory (a local model dir, a hub id, or {OFFLINE_MODEL!r})"
        )
    warm = config["model"]["warmstart"]
    if warm and name != OFFLINE_MODEL:
        raise ConfigError(
            f"config: model.warmstart builds and trains its own small model; set model.name: {OFFLINE_MODEL} "
            f"with it, or model.warmstart: null to use {name!r} as it is"
        )
    if warm and warm["hidden"] % warm["heads"] or warm and warm["heads"] % warm["kv_heads"]:
        raise ConfigError("config: model.warmstart: hidden must be a multiple of heads, and heads of kv_heads")
    data = config["data"]
    if data["source"] == "local":
        d = data["local_dir"]
        if not d or not os.path.isdir(d):
            raise ConfigError(f"config: data.local_dir = {d!r}: no such directory (needed by data.source: local)")
    _check_pool_sizes(data)
    _check_sampling(config)


def _check_sampling(config: dict) -> None:
    """Sampling the engines and the trainer can honour exactly, or one line naming the key.

    The trainer's log-probs (TRL's loss, and the rollout check beside it) are those of
    softmax(logits / temperature): a rollout truncated by top-p or top-k, or reshaped by a repetition
    penalty, would be trained as if drawn from a distribution it was not drawn from. The loop and
    fast engines apply temperature, top-k and top-p only.
    """
    t = config["train"]
    for key, plain in (("top_p", 1.0), ("top_k", 0), ("repetition_penalty", 1.0)):
        if t[key] != plain:
            raise ConfigError(
                f"config: train.{key} = {t[key]!r} is not valid: the trainer scores rollouts under "
                f"softmax(logits / temperature) only; set train.{key}: {plain}"
            )
    e = config["eval"]
    if e["repetition_penalty"] != 1.0 and e["engine"] != "plain":
        raise ConfigError(
            f"config: eval.repetition_penalty = {e['repetition_penalty']!r} is not valid with "
            f"eval.engine: {e['engine']} (it applies no penalty); set it to 1.0 or eval.engine: plain"
        )


def _check_finite(node, path) -> None:
    """A schema passes NaN (every comparison with it is false): refuse NaN and infinities by name."""
    if isinstance(node, dict):
        for k, v in node.items():
            _check_finite(v, [*path, k])
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_finite(v, [*path, i])
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"config: {_where(path)} = {node!r} is not valid: expected a finite number")


def _check_pool_sizes(data: dict) -> None:
    """More problems asked than the source holds at all: fail now, not in the split job.

    Only the row counts are checked here (cheap); the split job still fails, naming the key, when
    too few of the rows are eligible for the fact split.
    """
    if data["source"] == "hub":
        sizes = {key: (n, "openai/gsm8k " + split) for (key, n), split in zip(GSM8K_ROWS.items(), ("train", "test"))}
    elif data["source"] == "local":
        sizes = {}
        for key, name in (("n_train", "train.jsonl"), ("n_heldout", "test.jsonl")):
            path = os.path.join(data["local_dir"], name)
            try:
                with open(path, "rb") as f:
                    sizes[key] = (sum(1 for line in f if line.strip()), path)
            except OSError:
                continue  # a missing file is the split job's DataError, naming the file
    else:
        return
    for key, (rows, where) in sizes.items():
        if data[key] > rows:
            raise ConfigError(
                f"config: data.{key} = {data[key]} is more than the {rows} problems in {where} "
                f"(and only the eligible ones, with two or more fact sentences, count): lower data.{key}"
            )


def _hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def load_config(paths: list[str]) -> dict:
    """Load config.yaml and overlays (later files win, nested keys merge), then validate."""
    merged: dict = {}
    for p in paths:
        try:
            with open(p) as f:
                layer = yaml.safe_load(f) or {}
        except OSError as err:
            raise ConfigError(f"config: cannot read {p}: {err.strerror}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config: {p} is not valid YAML: {err}") from None
        merged = merge(merged, layer)
    validate_config(merged)
    return merged


def merge(base: dict, over: dict) -> dict:
    """Recursive dict update (what Snakemake does with --configfile)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def trains_as_cohort(config: dict, arm: str) -> bool:
    """Whether ``arm``'s seeds train as one cohort (``train.cohort``: true for every arm, false for none, or a list)."""
    chosen = config["train"]["cohort"]
    return chosen is True or arm in (chosen or [])


def cohort_arms(config: dict) -> list[str]:
    """The config's arms whose seeds train as one cohort, in its order."""
    return [a for a in config["arms"] if trains_as_cohort(config, a)]


def train_params(config: dict, arm: str, seed: int, results: str = "results") -> dict:
    """Plain values of one training run (a rule's ``params:``, so an edit reruns it): ``recipe.TrainConfig``'s fields."""
    t = config["train"]
    return {
        "arm": arm,
        "seed": int(seed),
        "model": model_params(config, results),
        **{
            k: t[k]
            for k in (
                "steps",
                "problems_per_step",
                "chats_per_problem",
                "learning_rate",
                "lr_schedule",
                "lora_r",
                "lora_alpha",
                "lora_dropout",
                "ada_max_replays",
                "ada_draw_ahead",
                "pack_seats",
                "save_every",
                "gradient_checkpointing",
                "engine",
                "micro_batches",
                "liger_kernels",
            )
        },
        "sampling": _sampling(t, t["max_prompt_tokens"]),
        "precision": config["model"]["precision"],
    }


def _sampling(section: dict, max_prompt_tokens: int) -> dict:
    """``engines.sampling.Sampling``'s fields from a train or eval section."""
    return {
        "max_new_tokens": section["max_new_tokens"],
        "temperature": section["temperature"],
        "top_p": section["top_p"],
        "top_k": section["top_k"],
        "repetition_penalty": section["repetition_penalty"],
        "max_prompt_tokens": max_prompt_tokens,
    }


def model_params(config: dict, results: str = "results") -> dict:
    """The base model every arm and eval starts from: the warm-started one when the config has a warm start."""
    if config["model"]["warmstart"]:
        return {"name": f"{results}/{WARMSTART_MODEL}"}
    return {"name": config["model"]["name"]}


def warmstart_params(config: dict) -> dict | None:
    """Plain values of the warm start (a rule's ``params:``), or None when the config has none."""
    warm = config["model"]["warmstart"]
    return {**warm, "precision": config["model"]["precision"]} if warm else None


def eval_params(config: dict, results: str = "results") -> dict:
    """Plain values of every eval (a rule's ``params:``): ``recipe.EvalConfig``'s fields."""
    e = config["eval"]
    return {
        "model": model_params(config, results),
        "precision": config["model"]["precision"],
        "sampling": _sampling(e, config["train"]["max_prompt_tokens"]),
        **{k: e[k] for k in ("chats_per_problem", "batch_chats", "sample_dialogues", "engine")},
        "eval_seed": config["data"]["data_seed"],
    }


def split_params(config: dict) -> dict:
    d = config["data"]
    return {
        "source": d["source"],
        "local_dir": d["local_dir"],
        "n_train": d["n_train"],
        "n_heldout": d["n_heldout"],
        "data_seed": d["data_seed"],
        "world": d["world"],
        "prompt": d["prompt"],
    }
