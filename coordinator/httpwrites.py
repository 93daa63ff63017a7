"""One socket write per HTTP response: the server's protocol (uvicorn's httptools one) with its writes held until the
next one, or until the event loop's current step ends.

uvicorn writes a response's head when the app sends `http.response.start` and its body when the app sends
`http.response.body`: two `send` system calls for every answer. On loopback the sender's call carries the segment
through the whole TCP stack, the receiver's side included, and the receiver may wake for each: under load a worker
made 1.55 write calls per request it read (`bench/RESULTS.md`). Here the head waits for the body and both go out
in one call. A write that nothing follows in the same step (the head of a streamed response, a
stream's chunk) goes out when the step ends, so nothing waits longer than the event loop's current callbacks.

`HttpToolsProtocol` is private to uvicorn: pyproject pins uvicorn to the version this was written against.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["CoalescingHttpProtocol", "HeldWrites"]


class HeldWrites:
    """A transport whose `write` holds its data until the next `write` (both go out in one call) or until the event
    loop's current step ends, whichever comes first. Writes keep their order; `close` and `write_eof` send what is
    held first; `abort` drops it, as it drops the transport's own buffer. Everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is None:
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            held, self._held = self._held, None
            self._transport.write(held + data)

    def flush(self) -> None:
        """Send what is held now (nothing, if the next write took it)."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through `HeldWrites`: a response's head and body in one system call."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeldWrites(transport, self.loop))  # type: ignore[arg-type]
