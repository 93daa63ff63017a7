"""Checkpoint manifests and content-addressed shards.

A checkpoint is a directory in Hugging Face layout (safetensors weights, config, tokenizer files). It is
cut into fixed-size shards named by their sha256; the manifest lists every file with its own hash and
its shards, plus the policy version, and is signed by the coordinator's key. A receiver trusts nothing
but that signature: it checks every shard's hash before storing, serving or assembling it, and a file is
the concatenation of its checked shards (CheckpointAssembly).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, field_validator

from swarmrl.protocol.identity import Identity, verify_signature
from swarmrl.protocol.signing import canonical_json

DEFAULT_SHARD_SIZE = 2 * 1024 * 1024  # see trainer.config.TrainerConfig.shard_mb
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(Exception):
    """A manifest or shard failed a signature, hash, size or path check."""


class ShardRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(max_length=255, description="Relative POSIX path inside the checkpoint directory.")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    shards: list[ShardRef]

    @field_validator("path")
    @classmethod
    def _safe_path(cls, v: str) -> str:
        p = PurePosixPath(v)
        if p.is_absolute() or ".." in p.parts or not p.parts or "\\" in v:
            raise ValueError(f"unsafe path in manifest: {v!r}")
        return v


class CheckpointManifest(BaseModel):
    """What a checkpoint version consists of. Signed as a whole by the coordinator."""

    model_config = ConfigDict(extra="forbid")
    run_id: str = Field(max_length=128)
    version: int = Field(ge=0, description="Policy version; strictly increasing within a run.")
    created_at: float = 0.0
    shard_size: int = Field(DEFAULT_SHARD_SIZE, gt=0)
    files: list[FileEntry] = Field(max_length=1024)

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
        return hashlib.sha256(canonical_json(self.model_dump(mode="json"))).hexdigest()


class SignedManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    manifest: CheckpointManifest
    public_key: str = Field(min_length=64, max_length=64)
    signature: str = Field(min_length=128, max_length=128)

    @classmethod
    def sign(cls, manifest: CheckpointManifest, identity: Identity) -> SignedManifest:
        msg = b"swarmrl-manifest\n" + canonical_json(manifest.model_dump(mode="json"))
        return cls(manifest=manifest, public_key=identity.public_key_hex, signature=identity.sign(msg))

    def verify(self, trusted_key: str, *, newer_than: int | None = None) -> CheckpointManifest:
        """The manifest, if signed by `trusted_key` (and newer than `newer_than`); else ManifestError."""
        if self.public_key != trusted_key:
            raise ManifestError("manifest signed by an untrusted key")
        msg = b"swarmrl-manifest\n" + canonical_json(self.manifest.model_dump(mode="json"))
        if not verify_signature(self.public_key, msg, self.signature):
            raise ManifestError("bad manifest signature")
        if newer_than is not None and self.manifest.version <= newer_than:
            raise ManifestError(f"manifest version {self.manifest.version} is not newer than {newer_than}")
        return self.manifest


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
