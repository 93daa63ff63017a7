"""The configuration examples in module docstrings work as written: every `load_config(SomeConfig, "file.toml",
[overrides])` line's overrides apply to that config's defaults (a renamed or removed key fails here, not in the
hands of a reader who copies the line)."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from swarmrl.runtime.config import load_config

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ["protocol", "transfer", "runtime", "models", "node", "coordinator", "verifier", "trainer", "pools",
           "tasks", "swarmrl"]
EXAMPLE = re.compile(r"load_config\((\w+), [^,\[\]]+, (\[[^\]]*\])\)")


def _examples() -> list[tuple[str, str, list[str]]]:
    found = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            for cls, overrides in EXAMPLE.findall(doc):
                module = ".".join(["swarmrl", *path.relative_to(REPO).with_suffix("").parts]).replace(
                    "swarmrl.swarmrl", "swarmrl").removesuffix(".__init__")
                found.append((module, cls, ast.literal_eval(overrides)))
    return found


def test_there_are_examples_to_check() -> None:
    assert len(_examples()) >= 3


@pytest.mark.parametrize(("module", "cls", "overrides"), _examples(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_docstring_example_loads(module: str, cls: str, overrides: list[str]) -> None:
    importlib.import_module(module)
    for folder in FOLDERS:  # the config a docstring names may live in another role's config module
        if (REPO / folder / "config.py").is_file():
            importlib.import_module(f"swarmrl.{folder}.config")
    config = next(getattr(m, cls) for name, m in sorted(sys.modules.items())
                  if name.startswith("swarmrl") and hasattr(m, cls))
    load_config(config, None, overrides)
