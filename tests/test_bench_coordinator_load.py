"""bench/coordinator_load.py runs end to end at a toy size: a real coordinator process, load processes of signed
nodes, the coordinator killed with SIGKILL, its database read; its last line is the JSON object that
bench/RESULTS.md records, and nothing answered was lost, with two coordinator processes on one SQLite database (with
the store's writer process and without) as with one. (What it measures is the bench's business; no speed is
asserted here.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.postgres import PG_URL, needs_pg

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_the_load_bench_runs_and_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "coordinator_load.py"), "--stores", "sqlite",
                           "--nodes", "20", "--duration", "2", "--warmup", "1", "--workers", "1", "--concurrency", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"submissions_per_s", "p99_ms", "errors", "lost", "nodes", "store"} <= set(last)
    assert (last["nodes"], last["store"], last["lost"]) == (20, "sqlite", 0)
    runs = last["runs"]
    # Two coordinator processes and the store's writer, nodes asking for the next lease with each submission;
    # beside the baselines: a lease request per submission, one process, one commit per write, no writer process.
    assert [(r["nodes"], r["group_commit"], r["coordinator_workers"], r["next_lease"], r["writer_process"])
            for r in runs] == [(20, True, 2, True, True), (20, True, 2, False, True), (20, True, 1, True, False),
                               (20, False, 2, True, True), (20, True, 2, True, False)]
    assert all(r["lost"] == 0 and r["accepted_total"] > 0 for r in runs), runs
    assert json.loads(out.read_text()) == last


@pytest.mark.timeout(600)
def test_the_load_bench_records_its_scaling_curve_in_processes(tmp_path: Path) -> None:
    """--scaling runs the largest node count with each number of coordinator processes (the headline's not twice)
    and sums them up as submissions/s per store and number of processes."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "coordinator_load.py"), "--stores", "sqlite",
                           "--nodes", "20", "--duration", "2", "--warmup", "1", "--workers", "1", "--concurrency", "4",
                           "--no-baseline", "--scaling", "1,2"], capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["nodes"], r["coordinator_workers"], r["writer_process"]) for r in last["runs"]] == [
        (20, 2, True), (20, 1, False)]
    assert set(last["scaling"]) == {"sqlite"} and set(last["scaling"]["sqlite"]) == {"1", "2"}
    assert all(r["lost"] == 0 and r["accepted_total"] > 0 for r in last["runs"]), last["runs"]


@needs_pg
@pytest.mark.timeout(600)
def test_two_coordinator_processes_on_postgresql_serve_and_lose_nothing(tmp_path: Path) -> None:
    """The same, on PostgreSQL, with one and two coordinator processes: the second forks from the first after the
    migrations, and both serve nodes from one database."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "coordinator_load.py"), "--stores", "postgresql",
                           "--pg-url", PG_URL or "", "--nodes", "20", "--duration", "2", "--warmup", "1", "--workers",
                           "1", "--concurrency", "4", "--no-baseline", "--scaling", "1,2"],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])["runs"]
    assert sorted((r["store"], r["coordinator_workers"]) for r in runs) == [("postgresql", 1), ("postgresql", 2)]
    assert all(r["lost"] == 0 and r["errors"] == 0 and r["accepted_total"] > 0 for r in runs), runs
