"""A persistent attacker for swarm runs: joins a pool like any node, cheats on every group it submits, one attack
after another, and comes back under a fresh identity each time it is banned.

    python -m swarmrl.testing.byzantine.rogue --url http://127.0.0.1:8470 --work-dir runs/rogue

Every identity it used is appended to <work-dir>/identities.txt, so that a bench can check afterwards that
none of their groups ever reached the trainer.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import httpx

from swarmrl.node.config import NodeConfig
from swarmrl.node.engine import EngineConfig
from swarmrl.runtime.client import CoordinatorError
from swarmrl.testing.byzantine import nodes as bad
from swarmrl.testing.byzantine.harness import ScriptedNode

log = logging.getLogger("swarmrl.rogue")

ROGUES = {
    "wrong_model_1pct": lambda cfg: bad.WrongModelNode(cfg, frac=0.01),
    "wrong_model_0.1pct": lambda cfg: bad.WrongModelNode(cfg, frac=0.001),
    "faked_logprobs": lambda cfg: bad.EditNode(cfg, bad.faked_logprobs),
    "edited_token": lambda cfg: bad.EditNode(cfg, bad.edit_token),
    "temperature_1.5x": lambda cfg: bad.TemperatureNode(cfg, clever=True),
    "made_up_completion": lambda cfg: bad.EditNode(cfg, bad.made_up_completion),
    "inflated_claimed_reward": lambda cfg: bad.ClaimNode(cfg),
}


def run_identity(node: ScriptedNode, stop: Path) -> str:
    """Cheat with one identity until it is banned (returns the reason) or `stop` exists."""
    node.prepare()
    while not stop.exists():
        try:
            node.sync()
            if not node.step():
                time.sleep(0.5)
        except CoordinatorError as e:
            if e.status == 403:
                return e.reason
            log.warning("coordinator refused: %s", e.reason)
            time.sleep(0.5)
    return "stopped"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--work-dir", type=Path, required=True)
    p.add_argument("--coordinator-key", default=None)
    p.add_argument("--attacks", default=",".join(ROGUES), help="comma-separated, cycled through")
    p.add_argument("--max-prompts", type=int, default=8)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    attacks = args.attacks.split(",")
    stop = args.work_dir / "STOP"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    k, unreachable = 0, 0
    while not stop.exists() and unreachable < 3:  # the pool is gone: stop
        name = attacks[k % len(attacks)]
        d = args.work_dir / f"id{k}-{name}"
        cfg = NodeConfig(coordinator_url=args.url, coordinator_key=args.coordinator_key, key_path=d / "node.key",
                         name=f"rogue{k}", work_dir=d, max_prompts=args.max_prompts, progress=False,
                         engine=EngineConfig(kind="torch"))
        node = ROGUES[name](cfg)
        with open(args.work_dir / "identities.txt", "a") as f:
            f.write(f"{node.node_id} {name}\n")
        try:
            outcome = run_identity(node, stop)
            unreachable = 0
        except httpx.TransportError as e:
            outcome, unreachable = f"coordinator unreachable: {e!r}", unreachable + 1
            time.sleep(1.0)
        except Exception as e:  # keep attacking: one broken identity must not end the run
            log.exception("identity %d crashed", k)
            outcome = f"crashed: {e!r}"
            time.sleep(1.0)
        finally:
            if node.engine is not None:
                node.engine.close()
        log.info("identity %d (%s) %s: %s", k, name, node.node_id[:10], outcome)
        k += 1


if __name__ == "__main__":
    main()
