"""Identities, signed envelopes, manifests and shards: the parts every trust decision rests on."""

import json
import os
import random
import threading

import pytest
from pydantic import BaseModel, ValidationError

from swarmrl.protocol.identity import Identity, IdentityError, node_id_from_public_key
from swarmrl.protocol.manifest import CheckpointManifest, ManifestError, SignedManifest
from swarmrl.protocol.messages import RolloutSubmission
from swarmrl.protocol.signing import SignatureError, canonical_json, parse_header, sign, verify, verify_signed
from swarmrl.runtime.config import deep_update, dump_toml, load_config
from swarmrl.transfer.store import CheckpointAssembly, ShardStore, assemble_checkpoint, cut_checkpoint


def test_identity_roundtrip_and_permissions(tmp_path):
    ident = Identity.generate()
    path = tmp_path / "k" / "node.key"
    ident.save(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = Identity.load(path)
    assert again.public_key_hex == ident.public_key_hex
    assert again.node_id == node_id_from_public_key(ident.public_key_hex) != Identity.generate().node_id
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="readable by others"):
        Identity.load(path)
    path.write_text("garbage")
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError):
        Identity.load(path)


POOL = "run/" + "ab" * 32


def _submission() -> dict:
    return {"lease_id": "L1", "policy_version": 3, "gen_seconds": 0.25,
            "groups": [{"prompt_id": "p", "prompt_ids": [1, 2], "rollouts": [
                {"seed": 7, "completion_ids": [4, 2], "logprobs": [-0.1, -1e-7], "finish_reason": "stop"}]}]}


def test_a_signature_survives_the_wire():
    ident = Identity.generate()
    body = RolloutSubmission.model_validate(_submission()).model_dump_json().encode()
    sig = sign(ident, "submit", POOL, body)
    received = parse_header(sig.header())
    verify_signed(received, body, kind="submit", pool=POOL)  # does not raise
    assert received.signer_id == ident.node_id


@pytest.mark.parametrize("attack", ["body", "kind", "pool", "key", "nonce", "ts", "digest", "sig", "version"])
def test_tampered_signatures_are_refused(attack):
    ident = Identity.generate()
    body = json.dumps(_submission()).encode()
    sig = json.loads(sign(ident, "submit", POOL, body).header())
    if attack == "body":
        body = body.replace(b"-0.1", b"-0.2")
    elif attack == "kind":
        sig["kind"] = "lease"
    elif attack == "pool":  # replayed into another pool (another run id, or the same run under another key)
        sig["pool"] = "run/" + "cd" * 32
    elif attack == "key":  # claim someone else's identity with our signature
        sig["key"] = Identity.generate().public_key_hex
    elif attack == "nonce":
        sig["nonce"] = "0" * 32
    elif attack == "ts":
        sig["ts"] += 1
    elif attack == "digest":
        sig["body"] = "0" * 64
    elif attack == "version":
        sig["v"] = "swarmrl/1"
    else:
        raw = bytearray(bytes.fromhex(sig["sig"]))
        raw[5] ^= 1
        sig["sig"] = raw.hex()
    received = parse_header(json.dumps(sig))
    with pytest.raises(SignatureError):
        verify_signed(received, body, kind="submit", pool=POOL)


def test_stale_and_future_signatures_are_refused_and_timeless_ones_need_no_clock():
    sig = sign(Identity.generate(), "lease", POOL, b"{}")
    verify(sig, kind="lease", pool=POOL, now=sig.ts + 10)
    with pytest.raises(SignatureError, match="stale or future"):
        verify(sig, kind="lease", pool=POOL, now=sig.ts + 1000)
    with pytest.raises(SignatureError, match="stale or future"):
        verify(sig, kind="lease", pool=POOL, now=sig.ts - 1000)
    verify(sig, kind="lease", pool=POOL, now=sig.ts + 1e6, max_skew_s=None)


def test_malformed_and_missing_headers_are_refused_unparsed():
    with pytest.raises(SignatureError, match="missing"):
        parse_header(None)
    with pytest.raises(SignatureError, match="longer than"):
        parse_header("{" + " " * 5000 + "}")
    with pytest.raises(SignatureError, match="malformed"):
        parse_header('{"kind": "x"}')


def test_non_finite_numbers_cannot_be_signed_canonically():
    with pytest.raises(ValueError):
        canonical_json({"v": float("nan")})


def test_the_run_description_and_leases_carry_the_coordinators_signature():
    from swarmrl.protocol.leases import Lease, LeasedPrompt
    from swarmrl.protocol.run import RunInfo, RunSpec, SamplingSpec

    coordinator, mallory = Identity.generate(), Identity.generate()
    info = RunInfo.signed(RunSpec(run_id="r"), coordinator, current_version=3)
    again = RunInfo.model_validate_json(info.model_dump_json())
    again.verify(coordinator.public_key_hex)
    assert again.spec_signature == RunInfo.signed(RunSpec(run_id="r"), coordinator, 4).spec_signature  # signed once
    hotter = again.model_copy(update={"spec": again.spec.model_copy(update={
        "sampling": SamplingSpec(temperature=2.0)})})
    with pytest.raises(SignatureError):
        hotter.verify(coordinator.public_key_hex)
    with pytest.raises(SignatureError):  # mallory's own, valid signature: not the pinned key
        RunInfo.signed(RunSpec(run_id="r"), mallory, 3).verify(coordinator.public_key_hex)

    pool = info.pool
    lease = Lease.issue(coordinator, pool, lease_id="L", node_id="n" * 40, policy_version=3, expires_at=123.25,
                        sampling=SamplingSpec(), prompts=[LeasedPrompt(prompt_id=f"L.{i}", text=f"{i}+{i}=",
                                                                       seeds=[i, i + 1]) for i in range(3)])
    wire = Lease.model_validate_json(lease.model_dump_json())
    wire.verify(coordinator.public_key_hex, pool)
    excerpt = wire.excerpt("L.1")
    excerpt.verify(coordinator.public_key_hex, pool)
    for changed in (wire.model_copy(update={"sampling": SamplingSpec(max_tokens=9)}),
                    wire.model_copy(update={"prompts": [wire.prompts[0].model_copy(update={"text": "9+9="}),
                                                        *wire.prompts[1:]]}),
                    wire.model_copy(update={"node_id": "m" * 40})):
        with pytest.raises(SignatureError):
            changed.verify(coordinator.public_key_hex, pool)
    with pytest.raises(SignatureError):
        wire.verify(coordinator.public_key_hex, "other/" + coordinator.public_key_hex)
    with pytest.raises(SignatureError):
        excerpt.model_copy(update={"prompt": excerpt.prompt.model_copy(update={"seeds": [7, 7]})}).verify(
            coordinator.public_key_hex, pool)


def _checkpoint(tmp_path, size=10_000):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    rng = random.Random(0)
    (d / "model.safetensors").write_bytes(bytes(rng.getrandbits(8) for _ in range(size)))
    (d / "config.json").write_text('{"a": 1}')
    (d / "sub" / "tokenizer.json").write_text('{"t": 2}')
    return d


def test_cut_and_assemble_roundtrip(tmp_path):
    d = _checkpoint(tmp_path)
    store = ShardStore(tmp_path / "store")
    m = cut_checkpoint(d, run_id="r", version=1, store=store, shard_size=4096)
    weights = next(f for f in m.files if f.path == "model.safetensors")
    assert [s.size for s in weights.shards] == [4096, 4096, 1808]
    out = assemble_checkpoint(m, store.get, tmp_path / "out")
    for f in m.files:
        assert (out / f.path).read_bytes() == (d / f.path).read_bytes()


def test_corrupt_shard_is_refused_everywhere(tmp_path):
    d = _checkpoint(tmp_path)
    store = ShardStore(tmp_path / "store")
    m = cut_checkpoint(d, run_id="r", version=1, store=store, shard_size=4096)
    shard = m.files[0].shards[0] if m.files[0].shards else m.shards()[0]
    good = store.get(shard.sha256)
    bad = bytes([good[0] ^ 1]) + good[1:]
    with pytest.raises(ManifestError, match="hash mismatch"):
        ShardStore(tmp_path / "other").put(shard.sha256, bad)
    # A source that lies at assembly time is caught too, and nothing is left behind.
    def lying_get(h: str) -> bytes:
        return bad if h == shard.sha256 else store.get(h)

    with pytest.raises(ManifestError, match="corrupt"):
        assemble_checkpoint(m, lying_get, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out-*"))
    assert assemble_checkpoint(m, store.get, tmp_path / "out").exists()


def test_assembly_takes_shards_in_any_order_from_many_threads(tmp_path):
    d = _checkpoint(tmp_path)
    store = ShardStore(tmp_path / "store")
    m = cut_checkpoint(d, run_id="r", version=1, store=store, shard_size=1024)
    refs = m.shards()
    random.Random(0).shuffle(refs)
    assembly = CheckpointAssembly(m, tmp_path / "out")
    for ref in refs[:-1]:
        assembly.write(ref.sha256, store.get(ref.sha256), verified=True)
    with pytest.raises(ManifestError, match="1 shards were never written"):
        assembly.finish()
    assert not (tmp_path / "out").exists()
    with pytest.raises(ManifestError, match="corrupt"):  # wrong size, even when the caller says it checked
        assembly.write(refs[-1].sha256, b"short", verified=True)
    with pytest.raises(ManifestError, match="not in the manifest"):
        assembly.write("0" * 64, b"")
    threads = [threading.Thread(target=assembly.write, args=(r.sha256, store.get(r.sha256))) for r in refs]
    for t in threads:  # every shard again, at once: those written before are ignored
        t.start()
    for t in threads:
        t.join()
    out = assembly.finish()
    for f in m.files:
        assert (out / f.path).read_bytes() == (d / f.path).read_bytes()


def test_assembly_refuses_a_manifest_whose_sizes_do_not_add_up(tmp_path):
    m = cut_checkpoint(_checkpoint(tmp_path), run_id="r", version=1, shard_size=4096)
    m.files[0].size += 1
    with pytest.raises(ManifestError, match="add up"):
        CheckpointAssembly(m, tmp_path / "out")
    m.files[0].size -= 1
    m.files.append(m.files[0])
    with pytest.raises(ManifestError, match="twice"):
        CheckpointAssembly(m, tmp_path / "out")
    assert not list(tmp_path.glob(".out-*"))


def test_manifest_signature(tmp_path):
    coordinator, mallory = Identity.generate(), Identity.generate()
    m = cut_checkpoint(_checkpoint(tmp_path), run_id="r", version=5)
    signed = SignedManifest.sign(m, coordinator)
    wire = SignedManifest.model_validate_json(signed.model_dump_json())
    assert wire.verify(coordinator.public_key_hex).version == 5
    with pytest.raises(ManifestError, match="untrusted key"):
        SignedManifest.sign(m, mallory).verify(coordinator.public_key_hex)
    with pytest.raises(ManifestError, match="not newer"):
        wire.verify(coordinator.public_key_hex, newer_than=5)
    tampered = json.loads(wire.model_dump_json())
    tampered["manifest"]["files"][0]["sha256"] = "0" * 64
    with pytest.raises(ManifestError, match="bad manifest signature"):
        SignedManifest.model_validate(tampered).verify(coordinator.public_key_hex)
    forged = json.loads(SignedManifest.sign(m, mallory).model_dump_json())
    forged["public_key"] = coordinator.public_key_hex  # claims to be the coordinator
    with pytest.raises(ManifestError, match="bad manifest signature"):
        SignedManifest.model_validate(forged).verify(coordinator.public_key_hex)


@pytest.mark.parametrize("path", ["../etc/passwd", "/abs", "a/../../b", "a\\b"])
def test_manifest_refuses_unsafe_paths(path):
    with pytest.raises(ValidationError):
        CheckpointManifest.model_validate({"run_id": "r", "version": 1, "files": [
            {"path": path, "size": 0, "sha256": "0" * 64, "shards": []}]})


def test_messages_refuse_unknown_fields_and_oversize():
    bad = _submission()
    bad["groups"][0]["rollouts"][0]["reward"] = 1.0
    with pytest.raises(ValidationError):
        RolloutSubmission.model_validate(bad)
    big = _submission()
    big["groups"][0]["rollouts"] = big["groups"][0]["rollouts"] * 65
    with pytest.raises(ValidationError):
        RolloutSubmission.model_validate(big)


def test_config_toml_and_overrides(tmp_path):
    class Inner(BaseModel):
        k: int = 1

    class Cfg(BaseModel):
        name: str = "a"
        rate: float = 0.1
        inner: Inner = Inner()

    f = tmp_path / "c.toml"
    f.write_text('name = "b"\n[inner]\nk = 2\n')
    cfg = load_config(Cfg, f, ["inner.k=3", "rate=0.5"])
    assert (cfg.name, cfg.rate, cfg.inner.k) == ("b", 0.5, 3)
    with pytest.raises(ValueError):
        load_config(Cfg, None, ["novalue"])


def test_dump_toml_reads_back_nested_tables(tmp_path):
    from swarmrl.demo import DemoConfig

    cfg = load_config(DemoConfig, None, ["roles.trainer.threads=4", "roles.node.engine.kind=torch", "nodes=3"])
    f = tmp_path / "demo.toml"
    f.write_text(dump_toml(cfg))
    again = load_config(DemoConfig, f)
    assert again.data_dir == tmp_path  # a relative path written in a file is relative to the file
    assert again.model_copy(update={"data_dir": cfg.data_dir}) == cfg
    assert again.roles == {"trainer": {"threads": 4}, "node": {"engine": {"kind": "torch"}}}
    # A role's extra settings merge into the demo's own, nested sections included.
    assert deep_update({"engine": {"kind": "auto", "dtype": "float32"}, "name": "n0"}, again.roles["node"]) == {
        "engine": {"kind": "torch", "dtype": "float32"}, "name": "n0"}
