"""Configuration of a swarm peer (one `[p2p]` table in a node's, verifier's or coordinator's TOML).

Only what the swarm itself uses: how it joins the DHT, what it announces, how it serves, how it treats other
peers. How a download is scheduled over peers and seeds is the fetcher's (`transfer.fetcher.FetchConfig`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class P2PConfig(BaseModel):
    """How a node (or the coordinator's seed) joins the DHT and exchanges checkpoint shards with peers."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Share shards with peers; if false, every shard comes from the origin.")
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        description="libp2p multiaddrs to listen on, e.g. /ip4/0.0.0.0/tcp/31337 (port 0: any free port).",
    )
    announce_maddrs: list[str] = Field(
        default_factory=list,
        description="Multiaddrs other peers should dial (behind NAT or a port forward); explicit ports only.",
    )
    initial_peers: list[str] = Field(
        default_factory=list,
        description="DHT bootstrap multiaddrs ending in /p2p/<peer id>; empty: take RunInfo.dht_peers from the "
        "coordinator.",
    )
    identity_path: str | None = Field(
        None,
        description="File holding this peer's libp2p RSA key (created if missing). It also signs the peer's DHT "
        "records. None: a fresh key per process.",
    )
    upload_cap_mbps: float | None = Field(
        None, gt=0, description="Upload rate cap for serving shards to peers, megabits per second; None: no cap."
    )
    max_uploads: int = Field(
        8, ge=1, description="Shard uploads served at once; see upload_queue for the requests beyond. 8 serves every "
        "other node of an 8-node swarm at once (N=8, 100 Mbit/s: 20.0-20.5 s against 20.5-20.7 s with 5; N=16, "
        "25 Mbit/s: the same with either): an asker left waiting for a slot idles while its data could flow."
    )
    upload_queue: int = Field(
        2, ge=0, description="Requests that may wait for an upload slot (so the link never idles between uploads); "
        "one more is answered 'busy'."
    )
    busy_retry_s: float = Field(0.25, gt=0, description="A peer that answered 'busy' is asked again after this long.")
    peer_timeout_s: float = Field(
        20.0, gt=0, description="A peer that has not delivered a whole shard within this many seconds is skipped."
    )
    max_peer_failures: int = Field(
        3, ge=1, description="Consecutive failures (errors, timeouts) after which a peer is dropped for a while."
    )
    drop_s: float = Field(60.0, ge=0, description="How long a dropped (failing or slow) peer is left alone.")
    record_ttl_s: float = Field(
        60.0, ge=5, description="DHT holder records expire after this many seconds; refreshed every third of it."
    )
    announce_delay_s: float = Field(
        0.1, ge=0, description="Newly stored shards are announced within this many seconds (batched)."
    )
    announce_interval_s: float = Field(
        2.0, ge=0, description="After a version's first DHT record, newly stored shards are re-announced at "
        "most this often. Each announcement is a signed store that every replica verifies, so this bounds a "
        "peer's DHT load; watchers hear of every shard at once anyway (watch_peers). 0: on every change."
    )
    watch_peers: int = Field(
        32, ge=0, description="Peers per checkpoint version whose new shards this peer hears of at once over a "
        "watch stream (HAVE messages), besides their DHT records, which lag seconds behind under load. 0: the "
        "DHT only."
    )
    poll_interval_s: float = Field(
        0.25, gt=0, description="While downloading, who-holds-what is re-read from the DHT this often; up to 8 "
        "times less often while reads find no new peer and every known holder is followed over a watch stream."
    )
    startup_timeout_s: float = Field(30.0, gt=0, description="Seconds allowed for the libp2p daemon and DHT to start.")
    dht_wait_timeout_s: float = Field(3.0, gt=0, description="A DHT request without a reply in this time is lost.")
    seed_max_uploads: int = Field(
        5, ge=1, description="Uploads a seed (the coordinator) serves at once; further requests queue. Each copy must "
        "share its receiver's link with fetch.max_parallel_peers peer streams, so about that many plus one keep the "
        "seed's link full, and fewer at once means each copy lands (and spreads) sooner."
    )
    seed_grace_s: float = Field(
        5.0, ge=0, description="A seed sends every shard once before any twice; after that it sends a shard again "
        "only this long after its last upload of it ended (time for the receiver to announce it)."
    )
    seed: bool = Field(False, description="This peer holds every shard it announces (the coordinator's seed).")

    @field_validator("announce_maddrs")
    @classmethod
    def _explicit_ports(cls, v: list[str]) -> list[str]:
        for a in v:
            if a.endswith("/tcp/0") or "/tcp/0/" in a:
                raise ValueError(f"announce multiaddr {a!r} needs an explicit port")
        return v
