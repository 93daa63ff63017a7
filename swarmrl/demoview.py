"""What `swarmrl demo` shows: the live panel while the swarm runs, and the progress plot at the end."""

from __future__ import annotations

from pathlib import Path

from rich.console import Group
from rich.table import Table

from swarmrl.protocol.messages import RunStatus


def metric_series(status: RunStatus, key: str) -> list[tuple[int, float]]:
    """(step, value) of every trainer report that has `key`."""
    return [(m.step, m.metrics[key]) for m in status.metrics if key in m.metrics]


def render(status: RunStatus | None, elapsed: float, max_steps: int, phase: str) -> Group:
    """The live panel: step, held-out accuracy, rollout reward, groups, and one row per node."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row(phase, f"{elapsed:.0f} s")
    if status is None:
        return Group(head)
    acc = metric_series(status, "eval_accuracy")
    rew = metric_series(status, "reward_mean")
    step = status.metrics[-1].step if status.metrics else 0
    head.add_row("step", f"{step}/{max_steps}  (policy v{status.run.current_version})")
    head.add_row("held-out accuracy", " ".join(f"{a:.2f}" for _, a in acc[-8:]) or "-")
    head.add_row("rollout reward", f"{rew[-1][1]:.3f}" if rew else "-")
    head.add_row("groups", f"accepted [green]{status.groups_accepted}[/]  rejected [red]{status.groups_rejected}[/]  "
                           f"pending {status.groups_pending}")
    nodes = Table("node", "engine", "version", "accepted", "rejected", "banned", box=None)
    for n in status.nodes:
        nodes.add_row(n.name, n.engine, str(n.held_version), str(n.groups_accepted), str(n.groups_rejected),
                      "yes" if n.banned else "")
    return Group(head, nodes)


def plot(status: RunStatus, path: Path, title: str) -> None:
    """Held-out accuracy and rollout exact-match rate (left), mean rollout reward (right), per trainer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    acc = metric_series(status, "eval_accuracy")
    rew = metric_series(status, "reward_mean")
    train_acc = metric_series(status, "accuracy")
    if acc:
        ax1.plot(*zip(*acc, strict=True), marker="o", label="held-out greedy accuracy")
    if train_acc:
        ax1.plot(*zip(*train_acc, strict=True), alpha=0.5, label="rollout exact-match rate")
    ax1.set_xlabel("trainer step")
    ax1.set_ylabel("accuracy")
    ax1.set_ylim(0, 1)
    ax1.grid(alpha=0.3)
    ax1.legend()
    if rew:
        ax2.plot(*zip(*rew, strict=True), color="tab:orange")
    ax2.set_xlabel("trainer step")
    ax2.set_ylabel("mean reward of rollouts")
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
