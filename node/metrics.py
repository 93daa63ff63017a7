"""A node's Prometheus metrics (`swarmrl_node_*`), served on `metrics_port` while it runs.

Read from what the node already counts for its panel (`NodeStats`, its client's outage bookkeeping, its
checkpoint fetcher) at every scrape. They are the node's own view: the coordinator keeps its own books, and the
receipts are what proves a contribution.
"""

from __future__ import annotations

from prometheus_client.core import Metric

from swarmrl.node.stats import NodeStats
from swarmrl.runtime.metrics import counter, gauge
from swarmrl.runtime.retry import Outage
from swarmrl.transfer.download import FetchStats

ROLE = "node"


def node_families(node_id: str, name: str, s: NodeStats, outage: Outage, fetch: FetchStats | None) -> list[Metric]:
    """The metric families of a node's counters now (`fetch`: its checkpoint fetcher's, once it has one)."""
    fams = [
        gauge(ROLE, "info", "This node's id and name (value 1).", labels=("node", "name"),
              samples=[((node_id, name), 1.0)]),
        counter(ROLE, "leases", "Leases taken.", s.leases),
        counter(ROLE, "groups", "Groups submitted, by what the coordinator said: taken (for verification), refused, "
                "unconfirmed (a retry's outcome unknown).", labels=("outcome",),
                samples=[(("taken",), s.groups_accepted), (("refused",), s.groups_rejected),
                         (("unconfirmed",), s.groups_unconfirmed)]),
        counter(ROLE, "tokens_generated", "Completion tokens generated.", s.tokens),
        counter(ROLE, "tokens_taken", "Completion tokens of the groups the coordinator took for verification.",
                s.accepted_tokens),
        counter(ROLE, "receipts", "Valid receipts held for accepted groups (receipts.jsonl).", s.receipts),
        counter(ROLE, "receipt_tokens", "Completion tokens the receipts held credit.", s.receipt_tokens),
        counter(ROLE, "generate_seconds", "Seconds spent generating.", s.gen_seconds),
        counter(ROLE, "busy_seconds", "Seconds spent generating and submitting.", s.busy_seconds),
        counter(ROLE, "idle_seconds", "Seconds spent waiting for work or for recent enough weights.", s.idle_seconds),
        counter(ROLE, "registrations", "Registrations with the coordinator (more than one: it forgot the node).",
                s.registrations),
        counter(ROLE, "coordinator_outages", "Times the coordinator became unreachable.", outage.outages),
        gauge(ROLE, "coordinator_up", "1 while the coordinator answers, 0 during an outage.",
              1.0 if outage.down_for_s is None else 0.0),
        gauge(ROLE, "held_version", "Newest policy version loaded (-1: none).", s.held_version),
        gauge(ROLE, "current_version", "The coordinator's newest version, as last seen.", s.current_version),
        gauge(ROLE, "tokens_per_second", "Completion tokens per second spent generating.", s.tokens_per_s),
    ]
    if fetch is not None:
        fams += [counter(ROLE, "shards_fetched", "Checkpoint shards fetched (verified).", fetch.shards_fetched),
                 counter(ROLE, "shard_bytes_fetched", "Bytes of checkpoint shards fetched.", fetch.bytes_fetched),
                 counter(ROLE, "bad_shards", "Shards whose bytes did not match their hash (the peer is banned).",
                         fetch.bad_shards)]
    return fams
