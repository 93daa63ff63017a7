"""The coordinator's HTTP protocol writes a response's head and body in one call (`coordinator.httpwrites`), sends
the head of a streamed response without waiting for its body, and loses nothing held when the connection closes.
Driven through uvicorn's real protocol and a real event loop, with a transport that records each write call."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from swarmrl.coordinator.httpwrites import CoalescingHttpProtocol

REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"


class RecordingTransport(asyncio.Transport):
    """Each `write` call's bytes, in order; closing only marks it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.calls.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def plain_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
    await send({"type": "http.response.body", "body": b"hello"})


def serve_one(protocol_class: type[HttpToolsProtocol], app: Any, until: Any) -> RecordingTransport:
    """Feed one request to a `protocol_class` connection running `app`; return its transport once `until(transport)`
    holds (checked after each turn of the event loop)."""

    async def main() -> RecordingTransport:
        config = uvicorn.Config(app, log_level="warning", lifespan="off", http=protocol_class)
        config.load()
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        transport = RecordingTransport()
        protocol.connection_made(transport)
        protocol.data_received(REQUEST)
        for _ in range(1000):
            await asyncio.sleep(0)
            if until(transport):
                break
        protocol.connection_lost(None)
        return transport

    return asyncio.run(main())


def test_a_responses_head_and_body_go_out_in_one_write() -> None:
    done = lambda t: t.calls and t.calls[-1].endswith(b"hello")  # noqa: E731
    mine = serve_one(CoalescingHttpProtocol, plain_app, done)
    theirs = serve_one(HttpToolsProtocol, plain_app, done)
    assert len(theirs.calls) == 2  # what uvicorn does alone: the head, then the body
    assert mine.calls == [b"".join(theirs.calls)]


def test_a_streamed_responses_head_goes_out_before_its_body() -> None:
    release = asyncio.Event()
    seen: list[int] = []

    async def streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await release.wait()
        await send({"type": "http.response.body", "body": b"late", "more_body": False})

    def until(t: RecordingTransport) -> bool:
        if t.calls and not release.is_set():  # the head is out while the body is still to come
            seen.append(len(t.calls))
            release.set()
        return bool(t.calls) and t.calls[-1].endswith(b"0\r\n\r\n")

    transport = serve_one(CoalescingHttpProtocol, streaming_app, until)
    assert seen == [1] and transport.calls[0].startswith(b"HTTP/1.1 200") and transport.calls[0].endswith(b"\r\n\r\n")
    assert b"late" in transport.calls[-1]


def test_what_is_held_goes_out_before_the_connection_closes() -> None:
    async def main() -> RecordingTransport:
        from swarmrl.coordinator.httpwrites import HeldWrites

        inner = RecordingTransport()
        held = HeldWrites(inner, asyncio.get_running_loop())
        held.write(b"head")
        assert inner.calls == [] and held.get_write_buffer_size() == 4
        held.close()  # before the loop's step ends
        assert inner.calls == [b"head"] and inner.closed
        return inner

    asyncio.run(main())
