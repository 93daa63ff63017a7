"""The checkpoint swarm wired into the pool: the coordinator seeds the DHT and names it in RunInfo, and
nodes that join the pool fetch published checkpoints from each other, every shard verified."""

from __future__ import annotations

import json
import secrets
import threading

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.server import running_server
from swarmrl.node.agent import Node
from swarmrl.node.config import NodeConfig
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.transfer.store import ShardStore, cut_checkpoint

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_nodes_share_a_published_checkpoint_through_the_coordinators_seed(tmp_path):
    trainer = Identity.generate()
    cfg = CoordinatorConfig(data_dir=tmp_path / "coord", run={"run_id": "p2p-run"},
                            operator_keys=[trainer.public_key_hex], p2p={"host_maddrs": LOOPBACK, "seed_grace_s": 0.5})
    coordinator_key = cfg.load_identity()
    with running_server(cfg, coordinator_key) as url:
        info = CoordinatorClient(url).info()
        assert info.dht_peers and all("/p2p/" in a for a in info.dht_peers)

        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps({"v": 1}))
        weights = secrets.token_bytes(3 * 1024 * 1024)
        (ckpt / "model.safetensors").write_bytes(weights)
        local = ShardStore(tmp_path / "trainer-shards")
        manifest = cut_checkpoint(ckpt, run_id="p2p-run", version=0, store=local, shard_size=128 * 1024)
        op = CoordinatorClient(url, trainer)
        for ref in manifest.shards():
            op.upload_shard(ref.sha256, local.get(ref.sha256))
        op.publish(manifest)

        nodes = [Node(NodeConfig(coordinator_url=url, coordinator_key=coordinator_key.public_key_hex,
                                 key_path=tmp_path / f"n{i}.key", work_dir=tmp_path / f"n{i}",
                                 p2p={"host_maddrs": LOOPBACK, "poll_interval_s": 0.1, "announce_delay_s": 0.02}))
                 for i in range(3)]
        errors: list[BaseException] = []

        def join_and_fetch(node: Node) -> None:
            # What Node.run does before generating: register, join the swarm, fetch the newest checkpoint.
            try:
                node.join()
                node.fetch_newer()
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=join_and_fetch, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        try:
            assert not errors, errors
            by_kind: dict[str, int] = {}
            for n in nodes:
                assert n.weights.ready is not None and n.weights.ready[0] == 0
                assert (n.weights.ready[1] / "model.safetensors").read_bytes() == weights
                assert n.fetcher is not None and n.fetcher.stats.bad_shards == 0
                for k, v in n.fetcher.stats.by_source.items():
                    by_kind[k.split(":")[0]] = by_kind.get(k.split(":")[0], 0) + v
            assert by_kind.get("peer", 0) > 0, by_kind  # nodes served each other
            assert by_kind.get("seed", 0) > 0, by_kind  # the coordinator's seed peer took part
        finally:
            for n in nodes:
                if n.swarm is not None:
                    n.swarm.close()


def test_the_trainer_cuts_checkpoints_into_shards_of_the_size_it_is_given(tmp_path):
    from swarmrl.protocol.manifest import SignedManifest
    from swarmrl.trainer.publisher import publish_checkpoint

    coordinator = Identity.generate()
    uploads: dict[str, bytes] = {}

    class Client:
        def upload_shard(self, sha256: str, data: bytes) -> None:
            uploads[sha256] = data

        def publish(self, manifest):  # what the coordinator does: sign what it was given
            return SignedManifest.sign(manifest, coordinator)

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(secrets.token_bytes(1_000_000))
    signed = publish_checkpoint(Client(), ckpt, "run", 3, shard_size=256 * 1024)
    sizes = [s.size for s in signed.manifest.shards()]
    assert signed.manifest.shard_size == 256 * 1024
    assert sizes == [256 * 1024] * 3 + [1_000_000 - 3 * 256 * 1024]
    assert sorted(uploads) == sorted(s.sha256 for s in signed.manifest.shards())


def test_a_verifier_with_p2p_takes_policy_versions_from_the_swarm(tmp_path):
    from swarmrl.testing.byzantine.harness import make_checkpoint
    from swarmrl.transfer.p2p.config import P2PConfig
    from swarmrl.verifier.config import VerifierConfig
    from swarmrl.verifier.models import ModelCache

    trainer = Identity.generate()
    cfg = CoordinatorConfig(data_dir=tmp_path / "coord", run={"run_id": "p2p-run"},
                            operator_keys=[trainer.public_key_hex], p2p={"host_maddrs": LOOPBACK})
    coordinator_key = cfg.load_identity()
    ckpt = make_checkpoint(tmp_path / "ckpt")
    with running_server(cfg, coordinator_key) as url:
        local = ShardStore(tmp_path / "trainer-shards")
        manifest = cut_checkpoint(ckpt, run_id="p2p-run", version=0, store=local, shard_size=256 * 1024)
        op = CoordinatorClient(url, trainer)
        for ref in manifest.shards():
            op.upload_shard(ref.sha256, local.get(ref.sha256))
        op.publish(manifest)

        vcfg = VerifierConfig(coordinator_url=url, work_dir=tmp_path / "verifier",
                              p2p={"host_maddrs": LOOPBACK, "poll_interval_s": 0.1})
        cache = ModelCache(op, coordinator_key.public_key_hex, vcfg.work_dir, keep=2, p2p=vcfg.p2p)
        try:
            assert cache.swarm is not None  # joined through the pool's RunInfo.dht_peers
            policy = cache.get(0)
            assert policy.version == 0
            by_source = cache.fetcher.stats.by_source
            assert sum(v for k, v in by_source.items() if k.startswith("seed:")) > 0, by_source
            assert cache.fetcher.stats.shards_fetched == len(manifest.shards())
        finally:
            cache.close()
    assert ModelCache(op, coordinator_key.public_key_hex, tmp_path / "v2", p2p=None).swarm is None
    assert VerifierConfig().p2p is None and isinstance(vcfg.p2p, P2PConfig)
