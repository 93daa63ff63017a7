"""`swarmrl demo`: a whole swarm on this machine, learning a task by RL, watched live.

With no arguments it builds and warms up the tiny adder and improves it on 3-digit addition. Given a run config it
runs any pool's run description (`[run]`: task and options, sampling, staleness) on any model: a checkpoint
directory (`[model] path`, e.g. an instruct model downloaded beforehand) or a `swarmrl model` recipe
(`[model.build]`), optionally warmed up first on the task's reference solutions (`[warmup]`), with per-role
settings (`[roles.trainer]`, ...). It starts the coordinator, verifier(s), trainer and worker nodes as separate
processes (`swarmrl.localswarm`) talking over loopback exactly as they would across the internet (signed
requests, signed manifests, hash-checked shards), shows progress live, and at the end checks the newest published
checkpoint itself on the held-out problems (greedy accuracy and mean trusted reward, before and after), draws a
plot and writes a JSON report.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator
from rich.console import Console
from rich.live import Live
from rich.panel import Panel

from swarmrl.demoview import metric_series, plot, render
from swarmrl.localswarm import LOOPBACK_MADDRS, Swarm, free_port, wait_until_up
from swarmrl.modelcmd import ModelRecipe
from swarmrl.protocol.episodes import load_environment
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.messages import RunStatus
from swarmrl.protocol.run import RunSpec, SamplingSpec
from swarmrl.protocol.tasks import Task, TaskSpec, task_options
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.trainer.warmup import WarmupConfig

ADDITION_MODEL = "tiny Llama (0.86M), character tokenizer"


def addition_run() -> RunSpec:
    """The zero-argument demo's run: 3-digit addition, 8 rollouts of at most 6 tokens at T = 1, k = 2."""
    return RunSpec(model=ADDITION_MODEL, task=TaskSpec(name="addition"), max_staleness=2,
                   sampling=SamplingSpec(temperature=1.0, max_tokens=6, group_size=8))


class ModelSource(BaseModel):
    """Where the swarm's initial policy comes from: a checkpoint directory, or a recipe to build one."""

    model_config = ConfigDict(extra="forbid")

    path: Path | None = Field(None, description="A Hugging Face causal LM directory (safetensors, config, tokenizer) "
                              "to start from, e.g. an instruct model downloaded beforehand; None: build one.")
    build: ModelRecipe = Field(default_factory=ModelRecipe, description="The `swarmrl model` recipe used when "
                               "`path` is None (its weights are seeded by the demo's `seed`).")


class DemoConfig(BaseModel):
    """A local swarm's run config. Every field can be set with `--set name=value`. A relative path is relative to the
    config file's directory when written there, to the working directory when given with --set; the task's own data
    paths resolve against `data_dir`."""

    model_config = ConfigDict(extra="forbid")

    run_dir: Path | None = Field(None, description="Where keys, data, logs and results go (default runs/demo-<time>).")
    data_dir: Path = Field(Path("."), description="Where the task's relative data paths resolve: every role runs in "
                           "this directory, and the demo loads the task from it.")
    run: RunSpec = Field(default_factory=addition_run, description="The pool's run description (task and options, "
                         "sampling, max_staleness, proofs), as in a coordinator's [run] table: a [run] given replaces "
                         "the whole default (its fields not given take RunSpec's defaults). run_id not given: "
                         "demo-<time>; model not given: described from [model].")
    model: ModelSource = Field(default_factory=ModelSource, description="The initial policy.")
    warmup: WarmupConfig = Field(default_factory=WarmupConfig, description="Supervised warm start on the task's "
                                 "training split before RL. target_accuracy = 0: none; the default, 0.25, is the "
                                 "adder's: set 0 for a model that needs none (an instruct model, say).")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="cpu: every role in float32 on the CPU; cuda: the trainer, the verifier (bf16 "
        "recomputation), the nodes' engines (bf16) and the demo's evaluations on the GPU. [roles] settings win.")
    nodes: int = Field(2, ge=1, description="Worker nodes to start.")
    verifiers: int = Field(1, ge=1, description="Verifier processes (each claims its own share of the pending groups).")
    engine: Literal["auto", "vllm", "torch"] = Field("auto", description="Node inference engine: auto (vLLM if "
                                                    "installed), vllm or torch.")
    max_steps: int = Field(150, description="Trainer steps at most.")
    target_accuracy: float = Field(0.65, description="Stop early once the trainer's held-out accuracy reaches this.")
    time_limit_s: float = Field(900, description="Stop the RL phase after this many seconds.")
    batch_groups: int = Field(32, description="Groups (prompts) per trainer step.")
    prompts_per_lease: int = Field(8, description="Prompts a node leases at once.")
    lr: float = Field(3e-4, description="Trainer learning rate.")
    eval_every: int = Field(10, description="Trainer evaluates held-out accuracy every this many steps (0: never).")
    eval_size: int = Field(500, ge=1, description="Held-out problems evaluated (the first of the task's held-out set): "
                           "by the trainer, and by the demo before and after RL.")
    seed: int = Field(0, description="Seed of the model's initial weights (and its BPE) and of the warm start.")
    node_nice: int = Field(
        10, ge=0, le=19, description="CPU niceness of the node processes. On one machine every role shares the "
        "cores and the trainer's step is the pipeline's critical path: nodes take the cycles it leaves.")
    p2p: bool = Field(True, description="Share checkpoints between nodes over libp2p (the coordinator seeds the DHT).")
    report: Path | None = Field(None, description="Write the JSON report here.")
    roles: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Extra settings per role (coordinator, node, verifier, trainer), merged "
        "over the ones the demo writes, e.g. --set roles.trainer.threads=4.")


    @field_validator("run")
    @classmethod
    def _known_task(cls, run: RunSpec) -> RunSpec:
        task_options(run.task)  # the task is registered and takes these options (its data is read at the start)
        if run.environment is not None:  # refused now, in one line, unless it loads and replays (protocol.episodes)
            load_environment(run.environment)
        return run


def _load_task(spec: TaskSpec, data_dir: Path) -> Task:
    from swarmrl.protocol.tasks import load_task

    return load_task(spec, data_dir)


def _scores(model: Any, tok: Any, task: Task, cfg: DemoConfig) -> tuple[float, float]:
    from swarmrl.trainer.evaluate import held_out_scores, run_episodes

    return held_out_scores(model.to(cfg.device), tok, list(task.eval_set())[: cfg.eval_size], task,
                           episodes=run_episodes(cfg.run))


def prepare_model(cfg: DemoConfig, task: Task, init_dir: Path, console: Console) -> tuple[Path, dict[str, Any]]:
    """The initial checkpoint (built or loaded, warmed up when asked) and its held-out scores before RL. An
    `init_dir` that already holds a checkpoint is used as it is (a rerun, or a benchmark's shared start)."""
    from swarmrl.modelcmd import build_from_recipe, warm_and_save
    from swarmrl.models.build import count_parameters, load_checkpoint

    if (init_dir / "config.json").exists():
        ckpt, (model, tok) = init_dir, load_checkpoint(init_dir)
        meta = json.loads((init_dir / "swarmrl.json").read_text()) if (init_dir / "swarmrl.json").exists() else {}
    else:
        if cfg.model.path is not None:
            model, tok = load_checkpoint(cfg.model.path)
            meta = {"source": str(cfg.model.path), "parameters": count_parameters(model)}
        else:
            model, tok, meta = build_from_recipe(cfg.model.build, cfg.seed, task)
            console.print(f"[bold]model[/] {type(model).__name__}, {meta['parameters'] / 1e6:.2f}M parameters, "
                          f"{meta['tokenizer']} tokenizer of {meta['vocab']} tokens")
        if cfg.model.path is not None and cfg.warmup.target_accuracy <= 0:
            ckpt = cfg.model.path  # used in place: no copy of a large model
        else:
            from swarmrl.trainer.evaluate import run_episodes

            meta = warm_and_save(model, tok, init_dir, {**meta, "task": cfg.run.task.model_dump()}, task, cfg.warmup,
                                 console, seed=cfg.seed, episodes=run_episodes(cfg.run))
            ckpt = init_dir
    t0 = time.time()
    accuracy, reward = _scores(model, tok, task, cfg)
    console.print(f"[bold]model[/] before RL: held-out accuracy {accuracy:.3f}, mean reward {reward:.3f} "
                  f"({time.time() - t0:.0f} s)")
    return ckpt, {**meta, "accuracy": accuracy, "reward": reward}


def refuse_unreplayable(ckpt: Path, run: RunSpec, cfg: DemoConfig, swarm: Swarm, url: str, task: Task,
                        console: Console) -> None:
    """Probe the model with the nodes' engine on the task's prompts and replay it with the verifier's checks at the
    run's temperature (`compat.check_model`), so that no node is leased work for it first; when that fails, write
    report.json (the refusal, and the standing of the nodes once they have registered: none has had work) and
    raise `ModelRefused` with the one line that says what failed."""
    from swarmrl.compat import ModelRefused, check_model, engine_kinds

    kind = cfg.roles.get("node", {}).get("engine", {}).get("kind", cfg.engine)
    console.print(f"[bold]model[/] compatibility check: {kind} engine and the verifier at T = "
                  f"{run.sampling.temperature:g}")
    rng = random.Random(cfg.seed)
    problem = check_model(Path(ckpt), run, engine_kinds(kind), prompts=[task.sample(rng).prompt for _ in range(4)])
    if problem is None:
        return
    client = CoordinatorClient(url)
    deadline = time.monotonic() + 120
    status = client.status()
    while status.nodes_total < cfg.nodes and time.monotonic() < deadline and \
            any(n.startswith("node") and n not in swarm.dead() for n in swarm.procs):
        time.sleep(0.5)  # polls an observable condition (the nodes' registration), for the report only
        status = client.status()
    (swarm.run_dir / "report.json").write_text(json.dumps({
        "refused": problem, "nodes_banned": status.nodes_banned, "groups_rejected": status.groups_rejected,
        "nodes": [{"node": n.node_id, "banned": n.banned, "leased": n.prompts_leased, "rejected": n.groups_rejected}
                  for n in status.nodes]}, indent=1))
    raise ModelRefused(f"the run is refused before it starts: {problem}. Use a model this install can replay "
                       "(README: Models)")


def evaluate_published(client: CoordinatorClient, coordinator_key: str, work: Path, task: Task, cfg: DemoConfig
                       ) -> tuple[int, float, float]:
    """Fetch the newest published checkpoint like a node would; (its version, held-out accuracy, mean reward)."""
    from swarmrl.models.build import load_checkpoint
    from swarmrl.transfer.fetcher import CheckpointFetcher
    from swarmrl.transfer.sources import HttpOrigin

    signed = client.latest_manifest()
    assert signed is not None, "nothing was published"
    fetcher = CheckpointFetcher(work, coordinator_key, [HttpOrigin(client)], manifests=client.manifest)
    manifest, out = fetcher.fetch(signed)  # a delta: rebuilt from the full checkpoint its chain starts at
    model, tok = load_checkpoint(out)
    return (manifest.version, *_scores(model, tok, task, cfg))


def checkpoint_traffic(status: RunStatus) -> dict[str, Any]:
    """What a receiver fetched per published version (the trainer's `publish_bytes` reports: a delta's payloads, or
    the full checkpoint), against the full checkpoint's size."""
    per_version = {int(r.metrics["publish_version"]): (int(r.metrics["publish_bytes"]),
                                                       int(r.metrics["publish_full_bytes"]))
                   for r in status.metrics if "publish_bytes" in r.metrics}
    if not per_version:
        return {}
    ratios = sorted(sent / full for sent, full in per_version.values() if full)
    return {"versions": len(per_version), "full_bytes": max(full for _, full in per_version.values()),
            "median_bytes_sent": int(statistics.median(sent for sent, _ in per_version.values())),
            "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
            "bytes_sent": [[v, sent] for v, (sent, _) in sorted(per_version.items())]}


def describe_model(source: ModelSource) -> str:
    """The run's model description when the config gives none: the directory's name, or the recipe."""
    if source.path is not None:
        return source.path.resolve().name
    b = source.build
    return f"{b.arch} {b.size}, {b.tokenizer} tokenizer, random init"


def buffered_groups(cfg: DemoConfig, run: RunSpec) -> int:
    """The coordinator's backpressure bound: enough groups in flight to keep the nodes busy, few enough that they do
    not go stale. Groups handed to the trainer leave the count at once, the zero-advantage ones a trainer that fills
    its batches with informative groups reads past included, so `batch_groups * k` is room for every batch. More
    room only lengthens the queue before the verifier: with three times as much, groups waited 6-8 s for their
    verdict, one to three trainer steps, and half of those the trainer read had gone stale (bench/RESULTS.md,
    "reasoning-gym through the whole swarm, warmed up to 0.2"). Here new weights reach the nodes at once; a pool
    whose nodes wait for them needs a batch more (`CoordinatorConfig.max_buffered_groups`)."""
    return cfg.batch_groups * max(run.max_staleness, 1)


def start_roles(swarm: Swarm, cfg: DemoConfig, run: RunSpec, url: str, port: int, keys: dict[str, Identity]) -> None:
    """Start the coordinator (and wait for it), the nodes and the verifiers; the trainer comes once the model is."""
    from swarmrl.coordinator.config import CoordinatorConfig
    from swarmrl.node.config import NodeConfig
    from swarmrl.verifier.config import VerifierConfig

    run_dir, cuda = swarm.run_dir, cfg.device == "cuda"
    verifier_names = [n for n in keys if n.startswith("verifier")]
    swarm.start("coordinator", "coordinator", {
        "host": "127.0.0.1", "port": port, "data_dir": str(run_dir / "coordinator"),
        "key_path": str(run_dir / "keys" / "coordinator.key"), "run": run.model_dump(mode="json"),
        "max_buffered_groups": buffered_groups(cfg, run),
        "keep_versions": run.max_staleness + 3,  # what the verifiers keep (below): they can fetch each again
        # Every node of the demo runs on this machine, so from one address: give them all a newcomer's allowance.
        "admission": {"unproven_per_source": cfg.prompts_per_lease * (cfg.nodes + 1)},
        "p2p": {"host_maddrs": LOOPBACK_MADDRS} if cfg.p2p else None,
        "operator_keys": [keys[name].public_key_hex for name in ["trainer", *verifier_names]],
    }, CoordinatorConfig)
    wait_until_up(url, swarm)
    # Nodes start now: importing vLLM and registering overlaps building and warming up the model.
    for i in range(cfg.nodes):
        swarm.start(f"node{i}", "node", {
            "coordinator_url": url, "coordinator_key": keys["coordinator"].public_key_hex,
            "key_path": str(run_dir / "keys" / f"node{i}.key"), "name": f"node{i}",
            "work_dir": str(run_dir / f"node{i}"), "max_prompts": cfg.prompts_per_lease, "progress": False,
            "engine": {"kind": cfg.engine, **({"dtype": "bfloat16", "device": "cuda"} if cuda else {})},
            "p2p": {"enabled": cfg.p2p, "host_maddrs": LOOPBACK_MADDRS},
            # On loopback a poll costs next to nothing, and a node held back by backpressure should start
            # again as soon as the trainer takes a batch (at the default 0.5 s, the trainer waited for it).
            "poll_interval_s": 0.1,
        }, NodeConfig, nice=cfg.node_nice)
    for name in verifier_names:
        swarm.start(name, "verifier", {
            "coordinator_url": url, "coordinator_key": keys["coordinator"].public_key_hex,
            "key_path": str(run_dir / "keys" / f"{name}.key"), "work_dir": str(run_dir / name),
            "sample_rate": 1.0,  # a local swarm checks every group: its runs are what the verifier is measured on
            # One claimed batch can span more versions than k + 1 (groups pending while the trainer steps fast), and
            # the verifier loads them all before it checks any: with only k + 1 kept, an evicted version whose shards
            # the coordinator has pruned since cannot be loaded again, and the verifier stopped (VersionUnavailable).
            "keep_versions": run.max_staleness + 3,
            **({"dtype": "bfloat16", "device": "cuda"} if cuda else {}),
        }, VerifierConfig)


def watch(swarm: Swarm, client: CoordinatorClient, cfg: DemoConfig, t_start: float, console: Console) -> str:
    """Show the run live until it ends; returns why it ended."""
    with Live(render(None, 0, cfg.max_steps, "starting"), console=console, refresh_per_second=2) as live:
        t_rl = time.time()
        while True:
            time.sleep(1.0)
            try:
                status: RunStatus | None = client.status(metrics=1000)
            except (CoordinatorError, httpx.TransportError):
                status = None
            phase = "learning" if status and status.metrics else "starting"
            live.update(Panel(render(status, time.time() - t_start, cfg.max_steps, phase), title="swarmrl demo"))
            dead = swarm.dead()
            if "trainer" in dead:
                return "trainer finished" if swarm.procs["trainer"].returncode == 0 else "trainer died"
            # A node may die or be banned; the swarm goes on while any node lives, as a real pool would.
            essential = [n for n in dead if n == "coordinator" or n.startswith("verifier")]
            nodes_alive = [n for n in swarm.procs if n.startswith("node") and n not in dead]
            if essential or not nodes_alive:
                return f"{essential[0]} died" if essential else "every node died"
            acc = metric_series(status, "eval_accuracy") if status else []
            if acc and acc[-1][1] >= cfg.target_accuracy:
                return "target accuracy reached"
            if time.time() - t_rl > cfg.time_limit_s:
                return "time limit"


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the local swarm `cfg` describes to its end; returns the report (also written to run_dir/report.json)."""
    from swarmrl.trainer.config import TrainerConfig

    console = Console()
    t_start = time.time()
    run_dir = (cfg.run_dir or Path("runs") / f"demo-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    data_dir = cfg.data_dir.resolve()
    console.print(f"[bold]swarmrl demo[/] in {run_dir}")
    task = _load_task(cfg.run.task, data_dir)  # a bad task or data file stops us before anything starts
    verifier_names = ["verifier"] + [f"verifier{i}" for i in range(1, cfg.verifiers)]
    keys = {name: Identity.load_or_create(run_dir / "keys" / f"{name}.key")
            for name in ["coordinator", "trainer", *verifier_names]}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    update: dict[str, Any] = {}
    if "run_id" not in cfg.run.model_fields_set:
        update["run_id"] = f"demo-{int(t_start)}"
    if "model" not in cfg.run.model_fields_set:
        update["model"] = describe_model(cfg.model)
    run = cfg.run.model_copy(update=update)
    swarm = Swarm(run_dir, cfg.roles, cwd=data_dir)
    try:
        start_roles(swarm, cfg, run, url, port, keys)
        ckpt, before = prepare_model(cfg, task, run_dir / "init", console)
        refuse_unreplayable(ckpt, run, cfg, swarm, url, task, console)  # before anything is published
        swarm.start("trainer", "trainer", {
            "coordinator_url": url, "key_path": str(run_dir / "keys" / "trainer.key"),
            "state_dir": str(run_dir / "trainer"), "init_checkpoint": str(Path(ckpt).resolve()),
            "lr": cfg.lr, "batch_groups": cfg.batch_groups, "max_steps": cfg.max_steps,
            "eval_every": cfg.eval_every, "eval_size": cfg.eval_size, "progress": False,
            "check_engine": "off",  # checked above, with the nodes' own engine, before any role had work
            **({"device": "cuda"} if cfg.device == "cuda" else {}),
        }, TrainerConfig)
        client = CoordinatorClient(url)
        t_rl = time.time()
        stop_reason = watch(swarm, client, cfg, t_start, console)
        rl_seconds = time.time() - t_rl
        for name in swarm.dead():
            if swarm.procs[name].returncode not in (0, None):
                console.print(f"[red]{name} exited with {swarm.procs[name].returncode}[/]; last log lines:\n"
                              f"{swarm.log_tail(name)}")
        status = client.status(metrics=1000)  # the whole run's reports, for the plot
        version, final_acc, final_reward = evaluate_published(
            client, keys["coordinator"].public_key_hex, run_dir / "eval", task, cfg)
    finally:
        swarm.stop()
        task.close()
    plot(status, run_dir / "progress.png", f"swarmrl demo: {cfg.run.task.name}, GRPO through a local swarm")
    engines = sorted({n.engine for n in status.nodes})
    report = {
        "task": cfg.run.task.name,
        "model": run.model,
        "parameters": before.get("parameters"),
        "initial_accuracy": before["accuracy"],
        "final_accuracy": final_acc,
        "initial_reward": before["reward"],
        "final_reward": final_reward,
        "eval_problems": min(cfg.eval_size, len(task.eval_set())),
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
        "checkpoint_traffic": checkpoint_traffic(status),
    }
    traffic = report["checkpoint_traffic"]
    sent = (f"\ncheckpoints: {traffic['median_bytes_sent'] / 1e3:.0f} kB sent per version (median of "
            f"{traffic['versions']}), the full checkpoint {traffic['full_bytes'] / 1e3:.0f} kB" if traffic else "")
    console.print(Panel(
        f"held-out accuracy [bold]{report['initial_accuracy']:.3f} -> {final_acc:.3f}[/], mean reward "
        f"{report['initial_reward']:.3f} -> {final_reward:.3f} in {report['steps']} steps, "
        f"{report['wall_seconds']:.0f} s ({stop_reason}); groups accepted {report['groups_accepted']}, "
        f"rejected {report['groups_rejected']}; engine {report['engine']}{sent}\nplot: {report['plot']}",
        title="result"))
    (run_dir / "report.json").write_text(json.dumps(report, indent=1))
    if cfg.report is not None:
        Path(cfg.report).write_text(json.dumps(report, indent=1))
    return report
