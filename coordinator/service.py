"""The coordinator: one object per run that builds the parts a rollout passes through and wires them together.

    gate          every signed request: signature header, rate limit, body digest, role, payload bounds; then,
                  first in the request's transaction, a retry's stored answer and the replay check
                                                                                           (coordinator.gate)
    registry      nodes: challenges, registration, heartbeats, bans                        (coordinator.registry)
    leases        signed leases to admitted identities, submissions    (coordinator.leases, coordinator.admission)
    verification  the pending queue, claims, verdicts, quarantine                          (coordinator.verification)
    feed          the trainer feed and its acknowledgements                                (coordinator.feed)
    checkpoints   shards, manifests, publishing                                            (coordinator.checkpoints)
    status        RunInfo, the status snapshot, pages of nodes and metrics                 (coordinator.status)
    ledger        receipts signed as groups are accepted, the contribution ledger          (coordinator.ledger)
    overviews     outcomes, reasons, node states, checkpoint spread (dashboard, metrics)   (coordinator.overview)
    housekeeping  silent nodes marked gone (leases freed), old nonces and answers pruned  (coordinator.liveness)

Every part either completes a request's whole effect, its nonce and (with an Idempotency-Key) its answer in one
transaction, or raises `Refused` having changed nothing. The one deliberate exception: the nonce of a correctly
signed request that was refused is recorded afterwards (`Gate.keep_nonce`), so that it cannot be replayed either.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from swarmrl.coordinator.auth import Signed
from swarmrl.coordinator.checkpoints import Checkpoints
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.store import Store
from swarmrl.coordinator.db.writes import Writes
from swarmrl.coordinator.feed import Feed
from swarmrl.coordinator.gate import Gate
from swarmrl.coordinator.leases import Leases
from swarmrl.coordinator.ledger import Ledger
from swarmrl.coordinator.liveness import Housekeeping
from swarmrl.coordinator.longpoll import LongPolls
from swarmrl.coordinator.overview import Overviews
from swarmrl.coordinator.registry import Registry, require_node
from swarmrl.coordinator.run_secret import RunSecret
from swarmrl.coordinator.status import Status, store_epoch
from swarmrl.coordinator.verification import Verification
from swarmrl.coordinator.watchdog import Watchdog
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import pool_id
from swarmrl.protocol.tasks import load_task
from swarmrl.transfer.store import ShardStore


class Coordinator:
    """One run's coordinator over the store at `config.store_url` and the shards in `config.data_dir`."""

    def __init__(self, config: CoordinatorConfig, identity: Identity, clock: Callable[[], float] = time.time,
                 writer: str | None = None):
        """`writer`: the socket of the store's writer process, which then writes the prechecked submissions and the
        heartbeats (`coordinator.db.sqlite.writer`)."""
        self.config, self.identity, self.clock = config, identity, clock
        self.store = open_store(config)
        self.shards = ShardStore(config.data_dir / "shards", durable=True)  # a published manifest refers to them
        self.secret = RunSecret(config.data_dir)
        self.epoch = store_epoch(self.store)
        self.pool = pool_id(config.run.run_id, identity.public_key_hex, self.epoch)
        long_polls = LongPolls(self.store, config.max_long_polls)
        self.gate = Gate(self.store, config, clock, self.pool,
                         lambda node_id: self.store.read(lambda tx: require_node(tx, node_id)))
        self.registry = Registry(self.store, config, clock, self.secret)
        self.leases = build_leases(self.store, config, identity, clock, self.secret, self.epoch)
        self.writes = self.leases.writes = self.registry.writes = Writes(self.store, writer)
        self.verification = Verification(self.store, config, clock, long_polls)
        self.feed = Feed(self.store, long_polls, clock)
        self.checkpoints = Checkpoints(self.store, self.shards, config, identity, clock)
        self.status = Status(self.store, config, identity, clock, self.epoch)
        self.ledger = Ledger(self.store, config, identity, clock)
        self.verification.accept_hooks.append(self.ledger.issue)
        self.ledger.backfill()  # groups accepted before the ledger existed get their receipts now
        self.watchdog = Watchdog(self.store, config.watchdog, clock, config.max_buffered_groups,
                                 config.run.max_staleness, config.node_gone_after_s)
        self.overviews = Overviews(self.store, config, clock, self.watchdog)
        self.housekeeping = Housekeeping(self.store, config, clock, self.watchdog).start()

    def close(self) -> None:
        self.housekeeping.close()
        self.writes.close()
        self.store.close()

    def register(self, req: Signed) -> m.Registered:
        """Register the signer from the request's source (`Registry.register`) and tell it about the run."""
        return self.registry.register(req, self.status.run_info_in)


def open_store(config: CoordinatorConfig, writer: bool = False) -> Store:
    """The run's store, as `config` says (its data dir made first); `writer`: as the store's writer process opens
    it (`coordinator.db.sqlite.writer`): its commits paced by `sqlite.writer_commit_interval_ms`, and made by the thread
    that serves the writes (`WriterServer`), not by a committer thread of their own."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    sqlite = config.sqlite
    return Store(config.resolved_store_url, pool_size=config.store_pool_size, group_commit=sqlite.group_commit,
                 processes=config.workers, realtime_committer=sqlite.realtime_committer,
                 commit_interval_s=sqlite.writer_commit_interval_ms / 1000 if writer else 0.0,
                 committer_thread=not writer)


def build_leases(store: Store, config: CoordinatorConfig, identity: Identity, clock: Callable[[], float],
                 secret: RunSecret, epoch: int) -> Leases:
    """The run's leases over `store` (of `epoch`): in every server process, and in the store's writer process."""
    return Leases(store, config, clock, load_task(config.run.task), identity,
                  pool_id(config.run.run_id, identity.public_key_hex, epoch), secret)
