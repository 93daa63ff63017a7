"""The coordinator's SQLite store and config, without HTTP."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import pytest

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.store import Store
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.config import load_config


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "db.sqlite")
    yield s
    s.close()


def _node(store: Store, node_id: str = "n1") -> None:
    store.upsert_node(node_id, node_id.ljust(64, "0"), "name", "torch", now=100.0)


def _lease(store: Store, lease_id: str = "L1", node_id: str = "n1", prompts: int = 2, expires_at: float = 200.0):
    store.insert_lease(lease_id, node_id, 0, 100.0, expires_at, {"group_size": 2},
                       [(f"{lease_id}.{i}", f"{i}+{i}=", str(2 * i), [10 + i, 20 + i]) for i in range(prompts)])


def _group(store: Store, lease_id: str = "L1", prompt: str = "L1.0", node_id: str = "n1") -> int:
    return store.insert_group(node_id, lease_id, prompt, 0, {"prompt_id": prompt, "rollouts": [{}, {}]}, now=101.0)


def test_transaction_rolls_back_on_error(store: Store) -> None:
    with pytest.raises(RuntimeError), store.transaction():
        _node(store)
        with store.transaction():  # nested: joins the outer transaction
            store.set_int("current_version", 5)
        raise RuntimeError("refused")
    assert store.get_node("n1") is None
    assert store.get_int("current_version", -1) == -1
    with store.transaction():
        _node(store)
    assert store.get_node("n1")["name"] == "name"


def test_nonces_refuse_replays_and_are_pruned(store: Store) -> None:
    assert store.record_nonce("a", "n1", 10.0)
    assert not store.record_nonce("a", "n1", 10.0)
    assert store.record_nonce("b", "n1", 10.0)  # per signer
    assert store.record_nonce("a", "n2", 500.0)
    assert store.prune_nonces(older_than=100.0) == 2
    assert not store.record_nonce("a", "n2", 500.0)


def test_challenges_are_bound_single_use_and_expire(store: Store) -> None:
    assert store.add_challenge("c1", "keyA", expires_at=160.0, now=100.0, limit=10)
    assert not store.take_challenge("c1", "keyB", now=110.0)  # someone else's: not consumed
    assert store.take_challenge("c1", "keyA", now=110.0)
    assert not store.take_challenge("c1", "keyA", now=111.0)  # single use
    assert store.add_challenge("c2", "keyA", expires_at=160.0, now=100.0, limit=10)
    assert not store.take_challenge("c2", "keyA", now=161.0)  # expired
    assert store.add_challenge("c3", "keyA", expires_at=300.0, now=200.0, limit=1)  # c2 pruned as expired
    assert not store.add_challenge("c4", "keyA", expires_at=300.0, now=200.0, limit=1)


def test_node_upsert_keeps_counters_and_ban(store: Store) -> None:
    _node(store)
    store.count_node_verdict("n1", accepted=3, rejected=1)
    store.ban_node("n1", "forged logprobs")
    store.upsert_node("n1", "n1".ljust(64, "0"), "renamed", "vllm", now=150.0)
    node = store.get_node("n1")
    assert (node["name"], node["engine"], node["last_seen"], node["registered_at"]) == ("renamed", "vllm", 150.0, 100.0)
    assert (node["groups_accepted"], node["groups_rejected"], node["banned"]) == (3, 1, 1)
    assert node["ban_reason"] == "forged logprobs"
    assert node["reputation"] == pytest.approx((3 + 1) / (4 + 2))
    assert store.node_counts() == {"total": 1, "banned": 1}


def test_leases_prompts_and_submission_flags(store: Store) -> None:
    _node(store)
    _lease(store, "L1", expires_at=200.0)
    _lease(store, "L2", expires_at=120.0)
    assert store.count_open_leases("n1", now=110.0) == 2
    assert store.count_open_leases("n1", now=150.0) == 1  # L2 expired
    prompts = store.lease_prompts("L1")
    assert list(prompts) == ["L1.0", "L1.1"] and prompts["L1.1"]["seeds"] == [11, 21]
    assert prompts["L1.1"]["answer"] == "2" and store.get_lease("L1")["sampling"] == {"group_size": 2}
    assert store.mark_prompt_submitted("L1", "L1.0")
    assert not store.mark_prompt_submitted("L1", "L1.0")
    assert not store.close_lease_if_complete("L1")
    assert store.mark_prompt_submitted("L1", "L1.1")
    assert store.close_lease_if_complete("L1")
    assert store.count_open_leases("n1", now=110.0) == 1


def test_group_lifecycle_claims_and_cursor(store: Store) -> None:
    _node(store)
    _node(store, "n2")
    _lease(store, "L1")
    _lease(store, "L2", node_id="n2")
    g1, g2, g3 = _group(store, "L1", "L1.0"), _group(store, "L1", "L1.1"), _group(store, "L2", "L2.0", "n2")
    with pytest.raises(Exception):  # noqa: B017 - the unique (lease, prompt) constraint, whatever the driver calls it
        _group(store, "L1", "L1.0")

    claimed = store.claim_pending("v1", limit=2, now=100.0, until=220.0)
    assert [r["id"] for r in claimed] == [g1, g2]
    assert claimed[0]["answer"] == "0" and claimed[0]["seeds"] == [10, 20] and claimed[0]["lease_version"] == 0
    assert [r["id"] for r in store.claim_pending("v2", limit=5, now=110.0, until=230.0)] == [g3]
    assert store.claim_pending("v2", limit=5, now=120.0, until=240.0) == []
    assert [r["id"] for r in store.claim_pending("v2", limit=5, now=225.0, until=345.0)] == [g1, g2]

    assert store.accept_group(g2, [1.0, 0.0], now=130.0) == 1
    assert store.accept_group(g1, [0.5, 0.5], now=131.0) == 2
    assert [(r["accepted_seq"], r["id"]) for r in store.accepted_after(0, 10)] == [(1, g2), (2, g1)]
    assert [r["id"] for r in store.accepted_after(1, 10)] == [g1]
    assert store.accepted_after(0, 10)[0]["rewards"] == [1.0, 0.0]
    assert store.accept_group(g1, [0.0, 0.0], now=131.5) is None  # decided already: no cursor value used

    store.reject_group(g1, "late", now=132.0)  # not pending any more: no effect
    assert store.get_group(g1)["status"] == "accepted"
    assert store.reject_pending_of_node("n2", "node banned", now=133.0) == 1
    assert store.get_group(g3)["reason"] == "node banned"
    assert store.group_counts() == {"pending": 0, "accepted": 2, "rejected": 1}


def test_counter_is_unique_across_threads(store: Store) -> None:
    seen: list[int] = []

    def work() -> None:
        for _ in range(50):
            seen.append(store.next_int("c"))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 201))


def test_state_survives_reopen(tmp_path: Path) -> None:
    s = Store(tmp_path / "db.sqlite")
    _node(s)
    _lease(s)
    gid = _group(s)
    s.accept_group(gid, [1.0, 1.0], now=120.0)
    s.insert_manifest(3, {"manifest": {"version": 3}}, now=121.0)
    s.set_int("current_version", 3)
    s.insert_metrics(7, 3, {"reward": 0.5}, now=122.0)
    s.close()

    s = Store(tmp_path / "db.sqlite")
    assert s.get_node("n1") is not None
    assert [r["id"] for r in s.accepted_after(0, 10)] == [gid]
    assert s.get_manifest(3) == {"manifest": {"version": 3}} and s.latest_manifests(5) == [{"manifest": {"version": 3}}]
    assert s.get_int("current_version", -1) == 3
    assert s.recent_metrics(10)[0]["data"] == {"reward": 0.5}
    assert s.next_int("accepted_seq") == 2  # the cursor continues, never reuses a value
    s.close()


def test_config_from_toml_with_overrides(tmp_path: Path) -> None:
    op = Identity.generate().public_key_hex
    toml = tmp_path / "coordinator.toml"
    toml.write_text(f'port = 9000\noperator_keys = ["{op.upper()}"]\n\n[run]\nrun_id = "r1"\n\n'
                    "[run.sampling]\ngroup_size = 4\ntemperature = 0.7\n")
    cfg = load_config(CoordinatorConfig, toml, ["run.sampling.group_size=6", f"data_dir={tmp_path / 'd'}"])
    run = cfg.run
    assert (run.run_id, cfg.port, run.sampling.group_size, run.sampling.temperature) == ("r1", 9000, 6, 0.7)
    assert cfg.operator_keys == [op] and cfg.data_dir == tmp_path / "d"
    assert cfg.resolved_key_path == tmp_path / "d" / "coordinator.key"
    assert all(f.description for f in CoordinatorConfig.model_fields.values())


@pytest.mark.parametrize("overrides", [
    ["keep_versions=2", "run.max_staleness=2"],  # verifiers could not fetch the oldest acceptable weights
    ['operator_keys=["abc"]'],
    ["run.task.name=chess"],
    ["nonsense=1"],
    ["run.sampling.group_size=1"],
    ["max_staleness=1"],  # a fact of the run belongs in [run]
])
def test_config_refuses_bad_values(overrides: list[str]) -> None:
    with pytest.raises(ValueError):
        load_config(CoordinatorConfig, None, overrides)


def test_identity_created_private_and_reused(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(data_dir=tmp_path)
    first = cfg.load_identity()
    assert stat.S_IMODE(cfg.resolved_key_path.stat().st_mode) == 0o600
    assert cfg.load_identity().public_key_hex == first.public_key_hex
