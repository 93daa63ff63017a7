"""The shard exchange's wire protocol, and the counters both of its sides keep.

Stream protocol `/swarmrl/shard/1`, one request per stream: an op byte, an 8-byte big-endian length, the
payload.

- `G` + sha256 hex: the response is a status byte (0 ok, 1 not held, 2 refused, 4 busy: all upload slots
  taken, ask again shortly) and, when ok, an 8-byte length and the shard bytes.
- `S` + manifest tag + bitfield of wanted shards: a status byte and, when ok, the 8-byte index of the shard
  the peer would rather send (seeds spread their uploads this way); status 3 means "none of these now: they
  are on their way to other peers, take them from those".
- `W` + manifest tag: a watch. The status byte, then (when ok) an 8-byte length and the peer's bitfield of
  held shards, then a 4-byte index for every shard it stores from then on (BitTorrent's HAVE messages); the
  peer ends the stream once it holds every shard or stops serving the version. Watches carry fresh
  holdings: under load a DHT store took 2 s and a DHT read 1 s, so a new copy showed up in the DHT about 4 s
  after it was stored.

The side that answers closes its end of a stream only after the asker has closed its own (see
`ShardServer.handle`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

PROTOCOL = "/swarmrl/shard/1"
OK, NOT_HELD, REFUSED, LATER, BUSY = b"\x00", b"\x01", b"\x02", b"\x03", b"\x04"
OP_GET, OP_SUGGEST, OP_WATCH = b"G", b"S", b"W"
LENGTH_BYTES = 8  # every length and index field of a request or answer (HAVE messages: 4 bytes)
HAVE_BYTES = 4
MAX_REQUEST = 16 + (1 << 17)  # a manifest tag and a bitfield of up to 2**20 shards
CHUNK = 1 << 16


class PeerError(Exception):
    """A peer could not or would not deliver a shard (not held, refused, connection trouble, timeout)."""


def encode_length(n: int) -> bytes:
    return n.to_bytes(LENGTH_BYTES, "big")


async def read_length(reader: asyncio.StreamReader) -> int:
    return int.from_bytes(await reader.readexactly(LENGTH_BYTES), "big")


async def send_request(writer: asyncio.StreamWriter, op: bytes, payload: bytes) -> None:
    writer.write(op + encode_length(len(payload)) + payload)
    await writer.drain()


@dataclass
class SwarmStats:
    """What one swarm peer did: its uploads, its downloads, and its DHT traffic."""

    uploads: int = 0
    bytes_uploaded: int = 0
    refused: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    peer_failures: int = 0
    announces: int = 0  # holder records stored in the DHT
    dht_reads: int = 0  # holder records read from the DHT
    busy: int = 0  # requests answered "busy" (all upload slots taken)
    haves: int = 0  # shards that watched peers reported holding after their watch began
    linger_timeouts: int = 0  # answered streams whose asker did not close its end within LINGER_S
    wait_s: float = 0.0  # downloads: seconds from sending a request to the holder's answer (queue, RTT, disk)
    transfer_s: float = 0.0  # downloads: seconds from the answer to the last byte
    last_upload_at: float = 0.0  # wall clock (time.time()) when the latest upload ended
