"""Publishing checkpoints through the coordinator without making training wait.

`Publisher.submit(dir, version)` returns at once; a background thread cuts the checkpoint into
content-addressed shards, uploads the ones it has not uploaded before, and publishes the manifest. Only
the newest submitted checkpoint matters: one still waiting when a newer one arrives is skipped (nodes
would only fetch the newer one anyway), so versions are published in increasing order and a slow upload
never queues up work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from swarmrl.protocol.manifest import DEFAULT_SHARD_SIZE, CheckpointManifest, SignedManifest
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


def publish_checkpoint(client: PublishClient, ckpt_dir: str | Path, run_id: str, version: int,
                       uploaded: set[str] | None = None, shard_size: int = DEFAULT_SHARD_SIZE) -> SignedManifest:
    """Cut `ckpt_dir` into `shard_size`-byte shards, upload them (skipping those in `uploaded`, which is
    updated), publish it.

    If the coordinator refuses the manifest (e.g. it lost shards we thought it had), uploads every shard
    again and retries once.
    """
    uploaded = uploaded if uploaded is not None else set()
    manifest = cut_checkpoint(ckpt_dir, run_id=run_id, version=version, shard_size=shard_size)
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


class Publisher:
    """Publishes submitted checkpoints on a background thread (or inline with `background=False`)."""

    def __init__(self, client: PublishClient, run_id: str, *, background: bool = True,
                 shard_size: int = DEFAULT_SHARD_SIZE):
        self.client = client
        self.run_id = run_id
        self.shard_size = shard_size
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
            publish_checkpoint(self.client, ckpt_dir, self.run_id, version, self.uploaded, self.shard_size)
            self.published_version = version
            self.last = PublishRecord(version, time.monotonic() - t0)
        except Exception as e:  # a failed publish must not kill training; the next version will try again
            log.warning("publishing version %d failed: %s", version, e)
            self.last = PublishRecord(version, time.monotonic() - t0, error=str(e))
