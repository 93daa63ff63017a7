"""Settings for reaching the pools' DHT (nodes: `[pools]`) and for announcing a pool (coordinators: `[pool]`).

Bootstrap peers are multiaddrs ending in /p2p/<peer id>: a coordinator that announces its pool prints its own
(`pool DHT: ...`), and an operator publishes them for volunteers, who put them in `pools.initial_peers` or in the
SWARMRL_BOOTSTRAP environment variable (comma-separated). The config wins when both are set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.protocol.pools import MAX_POOL_TTL_S, MAX_POOL_URLS, POOL_NAME_PATTERN

BOOTSTRAP_ENV = "SWARMRL_BOOTSTRAP"


def env_bootstrap() -> list[str]:
    """The multiaddrs in SWARMRL_BOOTSTRAP (comma-separated, blanks ignored)."""
    return [a.strip() for a in os.environ.get(BOOTSTRAP_ENV, "").split(",") if a.strip()]


class DhtAccess(BaseModel):
    """How this process joins the pools' DHT."""

    model_config = ConfigDict(extra="forbid")

    initial_peers: list[str] = Field(
        default_factory=list, description="Bootstrap multiaddrs of the pools' DHT (ending in /p2p/<peer id>); empty: "
        f"those in the {BOOTSTRAP_ENV} environment variable (comma-separated).")
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        description="libp2p multiaddrs to listen on (port 0: any free port).")
    announce_maddrs: list[str] = Field(
        default_factory=list, description="Multiaddrs other peers should dial (behind NAT or a port forward).")
    identity_path: Path | None = Field(
        None, description="File holding this peer's libp2p key (made if missing): a fixed key gives a stable "
        "/p2p/<peer id> to publish as a bootstrap address. None: a fresh key per process.")
    startup_timeout_s: float = Field(30.0, gt=0, description="Seconds allowed for the libp2p daemon and DHT to start.")
    wait_timeout_s: float = Field(5.0, gt=0, description="A DHT request without a reply in this time is lost.")

    def bootstrap(self) -> list[str]:
        """The bootstrap peers to use: `initial_peers`, else SWARMRL_BOOTSTRAP."""
        return list(self.initial_peers) or env_bootstrap()


class PoolsConfig(DhtAccess):
    """A node's view of the public pools (`swarmrl pool list`, `swarmrl node --pool NAME`)."""

    lookup_timeout_s: float = Field(30.0, gt=0, description="Seconds allowed to read the pools from the DHT.")


class PoolConfig(DhtAccess):
    """What a coordinator announces about its pool, and how it joins the pools' DHT to do so."""

    announce: bool = Field(True, description="Announce the pool in the DHT (refreshed every ttl_s / 3 while running).")
    name: str = Field("", pattern=r"^(|" + POOL_NAME_PATTERN[1:-1] + r")$",
                      description="The name nodes join by; empty: the run's run_id (lower-cased).")
    description: str = Field("", max_length=500, description="What the pool is for, shown by `swarmrl pool list`.")
    public_urls: list[str] = Field(
        default_factory=list, max_length=MAX_POOL_URLS, description="Base URLs nodes reach the coordinator at, "
        "preferred first; empty: the URL it listens on (only useful when that is reachable as is).")
    status: Literal["open", "paused", "closing"] = Field(
        "open", description="open: nodes may join; paused: not taking new nodes; closing: winding down.")
    ttl_s: float = Field(60.0, ge=10, le=MAX_POOL_TTL_S, description="Each record is valid this long; refreshed "
                         "every third of it, so a pool whose coordinator stopped drops out of lists within ttl_s.")
    active_window_s: float = Field(300.0, gt=0, description="A node counts towards the announced `nodes` when the "
                                   "coordinator heard from it within this many seconds.")
