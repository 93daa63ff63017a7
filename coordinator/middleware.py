"""ASGI middleware every request passes through: a body-size limit, and errors that keep the connection.

Both answer with the API's error shape (`protocol.refusals.ErrorBody`), through `send_error`: the one place that
writes an error answer's bytes, for every layer of the coordinator's HTTP stack.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmrl.protocol.refusals import RefusalCode, error_body

log = logging.getLogger("swarmrl.coordinator")


def error_response(code: RefusalCode, reason: str, headers: dict[str, str] | None = None
                   ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The status, headers and body of the error answer with `code` and `reason` (and `headers`)."""
    body = error_body(code, reason)
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    return code.status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *extra], body


async def send_error(send: Send, code: RefusalCode, reason: str, headers: dict[str, str] | None = None) -> None:
    """Answer with the error `code` and `reason` (`headers` beside them)."""
    status, head, body = error_response(code, reason, headers)
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class ErrorMiddleware:
    """An unexpected exception becomes a 500 with the exception's type, and is logged with its traceback.

    Starlette's own last-resort handler answers too but then re-raises, and uvicorn closes a keep-alive
    connection whose request raised: the client's next request on it failed with a reset. Here the exception
    stops, so the connection stays usable.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if started:  # half a response is out: nothing sensible can follow on this connection
                raise
            await send_error(send, RefusalCode.INTERNAL_ERROR, f"internal error ({type(e).__name__})")


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuse (413) a request body over its limit before the app parses any of it.

    A declared Content-Length over the limit is refused at once; an undeclared (chunked) body is counted
    as it streams. The body is drained up to a bound before answering, so that a client still sending
    reads our 413 instead of a reset connection.
    """

    DRAIN_BYTES = 16 * 1024 * 1024

    def __init__(self, app: ASGIApp, limit_for: Callable[[Scope], int]):
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await send_error(send, RefusalCode.MALFORMED_CONTENT_LENGTH, "malformed Content-Length")
                return
            if length > limit:
                await self._drain(receive)
                await send_error(send, RefusalCode.BODY_TOO_LARGE,
                                 f"request body of {length} bytes exceeds the limit of {limit} bytes")
                return
        received = 0
        started = False
        body_done = False

        async def counting_receive() -> Message:
            nonlocal received, body_done
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                if not body_done:  # draining a finished body would wait for a message that never comes
                    await self._drain(receive)
                await send_error(send, RefusalCode.BODY_TOO_LARGE, f"request body exceeds the limit of {limit} bytes")

    async def _drain(self, receive: Receive) -> None:
        drained = 0
        while drained < self.DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
