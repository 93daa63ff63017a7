"""Benchmark: what bounding connections (coordinator.connections, coordinator.httpguard) costs per request.

The HTTP protocol alone, driven in this process on one kept-alive connection (a transport that keeps what is written,
an app that answers 200 at once), so that nothing but the protocol layer is measured: `before`, the server's
protocol as it was (uvicorn's httptools protocol, `HttpToolsProtocol`), and
`after`, `GuardedHttpProtocol` under a `ConnectionGuard` with the app inside `RecordKeeper` (what
`server.uvicorn_config` runs). Two kinds of request: a GET, and a POST with a 200-byte body from a source without a
record (the record keeper watches its answer: the dearest case). Arms alternate; CPU time of this process.
A real coordinator spends 400-900 CPU microseconds per request (bench/RESULTS.md), against which to read these.

    python bench/connections.py [--requests 20000] [--repeats 3]

The last line printed is one JSON object: per arm and kind, the CPU microseconds per request of each round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from swarmrl.coordinator.connections import ConnectionConfig, ConnectionGuard
from swarmrl.coordinator.httpguard import GuardedHttpProtocol, RecordKeeper
from swarmrl.coordinator.ratelimit import RateLimitConfig

REQUESTS = {
    "get": b"GET /v1/info HTTP/1.1\r\nHost: coordinator\r\nAccept: */*\r\nUser-Agent: bench\r\n\r\n",
    "post": (b"POST /v1/heartbeat HTTP/1.1\r\nHost: coordinator\r\nContent-Type: application/json\r\n"
             b"Content-Length: 200\r\n\r\n" + b"x" * 200),
}


class Transport(asyncio.Transport):
    """Keeps the bytes written; a peer on loopback."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0
        self.closing = False

    def write(self, data: Any) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.2", 40000) if name in ("peername", "sockname") else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def app(scope: dict, receive: Any, send: Any) -> None:
    """Reads the body, answers 200 with a short JSON body."""
    if scope["method"] == "POST":
        while (await receive()).get("more_body"):
            pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


class _Store:
    def read(self, fn: Any) -> Any:  # never reached: no request here is signed
        raise AssertionError


async def drive(guarded: bool, kind: str, requests: int) -> float:
    """CPU microseconds per request of `requests` requests of `kind` on one connection."""
    loop = asyncio.get_running_loop()
    if guarded:
        guard = ConnectionGuard(ConnectionConfig(), RateLimitConfig())
        config = uvicorn.Config(RecordKeeper(app, guard, _Store(), 8), lifespan="off", ws="none",  # type: ignore[arg-type]
                                http=GuardedHttpProtocol.bound(guard, 1 << 20), log_level="warning")
    else:
        config = uvicorn.Config(app, lifespan="off", ws="none", http=HttpToolsProtocol, log_level="warning")
    config.load()
    protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    transport = Transport()
    protocol.connection_made(transport)
    request = REQUESTS[kind]
    started = time.process_time()
    for _ in range(requests):
        before = transport.written
        protocol.data_received(request)
        while transport.written == before or protocol.cycle.response_complete is False:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the held write's flush and the next request's keep-alive
    spent = time.process_time() - started
    protocol.connection_lost(None)
    return round(spent / requests * 1e6, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=20000, help="requests of each kind per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs both arms")
    args = p.parse_args()
    rounds: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for i in range(args.repeats):
        for name in ("before", "after"):
            for kind in REQUESTS:
                us = asyncio.run(drive(name == "after", kind, args.requests))
                rounds[name].setdefault(kind, []).append(us)
        print(f"round {i}: {json.dumps(rounds)}", flush=True)
    result: dict[str, Any] = {"requests": args.requests, "cpu_us_per_request": rounds}
    for kind in REQUESTS:
        result[f"{kind}_added_us"] = round(statistics.median(rounds["after"][kind])
                                           - statistics.median(rounds["before"][kind]), 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
