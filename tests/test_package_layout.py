"""The package is imported through its install (pyproject.toml's package-dir), once: `swarmrl.<folder>` is the
folder of that name, and no module can be reached under a second name (as `swarmrl.swarmrl` once was, when the
package appended the repository root to its own path)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_mapped_package_is_its_folder() -> None:
    mapped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in mapped.items():
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve() == (REPO / folder / "__init__.py").resolve(), name


def test_no_module_is_imported_under_two_names() -> None:
    for name in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]:
        importlib.import_module(name)
    names: dict[Path, list[str]] = defaultdict(list)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and name != "__main__" and Path(file).resolve().is_relative_to(REPO) and \
                Path(file).resolve().relative_to(REPO).parts[0] != ".venv":
            names[Path(file).resolve()].append(name)
    twice = {str(f.relative_to(REPO)): n for f, n in names.items() if len(n) > 1}
    assert twice == {}


def test_the_repository_root_is_not_a_package_path() -> None:
    run = subprocess.run([sys.executable, "-c", "import swarmrl.swarmrl"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode != 0 and "No module named 'swarmrl.swarmrl'" in run.stderr
