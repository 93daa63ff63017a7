"""The server's HTTP protocol with `coordinator.connections` applied to every connection, and the ASGI layer that
gives sources their record.

`GuardedHttpProtocol` is uvicorn's httptools protocol that asks the
process's `ConnectionGuard` to admit each new connection (a refused one is answered 429 or 503 and closed) and moves
the connection's deadline as its requests go: the head's from the connection's start or the previous response's end,
the body's from the end of the head, none while the app has the request. It relies on uvicorn's private protocol
class and its parser callbacks: pyproject pins uvicorn to the version this was written against.

`RecordKeeper` watches the answers to signed requests from sources without a record: an operator's answered
request gives its source a record at once; a node's gives one once the node is seen to be proven (at least
`admission.proven_after_groups` accepted groups, unbanned), looked up in the store for all such nodes together at
most once per second, off the event loop. A source with a record (and half its time left) costs nothing here.
"""

from __future__ import annotations

import asyncio
import http
import math
from typing import Any

from sqlalchemy import select
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from swarmrl.coordinator.connections import ConnectionGuard
from swarmrl.coordinator.db.schema import nodes
from swarmrl.coordinator.db.store import Store
from swarmrl.coordinator.middleware import error_response
from swarmrl.coordinator.pipeline import _Route as SignedRoute
from swarmrl.protocol.signing import SIGNATURE_HEADER, SignatureError, parse_header

__all__ = ["GuardedHttpProtocol", "RecordKeeper"]

_SIGNATURE = SIGNATURE_HEADER.lower().encode()
MAX_CANDIDATES = 1024
"""Sources waiting for their node's record to be looked up; more wait for a later request."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's protocol under `guard` (module docstring). Make one for a guard with `bound`."""

    guard: ConnectionGuard
    largest_body: int
    deadline = math.inf  # on the guard's clock; inf: the app has the request
    _in_body = False

    @classmethod
    def bound(cls, guard: ConnectionGuard, largest_body: int) -> type[GuardedHttpProtocol]:
        """The protocol class whose connections `guard` bounds; `largest_body`: the most bytes any endpoint reads
        (a declared length counts up to it)."""
        return type(cls.__name__, (cls,), {"guard": guard, "largest_body": largest_body})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        refusal = self.guard.admit(self.client[0] if self.client else "unknown", self, self.loop)
        if refusal is not None:
            code, reason = refusal
            status, head, body = error_response(code, reason, {"Retry-After": "1", "Connection": "close"})
            line = f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()
            self.transport.write(b"".join([line, *(k + b": " + v + b"\r\n" for k, v in head), b"\r\n", body]))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.release(self)
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._in_body = True
        declared = 0
        for name, value in self.headers:
            if name == b"content-length":
                declared = int(value) if value.isdigit() else 0  # the parser refuses a malformed one
                break
        self.deadline = self.guard.body_deadline(declared, self.largest_body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_body = False
        # The app may have answered before the body ended (a refusal that did not need it): then the next head's
        # deadline starts now, else the app has the request.
        self.deadline = self.guard.header_deadline() if self.cycle.response_complete else math.inf

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._in_body and self.cycle.response_complete:
            self.deadline = self.guard.header_deadline()  # else a body still arriving, or a pipelined request

    def expire(self) -> str:
        """Close the connection, past its deadline (`connections.Connection`)."""
        self.deadline = math.inf
        self.transport.close()
        return "body" if self._in_body else "header"


class RecordKeeper:
    """ASGI, outermost: gives the sources of answered signed requests of operators and proven nodes a record with
    `guard` (module docstring); `store`: where nodes are looked up, `proven_after`: accepted groups that prove one."""

    def __init__(self, app: ASGIApp, guard: ConnectionGuard, store: Store, proven_after: int):
        self.app, self.guard, self.store, self.proven_after = app, guard, store, proven_after
        self.candidates: dict[str, str] = {}  # source -> the node that was answered from there
        self._checking = False
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client") if scope["type"] == "http" and scope["method"] == "POST" else None
        if client is None:
            await self.app(scope, receive, send)
            return
        source = self.guard.source(client[0])
        if self.guard.has_record(source, self.guard.cfg.record_ttl_s / 2):
            await self.app(scope, receive, send)
            return
        status = 0

        async def watching(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, watching)
        route = scope.get("route")
        if 200 <= status < 300 and isinstance(route, SignedRoute):  # the gate verified its signature
            if route.operator:
                self.guard.record(source)
            else:
                self._propose(source, scope)

    def _propose(self, source: str, scope: Scope) -> None:
        header = next((v for k, v in scope["headers"] if k == _SIGNATURE), None)
        if header is None or len(self.candidates) >= MAX_CANDIDATES:
            return
        try:
            self.candidates[source] = parse_header(header.decode("latin-1")).signer_id
        except SignatureError:
            return
        if not self._checking:
            self._schedule()

    def _schedule(self) -> None:
        self._checking = True
        asyncio.get_running_loop().call_later(1.0, self._start)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._check())  # kept: a task nothing holds may vanish

    async def _check(self) -> None:
        batch, self.candidates = self.candidates, {}
        try:
            proven = await asyncio.get_running_loop().run_in_executor(None, self._proven, set(batch.values()))
        except Exception:  # the store busy or failing: these sources are proposed again by their next answer
            proven = set()
        for source, node in batch.items():
            if node in proven:
                self.guard.record(source)
        if self.candidates:  # proposed while this looked
            self._schedule()
        else:
            self._checking = False

    def _proven(self, ids: set[str]) -> set[str]:
        c = nodes.c
        stmt = select(c.id).where(c.id.in_(sorted(ids)), c.groups_accepted >= self.proven_after, c.banned.is_(False))

        def read(tx: Any) -> set[str]:
            return set(tx.execute(stmt).scalars())
        return self.store.read(read)
