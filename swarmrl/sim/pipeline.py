"""Behind the coordinator, in virtual time: the verifiers with the quarantine rule, and the trainer with the feed.

Verifiers (`verifier.service`'s loop): each claims up to `batch` pending groups, oldest first; a group whose
identity is over its verifier-time budget is deferred before anything is drawn for it (`verifier.budget`'s
`IdentityBudget`, on the simulation's clock) and is claimable again after the claim's time to live; for the
others the real `CheckPolicy.decide` draws warm-up, sampled, overflow or hold (`protocol.quarantine.decide`),
counting the holds decided earlier in the same batch. A full check costs the group's tokens at the verifier's
speed, a hold the cheap checks. The verdicts are applied together when the batch ends, as the coordinator
applies them (`coordinator.verification`): a failed full check bans the identity and drops every group of it
not yet released; a passed one releases what `protocol.quarantine.on_pass` says, then the group itself.

The trainer (`trainer.collect`): reads accepted groups in feed order until it has `batch_groups` fresh ones
(`protocol.validation.is_fresh` against its own version; stale ones are consumed and dropped), trains, publishes
the next version (at the origin after its upload). What backpressure counts follows the coordinator's
`leasequeries.buffered_groups`: groups waiting for a verdict, and accepted groups until the trainer has read
them; held groups not (docs/liveness.md).
"""

from __future__ import annotations

from collections import Counter, deque
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from swarmrl.protocol import validation
from swarmrl.protocol.quarantine import Check, Held, on_pass

if TYPE_CHECKING:
    from swarmrl.sim.desk import Identity


is_fresh = lru_cache(maxsize=1 << 16)(validation.is_fresh)
"""The staleness rule, remembered per (version, reference, k): the rule formats its reason on every call."""


class Group:
    __slots__ = ("gid", "ident", "version", "cheat", "dead")

    def __init__(self, gid: int, ident: Identity, version: int, cheat: bool):
        self.gid, self.ident, self.version, self.cheat, self.dead = gid, ident, version, cheat, False


class Verifiers:
    def __init__(self, world: Any):  # a sim.world.World (which imports this module)
        self.w = world
        self.pending: deque[Group] = deque()
        self.alive = 0
        """Pending groups not yet decided (held ones excluded): the backlog."""
        self.idle = list(range(world.sc.verifiers.count))
        self.busy_s = 0.0
        self.batches = 0
        self.checks: Counter[str] = Counter()
        self.stats = {"deferred": 0, "banned": 0, "dropped_at_ban": 0, "released": 0, "held_now": 0}

    def submitted(self, g: Group) -> None:
        self.pending.append(g)
        self.alive += 1
        if self.idle:
            self.w.clock.after(0.0, self.claim, self.idle.pop())

    def claim(self, vi: int) -> None:
        w, cfg = self.w, self.w.sc.verifiers
        batch: list[tuple[Group, Check]] = []
        held_here: Counter[str] = Counter()
        cost = 0.0
        tokens = w.sc.run.group_size * w.tokens_per_rollout
        while self.pending and len(batch) < cfg.batch:
            g = self.pending.popleft()
            if g.dead:
                continue
            ident = g.ident
            if w.budget is not None and w.budget.over(ident.id):
                self.stats["deferred"] += 1  # before the draw (verifier.budget)
                w.clock.after(cfg.claim_ttl_s, self.requeue, g)
                continue
            check = w.policy.decide(ident.checks_passed, len(ident.held) + held_here[ident.id])
            if check is Check.HOLD:
                held_here[ident.id] += 1
                cost += cfg.cheap_check_s
            else:
                cost += tokens / cfg.tokens_per_s
            batch.append((g, check))
        if not batch:
            self.idle.append(vi)
            return
        self.busy_s += cost
        self.batches += 1
        w.clock.after(cost, self.verdicts, vi, batch, tokens / cfg.tokens_per_s)

    def requeue(self, g: Group) -> None:
        if not g.dead:
            self.pending.append(g)
            if self.idle:
                self.w.clock.after(0.0, self.claim, self.idle.pop())

    def verdicts(self, vi: int, batch: list[tuple[Group, Check]], full_s: float) -> None:
        w = self.w
        m = w.sc.run.release_passes
        for g, check in batch:
            if g.dead:
                continue
            ident = g.ident
            self.checks[check.value] += 1
            self.alive -= 1
            if not check.full:
                ident.held.append(Held(g.gid))
                self.stats["held_now"] += 1
                w.desk.buffer(g.version, -1)  # a held group no longer holds the buffer (docs/liveness.md)
                continue
            if w.budget is not None:
                w.budget.charge(ident.id, full_s)
            if g.cheat:
                self.ban(ident)
                continue
            ident.checks_passed += 1
            out = on_pass(ident.held, g.gid, check.vouches, m)
            for gid in out.released:
                self.stats["released"] += 1
                self.stats["held_now"] -= 1
                released = ident.pending[gid]
                w.desk.buffer(released.version, 1)  # accepted, counted again until the trainer reads it
                w.accept(released)
            ident.held = list(out.still_held)
            w.accept(g)
        w.room()
        self.claim(vi)

    def ban(self, ident: Identity) -> None:
        """A failed full check: the identity is banned and every group of it not yet released is dropped."""
        w = self.w
        ident.banned = True
        self.stats["banned"] += 1
        held_ids = {h.group_id for h in ident.held}
        for g in list(ident.pending.values()):
            g.dead = True
            self.stats["dropped_at_ban"] += 1
            if g.gid in held_ids:
                self.stats["held_now"] -= 1
            else:
                self.alive -= 1
                w.desk.buffer(g.version, -1)
        self.alive += 1  # the failed group itself was counted out by its verdict already
        ident.pending.clear()
        ident.held = []
        ident.cheats.clear()
        for n in w.nodes_of.pop(ident.id, []):
            w.nodes.new_identity(n)
            w.nodes_of.setdefault(n.ident.id, []).append(n)


class Trainer:
    def __init__(self, world: Any):  # a sim.world.World (which imports this module)
        self.w = world
        self.feed: deque[Group] = deque()
        self.feed_versions: Counter[int] = Counter()
        self.version = 0
        self.steps = 0
        self.training = False
        self.staleness: Counter[int] = Counter()
        self.trained = 0
        self.poisoned = 0
        self.stale_dropped = 0
        self.busy_s = 0.0
        self.step_times: list[float] = []

    def accepted(self, g: Group) -> None:
        self.feed.append(g)
        self.feed_versions[g.version] += 1
        if not self.training:
            self.collect()

    def collect(self) -> None:
        """Take `batch_groups` fresh groups off the feed, or wait for more (the consumed stale ones stay
        consumed)."""
        w = self.w
        want, k = w.sc.trainer.batch_groups, w.sc.run.max_staleness
        fresh = sum(n for v, n in self.feed_versions.items() if is_fresh(v, self.version, k)) \
            if len(self.feed) >= want else 0
        if fresh < want:
            return
        batch: list[Group] = []
        consumed: list[Group] = []
        while len(batch) < want:
            g = self.feed.popleft()
            self.feed_versions[g.version] -= 1
            if not self.feed_versions[g.version]:
                del self.feed_versions[g.version]
            consumed.append(g)
            if is_fresh(g.version, self.version, k):
                batch.append(g)
            else:
                self.stale_dropped += 1
        for g in consumed:  # handed to the trainer: out of what backpressure counts (the feed's read cursor)
            w.desk.buffer(g.version, -1)
        w.room()
        tr = w.sc.trainer
        step_s = tr.step_overhead_s + want * w.sc.run.group_size * w.tokens_per_rollout / tr.tokens_per_s
        self.training = True
        self.busy_s += step_s
        w.clock.after(step_s, self.stepped, batch)

    def stepped(self, batch: list[Group]) -> None:
        w = self.w
        for g in batch:
            self.staleness[self.version - g.version] += 1
            self.trained += 1
            self.poisoned += g.cheat
        self.version += 1
        self.steps += 1
        self.step_times.append(w.clock.now)
        w.clock.after(w.upload_bytes * 8 / (w.sc.trainer.upload_mbit * 1e6), w.publish)
        self.training = False
        self.collect()
