"""Delta checkpoints through the real transfer paths: a delta's shards cross the libp2p swarm exactly like a full
checkpoint's (a tampered one is refused and its peer banned), and a verifier that rebuilds versions from deltas
accepts an honest node's groups (real coordinator, verifier logic and torch engine on loopback)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import CheckpointManifest, SignedManifest
from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool, perturb_checkpoint
from swarmrl.testing.waiting import wait_for
from swarmrl.trainer.publisher import Publisher, published_weights, stage
from swarmrl.transfer.fetcher import CheckpointFetcher
from swarmrl.transfer.store import ShardStore, cut_checkpoint
from tests.support.transfer import SHARD, LyingStore, StoreSource

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def swarm() -> Iterator[Callable[..., object]]:
    """Start SwarmPeers on 127.0.0.1; all are closed at the end of the test."""
    from swarmrl.transfer.p2p.config import P2PConfig
    from swarmrl.transfer.p2p.swarm import SwarmPeer

    peers: list[SwarmPeer] = []

    def start(initial_peers: list[str] | None = None) -> SwarmPeer:
        cfg = P2PConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], poll_interval_s=0.1, announce_delay_s=0.02,
                        peer_timeout_s=10.0)
        peer = SwarmPeer(cfg, "test", initial_peers=initial_peers or []).start()
        peers.append(peer)
        return peer

    yield start
    for p in peers:
        p.close()


def _checkpoint(out: Path, weights: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({"model_type": "test"}))
    return out


def test_a_tampered_delta_shard_is_refused_and_its_peer_banned(tmp_path, swarm):
    coordinator = Identity.generate()
    origin_store = ShardStore(tmp_path / "origin")
    gen = torch.Generator().manual_seed(0)
    w1 = {"w": torch.randn(400, 400, generator=gen) * 0.02}
    w2 = {"w": w1["w"] - 1e-3 * torch.sign(torch.randn(400, 400, generator=gen))}
    ck1, ck2 = _checkpoint(tmp_path / "ck1", w1), _checkpoint(tmp_path / "ck2", w2)
    # Version 1 in full, version 2 as a delta of it, staged and cut as the trainer's publisher does.
    m1 = cut_checkpoint(ck1, run_id="test", version=1, store=origin_store, shard_size=SHARD)
    staged = tmp_path / "staged"
    spec = stage(ck2, staged, published_weights(ck2, "float32"), (1, published_weights(ck1, "float32")))
    cut = cut_checkpoint(staged, run_id="test", version=2, store=origin_store, shard_size=SHARD)
    m2 = CheckpointManifest.model_validate({**cut.model_dump(), "delta": spec.model_dump()})
    signed = {1: SignedManifest.sign(m1, coordinator), 2: SignedManifest.sign(m2, coordinator)}
    assert len(m2.shards()) > 3 and m2.total_bytes < m1.total_bytes

    honest = swarm()
    liar = swarm(honest.maddrs)
    lies = LyingStore(m2)
    liar.serve(m2, lies)  # type: ignore[arg-type]  # announces every shard of the delta
    node = swarm(honest.maddrs)
    wait_for(lambda: liar.peer_id in node.holders(m2, wait=True), what="the liar's announcement")
    from swarmrl.transfer.p2p.sources import SwarmSource

    origin = StoreSource(origin_store)
    bad_reports: list[tuple[str, str]] = []
    f = CheckpointFetcher(tmp_path / "node", coordinator.public_key_hex, [SwarmSource(node), origin],
                          on_bad_shard=lambda src, shard: bad_reports.append((src.name, shard.sha256)),
                          manifests=signed.get)
    manifest, out = f.fetch(signed[2])  # holds nothing: version 1 first (its manifest asked for), then the delta
    wait_for(lambda: f.stats.bad_shards, what="the liar's bytes checked")

    assert manifest.delta is not None
    assert (out / "model.safetensors").read_bytes() == (ck2 / "model.safetensors").read_bytes()
    assert f.stats.bad_shards == 1 and len(bad_reports) == 1 and lies.served == 1
    assert bad_reports[0][0].endswith(liar.peer_id[-8:])
    assert liar.peer_id in node.banned
    bad_sha = bad_reports[0][1]
    assert bad_sha in {s.sha256 for s in m2.shards()} and bad_sha in origin.calls  # taken from the origin instead
    assert f.store.get(bad_sha) == origin_store.get(bad_sha)


def test_a_verifier_that_rebuilds_from_deltas_accepts_honest_groups(tmp_path):
    v0 = make_checkpoint(tmp_path / "ck0")
    with open_pool(tmp_path / "pool", v0, max_staleness=2) as pool:
        publisher = Publisher(pool.op, pool.cfg.run.run_id, background=False, full_every=10,
                              work_dir=tmp_path / "trainer")
        ckpts = {0: v0}
        for v in (1, 2, 3):
            ckpts[v] = perturb_checkpoint(ckpts[v - 1], tmp_path / f"ck{v}", 1e-3, seed=v)
        publisher.submit(ckpts[1], 1)  # the publisher's first: in full
        node = pool.node(name="honest")
        node.step()
        assert pool.verify_all() > 0  # the verifier holds version 1
        publisher.submit(ckpts[2], 2)
        publisher.submit(ckpts[3], 3)
        assert [pool.op.manifest(v).manifest.delta.base_version for v in (2, 3)] == [1, 2]

        node.sync()  # holds 1: rebuilds 2, then 3
        node.step()  # the lease that came with its last submission is for version 1: generated with 1
        node.step()  # a new lease, for version 3
        assert node.stats.held_version == 3
        assert pool.verify_all() > 0  # the verifier rebuilds 2 from the 1 it holds, then 3
        groups = pool.groups(node.node_id)
        assert groups and [g["reason"] for g in groups if g["status"] != "accepted"] == []
        models = pool.verifier.models
        assert models is not None
        v3 = models.fetcher.version_dir(3) / "model.safetensors"
        assert v3.read_bytes() == (ckpts[3] / "model.safetensors").read_bytes()
        assert models.fetcher.stats.shards_fetched > 0
