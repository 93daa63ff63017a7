"""Role processes of a swarm on one machine: each role a child process with its own TOML config and log.

    swarm = Swarm(run_dir, overrides={"trainer": {"threads": 2}}, cwd=data_dir)
    swarm.start("coordinator", "coordinator", {...}, CoordinatorConfig)
    wait_until_up(url, swarm)
    ...
    swarm.stop()

Every process runs `python -m swarmrl.cli ROLE --config FILE`, exactly as an operator or volunteer would run it,
with one torch thread and vLLM in-process (the settings that work on a few shared cores), in its own session so
that stopping the swarm takes each role's children down with it.
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.runtime.config import deep_update, dump_toml
from swarmrl.runtime.lifetime import PARENT_PID_ENV
from swarmrl.runtime.retry import Outage

LOOPBACK_MADDRS = ["/ip4/127.0.0.1/tcp/0"]
ROLES = ("coordinator", "node", "verifier", "trainer")
CHILD_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
             "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "COLUMNS": "160"}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Swarm:
    """The swarm's child processes, each with its own config file (`run_dir/config/NAME.toml`) and log
    (`run_dir/logs/NAME.log`). `overrides[role]` is merged over every config of that role (nested tables merge);
    every process runs in `cwd` (default: this one's), where tasks resolve their relative data paths."""

    def __init__(self, run_dir: Path, overrides: dict[str, dict[str, Any]] | None = None, cwd: Path | None = None):
        unknown = set(overrides or {}) - set(ROLES)
        if unknown:
            raise ValueError(f"roles: unknown role(s) {sorted(unknown)}; known: {list(ROLES)}")
        self.run_dir = run_dir
        self.overrides = overrides or {}
        self.cwd = cwd
        self.procs: dict[str, subprocess.Popen] = {}
        (run_dir / "config").mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def write_config(self, name: str, role: str, cfg: dict[str, Any], model: type[BaseModel]) -> Path:
        """Validate `cfg` (with the role's overrides merged in) against `model` and write it; returns its path."""
        path = self.run_dir / "config" / f"{name}.toml"
        merged = deep_update(copy.deepcopy(cfg), copy.deepcopy(self.overrides.get(role, {})))
        path.write_text(dump_toml(model.model_validate(merged)))
        return path

    def start(self, name: str, role: str, cfg: dict[str, Any], model: type[BaseModel], nice: int = 0) -> None:
        """Launch one role process; `nice` > 0 lowers its CPU priority."""
        path = self.write_config(name, role, cfg, model)
        log = open(self.run_dir / "logs" / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "swarmrl.cli", role, "--config", str(path)],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd,
            env={**os.environ, **CHILD_ENV, PARENT_PID_ENV: str(os.getpid())},  # ends with this process
            start_new_session=True,
        )
        log.close()  # the child holds its own copy
        if nice > 0:
            os.setpriority(os.PRIO_PROCESS, self.procs[name].pid, nice)

    def dead(self) -> list[str]:
        """Names of the processes that have exited."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def log_tail(self, name: str, lines: int = 20) -> str:
        text = (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every process group, SIGKILL those still there after `timeout` seconds."""
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_until_up(url: str, swarm: Swarm, timeout_s: float = 120.0) -> None:
    """Block until the coordinator at `url` answers (it starts its DHT seed before serving); RuntimeError with its
    log when it dies or does not answer in `timeout_s`. Its refusals while it starts are expected: not logged."""
    client = CoordinatorClient(url, retries=0, outage=Outage(url, quiet=True))
    deadline = time.time() + timeout_s
    while True:
        try:
            client.info()
            return
        except (CoordinatorError, httpx.TransportError) as e:
            if "coordinator" in swarm.dead() or time.time() > deadline:
                raise RuntimeError(f"the coordinator did not come up: {e}\n{swarm.log_tail('coordinator')}") from e
            time.sleep(0.3)
