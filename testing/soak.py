"""A pool made by docker/setup_pool.py, run on loopback as `swarmrl <role>` processes and put through faults: what
tests/test_soak.py (minutes, in CI) and bench/soak.py (an hour) drive.

The configs are the setup script's own (a random model: WARMUP_ACCURACY=0), with what makes the pool small and
quick given as `--set` overrides: a small quarantine warm-up K, so that nodes soon leave it and their groups start
being held; a small buffer and batch; the torch engine. Training steps are read from the trainer's step log and
timed here, so a gap between steps (a stall) shows whatever caused it.

    pool = SoakPool(tmp / "pool").start()
    pool.wait_steps(2, bound_s=240)
    pool.fault("coordinator")          # SIGKILL, then start again
    pool.wait_steps(2, bound_s=240)    # TimeoutError naming the watchdog's blockers if steps stop
    pool.stop()
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarmrl.protocol.overview import Training
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.runtime.retry import RetryPolicy
from swarmrl.testing.faults import free_port
from swarmrl.testing.processes import RoleProcess, kill_and_restart, stop_all
from swarmrl.trainer.state import read_step_log

SETUP_POOL = Path(__file__).resolve().parents[1] / "docker" / "setup_pool.py"
FAULTS = ("coordinator", "verifier", "trainer", "node0")
"""What `fault` can hit, in the order bench/soak.py goes round them."""


@dataclass
class Timeline:
    """When each training step was first seen, and the faults, in seconds since the pool started."""

    steps: list[float] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)
    held_seen: int = 0
    """The most groups seen held at once (nodes past their warm-up, groups waiting for their checks)."""

    def gaps(self) -> list[float]:
        """Seconds between consecutive steps."""
        return [b - a for a, b in zip(self.steps, self.steps[1:], strict=False)]


class SoakPool:
    """The pool's processes under `root` (made by the setup script there)."""

    def __init__(self, root: Path, *, nodes: int = 2, batch_groups: int = 8, max_buffered_groups: int = 16,
                 warmup_checks: int = 4, sample_rate: float = 0.1):
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "COORDINATOR_URL": self.url, "WARMUP_ACCURACY": "0", "RUN_ID": "soak"}
        env.pop("METRICS_PORT", None)
        subprocess.run([sys.executable, str(SETUP_POOL), str(root)], env=env, check=True, capture_output=True)
        config, logs = root / "config", root / "logs"
        self.state_dir = root / "trainer"
        sets = {
            "coordinator": {"max_buffered_groups": max_buffered_groups, "claim_ttl_s": 15, "node_gone_after_s": 20,
                            "housekeeping_interval_s": 1, "keep_versions": 50, "watchdog.stall_after_s": 120},
            "verifier": {"warmup_checks": warmup_checks, "sample_rate": sample_rate, "long_poll_s": 1,
                         "poll_interval_s": 0.1},
            # A random model earns little reward: train on every group, so that steps measure the pool, not luck.
            "trainer": {"batch_groups": batch_groups, "eval_every": 0, "long_poll_s": 1, "poll_interval_s": 0.1,
                        "keep_states": 2, "loss.filter_zero_advantage": "false", "max_steps": 10**9,
                        "check_engine": "torch"},  # the nodes' engine here
        }
        self.procs = {role: RoleProcess(role, config / f"{role}.toml", logs / f"{role}.log", args=_sets(s))
                      for role, s in sets.items()}
        for i in range(nodes):
            self.procs[f"node{i}"] = RoleProcess("node", config / "node.toml", logs / f"node{i}.log", args=_sets({
                "name": f"node{i}", "key_path": root / "keys" / f"node{i}.key", "work_dir": root / f"node{i}",
                "engine.kind": "torch", "max_prompts": 4, "poll_interval_s": 0.1, "heartbeat_interval_s": 2}))
        self.client = CoordinatorClient(self.url, retry=RetryPolicy(attempts=None, base_s=0.2, cap_s=1.0,
                                                                    give_up_after_s=120))
        self.timeline = Timeline()
        self._t0 = time.monotonic()

    def start(self) -> SoakPool:
        self.procs["coordinator"].start().url()
        for name, proc in self.procs.items():
            if name != "coordinator":
                proc.start()
        self._t0 = time.monotonic()
        return self

    def now(self) -> float:
        return time.monotonic() - self._t0

    def steps(self) -> int:
        """Training steps so far (the trainer's step log), timing each new one."""
        n = len(read_step_log(self.state_dir))
        while len(self.timeline.steps) < n:
            self.timeline.steps.append(self.now())
        return n

    def training(self) -> Training | None:
        try:
            return self.client.training()
        except Exception:  # the coordinator is being restarted: nothing to say now
            return None

    def check_alive(self) -> None:
        """RuntimeError, with its last lines, when a role exited on its own (every role here runs until stopped)."""
        dead = [n for n, p in self.procs.items() if not p.alive]
        if dead:
            raise RuntimeError(f"{dead[0]} exited on its own:\n{self.procs[dead[0]].tail()}")

    def wait_steps(self, more: int, bound_s: float, poll_s: float = 0.5) -> None:
        """Until `more` further steps are logged; TimeoutError, with the watchdog's blockers and each role's last
        lines, when no step comes for `bound_s`, or RuntimeError when a role exits on its own."""
        target, last_step_at = self.steps() + more, self.now()
        seen = self.steps()
        while self.steps() < target:
            if self.steps() > seen:
                seen, last_step_at = self.steps(), self.now()
            self.check_alive()
            self.note_held()
            if self.now() - last_step_at > bound_s:
                t = self.training()
                logs = "\n".join(f"-- {n}:\n{p.tail(8)}" for n, p in self.procs.items())
                raise TimeoutError(f"no training step for {bound_s:.0f} s (step {seen}); the watchdog says: "
                                   f"{t.why if t else 'nothing (unreachable)'}\n{logs}")
            time.sleep(poll_s)  # the polling interval of an observable condition (the step log)

    def note_held(self) -> None:
        """Remember the most groups held at once (read from the coordinator; nothing when it is down)."""
        try:
            held = self.client.status(nodes=0, metrics=0).groups_held
        except Exception:
            return
        self.timeline.held_seen = max(self.timeline.held_seen, held)

    def nodes_checks_passed(self) -> list[int]:
        return [n.checks_passed for n in self.client.status(nodes=100, metrics=0).nodes]

    def fault(self, name: str) -> None:
        """SIGKILL `name` (no cleanup of any kind runs) and start it again."""
        self.timeline.faults.append((self.now(), name))
        kill_and_restart(self.procs[name])

    def stop(self) -> None:
        """Stop every process (the coordinator last: the others may still be talking to it)."""
        stop_all(self.procs)
        self.client.close()


def _sets(settings: dict[str, object]) -> list[str]:
    return [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
