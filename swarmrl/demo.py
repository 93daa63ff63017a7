"""`swarmrl demo`: a whole swarm on this machine, learning 3-digit addition by RL, watched live.

It builds and warms up the tiny model, then starts the coordinator, verifier, trainer and worker nodes as
separate processes talking over loopback exactly as they would across the internet (signed requests,
signed manifests, hash-checked shards). It shows progress live, and at the end checks the newest
published checkpoint itself on the held-out set, draws a plot and (with --report) writes a JSON report.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.messages import RunStatus
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.runtime.config import deep_update, dump_toml


class DemoConfig(BaseModel):
    """The local swarm's shape. Every field can be set with `--set name=value`."""

    model_config = ConfigDict(extra="forbid")

    run_dir: Path | None = Field(None, description="Where keys, data, logs and results go (default runs/demo-<time>).")
    nodes: int = Field(2, ge=1, description="Worker nodes to start.")
    verifiers: int = Field(1, ge=1, description="Verifier processes (each claims its own share of the pending groups).")
    engine: str = Field("auto", description="Node inference engine: auto (vLLM if installed), vllm or torch.")
    warmup_accuracy: float = Field(0.25, description="The supervised warm start stops at this greedy accuracy.")
    max_steps: int = Field(150, description="Trainer steps at most.")
    target_accuracy: float = Field(0.65, description="Stop early once the trainer's held-out accuracy reaches this.")
    time_limit_s: float = Field(900, description="Stop the RL phase after this many seconds.")
    batch_groups: int = Field(32, description="Groups (prompts) per trainer step.")
    group_size: int = Field(8, description="Rollouts per prompt.")
    prompts_per_lease: int = Field(8, description="Prompts a node leases at once.")
    max_staleness: int = Field(2, description="Groups more than this many versions old are refused (0 = synchronous).")
    lr: float = Field(3e-4, description="Trainer learning rate.")
    eval_every: int = Field(10, description="Trainer evaluates held-out accuracy every this many steps.")
    seed: int = Field(0, description="Seed of the model's initial weights and warm start.")
    node_nice: int = Field(
        10, ge=0, le=19, description="CPU niceness of the node processes. On one machine every role shares the "
        "cores and the trainer's step is the pipeline's critical path: nodes take the cycles it leaves.")
    p2p: bool = Field(True, description="Share checkpoints between nodes over libp2p (the coordinator seeds the DHT).")
    report: Path | None = Field(None, description="Write the JSON report here.")
    roles: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Extra settings per role (coordinator, node, verifier, trainer), merged "
        "over the ones the demo writes, e.g. --set roles.trainer.threads=4.")


LOOPBACK_MADDRS = ["/ip4/127.0.0.1/tcp/0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Swarm:
    """The demo's child processes, each with its own config file and log."""

    def __init__(self, run_dir: Path, overrides: dict[str, dict[str, Any]] | None = None):
        self.run_dir = run_dir
        self.overrides = overrides or {}
        self.procs: dict[str, subprocess.Popen] = {}
        (run_dir / "config").mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, name: str, role: str, cfg: dict[str, Any], model: type[BaseModel], nice: int = 0) -> None:
        """Launch one role process; `nice` > 0 lowers its CPU priority."""
        path = self.run_dir / "config" / f"{name}.toml"
        path.write_text(dump_toml(model.model_validate(deep_update(cfg, copy.deepcopy(self.overrides.get(role, {}))))))
        log = open(self.run_dir / "logs" / f"{name}.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "COLUMNS": "160"}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "swarmrl.cli", role, "--config", str(path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        if nice > 0:
            os.setpriority(os.PRIO_PROCESS, self.procs[name].pid, nice)

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def log_tail(self, name: str, lines: int = 20) -> str:
        text = (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> None:
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


def _wait_until_up(client: CoordinatorClient, swarm: Swarm, timeout_s: float = 120.0) -> None:
    """Block until the coordinator answers (it starts its DHT seed before serving)."""
    deadline = time.time() + timeout_s
    while True:
        try:
            client.info()
            return
        except (CoordinatorError, httpx.TransportError) as e:
            if "coordinator" in swarm.dead() or time.time() > deadline:
                raise RuntimeError(f"the coordinator did not come up: {e}\n{swarm.log_tail('coordinator')}") from e
            time.sleep(0.3)


def _metric_series(status: RunStatus, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.metrics[key]) for m in status.metrics if key in m.metrics]


def render(status: RunStatus | None, elapsed: float, cfg: DemoConfig, phase: str) -> Group:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row(phase, f"{elapsed:.0f} s")
    if status is None:
        return Group(head)
    acc = _metric_series(status, "eval_accuracy")
    rew = _metric_series(status, "reward_mean")
    step = status.metrics[-1].step if status.metrics else 0
    head.add_row("step", f"{step}/{cfg.max_steps}  (policy v{status.run.current_version})")
    head.add_row("held-out accuracy", " ".join(f"{a:.2f}" for _, a in acc[-8:]) or "-")
    head.add_row("rollout reward", f"{rew[-1][1]:.3f}" if rew else "-")
    head.add_row("groups", f"accepted [green]{status.groups_accepted}[/]  rejected [red]{status.groups_rejected}[/]  "
                           f"pending {status.groups_pending}")
    nodes = Table("node", "engine", "version", "accepted", "rejected", "banned", box=None)
    for n in status.nodes:
        nodes.add_row(n.name, n.engine, str(n.held_version), str(n.groups_accepted), str(n.groups_rejected),
                      "yes" if n.banned else "")
    return Group(head, nodes)


def plot(status: RunStatus, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    acc = _metric_series(status, "eval_accuracy")
    rew = _metric_series(status, "reward_mean")
    train_acc = _metric_series(status, "accuracy")
    if acc:
        ax1.plot(*zip(*acc, strict=True), marker="o", label="held-out greedy accuracy")
    if train_acc:
        ax1.plot(*zip(*train_acc, strict=True), alpha=0.5, label="rollout exact-match rate")
    ax1.set_xlabel("trainer step")
    ax1.set_ylabel("accuracy")
    ax1.set_ylim(0, 1)
    ax1.grid(alpha=0.3)
    ax1.legend()
    if rew:
        ax2.plot(*zip(*rew, strict=True), color="tab:orange")
    ax2.set_xlabel("trainer step")
    ax2.set_ylabel("mean reward of rollouts")
    ax2.grid(alpha=0.3)
    fig.suptitle("swarmrl demo: 3-digit addition, GRPO through a local swarm")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def evaluate_published(client: CoordinatorClient, coordinator_key: str, work: Path) -> tuple[int, float]:
    """Fetch the newest published checkpoint like a node would and measure its held-out accuracy."""
    from swarmrl.protocol.tasks import load_task
    from swarmrl.trainer.evaluate import accuracy
    from swarmrl.trainer.model import load_checkpoint
    from swarmrl.transfer.fetcher import CheckpointFetcher
    from swarmrl.transfer.sources import HttpOrigin

    signed = client.latest_manifest()
    assert signed is not None, "nothing was published"
    manifest, out = CheckpointFetcher(work, coordinator_key, [HttpOrigin(client)]).fetch(signed)
    model, tok = load_checkpoint(out)
    task = load_task(client.info().spec.task)
    return manifest.version, accuracy(model, tok, task.eval_set(), task)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    from swarmrl.coordinator.config import CoordinatorConfig
    from swarmrl.modelcmd import build_and_warm
    from swarmrl.node.config import NodeConfig
    from swarmrl.trainer.config import TrainerConfig
    from swarmrl.verifier.config import VerifierConfig

    console = Console()
    t_start = time.time()
    run_dir = (cfg.run_dir or Path("runs") / f"demo-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]swarmrl demo[/] in {run_dir}")
    verifier_names = ["verifier"] + [f"verifier{i}" for i in range(1, cfg.verifiers)]
    keys = {name: Identity.load_or_create(run_dir / "keys" / f"{name}.key")
            for name in ["coordinator", "trainer", *verifier_names]}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    run_id = f"demo-{int(t_start)}"
    unknown = set(cfg.roles) - {"coordinator", "node", "verifier", "trainer"}
    if unknown:
        raise ValueError(f"roles: unknown role(s) {sorted(unknown)}")
    swarm = Swarm(run_dir, cfg.roles)
    try:
        swarm.start("coordinator", "coordinator", {
            "host": "127.0.0.1", "port": port, "data_dir": str(run_dir / "coordinator"),
            "key_path": str(run_dir / "keys" / "coordinator.key"),
            "run": {"run_id": run_id, "model": "tiny Llama (0.86M), character tokenizer",
                    "task": {"name": "addition"}, "max_staleness": cfg.max_staleness,
                    "sampling": {"temperature": 1.0, "max_tokens": 6, "group_size": cfg.group_size}},
            "max_buffered_groups": cfg.batch_groups * max(cfg.max_staleness, 1),
            "p2p": {"host_maddrs": LOOPBACK_MADDRS} if cfg.p2p else None,
            "operator_keys": [keys[name].public_key_hex for name in ["trainer", *verifier_names]],
        }, CoordinatorConfig)
        _wait_until_up(CoordinatorClient(url, retries=0), swarm)
        # Nodes start now: importing vLLM and registering overlaps the warm start below.
        for i in range(cfg.nodes):
            swarm.start(f"node{i}", "node", {
                "coordinator_url": url, "coordinator_key": keys["coordinator"].public_key_hex,
                "key_path": str(run_dir / "keys" / f"node{i}.key"), "name": f"node{i}",
                "work_dir": str(run_dir / f"node{i}"), "max_prompts": cfg.prompts_per_lease, "progress": False,
                "engine": {"kind": cfg.engine},
                "p2p": {"enabled": cfg.p2p, "host_maddrs": LOOPBACK_MADDRS},
                # On loopback a poll costs next to nothing, and a node held back by backpressure should start
                # again as soon as the trainer takes a batch (at the default 0.5 s, the trainer waited for it).
                "poll_interval_s": 0.1,
            }, NodeConfig, nice=cfg.node_nice)
        for name in verifier_names:
            swarm.start(name, "verifier", {
                "coordinator_url": url, "key_path": str(run_dir / "keys" / f"{name}.key"),
                "work_dir": str(run_dir / name),
            }, VerifierConfig)

        init_dir = run_dir / "init"
        if not (init_dir / "config.json").exists():
            build_and_warm(init_dir, target_accuracy=cfg.warmup_accuracy, seed=cfg.seed, console=console)
        initial = json.loads((init_dir / "swarmrl.json").read_text())["warmup_accuracy"]

        swarm.start("trainer", "trainer", {
            "coordinator_url": url, "key_path": str(run_dir / "keys" / "trainer.key"),
            "state_dir": str(run_dir / "trainer"), "init_checkpoint": str(init_dir),
            "lr": cfg.lr, "batch_groups": cfg.batch_groups, "max_steps": cfg.max_steps,
            "eval_every": cfg.eval_every, "progress": False,
        }, TrainerConfig)

        client = CoordinatorClient(url)
        t_rl = time.time()
        status: RunStatus | None = None
        stop_reason = "max_steps"
        with Live(render(None, 0, cfg, "starting"), console=console, refresh_per_second=2) as live:
            while True:
                time.sleep(1.0)
                try:
                    status = client.status(metrics=1000)
                except (CoordinatorError, httpx.TransportError):
                    status = None
                phase = "learning" if status and status.metrics else "starting"
                live.update(Panel(render(status, time.time() - t_start, cfg, phase), title="swarmrl demo"))
                dead = swarm.dead()
                if "trainer" in dead:
                    stop_reason = "trainer finished" if swarm.procs["trainer"].returncode == 0 else "trainer died"
                    break
                # A node may die or be banned; the swarm goes on while any node lives, as a real pool would.
                essential = [n for n in dead if n == "coordinator" or n.startswith("verifier")]
                nodes_alive = [n for n in swarm.procs if n.startswith("node") and n not in dead]
                if essential or not nodes_alive:
                    stop_reason = f"{essential[0]} died" if essential else "every node died"
                    break
                acc = _metric_series(status, "eval_accuracy") if status else []
                if acc and acc[-1][1] >= cfg.target_accuracy:
                    stop_reason = "target accuracy reached"
                    break
                if time.time() - t_rl > cfg.time_limit_s:
                    stop_reason = "time limit"
                    break
        rl_seconds = time.time() - t_rl
        for name in swarm.dead():
            if swarm.procs[name].returncode not in (0, None):
                console.print(f"[red]{name} exited with {swarm.procs[name].returncode}[/]; last log lines:\n"
                              f"{swarm.log_tail(name)}")
        status = client.status(metrics=1000)  # the whole run's reports, for the plot
        version, final = evaluate_published(client, keys["coordinator"].public_key_hex, run_dir / "eval")
    finally:
        swarm.stop()
    plot(status, run_dir / "progress.png")
    engines = sorted({n.engine for n in status.nodes})
    report = {
        "initial_accuracy": initial,
        "final_accuracy": final,
        "final_version": version,
        "steps": status.metrics[-1].step if status.metrics else 0,
        "wall_seconds": round(time.time() - t_start, 1),
        "rl_seconds": round(rl_seconds, 1),
        "groups_accepted": status.groups_accepted,
        "groups_rejected": status.groups_rejected,
        "engine": engines[0] if len(engines) == 1 else ",".join(engines),
        "nodes": cfg.nodes,
        "stop_reason": stop_reason,
        "plot": str(run_dir / "progress.png"),
    }
    console.print(Panel(
        f"held-out accuracy [bold]{initial:.3f} -> {final:.3f}[/] in {report['steps']} steps, "
        f"{report['wall_seconds']:.0f} s ({stop_reason}); groups accepted {report['groups_accepted']}, "
        f"rejected {report['groups_rejected']}; engine {report['engine']}\nplot: {report['plot']}",
        title="result"))
    (run_dir / "report.json").write_text(json.dumps(report, indent=1))
    if cfg.report is not None:
        Path(cfg.report).write_text(json.dumps(report, indent=1))
    return report
