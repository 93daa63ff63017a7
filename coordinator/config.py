"""The coordinator's configuration: one pydantic model, loadable from TOML with `runtime.config.load_config`.

    cfg = load_config(CoordinatorConfig, "coordinator.toml", ["port=9000", "run.sampling.group_size=4"])
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from swarmrl.coordinator.admission import AdmissionConfig
from swarmrl.coordinator.connections import ConnectionConfig
from swarmrl.coordinator.db.sqlite.config import SqliteConfig
from swarmrl.coordinator.ratelimit import RateLimitConfig
from swarmrl.coordinator.watchdog import WatchdogConfig
from swarmrl.pools.config import PoolConfig
from swarmrl.protocol import quarantine
from swarmrl.protocol.episodes import load_environment
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.run import RunSpec
from swarmrl.protocol.tasks import task_options
from swarmrl.transfer.p2p.config import P2PConfig

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MIB = 1024 * 1024
# Top-level keys of earlier versions that now live in [sqlite], with their names there.
_MOVED_TO_SQLITE = {"store_group_commit": "group_commit", "realtime_committer": "realtime_committer",
                    "request_nice": "request_nice", "store_writer_process": "writer_process",
                    "store_writer_commit_interval_ms": "writer_commit_interval_ms"}


class CoordinatorConfig(BaseModel):
    """Everything a coordinator needs to run one training run (a pool)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Interface to listen on; 0.0.0.0 to accept nodes from elsewhere.")
    port: int = Field(8470, ge=0, le=65535, description="TCP port to listen on (0: any free port).")
    data_dir: Path = Field(
        Path("runs/coordinator"),
        description="Where the shards, the coordinator key and (by default) the SQLite database live.",
    )
    store_url: str | None = Field(
        None, description="The database (SQLAlchemy URL): sqlite:///path/file.sqlite, or "
        "postgresql+psycopg://user:password@host:5432/db where several coordinator processes serve one pool (they "
        "then share data_dir: key and shards). None: sqlite:///<data_dir>/coordinator.sqlite.")
    store_pool_size: int = Field(
        40, ge=1, le=1000, description="Database connections this process opens at most: the request threads "
        "(worker_threads + operator_threads) each need one, and the HTTP reads (status, pages, the dashboard) and "
        "housekeeping more. On PostgreSQL, max_connections must cover every coordinator process's pool.")
    worker_threads: int = Field(
        8, ge=1, le=256, description="Threads that do the signed requests' work (the body's digest, the payload, the "
        "transaction) for nodes; the operator's requests have operator_threads of their own. Few: a process runs "
        "Python on one core at a time, and more threads only contend for it (measured: bench/RESULTS.md).")
    workers: int = Field(
        1, ge=1, le=64, description="Server processes, one core each, sharing the port (SO_REUSEPORT: the kernel "
        "spreads connections over them) and the store. On SQLite one more process, the store's writer, commits the "
        "submissions and heartbeats of all of them together (sqlite.writer_process), and their other writes take "
        "turns; on PostgreSQL they are as separate coordinators. Rate limits, HTTP request "
        "metrics and long-poll slots are per process. With [p2p], the first process runs the DHT seed.")
    sqlite: SqliteConfig = Field(default_factory=SqliteConfig, description="SQLite only: group commit, the "
                                 "committer's priority and the writer process (coordinator.db.sqlite).")
    run: RunSpec = Field(default_factory=RunSpec, description="The run description (task, sampling, staleness "
                         "bound, proofs): the one source of these facts; every role reads it from /v1/info.")
    lease_ttl_s: float = Field(60.0, gt=0, description="Seconds a node has to submit a lease's groups (then its "
                               "prompts are leased to others, and count as abandoned by it).")
    max_outstanding_leases: int = Field(
        4, ge=1, description="Unexpired, unfinished leases one node may hold at once; more are refused (429)."
    )
    max_body_bytes: int = Field(8 * MIB, ge=1024, description="Largest JSON request body accepted (413 above).")
    max_shard_bytes: int = Field(64 * MIB, ge=1024, description="Largest checkpoint shard upload accepted (413).")
    clock_skew_s: float = Field(
        120.0, gt=0, description="Signed requests whose timestamp is further than this from our clock are refused."
    )
    key_path: Path | None = Field(
        None,
        description="Coordinator Ed25519 key file (created if missing); default: <data_dir>/coordinator.key.",
    )
    operator_keys: list[str] = Field(
        default_factory=list,
        description="Public keys (hex) allowed to call the /v1/verifier/* and /v1/trainer/* endpoints.",
    )
    keep_versions: int = Field(
        3, ge=1, description="Shards of this many newest manifests are kept; older shards are deleted."
    )
    max_buffered_groups: int | None = Field(
        None, ge=1, description="Lease no more prompts while this many usable groups are already in flight "
        "(leased, pending verification, or accepted but not yet taken by the trainer; unproven identities' leases "
        "count only up to admission.unproven_share of it); None: no limit. About batch_groups * (max_staleness + 1) "
        "keeps the trainer fed where new weights take a while to reach the nodes (the simulator's default); where "
        "they arrive at once and the verifiers are the narrow part (the local demo), batch_groups * max_staleness "
        "queues fewer groups that go stale (bench/RESULTS.md, 'Which backpressure bound').")
    p2p: P2PConfig | None = Field(
        None, description="Run a DHT bootstrap peer that also seeds every published checkpoint over libp2p, so that "
        "nodes share shards with each other; None: nodes fetch from the HTTP origin only.")
    dht_peers: list[str] = Field(default_factory=list, description="DHT bootstrap multiaddrs, returned in RunInfo.")
    pool: PoolConfig | None = Field(
        None, description="Announce this run as a public pool in the pools' DHT (`swarmrl pool list` shows it, "
        "`swarmrl node --pool NAME` joins it); None: nodes join by URL only.")
    prompt_seed: int | None = Field(
        None, description="None: prompts are drawn from a secret made on the first start (<data_dir>/run.secret, "
        "0600, never served), so nobody can tell which prompts the next lease holds. An integer fixes the stream "
        "(with the lease counter, one row every lease request then updates) for a reproducible experiment: then "
        "anyone who knows it can predict the prompts.")
    challenge_ttl_s: float = Field(60.0, gt=0, description="Seconds a registration challenge stays valid.")
    max_long_polls: int = Field(
        8, ge=0, description="Operator requests (verifiers, the trainer) that may wait for work at once; each holds "
        "one of the operator's threads (operator_threads: this and two more), so more answer at once instead.")
    claim_ttl_s: float = Field(
        120.0, gt=0, description="Seconds a verifier's claim on pending groups lasts before others may take them."
    )
    draw_seed: int | None = Field(None, description="Seed of the groups' quarantine draws (tests only); None: the "
                                  "operating system's randomness, which no node can predict.")
    housekeeping_interval_s: float = Field(
        5.0, gt=0, description="Seconds between sweeps that mark silent nodes gone and forget expired nonces, "
        "stored answers and challenges.")
    idempotency_ttl_s: float = Field(
        3600.0, gt=0, description="Seconds the answer to a request with an Idempotency-Key is kept, so that a "
        "retry gets it again instead of applying the request twice; longer than any client retries one request.")
    release_passes: int = Field(
        quarantine.RELEASE_PASSES, ge=1, description="m: a held (unchecked) group reaches the trainer once this "
        "many vouching full checks of later groups of its node have passed (protocol.quarantine; docs/quarantine.md)."
    )
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="How many prompts an identity "
                                       "may hold in flight, and the share of the buffer unproven identities may hold.")
    connections: ConnectionConfig = Field(
        default_factory=ConnectionConfig, description="Per process: how long a request's head and body may take to "
        "arrive, connections per source and in all, and the share of them kept for sources of proven nodes and "
        "operators (coordinator.connections).")
    rate_limits: RateLimitConfig = Field(default_factory=RateLimitConfig, description="Requests per source and per "
                                         "identity (429 with Retry-After above them).")
    node_gone_after_s: float = Field(
        60.0, gt=0, description="A node not heard from (no signed request) for this long is gone: shown so on the "
        "dashboard and in /metrics, no longer counted in checkpoint spread, and its open leases are freed (its "
        "slots and the backpressure buffer); its next request brings it back. Nodes heartbeat every few seconds.")
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig, description="When the pool counts as stalled "
                                     "(no new version) and the trainer or the verifiers as absent.")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """A key that moved to [sqlite] is refused with its new place, not as an unknown key."""
        if isinstance(data, dict):
            moved = [f"{old} moved: write it as [sqlite] {new}" for old, new in _MOVED_TO_SQLITE.items() if old in data]
            if moved:
                raise PydanticCustomError("moved_key", "; ".join(moved))
        return data

    @field_validator("operator_keys")
    @classmethod
    def _hex_keys(cls, keys: list[str]) -> list[str]:
        out = [k.strip().lower() for k in keys]
        for k in out:
            if not _HEX64.match(k):
                raise ValueError(f"operator key {k[:80]!r} is not a 64-character hex Ed25519 public key")
        return out

    @field_validator("run")
    @classmethod
    def _known_task(cls, run: RunSpec) -> RunSpec:
        task_options(run.task)  # raises ValueError naming the known tasks, or the options refused
        if run.environment is not None:  # refused now, in one line, unless it loads and replays (protocol.episodes)
            load_environment(run.environment)
        return run

    @model_validator(mode="after")
    def _enough_connections(self) -> CoordinatorConfig:
        threads = self.worker_threads + self.operator_threads
        if self.store_pool_size < threads:
            raise ValueError(f"store_pool_size ({self.store_pool_size}) must be at least worker_threads + "
                             f"operator_threads ({threads}): each request thread needs a database connection")
        return self

    @property
    def operator_threads(self) -> int:
        """Threads for the operator's signed requests: one per long poll that may wait, and two that never do."""
        return self.max_long_polls + 2

    @model_validator(mode="after")
    def _keep_enough(self) -> CoordinatorConfig:
        # A verifier re-runs a group with the weights it was generated with, which may be up to
        # max_staleness versions old: those shards must still be served.
        if self.keep_versions < self.run.max_staleness + 1:
            raise ValueError(
                f"keep_versions ({self.keep_versions}) must be at least run.max_staleness + 1 "
                f"({self.run.max_staleness + 1}): verifiers need the weights of every version a group may still be "
                "submitted with"
            )
        return self

    @field_validator("store_url")
    @classmethod
    def _known_store(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("sqlite:///", "postgresql+psycopg://")):
            raise ValueError(f"store_url {url.split('@')[-1]!r}: use sqlite:///path or postgresql+psycopg://...")
        return url

    @property
    def resolved_store_url(self) -> str:
        """The database actually used: `store_url`, or SQLite in `data_dir`."""
        return self.store_url or f"sqlite:///{self.data_dir / 'coordinator.sqlite'}"

    @property
    def resolved_key_path(self) -> Path:
        """The key file actually used: `key_path`, or `<data_dir>/coordinator.key`."""
        return self.key_path if self.key_path is not None else self.data_dir / "coordinator.key"

    def load_identity(self) -> Identity:
        """The coordinator's identity, created and saved (mode 0600) on first use."""
        return Identity.load_or_create(self.resolved_key_path)
