"""`swarmrl simulate SCENARIO.toml`: run one scenario in virtual time, with progress, into one folder.

Imports what it runs only when it runs: the CLI registers the command on every start.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmrl.sim.scenario import Scenario


def simulate(sc: Scenario, progress: bool = False) -> dict:
    """Every figure of one run of `sc` (`sim.figures`), with the broadcast it drew the download rates from and
    the wall time it took."""
    from swarmrl.sim.figures import figures as figures_of
    from swarmrl.sim.world import World, region_rates

    t0 = time.perf_counter()
    if not progress:
        rates, info = region_rates(sc)
        world = World(sc, rates)
        world.run()
    else:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[what]}"),
                      TimeElapsedColumn()) as bar:
            task = bar.add_task("broadcast (real scheduler)", total=sc.sim.hours * 3600, what="")
            rates, info = region_rates(sc)
            world = World(sc, rates)
            bar.update(task, description="simulating")

            def on_progress(now: float) -> None:
                bar.update(task, completed=now, what=f"{now / 3600:.1f} h, {world.trainer.steps:,} steps, "
                           f"{world.clock.events:,} events")

            world.run(on_progress)
    figures = figures_of(world)
    figures["broadcast"]["sample"] = info
    figures["wall_s"] = time.perf_counter() - t0
    return figures


def cmd_simulate(args: argparse.Namespace) -> None:
    """The `simulate` subcommand."""
    from swarmrl.sim import report
    from swarmrl.sim.scenario import ScenarioError, load

    if args.hours is not None and args.hours <= 0:
        raise SystemExit(f"--hours must be positive, got {args.hours}")
    try:
        sc = load(args.scenario)
    except ScenarioError as e:
        raise SystemExit(str(e)) from None
    if args.hours is not None:
        sc.sim.hours = args.hours
    out = args.out or Path("runs") / f"sim-{Path(args.scenario).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    figures = simulate(sc, progress=True)
    report.write(figures, out)
    print(f"{out}/report.md: {figures['steps_per_hour']:.1f} steps/h, utilisation "
          f"{figures['node_utilisation']:.1%}, staleness median {figures['staleness_median']}, poisoned share "
          f"{figures['poisoned']['share']:.4f} (bound {figures['poisoned']['bound']:.4f}); "
          f"{figures['wall_s']:.0f} s of wall time")


def add_parser(sub) -> None:
    """Register `simulate` on the CLI's subparsers."""
    p = sub.add_parser("simulate", help="run a pool of up to 10,000s of nodes in virtual time from a scenario "
                                        "file (the real lease, check, staleness and transfer policies)")
    p.add_argument("scenario", type=Path, help="the scenario (TOML; see examples/simulate/)")
    p.add_argument("--out", type=Path, help="the run's folder (default runs/sim-<scenario>-<time>)")
    p.add_argument("--hours", type=float, help="override sim.hours")
    p.set_defaults(fn=cmd_simulate)
