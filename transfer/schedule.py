"""Which shard to fetch next, and from which source: a pure function of one download's state.

`choose(state, sources, now, policy, hints)` reads a `DownloadState` and a snapshot of the sources
(`SourceView`s, made by the executor from `ShardSource.expand` and `ShardSource.held`) and returns a decision:

- `Pick(shard, source, duplicate)`: request `shard` from `source` now (`duplicate`: an end-game second request);
- `Consult(seed, queue)`: first ask this seed which of `queue` it would rather send (`ShardSource.suggest`),
  then call `choose` again, with the answer under the seed's key in `hints`;
- `Wait(reason)`: nothing can start now; wait until a request ends (or poll again);
- `Fail(reason, shard, unavailable)`: the download cannot complete.

Nothing here reads a clock, takes a lock, starts a thread or calls a source: `now` is passed in, and ties are
broken by a hash of the download's `salt`, the number of requests started so far and the source's key (as random
as a coin, but the same answer for the same state). The executor (`transfer.download`) owns the threads, the lock
and the sources, and applies what happens to each request through `DownloadState`'s transitions.

The policy:

- Sources with `seed` set (the HTTP origin, the coordinator's seed peer: holders of everything, but one shared
  link) are used only for shards that no peer holds, rarest first; each shard goes to the first seed (in the
  order given) that has not failed it: a second seed is a fallback, not extra capacity. A seed is consulted
  before it is used and may answer WAIT for its queue ("these are on their way to peers").
- Peers are used for every shard they hold. Rarest first (fewest peer holders, ties by rank in the
  download's rotated shard list, so that nodes starting together take different shards from the seed), or,
  with `spread_holders`, the peer first (the free one this download uses least) and then the rarest shard it
  holds. At most `max_parallel_peers` peers at once, `requests_per_peer` requests to each (a seed:
  `origin_parallel`); a source that answered busy is left alone until the time it gave.
- End game: once every missing shard is in flight, a second free source is asked for a shard in flight from
  exactly one source for `endgame_patience` times the median download so far (`ENDGAME_FIRST_S` before any
  download has ended; 0: at once); peers first, and of the seeds only the first, for a shard in flight from a
  peer. The first copy to arrive wins.
- A shard fails once every seed has failed it and no peer holds it; without seeds, the download fails when
  nothing is in flight and no shard has been stored for `stall_timeout_s`.
"""

from __future__ import annotations

import statistics
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol

from swarmrl.protocol.manifest import ShardRef
from swarmrl.transfer.sources import WAIT, ShardSource

ENDGAME_FIRST_S = 2.0  # before any download has ended, the end game doubles one only after this long
DURATIONS_KEPT = 64  # the end game's median is over this many of the latest downloads


class Policy(Protocol):
    """The knobs `choose` reads (`transfer.fetcher.FetchConfig` has them, with their defaults and meaning)."""

    max_parallel_peers: int
    requests_per_peer: int
    origin_parallel: int
    spread_holders: bool
    endgame: bool
    endgame_patience: float
    stall_timeout_s: float


@dataclass(frozen=True)
class SourceView:
    """One concrete source as `choose` sees it: who it is and which of the remaining shards it holds."""

    key: str
    name: str
    seed: bool
    held: AbstractSet[str]  # hashes of shards not yet stored that this source holds
    source: ShardSource | None = None  # for the executor; `choose` never calls it


@dataclass(frozen=True)
class Pick:
    shard: ShardRef
    source: SourceView
    duplicate: bool = False


@dataclass(frozen=True)
class Consult:
    seed: SourceView
    queue: tuple[ShardRef, ...]


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class Fail:
    reason: str
    shard: str | None = None
    unavailable: bool = False  # every source that failed the shard said it does not have it


Decision = Pick | Consult | Wait | Fail


@dataclass
class DownloadState:
    """Where one download stands. `choose` only reads it; the executor changes it through the transitions
    below (`start`, `delivered`, `busy`, `failed_by`, `end`), under its lock, passing the time in."""

    refs: dict[str, ShardRef]  # every shard this download fetches, by hash
    pending: dict[str, ShardRef]  # neither stored nor in flight, in rank order
    remaining: set[str]  # not yet stored
    last_progress: float  # when a shard was last stored (or the download began)
    salt: int = 0  # seeds the tie-breaks
    picks: int = 0  # requests started so far
    in_flight: dict[str, set[str]] = field(default_factory=dict)  # shard -> keys of the sources fetching it now
    started: dict[str, float] = field(default_factory=dict)  # shard in flight -> when its first request began
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=DURATIONS_KEPT))  # successful downloads
    failed: dict[str, set[str]] = field(default_factory=dict)  # shard -> keys of the sources that failed it
    not_held: dict[str, set[str]] = field(default_factory=dict)  # shard -> keys of those that said they lack it
    errors: dict[str, list[str]] = field(default_factory=dict)  # shard -> what each failure was
    load: dict[str, int] = field(default_factory=dict)  # source key -> its requests in flight
    peer_in_flight: int = 0  # peers (non-seed sources) with a request in flight
    busy_until: dict[str, float] = field(default_factory=dict)  # source key -> when it said it is free again

    @classmethod
    def begin(cls, missing: Sequence[ShardRef], now: float, rotation: int = 0, salt: int = 0) -> DownloadState:
        """A download of `missing`, ranked from position `rotation` of the list on (wrapping around)."""
        order = [*missing[rotation:], *missing[:rotation]]
        return cls(refs={s.sha256: s for s in missing}, pending={s.sha256: s for s in order},
                   remaining={s.sha256 for s in missing}, last_progress=now, salt=salt)

    # -- transitions -----------------------------------------------------------------------------------

    def start(self, pick: Pick, now: float) -> bool:
        """A request for `pick` begins; True if the shard was already in flight (an end-game duplicate)."""
        sha, key = pick.shard.sha256, pick.source.key
        duplicate = self.pending.pop(sha, None) is None
        self.picks += 1
        self.started.setdefault(sha, now)
        self.in_flight.setdefault(sha, set()).add(key)
        self.load[key] = self.load.get(key, 0) + 1
        self.peer_in_flight += not pick.source.seed and self.load[key] == 1
        return duplicate

    def delivered(self, sha: str) -> bool:
        """The shard is stored; True unless another copy was stored first."""
        if sha not in self.remaining:
            return False
        self.remaining.discard(sha)
        return True

    def busy(self, key: str, until: float) -> None:
        """The source refused a request for now and is not to be asked again before `until`."""
        self.busy_until[key] = until

    def failed_by(self, sha: str, key: str, error: str, not_held: bool = False) -> None:
        """The source failed the shard (`not_held`: it said it does not have it); it is not asked for it again."""
        self.failed.setdefault(sha, set()).add(key)
        if not_held:
            self.not_held.setdefault(sha, set()).add(key)
        self.errors.setdefault(sha, []).append(error)

    def end(self, pick: Pick, began: float, now: float, ok: bool, requeue: bool = True) -> None:
        """The request for `pick` that began at `began` is over (`ok`: its copy was stored, or a late copy).
        A shard left with no request in flight and not stored goes back to the head of the line (`requeue`)."""
        sha, key = pick.shard.sha256, pick.source.key
        self.load[key] -= 1
        self.peer_in_flight -= not pick.source.seed and self.load[key] == 0
        fetching = self.in_flight.get(sha, set())
        fetching.discard(key)
        if not fetching:
            self.in_flight.pop(sha, None)
            self.started.pop(sha, None)
        if ok:
            self.last_progress = now
            self.durations.append(now - began)
        elif requeue and sha in self.remaining and not fetching:
            self.pending = {sha: pick.shard, **self.pending}  # first in line again


# -- the decision --------------------------------------------------------------------------------------------


def choose(state: DownloadState, sources: Sequence[SourceView], now: float, policy: Policy,
           hints: Mapping[str, object] | None = None) -> Decision:
    """What to do next (see the module docstring). `hints`: seed key -> what `suggest` answered this round."""
    hints = hints or {}
    if not state.pending:
        return _duplicate(state, sources, now, policy) if policy.endgame else Wait("every missing shard is in flight")
    pending = state.pending
    peers = [s for s in sources if not s.seed]
    seeds = [s for s in sources if s.seed]
    rank = {sha: r for r, sha in enumerate(pending)}
    # Who holds which pending shard (sources that failed a shard do not count as holding it).
    held: dict[str, set[str]] = {}
    counts: dict[str, int] = dict.fromkeys(pending, 0)
    for p in peers:
        hs = held[p.key] = {sha for sha in p.held if sha in pending and p.key not in state.failed.get(sha, ())}
        for sha in hs:
            counts[sha] += 1
    per_peer: list[tuple[tuple[int, int], str, SourceView]] = []  # each free peer's rarest shard
    peer_room = state.peer_in_flight < policy.max_parallel_peers
    for p in peers:
        if held[p.key] and _free(state, p, now, policy) and (peer_room or state.load.get(p.key, 0)):
            sha = min(held[p.key], key=lambda h: (counts[h], rank[h]))
            per_peer.append(((counts[sha], rank[sha]), sha, p))
    if per_peer:
        # Rarest first: the rarest shard, from its least-used free holder. Spread: the least-used free peer,
        # and its rarest shard.
        spread = policy.spread_holders
        _, sha, peer = min(per_peer, key=lambda b: (
            () if spread else b[0], state.load.get(b[2].key, 0), _tiebreak(state, b[2].key)))
        return Pick(pending[sha], peer)
    # Seeds: each shard goes to the first seed (in the order given) that has not failed it; of each seed's
    # shards, only the rarest are offered to it.
    queues: dict[str, tuple[SourceView, list[ShardRef], int]] = {}
    for sha in sorted(pending, key=lambda h: (counts[h], rank[h])):
        failed = state.failed.get(sha, ())
        first = next((s for s in seeds if s.key not in failed and sha in s.held), None)
        if first is None:
            if seeds and counts[sha] == 0:
                unavailable = bool(failed) and set(failed) <= state.not_held.get(sha, set())
                return Fail(f"no source had a good copy of shard {sha[:12]}: "
                            f"{'; '.join(state.errors.get(sha, []))}", sha, unavailable)
            continue
        seed, queue, rarest = queues.setdefault(first.key, (first, [], counts[sha]))
        if counts[sha] == rarest:
            queue.append(pending[sha])
    for seed, queue, _ in queues.values():
        if not _free(state, seed, now, policy):
            continue
        if seed.key not in hints:
            return Consult(seed, tuple(queue))
        hint = hints[seed.key]
        if hint is WAIT:
            continue
        return Pick(hint if isinstance(hint, ShardRef) and hint in queue else queue[0], seed)
    if not seeds and not state.in_flight and now - state.last_progress > policy.stall_timeout_s:
        return Fail(f"no source can provide the {len(pending)} missing shards")
    return Wait("no free source holds a pending shard")


def overdue(state: DownloadState, now: float, policy: Policy) -> list[str]:
    """Shards in flight from exactly one source for long enough that the end game may ask a second one."""
    patience = policy.endgame_patience
    if state.durations:
        after = patience * statistics.median(state.durations)
    else:
        after = ENDGAME_FIRST_S if patience else 0.0
    return [sha for sha, keys in state.in_flight.items()
            if len(keys) == 1 and sha in state.remaining and now - state.started[sha] >= after]


def needs_sources(state: DownloadState, now: float, policy: Policy) -> bool:
    """Whether `choose` would look at the sources now (the executor need not list them otherwise)."""
    return bool(state.pending) or (policy.endgame and bool(overdue(state, now, policy)))


def _duplicate(state: DownloadState, sources: Sequence[SourceView], now: float, policy: Policy) -> Decision:
    """End game: an overdue shard and a second free source holding it (peers first, the least loaded). Of the
    seeds only the first is asked, and only for a shard in flight from a peer: seeds share one link, so a
    second seed is a fallback, never extra capacity."""
    single = overdue(state, now, policy)
    if not single:
        return Wait("every missing shard is in flight")
    seeds = [s for s in sources if s.seed]
    seed_keys = {s.key for s in seeds}
    peer_room = state.peer_in_flight < policy.max_parallel_peers
    for sha in single:
        busy, failed = state.in_flight[sha], state.failed.get(sha, ())
        seed_ok = not (busy & seed_keys)
        free = [s for s in sources if s.key not in busy and s.key not in failed and _free(state, s, now, policy)
                and ((s.key == seeds[0].key and seed_ok) if s.seed else peer_room or state.load.get(s.key, 0))
                and sha in s.held]
        if free:
            best = min(free, key=lambda s: (s.seed, state.load.get(s.key, 0), _tiebreak(state, s.key)))
            return Pick(state.refs[sha], best, duplicate=True)
    return Wait("no second source is free for an overdue shard")


def _free(state: DownloadState, s: SourceView, now: float, policy: Policy) -> bool:
    limit = policy.origin_parallel if s.seed else policy.requests_per_peer
    return state.load.get(s.key, 0) < limit and state.busy_until.get(s.key, 0.0) <= now


def _tiebreak(state: DownloadState, key: str) -> int:
    return zlib.crc32(f"{state.salt}:{state.picks}:{key}".encode())
