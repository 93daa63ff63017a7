"""`swarmrl pool list`: the public pools found in the DHT, as a table or as JSON, with every refused record and why."""

from __future__ import annotations

import json
import sys
import time

from rich.console import Console
from rich.table import Table

from swarmrl.node.config import NodeConfig
from swarmrl.pools.errors import PoolLookupError


def list_command(cfg: NodeConfig, bootstrap: list[str] | None = None, as_json: bool = False) -> None:
    """Print the pools (and refusals) the node config's `[pools]` DHT holds. Read only: the pins a node made when it
    joined apply (a record of a pinned name under another key is refused), but listing pins nothing."""
    from swarmrl.pools.discover import list_pools  # imports hivemind
    from swarmrl.pools.trust import TRUST_FILE, PoolTrust

    trust = PoolTrust.in_dir(cfg.work_dir) if (cfg.work_dir / TRUST_FILE).exists() else None
    try:
        listing = list_pools(cfg.pools, trust=trust, bootstrap=bootstrap or None)
    except PoolLookupError as e:
        sys.exit(f"swarmrl pool list: {e}")
    if as_json:
        print(json.dumps({"pools": [s.model_dump(mode="json") for s in listing.pools],
                          "refused": [{"key": r.key, "name": r.name, "reason": r.reason} for r in listing.refused]},
                         indent=1))
        return
    console = Console(highlight=False)
    table = Table(title=f"{len(listing.pools)} pools", title_justify="left")
    for col in ("name", "status", "model", "task", "version", "nodes", "accepted tokens", "coordinator", "key",
                "expires"):
        table.add_column(col, no_wrap=col in ("name", "key"))
    names = [s.record.name for s in listing.pools]
    now = time.time()
    for s in listing.pools:
        r = s.record
        name = r.name + (" [yellow](name claimed by several keys)[/]" if names.count(r.name) > 1 else "")
        table.add_row(name, r.status, r.model or "-", r.task or "-", str(r.current_version), str(r.nodes),
                      f"{r.accepted_tokens:,}", r.coordinator_urls[0], r.coordinator_key[:16] + "…",
                      f"in {r.expires_at - now:.0f} s")
    console.print(table)
    for r in listing.refused:
        console.print(f"[red]refused[/] {r.name or '?'} (key {r.key[:16]}…): {r.reason}")
