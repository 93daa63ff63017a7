"""Configs: pydantic models with a docstring per field, loaded from TOML, overridable from the command line.

Each role owns its config model next to its code; this module only knows how to fill one in:

    cfg = load_config(NodeConfig, "node.toml", ["engine.kind=torch", "max_prompts=16"])

An override is `dotted.key=value`; the value is read as JSON when it parses (numbers, booleans, lists)
and as a plain string otherwise.

A relative path written in a config file (a field typed `Path`, in any table) is taken relative to that file's
directory, so a role finds its key and data wherever it is started from; a path given with `--set` is relative
to the current directory, as on any command line. A file that is missing, unreadable or not TOML is a
ConfigError naming the file (and the line), like a key that does not fit the model.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
import types
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from swarmrl.protocol.pydantic_errors import describe_validation_error

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
        deep_update(data, resolve_paths(model, read_toml(path), Path(path).absolute().parent))
    try:
        apply_overrides(data, overrides or [])
    except ValueError as e:
        raise ConfigError(f"--set: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        source = f"{path} and --set overrides" if path is not None else "--set overrides"
        raise ConfigError(f"invalid {model.__name__} ({source}):\n  " + describe_validation_error(
            e, limit=None, root="(top level)", sep="\n  ", hint=lambda err: _unknown_key_hint(model, err))) from None


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file at `path`; ConfigError naming the file (and the line, for a syntax error) with the fix."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no config file {path}: check the --config path (docker/setup_pool.py writes one per "
                          "role under <pool>/config)") from None
    except IsADirectoryError:
        raise ConfigError(f"config {path} is a directory: give --config the .toml file in it") from None
    except PermissionError:
        raise ConfigError(f"config {path} cannot be read by this user: fix its permissions") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}; fix that line") from None


def resolve_paths(model: type[BaseModel], data: dict[str, Any], base: Path) -> dict[str, Any]:
    """`data` (read from a file in `base`) with each relative path of a `Path`-typed field of `model` (nested
    tables too) made relative to `base` instead of the current directory; in place, also returned."""
    fields = getattr(model, "model_fields", {})
    for key, value in data.items():
        if key not in fields:
            continue  # an unknown key: validation names it
        annotation = fields[key].annotation
        if isinstance(value, str) and _is_path(annotation) and value and not os.path.isabs(value):
            data[key] = os.path.normpath(base / os.path.expanduser(value))
        elif isinstance(value, dict):
            for sub in _models_in(annotation):
                resolve_paths(sub, value, base)
    return data


def _is_path(annotation: Any) -> bool:
    return annotation is Path or (_is_union(annotation) and Path in get_args(annotation))


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field of this annotation may hold (Model, Model | None)."""
    candidates = get_args(annotation) if _is_union(annotation) else (annotation,)
    return [a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)]


def _unknown_key_hint(model: type[BaseModel], err: Any) -> str | None:
    """An unknown key's message: the closest known keys (or all of them)."""
    if err.get("type") != "extra_forbidden":
        return None
    loc = [str(p) for p in err.get("loc", ())]
    known = _field_names(model, loc[:-1])
    close = difflib.get_close_matches(loc[-1], known, n=3) if loc else []
    return f"unknown key; did you mean {', '.join(close)}?" if close else \
        f"unknown key; known keys: {', '.join(sorted(known))}"


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
