"""The quarantine rule (`protocol.quarantine`) against adaptive attackers with free identities: the attacker's
optimal strategy by dynamic programming, and a seeded simulation of the rule's own functions (`decide`,
`on_pass`) under any strategy. Pure and fast (no model, no server); tests and the bench use it.
Derivation and figures: docs/quarantine.md.

The model. An attacker identity first passes K warm-up checks with honest groups (any cheat there is checked).
Then, one group at a time, knowing everything that has happened (its held groups, which of them cheat, their
vouch counts), it sends an honest group (it costs one group of generation) or a cheating one (free: the bound
does not assume cheats cost anything). The verifier draws each check after the group was sent. A checked
cheat bans the identity and drops everything it holds; the attacker then starts a new identity. Poisoned: a
cheating group released to the trainer.

`optimal_yield` maximises poisoned groups per honest group generated, over every strategy, for the rule
without its held cap (the cap only forces checks that cannot vouch, so dropping it can only help the attacker):
Dinkelbach's method, pi* = the lambda at which the best E[poisoned - lambda x honest work] of an identity's life,
warm-up included, is 0. States: the number of held cheats at each vouch level 0..m-1.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from swarmrl.protocol.quarantine import Held, Rules, decide, on_pass

# -- the attacker's optimum ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Optimum:
    yield_per_work: float
    """pi*: poisoned groups trained on per honest group the attacker generates, with its best strategy."""
    cheat_in: frozenset[tuple[int, ...]]
    """The states (held cheats per vouch level, level 0 first) in which the best strategy sends a cheat."""
    max_cheats: int
    """Held cheats the state space allowed (the optimum never reaches it unless it is too small)."""


def _tables(m: int, cmax: int) -> tuple[list[tuple[int, ...]], np.ndarray, np.ndarray, np.ndarray]:
    states = [s for s in itertools.product(range(cmax + 1), repeat=m) if sum(s) <= cmax]
    idx = {s: i for i, s in enumerate(states)}
    after_pass = np.array([idx[(0,) + s[:-1]] for s in states])
    released = np.array([s[-1] for s in states], dtype=float)
    after_cheat = np.array([idx[(s[0] + 1,) + s[1:]] if sum(s) < cmax else -1 for s in states])
    return states, after_pass, released, after_cheat


def _values(lam: float, p: float, tabs, tol: float = 1e-11) -> tuple[np.ndarray, np.ndarray]:
    """Best E[poisoned - lam x work] from each state to the identity's end; and where cheating is best."""
    _, after_pass, released, after_cheat = tabs
    can_cheat = after_cheat >= 0
    v = np.zeros(len(after_pass))
    for _ in range(1_000_000):
        # Honest groups until a drawn check (1 / p of them on average, each costing lam); it vouches, which
        # moves every held cheat up one level and releases the top level.
        honest = -lam / p + released + v[after_pass]
        cheat = np.where(can_cheat, (1 - p) * v[np.maximum(after_cheat, 0)], -np.inf)  # checked: the end, 0
        new = np.maximum(0.0, np.maximum(honest, cheat))  # 0: leave the identity (its held cheats are lost)
        if np.abs(new - v).max() < tol:
            return new, cheat > honest
        v = new
    raise RuntimeError("value iteration did not converge")  # pragma: no cover


def optimal_yield(rules: Rules, max_cheats: int | None = None) -> Optimum:
    """The attacker's best poisoned-per-honest-work against `rules` (held cap ignored: an upper bound)."""
    p, k, m = rules.sample_rate, rules.warmup_checks, rules.release_passes
    if p <= 0 or p >= 1:
        raise ValueError("optimal_yield needs 0 < p < 1")
    cmax = max_cheats if max_cheats is not None else {1: 80, 2: 40}.get(m, 14)
    tabs = _tables(m, cmax)
    lo, hi = 0.0, 1.0
    while _values(hi, p, tabs)[0][0] - hi * k > 0:  # the yield is above hi: widen
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if _values(mid, p, tabs)[0][0] - mid * k > 0:
            lo = mid
        else:
            hi = mid
    _, cheat = _values(lo, p, tabs)
    return Optimum(yield_per_work=lo, cheat_in=frozenset(s for s, c in zip(tabs[0], cheat, strict=True) if c),
                   max_cheats=cmax)


def share(yield_per_work: float, attacker_share: float, own_trained_per_work: float = 0.0) -> float:
    """Poisoned share of trained-on groups when the attacker (a share `attacker_share` of the throughput) gets
    `yield_per_work` poisoned and `own_trained_per_work` of its honest groups trained per honest group."""
    a, pi = attacker_share, yield_per_work
    return a * pi / ((1 - a) + a * own_trained_per_work + a * pi)


# -- strategies ------------------------------------------------------------------------------------------------------


@dataclass
class View:
    """What an attacker identity knows before sending its next group: everything."""

    rules: Rules
    passes: int
    held: list[Held]
    cheats: set[int]
    """Ids of its held groups that cheat."""

    @property
    def check_is_certain(self) -> bool:
        return self.passes < self.rules.warmup_checks or len(self.held) >= self.rules.max_held

    def cheat_levels(self) -> tuple[int, ...]:
        levels = [0] * self.rules.release_passes
        for h in self.held:
            if h.group_id in self.cheats:
                levels[h.vouches] += 1
        return tuple(levels)


Strategy = Callable[[View, random.Random], bool]
"""Returns True to send a cheating group next."""


class batch:  # noqa: N801 - used like the other strategy factories
    """c cheats, then honest groups until none of its cheats is held any more; again. c = 1 is the script of
    issue 16 (one cheat, then honest until a check released it); a large c cheats on everything."""

    def __init__(self, c: int):
        self.c, self.sent, self.__name__ = c, 0, f"batch{c}"

    def __call__(self, v: View, rng: random.Random) -> bool:
        if v.check_is_certain:
            return False
        if not v.cheats:  # a new cycle (or a new identity)
            self.sent = 0
        if self.sent < self.c:
            self.sent += 1
            return True
        return False


def mixed(f: float) -> Strategy:
    """Each group after the warm-up cheats with probability f (whatever the state)."""
    def choose(v: View, rng: random.Random) -> bool:
        return not v.check_is_certain and rng.random() < f
    choose.__name__ = f"mixed{f:g}"
    return choose


def optimal(opt: Optimum) -> Strategy:
    """The dynamic programme's best strategy (honest where a check is certain)."""
    def choose(v: View, rng: random.Random) -> bool:
        return not v.check_is_certain and v.cheat_levels() in opt.cheat_in
    choose.__name__ = "optimal"
    return choose


# -- the simulation --------------------------------------------------------------------------------------------------


@dataclass
class SimResult:
    poisoned: int = 0
    work: int = 0
    """Honest groups the attacker generated (warm-ups included)."""
    own_trained: int = 0
    """Of those, how many were trained on (the rest were dropped with a banned identity)."""
    identities: int = 0
    banned: int = 0
    per_identity: list[tuple[int, int]] = field(default_factory=list)
    """(poisoned, work) of each finished identity, for the sampling error."""

    @property
    def yield_per_work(self) -> float:
        return self.poisoned / max(self.work, 1)

    @property
    def yield_stderr(self) -> float:
        """Standard error of `yield_per_work` (ratio estimator over finished identities)."""
        n = len(self.per_identity)
        if n < 2:
            return math.inf
        pi = self.yield_per_work
        resid = [p - pi * w for p, w in self.per_identity]
        return math.sqrt(sum(r * r for r in resid) * n / (n - 1)) / max(self.work, 1)

    def share(self, attacker_share: float, conservative: bool = False) -> float:
        """Poisoned share of trained-on groups, honest nodes doing (1 - a) / a of the attacker's work (all of it
        trained on); `conservative`: counting none of the attacker's own honest groups as trained on."""
        own = 0.0 if conservative else self.own_trained / max(self.work, 1)
        return share(self.yield_per_work, attacker_share, own)


def simulate(rules: Rules, strategy: Strategy, work: int, seed: int = 0) -> SimResult:
    """Run the rule's own functions against `strategy` until the attacker has generated `work` honest groups."""
    rng = random.Random(seed)
    res = SimResult()
    gid = 0
    while res.work < work:
        res.identities += 1
        passes, held, cheats = 0, [], set()
        poisoned0, work0 = res.poisoned, res.work
        while res.work < work:
            gid += 1
            cheat = strategy(View(rules, passes, held, cheats), rng)
            res.work += not cheat
            check = decide(rules, passes, len(held), rng.random())
            if not check.full:
                held.append(Held(gid))
                if cheat:
                    cheats.add(gid)
                continue
            if cheat:  # caught: banned, everything it holds is dropped
                res.banned += 1
                break
            passes += 1
            res.own_trained += 1
            out = on_pass(held, gid, check.vouches, rules.release_passes)
            for g in out.released:
                if g in cheats:
                    cheats.discard(g)
                    res.poisoned += 1
                else:
                    res.own_trained += 1
            held = list(out.still_held)
        res.per_identity.append((res.poisoned - poisoned0, res.work - work0))
    return res


@dataclass
class HonestResult:
    groups: int
    checks: int
    overflow: int
    mean_release_delay: float
    """Groups of its own the node submitted between a held group and its release, on average."""

    @property
    def check_rate(self) -> float:
        return self.checks / self.groups


def simulate_honest(rules: Rules, groups: int, seed: int = 0) -> HonestResult:
    """One honest identity through the rule: its check rate (warm-up included) and how long held groups wait."""
    rng = random.Random(seed)
    held: list[Held] = []
    passes = checks = overflow = 0
    delays: list[int] = []
    for gid in range(1, groups + 1):
        check = decide(rules, passes, len(held), rng.random())
        if not check.full:
            held.append(Held(gid))
            continue
        checks += 1
        overflow += check.name == "OVERFLOW"
        passes += 1
        out = on_pass(held, gid, check.vouches, rules.release_passes)
        delays.extend(gid - g for g in out.released)
        held = list(out.still_held)
    return HonestResult(groups=groups, checks=checks, overflow=overflow,
                        mean_release_delay=sum(delays) / len(delays) if delays else 0.0)
