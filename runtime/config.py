"""Configs: pydantic models with a docstring per field, loaded from TOML, overridable from the command line.

Each role owns its config model next to its code; this module only knows how to fill one in:

    cfg = load_config(NodeConfig, "node.toml", ["engine.kind=torch", "max_prompts=16"])

An override is `dotted.key=value`; the value is read as JSON when it parses (numbers, booleans, lists)
and as a plain string otherwise.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

C = TypeVar("C", bound=BaseModel)


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `a.b.c=value` of `overrides` in the nested dict `data` (in place; also returned)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = _parse_value(raw.strip())
    return data


class ConfigError(ValueError):
    """A config that does not fit its model: every problem, one per line, with the key's dotted path (unknown keys
    come with the closest known ones)."""


def load_config(model: type[C], path: str | Path | None = None, overrides: list[str] | None = None,
                **defaults: Any) -> C:
    """Build `model` from `defaults`, then the TOML file at `path`, then `overrides`, later ones winning.

    Every role's config refuses unknown keys, so a typo in a file or a `--set` is an error (ConfigError), never
    silently ignored."""
    data: dict[str, Any] = dict(defaults)
    if path is not None:
        with open(path, "rb") as f:
            deep_update(data, tomllib.load(f))
    apply_overrides(data, overrides or [])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        source = f"{path} and --set overrides" if path is not None else "--set overrides"
        raise ConfigError(f"invalid {model.__name__} ({source}):\n" + "\n".join(
            _describe(model, err) for err in e.errors())) from None


def _describe(model: type[BaseModel], err: Any) -> str:
    loc = [str(p) for p in err.get("loc", ())]
    key = ".".join(loc) or "(top level)"
    if err.get("type") != "extra_forbidden":
        return f"  {key}: {err.get('msg', 'invalid')}"
    known = _field_names(model, loc[:-1])
    close = difflib.get_close_matches(loc[-1], known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return f"  {key}: unknown key{hint}"


def _field_names(model: type[BaseModel], path: list[str]) -> list[str]:
    """The field names of the (nested) model at `path`, or [] when the path does not lead to a model."""
    current: Any = model
    for part in path:
        fields = getattr(current, "model_fields", {})
        if part not in fields:
            return []
        current = fields[part].annotation
        for arg in getattr(current, "__args__", ()):  # Optional[Model], Model | None
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    return list(getattr(current, "model_fields", {}))


def deep_update(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Merge `new` into `base` (in place; also returned): nested dicts merge, anything else replaces."""
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            deep_update(base[k], v)
        else:
            base[k] = v
    return base


def dump_toml(cfg: BaseModel) -> str:
    """A TOML rendering of `cfg` that `load_config` reads back: scalars and arrays as keys, nested models and
    dicts as [tables] (dotted names for deeper levels); None values are left out (the default applies)."""
    lines: list[str] = []

    def table(prefix: str, data: dict[str, Any]) -> None:
        subtables = []
        if prefix:
            lines.append(f"\n[{prefix}]")
        for k, v in data.items():
            if isinstance(v, dict):
                subtables.append((f"{prefix}.{k}" if prefix else k, v))
            elif v is not None:
                lines.append(f"{k} = {json.dumps(v)}")
        for name, sub in subtables:
            table(name, sub)

    table("", cfg.model_dump(mode="json"))
    return "\n".join(lines).lstrip("\n") + "\n"
