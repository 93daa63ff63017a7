"""The run's secret: 32 random bytes made on the coordinator's first start, kept 0600 in its data dir, never served.

Everything a node must not be able to predict or forge is derived from it (`RunSecret.derive`): the prompt stream
(so that nobody can tell which prompts the next lease holds, and pick the leases worth taking), and the MAC of the
stateless registration challenges. Coordinator processes sharing one database share the data dir, and so this file.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

SECRET_FILE = "run.secret"
SECRET_BYTES = 32


class RunSecret:
    """The secret in `<data_dir>/run.secret`, made (mode 0600) when missing."""

    def __init__(self, data_dir: Path):
        self.path = data_dir / SECRET_FILE
        self._key = self._load_or_create()

    def _load_or_create(self) -> bytes:
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            key = secrets.token_bytes(SECRET_BYTES)
            tmp = self.path.with_name(f".{SECRET_FILE}.{secrets.token_hex(4)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key.hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path)  # atomic, and fails if another process made it first: then theirs is used
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        mode = self.path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(f"{self.path} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
        key = bytes.fromhex(self.path.read_text().strip())
        if len(key) != SECRET_BYTES:
            raise ValueError(f"{self.path} does not hold {SECRET_BYTES} hex-encoded bytes")
        return key

    def derive(self, label: str, message: bytes = b"") -> bytes:
        """HMAC-SHA256 of `message` under the key for `label`: one independent secret per use."""
        sub = hmac.new(self._key, label.encode(), hashlib.sha256).digest()
        return hmac.new(sub, message, hashlib.sha256).digest()
