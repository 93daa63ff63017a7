"""A volunteer's contribution, proven: `swarmrl node --pool NAME` finds a pool in the DHT, joins it and works; the
groups the verifier accepts appear in the coordinator's ledger, and the node holds a valid signed receipt for each,
which `swarmrl ledger --verify` checks offline against nothing but the pool's key. Meanwhile every role serves
Prometheus metrics, each parsed with prometheus_client's exposition parser, under names no other role uses.

Real parts throughout: a coordinator (uvicorn on loopback, SQLite) announcing its pool in a hivemind DHT on
loopback; `swarmrl trainer`, `swarmrl verifier` and `swarmrl node` as separate processes (the node generating with
the torch engine; the verifier running its full checks); real Ed25519. Waits are on observable conditions with
deadlines.
"""

from __future__ import annotations

import csv
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.server import running_server
from swarmrl.node.config import NodeConfig
from swarmrl.node.receipts import RECEIPTS_FILE, ReceiptBook, collect_receipts
from swarmrl.pools.config import PoolsConfig
from swarmrl.pools.records import open_pools_dht
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.receipts import Receipt, verify_receipt
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.runtime.config import dump_toml
from swarmrl.trainer.config import TrainerConfig
from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer, save_checkpoint
from swarmrl.verifier.config import VerifierConfig

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
REPO = Path(__file__).resolve().parents[1]
POOL = "ledger-pool"
RUN = {"run_id": "ledger-run", "task": {"name": "addition"},
       "sampling": {"temperature": 1.0, "max_tokens": 6, "group_size": 4}}
ROLES = ("coordinator", "trainer", "verifier", "node")


def wait_for(condition: Callable[[], Any], what: str, procs: dict[str, subprocess.Popen], logs: Path,
             timeout: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        for name, p in procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited ({p.returncode}):\n{(logs / f'{name}.log').read_text()[-3000:]}")
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}\n{(logs / f'{n}.log').read_text()[-1500:]}" for n in procs)
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.2)  # polling interval of the wait, not a stand-in for synchronisation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, Any] | None:
    """Metric families by name from http://127.0.0.1:port/metrics, or None while nothing answers there."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict[str, Any], name: str, **labels: str) -> float:
    return sum(s.value for s in families[name].samples
               if s.labels.items() >= labels.items() and not s.name.endswith("_created"))


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[tuple[dict[str, subprocess.Popen], Callable[..., None]]]:
    procs: dict[str, subprocess.Popen] = {}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, args: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1"}
        with open(logs / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen([sys.executable, "-m", "swarmrl.cli", *args], stdout=log,
                                           stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)

    yield procs, start
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


def test_a_node_joined_by_pool_name_earns_receipts_for_its_ledger_entries(tmp_path: Path, processes) -> None:
    procs, start = processes
    logs = tmp_path / "logs"
    ckpt = save_checkpoint(build_model(ModelConfig(), build_tokenizer()), build_tokenizer(), tmp_path / "init")
    trainer_key, verifier_key = tmp_path / "trainer.key", tmp_path / "verifier.key"
    operators = []
    for path in (trainer_key, verifier_key):
        Identity.generate().save(path)
        operators.append(Identity.load(path).public_key_hex)
    ports = {role: free_port() for role in ("trainer", "verifier", "node")}

    bootstrap, _ = open_pools_dht(PoolsConfig(host_maddrs=LOOPBACK), client_mode=False, initial_peers=[])
    cfg = CoordinatorConfig(data_dir=tmp_path / "coord", run=RUN, operator_keys=operators,
                            pool={"name": POOL, "host_maddrs": LOOPBACK, "initial_peers": bootstrap.maddrs})
    coordinator = cfg.load_identity()
    try:
        with running_server(cfg, coordinator) as url:
            configs = {
                "trainer": TrainerConfig(coordinator_url=url, key_path=str(trainer_key), init_checkpoint=str(ckpt),
                                         state_dir=str(tmp_path / "trainer"), batch_groups=4, max_steps=1000,
                                         eval_every=1000, eval_size=20, progress=False, metrics_port=ports["trainer"],
                                         check_engine="torch"),
                "verifier": VerifierConfig(coordinator_url=url, key_path=verifier_key, work_dir=tmp_path / "verifier",
                                           metrics_port=ports["verifier"]),
                "node": NodeConfig(key_path=tmp_path / "node.key", work_dir=tmp_path / "node", name="volunteer",
                                   progress=False, max_prompts=2, poll_interval_s=0.1, receipts_interval_s=0.5,
                                   engine={"kind": "torch", "num_threads": 1}, p2p={"enabled": False},
                                   pools={"initial_peers": bootstrap.maddrs, "host_maddrs": LOOPBACK},
                                   metrics_port=ports["node"]),
            }
            for role, role_cfg in configs.items():
                (tmp_path / f"{role}.toml").write_text(dump_toml(role_cfg))
            start("trainer", ["trainer", "--config", str(tmp_path / "trainer.toml")])
            start("verifier", ["verifier", "--config", str(tmp_path / "verifier.toml")])
            start("node", ["node", "--pool", POOL, "--config", str(tmp_path / "node.toml")])  # joins by name

            node_id = Identity.load(wait_for(lambda: (tmp_path / "node.key").exists() and tmp_path / "node.key",
                                             "the node's key", procs, logs)).node_id
            receipts_file = tmp_path / "node" / RECEIPTS_FILE
            held = lambda: receipts_file.exists() and len(receipts_file.read_text().splitlines())  # noqa: E731
            wait_for(lambda: held() >= 4, "the node to hold 4 receipts", procs, logs)

            # Metrics of every role, while they run: parsed by prometheus_client, names prefixed by the role. Each
            # is read until it shows what the run has done (a role updates its counters a moment after acting).
            def shows(port: int, name: str, at_least: float, **labels: str) -> dict[str, Any] | None:
                fams = scrape(port)
                return fams if fams and name in fams and value(fams, name, **labels) >= at_least else None

            families = {
                "node": wait_for(lambda: shows(ports["node"], "swarmrl_node_receipts", 4), "node metrics", procs, logs),
                "verifier": wait_for(lambda: shows(ports["verifier"], "swarmrl_verifier_groups", 4,
                                                   verdict="accepted"), "verifier metrics", procs, logs),
                "trainer": wait_for(lambda: shows(ports["trainer"], "swarmrl_trainer_metric", 0,
                                                  metric="eval_accuracy"), "trainer metrics", procs, logs),
                "coordinator": scrape_url(url),
            }
            for role, fams in families.items():
                assert all(name.startswith(f"swarmrl_{role}_") for name in fams), (role, sorted(fams))
            names = [name for fams in families.values() for name in fams]
            assert len(names) == len(set(names))  # no name in two roles
            assert value(families["node"], "swarmrl_node_groups", outcome="taken") >= 4
            assert value(families["node"], "swarmrl_node_held_version") >= 0
            assert value(families["node"], "swarmrl_node_coordinator_up") == 1
            assert value(families["verifier"], "swarmrl_verifier_full_checks") >= 4
            assert value(families["coordinator"], "swarmrl_coordinator_ledger_groups") >= 4
            assert value(families["coordinator"], "swarmrl_coordinator_nodes", state="live") == 1
            assert value(families["coordinator"], "swarmrl_coordinator_http_requests",
                         route="/v1/receipts", status="200") >= 1

            # The node stops; the verifier decides what is left.
            os.killpg(procs["node"].pid, signal.SIGTERM)
            assert procs.pop("node").wait(60) == 0
            op = CoordinatorClient(url, Identity.load(verifier_key))
            wait_for(lambda: op.overview().groups["pending"] == 0 and op.overview().groups["held"] == 0,
                     "the verifier to decide every group", procs, logs)
            ov = op.overview()
            assert ov.groups["rejected"] == 0 and ov.nodes["banned"] == 0  # an honest node

            # What the node holds: every receipt valid, signed by the pool's key, issued to it; a prefix (by seq)
            # of what the coordinator signed for it. Collecting once more (the node's own code) completes it.
            mine = [Receipt.model_validate_json(line) for line in receipts_file.read_text().splitlines()]
            assert all(verify_receipt(r, coordinator.public_key_hex, node_id) is None for r in mine)
            as_node = CoordinatorClient(url, Identity.load(tmp_path / "node.key"))
            book = ReceiptBook(receipts_file, node_id, coordinator.public_key_hex)
            collect_receipts(as_node, book)
            final = [Receipt.model_validate_json(line) for line in receipts_file.read_text().splitlines()]
            assert final[:len(mine)] == mine and [r.seq for r in final] == sorted({r.seq for r in final})
            ledger = op.ledger(node_id=node_id).entries
            assert ledger and all(e.name == "volunteer" for e in ledger)
            by_version = {e.policy_version: (e.groups, e.tokens) for e in ledger}
            from_receipts: dict[int, tuple[int, int]] = {}
            for r in final:
                g, t = from_receipts.get(r.policy_version, (0, 0))
                from_receipts[r.policy_version] = (g + 1, t + r.tokens)
            assert from_receipts == by_version  # every accepted group of the node has its receipt, and only those
            assert sum(g for g, _ in by_version.values()) == ov.groups["accepted"] == ov.receipts

            # The CLI: the operator's ledger and the node's receipts checked offline say the same.
            cli = lambda *a: subprocess.run([sys.executable, "-m", "swarmrl.cli", "ledger", *a],  # noqa: E731
                                            capture_output=True, text=True, timeout=120,
                                            env={**os.environ, "PYTHONPATH": str(REPO)})
            online = cli("--url", url, "--node", node_id, "--csv")
            offline = cli("--verify", str(receipts_file), "--coordinator-key", coordinator.public_key_hex,
                          "--node", node_id, "--csv")
            assert online.returncode == 0 and offline.returncode == 0, (online.stderr, offline.stderr)
            rows = lambda out: sorted((r["node_id"], r["policy_version"], r["groups"], r["tokens"])  # noqa: E731
                                      for r in csv.DictReader(io.StringIO(out)))
            assert rows(online.stdout) == rows(offline.stdout) != []
            table = cli("--url", url)
            assert table.returncode == 0 and "volunteer" in table.stdout and node_id[:12] in table.stdout
            forged = cli("--verify", str(receipts_file), "--coordinator-key", Identity.generate().public_key_hex)
            assert forged.returncode == 1 and "bad signature" in forged.stderr
    finally:
        bootstrap.close()


def scrape_url(url: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)}
