"""Just enough HTTP/1.1 over asyncio streams for load generators and fault-injecting proxies.

`read_request` and `read_response` read one whole message (Content-Length or chunked bodies) and return it with
its raw bytes, so a proxy can forward exactly what it read; `Connection` is a keep-alive client connection that
costs a fraction of a general-purpose client's CPU per request (a load generator shares the cores with the server
it measures).

    conn = await Connection.open("127.0.0.1", 8470)
    resp = await conn.request("POST", "/v1/lease", body, {"content-type": "application/json"})
    resp.status, resp.body
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

MAX_HEAD_BYTES = 64 * 1024


class ProtocolError(Exception):
    """The peer sent something this module does not read as HTTP/1.1."""


@dataclass
class Message:
    """One request or response: its first line split in three, lower-cased headers, body, and raw bytes."""

    start: tuple[str, str, str]
    headers: dict[str, str]
    body: bytes
    raw: bytes = field(repr=False)

    @property
    def status(self) -> int:
        """A response's status code."""
        return int(self.start[1])

    @property
    def method(self) -> str:
        return self.start[0]

    @property
    def path(self) -> str:
        return self.start[1]

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


async def _read(reader: asyncio.StreamReader, *, bodiless: bool = False) -> Message | None:
    """The next message on `reader`, or None at a clean end of stream before its first byte."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ProtocolError("the stream ended inside a message head") from None
    except asyncio.LimitOverrunError:
        raise ProtocolError("message head too long") from None
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2:
        raise ProtocolError(f"malformed first line {lines[0][:80]!r}")
    start = (parts[0], parts[1], parts[2] if len(parts) > 2 else "")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolError(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    raw = [head]
    if bodiless:
        body = b""
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            raw.append(size_line)
            size = int(size_line.split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            raw.append(data)
            if size == 0:
                break
            chunks.append(data[:-2])
        body = b"".join(chunks)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        raw.append(body)
    return Message(start, headers, body, b"".join(raw))


async def read_request(reader: asyncio.StreamReader) -> Message | None:
    """The next request a client sent, or None when it closed the connection between requests."""
    return await _read(reader)


async def read_response(reader: asyncio.StreamReader, method: str) -> Message:
    """The response to a `method` request (HEAD responses and 1xx/204/304 answers carry no body)."""
    msg = await _read(reader, bodiless=method == "HEAD")
    if msg is None:
        raise ProtocolError("the server closed the connection without answering")
    if msg.start[1] in ("204", "304") or msg.start[1].startswith("1"):
        msg.body = b""
    return msg


def encode_request(method: str, path: str, host: str, body: bytes = b"", headers: dict[str, str] | None = None
                   ) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Connection:
    """One keep-alive connection; requests on it take turns (it is not shared by concurrent tasks)."""

    def __init__(self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.host, self.port, self.reader, self.writer = host, port, reader, writer
        self.closed = False

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_HEAD_BYTES)
        return cls(host, port, reader, writer)

    async def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
                      ) -> Message:
        """Send one request and read its whole response. Any error leaves the connection closed."""
        try:
            self.writer.write(encode_request(method, path, f"{self.host}:{self.port}", body, headers))
            resp = await read_response(self.reader, method)
        except BaseException:
            self.close()
            raise
        if not resp.keep_alive:
            self.close()
        return resp

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()
