"""bench/write_path.py runs at a toy size: this checkout and a baseline commit (HEAD, in a temporary worktree) each
drive an in-process coordinator side by side, every submission taken whole with its next lease; its last line is
the JSON object bench/RESULTS.md records, and the worktree is gone afterwards. (No speed is asserted here.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.postgres import PG_URL, needs_pg

ROOT = Path(__file__).resolve().parents[1]


def _worktrees() -> list[str]:
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list", "--porcelain"], capture_output=True,
                            text=True, check=True).stdout
    return [line for line in listed.splitlines() if line.startswith("worktree ")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgresql", marks=needs_pg)])
def test_the_write_path_bench_compares_two_checkouts(store: str) -> None:
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: the bench checks its baseline out of git")
    before = _worktrees()
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "write_path.py"), "--baseline", "HEAD",
                           "--rounds", "1", "--nodes", "3", "--warmup", "3", "--submissions", "12", "--store", store,
                           *(["--pg-url", PG_URL] if store == "postgresql" else [])],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert (last["baseline"], last["rounds"], last["submissions"], last["store"]) == ("HEAD", 1, 12, store)
    for key in ("write_cpu_us", "process_cpu_us"):
        assert last[key]["this"] > 0 and last[key]["baseline"] > 0
        assert len(last[key.removesuffix("_us") + "_ratios"]) == 1
    # The write is part of the process: its CPU per submission is less than the whole process's.
    assert last["write_cpu_us"]["this"] < last["process_cpu_us"]["this"]
    if store == "postgresql":  # the server's CPU is reported too (in clock ticks: 12 submissions may read as 0)
        assert last["server_cpu_us"]["this"] >= 0 and last["server_cpu_us"]["baseline"] >= 0
    assert _worktrees() == before
