"""Hoarding against a real pool (bench/byzantine.py, adaptive part): honest nodes' accepted groups per second with a
hoarder next to them, against the same pool without one, with backpressure on (the demo's setting).

Everything is real and runs at once in this process: the coordinator (uvicorn, SQLite, its default rate limits),
honest `ScriptedNode`s looping lease / generate / submit in threads (each from a loopback address of its own: a
machine of its own to the coordinator's per-source rules), the real verifier draining the queue, and a trainer
that takes and acknowledges every accepted group at once. The hoarder leases the most it is given and never
submits, asking again five times a second; `sybil` makes a fresh identity (as fast as the registration limits of
its one address allow) whenever its current one is refused or starved.

Each arm runs `duration_s` on a fresh pool; arms alternate `repeats` times. `admission` replaces the coordinator's
admission settings: `UNADMITTED` is the accounting before issue 16 (any identity may hold up to
max_outstanding_leases x 256 prompts, all counted against the buffer), to show what the defaults prevent.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from swarmrl.coordinator.ratelimit import RateLimitConfig
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.testing.byzantine.harness import Pool, ScriptedNode, open_pool

UNADMITTED = {"new_identity_prompts": m.MAX_PROMPTS_PER_LEASE, "max_identity_prompts": 4 * m.MAX_PROMPTS_PER_LEASE,
              "proven_after_groups": 0, "unproven_per_source": 10**6, "max_unproven_prompts": 10**6}
HOARDER_SOURCE = "127.0.0.99"
POLL_S = 0.2
NODE_POLL_S = 0.1


class Hoarder:
    """Leases all it may and never submits; `sybil`: a new identity whenever the current one gets nothing."""

    def __init__(self, pool: Pool, sybil: bool):
        self.pool, self.sybil = pool, sybil
        self.identities: list[str] = []
        self.prompts = 0
        self.refusals = 0
        self.client: CoordinatorClient | None = None

    def _new_identity(self) -> None:
        client = CoordinatorClient(self.pool.url, Identity.generate(), retries=0,
                                   coordinator_key=self.pool.coordinator_key,
                                   transport=httpx.HTTPTransport(local_address=HOARDER_SOURCE))
        client.register(name=f"hoarder{len(self.identities)}")
        self.identities.append(client.identity.node_id)
        self.client = client

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                if self.client is None:
                    self._new_identity()
                lease = self.client.lease(m.MAX_PROMPTS_PER_LEASE, 0)  # type: ignore[union-attr]
                if lease is not None:
                    self.prompts += len(lease.prompts)
                    continue
            except CoordinatorError:
                self.refusals += 1  # over its allowance, its rate, or its registrations
            if self.sybil:
                self.client = None
            stop.wait(POLL_S)


def _honest(node: ScriptedNode, stop: threading.Event, errors: list[str]) -> None:
    while not stop.is_set():
        try:
            node.sync()
            if not node.step():
                stop.wait(NODE_POLL_S)  # no work now (backpressure): poll again shortly, as the demo's nodes do
        except CoordinatorError as e:
            errors.append(e.reason)
            stop.wait(0.2)
    if node.engine is not None:
        node.engine.close()


def _verifier(pool: Pool, stop: threading.Event) -> None:
    while not stop.is_set():
        if not pool.verifier.poll_once():
            stop.wait(0.05)


def _trainer(pool: Pool, stop: threading.Event) -> None:
    cursor = 0
    while not stop.is_set():
        batch = pool.op.training_batch(after_id=cursor, limit=4096, wait_s=0.5)
        if batch.groups:
            cursor = batch.groups[-1].group_id
            pool.op.ack(cursor)


def arm(root: Path, ckpt: Path, hoarder: str | None, duration_s: float, honest_nodes: int, engine: str,
        max_buffered: int, admission: dict[str, Any] | None) -> dict[str, Any]:
    """One arm: honest nodes (and the hoarder, if any) for `duration_s` on a fresh pool."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    coordinator: dict[str, Any] = {"max_buffered_groups": max_buffered, "lease_ttl_s": 30.0,
                                   "max_outstanding_leases": 4, "rate_limits": RateLimitConfig()}
    if admission is not None:
        coordinator["admission"] = admission
    with open_pool(root, ckpt, **coordinator) as pool:
        honest = [pool.node(name=f"honest{i}", engine=engine, max_prompts=8, source=f"127.0.0.{10 + i}")
                  for i in range(honest_nodes)]
        for h in honest:  # engines are built one at a time, before the clock starts (loading is not thread-safe)
            h.load_ready_weights(pool.cfg.run.sampling.temperature)
        stop, errors = threading.Event(), []
        threads = [threading.Thread(target=_honest, args=(h, stop, errors), daemon=True) for h in honest]
        threads += [threading.Thread(target=f, args=(pool, stop), daemon=True) for f in (_verifier, _trainer)]
        bad = Hoarder(pool, sybil=hoarder == "sybil") if hoarder is not None else None
        if bad is not None:
            threads.append(threading.Thread(target=bad.run, args=(stop,), daemon=True))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        stop.wait(duration_s)
        stop.set()
        wall = time.monotonic() - t0
        for t in threads:
            t.join(timeout=120)
        ids = {h.node_id for h in honest}
        groups = [g for g in pool.groups() if g["node_id"] in ids]
        accepted = sum(g["status"] == "accepted" for g in groups)
        nodes = {n.node_id: n for n in pool.op.nodes()}
    out: dict[str, Any] = {
        "hoarder": hoarder, "wall_s": round(wall, 1), "honest_accepted": accepted,
        "honest_accepted_per_s": round(accepted / wall, 3), "honest_rejected": sum(g["status"] == "rejected"
                                                                                for g in groups),
        "honest_refusals": len(errors), "honest_refusal_examples": sorted(set(errors))[:3]}
    if bad is not None:
        rows = [nodes[i] for i in bad.identities if i in nodes]
        out.update(hoarder_identities=len(bad.identities), hoarder_prompts=bad.prompts,
                   hoarder_refusals=bad.refusals, hoarder_abandoned=sum(r.prompts_abandoned for r in rows),
                   hoarder_allowance_at_end=rows[-1].lease_allowance if rows else None)
    return out


def section(root: Path, ckpt: Path, duration_s: float = 60.0, repeats: int = 2, honest_nodes: int = 2,
            engine: str = "torch", max_buffered: int = 64, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Alternating arms: no hoarder, one hoarder, sybil hoarders (default admission), and one hoarder against the
    accounting before issue 16 (`UNADMITTED`). `honest_throughput_under_hoarding` is the honest accepted groups per
    second with the one hoarder over those without; the sybil and the unadmitted ratios (over the same baseline) go
    alongside."""
    plan = [("default", None), ("default", "one"), ("default", "sybil"), ("unadmitted", "one")]
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(repeats):
        for rules, hoarder in plan:
            name = f"{rules}/{hoarder or 'none'}"
            res = arm(root / f"{name.replace('/', '-')}-{r}", ckpt, hoarder, duration_s, honest_nodes, engine,
                      max_buffered, UNADMITTED if rules == "unadmitted" else None)
            log(f"hoarding {name} #{r}: {res}")
            runs.setdefault(name, []).append(res)

    def rate(name: str) -> float:
        return sum(x["honest_accepted"] for x in runs[name]) / max(sum(x["wall_s"] for x in runs[name]), 1e-9)

    def ratio(a: str, b: str) -> float | None:
        return round(rate(a) / rate(b), 3) if rate(b) > 0 else None

    return {
        "honest_throughput_under_hoarding": ratio("default/one", "default/none"),
        "honest_throughput_under_sybil_hoarding": ratio("default/sybil", "default/none"),
        "honest_throughput_under_hoarding_unadmitted": ratio("unadmitted/one", "default/none"),
        "honest_accepted_per_s": {k: round(rate(k), 3) for k in runs},
        "settings": {"duration_s": duration_s, "repeats": repeats, "honest_nodes": honest_nodes, "engine": engine,
                     "max_buffered_groups": max_buffered, "lease_ttl_s": 30.0},
        "runs": runs,
    }
