"""Running the coordinator: `serve(config)` in the foreground, `running_server(...)` in a thread for tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn

from coordinator.app import build_app
from coordinator.config import CoordinatorConfig
from protocol.identity import Identity


def serve(config: CoordinatorConfig, identity: Identity | None = None) -> None:
    """Run the coordinator until interrupted (Ctrl-C / SIGTERM), printing its public key and URL first."""
    identity = identity or config.load_identity()
    app = build_app(config, identity)
    host = config.host if ":" not in config.host else f"[{config.host}]"
    print(f"swarmrl coordinator for run {config.run_id!r}", flush=True)
    print(f"  url:            http://{host}:{config.port}", flush=True)
    print(f"  coordinator key {identity.public_key_hex}", flush=True)
    print(f"  data dir:       {config.data_dir.resolve()}", flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)


@contextmanager
def running_server(config: CoordinatorConfig, identity: Identity | None = None,
                   clock: Callable[[], float] = time.time, startup_timeout_s: float = 20.0) -> Iterator[str]:
    """Run the coordinator in a background thread on 127.0.0.1 (a free port); yield its base URL.

    On exit the server is asked to stop, finishes in-flight requests, closes its store, and the thread is
    joined, so the same data_dir can be opened again right after (a restart).
    """
    identity = identity or config.load_identity()
    app = build_app(config, identity, clock=clock)
    # Bind the socket ourselves: the port is known before the server starts, with no race for it.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="coordinator", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the coordinator server thread died during startup")
            if time.monotonic() > deadline:
                raise RuntimeError("the coordinator server did not start in time")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
