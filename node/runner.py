"""`swarmrl node`: run a Node with a live status line, and stop cleanly on Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import threading

from rich.console import Console
from rich.live import Live
from rich.table import Table

from swarmrl.node.agent import Node, NodeStats
from swarmrl.node.config import NodeConfig


def render(node: Node) -> Table:
    s: NodeStats = node.stats
    t = Table.grid(padding=(0, 2))
    t.add_row(
        f"[bold]node[/] {node.identity.node_id[:10]}",
        f"engine [cyan]{node.engine.name if node.engine else '-'}[/]",
        f"policy v[bold]{s.held_version}[/]",
        f"leases {s.leases}",
        f"groups submitted [green]{s.groups_submitted}[/] refused [red]{s.groups_refused}[/]",
        f"{s.tokens_per_s:,.0f} tok/s",
        f"idle {s.idle_seconds:.0f} s busy {s.busy_seconds:.0f} s",
        f"[dim]{s.last_error[:60]}[/]",
    )
    return t


def run_node(cfg: NodeConfig) -> NodeStats:
    node = Node(cfg)
    signal.signal(signal.SIGTERM, lambda *_: node.stop())
    if not cfg.progress:
        try:
            return node.run()
        except KeyboardInterrupt:
            node.stop()
            return node.stats
    done = threading.Event()
    console = Console()
    with Live(render(node), console=console, refresh_per_second=2) as live:
        def refresh() -> None:
            while not done.wait(0.5):
                live.update(render(node))

        th = threading.Thread(target=refresh, daemon=True)
        th.start()
        try:
            stats = node.run()
        except KeyboardInterrupt:
            node.stop()
            stats = node.stats
        finally:
            done.set()
            live.update(render(node))
    return stats
