"""docker/setup_pool.py (a script, not a package module) loaded for tests, and its configs written without building
the model."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SETTINGS = ("COORDINATOR_URL", "COORDINATOR_PORT", "METRICS_PORT", "RUN_ID", "WARMUP_ACCURACY", "TLS_CERT",
            "TLS_KEY")
"""The environment variables setup_pool.py reads."""


def setup_module() -> ModuleType:
    """docker/setup_pool.py as a module."""
    spec = importlib.util.spec_from_file_location("setup_pool", REPO / "docker" / "setup_pool.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setup_configs(pool: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None,
                  **kw: bool) -> dict[str, Path]:
    """setup_pool's files for `pool` with only `env` of its settings set, without building the model (a checkpoint
    directory is already there)."""
    (pool / "init").mkdir(parents=True, exist_ok=True)
    (pool / "init" / "config.json").write_text("{}")
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return setup_module().setup(pool, **kw)
