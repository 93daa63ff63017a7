"""Benchmark: synchronous (k = 0) vs asynchronous (k = 2) swarm, and TRL's GRPOTrainer at equal wall time.

One warm-started checkpoint (fixed seed) is built once and copied into every run, so that all runs start
from the same weights:

1. the local swarm (`swarmrl.demo.run_demo`) with max_staleness = 0, then with max_staleness = 2, same
   nodes, batch, seed and machine, each until the trainer's held-out greedy accuracy reaches the target
   (or a time limit); the wall time to the target is read off the trainer's evaluations;
2. TRL's GRPOTrainer (bench/trl_baseline.py) on the same checkpoint, task, reward and batch shape, for as
   long as the asynchronous run took (once per `--trl-threads` setting; its best is compared), and its
   held-out accuracy at that time.

Clocks. Launch clock (swarm): seconds since the trainer process was launched (imports, model load and
evaluations included; the trainer's `elapsed_s`). Training clock: seconds since setup ended, evaluations
excluded: how bench/trl_baseline.py times TRL; for the swarm, the trainer's `train_clock_s` less the
nodes' setup (the part of it before the coordinator granted the first lease, `nodes_setup_s`), so the
pipeline fill (first rollouts, first verification) still counts. sync_s/async_s use the launch
clock; the comparison with TRL (equal_wall_s, trl_accuracy, swarmrl_accuracy) uses the training clock for
both, and the JSON also gives TRL's accuracy at the swarm's launch-clock time (trl_accuracy_at_launch_s).

With `--in-flight`, a third swarm run: k = 2 with in-flight updates (`sampling.in_flight_updates`: nodes load a new
version between decode chunks instead of between leases), timed the same way: async_inflight_s, and
speedup_inflight = sync_s / async_inflight_s.

    python bench/async_vs_sync.py                 # full run: 15-25 min on 2 CPU cores, k=0 the longest
    python bench/async_vs_sync.py --in-flight --skip-trl   # the three swarm runs only
    python bench/async_vs_sync.py --quick         # smoke run: low target, short limits

Writes `<out>/async_vs_sync.json` and `<out>/async_vs_sync.png`; the last line printed is one JSON
object with sync_s, async_s, speedup, trl_accuracy, swarmrl_accuracy, equal_wall_s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
import tomllib
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package: find trl_baseline

Point = dict[str, float]


class EvalWatcher(threading.Thread):
    """Follows one demo run from outside: finds its coordinator in `<run_dir>/config`, polls /v1/status
    and timestamps every held-out evaluation the trainer reports."""

    def __init__(self, run_dir: Path, poll_s: float = 0.5):
        super().__init__(daemon=True)
        self.run_dir, self.poll_s = run_dir, poll_s
        self.points: list[Point] = []
        self.t_trainer: float | None = None
        self.done = threading.Event()

    def _wait_for(self, path: Path) -> bool:
        while not path.exists():
            if self.done.wait(0.1):
                return False
        return True

    def run(self) -> None:
        from swarmrl.runtime.client import CoordinatorClient

        coord_cfg = self.run_dir / "config" / "coordinator.toml"
        if not self._wait_for(coord_cfg):
            return
        time.sleep(0.2)  # let the writer finish
        port = tomllib.loads(coord_cfg.read_text())["port"]
        # The demo writes the trainer's config just before launching it: the swarm's clock starts there.
        if not self._wait_for(self.run_dir / "config" / "trainer.toml"):
            return
        self.t_trainer = (self.run_dir / "config" / "trainer.toml").stat().st_mtime
        seen: set[int] = set()
        with CoordinatorClient(f"http://127.0.0.1:{port}", timeout=5.0) as client:
            while not self.done.is_set():
                try:
                    metrics = client.status().metrics
                except Exception:  # not up yet, or already gone
                    metrics = []
                now = time.time()
                for m in metrics:
                    if "eval_accuracy" in m.metrics and m.step not in seen:
                        seen.add(m.step)
                        wall = m.metrics.get("elapsed_s", now - self.t_trainer)
                        point = {"wall_s": round(wall, 2), "step": m.step, "accuracy": m.metrics["eval_accuracy"]}
                        if "train_clock_s" in m.metrics:  # TRL's clock: setup and evaluations excluded
                            point["train_s"] = round(m.metrics["train_clock_s"], 2)
                        self.points.append(point)
                self.done.wait(self.poll_s)


def run_swarm(init: Path, run_dir: Path, max_staleness: int, args: argparse.Namespace,
              in_flight: bool = False) -> dict[str, Any]:
    """One demo run from the shared checkpoint (with `in_flight`, in-flight updates on); returns its report and
    timestamped evaluation points."""
    from swarmrl.demo import DemoConfig, addition_run, run_demo
    from swarmrl.runtime.config import load_config

    run = addition_run().model_dump(mode="json", exclude={"run_id"})  # each run gets its own demo-<time> id
    run["max_staleness"] = max_staleness
    run["sampling"]["group_size"] = args.group_size
    if in_flight:
        run["sampling"].update(in_flight_updates=True, update_chunk_tokens=args.chunk_tokens)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    shutil.copytree(init, run_dir / "init")  # run_demo skips its warm start when init/config.json exists
    cfg = load_config(
        DemoConfig, None, args.demo_set,
        run_dir=run_dir, nodes=args.nodes, engine=args.engine, run=run,
        target_accuracy=args.target, time_limit_s=args.time_limit, max_steps=args.max_steps,
        batch_groups=args.batch_prompts, lr=args.lr, eval_every=args.eval_every,
        seed=args.seed,
    )
    watcher = EvalWatcher(run_dir)
    watcher.start()
    result: dict[str, Any] = {"max_staleness": max_staleness, "in_flight": in_flight, "run_dir": str(run_dir)}
    try:
        result["report"] = run_demo(cfg)
    except Exception as e:  # the demo may not run end to end yet: record why, go on with the others
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        time.sleep(2 * watcher.poll_s)
        watcher.done.set()
        watcher.join(timeout=10)
    result["points"] = sorted(watcher.points, key=lambda p: p["step"])
    setup_s = nodes_setup_s(run_dir)
    if setup_s is not None:
        # The swarm's training clock, like TRL's, starts once the setup is done: here once a node has its
        # engine up and the coordinator grants the first lease (before that no rollout can be generated).
        result["nodes_setup_s"] = round(setup_s, 2)
        for p in result["points"]:
            if "train_s" in p:
                p["train_s_from_launch"] = p["train_s"]
                p["train_s"] = round(max(0.0, p["train_s"] - setup_s), 2)
    if "report" in result:  # the demo's own check of the newest published checkpoint, when the run stopped
        r = result["report"]
        result["end_point"] = {"wall_s": r["rl_seconds"], "step": r["steps"], "accuracy": r["final_accuracy"]}
    return result


def nodes_setup_s(run_dir: Path) -> float | None:
    """Seconds of the trainer's training clock that passed before the coordinator granted its first lease (the
    nodes' setup: engine start, first weights), read from the run's coordinator database; None if unknown."""
    import sqlite3

    db_path = run_dir / "coordinator" / "coordinator.sqlite"
    if not db_path.exists():
        return None
    with sqlite3.connect(db_path) as db:
        (first_lease,) = db.execute("SELECT MIN(issued_at) FROM leases").fetchone()
        first_metric = db.execute("SELECT ts, data FROM metrics ORDER BY id LIMIT 1").fetchone()
    if first_lease is None or first_metric is None or "train_clock_s" not in json.loads(first_metric[1]):
        return None
    clock_zero = first_metric[0] - json.loads(first_metric[1])["train_clock_s"]  # coordinator's wall clock
    return max(0.0, first_lease - clock_zero)


def time_to_target(points: list[Point], target: float) -> tuple[float | None, float | None]:
    """(interpolated, observed) wall seconds at which accuracy first reaches `target`; None if never.

    Interpolated: linear between the last evaluation below the target and the first at or above it.
    """
    for prev, p in zip([None, *points], points, strict=False):
        if p["accuracy"] >= target:
            if prev is None or p["accuracy"] == prev["accuracy"]:
                return p["wall_s"], p["wall_s"]
            frac = (target - prev["accuracy"]) / (p["accuracy"] - prev["accuracy"])
            return round(prev["wall_s"] + frac * (p["wall_s"] - prev["wall_s"]), 2), p["wall_s"]
    return None, None


def accuracy_at(points: list[Point], t: float) -> float | None:
    """The accuracy of the last evaluation at or before `t` seconds (TRL's clock)."""
    seen = [p["accuracy"] for p in points if p["wall_s"] <= t + 1e-6]
    return seen[-1] if seen else None


def plot(runs: dict[str, list[Point]], ends: dict[str, Point | None], target: float, equal_wall_s: float,
         path: Path) -> None:
    """Held-out accuracy against wall seconds for every run, the target and the equal-time line.

    `ends`: a swarm run's final checkpoint as the demo measured it when the run stopped (drawn as an x).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, pts in runs.items():
        line = None
        if pts:
            (line,) = ax.plot([p["wall_s"] for p in pts], [p["accuracy"] for p in pts], marker="o", ms=3, label=label)
        end = ends.get(label)
        if end is not None:
            ax.plot([end["wall_s"]], [end["accuracy"]], marker="x", ms=8, ls="",
                    color=line.get_color() if line else None, label=None if line else label)
    ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.2f}")
    ax.axvline(equal_wall_s, color="grey", ls=":", lw=1, label=f"equal wall time {equal_wall_s:.0f} s")
    ax.set_xlabel("wall seconds")
    ax.set_ylabel("held-out greedy accuracy (500 problems)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("3-digit addition, 0.86M Llama: swarm k=0 vs k=2 vs TRL GRPOTrainer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="output folder (default runs/bench/async_vs_sync-<time>)")
    ap.add_argument("--init", type=Path, default=None, help="reuse this warm-started checkpoint")
    ap.add_argument("--quick", action="store_true", help="smoke run: target 0.35, 150 s limit, eval every 5")
    ap.add_argument("--target", type=float, default=0.55, help="held-out accuracy to reach")
    ap.add_argument("--time-limit", type=float, default=900, help="seconds per swarm run at most")
    ap.add_argument("--max-steps", type=int, default=2000, help="trainer steps per swarm run at most")
    ap.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations (all runs)")
    ap.add_argument("--warmup-accuracy", type=float, default=0.25)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--batch-prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--demo-set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra DemoConfig setting for both swarm runs, e.g. roles.trainer.threads=4 (repeatable)")
    ap.add_argument("--skip-sync", action="store_true", help="only the asynchronous swarm run (and TRL)")
    ap.add_argument("--in-flight", action="store_true", help="a third swarm run: k = 2 with in-flight updates")
    ap.add_argument("--chunk-tokens", type=int, default=1, help="with --in-flight: decode steps between looks")
    ap.add_argument("--skip-trl", action="store_true", help="only the two swarm runs")
    ap.add_argument("--trl-threads", default="1", help="comma-separated torch thread counts to run TRL with; "
                    "on a machine with more cores than the swarm's processes, give TRL its best setting: the "
                    "run with the highest accuracy at equal wall time is the one compared")
    a = ap.parse_args()
    if a.quick:
        a.target, a.time_limit, a.eval_every = 0.35, 150.0, 5
    return a


def main() -> None:
    from swarmrl.runtime.lifetime import interrupt_on_sigterm

    interrupt_on_sigterm()  # SIGTERM runs the demos' cleanup: their swarms stop with this process
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = (args.out or Path("runs/bench") / f"async_vs_sync-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)

    init = args.init or out / "init"
    if not (init / "config.json").exists():
        from swarmrl.modelcmd import build_and_warm

        build_and_warm(init, target_accuracy=args.warmup_accuracy, seed=args.seed)
    initial = json.loads((init / "swarmrl.json").read_text()).get("warmup_accuracy")

    swarm = {k: run_swarm(init, out / f"k{k}", k, args) for k in ((2,) if args.skip_sync else (0, 2))}
    sync_s, sync_seen = time_to_target(swarm[0]["points"], args.target) if 0 in swarm else (None, None)
    async_s, async_seen = time_to_target(swarm[2]["points"], args.target)
    in_flight = run_swarm(init, out / "k2-inflight", 2, args, in_flight=True) if args.in_flight else None
    async_if_s = time_to_target(in_flight["points"], args.target)[0] if in_flight else None
    speedup, lower_bound = None, False
    if sync_s and async_s:
        speedup = round(sync_s / async_s, 2)
    elif async_s and 0 in swarm and swarm[0].get("report", {}).get("stop_reason") == "time limit":
        # k = 0 ran its whole time limit without reaching the target: it would have taken longer than that.
        speedup, lower_bound = round(swarm[0]["report"]["rl_seconds"] / async_s, 2), True

    # Equal time: where the asynchronous run's last evaluation stood (the one that reached the target), on two
    # clocks. The training clock is TRL's own (setup and evaluations excluded) and so the like-for-like one;
    # the launch clock (everything from the trainer's launch on) is the swarm's whole cost, reported beside it.
    async_pts = swarm[2]["points"]
    equal_launch_s = async_pts[-1]["wall_s"] if async_pts else args.time_limit
    equal_train_s = async_pts[-1].get("train_s", equal_launch_s) if async_pts else args.time_limit
    swarmrl_accuracy = async_pts[-1]["accuracy"] if async_pts else None

    trl: dict[str, Any] = {}
    trl_runs: list[dict[str, Any]] = []
    if not args.skip_trl:
        from trl_baseline import run_trl

        for threads in (int(t) for t in str(args.trl_threads).split(",")):
            run = run_trl(init, equal_launch_s, batch_prompts=args.batch_prompts, group_size=args.group_size,
                          lr=args.lr, eval_every_steps=args.eval_every, seed=args.seed,
                          output_dir=out / f"trl-{threads}t", threads=threads)
            run["accuracy_at_train_s"] = accuracy_at(run["points"], equal_train_s)
            trl_runs.append(run)
        trl = max(trl_runs, key=lambda r: r["accuracy_at_train_s"])
    trl_accuracy = trl["accuracy_at_train_s"] if trl else None
    equal_wall_s = equal_train_s

    labels = {"swarm k=0 (sync)": swarm.get(0), "swarm k=2 (async)": swarm[2],
              "swarm k=2 (async, in-flight updates)": in_flight}
    labels = {lb: r for lb, r in labels.items() if r is not None}
    curves = {f"{lb}, launch clock": r["points"] for lb, r in labels.items()}
    curves["swarm k=2 (async), training clock"] = [{**p, "wall_s": p["train_s"]} for p in async_pts if "train_s" in p]
    curves["TRL GRPOTrainer (training clock)"] = trl.get("points", [])
    plot(curves, {f"{lb}, launch clock": r.get("end_point") for lb, r in labels.items()}, args.target, equal_wall_s,
         out / "async_vs_sync.png")
    summary = {
        "sync_s": sync_s, "async_s": async_s, "speedup": speedup, "trl_accuracy": trl_accuracy,
        "swarmrl_accuracy": swarmrl_accuracy, "equal_wall_s": equal_wall_s,
    }
    if args.in_flight:
        summary.update(async_inflight_s=async_if_s,
                       speedup_inflight=round(sync_s / async_if_s, 2) if sync_s and async_if_s else None)
    details = {
        **summary, "clock": "equal_wall_s and trl_accuracy: training clock (setup and evaluations excluded, as "
        "TRL's); sync_s/async_s: launch clock", "equal_launch_s": equal_launch_s,
        "trl_accuracy_at_launch_s": accuracy_at(trl.get("points", []), equal_launch_s) if trl else None,
        "trl_s": time_to_target(trl.get("points", []), args.target)[0] if trl else None,
        "swarm_train_s_to_target": time_to_target([{**p, "wall_s": p["train_s"]} for p in async_pts
                                                   if "train_s" in p], args.target)[0],
        "speedup_is_lower_bound": lower_bound, "sync_first_eval_at_target_s": sync_seen,
        "async_first_eval_at_target_s": async_seen, "target": args.target, "initial_accuracy": initial,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "swarm": {f"k{k}": v for k, v in swarm.items()} | ({"k2_inflight": in_flight} if in_flight else {}),
        "trl": trl, "trl_runs": trl_runs,
        "plot": str(out / "async_vs_sync.png"),
    }
    (out / "async_vs_sync.json").write_text(json.dumps(details, indent=1))
    print(f"details: {out / 'async_vs_sync.json'}  plot: {out / 'async_vs_sync.png'}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
