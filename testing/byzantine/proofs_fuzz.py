"""Bad activation proofs a cheating node might send: garbage, truncated, a zero modulus, a proof of other
states (random ones, or another rollout's), or none at all."""

from __future__ import annotations

import base64
import random
import struct

import torch

from swarmrl.node.proof import build_proof
from swarmrl.protocol import messages as m
from swarmrl.protocol import proofs


def forged_proof(r: m.Rollout, rng: random.Random) -> str | None:
    n = len(r.completion_ids)
    valid = base64.b64decode(r.proof) if r.proof else b""
    kind = rng.randrange(6)
    if kind == 0 or not valid:
        return None
    if kind == 1:
        return base64.b64encode(rng.randbytes(len(valid))).decode()
    if kind == 2:
        return base64.b64encode(valid[: rng.randrange(1, len(valid))]).decode()
    if kind == 3:
        raw = bytearray(valid)
        struct.pack_into("<H", raw, 16, 0)  # modulus 0: crashed the published toploc verifier
        return base64.b64encode(bytes(raw)).decode()
    hidden = proofs.decode(r.proof).hidden_size
    if kind == 4:  # a well-formed proof of made-up states
        return build_proof(torch.randn(n, hidden, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))))
    raw = bytearray(valid)  # a well-formed proof with one coefficient changed
    off = 18 + 2 * rng.randrange((len(raw) - 18) // 2)
    (c,) = struct.unpack_from("<H", raw, off)
    struct.pack_into("<H", raw, off, (c + 1 + rng.randrange(1000)) % proofs.PRIMES[-1])
    return base64.b64encode(bytes(raw)).decode()
