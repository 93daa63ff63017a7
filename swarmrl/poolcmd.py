"""`swarmrl pool list`: the public pools found in the DHT, as a table or as JSON, with every refused record and why."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from swarmrl.node.config import NodeConfig
from swarmrl.pools.errors import PoolLookupError

if TYPE_CHECKING:
    from swarmrl.pools.discover import PoolListing  # imports hivemind: only when listing


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
    for line in render_listing(listing, time.time()):
        console.print(line)


def render_listing(listing: PoolListing, now: float) -> list[Text]:
    """The pools, one short block each (readable at 80 columns: a field per line, never a 10-column table), then
    every refused record with why. Every value is the records' (untrusted) text: never read as markup."""
    out = [Text(f"{len(listing.pools)} pools", style="bold")]
    names = [s.record.name for s in listing.pools]
    for s in listing.pools:
        r = s.record
        version = f"v{r.current_version}" if r.current_version >= 0 else "no version yet"
        out.append(Text.assemble("\n", (r.name, "bold"), "  ", (r.status, "green" if r.status == "open" else "yellow"),
                                 f"  {version}  {r.nodes:,} nodes  {r.accepted_tokens:,} accepted tokens",
                                 (f"  expires in {r.expires_at - now:.0f} s", "dim")))
        out.append(Text(f"  model  {r.model or '-'}   task {r.task or '-'}"))
        out.append(Text(f"  url    {r.coordinator_urls[0]}"))
        out.append(Text(f"  key    {r.coordinator_key[:16]}…"))
        if names.count(r.name) > 1:
            out.append(Text(f"  the name is claimed by several keys: join with --pool {r.name}@"
                            f"{r.coordinator_key[:8]}", style="yellow"))
    for ref in listing.refused:
        out.append(Text.assemble(("refused ", "red"), f"{ref.name or '?'} (key {ref.key[:16]}…): {ref.reason}"))
    return out
