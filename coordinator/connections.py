"""Bounded connections: how many a source may hold, how long a request's head and body may take to arrive, and room
kept for the sources of nodes with a record.

Without these, a connection that never finishes its request's head is held for ever: one machine opening connections
until the process runs out of file descriptors locked every honest client out (issue 25: 0 of 51 served). Each
coordinator process keeps its own `ConnectionGuard` (`coordinator.httpguard` applies it to every connection):

- a connection's request head (request line and headers) must be complete within `header_timeout_s` of the
  connection's start, or of the end of the previous response on a kept-alive connection;
- its body within `body_timeout_s` plus its declared length at `body_min_bytes_per_s` (a declared length counted at
  most up to the largest body any endpoint accepts);
- a source (the peer's address; IPv6 per /64, `ratelimit.normalise_source`) holds at most `max_per_source`
  connections, and never more than a quarter of the connections open to sources without a record; a connection over
  it is answered 429 and closed at once;
- of `max_connections`, `reserved_share` may only be taken by sources with a record: those from which an operator,
  or a node with at least `admission.proven_after_groups` accepted groups, was answered a signed request within
  `record_ttl_s` (`httpguard.RecordKeeper`). A connection over the cap of its kind is answered 503 and closed.

A connection that misses its deadline is closed without an answer (the client is not reading one: it is still
sending). Deadlines are swept on the event loop (every second, or a quarter of the shorter deadline), so that a
request arms no timer of its own: a connection is closed at its deadline or up to one sweep later, never before.

Behind a reverse proxy (`rate_limits.source_header` set), connections from `rate_limits.trusted_proxies` are exempt
from the per-source cap and count as recorded: the proxy holds the clients' connections and bounds them itself.
"""

from __future__ import annotations

import asyncio
import math
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.coordinator.ratelimit import RateLimitConfig, normalise_source
from swarmrl.protocol.refusals import RefusalCode


class ConnectionConfig(BaseModel):
    """The bounds on one coordinator process's connections (module `coordinator.connections`)."""

    model_config = ConfigDict(extra="forbid")

    header_timeout_s: float = Field(10.0, gt=0, description="Seconds a connection has to send a request's whole "
                                    "head (from its start, or from the previous response's end); then it is closed.")
    body_timeout_s: float = Field(30.0, gt=0, description="Seconds a request's body may take beyond what its "
                                  "length needs at body_min_bytes_per_s; then the connection is closed.")
    body_min_bytes_per_s: float = Field(64 * 1024, gt=0, description="The slowest upload served in full: a body of "
                                        "n bytes has body_timeout_s + n / this to arrive.")
    max_per_source: int = Field(128, ge=1, description="Connections one source (address, IPv6 /64) may hold at "
                                "once, and never more than a quarter of those open to sources without a record; "
                                "more are answered 429 and closed.")
    max_connections: int | None = Field(
        None, ge=8, description="Connections this process holds at once; more are answered 503 and closed. None: "
        "half the process's open-file limit (the rest is for the store, the shards and the process itself).")
    reserved_share: float = Field(0.25, ge=0, lt=1, description="The part of max_connections that only sources with a "
                                  "record (an operator, or a proven node, answered from there) may take.")
    record_ttl_s: float = Field(86400.0, gt=0, description="Seconds a source keeps its record after a signed request "
                                "of an operator or a proven node from it was last answered.")
    max_records: int = Field(100_000, ge=100, description="Sources with a record kept; the least recently confirmed "
                             "go first.")


class Connection(Protocol):
    """What the guard needs of a connection: its deadline and a way to close it."""

    deadline: float

    def expire(self) -> str:
        """Close the connection, which missed its deadline; which one it missed: "header" or "body"."""


def open_file_limit() -> int:
    """This process's soft limit on open files."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit (no privilege needed), so that connections are
    bounded by `ConnectionConfig` rather than by a low default; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):  # a platform that caps it lower: keep what there is
            pass
    return soft


class ConnectionGuard:
    """Counts one process's connections per source and in all, keeps the sources with a record, and closes the
    connections past their deadline. Used from the event loop's thread only."""

    def __init__(self, cfg: ConnectionConfig, limits: RateLimitConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self.max_connections = cfg.max_connections or max(64, open_file_limit() // 2)
        self.reserved = math.floor(self.max_connections * cfg.reserved_share)
        self.per_source = max(1, min(cfg.max_per_source, (self.max_connections - self.reserved) // 4))
        self._proxies = frozenset(limits.trusted_proxies) if limits.source_header is not None else frozenset()
        self.by_source: dict[str, int] = {}
        self.open = 0
        self.open_unrecorded = 0
        self.counts = {"refused_per_source": 0, "refused_full": 0, "header_timeouts": 0, "body_timeouts": 0}
        self._records: OrderedDict[str, float] = OrderedDict()  # source -> when its record ends (self.clock)
        self._live: dict[Connection, tuple[str, bool]] = {}  # -> (source, had a record)
        self._sweeping: asyncio.TimerHandle | None = None
        self.sweep_interval_s = min(1.0, cfg.header_timeout_s / 4, cfg.body_timeout_s / 4)

    # -- sources and their record ---------------------------------------------------------------------------------

    def source(self, peer: str) -> str:
        """The key a connection from `peer` counts under: the proxy's own name for a trusted proxy's connections."""
        return "proxy" if peer in self._proxies else normalise_source(peer)

    def has_record(self, source: str, for_at_least_s: float = 0.0) -> bool:
        """Whether `source` has a record that lasts `for_at_least_s` more seconds."""
        return source == "proxy" or self._records.get(source, 0.0) > self.clock() + for_at_least_s

    def record(self, source: str) -> None:
        """Give `source` a record for `cfg.record_ttl_s` from now."""
        records = self._records
        records.pop(source, None)
        records[source] = self.clock() + self.cfg.record_ttl_s
        while len(records) > self.cfg.max_records:
            records.popitem(last=False)

    # -- connections ------------------------------------------------------------------------------------------------

    def admit(self, peer: str, conn: Connection, loop: asyncio.AbstractEventLoop) -> tuple[RefusalCode, str] | None:
        """Count a new connection `conn` from `peer` and set its head's deadline; or say why it is refused (then
        nothing is counted)."""
        source = self.source(peer)
        recorded = self.has_record(source)
        held = self.by_source.get(source, 0)
        if source != "proxy" and held >= self.per_source:
            self.counts["refused_per_source"] += 1
            return RefusalCode.RATE_LIMITED, f"too many connections from this address ({held})"
        if self.open >= self.max_connections or (
                not recorded and self.open_unrecorded >= self.max_connections - self.reserved):
            self.counts["refused_full"] += 1
            return RefusalCode.UNAVAILABLE, "the coordinator holds as many connections as it may: retry later"
        self.by_source[source] = held + 1
        self.open += 1
        self.open_unrecorded += not recorded
        self._live[conn] = (source, recorded)
        conn.deadline = self.clock() + self.cfg.header_timeout_s
        if self._sweeping is None:
            self._sweeping = loop.call_later(self.sweep_interval_s, self._sweep, loop)
        return None

    def release(self, conn: Connection) -> None:
        """Uncount `conn` (nothing, if `admit` refused it or it was released already)."""
        counted = self._live.pop(conn, None)
        if counted is None:
            return
        source, recorded = counted
        held = self.by_source[source] - 1
        if held:
            self.by_source[source] = held
        else:
            del self.by_source[source]
        self.open -= 1
        self.open_unrecorded -= not recorded

    def header_deadline(self) -> float:
        return self.clock() + self.cfg.header_timeout_s

    def body_deadline(self, declared: int, largest: int) -> float:
        """When a body of `declared` bytes (counted up to `largest`, the most any endpoint reads) must be in."""
        return self.clock() + self.cfg.body_timeout_s + min(declared, largest) / self.cfg.body_min_bytes_per_s

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = self.clock()
        for conn in [c for c in self._live if c.deadline <= now]:
            self.counts[f"{conn.expire()}_timeouts"] += 1
        self._sweeping = loop.call_later(self.sweep_interval_s, self._sweep, loop) if self._live else None
