"""A simulated pool, as one TOML file (`swarmrl simulate SCENARIO.toml`): who joins, on what links, training what,
with which knobs, checked by whom, attacked by whom. Every field is validated here; a mistake is refused with the
field's name and what it accepts (`load`).

Figures the scenario gives that this machine cannot measure (GPU speeds, home links) are the user's assumptions;
the ones measured here are named where they are the default (bench/RESULTS.md).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from swarmrl.protocol import quarantine
from swarmrl.protocol.pydantic_errors import describe_validation_error
from swarmrl.protocol.strict import Strict


class SpeedClass(Strict):
    """A kind of node hardware."""

    name: str = Field(description="What it is, e.g. 'rtx4090'.")
    tokens_per_s: float = Field(gt=0, description="Generation throughput of one node of this class on the scenario's "
                                "model, tokens per second, all its concurrent rollouts together.")
    share: float = Field(1.0, gt=0, description="Relative share of nodes of this class (normalised over classes).")


class Region(Strict):
    """Where nodes are, and the links they have."""

    name: str = Field(description="A label, e.g. 'home' or 'datacenter'.")
    share: float = Field(1.0, gt=0, description="Relative share of nodes in this region (normalised over regions).")
    down_mbit: float = Field(gt=0, description="Each node's download link, Mbit/s.")
    up_mbit: float = Field(gt=0, description="Each node's upload link, Mbit/s.")
    latency_ms: float = Field(50.0, ge=0, description="Round-trip time to the origin and to other nodes, ms.")


class Nodes(Strict):
    """The volunteers: how many, how fast, how long they stay, where they are."""

    count: int = Field(ge=1, le=1_000_000, description="Nodes in the pool (online or not).")
    speed_classes: list[SpeedClass] = Field(min_length=1, description="Hardware classes, drawn per node by share.")
    regions: list[Region] = Field(min_length=1, description="Link classes, drawn per node by share.")
    session_hours: float = Field(8.0, gt=0, description="Mean length of a node's stay online (exponential).")
    offline_hours: float = Field(4.0, ge=0, description="Mean time a node stays away between stays (exponential); 0: "
                                 "nodes never leave.")
    max_prompts: int = Field(8, ge=1, description="Prompts a node asks for per lease (the node's max_prompts).")
    poll_interval_s: float = Field(0.5, gt=0, description="A node refused work asks again after this long on "
                                   "average (the node's poll_interval_s).")


class Model(Strict):
    """What is trained, and how its versions travel."""

    params: float = Field(gt=0, description="Parameters, e.g. 7e9.")
    bytes_per_param: float = Field(2.0, gt=0, description="Bytes per parameter of a published checkpoint (2: bf16).")
    bytes_per_version: float | None = Field(None, gt=0, description="Bytes of one full checkpoint; default params x "
                                            "bytes_per_param.")
    broadcast: Literal["full", "delta"] = Field("full", description="full: every version is sent whole; delta: a "
                                                "node one version behind fetches only the difference.")
    delta_ratio: float = Field(1 / 30, gt=0, le=1, description="Bytes of a delta over bytes of a full checkpoint "
                               "(1/30 until bench/deltas.py measures it).")
    deltas_kept: int = Field(3, ge=1, description="A node at most this many versions behind fetches the deltas in "
                             "between; further behind (or new), the full checkpoint.")

    @property
    def full_bytes(self) -> float:
        return self.bytes_per_version or self.params * self.bytes_per_param


class Run(Strict):
    """The run's knobs (the signed run description and the coordinator's admission)."""

    group_size: int = Field(8, ge=2, le=64, description="Rollouts per prompt.")
    max_tokens: int = Field(512, ge=1, le=4096, description="Completion length cap.")
    mean_token_share: float = Field(0.6, gt=0, le=1, description="Mean completion length over max_tokens.")
    max_staleness: int = Field(2, ge=0, description="k: groups more than k versions behind are refused or dropped.")
    sample_rate: float = Field(quarantine.SAMPLE_RATE, ge=0, le=1, description="p: share of an identity's groups "
                               "fully checked after its warm-up.")
    warmup_checks: int = Field(quarantine.WARMUP_CHECKS, ge=0, description="K: full checks an identity passes "
                               "before any of its groups may be held.")
    release_passes: int = Field(quarantine.RELEASE_PASSES, ge=1, description="m: vouches a held group needs.")
    max_held: int = Field(quarantine.MAX_HELD, ge=0, description="h: held groups one identity may have.")
    lease_ttl_s: float = Field(60.0, gt=0, description="Seconds a node has to submit a lease (coordinator).")
    max_buffered_groups: int | None = Field(None, ge=1, description="Backpressure (coordinator); default "
                                            "batch_groups x (max_staleness + 1).")


class Trainer(Strict):
    """The one trainer."""

    batch_groups: int = Field(256, ge=1, description="Groups per optimizer step.")
    tokens_per_s: float = Field(50_000, gt=0, description="Training throughput, rollout tokens per second.")
    step_overhead_s: float = Field(1.0, ge=0, description="Seconds per step besides the tokens (optimizer, save).")
    upload_mbit: float = Field(10_000, gt=0, description="The trainer's link to the origin, Mbit/s (publishing).")


class Coordinator(Strict):
    """The coordinator's capacity (bench/coordinator_load.py measures it)."""

    cores: float = Field(1.6, gt=0, description="Cores the coordinator's processes get (1.6 of 2 measured here).")
    cpu_per_request_ms: float = Field(1.2, gt=0, description="Coordinator CPU per request, ms (1.18-1.25 measured "
                                      "on SQLite at 1,000-10,000 nodes).")
    heartbeat_s: float = Field(30.0, gt=0, description="Seconds between a node's heartbeats.")
    origin_up_mbit: float = Field(10_000, gt=0, description="The origin's (coordinator's seed) upload link, Mbit/s.")


class Verifiers(Strict):
    """The trusted side that checks groups."""

    count: int = Field(1, ge=1, description="Verifier processes.")
    tokens_per_s: float = Field(gt=0, description="Tokens of rollouts one verifier fully checks per second.")
    cheap_check_s: float = Field(0.002, ge=0, description="Seconds for the cheap checks of a held group.")
    batch: int = Field(64, ge=1, description="Pending groups claimed per poll.")
    identity_budget_s: float | None = Field(300.0, gt=0, description="Verifier seconds of full checks one identity "
                                            "may use per window (verifier/budget.py); None: no budget.")
    identity_budget_window_s: float = Field(600.0, gt=0, description="Refill period of identity_budget_s.")
    claim_ttl_s: float = Field(120.0, gt=0, description="A deferred group is claimable again after this long.")


class Adversaries(Strict):
    """Attackers with free identities (docs/quarantine.md's threat)."""

    share: float = Field(0.0, ge=0, lt=1, description="Share of the nodes (hence of the throughput) that attack.")
    strategy: str = Field("batch2", description="A strategy of swarmrl.testing.byzantine.quarantine_sim: batchC (C "
                          "cheats, then honest until released), mixedF (cheat with probability F), or optimal.")


class Sim(Strict):
    """How the simulation itself runs."""

    hours: float = Field(24.0, gt=0, le=24 * 30, description="Simulated time.")
    seed: int = Field(0, description="Seeds every draw; the same scenario and seed give the same figures.")
    broadcast_sample: int = Field(200, ge=2, description="Nodes in the swarm broadcast driven shard by shard by "
                                  "the real scheduler (transfer/schedule.py); each node's download rate is drawn "
                                  "from what its region got there.")
    broadcast_shards: int = Field(32, ge=1, le=4096, description="Shards a version is cut into in that broadcast.")
    broadcast_peers: int = Field(16, ge=1, description="Peers each node of it knows (what the DHT returns).")
    samples: int = Field(720, ge=10, description="Points of every time series.")


class Scenario(Strict):
    """One simulated pool."""

    name: str = Field("scenario", description="Shown in the report.")
    nodes: Nodes
    model: Model
    run: Run = Field(default_factory=Run)
    trainer: Trainer = Field(default_factory=Trainer)
    coordinator: Coordinator = Field(default_factory=Coordinator)
    verifiers: Verifiers
    adversaries: Adversaries = Field(default_factory=Adversaries)
    sim: Sim = Field(default_factory=Sim)

    @model_validator(mode="after")
    def _strategy_named(self) -> Scenario:
        from swarmrl.sim.attackers import check_strategy_name
        check_strategy_name(self.adversaries.strategy)
        if self.adversaries.strategy == "optimal" and not 0 < self.run.sample_rate < 1:
            raise ValueError("adversaries.strategy optimal needs 0 < run.sample_rate < 1 (use batchC or mixedF)")
        return self

    @property
    def max_buffered(self) -> int:
        return self.run.max_buffered_groups or self.trainer.batch_groups * (self.run.max_staleness + 1)


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message is one line naming the file and the fix."""


def load(path: Path) -> Scenario:
    """The scenario in `path`, or ScenarioError saying what to fix."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: not valid TOML ({e})") from None
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise ScenarioError(f"{path}: {describe_validation_error(e, limit=1, root='(top level)')}") from None
