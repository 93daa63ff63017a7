"""The verifier's policy versions come through the same CheckpointFetcher as a node's: older versions than the newest
it holds, resume from disk, and the cache's own rules (keep N loaded, reuse a model in place, VersionUnavailable)
against a real coordinator on loopback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool, perturb_checkpoint
from swarmrl.verifier.models import ModelCache, VersionUnavailable

pytestmark = pytest.mark.timeout(300)


def _next_version(v0: Path, out: Path, seed: int) -> Path:
    """What a trainer publishes next: new weights, the other files unchanged."""
    shutil.copytree(v0, out)
    shutil.copy(perturb_checkpoint(v0, out.with_name(out.name + "-p"), 0.01, seed=seed) / "model.safetensors",
                out / "model.safetensors")
    return out


def _weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_model_cache_fetches_any_version_resumes_from_disk_and_evicts_the_least_recently_used(tmp_path):
    from swarmrl.verifier.models import load_policy

    v0 = make_checkpoint(tmp_path / "ck0")
    v1, v2 = _next_version(v0, tmp_path / "ck1", 1), _next_version(v0, tmp_path / "ck2", 2)
    with open_pool(tmp_path / "pool", v0) as pool:
        pool.publish(v1)
        pool.publish(v2)
        work = tmp_path / "verifier"
        cache = ModelCache(pool.op, pool.coordinator_key, work, keep=2)
        try:
            p2 = cache.get(2)
            model2 = p2.model
            p0 = cache.get(0)  # older than the newest one held: fetched all the same
            assert p0.version == 0 and _weights_equal(p0.model, load_policy(v0, 0).model)
            assert cache.get(2) is p2  # loaded: no fetch
            fetched = cache.fetcher.stats.shards_fetched
            p1 = cache.get(1)  # evicts 0, the least recently used, and takes its model over in place
            assert p1.model is p0.model and p1.version == 1 and _weights_equal(p1.model, load_policy(v1, 1).model)
            assert model2 is p2.model and cache.get(2).model is model2
            assert sorted(p.name for p in work.glob("v*")) == ["v00000001", "v00000002"]  # 0's files removed
            assert cache.fetcher.stats.shards_fetched > fetched
            with pytest.raises(VersionUnavailable, match="no manifest"):
                cache.get(9)
        finally:
            cache.close()

        # A verifier started again on the same directory loads what is on disk without fetching a shard.
        again = ModelCache(pool.op, pool.coordinator_key, work, keep=2)
        assert again.get(1).version == 1 and again.get(2).version == 2
        assert again.fetcher.stats.shards_fetched == 0 and again.fetcher.stats.shards_reused == 0

        # The coordinator no longer has a shard of version 0 (its own keep_versions): VersionUnavailable, and
        # nothing half-made is left behind.
        m0, m1, m2 = (pool.op.manifest(v).manifest for v in (0, 1, 2))
        only_v0 = {s.sha256 for s in m0.shards()} - {s.sha256 for m in (m1, m2) for s in m.shards()}
        assert only_v0
        shards_dir = pool.cfg.data_dir / "shards"
        for sha in only_v0:
            (shards_dir / sha[:2] / sha).unlink()
        with pytest.raises(VersionUnavailable, match="version 0"):
            again.get(0)
        assert not (work / "v00000000").exists()


def test_a_version_the_verifier_cannot_load_is_unavailable_not_a_crash(tmp_path):
    """A model the trusted side cannot replay (here NaN logits: its head does not reproduce its forward) is the
    trusted side's limit: VersionUnavailable, so its groups get 'cannot verify' and nobody a ban."""
    from safetensors.torch import load_file, save_file

    v0 = make_checkpoint(tmp_path / "ck0")
    bad = _next_version(v0, tmp_path / "ck1", 1)
    weights = load_file(str(bad / "model.safetensors"))
    name = next(k for k in weights if k.endswith("norm.weight") and "layers" not in k)
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with open_pool(tmp_path / "pool", v0) as pool:
        pool.publish(bad)
        cache = ModelCache(pool.op, pool.coordinator_key, tmp_path / "verifier", keep=2)
        try:
            assert cache.get(0).version == 0
            with pytest.raises(VersionUnavailable, match="version 1: this verifier cannot load it"):
                cache.get(1)
        finally:
            cache.close()
