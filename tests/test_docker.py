"""docker/ checked without a Docker engine (none runs here): every Dockerfile parsed (continuation lines, flags, JSON
forms), every COPY source present in the build context and not dropped by .dockerignore, every package folder of
pyproject.toml copied into every image that installs the project, each image installing its own extra; the compose
file validated by `docker-compose config` (Debian's docker-compose 1.29 needs no engine for it) and read as YAML;
and the pool volume's setup (docker/setup_pool.py) run for real, after which every service's command (its config
file and --set overrides) loads into that role's config model."""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.node.config import NodeConfig
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.config import load_config
from swarmrl.trainer.config import TrainerConfig
from swarmrl.verifier.config import VerifierConfig

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
IMAGES = {"Dockerfile.cpu": "cpu", "Dockerfile.gpu": "gpu", "Dockerfile.coordinator": "coordinator"}
MODELS = {"coordinator": CoordinatorConfig, "node": NodeConfig, "verifier": VerifierConfig, "trainer": TrainerConfig}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        line, buf = buf + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not buf, f"{path.name} ends inside a continued line"
    return out


def copy_sources(args: str) -> tuple[list[str], str, bool]:
    """(sources, destination, from another stage) of a COPY/ADD's arguments."""
    parts = json.loads(args) if args.startswith("[") else shlex.split(args)
    flags = [p for p in parts if p.startswith("--")]
    rest = [p for p in parts if not p.startswith("--")]
    return rest[:-1], rest[-1], any(f.startswith("--from") for f in flags)


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops `rel` (itself or a folder above it): its patterns, `**` for any depth."""
    parts = Path(rel).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        alternatives = {pattern, pattern.replace("**/", "")}
        if any(fnmatch.fnmatchcase(c, p) for c in candidates for p in alternatives):
            return True
    return False


def dockerignore() -> list[str]:
    text = (REPO / ".dockerignore").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_every_copy_source_exists_and_every_package_is_copied(dockerfile: str) -> None:
    steps = instructions(DOCKER / dockerfile)
    assert steps[0][0] == "FROM" and steps[-1][0] in ("ENTRYPOINT", "CMD")
    assert ("ENTRYPOINT", '["swarmrl"]') in steps
    patterns = dockerignore()
    copied: set[str] = set()
    for word, args in steps:
        assert word != "ADD", "COPY, not ADD: nothing is fetched or unpacked at build time"
        if word != "COPY":
            continue
        sources, _, other_stage = copy_sources(args)
        assert not other_stage
        for src in sources:
            assert (REPO / src).exists(), f"{dockerfile}: COPY {src}: not in the build context"
            assert not ignored(src, patterns), f"{dockerfile}: COPY {src}: dropped by .dockerignore"
            copied.add(src.rstrip("/"))
    folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert folders <= copied, f"{dockerfile} does not copy {sorted(folders - copied)}"
    assert {"pyproject.toml", "README.md"} <= copied  # pip builds the project from them
    runs = " ".join(a for w, a in steps if w == "RUN")
    extra = IMAGES[dockerfile]
    assert extra in PYPROJECT["project"]["optional-dependencies"]
    assert f'install ".[{extra}]"' in runs
    if extra == "coordinator":
        assert "vllm" not in runs.lower() and "vllm" not in " ".join(PYPROJECT["project"]["optional-dependencies"][
            "coordinator"])


def test_dockerignore_keeps_the_source_and_drops_what_runs_make() -> None:
    patterns = dockerignore()
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    shipped = [f for f in tracked if f.split("/")[0] in folders]
    assert shipped and not [f for f in shipped if ignored(f, patterns)]
    for made in ("runs/demo-1/coordinator/coordinator.sqlite", "node-data/receipts.jsonl", ".venv/bin/python",
                 "keys/trainer.key", "coordinator/__pycache__/app.cpython-311.pyc", ".git/HEAD", "x/node.key"):
        assert ignored(made, patterns), made


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="no docker-compose: apt-get install -y docker-compose (.ci/run does)")
def test_compose_file_is_valid_for_docker_compose() -> None:
    # No engine is contacted: `config` only parses, interpolates and validates the file against the schema.
    for profile in ([], ["--profile", "gpu"]):
        proc = subprocess.run(["docker-compose", "-f", str(DOCKER / "compose.yaml"), *profile, "config", "-q"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr


def test_compose_starts_a_whole_pool_from_the_images_here() -> None:
    doc = compose()
    services = doc["services"]
    assert set(services) == {"setup", "coordinator", "verifier", "trainer", "node1", "node2", "node-gpu"}
    assert "pool" in doc["volumes"]
    for name, svc in services.items():
        build = svc["build"]
        assert (DOCKER / build["context"]).resolve() == REPO
        assert (REPO / build["dockerfile"]).name in IMAGES, name
        assert "pool:/pool" in svc["volumes"], name
        if name != "setup":
            assert svc["healthcheck"]["test"][0] == "CMD", name
            assert svc["restart"] == "unless-stopped", name
            wanted = "setup" if name == "coordinator" else "coordinator"
            assert wanted in svc["depends_on"], name
    assert services["coordinator"]["build"]["dockerfile"] == "docker/Dockerfile.coordinator"
    assert services["node-gpu"]["build"]["dockerfile"] == "docker/Dockerfile.gpu"
    assert services["node-gpu"]["profiles"] == ["gpu"]


def test_the_pool_setup_writes_configs_every_service_loads(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    env = {**os.environ, "PYTHONPATH": str(REPO), "WARMUP_ACCURACY": "0", "OMP_NUM_THREADS": "1"}
    setup_args = compose()["services"]["setup"]["entrypoint"][2:]  # the script's own arguments
    assert setup_args[0] == "/pool" and "--containers" in setup_args
    for _ in range(2):  # a second run keeps keys and checkpoint
        proc = subprocess.run([sys.executable, str(DOCKER / "setup_pool.py"), str(pool), *setup_args[1:]], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert (pool / "init" / "config.json").exists()
    keys = {name: Identity.load(pool / "keys" / f"{name}.key") for name in ("trainer", "verifier")}
    loaded = {}
    for name, svc in compose()["services"].items():
        if name == "setup":
            continue
        cmd = [a.replace("/pool", str(pool)) for a in svc["command"]]
        role = cmd[0]
        overrides = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
        loaded[name] = load_config(MODELS[role], Path(cmd[cmd.index("--config") + 1]), overrides)
    coordinator = loaded["coordinator"]
    assert sorted(coordinator.operator_keys) == sorted(k.public_key_hex for k in keys.values())
    assert coordinator.host == "0.0.0.0" and coordinator.port == 8470
    assert loaded["trainer"].init_checkpoint == pool / "init"  # relative to the config file, wherever run from
    nodes = [loaded[n] for n in ("node1", "node2", "node-gpu")]
    assert len({n.key_path for n in nodes}) == 3 and len({n.work_dir for n in nodes}) == 3
    assert nodes[2].engine.kind == "vllm" and nodes[2].engine.device == "cuda"
    for name in ("verifier", "trainer", "node1"):
        assert loaded[name].coordinator_url == "http://coordinator:8470"
        assert (loaded[name].metrics_host, loaded[name].metrics_port) == ("0.0.0.0", 9100)  # the healthchecks' port
