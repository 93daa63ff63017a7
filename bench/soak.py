"""The long soak: a pool from docker/setup_pool.py's configs (testing/soak.py) runs for --minutes while a fault hits
it every --fault-every-s, going round a coordinator SIGKILL, a verifier, a trainer and a node restart. It records
when each training step came, and counts a stall whenever no step came for --stall-s.

    python bench/soak.py --minutes 60 --fault-every-s 180

Writes <out>/soak.png (steps per minute over time, faults marked) and <out>/soak.json; the last line printed is
one JSON object: minutes, steps, faults, steps_per_min (median and the lowest of any 10-minute window), max_gap_s,
stalls, held_max. There is no baseline to run beside it: the buffer rule before docs/liveness.md stalled for good
minutes into such a pool (tests/test_soak.py shows it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from swarmrl.runtime.lifetime import interrupt_on_sigterm
from swarmrl.testing.soak import FAULTS, SoakPool, Timeline


def per_minute(steps: list[float], minutes: int) -> list[int]:
    counts = [0] * max(minutes, 1)
    for t in steps:
        counts[min(int(t // 60), len(counts) - 1)] += 1
    return counts


def figures(tl: Timeline, minutes: int, stall_s: float, end: float) -> dict[str, object]:
    counts = per_minute(tl.steps, minutes)
    windows = [sum(counts[i:i + 10]) / 10 for i in range(0, max(len(counts) - 9, 1))]
    gaps = tl.gaps() + ([end - tl.steps[-1]] if tl.steps else [end])
    return {"minutes": minutes, "steps": len(tl.steps), "faults": len(tl.faults),
            "faults_by_role": {r: sum(1 for _, f in tl.faults if f == r) for r in FAULTS},
            "steps_per_min_median": statistics.median(counts), "steps_per_min_lowest_10min": min(windows),
            "max_gap_s": round(max(gaps), 1), "stalls": sum(1 for g in gaps if g > stall_s),
            "held_max": tl.held_seen, "steps_per_min": counts}


def plot(tl: Timeline, minutes: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = per_minute(tl.steps, minutes)
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.bar(range(len(counts)), counts, color="#1f77b4", width=0.9)
    colours = {"coordinator": "#d62728", "verifier": "#ff7f0e", "trainer": "#9467bd", "node0": "#2ca02c"}
    for t, role in tl.faults:
        ax.axvline(t / 60, color=colours.get(role, "#555"), lw=1, ls="--")
    for role, c in colours.items():
        ax.plot([], [], color=c, ls="--", label=f"{role} killed")
    ax.set_xlabel("minute")
    ax.set_ylabel("training steps")
    ax.set_title("soak: steps per minute, faults marked")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=int, default=60)
    ap.add_argument("--fault-every-s", type=float, default=180.0)
    ap.add_argument("--stall-s", type=float, default=300.0, help="no step for this long counts as a stall")
    ap.add_argument("--out", type=Path, default=None, help="where the pool and the figures go (default: a temp dir)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="swarmrl-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    interrupt_on_sigterm()  # stopped by SIGTERM (a timeout), it still stops every role it started
    pool = SoakPool(out / "pool").start()
    end_s, next_fault, k = args.minutes * 60.0, args.fault_every_s, 0
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn()) as bar:
            task = bar.add_task("soak", total=end_s)
            while pool.now() < end_s:
                pool.steps()
                pool.check_alive()
                pool.note_held()
                if pool.now() >= next_fault:
                    pool.fault(FAULTS[k % len(FAULTS)])
                    k, next_fault = k + 1, next_fault + args.fault_every_s
                bar.update(task, completed=pool.now(),
                           description=f"soak: {len(pool.timeline.steps)} steps, {len(pool.timeline.faults)} faults")
                time.sleep(1.0)  # the polling interval of the step log
    finally:
        pool.steps()
        now = pool.now()
        pool.stop()
    result = figures(pool.timeline, args.minutes, args.stall_s, now)
    plot(pool.timeline, args.minutes, out / "soak.png")
    (out / "soak.json").write_text(json.dumps({**result, "steps_at_s": pool.timeline.steps,
                                               "faults_at_s": pool.timeline.faults}, indent=1))
    print(f"plot: {out / 'soak.png'}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
