"""A node left running: it rides out its coordinator being SIGKILLed and restarted (a real subprocess on the same
port), re-registers when the coordinator lost its database, keeps every accepted group counted once, logs each
outage once, and stops only on a refusal that cannot change (banned, another coordinator key), saying what to do.

Real parts throughout: coordinator processes (`swarmrl coordinator`), uvicorn on loopback, SQLite, Ed25519, a
torch-engine node generating with a tiny random Llama, and a hivemind DHT on loopback through which the node
joins the pool by name. Every wait is on an observable condition with a deadline.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.server import running_server
from swarmrl.node.agent import Node
from swarmrl.node.config import NodeConfig
from swarmrl.node.join import join_pool
from swarmrl.node.refusal import PermanentRefusal
from swarmrl.pools.config import PoolsConfig
from swarmrl.pools.records import open_pools_dht
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import SIGNATURE_HEADER
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.runtime.config import dump_toml
from swarmrl.testing.waiting import wait_for
from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer, save_checkpoint
from swarmrl.transfer.store import ShardStore, cut_checkpoint
from tests.support.node import NodeThread, node_config

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
REPO = Path(__file__).resolve().parents[1]
RUN = {"run_id": "resilient", "sampling": {"group_size": 2, "max_tokens": 4}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tok = build_tokenizer()
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=64), tok)
    return save_checkpoint(model, tok, tmp_path_factory.mktemp("ckpt") / "v0")


def publish(url: str, operator: Identity, ckpt: Path, tmp: Path) -> None:
    """Upload the checkpoint's shards and publish it as version 0, as the trainer does."""
    store = ShardStore(tmp / f"trainer-shards-{secrets.token_hex(4)}")
    manifest = cut_checkpoint(ckpt, run_id=RUN["run_id"], version=0, store=store, shard_size=64 * 1024)
    with CoordinatorClient(url, operator) as op:
        for ref in manifest.shards():
            op.upload_shard(ref.sha256, store.get(ref.sha256))
        op.publish(manifest)


class CoordinatorProcess:
    """`swarmrl coordinator` in its own process on a fixed port, killed and restarted at will."""

    def __init__(self, tmp: Path, operator: Identity, **settings: Any):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.tmp, self.operator, self.settings = tmp, operator, settings
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, **changes: Any) -> None:
        self.settings.update(changes)
        cfg = CoordinatorConfig(host="127.0.0.1", port=self.port, run=RUN, operator_keys=[self.operator.public_key_hex],
                                **self.settings)
        self.starts += 1
        path = self.tmp / f"coordinator-{self.starts}.toml"
        path.write_text(dump_toml(cfg))
        log = open(self.tmp / f"coordinator-{self.starts}.log", "w")  # noqa: SIM115 (closed with the process)
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "swarmrl.cli", "coordinator", "--config", str(path)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.tmp)
        log.close()

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"coordinator exited: {(self.tmp / f'coordinator-{self.starts}.log').read_text()}")
            try:
                return httpx.get(self.url + "/v1/info", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "the coordinator to answer")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


@pytest.fixture
def outage_log(caplog) -> Iterator[Callable[[], tuple[int, int]]]:
    """(outages begun, outages ended) as logged by the node's client."""
    caplog.set_level(logging.INFO, logger="swarmrl.client")

    def counts() -> tuple[int, int]:
        msgs = [r.getMessage() for r in caplog.records if r.name == "swarmrl.client"]
        return sum("unreachable" in x for x in msgs), sum("reachable again" in x for x in msgs)

    yield counts


def test_node_rides_out_sigkill_restarts_and_a_lost_database(tmp_path, checkpoint, outage_log) -> None:
    operator = Identity.generate()
    bootstrap, _ = open_pools_dht(PoolsConfig(host_maddrs=LOOPBACK), client_mode=False, initial_peers=[])
    coord = CoordinatorProcess(tmp_path, operator, data_dir=tmp_path / "coord", key_path=tmp_path / "coordinator.key",
                               pool={"name": "resilient", "host_maddrs": LOOPBACK,
                                     "initial_peers": bootstrap.maddrs})
    runner = None
    try:
        coord.start()
        publish(coord.url, operator, checkpoint, tmp_path)
        # The node finds the pool by name in the DHT (as `swarmrl node --pool resilient` does).
        cfg = node_config(tmp_path, pool="resilient", pools={"initial_peers": bootstrap.maddrs,
                                                             "host_maddrs": LOOPBACK})
        cfg, _ = wait_for(lambda: _try_join(cfg), "the pool to be announced")
        assert cfg.coordinator_url == coord.url
        runner = NodeThread(cfg)
        node = runner.node
        wait_for(lambda: runner.accepted_at_least(4), "the node to submit groups")
        assert node.stats.registrations == 1

        # 1. SIGKILL, and the coordinator comes back with an empty database (same key): the node waits, then
        # registers again and goes on.
        coord.kill()
        wait_for(lambda: node.client.outage.down_since is not None, "the node to notice the outage")
        base = node.stats.groups_accepted  # nothing can be taken while the coordinator is down
        shutil.rmtree(tmp_path / "coord")
        coord.start()
        publish(coord.url, operator, checkpoint, tmp_path)
        wait_for(lambda: runner.accepted_at_least(base + 4), "the node to submit to the restarted coordinator")
        assert node.stats.registrations == 2 and node.stats.held_version == 0

        # 2. SIGKILL again, restarted on the same database: nothing to register, the work goes on.
        coord.kill()
        wait_for(lambda: node.client.outage.down_since is not None, "the node to notice the second outage")
        during = node.stats.groups_accepted
        coord.start()
        wait_for(lambda: runner.accepted_at_least(during + 4), "the node to submit after the second restart")
        assert node.client.outage.down_since is None
        runner.stop()
        assert runner.error is None
        assert node.stats.registrations == 2

        # Every group the node counts as taken since the database was lost is in it, once; no other is.
        with CoordinatorClient(coord.url, operator) as op:
            status = op.status()
            pending = op.pending(limit=1024)
        taken = node.stats.groups_accepted - base
        assert node.stats.groups_unconfirmed == 0
        assert status.groups_pending == len(pending) == taken
        keys = [(p.group.prompt_id, p.node_id) for p in pending]
        assert len(set(keys)) == len(keys) and {p.node_id for p in pending} == {node.identity.node_id}
        assert [n.groups_accepted + n.groups_rejected for n in status.nodes] == [0]  # nothing verified yet
        assert outage_log() == (2, 2)  # each outage said once when it began and once when it ended
        assert node.client.outage.outages == 2
    finally:
        if runner is not None and runner.thread.is_alive():
            runner.stop()
        coord.stop()
        bootstrap.close()


def _try_join(cfg: NodeConfig) -> tuple[NodeConfig, Any] | None:
    from swarmrl.pools.errors import PoolChoiceError

    try:
        return join_pool(cfg)
    except PoolChoiceError:
        return None


def test_a_coordinator_back_with_another_key_stops_the_node(tmp_path, checkpoint) -> None:
    operator = Identity.generate()
    coord = CoordinatorProcess(tmp_path, operator, data_dir=tmp_path / "coord", key_path=tmp_path / "first.key")
    runner = None
    try:
        coord.start()
        publish(coord.url, operator, checkpoint, tmp_path)
        runner = NodeThread(node_config(tmp_path, coordinator_url=coord.url))  # the key is pinned on first use
        wait_for(lambda: runner.accepted_at_least(2), "the node to submit groups")
        coord.kill()
        shutil.rmtree(tmp_path / "coord")
        coord.start(key_path=tmp_path / "second.key")  # someone else now answers at that address
        runner.thread.join(120)
        assert not runner.thread.is_alive()
        assert isinstance(runner.error, PermanentRefusal), runner.error
        assert "presents key" in str(runner.error) and "pinned" in str(runner.error)
    finally:
        if runner is not None and runner.thread.is_alive():
            runner.stop()
        coord.stop()


def test_a_banned_node_stops_with_the_reason(tmp_path, checkpoint) -> None:
    operator = Identity.generate()
    cfg = CoordinatorConfig(data_dir=tmp_path / "coord", run=RUN, operator_keys=[operator.public_key_hex])
    with running_server(cfg, cfg.load_identity()) as url:
        publish(url, operator, checkpoint, tmp_path)
        runner = NodeThread(node_config(tmp_path, coordinator_url=url))
        try:
            wait_for(lambda: runner.accepted_at_least(2), "the node to submit groups")
            with CoordinatorClient(url, operator) as op:
                group = op.pending(limit=1)[0]
                op.verdicts([m.Verdict(group_id=group.group_id, accepted=False, reason="replay mismatch", ban=True)])
            runner.thread.join(120)
            assert not runner.thread.is_alive()
        finally:
            if runner.thread.is_alive():
                runner.stop()
        assert isinstance(runner.error, PermanentRefusal), runner.error
        assert "banned" in str(runner.error) and "replay mismatch" in str(runner.error)
        assert str(cfg.data_dir) not in str(runner.error) and "node.key" in str(runner.error)


def test_a_submission_applied_but_unanswered_counts_once(tmp_path, checkpoint) -> None:
    """The coordinator applies a submission but its answer is lost on the way back: the retry (signed afresh,
    same Idempotency-Key) gets "already submitted" for every group, and the node counts them as taken, once."""
    operator = Identity.generate()
    cfg = CoordinatorConfig(data_dir=tmp_path / "coord", run=RUN, operator_keys=[operator.public_key_hex])
    seen: list[tuple[str, str | None, str]] = []

    class LoseFirstSubmitAnswer(httpx.HTTPTransport):
        """Sends every request to the real server; drops the answer to the first submission on the way back."""

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            response = super().handle_request(request)
            signature = json.loads(request.headers.get(SIGNATURE_HEADER, "{}"))
            seen.append((request.url.path, request.headers.get("idempotency-key"), signature.get("nonce", "")))
            if request.url.path == "/v1/submit" and sum(p == "/v1/submit" for p, _, _ in seen) == 1:
                response.read()
                raise httpx.ReadError("connection reset by peer", request=request)
            return response

    with running_server(cfg, cfg.load_identity()) as url:
        publish(url, operator, checkpoint, tmp_path)
        node = Node(node_config(tmp_path, coordinator_url=url, max_leases=2))
        node.client = CoordinatorClient(url, node.identity, transport=LoseFirstSubmitAnswer(),
                                        retry=node.client.retry, stop=node._stop, outage=node.client.outage)
        stats = node.run()
        with CoordinatorClient(url, operator) as op:
            pending = op.pending(limit=1024)
    submits = [(key, nonce) for path, key, nonce in seen if path == "/v1/submit"]
    assert len(submits) == 3  # lease 1: the lost try and its retry; lease 2: one try
    assert submits[0][0] == submits[1][0] != submits[2][0]  # one key per logical request, kept by its retry
    assert submits[0][1] != submits[1][1]  # each try signed afresh: a new nonce
    assert stats.groups_accepted == stats.groups_submitted == 4 and stats.groups_rejected == 0
    assert len(pending) == 4 and len({p.group.prompt_id for p in pending}) == 4
