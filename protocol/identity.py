"""Ed25519 identities: a node, verifier, trainer or coordinator is its key pair.

The node id is derived from the public key, so an id cannot be claimed without the matching private key.
Private keys are written with 0600 permissions and refused when group or world can read them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

PUBLIC_KEY_HEX_LEN = 64
SIGNATURE_HEX_LEN = 128


class IdentityError(Exception):
    """A key file is missing, malformed or too widely readable."""


def node_id_from_public_key(public_key_hex: str) -> str:
    """The stable id of a key holder: the first 20 bytes of sha256(raw public key), hex."""
    raw = bytes.fromhex(public_key_hex)
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key has 32 bytes")
    return hashlib.sha256(raw).hexdigest()[:40]


@functools.lru_cache(maxsize=4096)
def _public_key(public_key_hex: str) -> Ed25519PublicKey:
    # Loading a key costs about a fifth of a verification, and the same few keys sign most requests.
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex))


def verify_signature(public_key_hex: str, message: bytes, signature_hex: str) -> bool:
    """True when `signature_hex` is a valid Ed25519 signature of `message` by `public_key_hex`.

    Never raises on malformed input: a bad key or signature encoding is simply not valid.
    """
    try:
        _public_key(public_key_hex).verify(bytes.fromhex(signature_hex), message)
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair with the id derived from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @functools.cached_property
    def public_key_hex(self) -> str:  # derived once: every signature names the key
        return self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()

    @functools.cached_property
    def node_id(self) -> str:
        return node_id_from_public_key(self.public_key_hex)

    def sign(self, message: bytes) -> str:
        """The hex signature of `message`."""
        return self.private_key.sign(message).hex()

    def save(self, path: str | Path) -> None:
        """Write the private key as PKCS8 PEM, readable by the owner only (0600)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self.private_key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        os.chmod(path, 0o600)  # O_CREAT's mode is ignored when the file already existed

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        """Read a key written by `save`; refuse one that group or others can read."""
        path = Path(path)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise IdentityError(f"no key file at {path}: make one with `swarmrl keys make {path}`, or fix "
                                "key_path") from None
        if stat.S_ISDIR(mode):
            raise IdentityError(f"key path {path} is a directory, not a key file: set key_path to a file (one "
                                "inside it will do)")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityError(f"key file {path} is readable by others (mode {oct(mode & 0o777)}): "
                                f"chmod 600 {path}")
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            key = load_pem_private_key(path.read_bytes(), password=None)
        except PermissionError:
            raise IdentityError(f"key file {path} cannot be read by this user: chown it to the user running this "
                                "role") from None
        except ValueError:
            raise IdentityError(f"key file {path} is not a PEM private key: point key_path at a key made by "
                                "`swarmrl keys make`") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"key file {path} does not hold an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """The identity at `path`, made and saved there first if the file does not exist."""
        path = Path(path)
        if path.exists():
            return cls.load(path)
        ident = cls.generate()
        ident.save(path)
        return ident
