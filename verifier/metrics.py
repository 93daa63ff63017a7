"""What the verifier counts (`VerifierStats`) and its Prometheus metrics (`swarmrl_verifier_*`), served on
`metrics_port` while it runs, read from those counts at every scrape."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import Metric

from swarmrl.runtime.metrics import MetricsServer, counter, registry_of, serve_metrics

ROLE = "verifier"


@dataclass
class VerifierStats:
    groups: int = 0
    full_checks: int = 0
    held: int = 0
    rejected: int = 0
    deferred: int = 0
    """Groups left without a verdict because their identity was over its verification budget."""
    tokens_checked: int = 0
    check_seconds: float = 0.0
    """Wall time of full checks (prefill + comparisons), for the cost ratio."""
    bans: int = 0
    poll_errors: int = 0


def verifier_families(s: VerifierStats) -> list[Metric]:
    accepted = s.groups - s.held - s.rejected
    return [
        counter(ROLE, "groups", "Groups decided, by verdict: accepted (fully checked), held (cheap checks only, held "
                "by the coordinator until a later full check of the node), rejected.", labels=("verdict",),
                samples=[(("accepted",), accepted), (("held",), s.held), (("rejected",), s.rejected)]),
        counter(ROLE, "bans", "Rejections that banned their node (proof of cheating).", s.bans),
        counter(ROLE, "deferred", "Groups left pending because their identity was over its verification budget.",
                s.deferred),
        counter(ROLE, "full_checks", "Groups fully checked (prefill, replay, logprobs, proofs).", s.full_checks),
        counter(ROLE, "tokens_checked", "Completion tokens fully checked.", s.tokens_checked),
        counter(ROLE, "check_seconds", "Wall time of full checks.", s.check_seconds),
        counter(ROLE, "poll_errors", "Polls that failed (coordinator refusals, network, weights).", s.poll_errors),
    ]


def serve_verifier_metrics(stats: VerifierStats, host: str, port: int | None) -> MetricsServer | None:
    """Serve the metrics of `stats` on host:port (a port of 0 or None: off)."""
    return serve_metrics(registry_of(lambda: verifier_families(stats)), host, port)
