"""The attackers' strategies, by name, from `swarmrl.testing.byzantine.quarantine_sim` (the ones its simulation and
bench/byzantine.py play): `batchC`, `mixedF`, `optimal` (the dynamic programme's best against the scenario's rule).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

from swarmrl.protocol.quarantine import Rules
from swarmrl.testing.byzantine.quarantine_sim import Strategy, batch, mixed, optimal, optimal_yield

_NAME = re.compile(r"^(batch(?P<c>[1-9][0-9]*)|mixed(?P<f>0?\.[0-9]+|1(\.0*)?)|optimal)$")


def check_strategy_name(name: str) -> None:
    """ValueError unless `name` names a strategy."""
    if not _NAME.match(name):
        raise ValueError(f"unknown strategy {name!r}: use batchC (e.g. batch2), mixedF (e.g. mixed0.1) or optimal")


@lru_cache(maxsize=8)
def _optimum(rules: Rules):
    return optimal_yield(rules)


def factory(name: str, rules: Rules) -> Callable[[], Strategy]:
    """Makes a fresh strategy for each attacker identity (batchC keeps a count of its own)."""
    check_strategy_name(name)
    found = _NAME.match(name)
    assert found is not None
    if found["c"]:
        c = int(found["c"])
        return lambda: batch(c)
    if found["f"]:
        f = float(found["f"])
        return lambda: mixed(f)
    opt = _optimum(rules)
    return lambda: optimal(opt)
