"""The coordinator's public pool announcement: its `[pool]` settings turned into a signed record in the DHT.

`attach_pool` starts a `swarmrl.pools.announce.PoolAnnouncer` on a DHT peer of its own (bootstrapped from
`pool.initial_peers` or SWARMRL_BOOTSTRAP; none: it starts the DHT and others bootstrap from it), which refreshes
the record every ttl/3 with what the coordinator knows now: the current policy version, how many nodes it heard
from recently, and how many completion tokens of accepted groups its ledger holds.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarmrl.coordinator import registry
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.ledger import totals as ledger_totals
from swarmrl.coordinator.service import Coordinator
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pools import POOL_NAME_PATTERN, PoolRecord

if TYPE_CHECKING:
    from swarmrl.pools.announce import PoolAnnouncer

def pool_name(config: CoordinatorConfig) -> str:
    """`pool.name`, or the run's id made into a pool name; ValueError when neither is one."""
    assert config.pool is not None
    name = config.pool.name or re.sub(r"[^a-z0-9._-]", "-", config.run.run_id.lower())[:48]
    if not re.match(POOL_NAME_PATTERN, name):
        raise ValueError(f"[pool] name {name!r} is not a pool name (lower-case letters, digits, '.', '_', '-'); "
                         "set pool.name")
    return name


def record_fields(config: CoordinatorConfig, svc: Coordinator, listen_url: str,
                  clock: Callable[[], float] = time.time) -> Callable[[], dict[str, Any]]:
    """A function giving the pool record's fields as they are now (everything but key, lifetime and sequence)."""
    pool = config.pool
    assert pool is not None
    name = pool_name(config)

    def fields() -> dict[str, Any]:
        info = svc.status.run_info()
        seen_after = clock() - pool.active_window_s
        nodes = svc.store.read(lambda tx: registry.node_counts(tx, gone_before=seen_after))["live"]
        return dict(name=name, description=pool.description, model=info.spec.model, task=info.spec.task.name,
                    coordinator_urls=pool.public_urls or [listen_url], current_version=info.current_version,
                    nodes=nodes, accepted_tokens=svc.store.read(ledger_totals)[1], status=pool.status)

    return fields


def attach_pool(svc: Coordinator, config: CoordinatorConfig, identity: Identity, listen_url: str
                ) -> PoolAnnouncer | None:
    """Start announcing the pool if `config.pool` asks for it (the caller closes the announcer); its DHT peer's
    addresses, to publish as bootstrap peers, are `announcer.host.maddrs`."""
    if config.pool is None or not config.pool.announce:
        return None
    from swarmrl.pools.announce import PoolAnnouncer  # hivemind is heavy: only when announcing
    from swarmrl.pools.records import open_pools_dht

    if not config.pool.public_urls and re.match(r"^https?://(0\.0\.0\.0|\[::\])[:/]", listen_url):
        raise ValueError(f"the coordinator listens on {listen_url}, which nodes cannot dial: set pool.public_urls")
    fields = record_fields(config, svc, listen_url)
    now = time.time()  # a bad name or URL fails here, at startup, not in the announcer thread
    PoolRecord(**fields(), coordinator_key=identity.public_key_hex, issued_at=now, expires_at=now + 60, seq=0)
    host, _ = open_pools_dht(config.pool, client_mode=False)
    return PoolAnnouncer(host, identity, fields, ttl_s=config.pool.ttl_s).start()
