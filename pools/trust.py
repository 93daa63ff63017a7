"""What a node remembers about pools between runs: the key pinned for each pool name it joined, and the newest
record (sequence number, digest) seen for each coordinator key. Kept as JSON in `<work_dir>/pools.json`.

A pin is made on the first join of a name and never changed by this code: a record of that name under another
key is refused (`protocol.pools.pool_record_problem`), and only the node's operator can remove the pin (by editing
or deleting the file) once the pool's operator has announced a new key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from swarmrl.protocol.pools import Seen, SignedPoolRecord

MAX_SEEN = 4096
TRUST_FILE = "pools.json"


class PoolTrust:
    """Pins and sequence numbers seen, loaded from `path` when it exists (None: kept in memory only)."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self.pins: dict[str, str] = {}
        self.seen: dict[str, Seen] = {}
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
                self.pins = {str(k): str(v) for k, v in data.get("pins", {}).items()}
                self.seen = {str(k): Seen(int(v["seq"]), str(v["digest"])) for k, v in data.get("seen", {}).items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path} is not a pools trust file ({e}); move it away to start afresh") from None

    @classmethod
    def in_dir(cls, work_dir: Path) -> PoolTrust:
        return cls(Path(work_dir) / TRUST_FILE)

    def note(self, signed: SignedPoolRecord) -> None:
        """Remember `signed` as the newest record of its key, if it is newer than the one remembered."""
        rec = signed.record
        old = self.seen.get(rec.coordinator_key)
        if old is None or rec.seq > old.seq:
            if old is None and len(self.seen) >= MAX_SEEN:
                self.seen.pop(min(self.seen, key=lambda k: self.seen[k].seq))
            self.seen[rec.coordinator_key] = Seen(rec.seq, signed.digest())

    def pin(self, name: str, key: str) -> None:
        if name in self.pins and self.pins[name] != key:
            raise ValueError(f"pool {name!r} is already pinned to another key")
        self.pins[name] = key

    def save(self) -> None:
        """Write the file atomically (a crash leaves the old or the new one), readable by the owner only."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"pins": self.pins, "seen": {k: {"seq": v.seq, "digest": v.digest} for k, v in self.seen.items()}}
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
