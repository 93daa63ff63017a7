"""The simulator (`swarmrl simulate`, swarmrl/sim/): its validation against the runs measured on this machine, and
the scenario table of bench/RESULTS.md.

    python bench/simulate.py --validation                 # simulated vs measured: demo, broadcast N=8, coordinator
    python bench/simulate.py --table --nodes 10000 --hours 3 --out bench/simulate_table.json

The table crosses models of 0.5B, 7B and 32B, full checkpoints against deltas of 1/30, and home links (100 Mbit/s,
50 ms) against datacenter links (10 Gbit/s), with a third of the nodes attacking (strategy batch2) under the
default quarantine rule, nodes refused work asking again every 10 s (at the node's default 0.5 s, the idle
nodes' polls alone are several times what the coordinator carries). Speeds scale with the model from the 7B
figures of examples/simulate/home-7b.toml (generation, training and checking inversely with the parameters):
assumptions, not measurements. Last line of output: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from swarmrl.sim import validate
from swarmrl.sim.run import simulate
from swarmrl.sim.scenario import Scenario

MODELS = {"0.5B": 0.5e9, "7B": 7e9, "32B": 32e9}
LINKS = {"home": {"name": "home", "down_mbit": 100, "up_mbit": 100, "latency_ms": 50},
         "datacenter": {"name": "datacenter", "down_mbit": 10_000, "up_mbit": 10_000, "latency_ms": 5}}


def scenario(model: str, broadcast: str, link: str, nodes: int, hours: float, seed: int,
             poll_s: float = 10.0, delta_ratio: float = 1 / 30) -> Scenario:
    scale = 7e9 / MODELS[model]
    return Scenario.model_validate({
        "name": f"{model}, {broadcast}, {link}",
        "nodes": {"count": nodes, "session_hours": 6, "offline_hours": 6, "poll_interval_s": poll_s,
                  "speed_classes": [{"name": "rtx4090", "tokens_per_s": 1500 * scale, "share": 0.6},
                                    {"name": "a100", "tokens_per_s": 4000 * scale, "share": 0.3},
                                    {"name": "h100", "tokens_per_s": 8000 * scale, "share": 0.1}],
                  "regions": [LINKS[link]]},
        "model": {"params": MODELS[model], "broadcast": broadcast, "delta_ratio": delta_ratio},
        "trainer": {"batch_groups": 256, "tokens_per_s": 50_000 * scale},
        "verifiers": {"count": 8, "tokens_per_s": 20_000 * scale},
        "adversaries": {"share": 1 / 3, "strategy": "batch2"},
        "sim": {"hours": hours, "seed": seed, "broadcast_sample": 100},
    })


def table(nodes: int, hours: float, seed: int, models: list[str], broadcasts: list[str], delta_ratio: float
          ) -> list[dict]:
    rows = []
    for model in models:
        for broadcast in broadcasts:
            for link in LINKS:
                f = simulate(scenario(model, broadcast, link, nodes, hours, seed, delta_ratio=delta_ratio))
                row = {"model": model, "broadcast": broadcast, "link": link, "delta_ratio": delta_ratio,
                       "steps_per_hour": f["steps_per_hour"], "node_utilisation": f["node_utilisation"],
                       "waiting_for_weights": f["node_time_share"]["waiting for weights"],
                       "staleness_median": f["staleness_median"], "staleness_p99": f["staleness_p99"],
                       "verifier_utilisation": f["verifier"]["utilisation"],
                       "full_check_share": f["verifier"]["full_check_share"],
                       "poisoned_share": f["poisoned"]["share"], "poisoned_bound": f["poisoned"]["bound"],
                       "t90_median_s": f["broadcast"]["t90_median_s"],
                       "coordinator_utilisation": f["coordinator"]["utilisation_mean"],
                       "stale_dropped": f["stale_dropped_by_trainer"] + f["nodes"]["stale_submissions"],
                       "leases_expired_waiting_for_weights": f["nodes"]["expired_waiting_for_weights"],
                       "wall_s": f["wall_s"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--validation", action="store_true", help="simulated against measured (seconds)")
    ap.add_argument("--table", action="store_true", help="the scenario table (minutes)")
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--hours", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default=",".join(MODELS), help="which rows of the table: " + ", ".join(MODELS))
    ap.add_argument("--broadcasts", default="full,delta", help="full, delta or both")
    ap.add_argument("--delta-ratio", type=float, default=1 / 30, help="delta bytes over full bytes (1/30 until "
                    "measured; bench/RESULTS.md has 0.0107 for bf16 at lr 1e-6)")
    ap.add_argument("--out", type=Path, help="write the whole result here as JSON")
    args = ap.parse_args()
    out: dict = {}
    t0 = time.perf_counter()
    if args.validation or not args.table:
        out["validation"] = {"demo": validate.demo(), "broadcast_n8": validate.broadcast_n8(),
                             "coordinator_load": validate.coordinator_load()}
        print(json.dumps(out["validation"]), flush=True)
    if args.table:
        out["table"] = table(args.nodes, args.hours, args.seed, args.models.split(","), args.broadcasts.split(","),
                             args.delta_ratio)
    out["wall_s"] = time.perf_counter() - t0
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
