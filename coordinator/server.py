"""Running the coordinator: `serve(config)` in the foreground (in `config.workers` processes), `running_server(...)`
in a thread for tests.

With `workers` > 1 the first process binds the port with SO_REUSEPORT, brings the store up to date, and forks the
other workers before it opens anything else (no thread and no database connection exists yet to be copied). Each
worker binds the same port (the kernel spreads new connections over the workers' sockets), builds its own app over
the same store and data dir, and dies with the first process. On SQLite it forks the store's writer process first
(`coordinator.db.sqlite.writer`), which writes the submissions and heartbeats of every worker. A worker (or the writer)
that ends stops the whole coordinator, so that whatever supervises it (systemd, Docker) restarts it whole rather
than running on at a fraction of its capacity.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from sqlalchemy.engine import make_url

from swarmrl.coordinator.app import build_app
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.connections import ConnectionGuard, raise_open_file_limit
from swarmrl.coordinator.db.sqlite.writer import WriterServer
from swarmrl.coordinator.db.store import Store, upgrade
from swarmrl.coordinator.httpguard import GuardedHttpProtocol, RecordKeeper
from swarmrl.coordinator.pool import attach_pool
from swarmrl.coordinator.registry import Registry
from swarmrl.coordinator.run_secret import RunSecret
from swarmrl.coordinator.service import build_leases, open_store
from swarmrl.coordinator.status import store_epoch
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.errors import UserError, port_problem
from swarmrl.runtime.lifetime import die_with_parent, name_process

if TYPE_CHECKING:
    from swarmrl.transfer.seed import DhtSeed

log = logging.getLogger("swarmrl.coordinator")


def attach_seed(app: FastAPI, config: CoordinatorConfig) -> DhtSeed | None:
    """Start the checkpoint swarm's DHT seed if `config.p2p` asks for one, serving what is already published
    and each new version; nodes learn its addresses from RunInfo.dht_peers. The caller closes it.

    With several coordinator processes on one PostgreSQL store, give `[p2p]` to one of them and point the
    trainer (shard uploads and publishes) at that one: the seed learns of a new version from the publish hook,
    which runs in the process that handled the publish. The other processes serve the same versions over HTTP
    from the shared data_dir, and list the seed's peers when `dht_peers` names them."""
    if config.p2p is None or not config.p2p.enabled:
        return None
    from swarmrl.transfer.seed import DhtSeed  # hivemind is heavy: import it only when the swarm is on

    svc = app.state.coordinator
    seed = DhtSeed(config.p2p, run_id=config.run.run_id, store=svc.shards, keep_versions=config.keep_versions).start()
    current = svc.checkpoints.current_version()
    for version in sorted(v for v in (current - i for i in range(config.keep_versions)) if v >= 0):
        signed = svc.checkpoints.manifest(version)
        if signed is not None:
            seed.publish(signed.manifest)
    svc.status.dht_peers = [*seed.bootstrap_peers, *config.dht_peers]
    svc.checkpoints.publish_hooks.append(seed.publish)
    return seed


def uvicorn_config(app: FastAPI) -> uvicorn.Config:
    """The server of `app` in this process: every connection bounded by a `ConnectionGuard` of its own
    (`app.state.connections`; `coordinator.connections`)."""
    # No access log and no proxy-header rewriting: per-request costs that nothing here uses (client addresses
    # decide nothing; keys do). No WebSocket upgrade: nothing here speaks it, and an upgraded connection would leave
    # the guard's count.
    svc = app.state.coordinator
    config: CoordinatorConfig = svc.config
    guard = app.state.connections = ConnectionGuard(config.connections, config.rate_limits)
    protocol = GuardedHttpProtocol.bound(guard, max(config.max_body_bytes, config.max_shard_bytes))
    return uvicorn.Config(RecordKeeper(app, guard, svc.store, config.admission.proven_after_groups),
                          log_level="warning", access_log=False, lifespan="on", proxy_headers=False, http=protocol,
                          ws="none")


def _listen(host: str, port: int, shared: bool = False, first: bool = True) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one. Bound here so the real port is known (and
    printed) before the server starts, with no race for it. `shared`: other workers' sockets bind the port too;
    `first`: no worker of this coordinator has bound it yet (the later workers' own binds must not probe it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if shared and port and first:
        # SO_REUSEPORT would share the port with a coordinator already on it: bind once without it first, so that
        # one is found before this one opens (and migrates) its store.
        _listen(host, port).close()
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(port_problem("port", "host", host, port, e)) from None
    sock.listen(2048)
    return sock


class VersionFollower:
    """Publishes to the DHT seed every version published through another worker (which the publish hook, run in the
    worker that served the publish, does not see): it reads the store's current version every `interval_s`."""

    def __init__(self, app: FastAPI, seed: DhtSeed, interval_s: float = 2.0):
        self.svc, self.seed, self.interval_s = app.state.coordinator, seed, interval_s
        self.seen = self.svc.checkpoints.current_version()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="seed-versions", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                current = self.svc.checkpoints.current_version()
                for version in range(max(self.seen + 1, current - self.svc.config.keep_versions + 1), current + 1):
                    signed = self.svc.checkpoints.manifest(version)
                    if signed is not None:
                        self.seed.publish(signed.manifest)
                self.seen = max(self.seen, current)
            except Exception:  # the store busy or failing: the next round tries again
                log.exception("could not follow the published versions")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class Workers:
    """The workers after the first of a coordinator with `config.workers` > 1 (module docstring), and on SQLite the
    store's writer process before them, forked now when `writer` (`self.writer`: its socket, or None)."""

    def __init__(self, config: CoordinatorConfig, identity: Identity, first: socket.socket, writer: bool):
        self._stopping = False
        port = first.getsockname()[1]
        # Forked before any other thread exists in this process: a child inherits every lock as it was, and one
        # held by another thread stays held there. (A thread just joined may still run native exit handlers: the
        # store's change listener, left by a store opened to migrate, could leave libpq's OpenSSL lock taken, and
        # every connection of that worker to PostgreSQL then hung.)
        if threading.active_count() > 1:
            raise RuntimeError(f"the coordinator forks its workers with threads running: {threading.enumerate()}")
        context = mp.get_context("fork")
        self.writer: str | None = None
        self.writer_proc: mp.process.BaseProcess | None = None
        if writer:
            self.writer = writer_socket(config)
            self.writer_proc = context.Process(target=_run_writer, args=(config, identity, self.writer, os.getpid()),
                                               name="coordinator-writer")
            self.writer_proc.start()
        self.procs = [context.Process(target=_serve_worker, args=(config, identity, port, first, os.getpid(),
                                                                  self.writer),
                                      name=f"coordinator-worker-{i}") for i in range(1, config.workers)]
        for proc in self.procs:
            proc.start()

    def watch(self, on_end: Callable[[], None]) -> None:
        """Call `on_end` (from a thread of its own) when a worker ends before `stop`."""

        every = [*self.procs, *([self.writer_proc] if self.writer_proc is not None else [])]

        def run() -> None:
            ended = multiprocessing.connection.wait([p.sentinel for p in every])
            if not self._stopping:
                which = [p for p in every if p.sentinel in ended]
                log.error("%s ended (exit code %s): stopping the coordinator", which[0].name, which[0].exitcode)
                on_end()

        threading.Thread(target=run, name="coordinator-workers", daemon=True).start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every worker (each finishes its requests in flight), then SIGKILL those still running; then the
        writer, which their requests in flight needed."""
        self._stopping = True
        for group in (self.procs, [self.writer_proc] if self.writer_proc is not None else []):
            for proc in group:
                if proc.is_alive():
                    proc.terminate()
            deadline = time.monotonic() + timeout_s
            for proc in group:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.kill()
                    proc.join()


def writer_socket(config: CoordinatorConfig) -> str:
    """Where the store's writer process listens: in the data dir, or where a Unix socket's path fits (a 0700
    directory of its own) when the data dir's path is too long for one."""
    path = (config.data_dir / "writer.sock").resolve()
    if len(str(path)) <= 100:
        return str(path)
    return os.path.join(tempfile.mkdtemp(prefix="swarmrl-writer-"), "writer.sock")


def _run_writer(config: CoordinatorConfig, identity: Identity, path: str, parent: int) -> None:
    die_with_parent(parent)
    name_process("swarmrl-writer")
    # The writer's own store commits only from the thread that serves the writes (not running yet): the store's
    # epoch (the pool's name in the leases it signs) is read through an ordinary one first.
    plain = open_store(config)
    try:
        epoch = store_epoch(plain)
    finally:
        plain.close()
    store = open_store(config, writer=True)
    secret = RunSecret(config.data_dir)
    leases = build_leases(store, config, identity, time.time, secret, epoch)
    registry = Registry(store, config, time.time, secret)
    assert store.group_commit is not None
    try:
        WriterServer(path, store.group_commit, {"submit": leases.write_sent, "heartbeat": registry.write_heartbeat}
                     ).serve_forever()
    finally:
        store.close()


def _serve_worker(config: CoordinatorConfig, identity: Identity, port: int, first: socket.socket,
                  parent: int, writer: str | None) -> None:
    die_with_parent(parent)
    first.close()  # the first worker's socket: it accepts its own connections
    sock = _listen(config.host, port, shared=True, first=False)
    app = build_app(config, identity, writer=writer)
    lower_request_priority(app.state.coordinator.store, config.sqlite.request_nice)
    uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])


def lower_request_priority(store: Store, nice: int) -> None:
    """On SQLite, run this thread (the server's event loop) and every thread it starts from now on (the request
    threads) `nice` steps below the threads started before it, `store`'s committer among them
    (`SqliteConfig.request_nice`). Only in a server process of its own: it changes the calling thread."""
    if nice and store.dialect == "sqlite":
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, os.getpriority(os.PRIO_PROCESS, me) + nice)


def serve(config: CoordinatorConfig, identity: Identity | None = None) -> None:
    """Run the coordinator until interrupted (Ctrl-C / SIGTERM), printing its public key and URL first; in
    `config.workers` processes (module docstring).

    The URL line is printed once the socket listens (with the real port when `port` is 0): a client may connect
    as soon as it reads it."""
    identity = identity or config.load_identity()
    raise_open_file_limit()  # before the workers fork: they inherit it; connections are bounded by the guard
    sock = _listen(config.host, config.port, shared=config.workers > 1)
    workers = None
    if config.workers > 1:
        upgrade(config.resolved_store_url)  # migrations run once, before the workers open the store
        sqlite = make_url(config.resolved_store_url).get_backend_name() == "sqlite"
        workers = Workers(config, identity, sock, writer=sqlite and config.sqlite.writer_process)
    app = build_app(config, identity, writer=workers.writer if workers is not None else None)
    seed = attach_seed(app, config)
    follower = VersionFollower(app, seed) if seed is not None and workers is not None else None
    pool = None
    try:
        if seed is not None:
            print(f"  DHT seed:       {', '.join(app.state.coordinator.status.dht_peers)}", flush=True)
        host = config.host if ":" not in config.host else f"[{config.host}]"
        url = f"http://{host}:{sock.getsockname()[1]}"
        pool = attach_pool(app.state.coordinator, config, identity, url)
        if pool is not None:
            print(f"  pool DHT:       {', '.join(pool.bootstrap_addresses)}", flush=True)
        print(f"swarmrl coordinator for run {config.run.run_id!r}", flush=True)
        print(f"  coordinator key {identity.public_key_hex}", flush=True)
        print(f"  data dir:       {config.data_dir.resolve()}", flush=True)
        print(f"  url:            {url}", flush=True)
        server = uvicorn.Server(uvicorn_config(app))
        if workers is not None:
            workers.watch(lambda: setattr(server, "should_exit", True))
        lower_request_priority(app.state.coordinator.store, config.sqlite.request_nice)
        server.run(sockets=[sock])
    finally:
        if workers is not None:
            workers.stop()
        if pool is not None:
            pool.close()
        sock.close()
        if follower is not None:
            follower.close()
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
    sock = _listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app))
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
