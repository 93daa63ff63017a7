"""`swarmrl node`: join a pool (by name through the DHT, or by URL), run a Node under a live panel, and stop
cleanly on Ctrl-C or SIGTERM. With `progress = false` the node writes plain log lines instead.

The panel, refreshed twice a second: the pool and its coordinator, whether the coordinator is reachable (and for
how long it has not been), the policy version held and the pool's current one, the checkpoint download, tokens
per second, leases and groups (submitted, accepted, rejected, with the last rejection's reason), and the node's
contribution: completion tokens of accepted groups and the coordinator's receipts it holds.
"""

from __future__ import annotations

import threading

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from swarmrl.node.agent import Node
from swarmrl.node.config import NodeConfig
from swarmrl.node.stats import NodeStats
from swarmrl.runtime.lifetime import interrupt_on_sigterm

REFRESH_PER_S = 2


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def render(node: Node, pool: str = "") -> Panel:
    """The panel for `node` as it is now."""
    s: NodeStats = node.stats
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    key = node.coordinator_key[:16] + "…" if node.coordinator_key else "not known yet"
    t.add_row("pool", f"{pool or '(joined by URL)'}  [dim]{node.cfg.coordinator_url}  key {key}[/]")
    outage = node.client.outage
    down = outage.down_for_s
    if down is None:
        t.add_row("coordinator", "[green]reachable[/]" + (f"  [dim]({outage.outages} outages so far, longest "
                                                            f"{outage.longest_s:.0f} s)[/]" if outage.outages else ""))
    else:
        t.add_row("coordinator", f"[red]unreachable for {down:.0f} s[/] ({outage.last_error[:60]}; {outage.tries} "
                                 f"tries): waiting, weights and identity kept")
    current = f"v{s.current_version}" if s.current_version >= 0 else "none published yet"
    t.add_row("policy", f"v{s.held_version} held, {current} current" if s.held_version >= 0 else
              f"none held yet, {current} current")
    progress = node.weights.download_progress()
    if progress is None:
        t.add_row("download", "[dim]idle[/]")
    else:
        d, done = progress
        bar = ProgressBar(total=max(d.shards, 1), completed=done, width=30)
        t.add_row("download", Group(Text(f"v{d.version}: {done}/{d.shards} shards of {_mb(d.bytes)}"), bar))
    engine = node.engine.name if node.engine is not None else "not loaded yet"
    t.add_row("engine", f"{engine}  {s.tokens_per_s:,.0f} tokens/s")
    t.add_row("work", f"leases {s.leases}   groups submitted {s.groups_submitted}  accepted [green]"
                      f"{s.groups_accepted}[/]  rejected [red]{s.groups_rejected}[/]"
                      + (f"  unconfirmed {s.groups_unconfirmed}" if s.groups_unconfirmed else ""))
    if s.no_work:
        t.add_row("no work", f"[yellow]{s.no_work[:160]}[/]")
    t.add_row("last rejection", s.last_rejection[:100] or "[dim]none[/]")
    t.add_row("contribution", f"{s.accepted_tokens:,} accepted tokens   receipts {s.receipts} "
                              f"({s.receipt_tokens:,} tokens)")
    t.add_row("time", f"busy {s.busy_seconds:,.0f} s   idle {s.idle_seconds:,.0f} s")
    if s.last_error:
        t.add_row("last error", f"[dim]{s.last_error[:100]}[/]")
    title = f"swarmrl node {node.identity.node_id[:10]}" + (f" ({node.cfg.name})" if node.cfg.name else "")
    return Panel(t, title=title, title_align="left")


def run_node(cfg: NodeConfig) -> NodeStats:
    """Join (through the DHT when `cfg.pool` is set) and run until stopped; PermanentRefusal when the pool
    refuses the node for good (the caller prints its message)."""
    pool = ""
    if cfg.pool:
        from swarmrl.node.join import join_pool  # imports hivemind: only when joining by name

        cfg, record = join_pool(cfg)
        pool = record.record.name
    node = Node(cfg)
    interrupt_on_sigterm(node.stop)  # the node's loop stops by itself, and the process then ends at once
    if not cfg.progress:
        try:
            return node.run()
        except KeyboardInterrupt:
            node.stop()
            return node.stats
    done = threading.Event()
    with Live(render(node, pool), console=Console(), refresh_per_second=REFRESH_PER_S) as live:
        def refresh() -> None:
            while not done.wait(1 / REFRESH_PER_S):
                live.update(render(node, pool))

        th = threading.Thread(target=refresh, name="panel", daemon=True)
        th.start()
        try:
            stats = node.run()
        except KeyboardInterrupt:
            node.stop()
            stats = node.stats
        finally:
            done.set()
            live.update(render(node, pool))
    return stats
