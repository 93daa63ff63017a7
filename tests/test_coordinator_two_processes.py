"""Two coordinator processes (`swarmrl coordinator`, the same [run], the same PostgreSQL store_url, two ports)
serve one pool: nodes lease through one and submit through the other (each submission through both at once),
two verifiers claim and post verdicts crosswise (each batch twice), a trainer reads the feed through both and
acknowledges through the other. Every accepted group reaches the feed exactly once, in order, none lost, and the
counts add up. Needs the PostgreSQL test server (SWARMRL_TEST_PG_URL); real processes, HTTP, Ed25519."""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import pool_id
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.transfer.store import ShardStore, cut_checkpoint
from tests.support.coordinator import signed, submission
from tests.support.postgres import fresh_database, needs_pg

GROUP = 3
NODES, ROUNDS, PROMPTS = 4, 4, 2


@contextmanager
def coordinator_process(config: Path, name: str) -> Iterator[str]:
    """`swarmrl coordinator --config config` in a process of its own; yields its URL once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "swarmrl.cli", "coordinator", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def drain() -> None:  # keep reading, so the process never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.strip().startswith("url:") and not url:
                url.append(line.split()[-1])
                ready.set()
        ready.set()  # the output ended: the process is gone

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert ready.wait(timeout=120) and url, f"coordinator {name} did not start:\n{''.join(lines)}"
        yield url[0]
        assert proc.poll() is None, f"coordinator {name} died:\n{''.join(lines)}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)


def _verdict(pg: m.PendingGroup) -> m.Verdict:
    """A fixed decision per group: the first prompt of a lease is rejected one time in four, else accepted after a
    full check; the second is accepted on cheap checks only (held until a later check of its node)."""
    h = hashlib.sha256(pg.group.prompt_id.encode()).digest()[0]
    rewards = [float(i % 2) for i in range(GROUP)]
    if pg.group.prompt_id.endswith(".1"):
        return m.Verdict(group_id=pg.group_id, accepted=True, rewards=rewards, checked=False)
    if h % 4 == 0:
        return m.Verdict(group_id=pg.group_id, accepted=False, reason="does not replay")
    return m.Verdict(group_id=pg.group_id, accepted=True, rewards=rewards)


@needs_pg
@pytest.mark.timeout(600)
def test_two_coordinator_processes_serve_one_pool(tmp_path: Path) -> None:
    verifier_key, trainer_key = Identity.generate(), Identity.generate()
    shared = tmp_path / "shared"  # key, run secret and shards, as on a shared volume
    coordinator_key = Identity.load_or_create(shared / "coordinator.key").public_key_hex
    with fresh_database() as db_url, ExitStack() as stack:
        config = tmp_path / "coordinator.toml"
        config.write_text(
            f'host = "127.0.0.1"\nport = 0\ndata_dir = "{shared}"\nstore_url = "{db_url}"\n'
            f'operator_keys = ["{verifier_key.public_key_hex}", "{trainer_key.public_key_hex}"]\n'
            "lease_ttl_s = 600.0\nclaim_ttl_s = 600.0\nmax_outstanding_leases = 64\nmax_long_polls = 4\n\n"
            f'[run]\nrun_id = "two-processes"\n\n[run.sampling]\ngroup_size = {GROUP}\nmax_tokens = 4\n\n'
            "[rate_limits]\nsource_rate_per_s = 1e9\nsource_burst = 1e9\n")
        urls = [stack.enter_context(coordinator_process(config, name)) for name in "AB"]

        def clients(identity: Identity) -> list[CoordinatorClient]:
            return [stack.enter_context(CoordinatorClient(u, identity, retries=0)) for u in urls]

        # The trainer publishes through A; B sees the version and serves the shards from the shared directory.
        trainer = clients(trainer_key)
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_bytes(secrets.token_bytes(3000))
        local = ShardStore(tmp_path / "trainer-shards")
        manifest = cut_checkpoint(ckpt, run_id="two-processes", version=0, store=local, shard_size=1024)
        for ref in manifest.shards():
            trainer[0].upload_shard(ref.sha256, local.get(ref.sha256))
        trainer[0].publish(manifest)
        assert trainer[1].info().current_version == 0
        assert trainer[1].shard(manifest.shards()[0].sha256) == local.get(manifest.shards()[0].sha256)

        # Nodes: a challenge issued by one process is redeemed at the other (they share the run's secret).
        node_keys = [Identity.generate() for _ in range(NODES)]
        pool = trainer[0].info().pool  # with the store's epoch: the same from both processes
        assert trainer[1].info().pool == pool and pool.startswith(pool_id("two-processes", coordinator_key) + "/")
        for i, key in enumerate(node_keys):
            ch = httpx.post(urls[i % 2] + "/v1/register/challenge", json={"public_key": key.public_key_hex}).json()
            req = m.RegisterRequest(challenge=ch["challenge"], name=f"n{i}")
            body, headers = signed(key, m.KIND_REGISTER, pool, req)
            assert httpx.post(urls[1 - i % 2] + "/v1/register", content=body, headers=headers).status_code == 200

        lock = threading.Lock()
        taken: list[str] = []  # prompt ids a submission took
        submit_results: list[m.SubmitResult] = []
        claims: list[int] = []
        decisions: dict[str, m.Verdict] = {}  # prompt id -> the verdict posted for its group
        feed: list[m.TrainingGroup] = []
        feed_reads_with_gaps: list[list[int]] = []
        nodes_done, verifiers_done = threading.Event(), threading.Event()

        def node(i: int) -> None:
            mine = clients(node_keys[i])
            with ThreadPoolExecutor(2) as both:
                for r in range(ROUNDS):
                    lease = mine[(i + r) % 2].lease(PROMPTS, held_version=0)
                    assert lease is not None and lease.policy_version == 0
                    sub = submission(lease)
                    results = list(both.map(lambda c, s=sub: c.submit(s), mine))  # the same submission, both at once
                    with lock:
                        submit_results.extend(results)
                        taken.extend(pid for res in results for pid in res.accepted)

        def verifier(v: int) -> None:
            mine = clients(verifier_key)
            k = 0
            while True:
                k += 1
                got = mine[(v + k) % 2].pending(limit=3, wait_s=0.5)
                if not got:
                    if nodes_done.is_set() and mine[0].status().groups_pending == 0:
                        return
                    continue
                verdicts = [_verdict(pg) for pg in got]
                with lock:
                    claims.extend(pg.group_id for pg in got)
                    decisions.update({pg.group.prompt_id: vd for pg, vd in zip(got, verdicts, strict=True)})
                mine[(v + k + 1) % 2].verdicts(verdicts)
                mine[(v + k) % 2].verdicts(verdicts)  # a retried batch: changes nothing

        def train() -> None:
            cursor, k = 0, 0
            while True:
                k += 1
                batch = trainer[k % 2].training_batch(after_id=cursor, limit=5, wait_s=0.5)
                ids = [g.group_id for g in batch.groups]
                if ids != list(range(cursor + 1, cursor + 1 + len(ids))):
                    feed_reads_with_gaps.append(ids)
                if batch.groups:
                    feed.extend(batch.groups)
                    cursor = ids[-1]
                    assert trainer[(k + 1) % 2].ack(cursor).acked >= cursor
                elif verifiers_done.is_set() and cursor == trainer[0].status().groups_accepted:
                    return

        with ThreadPoolExecutor(NODES + 3) as pool:
            trainer_run = pool.submit(train)
            verifier_runs = [pool.submit(verifier, v) for v in range(2)]
            for f in [pool.submit(node, i) for i in range(NODES)]:
                f.result(timeout=300)
            nodes_done.set()
            for f in verifier_runs:
                f.result(timeout=300)
            verifiers_done.set()
            trainer_run.result(timeout=300)

        # Submissions: every leased prompt taken exactly once, the racing duplicate refused as such.
        assert len(taken) == len(set(taken)) == NODES * ROUNDS * PROMPTS
        assert sum(len(r.rejected) for r in submit_results) == NODES * ROUNDS * PROMPTS
        assert all(reason == "already submitted" for r in submit_results for reason in r.rejected.values())
        # Claims: no group was handed to two verifiers (claims outlive the test); every group got one verdict.
        assert len(claims) == len(set(claims)) == len(taken) and set(decisions) == set(taken)
        # The feed: positions 1..n with no read ever seeing a gap, each group once, only accepted ones.
        assert feed_reads_with_gaps == []
        assert [g.group_id for g in feed] == list(range(1, len(feed) + 1))
        fed = [g.group.prompt_id for g in feed]
        assert len(fed) == len(set(fed))
        checked = {p for p, v in decisions.items() if v.accepted and v.checked}
        held = {p for p, v in decisions.items() if v.accepted and not v.checked}
        rejected = {p for p, v in decisions.items() if not v.accepted}
        assert checked <= set(fed) <= checked | held and not rejected & set(fed)
        assert all(g.rewards == decisions[g.group.prompt_id].rewards for g in feed)
        # Counts add up, and both processes say the same.
        status = [c.status() for c in trainer]
        for st in status:
            assert (st.groups_accepted, st.groups_rejected, st.groups_pending) == (len(fed), len(rejected), 0)
            assert st.groups_held == len(held - set(fed))
            assert st.groups_accepted + st.groups_rejected + st.groups_held == len(taken)
            assert sum(n.groups_accepted for n in st.nodes) == len(fed)
            assert sum(n.groups_rejected for n in st.nodes) == len(rejected)
            assert sum(n.checks_passed for n in st.nodes) == len(checked)
        assert status[0].nodes == status[1].nodes
        for c in trainer:
            acked = c.ack(0)  # an older acknowledgement changes nothing
            assert (acked.acked, acked.head) == (len(fed), len(fed))
