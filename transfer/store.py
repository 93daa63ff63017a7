"""Content-addressed shard storage and checkpoint assembly: what a checkpoint's bytes look like on disk.

`cut_checkpoint` lists a checkpoint directory as shards (writing them to a `ShardStore`); `ShardStore` keeps
shards named by their sha256 and refuses bytes that do not match their name; `CheckpointAssembly` writes
verified shards into a checkpoint's files as they arrive and moves the whole directory into place at once.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from swarmrl.protocol.manifest import (
    DEFAULT_SHARD_SIZE,
    CheckpointManifest,
    FileEntry,
    ManifestError,
    ShardRef,
    sha256_bytes,
)

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _iter_chunks(path: Path, size: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(size):
            yield block


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardStore:
    """A directory of shards named by their sha256. `put` refuses bytes that do not match their name.

    One process owns a store's directory. Opening it removes the partial files (`.part-*`) a killed process left
    behind: `put` writes a shard under such a name and renames it into place, so they are never whole shards; a
    `put` that fails (a full disk) removes its own. `durable`: a shard is fsynced before it is renamed into place
    and the rename is fsynced with its directory, so a shard that a later commit refers to (a published manifest)
    survives a power cut whole (the coordinator's store is durable; a node's, which can fetch again, is not)."""

    def __init__(self, root: str | Path, durable: bool = False):
        self.root = Path(root)
        self.durable = durable
        self.root.mkdir(parents=True, exist_ok=True)
        for partial in self.root.glob("??/.part-*"):
            partial.unlink(missing_ok=True)

    def path(self, sha256: str) -> Path:
        if not _HEX64.match(sha256):
            raise ManifestError(f"not a sha256: {sha256[:80]!r}")
        return self.root / sha256[:2] / sha256

    def has(self, sha256: str) -> bool:
        return self.path(sha256).exists()

    def get(self, sha256: str) -> bytes:
        return self.path(sha256).read_bytes()

    def put(self, sha256: str, data: bytes) -> None:
        """Store `data` under its hash, atomically; ManifestError if the hash does not match."""
        actual = sha256_bytes(data)
        if actual != sha256:
            raise ManifestError(f"shard hash mismatch: expected {sha256[:12]}, got {actual[:12]}")
        dest = self.path(sha256)
        if dest.exists():
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if self.durable:
            _fsync_dir(dest.parent)

    def missing(self, manifest: CheckpointManifest) -> list[ShardRef]:
        return [s for s in manifest.shards() if not self.has(s.sha256)]

    def remove_unreferenced(self, keep: list[CheckpointManifest]) -> int:
        """Delete shards no manifest in `keep` references; returns how many were removed."""
        wanted = {s.sha256 for m in keep for s in m.shards()}
        removed = 0
        for p in self.root.glob("??/*"):
            if p.name not in wanted and not p.name.startswith(".part-"):
                p.unlink(missing_ok=True)
                removed += 1
        return removed


def cut_checkpoint(
    ckpt_dir: str | Path,
    *,
    run_id: str,
    version: int,
    store: ShardStore | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> CheckpointManifest:
    """List the files of `ckpt_dir` as content-addressed shards (and write them to `store` if given)."""
    root = Path(ckpt_dir)
    files: list[FileEntry] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        shards: list[ShardRef] = []
        h = hashlib.sha256()
        for chunk in _iter_chunks(path, shard_size):
            h.update(chunk)
            digest = sha256_bytes(chunk)
            shards.append(ShardRef(sha256=digest, size=len(chunk)))
            if store is not None:
                store.put(digest, chunk)
        files.append(FileEntry(path=rel, size=path.stat().st_size, sha256=h.hexdigest(), shards=shards))
    return CheckpointManifest(
        run_id=run_id, version=version, created_at=time.time(), shard_size=shard_size, files=files
    )


class CheckpointAssembly:
    """A checkpoint's files, written shard by shard in any order, and moved to `out_dir` once all are in.

    A fetcher writes each shard the moment it has verified it, so the files are complete when the last shard
    arrives, instead of being copied and hashed in a second pass over the whole checkpoint after it (under
    load, that pass took longer than the last tenth of the download). `write` checks the bytes against the
    shard's hash unless the caller has just checked them (`verified`, e.g. straight after `ShardStore.put`).
    A file is the concatenation of its shards, and the manifest's sizes are checked to add up, so once every
    shard has been written and checked, every file is right by construction: the manifest's file hashes are
    not hashed again.

    The files are written in a temporary sibling of `out_dir` and moved into place by `finish`, so `out_dir`
    either holds the whole checkpoint or does not exist. `write` may be called from several threads at once.
    One assembly per `out_dir` at a time: a new one removes what an interrupted one left behind.
    """

    def __init__(self, manifest: CheckpointManifest, out_dir: str | Path):
        self.manifest = manifest
        self.out = Path(out_dir)
        self.places: dict[str, list[tuple[int, int]]] = {}  # shard sha -> (file number, offset) of each copy
        self.sizes: dict[str, int] = {}
        if len({entry.path for entry in manifest.files}) != len(manifest.files):
            raise ManifestError("the manifest lists a file twice")
        for n, entry in enumerate(manifest.files):
            offset = 0
            for ref in entry.shards:
                self.places.setdefault(ref.sha256, []).append((n, offset))
                self.sizes[ref.sha256] = ref.size
                offset += ref.size
            if offset != entry.size:
                raise ManifestError(f"{entry.path}: its shards add up to {offset} bytes, not {entry.size}")
        self.missing = set(self.places)
        self._lock = threading.Lock()
        self._fds: list[int] = []
        self.out.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.out.parent.glob(f".{self.out.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}-"))
        try:
            for entry in manifest.files:
                dest = self.tmp / entry.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fds.append(fd)
                os.ftruncate(fd, entry.size)
        except BaseException:
            self.abort()
            raise

    def write(self, sha256: str, data: bytes, *, verified: bool = False) -> None:
        """Write the shard into every place it has; ManifestError if it is no shard of the manifest or its
        bytes do not match. A shard written before is ignored."""
        if sha256 not in self.places:
            raise ManifestError(f"shard {sha256[:12]} is not in the manifest")
        if sha256 not in self.missing:
            return
        if len(data) != self.sizes[sha256] or (not verified and sha256_bytes(data) != sha256):
            raise ManifestError(f"shard {sha256[:12]} is corrupt")
        for n, offset in self.places[sha256]:
            os.pwrite(self._fds[n], data, offset)
        with self._lock:
            self.missing.discard(sha256)

    def finish(self) -> Path:
        """Move the complete checkpoint into `out_dir` and return it; ManifestError if shards are missing."""
        if self.missing:
            raise ManifestError(f"{len(self.missing)} shards were never written")
        self._close()
        if self.out.exists():  # assembled meanwhile by someone else: theirs stands
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            os.replace(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        """Remove the partial files."""
        self._close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())


def assemble_checkpoint(manifest: CheckpointManifest, get_shard: Callable[[str], bytes], out_dir: str | Path) -> Path:
    """Write the checkpoint's files into `out_dir` from `get_shard`, checking every shard's hash (which catches
    a store damaged on disk too). See CheckpointAssembly; an `out_dir` that exists is returned as it is."""
    out = Path(out_dir)
    if out.exists():
        return out
    assembly = CheckpointAssembly(manifest, out)
    try:
        for ref in manifest.shards():
            assembly.write(ref.sha256, get_shard(ref.sha256))
        return assembly.finish()
    except BaseException:
        assembly.abort()
        raise
