"""The node runner's config: which coordinator to join, where to keep keys and checkpoints, how to generate."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.node.engine import EngineConfig
from swarmrl.transfer.fetcher import FetchConfig
from swarmrl.transfer.p2p.config import P2PConfig


class NodeConfig(BaseModel):
    """Everything `swarmrl node` needs. Load from TOML with `runtime.config.load_config`."""

    model_config = ConfigDict(extra="forbid")

    coordinator_url: str = Field("http://127.0.0.1:8470", description="Base URL of the pool's coordinator.")
    coordinator_key: str | None = Field(
        None,
        description="Pinned coordinator public key (hex). When unset, the key /v1/info reports is trusted on "
        "first use and written next to the node key, so later runs refuse a different one.",
    )
    key_path: Path = Field(Path("node.key"), description="This node's Ed25519 identity (made if missing, 0600).")
    name: str = Field("", description="Human-readable name shown on the coordinator's dashboard.")
    work_dir: Path = Field(Path("node-data"), description="Checkpoints and shards are kept here.")
    keep_versions: int = Field(2, ge=1, description="Checkpoint versions kept on disk.")
    join_timeout_s: float = Field(300.0, ge=0, description="Keep trying to reach the coordinator this long at start.")
    max_prompts: int = Field(8, ge=1, description="Prompts asked for per lease.")
    poll_interval_s: float = Field(0.5, gt=0, description="Wait between polls when there is no work or no new weights.")
    heartbeat_interval_s: float = Field(5.0, gt=0, description="Send a heartbeat (held version, idle and busy "
                                        "seconds) at most this often, between leases.")
    max_leases: int | None = Field(None, description="Stop after this many leases (for tests); None runs forever.")
    progress: bool = Field(True, description="Show a live status line (rich).")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Inference engine settings.")
    p2p: P2PConfig = Field(
        default_factory=P2PConfig,
        description="Checkpoint sharing with other nodes over libp2p (hivemind DHT). Used when enabled and the pool "
        "(or p2p.initial_peers) names DHT bootstrap peers; the coordinator's HTTP origin stays the fallback.")
    fetch: FetchConfig = Field(
        default_factory=FetchConfig,
        description="How a checkpoint's shards are scheduled over peers and the origin (parallel downloads, end game).")
