"""Public pools in the DHT: signed pool records, the rule that refuses one, and two coordinators announcing their
pools on a loopback hivemind DHT (real `running_server` instances, real Ed25519, real libp2p daemons) while a rogue
DHT peer stores forged, expired and replayed records, and squats a name. `swarmrl pool list --json` runs as a
subprocess against the same DHT. Waits are on observable conditions with deadlines, never on sleeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.pool import attach_pool, pool_name
from swarmrl.coordinator.server import running_server
from swarmrl.coordinator.service import Coordinator
from swarmrl.node.config import NodeConfig
from swarmrl.node.join import join_pool
from swarmrl.node.refusal import PermanentRefusal
from swarmrl.pools.config import BOOTSTRAP_ENV, PoolsConfig
from swarmrl.pools.discover import PoolListing, choose_pool, read_pools
from swarmrl.pools.errors import PoolChoiceError
from swarmrl.pools.records import POOLS_KEY, PoolRecordValidator, open_pools_dht, record_value
from swarmrl.pools.trust import PoolTrust
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pools import (
    MAX_POOL_TTL_S,
    PoolRecord,
    Seen,
    SignedPoolRecord,
    parse_signed_record,
    pool_record_problem,
)
from swarmrl.runtime.config import ConfigError, load_config
from swarmrl.testing.waiting import wait_for
from swarmrl.transfer.p2p.host import DhtHost

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
REPO = Path(__file__).resolve().parents[1]


def record(key: Identity, name: str = "alpha", seq: int = 1, issued: float | None = None, ttl: float = 60.0,
           **over: Any) -> SignedPoolRecord:
    issued = time.time() if issued is None else issued
    fields = dict(name=name, description="adds numbers", model="tiny-llama", task="addition",
                  coordinator_urls=["http://127.0.0.1:8470"], coordinator_key=key.public_key_hex, current_version=3,
                  nodes=2, accepted_tokens=1000, issued_at=issued, expires_at=issued + ttl, seq=seq)
    fields.update(over)
    return SignedPoolRecord.sign(PoolRecord(**fields), key)


# -- the record and the rule ----------------------------------------------------------------------------


def test_a_signed_record_verifies_and_any_change_breaks_it() -> None:
    key = Identity.generate()
    signed = record(key)
    assert pool_record_problem(signed, now=time.time()) is None
    back = parse_signed_record(record_value(signed))
    assert back == signed and back.signature_ok()
    tampered = signed.model_copy(update={"record": signed.record.model_copy(update={"nodes": 99})})
    assert "bad signature" in pool_record_problem(tampered, now=time.time())
    with pytest.raises(ValueError, match="signed by the coordinator key it names"):
        SignedPoolRecord.sign(signed.record, Identity.generate())


def test_every_refusal_has_its_reason() -> None:
    a, f = Identity.generate(), Identity.generate()
    now = time.time()
    good = record(a, seq=10)
    # Forged: a record naming A's key, signed by F.
    forged = SignedPoolRecord(record=good.record, signature=f.sign(good.record.signed_bytes()))
    assert pool_record_problem(forged, now=now).startswith("bad signature")
    # Mismatched: A's genuine record in F's slot; or stored to outlive what it says.
    assert pool_record_problem(good, now=now, subkey=f.public_key_hex).startswith("mismatched")
    assert pool_record_problem(good, now=now, dht_expiration=good.record.expires_at + 600).startswith("mismatched")
    assert pool_record_problem(good, now=now, dht_expiration=good.record.expires_at) is None
    # Expired, and issued in the future beyond the skew (within it is fine).
    assert pool_record_problem(record(a, issued=now - 120, ttl=60), now=now).startswith("expired")
    assert pool_record_problem(record(a, issued=now + 600), now=now).startswith("issued")
    assert pool_record_problem(record(a, issued=now + 30), now=now) is None
    # Pinned: the name is pinned to another key.
    squat = record(f, name="alpha")
    why = pool_record_problem(squat, now=now, pinned_key=a.public_key_hex)
    assert "does not match the key pinned for pool 'alpha'" in why
    assert pool_record_problem(good, now=now, pinned_key=a.public_key_hex) is None
    # Replayed: older than seen, or the same sequence number with other contents; the same record again is fine.
    seen = Seen(good.record.seq, good.digest())
    assert pool_record_problem(good, now=now, seen=seen) is None
    assert pool_record_problem(record(a, seq=9), now=now, seen=seen).startswith("replayed")
    assert pool_record_problem(record(a, seq=10, nodes=5), now=now, seen=seen).startswith("replayed")
    assert pool_record_problem(record(a, seq=11), now=now, seen=seen) is None


def test_records_are_bounded() -> None:
    key = Identity.generate()
    for bad in ({"name": "Has Caps"}, {"name": ""}, {"coordinator_urls": []}, {"coordinator_urls": ["ftp://x"]},
                {"coordinator_urls": ["http://a"] * 5}, {"description": "x" * 501}, {"ttl": MAX_POOL_TTL_S + 1},
                {"ttl": -1}, {"status": "sleeping"}, {"nodes": -1}):
        with pytest.raises(ValueError):
            record(key, **bad)
    for raw in ("{", "[]", json.dumps({"record": {}, "signature": "0" * 128}), "x" * 10000, 42):
        with pytest.raises(ValueError, match="malformed"):
            parse_signed_record(raw)


def test_trust_file_round_trip_and_choosing_a_pool(tmp_path: Path) -> None:
    a, b, f = Identity.generate(), Identity.generate(), Identity.generate()
    trust = PoolTrust.in_dir(tmp_path)
    trust.pin("alpha", a.public_key_hex)
    trust.note(record(a, seq=5))
    trust.note(record(a, seq=4))  # older: not remembered over the newer
    trust.save()
    again = PoolTrust.in_dir(tmp_path)
    assert again.pins == {"alpha": a.public_key_hex} and again.seen[a.public_key_hex].seq == 5
    assert oct((tmp_path / "pools.json").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ValueError):
        again.pin("alpha", f.public_key_hex)

    listing = PoolListing(pools=[record(a), record(b, name="beta", status="paused"), record(f, name="alpha")])
    with pytest.raises(PoolChoiceError, match="2 keys announce a pool named 'alpha'"):
        choose_pool(listing, "alpha")
    assert choose_pool(listing, "alpha@" + a.public_key_hex[:10]).record.coordinator_key == a.public_key_hex
    with pytest.raises(PoolChoiceError, match="paused"):
        choose_pool(listing, "beta")
    with pytest.raises(PoolChoiceError, match="no pool named 'gamma'.*alpha, beta"):
        choose_pool(listing, "gamma")


# -- on a loopback DHT ----------------------------------------------------------------------------------


@dataclass
class Pools:
    bootstrap: DhtHost
    reader: DhtHost
    validator: PoolRecordValidator
    urls: dict[str, str]  # pool name -> coordinator URL
    keys: dict[str, Identity]  # pool name -> coordinator key
    tmp: Path

    def read(self, trust: PoolTrust | None = None) -> PoolListing:
        return read_pools(self.reader, self.validator, trust=trust, timeout=30)

    def read_until(self, done: Callable[[PoolListing], bool], what: str, trust: PoolTrust | None = None
                   ) -> PoolListing:
        """Read the DHT until the listing satisfies `done` (records spread through the DHT as they are stored)."""
        last: list[PoolListing] = []
        wait_for(lambda: done(last.append(self.read(trust)) or last[-1]), what)
        return last[-1]


@pytest.fixture(scope="module")
def pools(tmp_path_factory) -> Iterator[Pools]:
    """A bootstrap peer (what an operator runs and publishes), two coordinators announcing 'alpha' and 'beta'
    through it, and a reader (what `swarmrl pool list` runs)."""
    tmp = tmp_path_factory.mktemp("pools")
    with ExitStack() as stack:
        bootstrap, _ = open_pools_dht(PoolsConfig(host_maddrs=LOOPBACK), client_mode=False, initial_peers=[])
        stack.callback(bootstrap.close)
        urls, keys = {}, {}
        for name in ("alpha", "beta"):
            cfg = CoordinatorConfig(data_dir=tmp / name, run={"run_id": f"run-{name}", "model": f"{name}-model"},
                                    pool={"name": name, "description": f"the {name} pool", "host_maddrs": LOOPBACK,
                                          "initial_peers": bootstrap.maddrs})
            keys[name] = cfg.load_identity()
            urls[name] = stack.enter_context(running_server(cfg, keys[name]))
        reader, validator = open_pools_dht(PoolsConfig(host_maddrs=LOOPBACK), client_mode=True,
                                           initial_peers=bootstrap.maddrs)
        stack.callback(reader.close)
        p = Pools(bootstrap, reader, validator, urls, keys, tmp)
        p.read_until(lambda lst: {s.record.name for s in lst.pools} == {"alpha", "beta"}, "both pools announced")
        yield p


@pytest.fixture
def rogue_store(pools: Pools) -> Iterator[Callable[[SignedPoolRecord, str, float], None]]:
    """What an attacker's DHT peer does: store whatever it likes under a pool's slot. It runs no pool validator,
    so it keeps the record itself (and serves it to readers until the test ends) even though honest peers refuse
    to store it."""
    rogues: list[DhtHost] = []

    def store(signed: SignedPoolRecord, subkey: str, dht_expiration: float) -> None:
        rogue = DhtHost(initial_peers=pools.bootstrap.maddrs, host_maddrs=LOOPBACK).start()
        rogues.append(rogue)
        assert rogue.dht is not None
        rogue.call(rogue.dht.store(POOLS_KEY, record_value(signed), dht_expiration, subkey=subkey), 30)

    yield store
    for r in rogues:
        r.close()


def test_two_pools_listed_forgery_refused_with_its_reason(pools: Pools, rogue_store) -> None:
    a = pools.keys["alpha"]
    listing = pools.read()
    by_name = {s.record.name: s.record for s in listing.pools}
    assert by_name["alpha"].coordinator_urls == [pools.urls["alpha"]]
    assert by_name["alpha"].coordinator_key == a.public_key_hex and by_name["alpha"].model == "alpha-model"
    assert by_name["beta"].description == "the beta pool" and by_name["beta"].current_version == -1
    assert listing.refused == []

    # A forger claims pool alpha: alpha's name and key, its own signature, in alpha's slot, living longer.
    forger = Identity.generate()
    fake = record(a, name="alpha", seq=2**40, coordinator_urls=["http://evil.example"])
    forged = SignedPoolRecord(record=fake.record, signature=forger.sign(fake.record.signed_bytes()))
    rogue_store(forged, a.public_key_hex, time.time() + 300)
    listing = pools.read_until(lambda lst: bool(lst.refused), "the forged record to be read")
    assert {s.record.name for s in listing.pools} == {"alpha", "beta"}  # the real ones, from honest peers
    alpha = next(s.record for s in listing.pools if s.record.name == "alpha")
    assert alpha.coordinator_urls == [pools.urls["alpha"]]
    assert [(r.key, r.reason.split(":")[0]) for r in listing.refused] == [(a.public_key_hex, "bad signature")]

    # The same through the CLI, in its own process (bootstrap from SWARMRL_BOOTSTRAP).
    env = {**os.environ, "PYTHONPATH": str(REPO), BOOTSTRAP_ENV: ",".join(pools.bootstrap.maddrs)}
    proc = subprocess.run([sys.executable, "-m", "swarmrl.cli", "pool", "list", "--json", "--set",
                           f"pools.host_maddrs={json.dumps(LOOPBACK)}", "--set", f"work_dir={pools.tmp / 'cli'}"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=pools.tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert sorted(p["record"]["name"] for p in out["pools"]) == ["alpha", "beta"]
    assert [SignedPoolRecord.model_validate(p).signature_ok() for p in out["pools"]] == [True, True]
    assert any(r["key"] == a.public_key_hex and r["reason"].startswith("bad signature") for r in out["refused"])

    # The table form, pointed at the DHT with --bootstrap instead.
    env.pop(BOOTSTRAP_ENV)
    proc = subprocess.run([sys.executable, "-m", "swarmrl.cli", "pool", "list", "--bootstrap",
                           pools.bootstrap.maddrs[0], "--set", f"pools.host_maddrs={json.dumps(LOOPBACK)}",
                           "--set", f"work_dir={pools.tmp / 'cli'}"],
                          capture_output=True, text=True, timeout=180, env={**env, "COLUMNS": "250"}, cwd=pools.tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "alpha" in proc.stdout and "beta" in proc.stdout and "bad signature" in proc.stdout


def test_expired_replayed_and_squatted_records_refused(pools: Pools, rogue_store) -> None:
    a, b = pools.keys["alpha"], pools.keys["beta"]
    trust = PoolTrust()
    first = pools.read(trust)
    assert {s.record.name for s in first.pools} == {"alpha", "beta"}
    assert trust.seen[a.public_key_hex].seq > 1  # remembered: the newest alpha record read

    # An expired record of beta's (once genuine), stored by a rogue to live on: refused as expired.
    now = time.time()
    old_beta = record(b, name="beta", seq=1, issued=now - 200, ttl=100)
    rogue_store(old_beta, b.public_key_hex, now + 400)
    listing = pools.read_until(lambda lst: bool(lst.refused), "the expired record to be read", trust)
    assert [(r.key, r.reason.split(" ")[0]) for r in listing.refused] == [(b.public_key_hex, "expired")]
    assert {s.record.name for s in listing.pools} == {"alpha", "beta"}

    # An older genuine record of alpha's that lives longer than the current one (alpha once announced with a
    # long ttl): it shadows the newest in the DHT, and a reader that saw a newer one refuses it as replayed.
    replay = record(a, name="alpha", seq=1, issued=now - 10, ttl=3000)
    rogue_store(replay, a.public_key_hex, replay.record.expires_at)
    listing = pools.read_until(lambda lst: any("replayed" in r.reason for r in lst.refused),
                               "the replayed record to be read", trust)
    assert [r.reason.split(":")[0] for r in listing.refused if r.key == a.public_key_hex] == ["replayed"]
    assert "alpha" not in {s.record.name for s in listing.pools}  # shadowed, but not believed

    # A squatter announces its own (validly signed) pool called alpha: refused where alpha is pinned; without a pin
    # the name is ambiguous and a join must name the key.
    squatter = Identity.generate()
    squat_host, _ = open_pools_dht(PoolsConfig(host_maddrs=LOOPBACK), client_mode=False,
                                   initial_peers=pools.bootstrap.maddrs)
    try:
        squat = record(squatter, name="alpha", coordinator_urls=["http://squat.example"])
        assert squat_host.dht is not None
        assert squat_host.call(squat_host.dht.store(POOLS_KEY, record_value(squat), squat.record.expires_at,
                                                    subkey=squatter.public_key_hex), 30)
        pinned = PoolTrust()
        pinned.pin("alpha", a.public_key_hex)
        listing = pools.read_until(lambda lst: any(r.key == squatter.public_key_hex for r in lst.refused),
                                   "the squatter's record to be read", pinned)
        why = next(r.reason for r in listing.refused if r.key == squatter.public_key_hex)
        assert "does not match the key pinned for pool 'alpha'" in why
        unpinned = pools.read()
        assert [s.record.coordinator_key for s in unpinned.pools if s.record.name == "alpha"].count(
            squatter.public_key_hex) == 1
        with pytest.raises(PoolChoiceError, match="2 keys announce"):
            choose_pool(unpinned, "alpha")
    finally:
        squat_host.close()


def test_node_joins_by_name_pins_the_key_and_refuses_a_changed_one(pools: Pools, tmp_path: Path) -> None:
    cfg = NodeConfig(pool="beta", work_dir=tmp_path / "node", key_path=tmp_path / "node.key", progress=False,
                     pools={"initial_peers": pools.bootstrap.maddrs, "host_maddrs": LOOPBACK})
    joined, chosen = join_pool(cfg)
    b = pools.keys["beta"]
    assert (joined.coordinator_url, joined.coordinator_key) == (pools.urls["beta"], b.public_key_hex)
    assert chosen.record.name == "beta"
    assert PoolTrust.in_dir(cfg.work_dir).pins == {"beta": b.public_key_hex}
    assert join_pool(cfg)[0].coordinator_key == b.public_key_hex  # the pin holds on the next join

    # The pool's key changes (here: the pin says another key): refused loudly, with what to do.
    trust = PoolTrust.in_dir(cfg.work_dir)
    trust.pins["beta"] = Identity.generate().public_key_hex
    trust.save()
    with pytest.raises(PermanentRefusal, match="REFUSED: pool 'beta' is now announced under another key"):
        join_pool(cfg)
    # The same through `swarmrl node --pool beta`: it stops for good (exit status 2) and says what to do.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "swarmrl.cli", "node", "--pool", "beta", "--set", "progress=false",
                           "--set", f"work_dir={cfg.work_dir}", "--set", f"key_path={cfg.key_path}",
                           "--set", f"pools.initial_peers={json.dumps(pools.bootstrap.maddrs)}",
                           "--set", f"pools.host_maddrs={json.dumps(LOOPBACK)}"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "node stopped for good" in proc.stderr and "remove 'beta' from the node's pools.json" in proc.stderr
    with pytest.raises(PoolChoiceError, match="no pool named 'gamma'"):
        join_pool(cfg.model_copy(update={"pool": "gamma"}))


def test_pool_settings_are_checked_before_anything_starts(tmp_path: Path) -> None:
    for bad in ("pool.name=Bad Name", "pool.ttl_s=1", "pool.status=sleeping", "pool.annouce=false"):
        with pytest.raises(ConfigError, match="pool"):
            load_config(CoordinatorConfig, None, [bad, f"data_dir={tmp_path / 'c'}"])
    cfg = CoordinatorConfig(data_dir=tmp_path / "c", run={"run_id": "Some Run!"}, pool={"host_maddrs": LOOPBACK})
    svc = Coordinator(cfg, cfg.load_identity())
    try:
        with pytest.raises(ValueError, match="nodes cannot dial: set pool.public_urls"):
            attach_pool(svc, cfg.model_copy(update={"run": cfg.run.model_copy(update={"run_id": "ok"})}),
                        cfg.load_identity(), "http://0.0.0.0:8470")
        # The run id made into a pool name ('some-run-'): a valid name, announced as such.
        assert pool_name(cfg) == "some-run-"
        assert attach_pool(svc, cfg.model_copy(update={"pool": cfg.pool.model_copy(update={"announce": False})}),
                           cfg.load_identity(), "http://127.0.0.1:1") is None
    finally:
        svc.close()
