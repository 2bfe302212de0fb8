"""Config checking: the JSON schema, plus the checks a schema cannot state, with one clear message."""

from __future__ import annotations

import os
from importlib import resources

import yaml

from talkmethods.models import OFFLINE_MODEL


class ConfigError(ValueError):
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
    name = config["model"]["name"]
    looks_local = name.startswith((".", "/", "~")) or os.sep in name and not _hub_id(name)
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(f"config: model.name = {name!r}: no such directory (a local model dir, a hub id, or {OFFLINE_MODEL!r})")
    data = config["data"]
    if data["source"] == "local":
        d = data.get("local_dir")
        if not d or not os.path.isdir(d):
            raise ConfigError(f"config: data.local_dir = {d!r}: no such directory (needed by data.source: local)")


def _hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))
