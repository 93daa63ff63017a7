"""Peer-to-peer checkpoint distribution: DHT discovery records, shard exchange, watch streams, bans, seeds.

Everything runs on 127.0.0.1 (libp2p daemons with NAT helpers and relays off). No timing: tests wait for
conditions (with generous deadlines) or for events they control, never for a stretch of time, and assert on
what happened, not on how long it took. What follows from the time alone (when a record is due, how often the
DHT is read, what a seed suggests) is tested on the pure functions that decide it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import SignedManifest
from swarmrl.testing.waiting import wait_for
from swarmrl.transfer.fetcher import CheckpointFetcher, FetchConfig
from swarmrl.transfer.p2p.sources import SwarmSource
from swarmrl.transfer.sources import SourceBusy
from swarmrl.transfer.store import ShardStore, cut_checkpoint
from tests.support.transfer import SHARD, GatedStore, LyingStore, StoreSource, make_checkpoint, publish

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def coordinator() -> Identity:
    return Identity.generate()


@pytest.fixture()
def published(tmp_path: Path, coordinator: Identity) -> tuple[SignedManifest, ShardStore, bytes]:
    return publish(tmp_path, coordinator)


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
    assert not c.call(c._dht.store(key, forged.to_value(), get_dht_time() + 30, subkey=b._rsa.local_public_key))
    # c announces under its own key that *b's* peer id holds everything: refused as well.
    spoof = HolderRecord(peer_id=b.peer_id, tag=manifest_tag(manifest), n_shards=n, bits=make_bitfield(n, range(n)))
    assert not c.call(c._dht.store(key, spoof.to_value(), get_dht_time() + 30, subkey=c._rsa.local_public_key))
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
            f = CheckpointFetcher(tmp_path / f"node{i}", coordinator.public_key_hex, [SwarmSource(nodes[i]), http],
                                  config=FetchConfig())
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
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [SwarmSource(node), origin],
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
    from swarmrl.transfer.p2p.wire import PeerError

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
    else:  # once the DHT has the new record, the node still does not know: nothing told it
        reader = swarm(holder.maddrs, watch_peers=0)
        wait_for(lambda: last in reader.holders(manifest, wait=True)[holder.peer_id].indices(), what="the record")
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
    served = node.server.served[tag]
    first_store = served.announced_at
    wait_for(lambda: served.announced_at > first_store, what="a refresh (which re-reads the disk)")
    assert node.server.served.get(tag) is served  # still nothing on disk, and still served
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
    from swarmrl.transfer.p2p.wire import OK, OP_GET, read_length, send_request

    signed, origin_store, _ = published
    manifest = signed.manifest
    shard = manifest.shards()[0]
    store = ShardStore(tmp_path / "holder")
    store.put(shard.sha256, origin_store.get(shard.sha256))
    holder = swarm()
    holder.serve(manifest, store)
    node = swarm(holder.maddrs)

    async def ask() -> tuple[bytes, asyncio.StreamWriter]:
        reader, writer = await node.client.open(holder.peer_id)
        await send_request(writer, OP_GET, shard.sha256.encode())
        status = await reader.readexactly(1)
        data = await reader.readexactly(await read_length(reader))
        return status + data, writer

    got, writer = node.call(ask(), 30)
    assert got == OK + origin_store.get(shard.sha256)
    assert holder.server.streams == 1  # everything read, and the holder's side is still open: it waits for ours
    async def close() -> None:
        writer.close()

    node.call(close(), 30)
    wait_for(lambda: holder.server.streams == 0, what="the holder to close its side")
    assert holder.stats.linger_timeouts == 0  # it closed because the asker had, not after waiting in vain


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
    # The last HAVE completes the holder's bitfield: the watcher ends the stream (the holder closes only after
    # it; had the watcher waited for the holder, the holder would have given up waiting after LINGER_S).
    wait_for(lambda: not node.watches.tasks, what="the watch to end")
    wait_for(lambda: holder.server.streams == 0, what="the holder's side to end")
    assert holder.stats.linger_timeouts == 0
    assert node.stats.haves >= 1


def test_the_dht_is_read_less_often_while_every_known_holder_is_watched(tmp_path, published, swarm):
    from swarmrl.transfer.p2p.dht import manifest_tag

    signed, origin_store, _ = published
    manifest = signed.manifest
    store = ShardStore(tmp_path / "holder")
    store.put(manifest.shards()[0].sha256, origin_store.get(manifest.shards()[0].sha256))
    holder = swarm()
    holder.serve(manifest, store)
    intervals = {}
    for watch in (0, 32):
        node = swarm(holder.maddrs, poll_interval_s=0.05, watch_peers=watch)
        wait_for(lambda node=node: holder.peer_id in node.holders(manifest, wait=True), what="the record")
        if watch:
            wait_for(lambda node=node: holder.peer_id in node.watches.watched(manifest_tag(manifest)),
                     what="the watch")
        intervals[watch] = []
        for _ in range(5):  # five reads of the DHT, each finding the same holder
            node.holders(manifest, wait=True)
            intervals[watch].append(node.directory.interval(manifest))
    assert intervals[0] == [0.05] * 5  # unwatched: every poll interval
    assert intervals[32][-2:] == [0.4, 0.4] and intervals[32] == sorted(intervals[32])  # watched: doubling to 8x


def test_the_dht_read_interval_doubles_only_while_nothing_is_new_and_every_holder_is_watched():
    from swarmrl.transfer.p2p.discovery import _Holders, next_poll

    recs = {"a": object(), "b": object()}
    before = _Holders(records=dict(recs), at=0.0, every=0.1)  # type: ignore[arg-type]
    assert next_poll(None, recs, {"a", "b"}, 0.1) == 0.1  # a first read
    assert next_poll(before, recs, {"a", "b"}, 0.1) == 0.2
    assert next_poll(_Holders(dict(recs), 0.0, 0.6), recs, {"a", "b"}, 0.1) == 0.8  # at most 8 poll intervals
    assert next_poll(before, recs, {"a"}, 0.1) == 0.1  # b is not watched: the DHT speaks for it
    assert next_poll(before, {**recs, "c": object()}, {"a", "b", "c"}, 0.1) == 0.1  # a new holder


def test_a_record_is_stored_at_once_when_new_or_emptied_and_changes_at_most_once_per_interval():
    from swarmrl.transfer.p2p.dht import make_bitfield
    from swarmrl.transfer.p2p.discovery import store_delay

    one, two, empty = make_bitfield(10, [0]), make_bitfield(10, [0, 1]), make_bitfield(10, [])
    refresh = 20.0
    assert store_delay(empty, None, 0.0, 5.0, 1.5, refresh) == 0.0  # the first record, even with nothing held
    assert store_delay(one, one, 10.0, 11.0, 1.5, refresh) == 19.0  # unchanged: at the next refresh
    assert store_delay(one, one, 10.0, 30.0, 1.5, refresh) == 0.0  # the refresh is due
    assert store_delay(two, one, 10.0, 11.0, 1.5, refresh) == 0.5  # changed too soon after the last store
    assert store_delay(two, one, 10.0, 11.5, 1.5, refresh) == 0.0
    assert store_delay(two, one, 10.0, 10.01, 0.0, refresh) == 0.0  # interval 0: every change
    assert store_delay(empty, one, 10.0, 10.01, 1.5, refresh) == 0.0  # emptied (pruned, retired): at once


@pytest.mark.parametrize("interval", [0.0, 1.5])
def test_new_shards_stored_quickly_all_reach_the_dht(tmp_path, published, swarm, interval):
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
    for s in shards[1:]:  # one after another, as fast as a download stores them
        store.put(s.sha256, origin_store.get(s.sha256))
        holder.mark_held(manifest, s)
    everything = set(range(len(manifest_info(manifest).shards)))
    wait_for(lambda: reader.holders(manifest, wait=True)[holder.peer_id].indices() >= everything,
             what="every shard in the DHT record")  # the last change is not left waiting for a later one


def test_a_peer_sources_bulk_held_agrees_with_holds_and_follows_its_record(tmp_path):
    from types import SimpleNamespace

    from swarmrl.transfer.p2p.dht import HolderRecord, make_bitfield, manifest_tag
    from swarmrl.transfer.p2p.sources import PeerSource

    ckpt, _ = make_checkpoint(tmp_path, size=20 * SHARD)
    manifest = cut_checkpoint(ckpt, run_id="test", version=1, store=ShardStore(tmp_path / "s"), shard_size=SHARD)
    shards = manifest.shards()
    n, tag = len(shards), manifest_tag(manifest)
    src = PeerSource(SimpleNamespace(trusted_seeds=set()), "QmPeer",  # type: ignore[arg-type]
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
    source = SwarmSource(node)

    def both() -> list:
        found = {s.peer_id: s for s in source.expand(manifest)} if node.holders(manifest, wait=True) else {}
        return found if {boot.peer_id, impostor.peer_id} <= set(found) else []

    found = wait_for(both, what="both seeds' records")
    assert found[boot.peer_id].seed
    assert not found[impostor.peer_id].seed


def test_slow_peer_is_dropped_and_the_shard_taken_elsewhere(tmp_path, published, coordinator, swarm):
    signed, origin_store, weights = published
    manifest = signed.manifest
    slow_store = GatedStore(tmp_path / "slow")  # it answers nothing until the test ends
    for s in manifest.shards():
        slow_store.put(s.sha256, origin_store.get(s.sha256))
    slow = swarm()
    slow.serve(manifest, slow_store)
    try:
        node = swarm(slow.maddrs, peer_timeout_s=0.5, max_peer_failures=1, drop_s=600)
        wait_for(lambda: slow.peer_id in node.holders(manifest, wait=True), what="the slow peer's announcement")
        origin = StoreSource(origin_store)
        f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [SwarmSource(node), origin])
        _, out = f.fetch(signed)
        # With the end game, fetch may return on the origin's copy before the slow peer's request has timed out.
        wait_for(lambda: f.stats.failures, what="the slow peer's timeout")
        assert (out / "model.safetensors").read_bytes() == weights
        assert f.stats.bad_shards == 0 and f.stats.failures == 1  # one timeout, then the peer was dropped
        assert not node.usable(slow.peer_id) and slow.peer_id not in node.banned
        assert sorted(origin.calls) == sorted(s.sha256 for s in manifest.shards())
    finally:
        slow_store.gate.set()


def test_a_pipelined_request_waits_in_its_askers_upload_slot_not_in_the_queue(tmp_path, published, swarm):
    signed, origin_store, _ = published
    manifest = signed.manifest
    shards = manifest.shards()
    store = GatedStore(tmp_path / "holder")  # uploads wait for the test's word
    for s in shards:
        store.put(s.sha256, origin_store.get(s.sha256))
    holder = swarm(max_uploads=1, upload_queue=0)  # one upload at a time, nobody queues for it
    holder.serve(manifest, store)
    a, b = swarm(holder.maddrs, peer_timeout_s=120), swarm(holder.maddrs, peer_timeout_s=120)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(a.fetch, holder.peer_id, shards[0])
            assert store.reading.wait(60), "the first upload never began"  # it holds the one slot
            second = pool.submit(a.fetch, holder.peer_id, shards[1])  # pipelined behind the first
            wait_for(lambda: getattr(holder.server.askers.get(a.peer_id), "requests", 0) == 2,
                     what="a's second request to wait behind its first")
            with pytest.raises(SourceBusy):  # another asker finds the one slot taken
                b.fetch(holder.peer_id, shards[2])
            store.gate.set()
            assert first.result() == origin_store.get(shards[0].sha256)
            assert second.result() == origin_store.get(shards[1].sha256)
    finally:
        store.gate.set()
    wait_for(lambda: holder.stats.uploads == 2 and not holder.server.askers, what="a's slot to be given back")
    assert holder.stats.busy == 1
    # The asker's last request ended, so its slot is free again.
    assert b.fetch(holder.peer_id, shards[2]) == origin_store.get(shards[2].sha256)


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
    from swarmrl.transfer.p2p.seeding import SeedLedger
    from swarmrl.transfer.p2p.wire import LATER

    signed, _, _ = published
    shards = signed.manifest.shards()
    n = len(shards)
    everything, held = set(range(n)), set(range(n))
    ledger = SeedLedger(grace_s=60, max_uploads=5)
    assert ledger.suggest(shards, held, {3}, serving=0, now=0.0) == 3
    assert ledger.suggest(shards, held, {3}, serving=0, now=0.0) == LATER  # others have never-handed shards to get
    picks = [ledger.suggest(shards, held, everything, serving=0, now=0.0) for _ in range(n - 1)]
    assert sorted(picks) == [i for i in range(n) if i != 3]  # n - 1 askers, n - 1 different shards
    # All handed out, all still on their way (within the grace), the seed's link full: take them from peers.
    assert ledger.suggest(shards, held, everything, serving=5, now=1.0) == LATER
    ledger.handouts[shards[5].sha256].quiet_at = 0.0  # shard 5's copy landed long ago
    assert ledger.suggest(shards, held, everything, serving=5, now=1.0) == 5  # the seed helps with a second copy
    # Room on the seed's link: rather a copy still on its way than idling; the least handed out first (5 has two).
    second = ledger.suggest(shards, held, everything, serving=4, now=1.0)
    assert isinstance(second, int) and second != 5
    assert ledger.suggest(shards, held, set(), serving=0, now=1.0) is None  # wants nothing: no opinion


def test_an_upload_a_suggestion_promised_counts_once_and_an_unannounced_one_counts(published):
    from swarmrl.transfer.p2p.seeding import SeedLedger

    signed, _, _ = published
    shards = signed.manifest.shards()
    ledger = SeedLedger(grace_s=5, max_uploads=5)
    i = ledger.suggest(shards, {0}, {0}, serving=0, now=10.0)
    h = ledger.upload_begins(shards[i].sha256, now=10.1)  # the asker's request follows the suggestion
    assert h.given == 1 and h.active == 1
    ledger.upload_ends(h, now=11.0)
    assert h.active == 0 and h.quiet_at == 16.0
    assert ledger.upload_begins(shards[i].sha256, now=20.0).given == 2  # asked for without a suggestion


def test_a_server_has_no_opinion_on_a_version_it_does_not_serve(published):
    from swarmrl.transfer.p2p.config import P2PConfig
    from swarmrl.transfer.p2p.dht import make_bitfield, manifest_tag
    from swarmrl.transfer.p2p.serving import ShardServer
    from swarmrl.transfer.p2p.wire import SwarmStats

    signed, origin_store, _ = published
    manifest = signed.manifest
    n = len(manifest.shards())
    seed = ShardServer(P2PConfig(seed=True), SwarmStats(), set(), lambda: None)  # not started: no event loop
    seed.serve(manifest, origin_store)
    assert seed.suggest_for(manifest_tag(manifest).encode() + make_bitfield(n, [3])) == 3
    assert seed.suggest_for(b"0" * 16 + make_bitfield(n, [3])) is None  # unknown manifest
    assert seed.suggest_for(manifest_tag(manifest).encode() + b"\xff") is None  # a bitfield of the wrong size


def test_start_swarm_degrades_to_the_origin_when_disabled_or_unreachable():
    from swarmrl.transfer.p2p import P2PConfig, start_swarm

    assert start_swarm(P2PConfig(enabled=False), "test", []) is None
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"  # nobody listens there
    cfg = P2PConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_wait_timeout_s=1.0, startup_timeout_s=10.0)
    assert start_swarm(cfg, "test", [dead]) is None
