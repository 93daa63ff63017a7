"""Benchmark: what refusing a large unauthenticated request costs the coordinator, now and before issue 16.

Side by side, on the same 8 MiB body (the attacker's choice: a payload of about 4 million small numbers), the
coordinator's CPU seconds per refused request:

- `envelope_parse_s`: what the coordinator did before: parse the whole envelope (its payload as a pydantic
  `dict[str, Any]`), encode the payload canonically again (checking every number is finite), then check the
  signature (the old `auth.parse_envelope` + `signing.verify`, kept below as the baseline), for a request whose
  signature is bad;
- `unsigned_s`, `forged_s`: the gate now, on a request with no signature header, and with a header whose signature
  is bad (`Gate.check_header`): the body is never read;
- `fresh_key_wrong_body_s`: a correctly signed header of a key that is no node, over another body: the sha256 of
  the body is all it costs (`check_body`).

    python bench/admission.py [--mib 8] [--repeats 20]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from pydantic import BaseModel

from swarmrl.coordinator.auth import Refused
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.store import Store
from swarmrl.coordinator.gate import Gate
from swarmrl.coordinator.ratelimit import RateLimitConfig
from swarmrl.coordinator.registry import require_node
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity, verify_signature
from swarmrl.protocol.signing import pool_id, sign


def body_of(mib: int) -> bytes:
    """About `mib` MiB of JSON: one list of small numbers, the most elements per byte an attacker can send."""
    return b'{"x":[' + b",".join([b"0"] * ((mib << 20) // 2)) + b"]}"


class _OldEnvelope(BaseModel):
    """The envelope before issue 16: the payload inside the signed JSON (`protocol.signing.SignedEnvelope`)."""

    kind: str
    public_key: str
    nonce: str
    timestamp: float
    payload: dict[str, Any]
    signature: str


def _old_canonical(obj: Any) -> bytes:
    """`canonical_json` before issue 16: a walk over every value, then one encoding."""

    def check(o: Any) -> None:
        if isinstance(o, float) and not math.isfinite(o):
            raise ValueError("non-finite numbers cannot be signed")
        if isinstance(o, dict):
            for v in o.values():
                check(v)
        elif isinstance(o, list | tuple):
            for v in o:
                check(v)

    check(obj)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which must raise Refused or return)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            fn()
        except Refused:
            pass
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    body = body_of(args.mib)
    coordinator, node = Identity.generate(), Identity.generate()
    with TemporaryDirectory() as tmp:
        cfg = CoordinatorConfig(data_dir=Path(tmp), rate_limits=RateLimitConfig.off())
        store = Store(cfg.resolved_store_url)
        pool = pool_id(cfg.run.run_id, coordinator.public_key_hex)
        gate = Gate(store, cfg, time.time, pool, lambda node_id: store.read(lambda tx: require_node(tx, node_id)))

        raw = (b'{"kind":"submit","public_key":"' + node.public_key_hex.encode() + b'","nonce":"' + b"0" * 32 +
               b'","timestamp":0.0,"payload":' + body + b',"signature":"' + b"0" * 128 + b'"}')

        def envelope_parse() -> None:  # before: the whole envelope parsed, re-encoded, then verified
            env = _OldEnvelope.model_validate_json(raw)
            verify_signature(env.public_key, _old_canonical({"header": {}, "payload": env.payload}), env.signature)

        good = sign(node, m.KIND_SUBMIT, pool, body)
        forged = good.model_copy(update={"sig": "0" * 128}).header()
        fresh = lambda: gate.open(gate.check_header(sign(node, m.KIND_SUBMIT, pool, b"{}").header(),  # noqa: E731
                                                    m.KIND_SUBMIT, "node"), body, m.RolloutSubmission, "node")
        res = {
            "body_mib": round(len(body) / 2**20, 2),
            "envelope_parse_s": timed(envelope_parse, max(3, args.repeats // 5)),
            "unsigned_s": timed(lambda: gate.check_header(None, m.KIND_SUBMIT, "node"), args.repeats),
            "forged_s": timed(lambda: gate.check_header(forged, m.KIND_SUBMIT, "node"), args.repeats),
            "fresh_key_wrong_body_s": timed(fresh, args.repeats),
        }
        store.close()
    res["amplification_before_over_now"] = round(res["envelope_parse_s"] / res["fresh_key_wrong_body_s"], 1)
    print(json.dumps({k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in res.items()}), flush=True)


if __name__ == "__main__":
    main()
