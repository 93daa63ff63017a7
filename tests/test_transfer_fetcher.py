"""CheckpointFetcher with in-process sources: what reaches disk, resume, manifest checks, which versions are kept,
and the executor following the scheduler (whose decisions are tested one by one in test_transfer_schedule.py).

No network, no timing: sources that must be slow block on events the test controls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import CheckpointManifest, ManifestError, ShardRef, SignedManifest
from swarmrl.testing.waiting import wait_for
from swarmrl.transfer.fetcher import CheckpointFetcher, FetchConfig, ShardUnavailable
from swarmrl.transfer.sources import WAIT, ShardNotHeld
from swarmrl.transfer.store import ShardStore, cut_checkpoint
from tests.support.transfer import SHARD, FakePeer, StoreSource, make_checkpoint, publish

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def coordinator() -> Identity:
    return Identity.generate()


@pytest.fixture()
def published(tmp_path: Path, coordinator: Identity) -> tuple[SignedManifest, ShardStore, bytes]:
    return publish(tmp_path, coordinator)

ROOT = Path(__file__).resolve().parents[1]


def test_rarest_shards_first_from_peers_and_the_rest_from_the_seed(tmp_path, published, coordinator):
    signed, origin_store, weights = published
    shards = [s.sha256 for s in signed.manifest.shards()]
    peers_done = threading.Event()

    class Log(list):
        def append(self, item: tuple[str, str]) -> None:
            super().append(item)
            if len(self) == 3:
                peers_done.set()

    class HeldBackOrigin(StoreSource):
        """Serves only once the peers have served their three shards: otherwise, on a busy machine, the seed
        slot may empty its own queue first and then take a shard peers hold (as it should), and the order of
        the peers' shards would depend on timing."""

        def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
            if not peers_done.wait(120):
                raise TimeoutError("the peers never served their shards")
            return super().get(manifest, shard)

    log: list[tuple[str, str]] = Log()
    # shard 0: 3 holders, 1: 2 holders, 2: 1 holder, 3..: no peer holds them.
    p1 = FakePeer("p1", origin_store, {shards[0], shards[1], shards[2]}, log)
    p2 = FakePeer("p2", origin_store, {shards[0], shards[1]}, log)
    p3 = FakePeer("p3", origin_store, {shards[0]}, log)
    origin = HeldBackOrigin(origin_store)
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [p3, p2, p1, origin],
                          config=FetchConfig(max_parallel_peers=1, spread_holders=False))
    assert f.workers == 2  # one peer slot, one seed slot
    _, out = f.fetch(signed)
    assert (out / "model.safetensors").read_bytes() == weights
    assert [sha for _, sha in log] == [shards[2], shards[1], shards[0]]  # one peer at a time, rarest first
    assert sorted(origin.calls) == sorted(shards[3:])
    assert f.stats.by_source["origin"] == len(shards) - 3 and f.stats.shards_fetched == len(shards)


def test_end_game_takes_a_stuck_shard_from_a_second_holder(tmp_path, published, coordinator):
    """Once every shard is in flight, a shard stuck at one holder is asked of another; fetch returns with the
    first copy and does not wait for the stuck one."""
    signed, origin_store, weights = published
    everything = {s.sha256 for s in signed.manifest.shards()}
    release = threading.Event()

    class StuckPeer(FakePeer):
        def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
            self.log.append((self.name, shard.sha256))
            release.wait(120)
            return self.store.get(shard.sha256)

    log: list[tuple[str, str]] = []
    stuck, fast = StuckPeer("stuck", origin_store, everything, log), FakePeer("fast", origin_store, everything, log)
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [stuck, fast],
                          config=FetchConfig(max_parallel_peers=2))
    result: dict[str, tuple] = {}
    done = threading.Event()
    threading.Thread(target=lambda: (result.update(out=f.fetch(signed)), done.set()), daemon=True).start()
    try:
        assert done.wait(120), "fetch waited for the stuck holder"
        assert not release.is_set() and [name for name, _ in log].count("stuck") == 1
        _, path = result["out"]
        assert (path / "model.safetensors").read_bytes() == weights
        assert f.stats.duplicates == 1 and f.stats.by_source == {"fast": len(everything)}
    finally:
        release.set()


def test_plain_sources_keep_their_order_and_a_bad_one_is_reported(tmp_path, published, coordinator):
    signed, origin_store, weights = published

    class Corrupting(StoreSource):
        def get(self, manifest, shard):
            return b"\0" * shard.size

    bad, good = Corrupting(origin_store, "bad"), StoreSource(origin_store, "good")
    reports: list[str] = []
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [bad, good],
                          on_bad_shard=lambda src, shard: reports.append(src.name))
    assert f.workers == 1  # seeds only: one shard after another
    _, out = f.fetch(signed)
    n = len(signed.manifest.shards())
    assert (out / "model.safetensors").read_bytes() == weights
    assert reports == ["bad"] * n and f.stats.by_source == {"good": n}

    class Failing(StoreSource):
        def get(self, manifest, shard):
            raise OSError("down")

    f2 = CheckpointFetcher(tmp_path / "node2", coordinator.public_key_hex, [Failing(origin_store), bad])
    with pytest.raises(ManifestError, match="no source had a good copy") as err:
        f2.fetch(signed)
    assert not isinstance(err.value, ShardUnavailable)  # bad bytes and a broken link are faults, not absence
    assert not f2.version_dir(1).exists()


def test_a_shard_no_source_has_fails_the_fetch_as_unavailable(tmp_path, published, coordinator):
    signed, origin_store, _ = published
    gone = signed.manifest.shards()[4].sha256

    class Forgetful(StoreSource):
        def get(self, manifest, shard):
            if shard.sha256 == gone:
                raise ShardNotHeld("404: no such shard")
            return super().get(manifest, shard)

    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [Forgetful(origin_store)])
    with pytest.raises(ShardUnavailable, match=gone[:12]):
        f.fetch(signed)
    assert not f.version_dir(1).exists()


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
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [late_peer, seed],
                          config=FetchConfig(max_parallel_peers=1, poll_s=0.01))
    f.fetch(signed)
    assert shards[0].sha256 not in seed.calls
    assert log == [("peer", shards[0].sha256)]


def test_resume_after_a_killed_download(tmp_path, published, coordinator):
    signed, origin_store, weights = published
    root = tmp_path / "node"
    (tmp_path / "signed.json").write_text(signed.model_dump_json())
    # A separate process fetches (one shard after another, in manifest order); its source hands out four shards
    # and then never answers again, and the process is killed with SIGKILL.
    child = textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(ROOT)!r})
        from swarmrl.transfer.fetcher import CheckpointFetcher
        from swarmrl.protocol.manifest import SignedManifest
        from swarmrl.transfer.store import ShardStore
        from swarmrl.transfer.sources import ShardSource
        class Stalling(ShardSource):
            calls = 0
            def get(self, manifest, shard):
                Stalling.calls += 1
                if Stalling.calls > 4:
                    threading.Event().wait()
                return ShardStore({str(origin_store.root)!r}).get(shard.sha256)
        signed = SignedManifest.model_validate_json(open({str(tmp_path / "signed.json")!r}).read())
        CheckpointFetcher({str(root)!r}, {coordinator.public_key_hex!r}, [Stalling()]).fetch(signed)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        store = ShardStore(root / "shards")

        def stored() -> set[str]:  # whole shards only: a write in progress is a ".part-" file
            return {p.name for p in store.root.glob("??/*") if not p.name.startswith(".part-")}

        wait_for(lambda: len(stored()) >= 4 or proc.poll() is not None, what="four shards")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    held = stored()
    assert held == {s.sha256 for s in signed.manifest.shards()[:4]}
    assert not (root / "v00000001").exists()
    assert list(root.glob(".v00000001-*")), "the killed fetch had begun writing the checkpoint's files"
    # One of the shards on disk has been damaged since: it is fetched again, not written into the files.
    damaged = sorted(held)[0]
    path = store.path(damaged)
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # its first byte changed, whatever it was ("x" was, 1 in 256)

    origin = StoreSource(origin_store)
    f = CheckpointFetcher(root, coordinator.public_key_hex, [origin])
    _, out = f.fetch(signed)
    assert (out / "model.safetensors").read_bytes() == weights
    assert f.stats.shards_reused == len(held) - 1
    # only the missing ones, and the damaged one
    assert set(origin.calls) == {s.sha256 for s in signed.manifest.shards()} - held | {damaged}
    assert not list(root.glob(".v*")), "what the killed fetch left behind is gone"
    assert not list(f.store.root.glob("??/.part-*")), "and so is any shard it was writing"


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
    assert origin.calls == []
    assert not list((tmp_path / "node").glob("v*")) and not list(f.store.root.glob("??/*"))


def _versions(tmp_path: Path, coordinator: Identity, *versions: int) -> tuple[ShardStore, dict[int, SignedManifest]]:
    store = ShardStore(tmp_path / "origin")
    signed = {}
    for v in versions:
        ckpt, _ = make_checkpoint(tmp_path, version=v, size=200_000, seed=v)
        signed[v] = SignedManifest.sign(cut_checkpoint(ckpt, run_id="test", version=v, store=store,
                                                       shard_size=SHARD), coordinator)
    return store, signed


def _on_disk(f: CheckpointFetcher) -> tuple[list[str], set[str]]:
    return sorted(p.name for p in f.root.glob("v*")), {p.name for p in f.store.root.glob("??/*")}


def test_keep_versions_keeps_the_most_recently_fetched_older_versions_included(tmp_path, coordinator):
    store, signed = _versions(tmp_path, coordinator, 1, 2, 3)
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [StoreSource(store)], keep_versions=2)
    for v in (1, 2, 3):  # a node: each version newer than the last
        f.fetch(signed[v])
    dirs, shards = _on_disk(f)
    assert dirs == ["v00000002", "v00000003"]
    assert shards == {x.sha256 for v in (2, 3) for x in signed[v].manifest.shards()}
    # A verifier goes back to an older version: it is fetched, and the least recently fetched one goes.
    manifest, out = f.fetch(signed[1])
    assert manifest.version == 1 and out == f.version_dir(1) and out.exists()
    assert _on_disk(f)[0] == ["v00000001", "v00000003"]
    # A fetcher started later on the same directory counts what it fetches as newer than what it found, and
    # orders what it found by when it was fetched.
    g = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [StoreSource(store)], keep_versions=2)
    g.fetch(signed[2])
    assert _on_disk(g)[0] == ["v00000001", "v00000002"]
    g.remove(2)
    assert _on_disk(g) == (["v00000001"], {x.sha256 for x in signed[1].manifest.shards()})


def test_a_node_fetches_only_versions_newer_than_it_holds(tmp_path, coordinator):
    """Moving forward only is the node's rule; the fetcher fetches whatever it is given (see above)."""
    from swarmrl.node.agent import Node
    from swarmrl.node.config import NodeConfig

    store, signed = _versions(tmp_path, coordinator, 1, 2)
    node = Node(NodeConfig(key_path=tmp_path / "node.key", work_dir=tmp_path / "node", progress=False))
    served = {"latest": 2}
    node.client = SimpleNamespace(info=lambda: SimpleNamespace(current_version=3),  # type: ignore[assignment]
                                  latest_manifest=lambda: signed[served["latest"]])
    origin = StoreSource(store)
    node.fetcher = CheckpointFetcher(tmp_path / "node" / "checkpoints", coordinator.public_key_hex, [origin])
    node.fetch_newer()
    assert node.weights.ready is not None and node.weights.ready[0] == 2
    calls = len(origin.calls)
    served["latest"] = 1  # a coordinator that hands out an older manifest than the node already has
    node.fetch_newer()
    assert node.weights.ready[0] == 2 and len(origin.calls) == calls


def test_versions_in_use_are_never_pruned(tmp_path, coordinator):
    store, signed = _versions(tmp_path, coordinator, 1, 2, 3, 4)
    in_use = {1}
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [StoreSource(store)], keep_versions=2,
                          in_use=lambda: in_use)
    for v in (1, 2, 3, 4):
        f.fetch(signed[v])
    assert _on_disk(f)[0] == ["v00000001", "v00000003", "v00000004"]  # above keep_versions while 1 is in use
    in_use.clear()
    f.fetch(signed[4])
    dirs, shards = _on_disk(f)
    assert dirs == ["v00000003", "v00000004"]
    assert shards == {x.sha256 for v in (3, 4) for x in signed[v].manifest.shards()}


def test_a_node_keeps_the_files_of_the_version_it_is_loading(tmp_path, coordinator):
    """The fetch thread goes on fetching while the generating thread loads (or, for a lease older than them, holds
    back) a ready version: that version's files stay until it is loaded, however many newer ones arrive."""
    from swarmrl.node.agent import Node
    from swarmrl.node.config import NodeConfig

    store, signed = _versions(tmp_path, coordinator, 1, 2, 3, 4, 5)
    node = Node(NodeConfig(key_path=tmp_path / "node.key", work_dir=tmp_path / "node", progress=False))
    served = {"latest": 1}
    node.client = SimpleNamespace(  # type: ignore[assignment]
        info=lambda: SimpleNamespace(current_version=served["latest"]),
        latest_manifest=lambda: signed[served["latest"]])
    node.fetcher = CheckpointFetcher(tmp_path / "node" / "checkpoints", coordinator.public_key_hex,
                                     [StoreSource(store)], keep_versions=2, in_use=node.weights.in_use)
    node.stats.held_version = 1
    node.fetcher.fetch(signed[1])
    served["latest"] = 2
    node.fetch_newer()
    with node.weights.take() as ready:  # the generating thread loads version 2 ...
        assert ready is not None and ready[0] == 2
        for newer in (3, 4):  # ... while the fetch thread fetches two newer ones
            served["latest"] = newer
            node.fetch_newer()
        assert ready[1].exists() and (ready[1] / "model.safetensors").exists()
        node.stats.held_version = 2
    assert node.weights.ready is not None and node.weights.ready[0] == 4
    assert node.weights.versions() == {4}
    served["latest"] = 5
    node.fetch_newer()  # 2 is held; 4, ready while 5 was fetched, goes at the next fetch
    assert _on_disk(node.fetcher)[0] == ["v00000002", "v00000004", "v00000005"]
    loaded: list[Path] = []
    node.engine = SimpleNamespace(temperature=1.0, load=loaded.append, close=lambda: None)  # type: ignore[assignment]
    node.load_ready_weights(1.0)
    assert loaded == [node.fetcher.version_dir(5)] and node.stats.held_version == 5
