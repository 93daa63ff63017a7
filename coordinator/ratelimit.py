"""Rate limits: token buckets per request source and per identity, answered 429 with Retry-After.

- Per source (the client's address; behind a reverse proxy, the address a trusted proxy puts in a configured
  header), before anything else of a request is read: every request, and registration challenges on a bucket of
  their own. IPv6 sources are counted per /64, the block one subscriber gets for free.
- Per identity (a signer whose signature has just verified, so nobody can spend another's tokens), before the
  request's body is read: every signed request of a node. Operator keys are not limited.
- Per source again, for signed requests sent again byte for byte (`coordinator.gate`): captured requests, whose
  stored answers cost far more than resending them.

Buckets live in this process's memory (several coordinator processes on one database each keep their own): a
bucket that is full again is the same as none, so the table forgets the least recently used ones past
`max_tracked`.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from swarmrl.coordinator.middleware import send_error
from swarmrl.protocol.refusals import RefusalCode

CHALLENGE_PATH = "/v1/register/challenge"


class RateLimitConfig(BaseModel):
    """Token buckets (rate per second, burst) of the coordinator's rate limits."""

    model_config = ConfigDict(extra="forbid")

    source_rate_per_s: float = Field(100.0, gt=0, description="Requests per second one source may make.")
    source_burst: float = Field(400.0, ge=1, description="Requests one source may make at once.")
    registration_rate_per_s: float = Field(
        1.0, gt=0, description="Registration challenges per second one source may ask for (each new identity needs "
        "one): free identities cost time per source, and no source can keep others from registering.")
    registration_burst: float = Field(30.0, ge=1, description="Registration challenges one source may ask at once.")
    identity_rate_per_s: float = Field(20.0, gt=0, description="Signed requests per second one node identity may "
                                       "make (operators are not limited).")
    identity_burst: float = Field(100.0, ge=1, description="Signed requests one node identity may make at once.")
    resend_rate_per_s: float = Field(
        1.0, gt=0, description="Signed requests one source may send again byte for byte (the same signature, with "
        "an Idempotency-Key), per second: clients sign each retry afresh, so these are captured requests, answered "
        "from the store at many times what sending them cost. Charged to the source, never to the signer.")
    resend_burst: float = Field(20.0, ge=1, description="Byte-for-byte re-sends one source may make at once.")
    source_header: str | None = Field(
        None, description="Behind a reverse proxy: the header it puts the client's address in (e.g. "
        "x-forwarded-for, whose last entry is used, or x-real-ip). Honoured only on connections from "
        "trusted_proxies; None: the connection's own address is the source.")
    trusted_proxies: list[str] = Field(["127.0.0.1", "::1"], description="Addresses whose source_header is believed.")
    max_tracked: int = Field(100_000, ge=100, description="Buckets kept per kind; the least recently used go first.")

    @classmethod
    def off(cls) -> RateLimitConfig:
        """Limits nothing on one machine reaches (tests and benches whose every process is on loopback)."""
        big = 1e9
        return cls(source_rate_per_s=big, source_burst=big, registration_rate_per_s=big, registration_burst=big,
                   identity_rate_per_s=big, identity_burst=big, resend_rate_per_s=big, resend_burst=big)


class Buckets:
    """Token buckets by key, refilled at `rate` per second up to `burst`; thread-safe."""

    def __init__(self, rate: float, burst: float, max_tracked: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.max_tracked, self.clock = rate, burst, max_tracked, clock
        self._state: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str, cost: float = 1.0) -> float:
        """Spend `cost` tokens of `key`'s bucket: 0.0 if it had them, else the seconds until it will (and nothing
        is spent)."""
        now = self.clock()
        with self._lock:
            tokens, at = self._state.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if tokens >= cost:
                tokens -= cost
                wait = 0.0
            else:
                wait = (cost - tokens) / self.rate
            self._state[key] = (tokens, now)
            while len(self._state) > self.max_tracked:
                self._state.popitem(last=False)
        return wait


@functools.lru_cache(maxsize=65536)
def normalise_source(address: str) -> str:
    """An address as a rate-limit key: IPv4 as is, IPv6 as its /64 (an IPv4-mapped one as the IPv4). Remembered for
    the most recent addresses: parsing one costs tens of microseconds, and every request needs its source."""
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return address.strip()[:64] or "unknown"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


SOURCE_KEY = "swarmrl.source"
"""The ASGI scope key under which `source_of` keeps a request's source once found."""


def source_of(scope: Scope, cfg: RateLimitConfig) -> str:
    """The request's source: its peer address, or the address a trusted proxy names in `cfg.source_header`; found
    once per request (kept in the scope)."""
    known = scope.get(SOURCE_KEY)
    if known is not None:
        return known
    scope[SOURCE_KEY] = source = _find_source(scope, cfg)
    return source


def _find_source(scope: Scope, cfg: RateLimitConfig) -> str:
    client = scope.get("client")
    peer = client[0] if client else "unknown"
    if cfg.source_header is not None and peer in cfg.trusted_proxies:
        wanted = cfg.source_header.lower().encode()
        for name, value in scope.get("headers", ()):
            if name == wanted:
                # X-Forwarded-For lists every hop; the last one is what our proxy saw connecting to it.
                return normalise_source(value.decode("latin-1").split(",")[-1])
    return normalise_source(peer)


def retry_after_header(seconds: float) -> bytes:
    return str(max(1, math.ceil(seconds))).encode()


class RateLimitMiddleware:
    """Per-source limits, applied before a request's body is read: 429 with Retry-After when over them."""

    def __init__(self, app: ASGIApp, cfg: RateLimitConfig, clock: Callable[[], float] = time.monotonic):
        self.app, self.cfg = app, cfg
        self.requests = Buckets(cfg.source_rate_per_s, cfg.source_burst, cfg.max_tracked, clock)
        self.challenges = Buckets(cfg.registration_rate_per_s, cfg.registration_burst, cfg.max_tracked, clock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        source = source_of(scope, self.cfg)
        wait = self.requests.take(source)
        reason = "too many requests from this address"
        if wait == 0.0 and scope.get("path") == CHALLENGE_PATH:
            wait = self.challenges.take(source)
            reason = "too many registration challenges from this address"
        if wait > 0.0:
            await send_error(send, RefusalCode.RATE_LIMITED, f"{reason}: retry in {wait:.2f} s",
                             {"Retry-After": retry_after_header(wait).decode()})
            return
        await self.app(scope, receive, send)
