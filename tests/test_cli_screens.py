"""What a user reads and types, fitted to what the screens show: `ledger --node` takes the id prefixes every screen
prints, `pool list` reads at 80 columns, every flag a message suggests exists, and vLLM's reload warnings stay out of
the node's live panel."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from swarmrl.ledgercmd import NodeIdError, resolve_node_id
from swarmrl.poolcmd import render_listing
from swarmrl.pools.discover import PoolListing, Refusal
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pools import PoolRecord, SignedPoolRecord
from swarmrl.runtime.client import CoordinatorClient

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}


def swarmrl(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarmrl.cli", *args], cwd=cwd, env=env or ENV,
                          capture_output=True, text=True, timeout=180)


# -- ledger --node ----------------------------------------------------------------------------------------------


def test_a_node_id_prefix_names_the_one_node_it_starts_and_no_other() -> None:
    ids = ["3fa9c01b2e" + "0" * 30, "3fa9c01b2f" + "1" * 30, "77" + "2" * 38]
    assert resolve_node_id("3FA9C01B2E", ids, "x") == ids[0]  # the 10 characters a screen shows, any case
    assert resolve_node_id("77", ids, "x") == ids[2]
    with pytest.raises(NodeIdError, match=r"'3fa9c01b2' is the start of 2 node ids in the pool .*give more"):
        resolve_node_id("3fa9c01b2", ids, "the pool")
    with pytest.raises(NodeIdError, match="no node id in the pool starts with 'abc'"):
        resolve_node_id("abc", ids, "the pool")
    with pytest.raises(NodeIdError, match="is not a node id"):
        resolve_node_id("node-1", ids, "the pool")


def _sharing_a_first_digit() -> tuple[Identity, Identity]:
    seen: dict[str, Identity] = {}
    while True:
        ident = Identity.generate()
        if ident.node_id[0] in seen:
            return seen[ident.node_id[0]], ident
        seen[ident.node_id[0]] = ident


def test_ledger_takes_the_prefix_a_screen_shows_and_refuses_an_ambiguous_one(tmp_path: Path, run_factory) -> None:
    run = run_factory()
    a, b = _sharing_a_first_digit()
    for name, ident in (("a", a), ("b", b)):
        CoordinatorClient(run.url, ident, retries=0, coordinator_key=run.key.public_key_hex).register(name=name)
    ok = swarmrl("ledger", "--url", run.url, "--node", a.node_id[:12], "--csv", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0].startswith("node_id,")
    shared = os.path.commonprefix([a.node_id, b.node_id])
    ambiguous = swarmrl("ledger", "--url", run.url, "--node", shared, cwd=tmp_path)
    assert ambiguous.returncode != 0 and "Traceback" not in ambiguous.stderr
    assert f"--node '{shared}' is the start of 2 node ids" in ambiguous.stderr and "give more" in ambiguous.stderr


# -- pool list --------------------------------------------------------------------------------------------------


def _record(name: str, key: Identity, **over: object) -> SignedPoolRecord:
    now = time.time()
    fields: dict = dict(name=name, model="Qwen2.5-0.5B-Instruct [bold]not markup[/bold], fp32", task="gsm8k",
                        coordinator_urls=["https://a-rather-long-host-name.pools.example.org:8470"],
                        coordinator_key=key.public_key_hex, current_version=1234, nodes=56,
                        accepted_tokens=123_456_789, issued_at=now, expires_at=now + 300, seq=1)
    fields.update(over)
    return SignedPoolRecord.sign(PoolRecord(**fields), key)


def test_pool_list_reads_at_80_columns() -> None:
    k1, k2, k3 = Identity.generate(), Identity.generate(), Identity.generate()
    listing = PoolListing(pools=[_record("alpha", k1), _record("alpha", k2), _record("math-pool", k3, status="paused",
                                                                                      current_version=-1)],
                          refused=[Refusal(k3.public_key_hex, "beta", "expired 20 s ago")])
    out = io.StringIO()
    console = Console(file=out, width=80, highlight=False, color_system=None)
    for line in render_listing(listing, time.time()):
        console.print(line)
    text = out.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    for field in ("alpha", "math-pool", "paused", "v1234", "no version yet", "56 nodes", "123,456,789 accepted tokens",
                  "task gsm8k", "https://a-rather-long-host-name.pools.example.org:8470", k1.public_key_hex[:16],
                  "Qwen2.5-0.5B-Instruct [bold]not markup[/bold], fp32",  # whole, and as the record says it
                  f"--pool alpha@{k2.public_key_hex[:8]}", "refused beta", "expired 20 s ago"):
        assert sum(field in line for line in lines) >= 1, (field, text)  # on one line: nothing wrapped or cut


# -- flags the messages suggest ---------------------------------------------------------------------------------


def test_every_flag_the_missing_bootstrap_message_suggests_exists_for_swarmrl_node(tmp_path: Path) -> None:
    env = {k: v for k, v in ENV.items() if k != "SWARMRL_BOOTSTRAP"}
    proc = swarmrl("node", "--pool", "alpha", "--set", f"work_dir={tmp_path / 'node'}", cwd=tmp_path, env=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("swarmrl node: no bootstrap peers"), proc.stderr
    flags = re.findall(r"(?<![\w-])--[a-z][a-z-]*", message)
    assert "--bootstrap" in flags
    peer = "/ip4/127.0.0.1/tcp/31337/p2p/QmBootstrapPeer"
    for flag in flags:
        shown = swarmrl("node", flag, peer, "--print-config", cwd=tmp_path, env=env)
        assert shown.returncode == 0, (flag, shown.stderr)
    assert f'initial_peers = ["{peer}"]' in shown.stdout


# -- vLLM's logs and the live panel -----------------------------------------------------------------------------


def test_vllm_logs_go_through_ours_and_the_tied_head_reload_warning_is_dropped(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import logging
        from swarmrl.node.quietlogs import route_engine_logs
        route_engine_logs()
        seen = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())
        logging.getLogger().addHandler(handler)
        from vllm.logger import init_logger  # vLLM configures its logging on import
        vllm_root = logging.getLogger("vllm")
        assert vllm_root.handlers == [] and vllm_root.propagate, (vllm_root.handlers, vllm_root.propagate)
        reload_log = init_logger("vllm.model_executor.model_loader.reload.layerwise")
        reload_log.warning("%s: Failed to load weights", "ParallelLMHead")
        reload_log.warning("%s: Failed to load weights", "QKVParallelLinear")
        print(seen)
    """)
    env = {k: v for k, v in ENV.items() if k != "VLLM_CONFIGURE_LOGGING"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Through this process's handlers (printed above the panel), and only the warning that says something.
    assert proc.stdout.strip().splitlines()[-1] == "['QKVParallelLinear: Failed to load weights']"
