"""A small real run to kill: a coordinator, a trainer, a verifier and nodes as `swarmrl <role>` processes on
loopback (torch engine, a tiny random Llama, no peer-to-peer), each of which can be SIGKILLed and started again,
and the audit that says afterwards whether anything was lost or counted twice.

    run = FaultRun(tmp / "run", checkpoint, nodes=2, max_steps=6).start()
    run.wait(lambda: run.trainer_steps() >= 1, "a first step")
    run.kill_and_restart("coordinator")
    ...
    run.wait_done(); run.stop()
    problems = audit(run.store_url, run.state_dir).problems      # [] when every count adds up
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.node.config import NodeConfig
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.runtime.config import dump_toml
from swarmrl.runtime.retry import RetryPolicy
from swarmrl.testing.audit import Audit, audit
from swarmrl.testing.processes import RoleProcess, kill_and_restart, stop_all
from swarmrl.trainer.config import TrainerConfig
from swarmrl.trainer.state import read_step_log
from swarmrl.verifier.config import VerifierConfig

__all__ = ["Audit", "FaultRun", "audit"]
RUN_ID = "faults"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FaultRun:
    """The run's processes, configs and logs under `root`; the coordinator keeps one port across restarts."""

    def __init__(self, root: Path, checkpoint: Path, *, nodes: int = 2, max_steps: int = 6, batch_groups: int = 4,
                 store_url: str | None = None):
        self.root, self.checkpoint, self.max_steps = root, checkpoint, max_steps
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        keys = root / "keys"
        self.trainer_key = Identity.load_or_create(keys / "trainer.key")
        self.verifier_key = Identity.load_or_create(keys / "verifier.key")
        self.state_dir = root / "trainer"
        self.coordinator_key = Identity.load_or_create(root / "coordinator" / "coordinator.key").public_key_hex
        coordinator = CoordinatorConfig.model_validate({
            "host": "127.0.0.1", "port": self.port, "data_dir": str(root / "coordinator"), "store_url": store_url,
            "operator_keys": [self.trainer_key.public_key_hex, self.verifier_key.public_key_hex],
            "lease_ttl_s": 60.0, "claim_ttl_s": 10.0, "node_gone_after_s": 20.0, "housekeeping_interval_s": 1.0,
            "max_buffered_groups": batch_groups * 3,
            # Every version's shards stay: a verifier restarted late still finds the weights of old groups.
            "keep_versions": max_steps + 2,
            "run": {"run_id": RUN_ID, "max_staleness": 2, "sampling": {"group_size": 4, "max_tokens": 4}}})
        self.store_url = coordinator.resolved_store_url
        trainer = TrainerConfig.model_validate({
            "coordinator_url": self.url, "key_path": str(keys / "trainer.key"), "state_dir": str(self.state_dir),
            "init_checkpoint": str(checkpoint), "batch_groups": batch_groups, "max_steps": max_steps,
            "eval_every": 0, "long_poll_s": 1.0, "poll_interval_s": 0.1, "keep_states": 2, "progress": False,
            "check_engine": "torch",  # the nodes' engine here
            "loss": {"filter_zero_advantage": False}})  # a random model earns no reward: train on every group
        verifier = VerifierConfig.model_validate({
            "coordinator_url": self.url, "key_path": str(keys / "verifier.key"), "work_dir": str(root / "verifier"),
            "batch": 16, "long_poll_s": 1.0, "poll_interval_s": 0.1})
        configs: dict[str, Any] = {"coordinator": coordinator, "trainer": trainer, "verifier": verifier}
        for i in range(nodes):
            configs[f"node{i}"] = NodeConfig.model_validate({
                "coordinator_url": self.url, "key_path": str(keys / f"node{i}.key"), "name": f"node{i}",
                "work_dir": str(root / f"node{i}"), "max_prompts": 2, "poll_interval_s": 0.1,
                "heartbeat_interval_s": 2.0, "receipts_interval_s": 2.0, "progress": False,
                "engine": {"kind": "torch"}, "p2p": {"enabled": False}})
        self.procs: dict[str, RoleProcess] = {}
        for name, cfg in configs.items():
            path = root / "config" / f"{name}.toml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(dump_toml(cfg))
            role = "node" if name.startswith("node") else name
            self.procs[name] = RoleProcess(role, path, root / "logs" / f"{name}.log")
        self.kills: list[tuple[str, str]] = []  # (role, the progress at which it was killed)
        self.client = CoordinatorClient(self.url, retry=RetryPolicy(attempts=None, base_s=0.1, cap_s=1.0,
                                                                    give_up_after_s=300))

    @property
    def receipt_files(self) -> list[Path]:
        """Every node's receipts.jsonl (those that exist)."""
        return sorted(self.root.glob("node*/receipts.jsonl"))

    def audit(self) -> Audit:
        """The audit of this run (every process stopped): database, step log, ledger, nodes' receipts."""
        return audit(self.store_url, self.state_dir, self.receipt_files, self.coordinator_key)

    def start(self) -> FaultRun:
        self.procs["coordinator"].start().url()
        for name, proc in self.procs.items():
            if name != "coordinator":
                proc.start()
        return self

    # -- watching ---------------------------------------------------------------------------------------

    def trainer_steps(self) -> int:
        """Steps the trainer has logged (`steps.jsonl`)."""
        return len(read_step_log(self.state_dir))

    def accepted(self) -> int:
        """Groups the coordinator has accepted (asked over HTTP, riding out its restarts)."""
        return self.client.status(nodes=0, metrics=0).groups_accepted

    def submitted(self) -> int:
        st = self.client.status(nodes=0, metrics=0)
        return st.groups_pending + st.groups_held + st.groups_accepted + st.groups_rejected

    def wait(self, condition: Callable[[], bool], what: str, timeout: float = 300.0) -> None:
        """Until `condition()`, checking that no process died on its own meanwhile."""
        deadline = time.monotonic() + timeout
        while not condition():
            dead = [n for n, p in self.procs.items() if not p.alive and not (n == "trainer" and p.proc is not None
                                                                             and p.proc.returncode == 0)]
            if dead:
                raise RuntimeError(f"{dead[0]} exited while waiting for {what}:\n{self.procs[dead[0]].tail()}")
            if time.monotonic() > deadline:
                logs = "\n".join(f"-- {n}:\n{p.tail(12)}" for n, p in self.procs.items())
                raise TimeoutError(f"timed out waiting for {what}; the last lines of each role's log:\n{logs}")
            time.sleep(0.2)  # the polling interval of an observable condition

    def trainer_finished(self) -> bool:
        """Whether the trainer has taken its max_steps and exited: the run is over, and groups stop flowing once
        the coordinator's buffer of untrained ones is full."""
        trainer = self.procs["trainer"].proc
        return trainer is not None and trainer.poll() == 0

    def wait_at_least(self, measure: Callable[[], int], target: int, what: str, timeout: float = 300.0) -> int:
        """Until `measure()` reaches `target`, or the trainer has finished (no more progress is due after it);
        the measure's value then."""
        self.wait(lambda: self.trainer_finished() or measure() >= target, f"{what} to reach {target}", timeout)
        return measure()

    def wait_done(self, timeout: float = 900.0) -> None:
        """Until the trainer has taken max_steps and exited."""
        trainer = self.procs["trainer"]
        self.wait(lambda: trainer.proc is not None and trainer.proc.poll() is not None, "the trainer to finish",
                  timeout)
        if trainer.proc is not None and trainer.proc.returncode != 0:
            raise RuntimeError(f"the trainer exited with {trainer.proc.returncode}:\n{trainer.tail()}")

    # -- faults -----------------------------------------------------------------------------------------

    def kill_and_restart(self, name: str, when: str = "") -> None:
        """SIGKILL `name` (no cleanup of any kind runs) and start it again."""
        self.kills.append((name, when))
        kill_and_restart(self.procs[name])

    def stop(self) -> None:
        """Stop every process (the coordinator last: the others may still be talking to it)."""
        stop_all(self.procs)
        self.client.close()
