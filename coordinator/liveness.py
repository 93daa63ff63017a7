"""Liveness and housekeeping: nodes that stopped talking are marked gone and their leases freed; nonces and stored
answers past their time are forgotten.

A node is live while the coordinator hears from it (any heartbeat, lease or submission moves `last_seen`), and
gone once it has been silent for `node_gone_after_s`: that is what /v1/status, /v1/overview, the dashboard and
/metrics count, at the moment they are read. The sweep acts on the same rule: it marks such a node (`gone_since`,
when its leases were freed) and settles its open leases (`admission.settle_leases`), which then stop holding its
allowance and the backpressure buffer's room: their unsubmitted prompts are queued and leased again to other
nodes, and count as abandoned by the gone node, as they would at the leases' expiry. A gone node that comes back
with groups of a settled lease is told, group by group, that they were leased again: nothing is counted twice.
Its next heartbeat or lease request makes it live again (`registry.note_beat`, `registry.touch_settled` clear
`gone_since`). Each sweep that freed anything logs one line.

`Housekeeping` runs `sweep` every `housekeeping_interval_s` in a thread of the coordinator. With several
coordinator processes on one PostgreSQL store each sweeps: every statement is a conditional update or a delete,
so a node is marked gone once and a row is deleted once, whichever process gets there first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Double, bindparam, select, update

from swarmrl.coordinator import admission, idempotency
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.schema import leases, nodes
from swarmrl.coordinator.db.store import Store, Tx
from swarmrl.coordinator.nonces import prune_nonces
from swarmrl.coordinator.watchdog import Watchdog

log = logging.getLogger("swarmrl.coordinator")

_n, _l = nodes.c, leases.c
_MARK_GONE = (update(nodes).where(_n.gone_since.is_(None), _n.banned.is_(False),
                                  _n.last_seen < bindparam("b_cutoff", type_=Double))
              .values(gone_since=bindparam("b_now", type_=Double)).returning(_n.id))
_OPEN = (select(_l.id).where(_l.node_id.in_(bindparam("b_ids", expanding=True)), _l.state == "open")
         .order_by(_l.node_id, _l.id))


def mark_gone(tx: Tx, silent_since: float, now: float) -> tuple[list[str], int]:
    """Mark gone every live, unbanned node not heard from since `silent_since`, and settle its open leases (their
    prompts leased again); (the nodes marked, the leases freed)."""
    gone = sorted(tx.execute(_MARK_GONE, {"b_cutoff": silent_since, "b_now": now}).scalars())
    if not gone:
        return gone, 0
    open_leases = list(tx.execute(_OPEN, {"b_ids": gone}).scalars())
    admission.settle_leases(tx, open_leases, now)
    return gone, len(open_leases)


@dataclass
class Sweep:
    """What one sweep did."""

    gone: list[str]
    leases_freed: int
    nonces: int
    answers: int


class Housekeeping:
    """Runs `sweep` every `config.housekeeping_interval_s` on a thread of its own, until `close`."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float],
                 watchdog: Watchdog | None = None):
        """`watchdog`: asked at every tick too, so that a stall is logged when it begins, whoever looks."""
        self.store, self.config, self.clock, self.watchdog = store, config, clock, watchdog
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Housekeeping:
        self._thread = threading.Thread(target=self._run, name="housekeeping", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def sweep(self) -> Sweep:
        """Mark silent nodes gone (freeing their leases), and forget nonces outside the clock window and stored
        answers older than idempotency_ttl_s."""
        cfg, now = self.config, self.clock()

        def run(tx: Tx) -> Sweep:
            gone, freed = mark_gone(tx, now - cfg.node_gone_after_s, now)
            # A nonce only needs remembering while its timestamp is inside the window; 2x for margin.
            pruned = prune_nonces(tx, now - 2 * cfg.clock_skew_s)
            answers = idempotency.prune(tx, now - cfg.idempotency_ttl_s)
            return Sweep(gone, freed, pruned, answers)

        # Not durable: a sweep lost with a power cut is done again by the next one.
        done = self.store.write(run, durable=False)
        if done.gone:
            log.warning("%d node(s) silent for %.0f s marked gone (%s%s); %d open lease(s) freed", len(done.gone),
                        cfg.node_gone_after_s, ", ".join(n[:12] for n in done.gone[:5]),
                        ", ..." if len(done.gone) > 5 else "", done.leases_freed)
        return done

    def _run(self) -> None:
        while not self._stop.wait(self.config.housekeeping_interval_s):
            try:
                self.sweep()
                if self.watchdog is not None:
                    self.watchdog.training()
            except Exception:  # a failed sweep (a full disk, a lost database) is tried again at the next tick
                log.exception("housekeeping sweep failed")
