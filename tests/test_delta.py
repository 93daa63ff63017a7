"""Delta checkpoints: the codec is lossless, a payload is trusted for nothing (what it rebuilds must match the signed
tensor hashes), and through a real coordinator on loopback the trainer's publisher sends deltas between full
checkpoints while a node that missed versions catches up from the nearest full one."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from swarmrl.protocol.manifest import CheckpointManifest, DeltaSpec, ManifestError, SignedManifest
from swarmrl.trainer.publisher import Publisher, published_weights
from swarmrl.transfer import delta
from swarmrl.transfer.connect import open_fetcher
from tests.support.coordinator import refused

pytestmark = pytest.mark.timeout(300)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(300, 64, generator=gen) * 0.02,
            "layer.0.weight": torch.randn(64, 64, generator=gen) * 0.02,
            "layer.0.bias": torch.zeros(64),
            "steps": torch.arange(5, dtype=torch.int64)}


def _step(w: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """An Adam-like update: every floating weight moves by about `lr`."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v - lr * torch.sign(torch.randn(v.shape, generator=gen)) if v.is_floating_point() else v + 1
            for k, v in w.items()}


def _file(w: dict[str, torch.Tensor], dtype: torch.dtype) -> bytes:
    return save({k: v.to(dtype) if v.is_floating_point() else v for k, v in w.items()}, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lr", [1e-6, 1e-3])
def test_a_delta_rebuilds_the_target_bit_for_bit(dtype, lr):
    base_w = _tensors()
    target_w = _step(base_w, lr, seed=1)
    target_w["layer.1.weight"] = torch.ones(3, 3)  # new in the target: sent as it is
    target_w["layer.0.bias"] = torch.ones(32)  # reshaped: sent as it is
    del target_w["steps"]  # gone: nothing to send
    base, target = _file(base_w, dtype), _file(target_w, dtype)
    payload = delta.encode(base, target)
    assert delta.apply(base, payload, len(target)) == target
    delta.check(target, delta.describe("model.safetensors", "model.safetensors.delta", target))
    assert len(payload) < len(target)
    if lr == 1e-6 and dtype == torch.bfloat16:  # most bf16 weights keep every bit at RL learning rates
        assert len(payload) < len(target) / 10


def _delta_dirs(tmp_path: Path, base: bytes, target: bytes, payload: bytes) -> tuple[Path, Path, DeltaSpec]:
    base_dir, staged = tmp_path / "base", tmp_path / "staged"
    base_dir.mkdir(parents=True)
    staged.mkdir(parents=True)
    (base_dir / "model.safetensors").write_bytes(base)
    (staged / "model.safetensors.delta").write_bytes(payload)
    spec = DeltaSpec(base_version=1, files=[delta.describe("model.safetensors", "model.safetensors.delta", target)])
    return base_dir, staged, spec


@pytest.mark.parametrize("layout", ["same", "other"])
def test_rebuild_writes_the_signed_file_and_leaves_the_base_as_it_was(tmp_path, layout):
    """Same layout as the base: rebuilt in place in a copy of the base (memory-mapped); another layout (a tensor
    added, one reshaped): rebuilt in memory. Either way the file is the target bit for bit, and the base, which an
    engine may have loaded, keeps every byte."""
    base_w = _tensors()
    target_w = _step(base_w, 1e-6, seed=3)
    if layout == "other":
        target_w["layer.1.weight"] = torch.ones(3, 3)
        target_w["layer.0.bias"] = torch.ones(32)
    base, target = _file(base_w, torch.bfloat16), _file(target_w, torch.bfloat16)
    payload = delta.encode(base, target)
    base_dir, staged, spec = _delta_dirs(tmp_path, base, target, payload)
    in_place = tmp_path / "probe.safetensors"
    in_place.write_bytes(base)
    mapped = delta.apply_in_place(in_place, payload, len(target))
    assert (mapped is not None) == (layout == "same")
    if mapped is not None:
        mapped.close()
        assert in_place.read_bytes() == target
    out = delta.rebuild(base_dir, staged, spec, tmp_path / "out")
    assert (out / "model.safetensors").read_bytes() == target
    assert (base_dir / "model.safetensors").read_bytes() == base
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_a_payload_that_does_not_rebuild_the_signed_tensors_is_refused(tmp_path):
    """The payload's shards pass their hash checks (the manifest names them), but what it rebuilds is not the
    signed target: refused, and nothing is left behind."""
    base_w = _tensors()
    honest = _file(_step(base_w, 1e-3, seed=1), torch.float32)
    forged_w = _step(base_w, 1e-3, seed=1)
    forged_w["layer.0.weight"][3, 7] += 1.0  # one weight changed
    base = _file(base_w, torch.float32)
    base_dir, staged, spec = _delta_dirs(tmp_path, base, honest, delta.encode(base, _file(forged_w, torch.float32)))
    with pytest.raises(ManifestError, match="tensor 'layer.0.weight' does not match its signed hash"):
        delta.rebuild(base_dir, staged, spec, tmp_path / "out")
    assert not staged.exists() and not (tmp_path / "out").exists()
    assert (base_dir / "model.safetensors").read_bytes() == base  # the forged bits went into a copy only

    # Against another base (a node holding something else): the same refusal, never wrong weights.
    other = _file(_tensors(seed=5), torch.float32)
    base_dir, staged, spec = _delta_dirs(tmp_path / "other", other, honest, delta.encode(base, honest))
    with pytest.raises(ManifestError, match="does not match its signed hash"):
        delta.rebuild(base_dir, staged, spec, tmp_path / "other" / "out")


def test_a_payload_with_another_header_is_refused_even_with_every_tensor_right(tmp_path):
    """Same tensors, other header bytes (metadata): every tensor hash matches, the signed header hash does not."""
    base_w = _tensors()
    target_w = _step(base_w, 1e-3, seed=1)
    honest, base = _file(target_w, torch.float32), _file(base_w, torch.float32)
    forged = save(target_w, metadata={"format": "pt", "note": "not what was signed"})
    assert delta.tensor_hashes(forged) == delta.tensor_hashes(honest)
    base_dir, staged, spec = _delta_dirs(tmp_path, base, honest, delta.encode(base, forged))
    spec.files[0].size = len(forged)
    with pytest.raises(ManifestError, match="header does not match"):
        delta.rebuild(base_dir, staged, spec, tmp_path / "out")


def test_a_damaged_payload_is_a_manifest_error_never_a_crash(tmp_path):
    base_w = _tensors()
    base, target = _file(base_w, torch.bfloat16), _file(_step(base_w, 1e-4, seed=2), torch.bfloat16)
    payload = delta.encode(base, target)
    rng = random.Random(7)
    damaged = [payload[:n] for n in (0, 8, 20, len(payload) // 2, len(payload) - 1)]
    for _ in range(60):
        b = bytearray(payload)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        damaged.append(bytes(b))
    for n, bad in enumerate(damaged):
        if bad == payload:
            continue
        base_dir, staged, spec = _delta_dirs(tmp_path / f"d{n}", base, target, bad)
        with pytest.raises(ManifestError):
            delta.rebuild(base_dir, staged, spec, tmp_path / f"d{n}" / "out")


class Trace:
    """Checkpoint directories a trainer would write, one per version: fp32 weights moved by Adam-like steps."""

    def __init__(self, root: Path):
        self.root, self.weights, self.n = root, _tensors(), 0

    def next(self) -> Path:
        self.n += 1
        self.weights = _step(self.weights, 1e-4, seed=self.n)
        out = self.root / f"ckpt-{self.n}"
        out.mkdir(parents=True)
        save_file(self.weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({"model_type": "test"}))
        return out


def test_a_node_that_missed_versions_catches_up_from_the_nearest_full_checkpoint(run_factory, tmp_path):
    run = run_factory(keep_versions=1, max_staleness=0)
    publisher = Publisher(run.op, run.cfg.run.run_id, background=False, full_every=3, dtype="bfloat16",
                          work_dir=tmp_path / "trainer", shard_size=4096)
    trace = Trace(tmp_path / "trace")
    late = run.node("late")
    late_fetcher, _ = open_fetcher(tmp_path / "late", run.key.public_key_hex, late, None, p2p=None)
    steady = run.node("steady")
    steady_fetcher, _ = open_fetcher(tmp_path / "steady", run.key.public_key_hex, steady, None, p2p=None)

    ckpts, records = {}, {}
    for version in range(1, 7):
        ckpts[version] = trace.next()
        publisher.submit(ckpts[version], version)
        records[version] = publisher.last
        assert records[version].error is None
        if version == 1:
            late_fetcher.fetch(late.latest_manifest())  # then misses 2..5
        if version <= 5:
            steady_fetcher.fetch(steady.latest_manifest())
    bases = {v: (m.delta.base_version if m.delta else None)
             for v in range(1, 7) if (m := run.op.manifest(v).manifest)}
    assert bases == {1: None, 2: 1, 3: 2, 4: None, 5: 4, 6: 5}  # a full checkpoint every 3 versions
    assert all(records[v].delta == (bases[v] is not None) for v in bases)
    assert all(records[v].sent_bytes < records[v].full_bytes / 3 for v in bases if bases[v] is not None)

    # The node that holds 5 fetches only 6's payload; the one that holds 1 walks back to the full version 4.
    before = steady_fetcher.stats.bytes_fetched
    _, steady_path = steady_fetcher.fetch(steady.latest_manifest())
    assert steady_fetcher.stats.bytes_fetched - before == records[6].sent_bytes - len(b'{"model_type": "test"}')
    asked: list[int] = []
    late_fetcher.manifests = lambda v: (asked.append(v), late.manifest(v))[1]
    manifest, late_path = late_fetcher.fetch(late.latest_manifest())
    assert manifest.version == 6 and asked == [5, 4]
    published = published_weights(ckpts[6], "bfloat16")["model.safetensors"]
    for path in (late_path, steady_path):
        assert (path / "model.safetensors").read_bytes() == published
        assert not (path / "model.safetensors.delta").exists()
        assert (path / "config.json").read_bytes() == (ckpts[6] / "config.json").read_bytes()
    assert torch.equal(load_file(str(late_path / "model.safetensors"))["embed.weight"],
                       trace.weights["embed.weight"].to(torch.bfloat16))


def test_the_coordinator_refuses_a_delta_of_a_version_it_never_published(run, tmp_path):
    trace = Trace(tmp_path / "trace")
    publisher = Publisher(run.op, run.cfg.run.run_id, background=False, full_every=5, work_dir=tmp_path / "t",
                          shard_size=4096)
    publisher.submit(trace.next(), 1)
    publisher.submit(trace.next(), 2)
    signed: SignedManifest = run.op.manifest(2)
    assert signed.manifest.delta is not None and signed.manifest.delta.base_version == 1
    forged = CheckpointManifest.model_validate({**signed.manifest.model_dump(), "version": 9,
                                                "delta": {**signed.manifest.delta.model_dump(), "base_version": 7}})
    refused(lambda: run.op.publish(forged), 422, "not published")


def test_a_publisher_sends_the_full_checkpoint_when_its_delta_is_refused(run, tmp_path):
    """The coordinator does not have the publisher's base (e.g. a new database): the delta is refused, and the
    same version goes out in full."""
    trace = Trace(tmp_path / "trace")
    publisher = Publisher(run.op, run.cfg.run.run_id, background=False, full_every=5, work_dir=tmp_path / "t",
                          shard_size=4096)
    publisher.submit(trace.next(), 1)
    assert publisher.last is not None and not publisher.last.delta
    assert publisher._base is not None
    publisher._base = (7, publisher._base[1])  # what it published last, as it believes: version 7
    publisher.published_version = 7
    publisher.submit(trace.next(), 8)
    assert publisher.last.version == 8 and publisher.last.error is None and not publisher.last.delta
    assert run.op.manifest(8).manifest.delta is None
    assert not list((tmp_path / "t").glob(".publish-*"))  # staging removed
