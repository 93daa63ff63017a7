"""A full disk, for real: the coordinator's data_dir (SQLite database, shards, key) on a 4 MiB tmpfs the test mounts
and then fills. Writes get a 507 with a reason and a Retry-After (shard uploads at once, submissions once the
database's log can no longer grow), leave no partial file and change nothing (the database passes its integrity
check; a refused submission is not there); reads keep being served; once space is freed the same requests
succeed without a restart. Needs root and mount(8); skipped, saying why, without them."""

from __future__ import annotations

import errno
import os
import secrets
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from swarmrl.protocol.manifest import sha256_bytes
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.runtime.retry import RetryPolicy
from swarmrl.testing.waiting import wait_for
from tests.support.coordinator import Run, submission

DISK_BYTES = 4 * 1024 * 1024


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mountpoint)],
                              capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a small tmpfs here ({e})")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=60)


def fill(disk: Path) -> Path:
    """Fill `disk` to the last byte with one file (appending to it when it exists); return it (deleting or
    truncating it frees the space)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_is_a_clear_507_and_nothing_half_written(run_factory, small_disk: Path, caplog) -> None:
    run: Run = run_factory(data_dir=small_disk / "coordinator")
    run.publish(0)
    node = run.node("patient")
    op = CoordinatorClient(run.url, run.op.identity, retries=0)
    lease, later = node.lease(2, 0), node.lease(1, 0)
    node.submit(submission(later))
    shards = small_disk / "coordinator" / "shards"

    # Room for the request's nonce, not for its shard: the shard write fails half way and leaves nothing.
    filler = fill(small_disk)
    os.truncate(filler, filler.stat().st_size - 40 * 1024)
    data = secrets.token_bytes(60 * 1024)
    with pytest.raises(CoordinatorError) as info:
        op.upload_shard(sha256_bytes(data), data)
    assert info.value.status == 507 and "disk is full" in info.value.reason
    assert not list(shards.rglob(".part-*")) and not list(shards.rglob(sha256_bytes(data)))
    assert any("PUT" in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)  # the file

    # No room at all: every write is refused the same way, and changes nothing. SQLite may still find room in its
    # own log file: space a reset log leaves behind it, or the frames a refused write got to before the disk ran
    # out. So the log is emptied into the database and truncated first (with room for that), then the disk is
    # filled, and the writes come smallest first (each needs more than the one before it wrote).
    filler.unlink()
    db = small_disk / "coordinator" / "coordinator.sqlite"
    with sqlite3.connect(db, timeout=30) as log:
        wait_for(lambda: log.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0, "the log truncated")
    filler = fill(small_disk)
    before = run.op.status()
    for call in (lambda: node.heartbeat(0), lambda: node.lease(1, 0), lambda: node.submit(submission(lease))):
        with pytest.raises(CoordinatorError) as info:
            call()
        assert info.value.status == 507 and "disk is full" in info.value.reason
    resp = httpx.post(run.url + "/v1/submit", content=b"{}")  # a refusal that needs no disk is made as usual
    assert resp.status_code == 401 and "unsigned" in resp.json()["detail"]
    assert resp.headers.get("retry-after") is None

    # Reads are served throughout.
    assert run.op.status() == before and before.groups_pending == 1
    assert run.op.latest_manifest() is not None and [n.name for n in run.op.nodes()] == ["patient"]
    shard = run.op.latest_manifest().manifest.shards()[0]
    assert httpx.get(f"{run.url}/v1/shards/{shard.sha256}").status_code == 200
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as check:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)

    # Space freed: the same work goes through, once, without a restart.
    filler.unlink()
    patient = CoordinatorClient(run.url, node.identity, retry=RetryPolicy(attempts=3, base_s=0.01))
    assert sorted(patient.submit(submission(lease)).accepted) == sorted(p.prompt_id for p in lease.prompts)
    op.upload_shard(sha256_bytes(data), data)
    assert httpx.get(f"{run.url}/v1/shards/{sha256_bytes(data)}").content == data
    assert patient.lease(1, 0) is not None
    assert run.op.status().groups_pending == 3
