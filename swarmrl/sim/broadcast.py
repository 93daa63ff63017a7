"""A checkpoint broadcast in virtual time, shard by shard, every pick made by the real scheduler
(`transfer.schedule.choose` on a `DownloadState`, with `FetchConfig`'s defaults as the policy).

Each node downloads every shard from the origin (a seed: the coordinator's seed peer, holding everything, one
shared upload link) or from the peers it knows that already stored it, as `choose` decides; a node that
stored a shard serves it at once (what it announces to the DHT, without the announcement's delay). The origin
answers `choose`'s consultations as the coordinator's seed peer does, by the real `SeedLedger.suggest` (every
shard once before any twice; its ramp-up is left out; `P2PConfig`'s defaults; it draws from the `random`
module, which `run` seeds). Links: a
transfer of b bytes from s to d takes the round trip plus b / min(s's upload / its uploads, d's download / its
downloads), the shares counted when it starts (so a link's later arrivals slow only themselves: an
approximation of TCP sharing that errs on the fast side while uploads pile up). A node asks `choose` again when
one of its requests ends or when a peer it knows stores a shard. Nothing opens a socket or sleeps.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from swarmrl.protocol.manifest import ShardRef
from swarmrl.sim.clock import Clock
from swarmrl.transfer.fetcher import FetchConfig
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.p2p.seeding import SeedLedger
from swarmrl.transfer.p2p.wire import LATER
from swarmrl.transfer.schedule import Consult, DownloadState, Fail, Pick, SourceView, choose
from swarmrl.transfer.sources import WAIT

ORIGIN = "origin"


@dataclass(frozen=True)
class Link:
    down_bps: float
    """Bytes per second."""
    up_bps: float
    rtt_s: float


@dataclass(eq=False)
class _Node:
    i: int
    link: Link
    state: DownloadState
    peers: list[int]
    stored: set[str] = field(default_factory=set)
    uploads: int = 0
    downloads: int = 0
    done_at: float | None = None
    watchers: list[int] = field(default_factory=list)


@dataclass
class Broadcast:
    """What one broadcast gave: when each node had every shard (seconds from the start), and the bytes sent."""

    done_s: list[float]
    origin_bytes: float
    peer_bytes: float
    picks: int

    @property
    def last_s(self) -> float:
        return max(self.done_s)


def shards_of(size: float, count: int) -> list[ShardRef]:
    each = max(1, int(round(size / count)))
    return [ShardRef(sha256=hashlib.sha256(f"shard{i}".encode()).hexdigest(), size=each) for i in range(count)]


def run(links: list[Link], origin_up_bps: float, size: float, shards: int, peers_known: int, swarm: bool = True,
        seed: int = 0, policy: FetchConfig | None = None) -> Broadcast:
    """Broadcast one checkpoint of `size` bytes in `shards` shards to nodes with `links`, all starting at 0;
    `swarm` False: from the origin only (every node's only source)."""
    policy = policy or FetchConfig()
    rng = random.Random(seed)
    random.seed(seed)  # SeedLedger.suggest's draws
    p2p = P2PConfig()
    ledger = SeedLedger(p2p.seed_grace_s, p2p.seed_max_uploads)
    handouts: dict[tuple[int, str], object] = {}
    clock = Clock()
    refs = shards_of(size, shards)
    index = {r.sha256: i for i, r in enumerate(refs)}
    everything = frozenset(range(len(refs)))
    n = len(links)
    nodes = []
    for i, link in enumerate(links):
        others = [j for j in range(n) if j != i]
        known = rng.sample(others, min(peers_known, len(others))) if swarm else []
        nodes.append(_Node(i, link, DownloadState.begin(refs, 0.0, rotation=rng.randrange(len(refs)), salt=i), known))
    for nd in nodes:
        for j in nd.peers:
            nodes[j].watchers.append(nd.i)
    origin = {"uploads": 0, "bytes": 0.0}
    sent = {"peer": 0.0, "picks": 0}

    def views(nd: _Node) -> list[SourceView]:
        remaining = nd.state.remaining
        out = [SourceView(ORIGIN, ORIGIN, True, remaining)]
        for j in nd.peers:
            held = nodes[j].stored & remaining
            if held:
                out.append(SourceView(str(j), str(j), False, held))
        return out

    def pump(nd: _Node) -> None:
        if nd.done_at is not None:
            return
        hints: dict[str, object] = {}
        while True:
            now = clock.now
            decision = choose(nd.state, views(nd), now, policy, hints)
            if isinstance(decision, Consult):
                wanted = {index[r.sha256] for r in decision.queue}
                said = ledger.suggest(refs, everything, wanted, origin["uploads"], now)
                hints[decision.seed.key] = WAIT if said == LATER else None if said is None else refs[said]
                continue
            if isinstance(decision, Fail):
                raise RuntimeError(f"broadcast failed at node {nd.i}: {decision.reason}")
            if not isinstance(decision, Pick):
                if not nd.state.in_flight:  # told to wait with nothing under way: look again (the fetcher's poll_s)
                    clock.after(policy.poll_s, pump, nd)
                return
            nd.state.start(decision, now)
            start(nd, decision, now)

    def start(nd: _Node, pick: Pick, now: float) -> None:
        sent["picks"] += 1
        nd.downloads += 1
        if pick.source.seed:
            origin["uploads"] += 1
            handouts[(nd.i, pick.shard.sha256)] = ledger.upload_begins(pick.shard.sha256, now)
            up = origin_up_bps / origin["uploads"]
        else:
            src = nodes[int(pick.source.key)]
            src.uploads += 1
            up = src.link.up_bps / src.uploads
        rate = min(up, nd.link.down_bps / nd.downloads)
        clock.after(nd.link.rtt_s + pick.shard.size / rate, end, nd, pick, now)

    def end(nd: _Node, pick: Pick, began: float) -> None:
        now = clock.now
        nd.downloads -= 1
        if pick.source.seed:
            origin["uploads"] -= 1
            origin["bytes"] += pick.shard.size
            ledger.upload_ends(handouts.pop((nd.i, pick.shard.sha256)), now)
        else:
            src = nodes[int(pick.source.key)]
            src.uploads -= 1
            sent["peer"] += pick.shard.size
            pump(src)  # its upload slot is free: nothing to do for its own download, but cheap
        sha = pick.shard.sha256
        fresh = nd.state.delivered(sha)
        nd.state.end(pick, began, now, ok=True)
        if fresh:
            nd.stored.add(sha)
            if not nd.state.remaining:
                nd.done_at = now
            for w in nd.watchers:
                other = nodes[w]
                # Only a node with a peer slot free and a shard not yet under way can start anything on this news.
                if other.state.pending and other.state.peer_in_flight < policy.max_parallel_peers:
                    pump(other)
        pump(nd)

    for nd in nodes:
        clock.at(0.0, pump, nd)
    clock.run(until=1e9)
    missing = [nd.i for nd in nodes if nd.done_at is None]
    if missing:
        raise RuntimeError(f"broadcast stopped with {len(missing)} nodes unfinished")
    return Broadcast([nd.done_at for nd in nodes], origin["bytes"], sent["peer"], sent["picks"])
