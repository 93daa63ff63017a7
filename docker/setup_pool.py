"""Prepare a local pool's shared volume for docker/compose.yaml (its one-shot `setup` service), or any directory.

    python docker/setup_pool.py /pool            # in the compose file: POOL_DIR=/pool, the `pool` volume

Makes what the roles need and nothing they make themselves (the coordinator makes its own key in its data dir):
the trainer's and the verifier's keys (their public keys become the coordinator's operator keys), the initial
checkpoint (`swarmrl model`, warmed up to WARMUP_ACCURACY, default 0.25; 0 keeps it random), and one config file
per role under <dir>/config, each checked against the role's config model. Nodes share one config; each gets its
name, key and work dir with --set. Safe to run again: keys and the checkpoint are kept.

Environment: COORDINATOR_URL (default http://coordinator:8470, the compose service), METRICS_PORT (default 9100,
where the verifier, trainer and nodes serve Prometheus metrics inside their containers), RUN_ID, WARMUP_ACCURACY.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.node.config import NodeConfig
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.config import dump_toml
from swarmrl.trainer.config import TrainerConfig
from swarmrl.verifier.config import VerifierConfig


def setup(pool: Path) -> dict[str, Path]:
    """Write keys, checkpoint and configs under `pool`; the config files by role."""
    url = os.environ.get("COORDINATOR_URL", "http://coordinator:8470")
    metrics_port = int(os.environ.get("METRICS_PORT", "9100"))
    run_id = os.environ.get("RUN_ID", "compose-pool")
    warmup = os.environ.get("WARMUP_ACCURACY", "0.25")
    (pool / "config").mkdir(parents=True, exist_ok=True)
    keys = {name: Identity.load_or_create(pool / "keys" / f"{name}.key") for name in ("trainer", "verifier")}
    init = pool / "init"
    if not (init / "config.json").exists():
        # The same command a lab runs by hand; a fresh process, so its threads and memory go away with it.
        subprocess.run([sys.executable, "-m", "swarmrl.cli", "model", str(init), "--warmup-accuracy", warmup],
                       check=True)
    metrics = {"metrics_host": "0.0.0.0", "metrics_port": metrics_port}
    configs = {
        "coordinator": CoordinatorConfig(
            host="0.0.0.0", port=8470, data_dir=pool / "coordinator",
            run={"run_id": run_id, "model": "tiny Llama (0.86M), character tokenizer", "task": {"name": "addition"},
                 "sampling": {"temperature": 1.0, "max_tokens": 6, "group_size": 8}},
            operator_keys=[k.public_key_hex for k in keys.values()], max_buffered_groups=64),
        "verifier": VerifierConfig(coordinator_url=url, key_path=pool / "keys" / "verifier.key",
                                   work_dir=pool / "verifier", **metrics),
        "trainer": TrainerConfig(coordinator_url=url, key_path=str(pool / "keys" / "trainer.key"),
                                 state_dir=str(pool / "trainer"), init_checkpoint=str(init), batch_groups=32,
                                 progress=False, **metrics),
        # Nodes: --set name=..., key_path=..., work_dir=... per node (compose.yaml).
        "node": NodeConfig(coordinator_url=url, progress=False, max_prompts=8, engine={"kind": "auto"},
                           p2p={"enabled": False}, **metrics),
    }
    paths = {}
    for role, cfg in configs.items():
        paths[role] = pool / "config" / f"{role}.toml"
        paths[role].write_text(dump_toml(cfg))
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("POOL_DIR", "/pool"))
    for role, path in setup(target).items():
        print(f"{role:12s} {path}")
