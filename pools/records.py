"""Pool records in the hivemind DHT: where they live, and the validator every pools peer of ours runs.

All pools share one DHT key, `POOLS_KEY`; each coordinator writes the subkey named by its Ed25519 public key
(hex), the value being its `SignedPoolRecord` as JSON text, stored to expire when the record does. hivemind keeps
one value per subkey (the one that expires last), so whoever can store under a subkey could shadow its owner's
record: `PoolRecordValidator` makes a peer refuse, for that key only, a value that is not a record signed by the
subkey's own key, or that is stored to outlive what it says. Coordinators' announcing peers run it (so they refuse
to store forgeries for others) and so do readers (a peer's answer that carries a forgery is dropped whole, and
the forgery's reason is kept for the reader to show); other DHT users' records are not its business.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.timed_storage import get_dht_time

from swarmrl.pools.config import DhtAccess
from swarmrl.protocol.pools import SignedPoolRecord, parse_signed_record, pool_record_problem
from swarmrl.protocol.signing import DEFAULT_CLOCK_SKEW_S
from swarmrl.transfer.p2p.host import DhtHost

POOLS_KEY = "swarmrl/pools/v1"
_POOLS_KEY_ID = DHTID.generate(source=POOLS_KEY).to_bytes()
MAX_REFUSALS_KEPT = 256


def record_value(signed: SignedPoolRecord) -> str:
    """What is stored in the DHT for `signed`."""
    return signed.model_dump_json()


class PoolRecordValidator(RecordValidatorBase):
    """Refuses pool records that are forged, tampered with, in another key's slot, expired or stored to outlive
    their own expiry. `refusals` keeps the latest reason per subkey (for readers to report)."""

    def __init__(self, max_skew_s: float = DEFAULT_CLOCK_SKEW_S):
        self.max_skew_s = max_skew_s
        self._lock = threading.Lock()
        self._refusals: dict[str, str] = {}

    def validate(self, record: DHTRecord) -> bool:
        if record.key != _POOLS_KEY_ID or record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            return True
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
        except Exception:  # noqa: BLE001 (anything that does not decode is malformed)
            return self._refuse(repr(record.subkey[:40]), "malformed: not a msgpack value")
        if not isinstance(subkey, str):
            return self._refuse(repr(subkey)[:40], "malformed: the subkey is not a key")
        try:
            signed = parse_signed_record(value)
        except ValueError as e:
            return self._refuse(subkey, str(e))
        problem = pool_record_problem(signed, now=get_dht_time(), max_skew_s=self.max_skew_s, subkey=subkey,
                                      dht_expiration=record.expiration_time)
        return True if problem is None else self._refuse(subkey, problem)

    def _refuse(self, subkey: str, reason: str) -> bool:
        with self._lock:
            if len(self._refusals) >= MAX_REFUSALS_KEPT:
                self._refusals.clear()
            self._refusals[subkey[:80]] = reason
        return False

    def take_refusals(self) -> dict[str, str]:
        """Subkey -> reason of the records refused since the last call."""
        with self._lock:
            out, self._refusals = self._refusals, {}
        return out

    @property
    def priority(self) -> int:
        return 5  # after hivemind's signature validator (10), as the holder records' validator

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, PoolRecordValidator)


def open_pools_dht(access: DhtAccess, *, client_mode: bool, initial_peers: Sequence[str] | None = None
                   ) -> tuple[DhtHost, PoolRecordValidator]:
    """A started DHT host for the pools (bootstrapped from `initial_peers`, else `access.bootstrap()`), with its
    pool-record validator. `client_mode`: read only (a reader); False: a full member that also keeps and serves
    records for others (a coordinator's announcer, a bootstrap peer)."""
    validator = PoolRecordValidator()
    peers = list(initial_peers) if initial_peers is not None else access.bootstrap()
    host = DhtHost(initial_peers=peers, host_maddrs=access.host_maddrs, announce_maddrs=access.announce_maddrs,
                   identity_path=access.identity_path, startup_timeout_s=access.startup_timeout_s,
                   wait_timeout_s=access.wait_timeout_s, extra_validators=[validator], client_mode=client_mode)
    return host.start(), validator
