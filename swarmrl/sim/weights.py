"""Which policy version each node holds, in virtual time, without an event per download.

A node's fetcher (`transfer.fetcher`) fetches the newest published version whenever it holds an older one, one
fetch after another, while the node is online. That chain depends only on when versions were published and on
the node's download rate, so it is worked out when someone asks (`advance`), not event by event: a 10,000-node
day would otherwise spend most of its events on downloads. A fetch of version w by a node holding h costs the
full checkpoint, or with delta broadcasts and 0 <= h, w - h <= deltas_kept, the w - h deltas in between; it
takes two round trips plus bytes / the node's rate (drawn from the broadcast the real scheduler ran,
`sim.broadcast`). A node asked about after a long absence of questions (idle, not tracked) is assumed to have
fetched all along: its chain is worked out over the last `horizon_s` only.
"""

from __future__ import annotations

import math
from bisect import bisect_right

from swarmrl.sim.scenario import Model


class Versions:
    """When each version was published (at the origin), in order."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def publish(self, at: float) -> int:
        self.times.append(at)
        return len(self.times) - 1

    def at(self, t: float) -> int:
        """The newest version published at or before `t` (-1 before the first)."""
        return bisect_right(self.times, t) - 1

    @property
    def current(self) -> int:
        return len(self.times) - 1


class Fetcher:
    """One node's fetch chain."""

    __slots__ = ("held", "target", "end", "anchor", "rate", "rtt", "online", "reach", "sessions")

    def __init__(self, rate: float, rtt: float):
        self.held, self.target, self.end, self.anchor = -1, -1, math.inf, 0.0
        self.rate, self.rtt, self.online = rate, rtt, False
        self.reach: list[tuple[int, int, float]] | None = None
        """For a tracked node: (from, to, when) of every fetch it completed."""
        self.sessions: list[list[float]] = []
        """For a tracked node: [online from, until] of each stay (until: inf while online)."""


class Weights:
    """The fetch chains of every node, against one publication history."""

    def __init__(self, model: Model, versions: Versions):
        self.model, self.versions = model, versions
        self.full = model.full_bytes
        self.delta = self.full * model.delta_ratio
        self.fetches = 0
        self.bytes = 0.0

    def size(self, held: int, target: int) -> float:
        m = self.model
        if m.broadcast == "delta" and held >= 0 and target - held <= m.deltas_kept:
            return (target - held) * self.delta
        return self.full

    def horizon(self, f: Fetcher) -> float:
        return 4 * (2 * f.rtt + self.full / f.rate)

    def go_online(self, f: Fetcher, now: float) -> None:
        f.online, f.anchor = True, now
        if f.reach is not None:
            f.sessions.append([now, math.inf])

    def go_offline(self, f: Fetcher, now: float) -> None:
        self.advance(f, now)
        f.online, f.target, f.end = False, -1, math.inf  # a fetch under way is lost
        if f.reach is not None and f.sessions:
            f.sessions[-1][1] = now

    def advance(self, f: Fetcher, t: float) -> int:
        """Work `f`'s chain out up to `t`; the version it holds then."""
        if not f.online:
            return f.held
        times = self.versions.times
        if f.reach is None and f.target < 0 and t - f.anchor > self.horizon(f):
            # Long unobserved: it fetched all along. Start its chain one horizon back, holding what it would.
            start = t - self.horizon(f)
            f.held = max(f.held, self.versions.at(start - 2 * f.rtt - self.full / f.rate))
            f.anchor = start
        while True:
            if f.target >= 0:
                if f.end > t:
                    return f.held
                if f.reach is not None:
                    f.reach.append((f.held, f.target, f.end))
                f.held, f.anchor, f.target, f.end = f.target, f.end, -1, math.inf
            newest = bisect_right(times, f.anchor) - 1
            if newest > f.held:
                size = self.size(f.held, newest)
                self.fetches += 1
                self.bytes += size
                f.target, f.end = newest, f.anchor + 2 * f.rtt + size / f.rate
                continue
            if f.held + 1 >= len(times) or times[f.held + 1] > t:
                f.anchor = max(f.anchor, t)
                return f.held
            f.anchor = times[f.held + 1]

    def next_change(self, f: Fetcher) -> float:
        """When `f` next holds something new (inf: nothing under way)."""
        return f.end
