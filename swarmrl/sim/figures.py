"""Every figure of one simulated run, as plain JSON data (`figures`), from the parts of a `World` after its run."""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from typing import TYPE_CHECKING

from swarmrl.sim.nodes import GEN, IDLE, WAIT
from swarmrl.sim.world import REACH_NODES

if TYPE_CHECKING:
    from swarmrl.sim.world import World

REACH_VERSIONS = 60  # versions (spread over the run) whose reach is measured


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _hist_quantile(hist: dict[int, int], q: float) -> float:
    total = sum(hist.values())
    if not total:
        return math.nan
    seen = 0
    for k in sorted(hist):
        seen += hist[k]
        if seen >= q * total:
            return float(k)
    return float(max(hist))


REACH_WINDOW_S = 3600.0


def reach(w: World) -> list[dict]:
    """For versions spread over the run: seconds from publication until 50, 90 and 99% of the tracked nodes
    that were online throughout the hour after it (or to the end of the run) held it or a newer one (None: not
    within that window)."""
    times = w.versions.times
    if len(times) < 2:
        return []
    tracked = [n.fetch for n in w.all_nodes[:REACH_NODES]]
    stride = max(1, (len(times) - 1) // REACH_VERSIONS)
    out = []
    end = w.clock.now
    for v in range(1, len(times), stride):
        t_v = times[v]
        until = min(end, t_v + REACH_WINDOW_S)
        got: list[float] = []
        for f in tracked:
            if not any(a <= t_v and until <= b for a, b in f.sessions):
                continue
            # A fetch's target was published when it started, so the first fetch ending at a version >= v ended
            # after v was published; targets never go down.
            i = bisect_left(f.reach, v, key=lambda r: r[1])
            first = f.reach[i][2] if i < len(f.reach) else None
            got.append(math.inf if first is None or first > until else first - t_v)
        if not got:
            continue
        row: dict = {"version": v, "published_h": t_v / 3600, "nodes": len(got)}
        for q in (0.5, 0.9, 0.99):
            x = percentile(got, q)
            row[f"t{round(q * 100)}_s"] = None if math.isinf(x) else x
        out.append(row)
    return out


def figures(w: World) -> dict:
    sc, tr, ver, nodes = w.sc, w.trainer, w.verifiers, w.nodes
    hours = sc.sim.hours
    per_hour = [0] * math.ceil(hours)
    for t in tr.step_times:
        per_hour[min(len(per_hour) - 1, int(t // 3600))] += 1
    total = sum(nodes.time.values()) or 1.0
    hist = dict(sorted(tr.staleness.items()))
    checks = dict(ver.checks)
    full = sum(n for c, n in checks.items() if c != "hold")
    decided = sum(checks.values()) or 1
    vt = sc.run.group_size * w.tokens_per_rollout
    reach_rows = reach(w)

    def med(key: str) -> float | None:
        xs = [r[key] for r in reach_rows if r[key] is not None]
        return statistics.median(xs) if xs else None

    series = w.series
    return {
        "scenario": sc.model_dump(mode="json"),
        "events": w.clock.events,
        "steps": tr.steps,
        "steps_per_hour": tr.steps / hours,
        "steps_each_hour": per_hour,
        "groups_trained": tr.trained,
        "groups_trained_per_hour": tr.trained / hours,
        "stale_dropped_by_trainer": tr.stale_dropped,
        "trainer_busy_share": tr.busy_s / (hours * 3600),
        "node_time_s": {GEN: nodes.time[GEN], WAIT: nodes.time[WAIT], IDLE: nodes.time[IDLE]},
        "node_time_share": {k: v / total for k, v in nodes.time.items()},
        "node_utilisation": nodes.time[GEN] / total,
        "nodes": nodes.stats,
        "staleness_histogram": {str(k): v for k, v in hist.items()},
        "staleness_median": _hist_quantile(hist, 0.5),
        "staleness_p99": _hist_quantile(hist, 0.99),
        "staleness_max": max(hist) if hist else None,
        "max_staleness": sc.run.max_staleness,
        "verifier": {
            "checks": checks,
            "full_check_share": full / decided,
            "utilisation": ver.busy_s / (sc.verifiers.count * hours * 3600),
            "full_checks_per_hour": full / hours,
            "verifier_s_per_trained_group": ver.busy_s / max(1, tr.trained),
            "full_check_s": vt / sc.verifiers.tokens_per_s,
            "backlog_max": max(series["backlog"], default=0),
            "backlog_end": ver.alive,
            **ver.stats,
        },
        "poisoned": {
            "trained": tr.trained,
            "poisoned": tr.poisoned,
            "share": tr.poisoned / tr.trained if tr.trained else 0.0,
            "bound": w.share_bound,
            "attacker_share": sc.adversaries.share,
            "strategy": sc.adversaries.strategy,
            "identities_made": nodes.stats["identities"],
        },
        "broadcast": {
            "full_bytes": w.model_bytes,
            "fetches": w.weights.fetches,
            "bytes_fetched": w.weights.bytes,
            "reach": reach_rows,
            "t50_median_s": med("t50_s"),
            "t90_median_s": med("t90_s"),
            "t99_median_s": med("t99_s"),
        },
        "coordinator": {
            "requests_simulated": w.coordinator.requests,
            "requests_counted": w.coordinator.requests + w.coordinator.background,
            "requests_per_s": (w.coordinator.requests + w.coordinator.background) / (hours * 3600),
            "utilisation_mean": statistics.fmean(series["coordinator_util"]) if series["coordinator_util"] else 0,
            "utilisation_max": max(series["coordinator_util"], default=0),
        },
        "desk_refusals": dict(w.desk.refusals),
        "series": series,
    }
