"""One run's folder: figures.json (every figure), the plots, and report.md that puts them together."""

from __future__ import annotations

import json
import math
from pathlib import Path

PLOTS = {
    "steps_per_hour.png": "Trainer steps in each simulated hour",
    "node_time.png": "Node time: generating, waiting for weights, idle (nodes online at each moment)",
    "staleness.png": "Staleness of the groups trained on (trainer version minus the group's policy version)",
    "verifier_backlog.png": "Groups waiting for a verdict, and held groups, over time",
    "poisoned_share.png": "Poisoned share of the groups trained on so far, against the bound of docs/quarantine.md",
    "version_reach.png": "Time for a version to reach 50%, 90% and 99% of the nodes online",
}


def _plots(f: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = f["series"]
    t = s["t_h"]

    def save(fig, name: str) -> None:
        fig.suptitle(PLOTS[name], fontsize=9)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(range(len(f["steps_each_hour"])), f["steps_each_hour"], color="tab:blue")
    ax.set_xlabel("hour")
    ax.set_ylabel("steps")
    save(fig, "steps_per_hour.png")

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.stackplot(t, s["generating"], s["waiting_for_weights"], s["idle"],
                 labels=["generating", "waiting for weights", "idle"], colors=["tab:green", "tab:orange", "0.8"])
    ax.set_xlabel("hours")
    ax.set_ylabel("nodes")
    ax.legend(loc="upper right", fontsize=7)
    save(fig, "node_time.png")

    fig, ax = plt.subplots(figsize=(7, 3.2))
    hist = {int(k): v for k, v in f["staleness_histogram"].items()}
    ax.bar(list(hist), list(hist.values()), color="tab:purple")
    ax.axvline(f["max_staleness"] + 0.5, color="red", ls="--", label=f"bound k = {f['max_staleness']}")
    ax.set_xlabel("versions behind")
    ax.set_ylabel("groups trained on")
    ax.legend(fontsize=7)
    save(fig, "staleness.png")

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(t, s["backlog"], label="waiting for a verdict")
    ax.plot(t, s["held"], label="held (quarantine)")
    ax.set_xlabel("hours")
    ax.set_ylabel("groups")
    ax.legend(fontsize=7)
    save(fig, "verifier_backlog.png")

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(t, s["poisoned_share"], label="poisoned share (cumulative)")
    if f["poisoned"]["bound"]:
        ax.axhline(f["poisoned"]["bound"], color="red", ls="--", label="bound")
    ax.set_xlabel("hours")
    ax.legend(fontsize=7)
    save(fig, "poisoned_share.png")

    fig, ax = plt.subplots(figsize=(7, 3.2))
    rows = f["broadcast"]["reach"]
    for key, label in (("t50_s", "50%"), ("t90_s", "90%"), ("t99_s", "99%")):
        pts = [(r["published_h"], r[key]) for r in rows if r[key] is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=label)
    ax.set_xlabel("published at (hours)")
    ax.set_ylabel("seconds to reach")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no version reached the nodes within the run", ha="center", transform=ax.transAxes)
    save(fig, "version_reach.png")


def _fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def markdown(f: dict) -> str:
    sc = f["scenario"]
    p, v, b, c = f["poisoned"], f["verifier"], f["broadcast"], f["coordinator"]
    share = f["node_time_share"]
    lines = [
        f"# Simulated pool: {sc['name']}",
        "",
        f"{sc['nodes']['count']:,} nodes, a {sc['model']['params']:.3g}-parameter model ({sc['model']['broadcast']} "
        f"broadcasts), {sc['sim']['hours']:g} simulated hours, seed {sc['sim']['seed']}; {f['events']:,} events "
        f"in {_fmt(f.get('wall_s'))} s of wall time. Every figure is in `figures.json`.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| trainer steps per hour | {_fmt(f['steps_per_hour'])} ({f['steps']:,} in all) |",
        f"| groups trained on per hour | {_fmt(f['groups_trained_per_hour'])} |",
        f"| node time generating / waiting for weights / idle | {share['generating']:.1%} / "
        f"{share['waiting for weights']:.1%} / {share['idle']:.1%} |",
        f"| staleness median / p99 / max (bound k) | {_fmt(f['staleness_median'])} / {_fmt(f['staleness_p99'])} / "
        f"{_fmt(f['staleness_max'])} ({f['max_staleness']}) |",
        f"| groups dropped stale by the trainer | {f['stale_dropped_by_trainer']:,} |",
        f"| verifier utilisation; share of groups fully checked | {v['utilisation']:.1%}; "
        f"{v['full_check_share']:.1%} |",
        f"| verifier backlog, largest | {v['backlog_max']:,} groups |",
        f"| poisoned share (bound) | {p['share']:.4f} ({_fmt(p['bound'], 4)}), attackers {p['attacker_share']:.0%} "
        f"with {p['strategy']}, {p['identities_made']:,} new identities |",
        f"| version reach, median over versions: 50% / 90% / 99% of nodes | {_fmt(b['t50_median_s'])} / "
        f"{_fmt(b['t90_median_s'])} / {_fmt(b['t99_median_s'])} s |",
        f"| coordinator requests per second; utilisation mean / max | {_fmt(c['requests_per_s'])}; "
        f"{c['utilisation_mean']:.1%} / {c['utilisation_max']:.1%} |",
        "",
        "What ties them together: steps per hour are set by whichever of the trainer, the verifiers and the nodes "
        "fresh enough to be used is slowest; nodes are idle while backpressure (max_buffered_groups) holds them "
        "back and wait for weights while a version travels; the groups that wait longest (held by the quarantine, "
        "or stuck behind a slow download) are the ones that go stale.",
        "",
    ]
    for name, title in PLOTS.items():
        lines += [f"## {title}", "", f"![{title}]({name})", ""]
    return "\n".join(lines)


def write(f: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.json").write_text(json.dumps(f, indent=1, default=str))
    _plots(f, out)
    (out / "report.md").write_text(markdown(f))
