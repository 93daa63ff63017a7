"""Configs: pydantic models with a docstring per field, loaded from TOML, overridable from the command line.

Each role owns its config model next to its code; this module only knows how to fill one in:

    cfg = load_config(NodeConfig, "node.toml", ["engine=torch", "lease.max_prompts=16"])

An override is `dotted.key=value`; the value is read as JSON when it parses (numbers, booleans, lists)
and as a plain string otherwise.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

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


def load_config(model: type[C], path: str | Path | None = None, overrides: list[str] | None = None,
                **defaults: Any) -> C:
    """Build `model` from `defaults`, then the TOML file at `path`, then `overrides`, later ones winning."""
    data: dict[str, Any] = dict(defaults)
    if path is not None:
        with open(path, "rb") as f:
            deep_update(data, tomllib.load(f))
    apply_overrides(data, overrides or [])
    return model.model_validate(data)


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
