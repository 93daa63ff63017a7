"""Checkpoint manifests and content-addressed shards.

A checkpoint is a directory in Hugging Face layout (safetensors weights, config, tokenizer files). It is
cut into fixed-size shards named by their sha256; the manifest lists every file with its own hash and
its shards, plus the policy version, and is signed by the coordinator's key. A receiver trusts nothing
but that signature: it checks every shard's hash before storing, serving or assembling it, and a file is
the concatenation of its checked shards (CheckpointAssembly).

A delta checkpoint (`CheckpointManifest.delta`) lists, besides the files that go over as they are, one payload
file per weights file: the bits that changed since the base version (`transfer.delta`). The receiver rebuilds
each weights file from its own copy of the base version and the payload, and keeps it only when every tensor
matches the hash this manifest lists for it (and the file its size and hash): the payload is trusted for nothing.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swarmrl.protocol.identity import Identity, verify_signature
from swarmrl.protocol.signing import canonical_json

DEFAULT_SHARD_SIZE = 2 * 1024 * 1024  # see trainer.config.TrainerConfig.shard_mb
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_INT64_END = 2**63  # what the coordinator's store and its JSON encoder take


class ManifestError(Exception):
    """A manifest or shard failed a signature, hash, size or path check."""


class ShardRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


def _safe_path(v: str) -> str:
    p = PurePosixPath(v)
    if p.is_absolute() or ".." in p.parts or not p.parts or "\\" in v:
        raise ValueError(f"unsafe path in manifest: {v!r}")
    return v


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(max_length=255, description="Relative POSIX path inside the checkpoint directory.")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    shards: list[ShardRef]

    _path = field_validator("path")(_safe_path)


class TensorHash(BaseModel):
    """One tensor a delta must produce: its name, dtype and shape as the safetensors header states them, and the
    sha256 of its raw bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(max_length=1024)
    dtype: str = Field(max_length=16)
    shape: list[Annotated[int, Field(ge=0, lt=_INT64_END)]] = Field(max_length=16)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class DeltaFile(BaseModel):
    """A weights file rebuilt from the base version's file at the same `path` and the payload file `payload`."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(max_length=255, description="The rebuilt file, relative POSIX path in the checkpoint.")
    size: int = Field(ge=0, lt=_INT64_END, description="Its size in bytes.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Its sha256: the full checkpoint's file, bit for bit.")
    header_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The sha256 of its safetensors header block: "
                               "with every tensor's hash, and tensors that tile the data, the whole file is checked "
                               "in one pass.")
    payload: str = Field(max_length=255, description="The manifest file holding the delta (not kept once applied).")
    tensors: list[TensorHash] = Field(max_length=1_000_000, description="Every tensor of the rebuilt file.")

    _paths = field_validator("path", "payload")(_safe_path)


class DeltaSpec(BaseModel):
    """What makes a manifest a delta: the version it applies to, the codec, and what it must produce."""

    model_config = ConfigDict(extra="forbid")
    base_version: int = Field(ge=0, lt=_INT64_END, description="The version whose weights files the delta applies to.")
    codec: Literal["xor-zstd"] = Field("xor-zstd", description="How payloads encode the change (transfer.delta).")
    files: list[DeltaFile] = Field(min_length=1, max_length=1024)


class CheckpointManifest(BaseModel):
    """What a checkpoint version consists of. Signed as a whole by the coordinator."""

    model_config = ConfigDict(extra="forbid")
    run_id: str = Field(max_length=128)
    version: int = Field(ge=0, description="Policy version; strictly increasing within a run.")
    created_at: float = 0.0
    shard_size: int = Field(DEFAULT_SHARD_SIZE, gt=0)
    files: list[FileEntry] = Field(max_length=1024)
    delta: DeltaSpec | None = Field(None, description="Set for a delta checkpoint (module docstring); signed with "
                                    "the rest. Absent from the signed body of a full checkpoint.")

    @model_validator(mode="after")
    def _delta_fits(self) -> CheckpointManifest:
        if self.delta is None:
            return self
        if self.delta.base_version >= self.version:
            raise ValueError(f"delta base version {self.delta.base_version} is not older than {self.version}")
        listed = {f.path for f in self.files}
        payloads = [d.payload for d in self.delta.files]
        rebuilt = [d.path for d in self.delta.files]
        if any(p not in listed for p in payloads) or len(set(payloads)) != len(payloads):
            raise ValueError("every delta payload must be a distinct file of the manifest")
        if len(set(rebuilt)) != len(rebuilt) or any(p in listed for p in rebuilt):
            raise ValueError("a rebuilt file is listed twice, or also as a file of the manifest")
        return self

    def checkpoint_files(self) -> dict[str, str]:
        """path -> sha256 of every file of the checkpoint this manifest yields (a delta's payloads replaced by the
        files they rebuild)."""
        out = {f.path: f.sha256 for f in self.files}
        for d in self.delta.files if self.delta is not None else ():
            out.pop(d.payload, None)
            out[d.path] = d.sha256
        return out

    def body(self) -> dict:
        """What is signed and digested: the JSON form, without `delta` when there is none (so full manifests sign
        the same body as before deltas existed)."""
        data = self.model_dump(mode="json")
        if data.get("delta") is None:
            data.pop("delta", None)
        return data

    def shards(self) -> list[ShardRef]:
        """Every distinct shard, in file order."""
        seen: dict[str, ShardRef] = {}
        for f in self.files:
            for s in f.shards:
                seen.setdefault(s.sha256, s)
        return list(seen.values())

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def digest(self) -> str:
        return hashlib.sha256(canonical_json(self.body())).hexdigest()


class SignedManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    manifest: CheckpointManifest
    public_key: str = Field(min_length=64, max_length=64)
    signature: str = Field(min_length=128, max_length=128)

    @classmethod
    def sign(cls, manifest: CheckpointManifest, identity: Identity) -> SignedManifest:
        msg = b"swarmrl-manifest\n" + canonical_json(manifest.body())
        return cls(manifest=manifest, public_key=identity.public_key_hex, signature=identity.sign(msg))

    def verify(self, trusted_key: str, *, newer_than: int | None = None) -> CheckpointManifest:
        """The manifest, if signed by `trusted_key` (and newer than `newer_than`); else ManifestError."""
        if self.public_key != trusted_key:
            raise ManifestError("manifest signed by an untrusted key")
        msg = b"swarmrl-manifest\n" + canonical_json(self.manifest.body())
        if not verify_signature(self.public_key, msg, self.signature):
            raise ManifestError("bad manifest signature")
        if newer_than is not None and self.manifest.version <= newer_than:
            raise ManifestError(f"manifest version {self.manifest.version} is not newer than {newer_than}")
        return self.manifest


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
