"""`swarmrl node --pool NAME`: find the pool in the DHT, pin its key on first join, point the node at it.

The pool's record (checked by `protocol.pools.pool_record_refusal` against the node's pins and the sequence
numbers it saw) gives the coordinator's URLs and key; the node then talks to the coordinator exactly as if both
had been configured by hand, and refuses a coordinator that presents another key. A pool whose name is pinned to
another key than the one announced now is refused loudly (`PermanentRefusal`), with what to do.
"""

from __future__ import annotations

import logging

import httpx

from swarmrl.node.config import NodeConfig
from swarmrl.node.refusal import PermanentRefusal
from swarmrl.pools.discover import PoolListing, choose_pool, list_pools
from swarmrl.pools.errors import PoolKeyChanged
from swarmrl.pools.trust import PoolTrust
from swarmrl.protocol.pools import PoolRecord, SignedPoolRecord
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError

log = logging.getLogger("swarmrl.node")

URL_PROBE_TIMEOUT_S = 5.0


def reachable_url(record: PoolRecord, timeout: float = URL_PROBE_TIMEOUT_S) -> str:
    """The first of the pool's URLs whose coordinator answers with the pool's key; the first URL when none
    answers (the node then waits for it like for any outage)."""
    for url in record.coordinator_urls:
        try:
            with CoordinatorClient(url, retries=0, timeout=timeout) as client:
                key = client.info().coordinator_key
        except (CoordinatorError, httpx.HTTPError, ValueError) as e:  # ValueError: not a RunInfo
            log.info("pool URL %s did not answer (%s: %s)", url, type(e).__name__, e)
            continue
        if key == record.coordinator_key:
            return url
        log.warning("pool URL %s answers with another key (%s…) than the pool's: skipped", url, key[:16])
    return record.coordinator_urls[0]


def find_pool(cfg: NodeConfig, trust: PoolTrust | None = None) -> tuple[SignedPoolRecord, PoolListing]:
    """The record of the pool `cfg.pool` names, judged against `trust`; PermanentRefusal when a record of that name
    is refused because its key is not the pinned one, PoolChoiceError for every other reason it cannot be chosen."""
    assert cfg.pool is not None
    listing = list_pools(cfg.pools, trust=trust)
    try:
        chosen = choose_pool(listing, cfg.pool)
    except PoolKeyChanged as e:
        raise PermanentRefusal(str(e)) from None
    if cfg.coordinator_key and cfg.coordinator_key != chosen.record.coordinator_key:
        raise PermanentRefusal(
            f"pool {chosen.record.name!r} is announced with key {chosen.record.coordinator_key[:16]}…, but "
            f"coordinator_key is set to {cfg.coordinator_key[:16]}…: unset one of them, or check the pool's name")
    return chosen, listing


def join_pool(cfg: NodeConfig) -> tuple[NodeConfig, SignedPoolRecord]:
    """`cfg` pointed at the pool `cfg.pool` names (coordinator_url and coordinator_key from its record), with the
    pool's key pinned in `<work_dir>/pools.json` on first join."""
    trust = PoolTrust.in_dir(cfg.work_dir)
    chosen, _ = find_pool(cfg, trust)
    rec = chosen.record
    first = rec.name not in trust.pins
    trust.pin(rec.name, rec.coordinator_key)
    trust.save()
    if first:
        log.warning("first join of pool %r: its key %s… is now pinned in %s", rec.name, rec.coordinator_key[:16],
                    trust.path)
    url = reachable_url(rec)
    log.info("joining pool %r (%s, %s) at %s", rec.name, rec.model or "model not named", rec.task or "task not named",
             url)
    return cfg.model_copy(update={"coordinator_url": url, "coordinator_key": rec.coordinator_key}), chosen
