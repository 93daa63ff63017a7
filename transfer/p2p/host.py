"""Joining the hivemind DHT: one libp2p daemon (p2pd) and one `DHTNode` on it, the way every swarmrl peer does it.

`open_dht` is the one place that starts them (NAT helpers and relays off: peers are dialled at the addresses
they announce; the identity file doubles as the DHT record signer; every record is checked by the holder-record
validators plus any the caller adds). `SwarmPeer` calls it on its own loop; `DhtHost` runs it on a loop in a
background thread for users that only need the DHT itself (public pool announcements: `swarmrl.pools`).

    host = DhtHost(initial_peers=["/ip4/127.0.0.1/tcp/31337/p2p/Qm..."], host_maddrs=["/ip4/127.0.0.1/tcp/0"]).start()
    value = host.call(host.dht.get("some key", latest=True), timeout=10)
    host.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, Self

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator, RecordValidatorBase
from hivemind.p2p import P2P

from swarmrl.transfer.p2p.dht import (
    CachingSignatureValidator,
    HolderRecordValidator,
    full_maddrs,
    load_or_create_rsa_identity,
)

log = logging.getLogger(__name__)


async def open_dht(*, initial_peers: Sequence[str], host_maddrs: Sequence[str],
                   announce_maddrs: Sequence[str] = (), identity_path: str | None = None,
                   startup_timeout_s: float = 30.0, wait_timeout_s: float = 3.0,
                   extra_validators: Sequence[RecordValidatorBase] = (), client_mode: bool = False,
                   num_workers: int = 4) -> tuple[P2P, DHTNode, CachingSignatureValidator]:
    """Start a libp2p daemon and a DHTNode on it, bootstrapped from `initial_peers` (none: a new DHT).

    `identity_path`: this peer's RSA key file (made if missing; None: a fresh key, its temporary file deleted once
    the daemon has read it). `client_mode`: take part without storing or serving records for others.
    """
    key, path, temporary = load_or_create_rsa_identity(identity_path)
    try:
        p2p = await P2P.create(
            initial_peers=list(initial_peers) or None,
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=str(path),
            check_if_identity_free=False,
            auto_nat=False,
            nat_port_map=False,
            use_relay=False,
            use_auto_relay=False,
            startup_timeout=startup_timeout_s,
        )
    finally:
        if temporary:
            path.unlink(missing_ok=True)
    rsa = CachingSignatureValidator(key)
    try:
        dht = await DHTNode.create(
            p2p=p2p,
            initial_peers=list(initial_peers) or None,
            record_validator=CompositeValidator([rsa, HolderRecordValidator(), *extra_validators]),
            wait_timeout=wait_timeout_s,
            num_workers=num_workers,
            client_mode=client_mode,
        )
    except BaseException:
        await p2p.shutdown()
        raise
    return p2p, dht, rsa


class LoopThread:
    """An asyncio loop in a daemon thread of this process, for the hivemind parts that live on one: `start` runs the
    subclass's `_start` on it (within `startup_timeout_s`, cleaning up when that fails), `call` runs a coroutine on it
    and waits for its result, `submit` starts one without waiting, and `close` runs `_stop`, then ends every task
    still on the loop, the loop and its thread (safe to call twice). Both `DhtHost` and `transfer.p2p.swarm.SwarmPeer`
    are one."""

    thread_name = "loop"
    what = "the loop"
    """What it is called in messages."""
    not_running: type[Exception] = RuntimeError
    """What `call` raises when the loop is not running."""

    def __init__(self, startup_timeout_s: float):
        self.startup_timeout_s = startup_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def _start(self) -> None:
        """What `start` runs on the loop (the subclass's)."""

    async def _stop(self) -> None:
        """What `close` runs on the loop before ending the tasks left on it (the subclass's)."""

    def start(self) -> Self:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        try:
            self.call(self._start(), self.startup_timeout_s + 10)
        except BaseException:
            self.close()
            raise
        return self

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run `coro` on the loop and wait for its result (TimeoutError after `timeout`)."""
        if self._loop is None:
            coro.close()
            raise self.not_running(f"{self.what} is not running")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as e:
            fut.cancel()
            raise TimeoutError(f"timed out after {timeout} s") from e

    def submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Start `coro` on the loop without waiting for it (dropped when the loop is not running)."""
        if self._loop is None:
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if loop.is_running():
            async def stop() -> None:
                try:
                    await self._stop()
                finally:
                    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                    for t in others:
                        t.cancel()
                    await asyncio.gather(*others, return_exceptions=True)

            try:
                asyncio.run_coroutine_threadsafe(stop(), loop).result(15)
            except Exception as e:  # noqa: BLE001 (best effort on the way out)
                log.debug("%s shutdown: %s", self.what, e)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> Self:
        return self.start() if self._loop is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DhtHost(LoopThread):
    """A DHT member on an asyncio loop in a background thread of this process (see `open_dht` for the arguments).

    `call(coro, timeout)` runs a coroutine on that loop and returns its result; `dht` and `p2p` are only to be
    used from coroutines run that way.
    """

    thread_name = "dht-host"
    what = "the DHT host"

    def __init__(self, *, initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
                 announce_maddrs: Sequence[str] = (), identity_path: str | None = None,
                 startup_timeout_s: float = 30.0, wait_timeout_s: float = 3.0,
                 extra_validators: Sequence[RecordValidatorBase] = (), client_mode: bool = False):
        self._options: dict[str, Any] = dict(
            initial_peers=list(initial_peers), host_maddrs=list(host_maddrs), announce_maddrs=list(announce_maddrs),
            identity_path=identity_path, startup_timeout_s=startup_timeout_s, wait_timeout_s=wait_timeout_s,
            extra_validators=list(extra_validators), client_mode=client_mode)
        super().__init__(startup_timeout_s)
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        self.peer_id = ""
        self.maddrs: list[str] = []

    async def _start(self) -> None:
        """Start the daemon and join the DHT (`start` runs it, within the startup timeout)."""
        self.p2p, self.dht, _ = await open_dht(**self._options)
        self.peer_id = self.p2p.peer_id.to_base58()
        self.maddrs = full_maddrs(await self.p2p.get_visible_maddrs(), self.p2p.peer_id)

    async def _stop(self) -> None:
        if self.dht is not None:
            await self.dht.shutdown()
        if self.p2p is not None:
            await self.p2p.shutdown()
