"""A node's membership of its pool: joining, registering, the coordinator key it trusts, what it does about a
refusal, its receipts and its heartbeats.

A coordinator that forgot the node (a new database) or runs another run is registered with again; only a refusal
that waiting cannot change stops the node (`refusal.permanent`, decided on the refusal's code). The key is settled
(configured, pinned on first use, or refused) before anything is signed for it.

`Membership` is built from `MembershipConfig` (the node config's fields it reads) and talks to the coordinator
through `MembershipClient`, the few calls it makes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import httpx

from swarmrl.node.config import NodeConfig
from swarmrl.node.engines import resolve_engine_kind
from swarmrl.node.receipts import RECEIPTS_FILE, ReceiptBook, collect_receipts
from swarmrl.node.refusal import PermanentRefusal, is_other_pool, is_unknown_node, permanent, pinned_coordinator_key
from swarmrl.node.stats import NodeStats
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.messages import MAX_NODE_SECONDS, Registered, RunInfo
from swarmrl.protocol.receipts import ReceiptPage
from swarmrl.runtime.client import CoordinatorError, UntrustedResponse
from swarmrl.runtime.retry import RetryPolicy

log = logging.getLogger("swarmrl.node")


class MembershipClient(Protocol):
    """The coordinator calls a node's membership makes (`runtime.client.CoordinatorClient` has them all), and the
    client settings it sets: the key it trusts, and how long the first registration waits."""

    coordinator_key: str | None
    retry: RetryPolicy

    def info(self, trust: bool = True) -> RunInfo: ...

    def trust(self, run: RunInfo) -> RunInfo: ...

    def register(self, name: str = "", engine: str = "") -> Registered: ...

    def heartbeat(self, held_version: int, status: str = "", idle_s: float = 0.0, busy_s: float = 0.0) -> None: ...

    def receipts(self, after: int = 0, limit: int = 200) -> ReceiptPage: ...


@dataclass(frozen=True)
class MembershipConfig:
    """The node config's fields the membership reads (`engine`: the engine kind it registers with)."""

    coordinator_url: str
    coordinator_key: str | None
    key_path: Path
    name: str
    engine: str
    receipts_path: Path
    join_timeout_s: float | None
    heartbeat_interval_s: float
    receipts_interval_s: float

    @classmethod
    def from_node(cls, cfg: NodeConfig) -> MembershipConfig:
        return cls(coordinator_url=cfg.coordinator_url, coordinator_key=cfg.coordinator_key, key_path=cfg.key_path,
                   name=cfg.name, engine=resolve_engine_kind(cfg.engine), receipts_path=cfg.work_dir / RECEIPTS_FILE,
                   join_timeout_s=cfg.join_timeout_s, heartbeat_interval_s=cfg.heartbeat_interval_s,
                   receipts_interval_s=cfg.receipts_interval_s)


class Membership:
    """This node's standing with one pool. `run` is the run description of the last registration (None before
    the first), `coordinator_key` the key trusted ("" until settled), `receipts` the book of receipts held (None
    before `join`)."""

    def __init__(self, cfg: MembershipConfig, client: MembershipClient, identity: Identity, stats: NodeStats,
                 stop: threading.Event):
        self.cfg, self.client, self.identity, self.stats, self._stop = cfg, client, identity, stats, stop
        self.coordinator_key = cfg.coordinator_key or ""
        self.run: RunInfo | None = None
        self.receipts: ReceiptBook | None = None
        self._last_beat = self._last_receipts = 0.0  # set by join

    def join(self) -> Registered:
        """Register with the pool and open the receipt book. Only this first registration gives up, after
        join_timeout_s (when set), on a coordinator it cannot reach: ConnectionError then, with what to check."""
        policy = self.client.retry
        self.client.retry = replace(policy, give_up_after_s=self.cfg.join_timeout_s)
        try:
            reg = self.register()
        except httpx.TransportError as e:
            if self._stop.is_set():  # given up because the node is stopping, not for join_timeout_s
                raise
            raise ConnectionError(f"could not reach the coordinator at {self.cfg.coordinator_url} for "
                                  f"{self.cfg.join_timeout_s:.0f} s (join_timeout_s): {e}; `swarmrl node doctor` "
                                  "checks the URL and the network") from e
        finally:
            self.client.retry = policy
        self.receipts = ReceiptBook(self.cfg.receipts_path, self.identity.node_id, self.coordinator_key)
        self.stats.receipts, self.stats.receipt_tokens = self.receipts.count, self.receipts.tokens
        self._last_beat, self._last_receipts = 0.0, time.time()  # a heartbeat at once, receipts after an interval
        return reg

    def register(self) -> Registered:
        """Register (waiting out a coordinator that cannot be reached), check its key against the one trusted,
        and take its run description. PermanentRefusal when banned or when the key is not the trusted one."""
        c = self.cfg
        try:
            info = self.client.info(trust=False)
            self.coordinator_key = pinned_coordinator_key(c.coordinator_key, info.coordinator_key, c.coordinator_url,
                                                          c.key_path)
            self.client.coordinator_key = self.coordinator_key
            self.client.trust(info)
            reg = self.client.register(name=c.name or self.identity.node_id[:8], engine=c.engine)
        except UntrustedResponse as e:
            raise PermanentRefusal(f"the coordinator at {c.coordinator_url} did not prove its key: "
                                   f"{e.reason}") from None
        except CoordinatorError as e:
            raise permanent(e, c.coordinator_url, c.key_path) or e from None
        if self.run is not None and reg.run.spec != self.run.spec:
            log.warning("the coordinator's run description changed: %s", reg.run.spec.mismatch(self.run.spec))
        self.run = reg.run
        self.stats.registrations += 1
        self.stats.current_version = max(self.stats.current_version, reg.run.current_version)
        return reg

    def refused(self, e: CoordinatorError) -> None:
        """Deal with a refusal met in the main loop: stop (PermanentRefusal), register again, or note it and go on."""
        stop = permanent(e, self.cfg.coordinator_url, self.cfg.key_path)
        if stop is not None:
            raise stop
        self.stats.last_error = e.reason
        if isinstance(e, UntrustedResponse):  # e.g. a lease rewritten on the way: not acted on
            self.stats.untrusted += 1
            log.warning("%s", e.reason)
            return
        if is_unknown_node(e) or is_other_pool(e):
            log.warning("the coordinator does not know this node (a new database, a new run, another key?): "
                        "registering again")
            try:
                self.register()
            except CoordinatorError as again:  # e.g. too many challenges at once: the main loop backs off
                self.stats.last_error = again.reason
                log.warning("registering again was refused: %s", again.reason)
            return
        log.warning("coordinator refused: %s", e.reason)

    def keep_up(self, worked: bool) -> None:
        """Between leases: a heartbeat (held version, generating or idle, idle and busy seconds) every
        heartbeat_interval_s, and the receipts collected every receipts_interval_s. A refusal of the heartbeat is
        raised (the main loop gives it to `refused`)."""
        if time.time() - self._last_beat > self.cfg.heartbeat_interval_s:
            self._last_beat = time.time()
            s = self.stats
            self.client.heartbeat(s.held_version, status="generating" if worked else "idle",
                                  idle_s=min(s.idle_seconds, MAX_NODE_SECONDS),
                                  busy_s=min(s.busy_seconds, MAX_NODE_SECONDS))
        if time.time() - self._last_receipts > self.cfg.receipts_interval_s:
            self._last_receipts = time.time()
            self.collect_receipts()

    def collect_receipts(self) -> int:
        """Collect the receipts the coordinator signed for this node since the last ones held (`node.receipts`);
        how many new ones were kept. A refusal (e.g. a coordinator without receipts) is logged, not raised."""
        assert self.receipts is not None
        try:
            new = collect_receipts(self.client, self.receipts)
        except CoordinatorError as e:
            log.warning("collecting receipts was refused: %s", e.reason)
            return 0
        self.stats.receipts, self.stats.receipt_tokens = self.receipts.count, self.receipts.tokens
        return new
