"""Role processes for fault tests and benchmarks: `swarmrl <role> --config FILE` as a real child process whose
output is kept (in a log file and in memory), that can be waited on by what it prints, killed with a real SIGKILL
and started again.

    coord = RoleProcess("coordinator", config_path, log_dir / "coordinator.log").start()
    url = coord.wait_for(lambda line: line.strip().startswith("url:")).split()[-1]
    coord.kill()          # SIGKILL, no goodbye
    coord.start()         # the same command again
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from swarmrl.runtime.lifetime import PARENT_PID_ENV

ROLE_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def kill_and_restart(proc: RoleProcess) -> None:
    """SIGKILL `proc` (no cleanup of any kind runs) and start it again; a coordinator is waited for (its URL)."""
    proc.kill()
    proc.start()
    if proc.role == "coordinator":
        proc.url()


def stop_all(procs: dict[str, RoleProcess], timeout: float = 30.0) -> None:
    """Stop every process, the coordinator last (the others may still be talking to it)."""
    for name, proc in procs.items():
        if name != "coordinator":
            proc.stop(timeout=timeout)
    if "coordinator" in procs:
        procs["coordinator"].stop(timeout=timeout)


class RoleProcess:
    """One role process at a time, started from `config`; its output goes to `log` (appended across restarts)."""

    def __init__(self, role: str, config: Path, log: Path, env: dict[str, str] | None = None,
                 args: list[str] | None = None):
        """`args`: more arguments after `--config FILE` (`--set key=value` overrides)."""
        self.role, self.config, self.log_path, self.args = role, config, log, list(args or [])
        self.env = {**os.environ, **ROLE_ENV, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.starts = 0
        self._first_line = 0
        self._changed = threading.Condition()
        self._reader: threading.Thread | None = None

    def start(self) -> RoleProcess:
        """Start the process (again, after a kill); lines it printed before are kept, `wait_for` looks only at
        this start's lines."""
        if self.alive:
            raise RuntimeError(f"{self.role} is still running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._changed:
            self.starts += 1
            self._first_line = len(self.lines)
        self.proc = subprocess.Popen([sys.executable, "-m", "swarmrl.cli", self.role, "--config", str(self.config),
                                      *self.args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**self.env, PARENT_PID_ENV: str(os.getpid())},
                                     start_new_session=True)  # ends with this process too
        self._reader = threading.Thread(target=self._drain, args=(self.proc,), daemon=True)
        self._reader.start()
        return self

    def _drain(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with open(self.log_path, "a") as log:
            log.write(f"---- start {self.starts} (pid {proc.pid})\n")
            for line in proc.stdout:  # keep reading, so the process never blocks on a full pipe
                log.write(line)
                log.flush()
                with self._changed:
                    self.lines.append(line)
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_for(self, match: Callable[[str], bool], timeout: float = 120.0) -> str:
        """The first line printed since the last start for which `match` is true; RuntimeError if the process
        ends first or `timeout` passes (with its last lines)."""
        deadline = time.monotonic() + timeout
        seen = self._first_line
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if match(line):
                        return line
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc is not None and self.proc.poll() is not None
                                      and not (self._reader and self._reader.is_alive())):
                    raise RuntimeError(f"{self.role}: no expected line ({'timeout' if remaining <= 0 else 'exited'})"
                                       f"; last lines:\n{self.tail()}")
                self._changed.wait(timeout=min(remaining, 1.0))

    def url(self, timeout: float = 120.0) -> str:
        """A coordinator's URL, from the `url:` line it prints once it listens."""
        return self.wait_for(lambda line: line.strip().startswith("url:"), timeout).split()[-1]

    def kill(self) -> None:
        """SIGKILL the process (and anything it started): no cleanup runs."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._reap()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._reap()
        return self.proc.returncode

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)

    def tail(self, n: int = 30) -> str:
        return "".join(self.lines[-n:])
