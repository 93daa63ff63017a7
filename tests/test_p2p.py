"""Peer-to-peer checkpoint distribution: DHT discovery records, shard exchange, bans, resume, manifest checks.

Everything runs on 127.0.0.1 (libp2p daemons with NAT helpers and relays off). No timing asserts: waits
poll for a condition with a generous deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import CheckpointManifest, ManifestError, ShardRef, SignedManifest
from swarmrl.transfer.fetcher import CheckpointFetcher
from swarmrl.transfer.sources import WAIT, ShardSource
from swarmrl.transfer.store import ShardStore, cut_checkpoint

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
SHARD = 64 * 1024


def wait_for(cond: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def make_checkpoint(root: Path, version: int = 1, size: int = 600_000, seed: int = 0) -> tuple[Path, bytes]:
    ckpt = root / f"ckpt-v{version}-{seed}"
    ckpt.mkdir(parents=True)
    weights = os.urandom(size)
    (ckpt / "model.safetensors").write_bytes(weights)
    (ckpt / "config.json").write_text(f'{{"version": {version}}}')
    return ckpt, weights


@pytest.fixture()
def coordinator() -> Identity:
    return Identity.generate()


@pytest.fixture()
def published(tmp_path: Path, coordinator: Identity) -> tuple[SignedManifest, ShardStore, bytes]:
    """A signed 600 kB checkpoint (10 shards of 64 KiB) and the origin's store holding its shards."""
    ckpt, weights = make_checkpoint(tmp_path)
    store = ShardStore(tmp_path / "origin")
    manifest = cut_checkpoint(ckpt, run_id="test", version=1, store=store, shard_size=SHARD)
    return SignedManifest.sign(manifest, coordinator), store, weights


class StoreSource(ShardSource):
    """A plain source reading a ShardStore (the HTTP origin without HTTP), counting and optionally pausing."""

    def __init__(self, store: ShardStore, name: str = "origin", delay: float = 0.0):
        self.store = store
        self.name = name
        self.delay = delay
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        with self.lock:
            self.calls.append(shard.sha256)
        if self.delay:
            time.sleep(self.delay)
        return self.store.get(shard.sha256)


class LyingStore:
    """Claims every shard of a manifest and serves random bytes of the right size."""

    def __init__(self, manifest: CheckpointManifest):
        self.sizes = {s.sha256: s.size for s in manifest.shards()}
        self.served = 0

    def has(self, sha: str) -> bool:
        return sha in self.sizes

    def get(self, sha: str) -> bytes:
        self.served += 1
        return os.urandom(self.sizes[sha])


class SlowStore(ShardStore):
    """A real store whose reads take `delay` seconds (a slow peer)."""

    def __init__(self, root: Path, delay: float):
        super().__init__(root)
        self.delay = delay

    def get(self, sha256: str) -> bytes:
        time.sleep(self.delay)
        return super().get(sha256)


# -- swarm peers on loopback ----------------------------------------------------------------------------


@pytest.fixture()
def swarm() -> Iterator[Callable[..., object]]:
    """Start SwarmPeers on 127.0.0.1; all are closed at the end of the test."""
    from swarmrl.transfer.p2p.config import P2PConfig
    from swarmrl.transfer.p2p.swarm import SwarmPeer

    peers: list[SwarmPeer] = []

    def start(initial_peers: list[str] | None = None, **overrides: object) -> SwarmPeer:
        settings: dict[str, object] = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "poll_interval_s": 0.1,
                                       "announce_delay_s": 0.02, "peer_timeout_s": 10.0}
        cfg = P2PConfig(**{**settings, **overrides})
        peer = SwarmPeer(cfg, "test", initial_peers=initial_peers or []).start()
        peers.append(peer)
        return peer

    yield start
    for p in peers:
        p.close()


def test_dht_of_three_peers_discovers_holders_and_refuses_foreign_records(tmp_path, published, swarm):
    from hivemind.utils.timed_storage import get_dht_time

    from swarmrl.transfer.p2p.dht import HolderRecord, holders_key, make_bitfield, manifest_tag

    signed, origin, _ = published
    manifest = signed.manifest
    shards = manifest.shards()
    a = swarm()
    b = swarm(a.maddrs)
    c = swarm(a.maddrs)
    # Each peer holds different shards: a the first 3, b the next 3, c none.
    stores = {}
    for name, peer, held in (("a", a, shards[:3]), ("b", b, shards[3:6]), ("c", c, [])):
        stores[name] = ShardStore(tmp_path / f"store-{name}")
        for s in held:
            stores[name].put(s.sha256, origin.get(s.sha256))
        peer.serve(manifest, stores[name])

    def seen_by_c() -> dict:
        h = c.holders(manifest, wait=True)
        return h if {a.peer_id, b.peer_id} <= set(h) else {}

    holders = wait_for(seen_by_c, what="c to see a and b in the DHT")
    assert holders[a.peer_id].indices() == {0, 1, 2}
    assert holders[b.peer_id].indices() == {3, 4, 5}
    # c holds nothing yet: its record says so (others find it, and can watch it, before its first shard).
    assert wait_for(lambda: a.holders(manifest, wait=True).get(c.peer_id), what="c's record").indices() == set()
    assert a.peer_id in wait_for(lambda: b.holders(manifest, wait=True), what="b to see a")

    # c tries to overwrite b's record (b's owner subkey, signed with c's key): refused by the DHT.
    key = holders_key("test", manifest.version)
    n = len(shards)
    forged = HolderRecord(peer_id=c.peer_id, tag=manifest_tag(manifest), n_shards=n, bits=make_bitfield(n, range(n)))
    assert not c._call(c._dht.store(key, forged.to_value(), get_dht_time() + 30, subkey=b._rsa.local_public_key))
    # c announces under its own key that *b's* peer id holds everything: refused as well.
    spoof = HolderRecord(peer_id=b.peer_id, tag=manifest_tag(manifest), n_shards=n, bits=make_bitfield(n, range(n)))
    assert not c._call(c._dht.store(key, spoof.to_value(), get_dht_time() + 30, subkey=c._rsa.local_public_key))
    time.sleep(0.3)
    again = a.holders(manifest, wait=True)
    assert again[b.peer_id].indices() == {3, 4, 5}
    assert again[c.peer_id].indices() == set()

    # A new shard is announced soon after it is stored.
    stores["c"].put(shards[9].sha256, origin.get(shards[9].sha256))
    c.mark_held(manifest, shards[9])
    wait_for(lambda: a.holders(manifest, wait=True)[c.peer_id].indices() == {9}, what="c's announcement")


def test_swarm_fetch_takes_shards_from_peers_and_seed_each_verified(tmp_path, published, coordinator, swarm):
    from swarmrl.transfer.p2p.config import P2PConfig
    from swarmrl.transfer.seed import DhtSeed

    signed, origin_store, weights = published
    seed = DhtSeed(P2PConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), "test", origin_store).start()
    try:
        seed.publish(signed.manifest)
        assert seed.bootstrap_peers and all("/p2p/" in a for a in seed.bootstrap_peers)
        nodes = [swarm(seed.bootstrap_peers) for _ in range(3)]
        http = StoreSource(origin_store)  # stands in for the HTTP origin: the fallback
        results: dict[int, tuple[CheckpointFetcher, Path]] = {}

        def run(i: int) -> None:
            f = CheckpointFetcher(tmp_path / f"node{i}", coordinator.public_key_hex, [nodes[i].source(), http],
                                  **nodes[i].fetcher_options())
            results[i] = (f, f.fetch(signed)[1])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 3
        n = len(signed.manifest.shards())
        for f, out in results.values():
            assert (out / "model.safetensors").read_bytes() == weights
            assert f.stats.shards_fetched == n and f.stats.bad_shards == 0
        by_kind: dict[str, int] = {}
        for f, _ in results.values():
            for k, v in f.stats.by_source.items():
                by_kind[k.split(":")[0]] = by_kind.get(k.split(":")[0], 0) + v
        assert by_kind.get("peer", 0) > 0  # nodes shared shards with each other
        assert by_kind.get("seed", 0) >= n  # the bootstrap peer's seed flag was believed
        assert by_kind.get("origin", 0) == 0  # the seed peer was there: no fallback needed
        assert seed.peer.stats.uploads >= n  # every shard left the seed at least once
    finally:
        seed.close()


def test_corrupted_shard_is_detected_refetched_elsewhere_and_its_peer_banned(tmp_path, published, coordinator,
                                                                                swarm):
    signed, origin_store, weights = published
    manifest = signed.manifest
    honest = swarm()
    liar = swarm(honest.maddrs)
    lies = LyingStore(manifest)
    liar.serve(manifest, lies)  # type: ignore[arg-type]  # announces every shard
    node = swarm(honest.maddrs)
    wait_for(lambda: liar.peer_id in node.holders(manifest, wait=True), what="the liar's announcement")

    origin = StoreSource(origin_store)
    bad_reports: list[tuple[str, str]] = []
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [node.source(), origin],
                          **node.fetcher_options(),
                          on_bad_shard=lambda src, shard: bad_reports.append((src.name, shard.sha256)))
    _, out = f.fetch(signed)
    # With the end game, fetch may return on the origin's copy while the liar's answer is still on its way.
    wait_for(lambda: f.stats.bad_shards, what="the liar's bytes checked")

    assert (out / "model.safetensors").read_bytes() == weights  # nothing corrupt was assembled
    assert f.stats.bad_shards == 1 and len(bad_reports) == 1  # caught once, then never asked again
    assert bad_reports[0][0].endswith(liar.peer_id[-8:])
    assert liar.peer_id in node.banned
    assert lies.served == 1
    bad_sha = bad_reports[0][1]
    assert bad_sha in origin.calls  # the corrupted shard was taken from the origin instead
    assert f.store.get(bad_sha) == origin_store.get(bad_sha)
    assert liar.peer_id not in node.holders(manifest)
    # The banned peer is refused service by the node from now on.
    from swarmrl.transfer.p2p.sources import PeerError

    with pytest.raises(PeerError, match="refused"):
        liar.fetch(node.peer_id, manifest.shards()[0])


@pytest.mark.parametrize("watch_peers", [0, 32])
def test_a_watch_stream_reports_new_shards_before_the_dht_does(tmp_path, published, swarm, watch_peers):
    from swarmrl.transfer.p2p.dht import manifest_info

    signed, origin_store, _ = published
    manifest = signed.manifest
    shards = manifest.shards()
    store = ShardStore(tmp_path / "holder")
    store.put(shards[0].sha256, origin_store.get(shards[0].sha256))
    holder = swarm()
    holder.serve(manifest, store)
    # The node reads the DHT once and then not for ten minutes: only a watch can tell it more.
    node = swarm(holder.maddrs, poll_interval_s=600, watch_peers=watch_peers)
    wait_for(lambda: holder.peer_id in node.holders(manifest, wait=True), what="the holder's DHT record")
    last = manifest_info(manifest).index[shards[-1].sha256][0]
    assert last not in node.holders(manifest)[holder.peer_id].indices()
    if watch_peers:  # the node's watch is open at the holder (so the shard below comes as a HAVE message)
        wait_for(lambda: any(s.watchers for s in holder.server.served.values()), what="the node's watch")
    store.put(shards[-1].sha256, origin_store.get(shards[-1].sha256))
    holder.mark_held(manifest, shards[-1])
    if watch_peers:
        wait_for(lambda: last in node.holders(manifest)[holder.peer_id].indices(), what="the watch's report")
        assert node.stats.haves >= 1
    else:
        time.sleep(2.0)
        assert last not in node.holders(manifest)[holder.peer_id].indices()
        assert node.stats.haves == 0


def test_a_peer_with_nothing_yet_stays_announced_and_one_pruned_from_disk_is_forgotten(tmp_path, published, swarm):
    from swarmrl.transfer.p2p.dht import manifest_tag

    signed, origin_store, _ = published
    manifest = signed.manifest
    first = manifest.shards()[0]
    tag = manifest_tag(manifest)
    store = ShardStore(tmp_path / "node")
    node = swarm(record_ttl_s=6.0, announce_interval_s=0.0)  # its record is refreshed (disk re-read) every 2 s
    node.serve(manifest, store)  # a download begins: nothing held yet
    reader = swarm(node.maddrs, watch_peers=0)
    rec = wait_for(lambda: reader.holders(manifest, wait=True).get(node.peer_id), what="the empty record")
    assert rec.indices() == set()
    time.sleep(2.5)  # past a refresh: still nothing on disk, and still served
    assert tag in node.server.served
    store.put(first.sha256, origin_store.get(first.sha256))
    node.mark_held(manifest, first)
    wait_for(lambda: reader.holders(manifest, wait=True)[node.peer_id].indices() == {0}, what="the first shard")
    store.path(first.sha256).unlink()  # pruned (keep_versions): the next refresh empties the record
    wait_for(lambda: tag not in node.server.served, what="the version to be forgotten")
    wait_for(lambda: reader.holders(manifest, wait=True)[node.peer_id].indices() == set(), what="the empty record")

    # A version the node never got a shard of is forgotten once a newer one is served (no record kept alive).
    ckpt2, _ = make_checkpoint(tmp_path, version=2)
    v2 = cut_checkpoint(ckpt2, run_id="test", version=2, store=ShardStore(tmp_path / "o2"), shard_size=SHARD)
    ckpt3, _ = make_checkpoint(tmp_path, version=3)
    v3 = cut_checkpoint(ckpt3, run_id="test", version=3, store=ShardStore(tmp_path / "o3"), shard_size=SHARD)
    node.serve(v2, store)
    wait_for(lambda: node.server.served.get(manifest_tag(v2)) and node.server.served[manifest_tag(v2)].announced,
             what="v2's empty record")
    node.serve(v3, store)
    wait_for(lambda: manifest_tag(v2) not in node.server.served, what="v2 to be forgotten")
    assert manifest_tag(v3) in node.server.served


def test_a_holder_keeps_the_stream_open_until_the_asker_has_read_everything_and_closed_it(tmp_path, published, swarm):
    """p2pd resets a stream whose handler side closes while its other direction is still open, dropping bytes
    not yet sent (one upload in a thousand lost its last 64 KiB in the benchmark): the holder closes last."""
    import asyncio

    from swarmrl.transfer.p2p.serving import OK, OP_GET
    from swarmrl.transfer.p2p.swarm import SwarmPeer

    signed, origin_store, _ = published
    manifest = signed.manifest
    shard = manifest.shards()[0]
    store = ShardStore(tmp_path / "holder")
    store.put(shard.sha256, origin_store.get(shard.sha256))
    holder = swarm()
    holder.serve(manifest, store)
    node = swarm(holder.maddrs)

    async def ask() -> tuple[bytes, bytes]:
        reader, writer = await node._open(holder.peer_id)
        await SwarmPeer._request(writer, OP_GET, shard.sha256.encode())
        status = await reader.readexactly(1)
        n = int.from_bytes(await reader.readexactly(8), "big")
        data = await reader.readexactly(n)
        try:  # everything read: the holder must not have closed its side yet
            after = await asyncio.wait_for(reader.read(1), 1.0)
        except TimeoutError:
            after = b"still open"
        writer.close()
        return status + data, after

    got, after = node._call(ask(), timeout=30)
    assert got == OK + origin_store.get(shard.sha256)
    assert after == b"still open"


def test_a_watcher_closes_its_watch_once_the_peer_holds_everything(tmp_path, published, swarm):
    signed, origin_store, _ = published
    manifest = signed.manifest
    shards = manifest.shards()
    store = ShardStore(tmp_path / "holder")
    for s in shards[:-1]:
        store.put(s.sha256, origin_store.get(s.sha256))
    holder = swarm()
    holder.serve(manifest, store)
    node = swarm(holder.maddrs)
    wait_for(lambda: holder.peer_id in node.holders(manifest, wait=True), what="the holder's record")
    wait_for(lambda: any(v.watchers for v in holder.server.served.values()), what="the watch")
    store.put(shards[-1].sha256, origin_store.get(shards[-1].sha256))
    holder.mark_held(manifest, shards[-1])
    # The last HAVE completes the holder's bitfield: the watcher ends the stream at once (the holder closes
    # only after it, so waiting for the holder would take its 10 s linger).
    wait_for(lambda: not node._watch_tasks, timeout=5.0, what="the watch to end")
    assert node.stats.haves >= 1


def test_the_dht_is_read_less_often_while_every_known_holder_is_watched(tmp_path, published, swarm):
    signed, origin_store, _ = published
    manifest = signed.manifest
    store = ShardStore(tmp_path / "holder")
    store.put(manifest.shards()[0].sha256, origin_store.get(manifest.shards()[0].sha256))
    holder = swarm()
    holder.serve(manifest, store)
    reads = {}
    for watch in (0, 32):
        node = swarm(holder.maddrs, poll_interval_s=0.05, watch_peers=watch)
        wait_for(lambda node=node: holder.peer_id in node.holders(manifest, wait=True), what="the record")
        if watch:
            wait_for(lambda node=node: node._live.get(next(iter(node._live)), {}), what="the watch")
        before = node.stats.dht_reads
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:
            node.holders(manifest)
            time.sleep(0.02)
        reads[watch] = node.stats.dht_reads - before
    # Unwatched: a read every poll interval (about 30 in 2 s). Watched: the interval doubles up to 0.4 s.
    assert reads[0] >= 15
    assert reads[32] <= 10


@pytest.mark.parametrize("interval", [0.0, 1.5])
def test_new_shards_are_announced_at_most_once_per_interval_and_all_reach_the_dht(tmp_path, published, swarm,
                                                                                  interval):
    from swarmrl.transfer.p2p.dht import manifest_info

    signed, origin_store, _ = published
    manifest = signed.manifest
    shards = manifest.shards()
    store = ShardStore(tmp_path / "holder")
    store.put(shards[0].sha256, origin_store.get(shards[0].sha256))
    holder = swarm(announce_interval_s=interval)
    holder.serve(manifest, store)
    reader = swarm(holder.maddrs, watch_peers=0)
    wait_for(lambda: holder.peer_id in reader.holders(manifest, wait=True), what="the first record")
    first = holder.stats.announces
    t0 = time.monotonic()
    for s in shards[1:]:  # one shard every 0.1 s: the store of a fast download
        store.put(s.sha256, origin_store.get(s.sha256))
        holder.mark_held(manifest, s)
        time.sleep(0.1)
    during = holder.stats.announces - first
    elapsed = time.monotonic() - t0
    everything = set(range(len(manifest_info(manifest).shards)))
    wait_for(lambda: reader.holders(manifest, wait=True)[holder.peer_id].indices() >= everything,
             what="every shard in the DHT record")
    if interval:
        assert during <= elapsed / interval + 1
    else:  # every change goes out (batched within announce_delay_s)
        assert during >= len(shards) // 2


def test_a_peer_sources_bulk_held_agrees_with_holds_and_follows_its_record(tmp_path):
    from types import SimpleNamespace

    from swarmrl.transfer.p2p.config import P2PConfig
    from swarmrl.transfer.p2p.dht import HolderRecord, make_bitfield, manifest_tag
    from swarmrl.transfer.p2p.sources import PeerSource

    ckpt, _ = make_checkpoint(tmp_path, size=20 * SHARD)
    manifest = cut_checkpoint(ckpt, run_id="test", version=1, store=ShardStore(tmp_path / "s"), shard_size=SHARD)
    shards = manifest.shards()
    n, tag = len(shards), manifest_tag(manifest)
    src = PeerSource(SimpleNamespace(trusted_seeds=set(), config=P2PConfig()), "QmPeer",  # type: ignore[arg-type]
                     HolderRecord("QmPeer", tag, n, make_bitfield(n, {0, 3, 5})))
    wanted = {s.sha256: s for s in shards[2:]}
    one_by_one = {sha for sha, s in wanted.items() if src.holds(manifest, s)}
    assert src.held(manifest, wanted) == one_by_one == {shards[3].sha256, shards[5].sha256}
    src.update(HolderRecord("QmPeer", tag, n, make_bitfield(n, {1, 7})))
    assert src.held(manifest, wanted) == {shards[7].sha256}


def test_only_a_bootstrap_peer_is_believed_when_it_claims_to_be_a_seed(tmp_path, published, swarm):
    signed, origin_store, _ = published
    manifest = signed.manifest
    boot = swarm(seed=True)
    boot.serve(manifest, origin_store)
    impostor = swarm(boot.maddrs, seed=True)
    impostor.serve(manifest, origin_store)
    node = swarm(boot.maddrs)
    source = node.source()

    def both() -> list:
        found = {s.peer_id: s for s in source.expand(manifest)} if node.holders(manifest, wait=True) else {}
        return found if {boot.peer_id, impostor.peer_id} <= set(found) else []

    found = wait_for(both, what="both seeds' records")
    assert found[boot.peer_id].seed
    assert not found[impostor.peer_id].seed and found[impostor.peer_id].max_in_flight == 1


def test_slow_peer_is_dropped_and_the_shard_taken_elsewhere(tmp_path, published, coordinator, swarm):
    signed, origin_store, weights = published
    manifest = signed.manifest
    slow_store = SlowStore(tmp_path / "slow", delay=3.0)
    for s in manifest.shards():
        slow_store.put(s.sha256, origin_store.get(s.sha256))
    slow = swarm()
    slow.serve(manifest, slow_store)
    node = swarm(slow.maddrs, peer_timeout_s=0.5, max_peer_failures=1, drop_s=600)
    wait_for(lambda: slow.peer_id in node.holders(manifest, wait=True), what="the slow peer's announcement")
    origin = StoreSource(origin_store)
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [node.source(), origin],
                          **node.fetcher_options())
    _, out = f.fetch(signed)
    # With the end game, fetch may return on the origin's copy before the slow peer's request has timed out.
    wait_for(lambda: f.stats.failures, what="the slow peer's timeout")
    assert (out / "model.safetensors").read_bytes() == weights
    assert f.stats.bad_shards == 0 and f.stats.failures == 1  # one timeout, then the peer was dropped
    assert not node.usable(slow.peer_id) and slow.peer_id not in node.banned
    assert len(origin.calls) == len(manifest.shards())


def test_a_pipelined_request_waits_in_its_askers_upload_slot_not_in_the_queue(tmp_path, published, swarm):
    from concurrent.futures import ThreadPoolExecutor

    from swarmrl.transfer.sources import SourceBusy

    signed, origin_store, _ = published
    manifest = signed.manifest
    shards = manifest.shards()
    store = SlowStore(tmp_path / "holder", delay=1.0)
    for s in shards:
        store.put(s.sha256, origin_store.get(s.sha256))
    holder = swarm(max_uploads=1, upload_queue=0)  # one upload at a time, nobody queues for it
    holder.serve(manifest, store)
    a, b = swarm(holder.maddrs), swarm(holder.maddrs)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(a.fetch, holder.peer_id, shards[0])
        time.sleep(0.2)
        second = pool.submit(a.fetch, holder.peer_id, shards[1])  # pipelined behind the first
        time.sleep(0.2)
        with pytest.raises(SourceBusy):  # another asker finds the one slot taken
            b.fetch(holder.peer_id, shards[2])
        assert first.result() == origin_store.get(shards[0].sha256)
        assert second.result() == origin_store.get(shards[1].sha256)
    assert holder.stats.uploads == 2 and holder.stats.busy == 1
    # The asker's last request ended, so its slot is free again.
    assert b.fetch(holder.peer_id, shards[2]) == origin_store.get(shards[2].sha256)
    assert not holder.server.askers


def test_upload_cap_token_bucket_paces_bytes():
    from swarmrl.transfer.p2p.serving import TokenBucket

    now = [0.0]

    async def fake_sleep(dt: float) -> None:
        now[0] += dt

    async def send(total: int, chunk: int) -> None:
        bucket = TokenBucket(1_000_000, burst=chunk, clock=lambda: now[0], sleep=fake_sleep)
        for _ in range(total // chunk):
            await bucket.take(chunk)

    asyncio.run(send(4_000_000, 65536))
    assert 3.9 <= now[0] <= 4.0  # 4 MB at 1 MB/s, less the initial burst


def test_seed_suggestions_hand_every_shard_out_once_before_any_twice(published):
    from swarmrl.transfer.p2p.config import P2PConfig
    from swarmrl.transfer.p2p.dht import make_bitfield, manifest_tag
    from swarmrl.transfer.p2p.serving import LATER, ShardServer
    from swarmrl.transfer.p2p.swarm import SwarmStats

    signed, origin_store, _ = published
    manifest = signed.manifest
    n = len(manifest.shards())
    seed = ShardServer(P2PConfig(seed=True, seed_grace_s=60), SwarmStats(), set(), lambda: None)  # not started
    seed.serve(manifest, origin_store)
    want_all = manifest_tag(manifest).encode() + make_bitfield(n, range(n))
    want_one = manifest_tag(manifest).encode() + make_bitfield(n, [3])
    assert seed.suggest_for(want_one) == 3
    assert seed.suggest_for(want_one) == LATER  # handed out once; others have never-handed shards to get
    picks = [seed.suggest_for(want_all) for _ in range(n - 1)]
    assert sorted(picks) == [i for i in range(n) if i != 3]  # n - 1 askers, n - 1 different shards
    seed.serving = seed.config.seed_max_uploads  # the seed's link is full
    assert seed.suggest_for(want_all) == LATER  # all handed out, all still on their way: take them from peers
    seed.handouts[manifest.shards()[5].sha256].quiet_at = 0.0  # shard 5's copy landed long ago
    assert seed.suggest_for(want_all) == 5  # now the seed may help with a second copy
    seed.serving = seed.config.seed_max_uploads - 1  # room on the seed's link: rather a copy still on its way
    second = seed.suggest_for(want_all)  # than idling; the least handed out first (shard 5 has two now)
    assert isinstance(second, int) and second != 5
    assert seed.suggest_for(b"0" * 16 + make_bitfield(n, [3])) is None  # unknown manifest: no opinion


# -- the fetcher's scheduling, resume and manifest checks (no network) -----------------------------------


class FakePeer(ShardSource):
    seed = False

    def __init__(self, name: str, store: ShardStore, holds: set[str], log: list[tuple[str, str]]):
        self.name, self.store, self.have, self.log = name, store, holds, log

    def holds(self, manifest: CheckpointManifest, shard: ShardRef) -> bool:
        return shard.sha256 in self.have

    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        self.log.append((self.name, shard.sha256))
        return self.store.get(shard.sha256)


def test_rarest_shards_first_and_seeds_only_for_what_no_peer_holds(tmp_path, published, coordinator):
    signed, origin_store, _ = published
    shards = [s.sha256 for s in signed.manifest.shards()]
    log: list[tuple[str, str]] = []
    # shard 0: 3 holders, 1: 2 holders, 2: 1 holder, 3..: no peer holds them.
    p1 = FakePeer("p1", origin_store, {shards[0], shards[1], shards[2]}, log)
    p2 = FakePeer("p2", origin_store, {shards[0], shards[1]}, log)
    p3 = FakePeer("p3", origin_store, {shards[0]}, log)
    origin = StoreSource(origin_store)
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [p3, p2, p1, origin])
    f.fetch(signed)
    assert [sha for _, sha in log] == [shards[2], shards[1], shards[0]]  # rarest first
    assert set(origin.calls) == set(shards[3:]) and len(origin.calls) == len(shards) - 3
    assert f.stats.by_source["origin"] == len(shards) - 3 and f.stats.shards_fetched == len(shards)


def test_max_peer_parallel_counts_peers_and_a_busy_peer_gets_its_second_request(tmp_path, published, coordinator):
    """Two requests in flight to one peer (its max_in_flight) use one of the max_peer_parallel peer places."""
    signed, origin_store, _ = published
    shards = {s.sha256 for s in signed.manifest.shards()}
    lock, active, most = threading.Lock(), {"p1": 0, "p2": 0}, {"peers": 0, "p1": 0, "p2": 0}

    class CountingPeer(FakePeer):
        max_in_flight = 2

        def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
            with lock:
                active[self.name] += 1
                most[self.name] = max(most[self.name], active[self.name])
                most["peers"] = max(most["peers"], sum(1 for v in active.values() if v))
            time.sleep(0.05)
            with lock:
                active[self.name] -= 1
            return super().get(manifest, shard)

    log: list[tuple[str, str]] = []
    peers = [CountingPeer("p1", origin_store, shards, log), CountingPeer("p2", origin_store, shards, log)]
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, peers, max_parallel=4,
                          max_peer_parallel=1, endgame=False)
    f.fetch(signed)
    assert most["peers"] == 1  # one peer at a time...
    assert max(most["p1"], most["p2"]) == 2  # ...with two requests open to it
    assert len(log) == len(shards)


@pytest.mark.parametrize("spread", [False, True])
def test_spread_holders_asks_the_least_used_peer_first(tmp_path, published, coordinator, spread):
    """p1 alone holds the two rarest shards. Rarest first asks p1 for both at once; spreading asks p1 for one
    and p2 (idle otherwise) for the rarest shard it holds."""
    signed, origin_store, _ = published
    shards = [s.sha256 for s in signed.manifest.shards()]
    both_started = threading.Barrier(2, timeout=10)
    first_two: list[tuple[str, str]] = []

    class PipelinedPeer(FakePeer):
        max_in_flight = 2

        def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
            if len(first_two) < 2:
                first_two.append((self.name, shard.sha256))
                both_started.wait()  # both requests are out before either ends
            return super().get(manifest, shard)

    log: list[tuple[str, str]] = []
    p1 = PipelinedPeer("p1", origin_store, set(shards), log)
    p2 = PipelinedPeer("p2", origin_store, set(shards[2:]), log)
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [p1, p2], max_parallel=2,
                          endgame=False, spread_holders=spread)
    f.fetch(signed)
    peers = sorted(name for name, _ in first_two)
    if spread:
        assert peers == ["p1", "p2"]
        assert dict(first_two)["p1"] in shards[:2]  # p1's rarest shard
    else:
        assert peers == ["p1", "p1"] and {sha for _, sha in first_two} == set(shards[:2])
    assert len(log) == len(shards)


def test_end_game_takes_a_stuck_shard_from_a_second_holder(tmp_path, published, coordinator):
    """Once every shard is in flight, a shard stuck at one holder is asked of another; fetch returns with the
    first copy and does not wait for the stuck one."""
    signed, origin_store, weights = published
    everything = {s.sha256 for s in signed.manifest.shards()}
    release = threading.Event()

    class StuckPeer(FakePeer):
        def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
            self.log.append((self.name, shard.sha256))
            release.wait(60)
            return self.store.get(shard.sha256)

    log: list[tuple[str, str]] = []
    stuck, fast = StuckPeer("stuck", origin_store, everything, log), FakePeer("fast", origin_store, everything, log)
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [stuck, fast], max_parallel=2)
    result: dict[str, tuple] = {}
    done = threading.Event()
    threading.Thread(target=lambda: (result.update(out=f.fetch(signed)), done.set()), daemon=True).start()
    try:
        assert done.wait(30), "fetch waited for the stuck holder"
        assert not release.is_set() and [name for name, _ in log].count("stuck") == 1
        _, path = result["out"]
        assert (path / "model.safetensors").read_bytes() == weights
        assert f.stats.duplicates == 1 and f.stats.by_source == {"fast": len(everything)}
    finally:
        release.set()


@pytest.mark.parametrize("patience", [0.0, 4.0])
def test_end_game_doubles_only_downloads_slower_than_usual(tmp_path, published, coordinator, patience):
    """Holders that all deliver at the usual pace get no second requests once the end game waits for a download
    to take `patience` times the median; without patience every last shard is asked of a second holder."""
    signed, origin_store, weights = published
    everything = {s.sha256 for s in signed.manifest.shards()}

    class SteadyPeer(FakePeer):
        def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
            time.sleep(0.2)
            return super().get(manifest, shard)

    log: list[tuple[str, str]] = []
    peers = [SteadyPeer(f"p{i}", origin_store, everything, log) for i in range(3)]
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, peers, max_parallel=3,
                          endgame_patience=patience)
    _, out = f.fetch(signed)
    assert (out / "model.safetensors").read_bytes() == weights
    assert f.stats.shards_fetched == len(everything)
    if patience:
        assert f.stats.duplicates == 0 and len(log) == len(everything)
    else:
        assert f.stats.duplicates > 0


def test_plain_sources_keep_their_order_and_a_bad_one_is_reported(tmp_path, published, coordinator):
    signed, origin_store, weights = published

    class Corrupting(StoreSource):
        def get(self, manifest, shard):
            return b"\0" * shard.size

    bad, good = Corrupting(origin_store, "bad"), StoreSource(origin_store, "good")
    reports: list[str] = []
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [bad, good],
                          on_bad_shard=lambda src, shard: reports.append(src.name))
    _, out = f.fetch(signed)
    n = len(signed.manifest.shards())
    assert (out / "model.safetensors").read_bytes() == weights
    assert reports == ["bad"] * n and f.stats.by_source == {"good": n}

    class Failing(StoreSource):
        def get(self, manifest, shard):
            raise OSError("down")

    f2 = CheckpointFetcher(tmp_path / "node2", coordinator.public_key_hex, [Failing(origin_store), bad])
    with pytest.raises(ManifestError, match="no source had a good copy"):
        f2.fetch(signed)
    assert not f2.version_dir(1).exists()


def test_resume_after_a_killed_download(tmp_path, published, coordinator):
    signed, origin_store, weights = published
    root = tmp_path / "node"
    (tmp_path / "signed.json").write_text(signed.model_dump_json())
    # A separate process fetches slowly (0.3 s per shard) and is killed with SIGKILL part-way through.
    child = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from swarmrl.transfer.fetcher import CheckpointFetcher
        from swarmrl.protocol.manifest import SignedManifest
        from swarmrl.transfer.store import ShardStore
        from swarmrl.transfer.sources import ShardSource
        class Slow(ShardSource):
            def get(self, manifest, shard):
                time.sleep(0.3)
                return ShardStore({str(origin_store.root)!r}).get(shard.sha256)
        signed = SignedManifest.model_validate_json(open({str(tmp_path / "signed.json")!r}).read())
        CheckpointFetcher({str(root)!r}, {coordinator.public_key_hex!r}, [Slow()]).fetch(signed)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        store = ShardStore(root / "shards")
        wait_for(lambda: len(list(store.root.glob("??/*"))) >= 3 or proc.poll() is not None, what="some shards")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    held = {p.name for p in store.root.glob("??/*")}
    n = len(signed.manifest.shards())
    assert 3 <= len(held) < n and not any(p.name.startswith(".part-") for p in store.root.glob("??/*"))
    assert not (root / "v00000001").exists()

    assert list(root.glob(".v00000001-*")), "the killed fetch had begun writing the checkpoint's files"
    # One of the shards on disk has been damaged since: it is fetched again, not written into the files.
    damaged = sorted(held)[0]
    path = store.path(damaged)
    path.write_bytes(b"x" + path.read_bytes()[1:])

    origin = StoreSource(origin_store)
    f = CheckpointFetcher(root, coordinator.public_key_hex, [origin])
    _, out = f.fetch(signed)
    assert (out / "model.safetensors").read_bytes() == weights
    assert f.stats.shards_reused == len(held) - 1
    # only the missing ones, and the damaged one
    assert set(origin.calls) == {s.sha256 for s in signed.manifest.shards()} - held | {damaged}
    assert not list(root.glob(".v*")), "what the killed fetch left behind is gone"


def test_manifest_signature_failures_are_refused_before_anything_is_fetched(tmp_path, published, coordinator):
    signed, origin_store, _ = published
    origin = StoreSource(origin_store)
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [origin])
    manifest = signed.manifest

    unsigned = SignedManifest(manifest=manifest, public_key=coordinator.public_key_hex, signature="00" * 64)
    other = SignedManifest.sign(manifest, Identity.generate())
    forged_key = SignedManifest(manifest=manifest, public_key=coordinator.public_key_hex,
                                signature=other.signature)
    tampered = signed.model_copy(deep=True)
    tampered.manifest.files[0].sha256 = "f" * 64
    for bad, reason in ((unsigned, "bad manifest signature"), (other, "untrusted key"),
                        (forged_key, "bad manifest signature"), (tampered, "bad manifest signature")):
        with pytest.raises(ManifestError, match=reason):
            f.fetch(bad)
    with pytest.raises(ManifestError, match="not newer"):
        f.fetch(signed, held_version=1)
    with pytest.raises(ManifestError, match="not newer"):
        f.fetch(signed, held_version=5)
    assert origin.calls == []
    assert not list((tmp_path / "node").glob("v*")) and not list(f.store.root.glob("??/*"))


def test_keep_versions_prunes_old_versions_and_their_shards(tmp_path, coordinator):
    store = ShardStore(tmp_path / "origin")
    signed = []
    for v in (1, 2, 3):
        ckpt, _ = make_checkpoint(tmp_path, version=v, size=200_000, seed=v)
        signed.append(SignedManifest.sign(cut_checkpoint(ckpt, run_id="test", version=v, store=store,
                                                         shard_size=SHARD), coordinator))
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [StoreSource(store)], keep_versions=2)
    held = -1
    for s in signed:
        held = f.fetch(s, held_version=held)[0].version
    assert sorted(p.name for p in (tmp_path / "node").glob("v*")) == ["v00000002", "v00000003"]
    on_disk = {p.name for p in f.store.root.glob("??/*")}
    assert on_disk == {x.sha256 for s in signed[1:] for x in s.manifest.shards()}


def test_wait_hint_holds_a_shard_back_from_the_seed(tmp_path, published, coordinator):
    """A seed saying WAIT is not asked for those shards; they come from a peer once it holds them."""
    signed, origin_store, _ = published
    shards = signed.manifest.shards()
    log: list[tuple[str, str]] = []
    late_peer = FakePeer("peer", origin_store, set(), log)

    class Seed(StoreSource):
        seed = True

        def suggest(self, manifest, wanted):
            if any(s.sha256 == shards[0].sha256 for s in wanted) and len(self.calls) == len(shards) - 1:
                late_peer.have.add(shards[0].sha256)  # "announced" by the peer that got it
                return WAIT
            return next((s for s in wanted if s.sha256 != shards[0].sha256), WAIT)

    seed = Seed(origin_store, "seed")
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [late_peer, seed], max_parallel=2,
                          poll_s=0.01)
    f.fetch(signed)
    assert shards[0].sha256 not in seed.calls
    assert log == [("peer", shards[0].sha256)]


def test_start_swarm_degrades_to_the_origin_when_disabled_or_unreachable():
    from swarmrl.transfer.p2p import P2PConfig, start_swarm

    assert start_swarm(P2PConfig(enabled=False), "test", []) is None
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"  # nobody listens there
    cfg = P2PConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_wait_timeout_s=1.0, startup_timeout_s=10.0)
    assert start_swarm(cfg, "test", [dead]) is None
