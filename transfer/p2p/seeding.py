"""What a seed (the coordinator's peer: one link that every node shares) does differently from other peers.

- Super-seeding (`SeedLedger`): it sends every shard once before it sends any twice, and lets the copies
  spread peer to peer; a node asks it which of the shards it wants it would rather send (`OP_SUGGEST`).
- Ramp-up (`RampUp`): it starts a new version with one upload at a time and adds one per upload that ends.

Both run inside `ShardServer`; the ledger is also kept by non-seeds (it is only consulted on a seed).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from swarmrl.protocol.manifest import ShardRef
from swarmrl.transfer.p2p.wire import LATER

MAX_HANDOUTS = 1 << 16  # shards whose hand-outs are remembered (then the ledger starts afresh)


@dataclass
class Handout:
    given: int = 0  # uploads started or promised by a suggestion
    active: int = 0  # uploads in progress
    quiet_at: float = 0.0  # before this (monotonic) time the last copy is presumed still on its way


class SeedLedger:
    """How often this peer has handed out each shard, and whether a copy is still on its way.

    Not thread-safe: its owner calls it under its own lock. Times are passed in (monotonic seconds).
    `grace_s`: how long after an upload ends its copy counts as still on its way (time for the receiver to
    announce it); `max_uploads`: the seed's upload slots.
    """

    def __init__(self, grace_s: float, max_uploads: int):
        self.grace_s = grace_s
        self.max_uploads = max_uploads
        self.handouts: dict[str, Handout] = {}

    def handout(self, sha: str) -> Handout:
        h = self.handouts.get(sha)
        if h is None:
            if len(self.handouts) > MAX_HANDOUTS:
                self.handouts.clear()
            h = self.handouts[sha] = Handout()
        return h

    def upload_begins(self, sha: str, now: float) -> Handout:
        """An upload of `sha` starts (or waits for a slot); it counts as a hand-out unless a suggestion
        promised it a moment ago."""
        h = self.handout(sha)
        if h.active == 0 and now >= h.quiet_at:
            h.given += 1  # not announced by a suggestion
        h.active += 1
        return h

    def upload_ends(self, h: Handout, now: float) -> None:
        h.active -= 1
        h.quiet_at = now + self.grace_s

    def suggest(self, shards: Sequence[ShardRef], held: AbstractSet[int], wanted: AbstractSet[int], serving: int,
                now: float) -> int | bytes | None:
        """Which of the `wanted` shard indices (of a version whose shards are `shards`, of which this peer
        holds `held`) to send the asker; `serving`: uploads in progress or waiting for a slot.

        A wanted shard never handed out, if any; if there is none but other shards have never been handed out,
        LATER (take these from the peers). Once every shard has been handed out, the least handed out wanted
        shard, preferring one not still on its way to some peer (an upload in progress, or ended less than
        `grace_s` ago); one on its way too while fewer than `max_uploads` are served, since the link would
        otherwise idle. A suggestion counts as a hand-out, which keeps concurrent askers apart. Returns an
        index, None (nothing wanted is held) or LATER.
        """
        wanted = wanted & held
        if not wanted:
            return None

        def given(i: int) -> int:
            h = self.handouts.get(shards[i].sha256)
            return 0 if h is None else h.given

        def in_transit(i: int) -> bool:
            h = self.handouts.get(shards[i].sha256)
            return h is not None and (h.active > 0 or now < h.quiet_at)

        fresh = [i for i in wanted if given(i) == 0]
        if fresh:
            best = random.choice(fresh)
        elif any(given(i) == 0 for i in held):
            return LATER
        else:
            ready = [i for i in wanted if not in_transit(i)]
            if not ready:
                if serving >= self.max_uploads:
                    return LATER
                # The seed's link has room: a second copy now beats an idle link while the last shards crawl
                # from the few peers that hold them (the end of a broadcast).
                ready = list(wanted)
            best = min(ready, key=lambda i: (given(i), random.random()))
        h = self.handout(shards[best].sha256)
        h.given += 1
        h.quiet_at = now + self.grace_s  # the asker's request should follow at once
        return best


class RampUp:
    """A seed's upload slots for a new version open one by one: one upload at first, one more per upload that
    ends. At first nobody's download link is busy, so one upload at full rate lands a first copy (which can then
    spread) soonest; later each copy shares its receiver's link with peer traffic, and more uploads at once keep
    the seed's link full. Runs on one event loop (`start` binds it)."""

    def __init__(self) -> None:
        self._cond: asyncio.Condition | None = None
        self.active = 0
        self.done = 0

    def start(self) -> None:
        self._cond = asyncio.Condition()

    def restart(self) -> None:
        """A new version: ramp up again."""
        self.done = 0

    async def acquire(self) -> None:
        assert self._cond is not None
        async with self._cond:
            await self._cond.wait_for(lambda: self.active < 1 + self.done)
            self.active += 1

    def release(self) -> None:
        self.active -= 1
        self.done += 1
        cond = self._cond
        if cond is not None:
            async def notify() -> None:
                async with cond:
                    cond.notify_all()

            asyncio.ensure_future(notify())
