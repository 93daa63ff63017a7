"""A man in the middle for tests and benches: an HTTP proxy on loopback that forwards everything to a coordinator
and rewrites the leases it hands out on the way (a prompt, max_tokens, the temperature), or any other answer, as
anyone on the network path of a plain-HTTP pool can.

    with Mitm(coordinator_url, rewrite=rewrite_lease("max_tokens")) as proxy:
        node = Node(NodeConfig(coordinator_url=proxy.url, ...))    # the node talks to the coordinator through it
        ...
    proxy.rewritten                                                # leases changed so far

A node that acted on such a lease would be judged on the lease the coordinator signed and banned; nodes refuse a
lease whose signature does not verify (`runtime.client.CoordinatorClient.check_lease`).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from swarmrl.testing.waiting import wait_for

Rewrite = Callable[[dict[str, Any]], dict[str, Any]]
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


def rewrite_lease(what: str) -> Rewrite:
    """A rewrite of one thing a node is judged on: "prompt" (the first prompt's text), "max_tokens" or
    "temperature"."""

    def rewrite(lease: dict[str, Any]) -> dict[str, Any]:
        if what == "prompt":
            first = lease["prompts"][0]
            first["text"] = "1" + first["text"]
        elif what == "max_tokens":
            lease["sampling"]["max_tokens"] = max(1, lease["sampling"]["max_tokens"] // 2)
        elif what == "temperature":
            lease["sampling"]["temperature"] = lease["sampling"]["temperature"] * 1.5
        else:
            raise ValueError(f"unknown rewrite {what!r}: prompt, max_tokens or temperature")
        return lease

    return rewrite


class Mitm:
    """Forwards every request to `upstream`; applies `rewrite` to each answer of POST `path` (default: the leases
    of /v1/lease) answered 200, of the requests for which `when()` is true (default: all). Runs uvicorn in a
    thread on 127.0.0.1."""

    def __init__(self, upstream: str, rewrite: Rewrite | None = None, when: Callable[[], bool] = lambda: True,
                 path: str = "/v1/lease"):
        self.upstream, self.rewrite, self.when, self.path = upstream.rstrip("/"), rewrite, when, path
        self.rewritten = 0
        self.forwarded = 0
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with httpx.AsyncClient(timeout=120.0) as client:
            resp = await client.request(request.method, self.upstream + request.url.path, params=request.query_params,
                                        content=body, headers=headers)
        content = resp.content
        self.forwarded += 1
        if (self.rewrite is not None and request.method == "POST" and request.url.path == self.path
                and resp.status_code == 200 and self.when()):
            content = json.dumps(self.rewrite(json.loads(content))).encode()
            self.rewritten += 1
        out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        return Response(content, status_code=resp.status_code, headers=out)

    def __enter__(self) -> Mitm:
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST", "PUT"])])
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))  # bound here, so the port is known before the server starts
        self._sock.listen(128)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, name="mitm",
                                        daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started or not self._thread.is_alive(), "the proxy to start")
        if not self._server.started:
            raise RuntimeError("the proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._sock.close()
