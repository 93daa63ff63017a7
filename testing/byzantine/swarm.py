"""A swarm with an attacker (bench/byzantine.py, swarm part): `swarmrl.demo` with two honest nodes plus the rogue
attacker (`testing.byzantine.rogue`, cycling attacks and identities) as a third node: the run must still learn,
and no attacker group may ever reach the trainer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from swarmrl.testing.waiting import wait_for


def swarm(out: Path, time_limit_s: float, max_steps: int) -> dict[str, Any]:
    """`swarmrl.demo` with two honest nodes, plus the rogue attacker as a third node (started as soon as the
    demo's coordinator is up); then the coordinator's database is searched for attacker groups."""
    import sqlite3
    import tomllib

    from swarmrl.demo import DemoConfig, run_demo

    run_dir = out / "swarm"
    shutil.rmtree(run_dir, ignore_errors=True)
    rogue_dir = run_dir / "rogue"
    rogue: dict[str, subprocess.Popen] = {}

    def launch_rogue() -> None:
        cfg_path = run_dir / "config" / "coordinator.toml"

        def configured_port() -> int | None:
            try:  # the demo writes the file after its warm start; a half-written one is read again
                return tomllib.loads(cfg_path.read_text())["port"]
            except (OSError, tomllib.TOMLDecodeError, KeyError):
                return None

        def answers(port: int) -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v1/info", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        port = wait_for(configured_port, "the demo's coordinator config", timeout=3600)
        wait_for(lambda: answers(port), "the demo's coordinator to answer", timeout=600)
        rogue_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # PYTHONPATH as ours: the same checkout
        rogue["p"] = subprocess.Popen(
            [sys.executable, "-m", "swarmrl.testing.byzantine.rogue", "--url", f"http://127.0.0.1:{port}",
             "--work-dir", str(rogue_dir)], env=env, start_new_session=True,
            stdout=open(run_dir / "rogue.log", "w"), stderr=subprocess.STDOUT)

    starter = threading.Thread(target=launch_rogue, daemon=True)
    starter.start()
    cfg = DemoConfig(run_dir=run_dir, nodes=2, time_limit_s=time_limit_s, max_steps=max_steps)
    try:
        report = run_demo(cfg)
    finally:
        (rogue_dir / "STOP").parent.mkdir(parents=True, exist_ok=True)
        (rogue_dir / "STOP").touch()
        if "p" in rogue:
            try:
                rogue["p"].wait(timeout=60)
            except subprocess.TimeoutExpired:
                rogue["p"].kill()
    ids = {}
    if (rogue_dir / "identities.txt").exists():
        for line in (rogue_dir / "identities.txt").read_text().splitlines():
            nid, attack = line.split()
            ids[nid] = attack
    con = sqlite3.connect(f"file:{run_dir / 'coordinator' / 'coordinator.sqlite'}?mode=ro", uri=True)
    rows = con.execute("SELECT node_id, status, reason FROM rollout_groups").fetchall()
    banned = {r[0] for r in con.execute("SELECT id FROM nodes WHERE banned = 1").fetchall()}
    con.close()
    attacker_rows = [r for r in rows if r[0] in ids]
    honest_rows = [r for r in rows if r[0] not in ids]
    return {
        "initial_accuracy": report["initial_accuracy"], "final_accuracy": report["final_accuracy"],
        "learned": report["final_accuracy"] > report["initial_accuracy"], "steps": report["steps"],
        "stop_reason": report["stop_reason"], "wall_seconds": report["wall_seconds"],
        "attacker_identities": len({r[0] for r in attacker_rows}),
        "attacker_identities_banned": len({r[0] for r in attacker_rows} & banned),
        "attacker_groups": len(attacker_rows),
        "attacker_groups_accepted": sum(r[1] == "accepted" for r in attacker_rows),
        "attacker_attacks": sorted(set(ids.values())),
        "honest_groups": len(honest_rows), "honest_groups_rejected": sum(r[1] == "rejected" for r in honest_rows),
    }
