"""`swarmrl node doctor`: against a live coordinator on loopback (real uvicorn, real HTTP Date header), against a
dead URL (in-process and through the CLI's exit status), and each check's verdicts on inputs that must fail."""

from __future__ import annotations

import email.utils
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.server import running_server
from swarmrl.node.config import NodeConfig
from swarmrl.node.doctor import check_disk, check_engine, check_key, check_ports, clock_check, report, run_checks
from swarmrl.node.engine import EngineConfig
from swarmrl.node.engines import vllm_available
from swarmrl.protocol.identity import Identity

REPO = Path(__file__).resolve().parents[1]


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once the socket is closed


def test_doctor_against_a_live_coordinator(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(data_dir=tmp_path / "coord", run={"run_id": "doc-run"})
    key = cfg.load_identity()
    with running_server(cfg, key) as url:
        node = NodeConfig(coordinator_url=url, key_path=tmp_path / "node.key", work_dir=tmp_path / "node",
                          engine={"kind": "torch"})
        checks = by_name(run_checks(node))
        assert checks["coordinator"].status == "OK" and "doc-run" in checks["coordinator"].detail
        assert checks["key"].status == "OK" and "will be pinned" in checks["key"].detail
        assert checks["clock"].status == "OK", checks["clock"]
        assert checks["engine"].status == "OK" and "torch engine" in checks["engine"].detail
        assert checks["device"].status == "OK" and checks["identity"].status == "OK"
        assert {"memory", "disk", "ports"} <= set(checks)

        # The node trusts another key than the one this coordinator presents: FAIL, with the fix.
        other = NodeConfig(**{**node.model_dump(), "coordinator_key": Identity.generate().public_key_hex})
        wrong = by_name(run_checks(other))["key"]
        assert wrong.status == "FAIL" and key.public_key_hex[:16] in wrong.detail and "coordinator_key" in wrong.fix
        assert "FAIL" in report(list(by_name(run_checks(other)).values()))


def test_doctor_against_a_dead_url(tmp_path: Path) -> None:
    url = dead_url()
    node = NodeConfig(coordinator_url=url, key_path=tmp_path / "node.key", work_dir=tmp_path / "node",
                      engine={"kind": "torch"})
    checks = by_name(run_checks(node))
    assert checks["coordinator"].status == "FAIL" and url in checks["coordinator"].detail
    assert "coordinator_url" in checks["coordinator"].fix
    assert "clock" not in checks  # nothing to measure against

    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "swarmrl.cli", "node", "doctor", "--set", f"coordinator_url={url}",
                           "--set", "engine.kind=torch", "--set", f"work_dir={tmp_path / 'node'}", "--set",
                           f"key_path={tmp_path / 'node.key'}"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "coordinator" in x and "FAIL" in x)
    assert url in line
    assert "fix:" in proc.stdout and "to fix" in proc.stdout.splitlines()[-1]


def test_clock_skew_verdicts() -> None:
    now = time.time()

    def header(offset: float) -> str:
        return email.utils.formatdate(now + offset, usegmt=True)

    assert clock_check(header(0), now - 0.01, now + 0.01).status == "OK"
    warn = clock_check(header(30), now - 0.01, now + 0.01)
    assert warn.status == "WARN" and "+30" in warn.detail.replace("+29", "+30") and "NTP" in warn.fix
    fail = clock_check(header(-600), now - 0.01, now + 0.01)
    assert fail.status == "FAIL" and "refused" in fail.detail
    assert clock_check(None, now, now).status == "WARN"
    assert clock_check("yesterday-ish", now, now).status == "WARN"


def test_local_checks_that_must_fail(tmp_path: Path) -> None:
    # A key file others can read is refused by the node: FAIL with the chmod fix.
    key = tmp_path / "node.key"
    Identity.generate().save(key)
    key.chmod(0o644)
    bad = check_key(key)
    assert bad.status == "FAIL" and "chmod 600" in bad.fix
    key.chmod(0o600)
    assert check_key(key).status == "OK"
    # A fixed port something else holds.
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = NodeConfig(p2p={"host_maddrs": [f"/ip4/0.0.0.0/tcp/{port}"]})
        (taken,) = check_ports(cfg)
        assert taken.status == "FAIL" and str(port) in taken.detail
    assert check_ports(NodeConfig())[0].status == "OK"
    # A work dir that cannot be written (not as root: root writes anywhere).
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        assert check_disk(ro / "node").status == "FAIL"
    assert check_disk(tmp_path / "deep" / "er").status in ("OK", "WARN")
    # The vLLM engine asked for where vLLM is missing, or the CPU asked for bf16.
    cpu_bf16 = by_name(check_engine(EngineConfig(kind="torch", device="cpu", dtype="bfloat16")))
    assert cpu_bf16["dtype"].status == "WARN"


@pytest.mark.vllm
def test_doctor_imports_vllm_in_a_fresh_interpreter() -> None:
    if not vllm_available():  # find_spec only: importing vLLM here would cost the test process seconds
        pytest.skip("vllm is not installed")
    checks = by_name(check_engine(EngineConfig(kind="vllm", device="cpu")))
    assert checks["engine"].status == "OK" and checks["engine"].detail.startswith("vLLM ")
