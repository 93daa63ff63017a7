"""Finding pools: read every pool record from the DHT, judge each, and say why each refused one was refused.

    listing = list_pools(cfg.pools, trust=PoolTrust.in_dir(cfg.work_dir))
    for signed in listing.pools: ...             # valid records, by name
    for r in listing.refused: print(r.key, r.reason)
    record = choose_pool(listing, "alpha")      # or "alpha@3f2a91c0" to pick one key; PoolChoiceError otherwise
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from swarmrl.pools.config import BOOTSTRAP_ENV, PoolsConfig
from swarmrl.pools.errors import PoolChoiceError, PoolKeyChanged, PoolLookupError
from swarmrl.pools.records import POOLS_KEY, PoolRecordValidator, open_pools_dht
from swarmrl.pools.trust import PoolTrust
from swarmrl.protocol.pools import RecordProblem, SignedPoolRecord, parse_signed_record, pool_record_refusal
from swarmrl.transfer.p2p.host import DhtHost


@dataclass(frozen=True)
class Refusal:
    key: str  # the subkey the record was stored under (a coordinator key, unless malformed)
    name: str  # the pool name the record claims ("" when it did not parse)
    reason: str
    problem: RecordProblem | None = None  # what programs decide on (None: malformed, or refused by the DHT validator)


@dataclass
class PoolListing:
    pools: list[SignedPoolRecord] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)


def read_pools(host: DhtHost, validator: PoolRecordValidator, *, trust: PoolTrust | None = None,
               now: float | None = None, timeout: float = 30.0) -> PoolListing:
    """The pool records in the DHT that `host` is part of, judged by `pool_record_refusal` against `trust`'s pins
    and sequence numbers (which then remember the valid ones). Records the DHT peers' answers carried but the
    validator refused (the whole answer is dropped then) are reported with the rest."""
    assert host.dht is not None
    validator.take_refusals()
    raw = host.call(host.dht.get(POOLS_KEY, latest=True), timeout)
    now = time.time() if now is None else now
    listing = PoolListing(refused=[Refusal(k, "", why) for k, why in validator.take_refusals().items()])
    value = getattr(raw, "value", None)
    for subkey, item in (value.items() if isinstance(value, dict) else []):
        try:
            signed = parse_signed_record(getattr(item, "value", item))
        except ValueError as e:
            listing.refused.append(Refusal(str(subkey)[:80], "", str(e)))
            continue
        rec = signed.record
        refusal = pool_record_refusal(
            signed, now=now, subkey=subkey, dht_expiration=getattr(item, "expiration_time", None),
            pinned_key=trust.pins.get(rec.name) if trust else None,
            seen=trust.seen.get(rec.coordinator_key) if trust else None)
        if refusal is None:
            listing.pools.append(signed)
        else:
            listing.refused.append(Refusal(str(subkey)[:80], rec.name, refusal[1], refusal[0]))
    if trust is not None:
        for signed in listing.pools:
            trust.note(signed)
    listing.pools.sort(key=lambda s: (s.record.name, s.record.coordinator_key))
    return listing


def list_pools(cfg: PoolsConfig, *, trust: PoolTrust | None = None, bootstrap: list[str] | None = None
               ) -> PoolListing:
    """Join the pools' DHT as a reader (bootstrap: `bootstrap`, else the config's, else SWARMRL_BOOTSTRAP), read
    the pools, leave."""
    peers = bootstrap or cfg.bootstrap()
    if not peers:
        raise PoolLookupError(f"no bootstrap peers for the pools' DHT: set pools.initial_peers, pass --bootstrap, or "
                              f"export {BOOTSTRAP_ENV}=<multiaddr>[,<multiaddr>...] (a pool operator publishes them)")
    try:
        host, validator = open_pools_dht(cfg, client_mode=True, initial_peers=peers)
    except Exception as e:  # noqa: BLE001 (the daemon or the bootstrap failed: say so in one line)
        raise PoolLookupError(f"could not join the pools' DHT through {', '.join(peers)}: {type(e).__name__}: {e}"
                              ) from e
    try:
        return read_pools(host, validator, trust=trust, timeout=cfg.lookup_timeout_s)
    finally:
        host.close()


def choose_pool(listing: PoolListing, wanted: str) -> SignedPoolRecord:
    """The one valid record `wanted` names: "NAME", or "NAME@KEYPREFIX" when several keys claim NAME.

    Raises PoolChoiceError saying why not: nothing of that name, a record of that name refused (a changed key is
    said loudly, with what to do, as its subclass PoolKeyChanged), several keys claiming the name, or a pool not
    taking new nodes."""
    name, _, prefix = wanted.partition("@")
    prefix = prefix.lower()
    found = [s for s in listing.pools if s.record.name == name and s.record.coordinator_key.startswith(prefix)]
    if not found:
        refused = [r for r in listing.refused if r.name == name]
        pinned = [r for r in refused if r.problem is RecordProblem.KEY_NOT_PINNED]
        if pinned:
            raise PoolKeyChanged(
                f"REFUSED: pool {name!r} is now announced under another key than the one this node pinned when it "
                f"first joined ({pinned[0].reason}). If the pool's operator has announced a new key, remove {name!r} "
                f"from the node's pools.json (in its work_dir) and join again; otherwise someone else is claiming the "
                f"name: do not join.")
        if refused:
            raise PoolChoiceError(f"pool {name!r} was found but refused: " + "; ".join(r.reason for r in refused))
        names = sorted({s.record.name for s in listing.pools})
        raise PoolChoiceError(f"no pool named {name!r} in the DHT" + (f" (found: {', '.join(names)})" if names else
                                                                     " (found none)"))
    keys = sorted({s.record.coordinator_key for s in found})
    if len(keys) > 1:
        raise PoolChoiceError(f"{len(keys)} keys announce a pool named {name!r}: "
                              + ", ".join(k[:16] for k in keys)
                              + f". Ask its operator for its key and join with --pool {name}@<key prefix>.")
    chosen = max(found, key=lambda s: s.record.seq)
    if chosen.record.status != "open":
        raise PoolChoiceError(f"pool {name!r} is {chosen.record.status}: it is not taking new nodes")
    return chosen
