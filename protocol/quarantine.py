"""The quarantine rule of spot-checked rollout groups: which group gets the full check, and when a group that
only passed the cheap checks may reach the trainer. The derivation of its bound is in docs/quarantine.md.

Pure and deterministic: no clock, no I/O, no state of its own; the randomness is a number the caller draws.
The verifier asks `decide` about every group; the coordinator, which stores holds and releases, asks
`on_pass` about every passed full check; the simulation in `swarmrl.testing.byzantine.adaptive` drives the
same two functions against adaptive attackers.

The rule, per identity (a node key), with the knobs of `Rules`:

1. Warm-up: every group of an identity with fewer than K passed full checks is fully checked.
2. After it, each group is fully checked with probability p, from a number the coordinator draws once, at the
   group's first claim, from randomness the node cannot predict; every re-claim keeps it.
3. A group not drawn gets the cheap checks only and is *held*. An identity may hold at most h groups: when it
   already does, its next group is fully checked anyway (an *overflow* check).
4. A drawn (or warm-up) full check that passes *vouches* for every group the identity holds that it submitted
   earlier; a held group with m vouches is released to the trainer, oldest first. An overflow check vouches
   for nothing: a check the node can foresee must not buy releases.
5. A failed full check bans the identity and drops every group of it not yet released.

What it promises (docs/quarantine.md): whatever an attacker with unlimited free identities does, in expectation
at most (1 - p) / p of its cheating groups reach the trainer per identity it loses, and every identity that can
hold a group first spent K honest groups on its warm-up. So per honest group of its own work, the attacker gets
at most (1 - p) / (p K) poisoned groups trained on (`poison_per_work_bound`); with a share a of the swarm's
throughput, poisoned groups are at most a x that / ((1 - a) + a x that) of all groups trained on
(`poisoned_share_bound`). m and h only lower the attacker's yield further (and bound one identity's exposure);
the bound does not depend on them. A check that misses a cheat with probability 1 - d acts as p d.

What the callers keep: a group's draw is made once and kept by every re-claim, and a failed full check bans
whatever verdict on the group landed first (docs/quarantine.md, "Re-claims and crashed verifiers"); otherwise a
node could have its checks drawn again until one comes out unchecked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

WARMUP_CHECKS = 450
"""K: with p = 0.1, the smallest K whose bound on the poisoned share is <= 1% with attackers holding a third of
the throughput (`warmup_for(0.1, 1/3, 0.01)`)."""
SAMPLE_RATE = 0.1
"""p: the share of an identity's groups fully checked after its warm-up."""
RELEASE_PASSES = 1
"""m: vouching passes needed after a held group before it is released (1: the next one)."""
MAX_HELD = 64
"""h: held groups one identity may have; an honest node reaches it with probability (1 - p)^h per check cycle."""
ATTACKER_SHARE = 1 / 3
"""a: the share of the swarm's throughput the bound is stated for (issue 16's threat)."""
TARGET_SHARE = 0.01
"""The largest share of trained-on groups that may be poisoned at `ATTACKER_SHARE`."""


@dataclass(frozen=True)
class Rules:
    """The knobs of the rule (see the module docstring)."""

    warmup_checks: int = WARMUP_CHECKS
    sample_rate: float = SAMPLE_RATE
    release_passes: int = RELEASE_PASSES
    max_held: int = MAX_HELD

    def __post_init__(self) -> None:
        if self.warmup_checks < 0:
            raise ValueError(f"warmup_checks must be >= 0, got {self.warmup_checks}")
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {self.sample_rate}")
        if self.release_passes < 1:
            raise ValueError(f"release_passes must be >= 1, got {self.release_passes}")
        if self.max_held < 0:
            raise ValueError(f"max_held must be >= 0, got {self.max_held}")


class Check(StrEnum):
    """What the verifier does with one group."""

    WARMUP = "warmup"
    """Full check: the identity has not yet passed K. Vouches when it passes."""
    SAMPLED = "sampled"
    """Full check: drawn with probability p. Vouches when it passes."""
    OVERFLOW = "overflow"
    """Full check forced by the held cap (the node could foresee it): does not vouch."""
    HOLD = "hold"
    """Cheap checks only; the coordinator holds the group until it is vouched for m times."""

    @property
    def full(self) -> bool:
        return self is not Check.HOLD

    @property
    def vouches(self) -> bool:
        return self in (Check.WARMUP, Check.SAMPLED)


def decide(rules: Rules, passes: int, held: int, draw: float) -> Check:
    """The check for an identity's next group. `passes`: full checks it has passed; `held`: groups it holds now;
    `draw`: uniform in [0, 1), drawn for this group only, after it was submitted, unpredictable to the node."""
    if passes < rules.warmup_checks:
        return Check.WARMUP
    if draw < rules.sample_rate:
        return Check.SAMPLED
    if held >= rules.max_held:
        return Check.OVERFLOW
    return Check.HOLD


@dataclass(frozen=True)
class Held:
    """A held group of an identity and the vouching passes it has had so far."""

    group_id: int
    vouches: int = 0


@dataclass(frozen=True)
class PassOutcome:
    """What a passed full check changes among the identity's held groups."""

    released: tuple[int, ...]
    """Held groups that reach the trainer now, oldest first (before the checked group itself)."""
    still_held: tuple[Held, ...]
    """The identity's other held groups, with their vouch counts after this pass."""


def on_pass(held: Sequence[Held], group_id: int, vouches: bool, release_passes: int) -> PassOutcome:
    """A full check of the identity's group `group_id` passed; `held` are all groups it holds (any order).

    A vouching pass adds a vouch to every held group submitted before `group_id` (a smaller id); those that reach
    `release_passes` are released. The checked group itself is accepted by the caller in any case."""
    if release_passes < 1:
        raise ValueError("release_passes must be >= 1")
    released: list[int] = []
    still: list[Held] = []
    for h in sorted(held, key=lambda h: h.group_id):
        n = h.vouches + 1 if vouches and h.group_id < group_id else h.vouches
        if n >= release_passes:
            released.append(h.group_id)
        else:
            still.append(Held(h.group_id, n))
    return PassOutcome(released=tuple(released), still_held=tuple(still))


# -- the bound (derivation: docs/quarantine.md) -------------------------------------------------------------------


def poison_per_work_bound(sample_rate: float, warmup_checks: int) -> float:
    """Poisoned groups trained on per honest group the attacker generates, at most, whatever its strategy:
    (1 - p) / (p K). Infinite when p = 0 or K = 0 (nothing bounds it then)."""
    if sample_rate <= 0 or warmup_checks <= 0:
        return math.inf
    return (1 - sample_rate) / (sample_rate * warmup_checks)


def poisoned_share_bound(rules: Rules, attacker_share: float = ATTACKER_SHARE) -> float:
    """The largest share of trained-on groups that can be poisoned by attackers with `attacker_share` of the
    throughput and unlimited free identities: a pi / ((1 - a) + a pi), pi = `poison_per_work_bound`. It counts
    none of the attacker's own honest groups as trained on, so it holds whatever it does with them."""
    if not 0 <= attacker_share < 1:
        raise ValueError("attacker_share must be in [0, 1)")
    pi = poison_per_work_bound(rules.sample_rate, rules.warmup_checks)
    if math.isinf(pi):
        return 1.0 if attacker_share > 0 else 0.0
    return attacker_share * pi / ((1 - attacker_share) + attacker_share * pi)


def warmup_for(sample_rate: float, attacker_share: float = ATTACKER_SHARE, target: float = TARGET_SHARE) -> int:
    """The smallest K for which `poisoned_share_bound` is at most `target` at this p and attacker share."""
    if not 0 < sample_rate <= 1 or not 0 < target < 1 or not 0 <= attacker_share < 1:
        raise ValueError("need 0 < sample_rate <= 1, 0 < target < 1, 0 <= attacker_share < 1")
    # a pi / ((1 - a) + a pi) <= s  <=>  pi <= s (1 - a) / (a (1 - s))
    if attacker_share == 0 or sample_rate == 1:
        return 0
    pi_max = target * (1 - attacker_share) / (attacker_share * (1 - target))
    k = math.ceil((1 - sample_rate) / (sample_rate * pi_max) - 1e-9)
    return max(k, 1)


def honest_check_rate(rules: Rules, lifetime: int | None = None) -> float:
    """p_eff: the share of an honest identity's groups that get the full check. Without `lifetime`, in the long
    run: p plus the overflow checks; with it, over an identity's first `lifetime` groups (warm-up included).

    Exact for m = 1: a check cycle (groups up to and including a drawn one) is geometric with mean 1 / p, and
    the groups beyond the first h undrawn ones of a cycle are overflow checks, (1 - p)^(h + 1) / p per cycle.
    For m > 1 a group waits for m cycles, so h is reached sooner; this then uses h / m in place of h, an
    approximation (the held count is the undrawn groups of the last m cycles). With p = 0 nothing is ever
    released after the warm-up, so every group beyond the first h is an overflow check: 1."""
    p, k = rules.sample_rate, rules.warmup_checks
    steady = min(1.0, p + (1 - p) ** (rules.max_held / rules.release_passes + 1))
    if lifetime is None:
        return steady
    if lifetime <= 0:
        raise ValueError("lifetime must be positive")
    warm = min(k, lifetime)
    return (warm + (lifetime - warm) * steady) / lifetime
