"""Prometheus text exposition (format 0.0.4) of the coordinator's counters, written by hand.

Names cannot collide: every family name here is fixed, and the trainer's metrics, whatever they are called, are
one family (`swarmrl_trainer_metric`) with the metric's own name as a label value (escaped, never rewritten), so
"eval/accuracy" and "eval_accuracy" stay two series and a trainer metric called "step" is not the step gauge."""

from __future__ import annotations

import math
from collections.abc import Iterable

from swarmrl.protocol.messages import NodeStatus, RunStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def render(status: RunStatus, nodes: Iterable[NodeStatus]) -> str:
    """The exposition text for one status snapshot (its counters and newest trainer report) and every node."""
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
    metric("swarmrl_nodes", "gauge", "Registered nodes by state: live, gone (missed their heartbeats), banned.",
           [(f'{base},state="{state}"', float(n)) for state, n in
            (("live", status.nodes_live), ("gone", status.nodes_gone), ("banned", status.nodes_banned))])
    metric("swarmrl_current_version", "gauge", "Newest published policy version (-1 before the first).",
           [(base, float(status.run.current_version))])
    per_node: dict[str, list[tuple[str, float]]] = {k: [] for k in ("accepted", "rejected", "idle", "busy")}
    for n in nodes:
        labels = f'{base},node="{n.node_id}",name="{_label(n.name)}"'
        per_node["accepted"].append((labels, float(n.groups_accepted)))
        per_node["rejected"].append((labels, float(n.groups_rejected)))
        per_node["idle"].append((labels, n.idle_s))
        per_node["busy"].append((labels, n.busy_s))
    metric("swarmrl_node_groups_accepted_total", "counter", "Groups of a node the verifier accepted.",
           per_node["accepted"])
    metric("swarmrl_node_groups_rejected_total", "counter", "Groups of a node the verifier rejected.",
           per_node["rejected"])
    metric("swarmrl_node_idle_seconds_total", "counter",
           "Seconds a node waited for work or weights since it started (its untrusted self-report).", per_node["idle"])
    metric("swarmrl_node_busy_seconds_total", "counter",
           "Seconds a node spent generating and submitting since it started (its untrusted self-report).",
           per_node["busy"])
    if status.metrics:
        last = status.metrics[-1]
        metric("swarmrl_trainer_step", "gauge", "Step of the last trainer metrics report.", [(base, float(last.step))])
        metric("swarmrl_trainer_metric", "gauge", "The last trainer metrics report, one series per metric name.",
               [(f'{base},name="{_label(key)}"', value) for key, value in sorted(last.metrics.items())])
    return "\n".join(lines) + "\n"
