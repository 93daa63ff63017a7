"""The byzantine suites' common run: honest nodes work a round, then between every attack attempt."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def run_with_honest(pool: Any, honest: Sequence[Any], run_suite: Callable[..., Any],
                    attempts: int) -> tuple[Any, list[dict[str, Any]]]:
    """`run_suite(pool, attempts, honest=round)`'s results, where each round has every honest node sync and step
    and the pool verify all it holds (one round runs before the first attack), with every honest node's groups."""

    def honest_round() -> int:
        for h in honest:
            h.sync()
            h.step()
        return pool.verify_all()

    honest_round()
    results = run_suite(pool, attempts, honest=honest_round)
    return results, [g for h in honest for g in pool.groups(h.node_id)]
