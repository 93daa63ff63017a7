"""Hoarding against a real pool (bench/byzantine.py, adaptive part): honest nodes' accepted groups per second with a
hoarder next to them, against the same pool without one, with backpressure on (the demo's setting).

Everything is real and runs at once in this process: the coordinator (uvicorn, SQLite, its default rate limits),
honest `ScriptedNode`s looping lease / generate / submit in threads (each from a loopback address of its own: a
machine of its own to the coordinator's per-source rules), the real verifier draining the queue, and a trainer
that takes and acknowledges every accepted group at once. The hoarder leases the most it is given and never
submits, asking again five times a second; `sybil` makes a fresh identity (as fast as the registration limits of
its one address allow) whenever its current one is refused or starved; `sybil4` is four such hoarders, each from an
address of its own (the newcomers' share is divided by source). `proven` is a hoarder with a record: before the
clock starts it does honest work (its own torch engine, verified and trained on) until it has twice
`proven_after_groups` accepted groups and an allowance as large as one identity may hold (`admission.identity_cap`:
its allowance grows with time too, so this takes as long as that needs), then it leases all it may and never
submits, and once its leases have expired it leases what its allowance still allows, again and again.

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

from swarmrl.coordinator.admission import identity_cap
from swarmrl.coordinator.ratelimit import RateLimitConfig
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.testing.byzantine.harness import Pool, ScriptedNode, open_pool

UNADMITTED = {"new_identity_prompts": m.MAX_PROMPTS_PER_LEASE, "max_identity_prompts": 4 * m.MAX_PROMPTS_PER_LEASE,
              "proven_after_groups": 0, "unproven_per_source": 10**6, "max_unproven_prompts": 10**6}
HOARDER_SOURCE = "127.0.0.99"
SYBIL_SOURCES = tuple(f"127.0.0.{90 + i}" for i in range(4))
PROVEN_HOARDER_SOURCE = "127.0.0.80"
POLL_S = 0.2
NODE_POLL_S = 0.1


class Hoarder:
    """Leases all it may and never submits; `sybil`: a new identity whenever the current one gets nothing."""

    def __init__(self, pool: Pool, sybil: bool, source: str = HOARDER_SOURCE):
        self.pool, self.sybil, self.source = pool, sybil, source
        self.identities: list[str] = []
        self.prompts = 0
        self.refusals = 0
        self.client: CoordinatorClient | None = None

    def _new_identity(self) -> None:
        client = CoordinatorClient(self.pool.url, Identity.generate(), retries=0,
                                   coordinator_key=self.pool.coordinator_key,
                                   transport=httpx.HTTPTransport(local_address=self.source))
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


class ProvenHoarder(Hoarder):
    """An identity that earns a record by honest work (`earn`, before the clock starts), then only hoards."""

    def __init__(self, pool: Pool, engine: str):
        super().__init__(pool, sybil=False, source=PROVEN_HOARDER_SOURCE)
        self.node = pool.node(name="proven-hoarder", engine=engine, max_prompts=8, source=PROVEN_HOARDER_SOURCE)
        self.identities.append(self.node.node_id)
        self.warmup_accepted = 0
        self.warmup_s = 0.0

    def earn(self, groups: int, allowance: int, stop: threading.Event) -> None:
        """Honest work until `groups` of its groups were accepted and its allowance is `allowance` (the verifier and
        trainer threads run); the lease it holds then is its first hoard."""
        self.node.load_ready_weights(self.pool.cfg.run.sampling.temperature)
        t0 = time.monotonic()
        self.warmup_accepted = _work_until(self.pool, self.node, groups, stop, allowance)
        self.warmup_s = round(time.monotonic() - t0, 1)
        if self.node.engine is not None:
            self.node.engine.close()
        in_hand = self.node.work.next_lease
        self.prompts += len(in_hand.prompts) if in_hand is not None else 0
        self.client = self.node.client


def _work_until(pool: Pool, node: ScriptedNode, groups: int, stop: threading.Event, allowance: int = 0) -> int:
    """Honest steps of `node` until `groups` of its groups were accepted and its allowance (as the coordinator's
    status shows it) is `allowance`; how many were accepted."""
    while not stop.is_set():
        row = next((n for n in pool.op.nodes() if n.node_id == node.node_id), None)
        if row is not None and row.groups_accepted >= groups and row.lease_allowance >= allowance:
            return row.groups_accepted
        node.sync()
        if not node.step():
            stop.wait(NODE_POLL_S)
    return 0


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
        max_buffered: int, admission: dict[str, Any] | None, warm_honest: bool = False) -> dict[str, Any]:
    """One arm: honest nodes (and the hoarder, if any) for `duration_s` on a fresh pool; `warm_honest`: the honest
    nodes are proven (`proven_after_groups` accepted groups each) before the clock starts. Only groups submitted
    after it count."""
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
        helpers = [threading.Thread(target=f, args=(pool, stop), daemon=True) for f in (_verifier, _trainer)]
        for t in helpers:
            t.start()
        bad: list[Hoarder] = []
        if hoarder == "proven":  # first: the lease it holds at the end stays open into the measured time
            proven = ProvenHoarder(pool, engine)
            proven.earn(2 * pool.cfg.admission.proven_after_groups,
                        identity_cap(pool.cfg.admission, pool.cfg.max_buffered_groups), stop)
            bad.append(proven)
        if warm_honest:  # proven honest nodes: their record earned before the clock starts
            for h in honest:
                _work_until(pool, h, pool.cfg.admission.proven_after_groups, stop)
        if hoarder == "sybil4":
            bad += [Hoarder(pool, sybil=True, source=src) for src in SYBIL_SOURCES]
        elif hoarder in ("one", "sybil"):
            bad.append(Hoarder(pool, sybil=hoarder == "sybil"))
        threads += [threading.Thread(target=b.run, args=(stop,), daemon=True) for b in bad]
        before = {g["id"] for g in pool.groups()}
        t0 = time.monotonic()
        for t in threads:
            t.start()
        threads += helpers
        stop.wait(duration_s)
        stop.set()
        wall = time.monotonic() - t0
        for t in threads:
            t.join(timeout=120)
        ids = {h.node_id for h in honest}
        groups = [g for g in pool.groups() if g["node_id"] in ids and g["id"] not in before]
        accepted = sum(g["status"] == "accepted" for g in groups)
        nodes = {n.node_id: n for n in pool.op.nodes()}
    out: dict[str, Any] = {
        "hoarder": hoarder, "wall_s": round(wall, 1), "honest_accepted": accepted,
        "honest_accepted_per_s": round(accepted / wall, 3), "honest_rejected": sum(g["status"] == "rejected"
                                                                                for g in groups),
        "honest_refusals": len(errors), "honest_refusal_examples": sorted(set(errors))[:3]}
    if bad:
        rows = [nodes[i] for b in bad for i in b.identities if i in nodes]
        out.update(hoarder_identities=len(rows), hoarder_prompts=sum(b.prompts for b in bad),
                   hoarder_refusals=sum(b.refusals for b in bad),
                   hoarder_abandoned=sum(r.prompts_abandoned for r in rows),
                   hoarder_allowance_at_end=rows[-1].lease_allowance if rows else None,
                   hoarder_sources=len({b.source for b in bad}))
        if isinstance(bad[0], ProvenHoarder):
            out.update(hoarder_warmup_accepted=bad[0].warmup_accepted, hoarder_warmup_s=bad[0].warmup_s)
    return out


ARMS = ("default/none", "default/one", "default/sybil4", "proven/none", "proven/proven")
"""Arm names, rules/hoarder: `default` honest nodes start as newcomers; `proven` honest nodes are proven before
the clock starts (`arm`'s warm_honest); `unadmitted` (not run by default): default honest nodes, the hoarder against
`UNADMITTED`."""


def section(root: Path, ckpt: Path, duration_s: float = 60.0, repeats: int = 3, honest_nodes: int = 2,
            engine: str = "torch", max_buffered: int = 64, arms: tuple[str, ...] = ARMS,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """`arms` alternating `repeats` times. Each figure is the honest accepted groups per second in one arm over
    those in its baseline (`.../none` of the same rules), pooled over the repeats, with the range of the per-repeat
    ratios beside it (`..._range`): `honest_throughput_under_hoarding` (one hoarder),
    `newcomer_throughput_under_sybil_hoarding` (newcomers against sybil hoarders from four addresses),
    `proven_throughput_under_proven_hoarder` (proven honest nodes against a hoarder with a record)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(repeats):
        for name in arms:
            rules, hoarder = name.split("/")
            res = arm(root / f"{name.replace('/', '-')}-{r}", ckpt, None if hoarder == "none" else hoarder,
                      duration_s, honest_nodes, engine, max_buffered, UNADMITTED if rules == "unadmitted" else None,
                      warm_honest=rules == "proven")
            log(f"hoarding {name} #{r}: {res}")
            runs.setdefault(name, []).append(res)

    def rate(xs: list[dict[str, Any]]) -> float:
        return sum(x["honest_accepted"] for x in xs) / max(sum(x["wall_s"] for x in xs), 1e-9)

    def ratio(a: str, b: str) -> float | None:
        if a not in runs or b not in runs or rate(runs[b]) <= 0:
            return None
        return round(rate(runs[a]) / rate(runs[b]), 3)

    def spread(a: str, b: str) -> list[float] | None:
        if a not in runs or b not in runs:
            return None
        each = [rate([x]) / rate([y]) for x, y in zip(runs[a], runs[b], strict=True) if rate([y]) > 0]
        return [round(min(each), 3), round(max(each), 3)] if each else None

    figures = {"honest_throughput_under_hoarding": ("default/one", "default/none"),
               "newcomer_throughput_under_sybil_hoarding": ("default/sybil4", "default/none"),
               "proven_throughput_under_proven_hoarder": ("proven/proven", "proven/none"),
               "honest_throughput_under_sybil_hoarding": ("default/sybil", "default/none"),
               "honest_throughput_under_hoarding_unadmitted": ("unadmitted/one", "default/none")}
    out: dict[str, Any] = {}
    for key, (a, b) in figures.items():
        if a in runs:
            out[key], out[f"{key}_range"] = ratio(a, b), spread(a, b)
    out.update(honest_accepted_per_s={k: round(rate(v), 3) for k, v in runs.items()},
               settings={"duration_s": duration_s, "repeats": repeats, "honest_nodes": honest_nodes,
                         "engine": engine, "max_buffered_groups": max_buffered, "lease_ttl_s": 30.0},
               runs=runs)
    return out
