"""The node runner's config: which pool to join, where to keep keys and checkpoints, how to generate."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.node.engine import EngineConfig
from swarmrl.pools.config import PoolsConfig
from swarmrl.transfer.fetcher import FetchConfig
from swarmrl.transfer.p2p.config import P2PConfig


class NodeConfig(BaseModel):
    """Everything `swarmrl node` needs. Load from TOML with `runtime.config.load_config`."""

    model_config = ConfigDict(extra="forbid")

    pool: str | None = Field(
        None, description="Join the public pool of this name, found in the pools' DHT (`swarmrl pool list`); "
        "NAME@KEYPREFIX picks one when several keys claim NAME. Its key is pinned in <work_dir>/pools.json on first "
        "join. None: join coordinator_url directly.")
    coordinator_url: str = Field("http://127.0.0.1:8470", description="Base URL of the pool's coordinator "
                                 "(set from the pool's record when `pool` is given).")
    coordinator_key: str | None = Field(
        None,
        description="Pinned coordinator public key (hex). When unset, the key /v1/info reports is trusted on "
        "first use and written next to the node key, so later runs refuse a different one.",
    )
    key_path: Path = Field(Path("node.key"), description="This node's Ed25519 identity (made if missing, 0600).")
    name: str = Field("", description="Human-readable name shown on the coordinator's dashboard.")
    work_dir: Path = Field(Path("node-data"), description="Checkpoints, shards, receipts.jsonl and pools.json are "
                           "kept here.")
    keep_versions: int = Field(2, ge=1, description="Checkpoint versions kept on disk.")
    join_timeout_s: float | None = Field(
        None, ge=0, description="Give up when the coordinator cannot be reached for this long at the first join; "
        "None: wait as long as it takes. Once joined, a node waits out outages of any length.")
    max_backoff_s: float = Field(30.0, gt=0, description="Longest wait between two tries while the coordinator is "
                                 "unreachable (exponential backoff with full jitter up to this).")
    request_timeout_s: float = Field(30.0, gt=0, description="An HTTP request without an answer in this time is "
                                     "tried again.")
    max_prompts: int = Field(8, ge=1, description="Most prompts asked for per lease. The node asks for what its "
                             "engine generates in a third of a lease's time to live, as measured on its last leases "
                             "(node.leasesize), up to this: raise it on a fast GPU.")
    poll_interval_s: float = Field(0.5, gt=0, description="Wait between polls when there is no work or no new weights.")
    heartbeat_interval_s: float = Field(5.0, gt=0, description="Send a heartbeat (held version, idle and busy "
                                        "seconds) at most this often, between leases.")
    receipts_interval_s: float = Field(30.0, gt=0, description="Collect the coordinator's signed receipts for "
                                       "accepted groups at most this often (they are kept in receipts.jsonl).")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Serve Prometheus metrics (swarmrl_node_*) on "
                                     "this port at /metrics; 0 or None: off.")
    metrics_host: str = Field("127.0.0.1", description="Interface the metrics port listens on (0.0.0.0: all).")
    max_leases: int | None = Field(None, description="Stop after this many leases (for tests); None runs forever.")
    pipeline: bool = Field(
        True, description="Keep the engine busy: submit on a background thread while the next lease is generated, "
        "and ask for a lease ahead, so that one is in hand when generation ends (node.work). Where the pool's "
        "admission allows this node one lease at a time, it works one at a time. False: lease, generate, submit "
        "in turn.")
    progress: bool = Field(True, description="Show a live panel (rich); false: plain log lines.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Inference engine settings.")
    p2p: P2PConfig = Field(
        default_factory=P2PConfig,
        description="Checkpoint sharing with other nodes over libp2p (hivemind DHT). Used when enabled and the pool "
        "(or p2p.initial_peers) names DHT bootstrap peers; the coordinator's HTTP origin stays the fallback.")
    pools: PoolsConfig = Field(default_factory=PoolsConfig, description="Where the public pools' DHT is (bootstrap "
                               "peers, or the SWARMRL_BOOTSTRAP environment variable), for `pool` and `pool list`.")
    fetch: FetchConfig = Field(
        default_factory=FetchConfig,
        description="How a checkpoint's shards are scheduled over peers and the origin (parallel downloads, end game).")
