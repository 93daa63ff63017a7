"""Discovery records in the hivemind DHT: which peer holds which shards of which checkpoint version.

For every checkpoint version there is one DHT key, `swarmrl/{run_id}/v{version}/holders`. Each peer writes
its own subkey under it: the owner tag of its RSA key (`[owner:ssh-rsa ...]`), so hivemind's
`RSASignatureValidator` makes every DHT node refuse a write to that subkey that the key's owner did not sign.
The value says which shards (a bitfield over `manifest.shards()`) the peer holds, for which manifest (a
digest prefix), and under which libp2p peer id it serves them. The same RSA key is the peer's libp2p
identity, and `HolderRecordValidator` checks that the peer id in a record is the one that key derives: a
peer can neither overwrite another's record nor advertise shards on another peer's behalf.

Records expire (`record_ttl_s`) and are refreshed while the peer serves. Readers validate every record
again (`parse_holders`) and ignore what does not parse: records are hints, every byte is hash-checked.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.multiaddr import Multiaddr

from swarmrl.protocol.manifest import CheckpointManifest, ShardRef

RECORD_KIND = "swarmrl.holders.v1"
MAX_ADDRS = 8
MAX_ADDR_LEN = 200
MAX_SHARDS = 1 << 20


def holders_key(run_id: str, version: int) -> str:
    """The DHT key under which holders of `version` of run `run_id` write their records."""
    return f"swarmrl/{run_id}/v{version}/holders"


@dataclass(frozen=True)
class ManifestInfo:
    """What discovery needs of a manifest, computed once: its tag, shard list and shard -> indices."""

    tag: str
    shards: tuple[ShardRef, ...]
    index: dict[str, tuple[int, ...]]


_INFO: dict[int, tuple[CheckpointManifest, ManifestInfo]] = {}


def manifest_info(manifest: CheckpointManifest) -> ManifestInfo:
    """Cached per manifest object (manifests are not modified once signed)."""
    hit = _INFO.get(id(manifest))
    if hit is not None and hit[0] is manifest:
        return hit[1]
    shards = tuple(manifest.shards())
    index: dict[str, list[int]] = {}
    for i, s in enumerate(shards):
        index.setdefault(s.sha256, []).append(i)
    info = ManifestInfo(manifest.digest()[:16], shards, {k: tuple(v) for k, v in index.items()})
    if len(_INFO) >= 32:
        _INFO.clear()
    _INFO[id(manifest)] = (manifest, info)  # the strong reference keeps id(manifest) from being reused
    return info


def manifest_tag(manifest: CheckpointManifest) -> str:
    """A short digest naming exactly which manifest a bitfield indexes."""
    return manifest_info(manifest).tag


# -- bitfields ----------------------------------------------------------------------------------------------


def make_bitfield(n: int, indices: Iterable[int]) -> bytes:
    """Bit i (most significant first within each byte) set for every i in `indices`."""
    out = bytearray((n + 7) // 8)
    for i in indices:
        if not 0 <= i < n:
            raise ValueError(f"shard index {i} out of range 0..{n - 1}")
        out[i >> 3] |= 0x80 >> (i & 7)
    return bytes(out)


def bitfield_indices(bits: bytes, n: int) -> frozenset[int]:
    return frozenset(i for i in range(n) if bits[i >> 3] & (0x80 >> (i & 7)))


# -- identities: one RSA key is both the libp2p identity and the DHT record signer ----------------------


def _private_key_from_der(der: bytes) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # hivemind's own (pickle) path for loading a DER key
    return key


def load_or_create_rsa_identity(path: str | Path | None) -> tuple[RSAPrivateKey, Path, bool]:
    """(key, libp2p identity file, whether the file is temporary) for `path`, or a fresh key if None.

    The file is in the format p2pd reads (a protobuf `PrivateKey`); a temporary one should be deleted once
    the daemon has started.
    """
    if path is not None and Path(path).exists():
        data = Path(path).read_bytes()
        pb = crypto_pb2.PrivateKey.FromString(data)
        if pb.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"identity file {path} does not hold an RSA key")
        return _private_key_from_der(pb.data), Path(path), False
    key = RSAPrivateKey()
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    if path is not None:
        dest, temporary = Path(path), False
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    else:
        fd, name = tempfile.mkstemp(prefix="swarmrl-p2p-", suffix=".key")
        dest, temporary = Path(name), True
        os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return key, dest, temporary


def peer_id_of_public_key(public_key: RSAPublicKey) -> PeerID:
    """The libp2p peer id an RSA public key derives (as `PeerID.from_identity` does for a private key)."""
    raw = public_key._public_key  # noqa: SLF001 (hivemind keeps the cryptography object there)
    if not isinstance(raw, rsa.RSAPublicKey):
        raise ValueError("not an RSA key")
    der = raw.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest())  # multihash: sha2-256, 32 bytes


def peer_id_of_private_key(key: RSAPrivateKey) -> PeerID:
    return peer_id_of_public_key(key.get_public_key())


# -- records ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HolderRecord:
    """What one peer says it holds of one manifest."""

    peer_id: str
    tag: str
    n_shards: int
    bits: bytes
    seed: bool = False
    addrs: tuple[str, ...] = ()

    def to_value(self) -> dict[str, Any]:
        return {"kind": RECORD_KIND, "peer": self.peer_id, "tag": self.tag, "n": self.n_shards,
                "have": self.bits, "seed": self.seed, "addrs": list(self.addrs)}

    @classmethod
    def from_value(cls, value: Any) -> HolderRecord:
        """Parse a record value; ValueError unless every field has the right type and bounds."""
        if not isinstance(value, dict) or value.get("kind") != RECORD_KIND:
            raise ValueError("not a holder record")
        if set(value) != {"kind", "peer", "tag", "n", "have", "seed", "addrs"}:
            raise ValueError("holder record has unexpected fields")
        peer, tag, n, bits, seed, addrs = (value[k] for k in ("peer", "tag", "n", "have", "seed", "addrs"))
        if not isinstance(peer, str) or not 1 <= len(peer) <= 128:
            raise ValueError("bad peer id")
        if not isinstance(tag, str) or len(tag) != 16:
            raise ValueError("bad manifest tag")
        if type(n) is not int or not 0 < n <= MAX_SHARDS:
            raise ValueError("bad shard count")
        if not isinstance(bits, bytes) or len(bits) != (n + 7) // 8:
            raise ValueError("bitfield does not match the shard count")
        if type(seed) is not bool:
            raise ValueError("bad seed flag")
        if not isinstance(addrs, list) or len(addrs) > MAX_ADDRS:
            raise ValueError("bad address list")
        for a in addrs:
            if not isinstance(a, str) or len(a) > MAX_ADDR_LEN:
                raise ValueError("bad address")
        return cls(peer_id=peer, tag=tag, n_shards=n, bits=bits, seed=seed, addrs=tuple(addrs))

    def indices(self) -> frozenset[int]:
        return bitfield_indices(self.bits, self.n_shards)


_OWNER_PEER: dict[bytes, str | None] = {}


def owner_peer_id(subkey: bytes) -> str | None:
    """The peer id (base58) of the RSA key an owner-tagged (serialized) subkey names; None unless exactly one.

    Memoized: the same few keys come back in every DHT answer.
    """
    keys = set(RSASignatureValidator._PUBLIC_KEY_RE.findall(subkey))  # noqa: SLF001
    if len(keys) != 1:
        return None
    raw = keys.pop()
    if raw not in _OWNER_PEER:
        try:
            pid: str | None = peer_id_of_public_key(RSAPublicKey.from_bytes(raw)).to_base58()
        except (ValueError, TypeError):
            pid = None
        if len(_OWNER_PEER) > 4096:
            _OWNER_PEER.clear()
        _OWNER_PEER[raw] = pid
    return _OWNER_PEER[raw]


def check_record(subkey: bytes, value: Any) -> HolderRecord:
    """A holder record whose peer id is the one the subkey's owner key derives; ValueError otherwise."""
    record = HolderRecord.from_value(value)
    owner = owner_peer_id(subkey)
    if owner is None:
        raise ValueError("holder record without an owner tag")
    if owner != record.peer_id:
        raise ValueError("holder record names a peer id its owner key does not derive")
    return record


class CachingSignatureValidator(RSASignatureValidator):
    """hivemind's RSASignatureValidator, remembering verdicts on records it has already checked.

    Every DHT answer carries the same records again (one per holder); an RSA verification each time was a
    noticeable share of a node's CPU. A verdict is keyed by the record's exact bytes, so it is the same
    verdict the full check would give.
    """

    def __init__(self, private_key: RSAPrivateKey | None = None, cache_size: int = 8192):
        super().__init__(private_key)
        self._verdicts: dict[DHTRecord, bool] = {}
        self._cache_size = cache_size

    def validate(self, record: DHTRecord) -> bool:
        verdict = self._verdicts.get(record)
        if verdict is None:
            verdict = super().validate(record)
            if len(self._verdicts) >= self._cache_size:
                self._verdicts.clear()
            self._verdicts[record] = verdict
        return verdict


class HolderRecordValidator(RecordValidatorBase):
    """DHT-side check of holder records (after RSASignatureValidator verified the owner's signature).

    A record that calls itself a holder record must parse, and its peer id must belong to the key that
    signed it. Other records (other applications sharing the DHT) are left to their own validators.
    """

    def validate(self, record: DHTRecord) -> bool:
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            return True
        try:
            value = DHTProtocol.serializer.loads(record.value)
        except Exception:  # noqa: BLE001 (not ours to judge)
            return True
        if not (isinstance(value, dict) and value.get("kind") == RECORD_KIND):
            return True
        try:
            check_record(record.subkey, value)
        except ValueError:
            return False
        return True

    @property
    def priority(self) -> int:
        return 5  # below RSASignatureValidator (10): sees values with the signature stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, HolderRecordValidator)


def parse_holders(raw: Any, manifest: CheckpointManifest) -> dict[str, HolderRecord]:
    """Peer id -> record, from a DHT `get` result for `holders_key`; drops anything invalid or stale.

    `raw` is what `DHTNode.get` returns: a ValueWithExpiration whose value is a DictionaryDHTValue of
    subkey -> ValueWithExpiration. Subkeys come back deserialized; they are serialized again to find the
    owner tag exactly as the validator saw it.
    """
    out: dict[str, HolderRecord] = {}
    if raw is None:
        return out
    value = getattr(raw, "value", raw)
    items = value.items() if hasattr(value, "items") else []
    info = manifest_info(manifest)
    tag, n = info.tag, len(info.shards)
    for subkey, entry in items:
        inner = getattr(entry, "value", entry)
        try:
            sub = subkey if isinstance(subkey, bytes) else DHTProtocol.serializer.dumps(subkey)
            rec = check_record(sub, inner)
        except Exception:  # noqa: BLE001 (a malformed record is simply not a holder)
            continue
        if rec.tag != tag or rec.n_shards != n:
            continue
        out[rec.peer_id] = rec
    return out


def full_maddrs(maddrs: Iterable[Any], peer_id: PeerID) -> list[str]:
    """Multiaddrs with a /p2p/<peer id> suffix, as DHT bootstrap lists want them."""
    out = []
    for a in maddrs:
        m = Multiaddr(str(a))
        if "p2p" not in m.protocols() and "/p2p/" not in str(m):
            m = m.encapsulate(Multiaddr(f"/p2p/{peer_id.to_base58()}"))
        out.append(str(m))
    return out


__all__ = [
    "HolderRecord",
    "HolderRecordValidator",
    "CachingSignatureValidator",
    "check_record",
    "full_maddrs",
    "holders_key",
    "load_or_create_rsa_identity",
    "make_bitfield",
    "manifest_info",
    "manifest_tag",
    "parse_holders",
    "peer_id_of_private_key",
    "peer_id_of_public_key",
]
