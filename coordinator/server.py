"""Running the coordinator: `serve(config)` in the foreground, `running_server(...)` in a thread for tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from swarmrl.coordinator.app import build_app
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.pool import attach_pool
from swarmrl.protocol.identity import Identity

if TYPE_CHECKING:
    from swarmrl.transfer.seed import DhtSeed


def attach_seed(app: FastAPI, config: CoordinatorConfig) -> DhtSeed | None:
    """Start the checkpoint swarm's DHT seed if `config.p2p` asks for one, serving what is already published
    and each new version; nodes learn its addresses from RunInfo.dht_peers. The caller closes it."""
    if config.p2p is None or not config.p2p.enabled:
        return None
    from swarmrl.transfer.seed import DhtSeed  # hivemind is heavy: import it only when the swarm is on

    svc = app.state.coordinator
    seed = DhtSeed(config.p2p, run_id=config.run.run_id, store=svc.shards, keep_versions=config.keep_versions).start()
    for version in sorted(v for v in (svc.current_version() - i for i in range(config.keep_versions)) if v >= 0):
        signed = svc.manifest(version)
        if signed is not None:
            seed.publish(signed.manifest)
    svc.dht_peers = [*seed.bootstrap_peers, *config.dht_peers]
    svc.publish_hooks.append(seed.publish)
    return seed


def serve(config: CoordinatorConfig, identity: Identity | None = None) -> None:
    """Run the coordinator until interrupted (Ctrl-C / SIGTERM), printing its public key and URL first."""
    identity = identity or config.load_identity()
    app = build_app(config, identity)
    seed = attach_seed(app, config)
    if seed is not None:
        print(f"  DHT seed:       {', '.join(app.state.coordinator.dht_peers)}", flush=True)
    host = config.host if ":" not in config.host else f"[{config.host}]"
    pool = attach_pool(app.state.coordinator, config, identity, f"http://{host}:{config.port}")
    if pool is not None:
        print(f"  pool DHT:       {', '.join(pool.bootstrap_addresses)}", flush=True)
    print(f"swarmrl coordinator for run {config.run.run_id!r}", flush=True)
    print(f"  url:            http://{host}:{config.port}", flush=True)
    print(f"  coordinator key {identity.public_key_hex}", flush=True)
    print(f"  data dir:       {config.data_dir.resolve()}", flush=True)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)
    finally:
        if pool is not None:
            pool.close()
        if seed is not None:
            seed.close()


@contextmanager
def running_server(config: CoordinatorConfig, identity: Identity | None = None,
                   clock: Callable[[], float] = time.time, startup_timeout_s: float = 20.0) -> Iterator[str]:
    """Run the coordinator in a background thread on 127.0.0.1 (a free port); yield its base URL.

    On exit the server is asked to stop, finishes in-flight requests, closes its store, and the thread is
    joined, so the same data_dir can be opened again right after (a restart).
    """
    identity = identity or config.load_identity()
    app = build_app(config, identity, clock=clock)
    seed = attach_seed(app, config)
    # Bind the socket ourselves: the port is known before the server starts, with no race for it.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="coordinator", daemon=True)
    thread.start()
    pool = None
    try:
        pool = attach_pool(app.state.coordinator, config, identity, f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the coordinator server thread died during startup")
            if time.monotonic() > deadline:
                raise RuntimeError("the coordinator server did not start in time")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        if pool is not None:  # first: its thread reads the store, which the server closes on its way out
            pool.close()
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        if seed is not None:
            seed.close()
