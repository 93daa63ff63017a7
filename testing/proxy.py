"""A fault-injecting HTTP/1.1 proxy for tests: it forwards every request to the server, and for the ones a rule
picks it lets the server answer but never passes the answer on (the client's connection is closed instead), the
way a response is lost on a real network after the server acted on the request.

    with LossyProxy("http://127.0.0.1:8470", drop=first_try_of({"/v1/submit"})) as proxy:
        client = CoordinatorClient(proxy.url, identity)     # its first submit is applied, and its answer lost
        proxy.events                                         # what happened to each request, in order

Runs its own event loop in a thread, so synchronous tests and clients use it as they would a server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from swarmrl.testing.http1 import Message, ProtocolError, read_request, read_response

DropRule = Callable[[Message], bool]


@dataclass(frozen=True)
class ProxyEvent:
    """One request through the proxy: its method, path, Idempotency-Key, the server's status, and whether the
    answer was dropped."""

    method: str
    path: str
    key: str | None
    status: int
    dropped: bool


def first_try_of(paths: set[str]) -> DropRule:
    """Drop the answer to the first try of each request to one of `paths`: the first request carrying a given
    Idempotency-Key (or, without a key, every request)."""
    seen: set[str] = set()
    lock = threading.Lock()

    def rule(req: Message) -> bool:
        if req.path.split("?")[0] not in paths:
            return False
        key = req.headers.get("idempotency-key")
        if key is None:
            return True
        with lock:
            first = key not in seen
            seen.add(key)
        return first

    return rule


class LossyProxy:
    """Listens on 127.0.0.1 (a free port) and forwards to `upstream`; see the module docstring."""

    def __init__(self, upstream: str, drop: DropRule):
        target = urlsplit(upstream)
        self.host, self.port = target.hostname or "127.0.0.1", target.port or 80
        self.drop = drop
        self.events: list[ProxyEvent] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lossy-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self.url = ""

    def __enter__(self) -> LossyProxy:
        self._thread.start()
        if not self._ready.wait(timeout=30):
            raise RuntimeError("the proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def dropped(self, path: str) -> list[ProxyEvent]:
        return [e for e in self.events if e.path.split("?")[0] == path and e.dropped]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            tasks = asyncio.all_tasks(self._loop)  # connections still open: end them before the loop goes
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.run_until_complete(self._server.wait_closed())
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                req = await read_request(reader)
                if req is None:
                    return
                if upstream is None:
                    upstream = await asyncio.open_connection(self.host, self.port)
                upstream[1].write(req.raw)
                resp = await read_response(upstream[0], req.method)
                dropped = self.drop(req)
                self.events.append(ProxyEvent(req.method, req.path, req.headers.get("idempotency-key"), resp.status,
                                              dropped))
                if dropped:
                    return  # the server acted; its answer is lost with this connection
                writer.write(resp.raw)
                await writer.drain()
                if not resp.keep_alive or not req.keep_alive:
                    return
        except (OSError, ProtocolError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()
            if upstream is not None:
                upstream[1].close()
