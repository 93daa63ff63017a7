"""One path for a node's submission or heartbeat, whatever the store: planned without blocking, then written.

An endpoint works its request out up to the write (`Leases.plan_submit`, `Registry.plan_heartbeat`): signatures,
checks against what the process knows, the transaction function. `Writes` then runs that write where this process
writes, from a request thread (`run`) or from the event loop (`run_async`):

- SQLite with the store's writer process (several server processes on one file: `coordinator.db.sqlite.writer`): the
  write's plain form (`remote`, when the request crosses: a prechecked submission, a heartbeat) is committed there,
  awaited from the event loop (`coordinator.db.sqlite.asyncwriter`) with no hand-off to a request thread; one that
  does not cross is written here.
- Otherwise (PostgreSQL, and SQLite in one process): `Store.write` on a request thread. On PostgreSQL the
  transaction awaited on the event loop instead (SQLAlchemy's asyncio layer over psycopg's asynchronous connection)
  was measured and not kept: 40-50% more coordinator CPU per request, and fewer submissions a second (bench/RESULTS.md).

Whichever runs it, the transaction is the same function (`fn`), and it promises what `Store.write` does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from swarmrl.coordinator.db.sqlite.asyncwriter import AsyncRemoteWriter, RemoteCall
from swarmrl.coordinator.db.sqlite.writer import RemoteWriter
from swarmrl.coordinator.db.store import Store, Tx

__all__ = ["PlannedWrite", "Writes"]


@dataclass(frozen=True)
class PlannedWrite:
    """A request's write: `fn` its transaction in this process (its result is the request's), `durable` and `notify`
    as for `Store.write`; `recover(error)` runs on a request thread when the write raised, before the error is
    answered (what a refusal still changes); `remote`: the same write as the store's writer process runs it, when
    one runs and the request can cross to it."""

    fn: Callable[[Tx], Any]
    durable: bool = True
    notify: bool = False
    recover: Callable[[BaseException], None] | None = None
    remote: RemoteCall | None = None


class Writes:
    """Where this process's planned writes run (module docstring): `store`, or the store's writer process through
    `writer` (from request threads) and `async_writer` (from the event loop)."""

    def __init__(self, store: Store, writer: str | None = None):
        self.store = store
        self.writer = RemoteWriter(writer) if writer is not None else None
        self.async_writer = AsyncRemoteWriter(writer) if writer is not None else None

    @property
    def crosses(self) -> bool:
        """Whether writes that can cross to the store's writer process should be planned with their plain form."""
        return self.writer is not None

    @property
    def on_the_loop(self) -> bool:
        """Whether a planned write may be awaited on the event loop (`run_async` needs no request thread for it)."""
        return self.async_writer is not None

    def run(self, w: PlannedWrite) -> Any:
        """`w` written, from a request thread (it blocks): the request's result, or the write's refusal."""
        if w.remote is not None and self.writer is not None:
            return w.remote.run(self.writer)
        try:
            return self.store.write(w.fn, notify=w.notify, durable=w.durable)
        except Exception as e:
            if w.recover is not None:
                w.recover(e)
            raise

    async def run_async(self, w: PlannedWrite, offload: Callable[..., Awaitable[Any]]) -> Any:
        """`run(w)`, from the event loop: awaited from the store's writer process when it crosses, else on a
        request thread (through `offload`)."""
        if w.remote is not None and self.async_writer is not None:
            return await w.remote.run_async(self.async_writer, offload)
        return await offload(self.run, w)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.async_writer is not None:
            self.async_writer.close()
