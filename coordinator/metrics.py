"""Prometheus text exposition (format 0.0.4) of the coordinator's counters, written by hand."""

from __future__ import annotations

import math
import re

from swarmrl.protocol.messages import RunStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def render(status: RunStatus) -> str:
    """The exposition text for one status snapshot."""
    run = _label(status.run.run_id)
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {_num(v)}" for labels, v in samples)

    base = f'run="{run}"'
    metric("swarmrl_groups", "gauge", "Submitted rollout groups by verification status.",
           [(f'{base},status="{s}"', float(n)) for s, n in
            (("pending", status.groups_pending), ("accepted", status.groups_accepted),
             ("rejected", status.groups_rejected))])
    banned = sum(1 for n in status.nodes if n.banned)
    metric("swarmrl_nodes", "gauge", "Registered nodes, banned or not.",
           [(f'{base},banned="false"', float(len(status.nodes) - banned)), (f'{base},banned="true"', float(banned))])
    metric("swarmrl_current_version", "gauge", "Newest published policy version (-1 before the first).",
           [(base, float(status.run.current_version))])
    metric("swarmrl_node_groups_accepted_total", "counter", "Groups of a node the verifier accepted.",
           [(f'{base},node="{n.node_id}",name="{_label(n.name)}"', float(n.groups_accepted)) for n in status.nodes])
    metric("swarmrl_node_groups_rejected_total", "counter", "Groups of a node the verifier rejected.",
           [(f'{base},node="{n.node_id}",name="{_label(n.name)}"', float(n.groups_rejected)) for n in status.nodes])
    metric("swarmrl_node_idle_seconds_total", "counter",
           "Seconds a node waited for work or weights since it started (its untrusted self-report).",
           [(f'{base},node="{n.node_id}",name="{_label(n.name)}"', n.idle_s) for n in status.nodes])
    metric("swarmrl_node_busy_seconds_total", "counter",
           "Seconds a node spent generating and submitting since it started (its untrusted self-report).",
           [(f'{base},node="{n.node_id}",name="{_label(n.name)}"', n.busy_s) for n in status.nodes])
    if status.metrics:
        last = status.metrics[-1]
        metric("swarmrl_trainer_step", "gauge", "Step of the last trainer metrics report.", [(base, float(last.step))])
        for key, value in sorted(last.metrics.items()):
            name = "swarmrl_trainer_" + _UNSAFE.sub("_", key)
            metric(name, "gauge", f"Last reported trainer metric {_label(key)}.", [(base, value)])
    return "\n".join(lines) + "\n"
