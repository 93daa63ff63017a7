"""Bounded connections (coordinator.connections, coordinator.httpguard): the deadlines on a request's head and body,
the cap per source, the room kept for sources with a record, and honest requests served while one source holds
every connection it can get, against real servers on loopback (Linux lets a client bind any 127.0.0.x address, so
each address is a source of its own).

Nothing here waits a fixed time: a test waits for the server to answer or close (with a generous deadline), and
checks that a connection was closed no earlier than its deadline, which the server cannot beat."""

from __future__ import annotations

import json
import select
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from swarmrl.coordinator.admission import AdmissionConfig
from swarmrl.coordinator.connections import ConnectionConfig, ConnectionGuard
from swarmrl.coordinator.ratelimit import RateLimitConfig
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.testing.byzantine.slowloris import Attacker, LimitedCoordinator, probe
from swarmrl.testing.waiting import wait_for

PATIENCE_S = 60.0
HEAD = b"GET /v1/info HTTP/1.1\r\nHost: coordinator\r\n"


def connect(url: str, source: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=PATIENCE_S, source_address=(source, 0))
    return sock


def until_answered(sock: socket.socket, trickle_s: float | None = None, since: float | None = None
                   ) -> tuple[bytes, float]:
    """What the server sends before it closes the connection (b"" if nothing) and the seconds it took since `since`
    (default: now; taken before the connection began, it is no later than the server's start of it), sending one
    more header byte every `trickle_s` meanwhile (None: nothing)."""
    started = time.monotonic() if since is None else since
    got = b""
    while time.monotonic() - started < PATIENCE_S:
        readable, _, _ = select.select([sock], [], [], trickle_s or PATIENCE_S)
        if not readable:
            try:
                sock.sendall(b"a")
            except OSError:
                break
            continue
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
    else:
        raise AssertionError("the server neither answered nor closed the connection")
    return got, time.monotonic() - started


def get_info(url: str, source: str) -> tuple[int, str]:
    """GET /v1/info on a connection of its own from `source`: the status and the refusal code (if any)."""
    with connect(url, source) as sock:
        sock.sendall(HEAD + b"Connection: close\r\n\r\n")
        got, _ = until_answered(sock)
    head, _, body = got.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, (json.loads(body).get("code", "") if status != 200 else "")


def held(url: str, source: str) -> socket.socket:
    """A connection whose request's head has begun and not ended."""
    sock = connect(url, source)
    sock.sendall(HEAD + b"X-Slow: a")
    return sock


def admitted(url: str, source: str, witness: str) -> socket.socket:
    """`held`, once the server admitted it (connections closed just before may still count a moment): the server
    accepts connections in order, so a request from `witness` answered after it means a refusal would have come."""
    def attempt() -> socket.socket | None:
        sock = held(url, source)
        assert get_info(url, witness) == (200, "")
        if select.select([sock], [], [], 0)[0]:
            sock.close()
            return None
        return sock
    return wait_for(attempt, f"a connection from {source} to be admitted", timeout=PATIENCE_S)


def test_a_head_that_never_ends_is_closed_after_its_deadline(run_factory):
    run = run_factory(connections=ConnectionConfig(header_timeout_s=1.0))
    since = time.monotonic()
    with connect(run.url, "127.0.0.2") as idle:
        got, idle_s = until_answered(idle, since=since)
    assert got == b"" and idle_s >= 1.0
    since = time.monotonic()
    with held(run.url, "127.0.0.2") as trickling:  # bytes keep coming; the head never ends
        got, trickling_s = until_answered(trickling, trickle_s=0.1, since=since)
    assert got == b"" and trickling_s >= 1.0
    # The same deadline on a kept-alive connection's next request, counted from the end of the previous answer.
    with connect(run.url, "127.0.0.2") as sock:
        sock.sendall(HEAD + b"\r\n" + HEAD)
        got, _ = until_answered(sock)
    assert got.startswith(b"HTTP/1.1 200") and got.count(b"HTTP/1.1") == 1
    assert get_info(run.url, "127.0.0.2") == (200, "")


def test_a_body_that_never_ends_is_closed_after_its_deadline(run_factory):
    run = run_factory(connections=ConnectionConfig(body_timeout_s=1.0, body_min_bytes_per_s=1000))
    since = time.monotonic()
    with connect(run.url, "127.0.0.2") as sock:
        sock.sendall(b"POST /v1/register/challenge HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"public_key\": ")
        got, seconds = until_answered(sock, trickle_s=0.1, since=since)
    assert got == b"" and seconds >= 1.0 + 1000 / 1000  # the base plus what the declared length needs
    # A body that arrives in time is served as ever.
    node = CoordinatorClient(run.url, Identity.generate(), retries=0, coordinator_key=run.key.public_key_hex)
    assert node.register(name="honest", engine="torch").node_id


def test_one_source_holds_at_most_its_cap(run_factory):
    run = run_factory(connections=ConnectionConfig(max_per_source=4, header_timeout_s=600))
    first = [held(run.url, "127.0.0.2") for _ in range(4)]
    assert get_info(run.url, "127.0.0.2") == (429, "rate_limited")  # the newest, over the cap
    assert get_info(run.url, "127.0.0.3") == (200, "")  # another source is served
    for sock in first:  # the four are still held: nothing was answered on them
        assert select.select([sock], [], [], 0)[0] == []
    first.pop().close()
    wait_for(lambda: get_info(run.url, "127.0.0.2") == (200, ""), "a freed connection to serve its source again")
    for sock in first:
        sock.close()


def test_room_is_kept_for_sources_with_a_record(run_factory):
    # 8 connections, 4 of them only for sources with a record: the others hold 4, one per source (a quarter).
    op_key = Identity.generate()
    run = run_factory(op_key=op_key, admission=AdmissionConfig(proven_after_groups=0),
                      connections=ConnectionConfig(max_connections=8, reserved_share=0.5, header_timeout_s=600))
    operator = CoordinatorClient(run.url, op_key, retries=0, transport=httpx.HTTPTransport(local_address="127.0.0.7"))
    operator.metrics(step=0, version=0, metrics={"loss": 1.0})  # an operator answered: a record at once
    node = CoordinatorClient(run.url, Identity.generate(), retries=0, coordinator_key=run.key.public_key_hex,
                             transport=httpx.HTTPTransport(local_address="127.0.0.8"))
    node.register(name="proven", engine="torch")  # proven after 0 groups: a record once the store says so
    node.heartbeat(held_version=-1)
    operator.close(), node.close()
    fillers = [admitted(run.url, f"127.0.0.{i}", witness="127.0.0.7") for i in range(10, 14)]
    assert get_info(run.url, "127.0.0.9") == (503, "unavailable")  # no record: the open part is full
    assert get_info(run.url, "127.0.0.7") == (200, "")
    wait_for(lambda: get_info(run.url, "127.0.0.8") == (200, ""), "the proven node's source to get its record")
    assert get_info(run.url, "127.0.0.10") == (429, "rate_limited")  # a quarter of the open part each
    for sock in fillers:
        sock.close()


def test_per_source_share_follows_the_open_part():
    guard = ConnectionGuard(ConnectionConfig(max_connections=400, reserved_share=0.25, max_per_source=128),
                            RateLimitConfig())
    assert (guard.reserved, guard.per_source) == (100, 75)
    proxied = ConnectionGuard(ConnectionConfig(), RateLimitConfig(source_header="x-real-ip"))
    assert proxied.source("127.0.0.1") == "proxy" and proxied.has_record("proxy")
    assert ConnectionGuard(ConnectionConfig(), RateLimitConfig()).source("127.0.0.1") == "127.0.0.1"


def test_honest_requests_are_served_while_one_source_holds_every_connection_it_can(tmp_path: Path):
    """Real processes: a coordinator with 512 open files (256 connections; 48 per source), an attacker that keeps
    300 connections going from 127.0.0.2, and 51 honest requests from 127.0.0.1, each on a new connection."""
    config = tmp_path / "coordinator.toml"
    config.write_text(f'data_dir = "{tmp_path / "coord"}"\nport = 0\n[connections]\nheader_timeout_s = 2.0\n')
    coordinator = LimitedCoordinator(config, tmp_path / "coordinator.log", nofile=512).start()
    attacker = None
    try:
        url = coordinator.url()
        attacker = Attacker(url, "127.0.0.2", slots=300, trickle_s=0.2)
        wait_for(lambda: attacker.tally.refused > 0 and attacker.tally.held >= 48, "the attacker to reach its cap",
                 timeout=PATIENCE_S)
        assert probe(url, 51, source="127.0.0.1") == 51
        wait_for(lambda: attacker.tally.closed > 0, "a held connection to reach its deadline", timeout=PATIENCE_S)
        closed_after_s = attacker.stop().closed_after_s
        assert closed_after_s is not None and closed_after_s >= 2.0
    finally:
        if attacker is not None and attacker.proc.poll() is None:
            attacker.stop()
        coordinator.stop()
