"""Publishing checkpoints through the coordinator without making training wait.

`Publisher.submit(dir, version)` returns at once; a background thread cuts the checkpoint into
content-addressed shards, uploads the ones it has not uploaded before, and publishes the manifest. Only
the newest submitted checkpoint matters: one still waiting when a newer one arrives is skipped (nodes
would only fetch the newer one anyway), so versions are published in increasing order and a slow upload
never queues up work.

What is published is the checkpoint's weights in the run's `weights_dtype` (the trainer keeps fp32 master weights
whatever it publishes), and, with `full_every` > 1, as a delta (`transfer.delta`) against the version published
before it: the manifest lists the payload's shards, the base version and every tensor's hash. Every `full_every`
versions, the first after a start, and whenever a delta is refused, the checkpoint goes out in full.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import safetensors.torch
import torch

from swarmrl.protocol.manifest import DEFAULT_SHARD_SIZE, CheckpointManifest, DeltaSpec, SignedManifest
from swarmrl.transfer import delta as codec
from swarmrl.transfer.store import cut_checkpoint

log = logging.getLogger(__name__)


class PublishClient(Protocol):
    """The part of `runtime.client.CoordinatorClient` the publisher uses."""

    def upload_shard(self, sha256: str, data: bytes) -> None: ...

    def publish(self, manifest: CheckpointManifest) -> SignedManifest: ...


def iter_shards(ckpt_dir: str | Path, manifest: CheckpointManifest) -> Iterator[tuple[str, bytes]]:
    """(sha256, bytes) of every shard of `manifest`, read from `ckpt_dir` (cut the same way as cut_checkpoint)."""
    root = Path(ckpt_dir)
    for entry in manifest.files:
        with open(root / entry.path, "rb") as f:
            for ref in entry.shards:
                yield ref.sha256, f.read(ref.size)


_SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16"}
_FLOATS = {"F64", "F32", "F16", "BF16"}


def published_weights(ckpt_dir: Path, dtype: str) -> dict[str, bytes]:
    """The bytes of every safetensors file of `ckpt_dir` (by relative path) as published: its floating tensors in
    `dtype` ("float32" or "bfloat16"), cast when the file holds another."""
    want = _SAFETENSORS_DTYPE[dtype]
    out: dict[str, bytes] = {}
    for path in sorted(ckpt_dir.rglob("*.safetensors")):
        data = path.read_bytes()
        _, tensors = codec.read_tensors(data)
        if any(t.dtype in _FLOATS and t.dtype != want for t in tensors):
            loaded = safetensors.torch.load(data)
            cast = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in loaded.items()}
            data = safetensors.torch.save(cast, metadata={"format": "pt"})
        out[path.relative_to(ckpt_dir).as_posix()] = data
    return out


def stage(ckpt_dir: Path, out: Path, weights: dict[str, bytes], base: tuple[int, dict[str, bytes]] | None
          ) -> DeltaSpec | None:
    """Write into `out` what is published: `ckpt_dir`'s other files as they are, and `weights` in full or, with
    `base` (a version and its weights as published), as delta payloads (`<path>.delta`). The DeltaSpec, or None."""
    for path in sorted(ckpt_dir.rglob("*")):
        rel = path.relative_to(ckpt_dir).as_posix()
        if path.is_file() and rel not in weights:
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out / rel)
    files = []
    for rel, data in weights.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        if base is None:
            (out / rel).write_bytes(data)
            continue
        (out / f"{rel}.delta").write_bytes(codec.encode(base[1][rel], data))
        files.append(codec.describe(rel, f"{rel}.delta", data))
    return None if base is None else DeltaSpec(base_version=base[0], codec=codec.CODEC, files=files)


def publish_checkpoint(client: PublishClient, ckpt_dir: str | Path, run_id: str, version: int,
                       uploaded: set[str] | None = None, shard_size: int = DEFAULT_SHARD_SIZE,
                       delta: DeltaSpec | None = None) -> SignedManifest:
    """Cut `ckpt_dir` into `shard_size`-byte shards, upload them (skipping those in `uploaded`, which is
    updated), publish it (as the delta `delta` describes, when given).

    If the coordinator refuses the manifest (e.g. it lost shards we thought it had), uploads every shard
    again and retries once.
    """
    uploaded = uploaded if uploaded is not None else set()
    manifest = cut_checkpoint(ckpt_dir, run_id=run_id, version=version, shard_size=shard_size)
    if delta is not None:
        manifest = CheckpointManifest.model_validate({**manifest.model_dump(), "delta": delta.model_dump()})
    for attempt in range(2):
        for sha, data in iter_shards(ckpt_dir, manifest):
            if sha not in uploaded:
                client.upload_shard(sha, data)
                uploaded.add(sha)
        try:
            return client.publish(manifest)
        except Exception:
            if attempt == 1:
                raise
            uploaded.clear()
    raise AssertionError("unreachable")


@dataclass
class PublishRecord:
    version: int
    seconds: float
    error: str | None = None
    sent_bytes: int = 0
    """What a receiver fetches for this version: the manifest's files (a delta's payloads, not the weights)."""
    full_bytes: int = 0
    """What the full checkpoint of this version weighs."""
    delta: bool = False


class Publisher:
    """Publishes submitted checkpoints on a background thread (or inline with `background=False`)."""

    def __init__(self, client: PublishClient, run_id: str, *, background: bool = True,
                 shard_size: int = DEFAULT_SHARD_SIZE, dtype: str = "float32", full_every: int = 1,
                 work_dir: str | Path | None = None):
        self.client = client
        self.run_id = run_id
        self.shard_size = shard_size
        self.dtype = dtype
        self.full_every = full_every
        # Where what is published is staged (`.publish-*`, removed once published; a killed trainer's at start).
        self.work_dir = Path(work_dir) if work_dir is not None else Path(tempfile.gettempdir())
        if work_dir is not None:
            for stale in self.work_dir.glob(".publish-*"):
                shutil.rmtree(stale, ignore_errors=True)
        # The weights of the newest version published, as published (a delta's base), and the deltas since a full.
        self._base: tuple[int, dict[str, bytes]] | None = None
        self._chain = 0
        self.background = background
        self.uploaded: set[str] = set()
        self.published_version = -1
        self.last: PublishRecord | None = None
        self._lock = threading.Condition()
        self._next: tuple[Path, int] | None = None
        self._current: Path | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
            self._thread.start()

    def submit(self, ckpt_dir: str | Path, version: int) -> None:
        """Queue `ckpt_dir` for publishing as `version` (replacing any older one not yet started)."""
        item = (Path(ckpt_dir), version)
        if not self.background:
            self._publish(*item)
            return
        with self._lock:
            if self._next is not None and self._next[1] >= version:
                return
            self._next = item
            self._lock.notify_all()

    def in_use(self) -> set[Path]:
        """Checkpoint directories being or waiting to be published: do not delete them."""
        with self._lock:
            return {p for p in (self._current, self._next[0] if self._next else None) if p is not None}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted is published (or failed); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._next is not None or self._current is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Publish what is pending, then stop the thread."""
        self.flush(timeout)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._next is None and not self._closed:
                    self._lock.wait()
                if self._next is None:
                    return
                ckpt_dir, version = self._next
                self._next, self._current = None, ckpt_dir
            try:
                self._publish(ckpt_dir, version)
            finally:
                with self._lock:
                    self._current = None
                    self._lock.notify_all()

    def _publish(self, ckpt_dir: Path, version: int) -> None:
        if version <= self.published_version:
            return
        t0 = time.monotonic()
        try:
            weights = published_weights(ckpt_dir, self.dtype)
            base = self._base
            if (base is not None and base[0] == self.published_version and self._chain + 1 < self.full_every
                    and set(base[1]) == set(weights)):
                try:
                    signed = self._send(ckpt_dir, version, weights, base)
                except Exception as e:  # e.g. the coordinator lost the base: the full checkpoint always goes
                    log.warning("publishing version %d as a delta failed (%s); publishing it in full", version, e)
                    signed = self._send(ckpt_dir, version, weights, None)
            else:
                signed = self._send(ckpt_dir, version, weights, None)
            is_delta = signed.manifest.delta is not None
            self._base, self._chain = (version, weights), self._chain + 1 if is_delta else 0
            self.published_version = version
            full = sum(len(w) for w in weights.values()) + sum(
                f.size for f in signed.manifest.files if f.path not in weights and not f.path.endswith(".delta"))
            self.last = PublishRecord(version, time.monotonic() - t0, sent_bytes=signed.manifest.total_bytes,
                                      full_bytes=full, delta=is_delta)
        except Exception as e:  # a failed publish must not kill training; the next version will try again
            log.warning("publishing version %d failed: %s", version, e)
            self.last = PublishRecord(version, time.monotonic() - t0, error=str(e))

    def _send(self, ckpt_dir: Path, version: int, weights: dict[str, bytes],
              base: tuple[int, dict[str, bytes]] | None) -> SignedManifest:
        """Stage what is published (a delta against `base`, else in full) and publish it."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(dir=self.work_dir, prefix=".publish-"))
        try:
            spec = stage(ckpt_dir, out, weights, base)
            return publish_checkpoint(self.client, out, self.run_id, version, self.uploaded, self.shard_size,
                                      delta=spec)
        finally:
            shutil.rmtree(out, ignore_errors=True)
