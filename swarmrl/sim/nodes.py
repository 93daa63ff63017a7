"""The nodes in virtual time: they come and go, lease, wait for weights, generate and submit, as `node.agent` does.

A node online asks for a lease (the desk decides: `sim.desk`); refused for now, it waits until there is room
again (what its polls would find; the wake-up comes after a uniform share of its poll interval). With a lease it
waits for weights fresh enough for it (`protocol.validation.is_fresh`, as `NodeAgent.wait_for_weights`), giving
up at the lease's expiry or when only newer weights are coming; then it generates the lease's groups and
submits them, asking for its next lease in the same request. Attackers decide per group, with their
strategy, whether it cheats, seeing everything about their identity; a banned one makes a new identity.
Time is counted per node as generating (and submitting), waiting for weights, or idle (no lease).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from swarmrl.sim.desk import REFUSED_ALLOWANCE, WAIT_UNPROVEN, Identity, Lease
from swarmrl.sim.pipeline import is_fresh
from swarmrl.sim.weights import Fetcher
from swarmrl.testing.byzantine.quarantine_sim import View

GEN, WAIT, IDLE, OFF = "generating", "waiting for weights", "idle", "offline"


class Node:
    __slots__ = ("i", "speed", "region", "adversary", "ident", "fetch", "state", "since", "lease", "epoch",
                 "strategy", "identities", "gen_version", "queued")

    def __init__(self, i: int, speed: float, region: int, adversary: bool, fetch: Fetcher):
        self.i, self.speed, self.region, self.adversary, self.fetch = i, speed, region, adversary, fetch
        self.ident = Identity(f"n{i}", f"src{i}", adversary)
        self.identities = 1
        self.state, self.since, self.lease, self.epoch = OFF, 0.0, None, 0
        self.strategy = None
        self.gen_version = -1
        self.queued = False


class Nodes:
    """Every node's life; `world` holds the coordinator's, verifiers' and trainer's side."""

    def __init__(self, world: Any, rng: random.Random):  # a sim.world.World (which imports this module)
        self.w, self.rng = world, rng
        self.time = {GEN: 0.0, WAIT: 0.0, IDLE: 0.0}
        self.count = {GEN: 0, WAIT: 0, IDLE: 0, OFF: 0}
        self.waiting: deque[Node] = deque()
        self.waiting_unproven: deque[Node] = deque()
        self.for_weights: set[Node] = set()
        self.stats = {"leases": 0, "expired_waiting_for_weights": 0, "gave_up_newer_weights": 0,
                      "stale_submissions": 0, "expired_submissions": 0, "identities": 0, "groups_submitted": 0,
                      "cheats_submitted": 0}

    # -- time accounting --------------------------------------------------------------------------------

    def set_state(self, n: Node, state: str) -> None:
        now = self.w.clock.now
        if n.state != OFF:
            self.time[n.state] += now - n.since
        self.count[n.state] -= 1
        self.count[state] += 1
        n.state, n.since = state, now

    def flush(self) -> None:
        now = self.w.clock.now
        for n in self.w.all_nodes:
            if n.state != OFF:
                self.time[n.state] += now - n.since
                n.since = now

    # -- sessions ---------------------------------------------------------------------------------------

    def go_online(self, n: Node) -> None:
        sc = self.w.sc.nodes
        n.epoch += 1
        self.set_state(n, IDLE)
        self.w.weights.go_online(n.fetch, self.w.clock.now)
        if sc.offline_hours > 0:
            self.w.clock.after(self.rng.expovariate(1 / (sc.session_hours * 3600)), self.go_offline, n)
        self.ask(n)

    def go_offline(self, n: Node) -> None:
        w = self.w
        n.epoch += 1  # every event of this stay is void
        self.w.weights.go_offline(n.fetch, w.clock.now)
        self.for_weights.discard(n)
        if n.lease is not None and n.lease.open:
            w.clock.at(n.lease.expires_at, self.expire, n.lease)  # the coordinator's sweep
        n.lease = None
        self.set_state(n, OFF)
        w.clock.after(self.rng.expovariate(1 / (w.sc.nodes.offline_hours * 3600)), self.go_online, n)

    def expire(self, lease: Lease) -> None:
        """A lease that reached its expiry unsubmitted: settled, every prompt abandoned (`sweep_expired`)."""
        if self.w.desk.close(lease, lease.n):
            self.w.room()

    # -- work -------------------------------------------------------------------------------------------

    def ask(self, n: Node) -> None:
        """Ask for a lease now."""
        w = self.w
        if n.state == OFF:
            return
        n.queued = False
        if w.weights.advance(n.fetch, w.clock.now) < 0:
            # No weights yet: the node's engine starts on its first checkpoint before it asks for work.
            if n.state != WAIT:
                self.set_state(n, WAIT)
            w.clock.at(n.fetch.end, self.ask_if, n, n.epoch)
            return
        got = w.desk.grant(n.ident, w.sc.nodes.max_prompts, w.versions.current, w.clock.now)
        w.coordinator.request()
        if isinstance(got, Lease):
            self.stats["leases"] += 1
            n.lease = got
            self.start(n)
            return
        self.set_state(n, IDLE)
        if got == REFUSED_ALLOWANCE:
            w.clock.after(w.sc.nodes.poll_interval_s, self.ask_if, n, n.epoch)
        else:
            n.queued = True
            (self.waiting_unproven if got == WAIT_UNPROVEN else self.waiting).append(n)

    def ask_if(self, n: Node, epoch: int) -> None:
        if n.epoch == epoch:
            self.ask(n)

    def wake(self, room_prompts: int, unproven_room: int) -> None:
        """Room for about `room_prompts` more prompts in flight: that many waiting nodes ask again, each after
        its own share of a poll interval."""
        poll = self.w.sc.nodes.poll_interval_s
        for queue, room in ((self.waiting, room_prompts), (self.waiting_unproven, min(room_prompts, unproven_room))):
            wanted = max(0, -(-room // self.w.sc.nodes.max_prompts))
            while wanted and queue:
                n = queue.popleft()
                if n.state == OFF or not n.queued:
                    continue
                n.queued = False
                wanted -= 1
                self.w.clock.after(self.rng.random() * poll, self.ask_if, n, n.epoch)

    def start(self, n: Node) -> None:
        """With a lease: generate when the weights held are fresh for it, else wait for them."""
        w, lease = self.w, n.lease
        assert lease is not None
        held = w.weights.advance(n.fetch, w.clock.now)
        if held > lease.version:
            # Only newer weights than the lease's: its groups would be refused; the submission's refusal settles
            # the lease without counting it against the node (`Leases._settle_stale`).
            self.stats["gave_up_newer_weights"] += 1
            w.desk.close(lease, lease.n, penalise=False)
            n.lease = None
            w.room()
            self.ask(n)
        elif is_fresh(held, lease.version, w.sc.run.max_staleness):
            self.generate(n, held)
        else:
            if n.state != WAIT:
                self.set_state(n, WAIT)
            self.for_weights.add(n)
            if w.clock.now >= lease.expires_at:
                self.stats["expired_waiting_for_weights"] += 1
                self.for_weights.discard(n)
                n.lease = None
                self.expire(lease)
                self.ask(n)
                return
            w.clock.at(min(n.fetch.end, lease.expires_at), self.recheck, n, n.epoch)

    def recheck(self, n: Node, epoch: int) -> None:
        if n.epoch == epoch and n.state == WAIT and n.lease is not None:
            self.start(n)

    def published(self) -> None:
        """A new version is at the origin: nodes waiting for weights look again when their fetch of it ends."""
        w = self.w
        for n in list(self.for_weights):
            w.weights.advance(n.fetch, w.clock.now)
            if n.lease is not None:
                w.clock.at(min(n.fetch.end, n.lease.expires_at), self.recheck, n, n.epoch)

    def generate(self, n: Node, held: int) -> None:
        w, lease = self.w, n.lease
        assert lease is not None
        self.for_weights.discard(n)
        self.set_state(n, GEN)
        n.gen_version = held
        tokens = lease.n * w.sc.run.group_size * w.tokens_per_rollout
        w.clock.after(tokens / n.speed, self.submit, n, n.epoch)

    def submit(self, n: Node, epoch: int) -> None:
        if n.epoch != epoch:
            return
        self.w.clock.after(self.w.coordinator.request(), self.arrive, n, epoch)

    def arrive(self, n: Node, epoch: int) -> None:
        """The submission at the coordinator (`Leases._take`); then the next lease, in the same answer."""
        w, lease = self.w, n.lease
        if n.epoch != epoch or lease is None:
            return
        n.lease = None
        now = w.clock.now
        if not lease.open or lease.ident.banned:
            w.desk.close(lease, lease.n, penalise=False)
        elif lease.expires_at < now:
            self.stats["expired_submissions"] += 1  # 410; the sweep settles it, every prompt abandoned
            self.expire(lease)
        elif not is_fresh(n.gen_version, w.versions.current, w.sc.run.max_staleness):
            self.stats["stale_submissions"] += 1  # StaleSubmission: settled without counting it against the node
            w.desk.close(lease, lease.n, penalise=False)
        else:
            self.deliver(n, lease)
            w.desk.close(lease, 0)
        w.room()
        self.ask(n)

    def deliver(self, n: Node, lease: Lease) -> None:
        w, ident = self.w, lease.ident
        cheats = 0
        for _ in range(lease.n):
            cheat = False
            if n.adversary:
                view = View(w.rules, ident.checks_passed, ident.held, ident.cheats)
                cheat = bool(n.strategy(view, self.rng))
            g = w.new_group(ident, n.gen_version, cheat)
            if cheat:
                ident.cheats.add(g.gid)
                cheats += 1
        self.stats["groups_submitted"] += lease.n
        self.stats["cheats_submitted"] += cheats

    def new_identity(self, n: Node) -> None:
        """An attacker's identity was banned: it registers a new key (free)."""
        n.identities += 1
        self.stats["identities"] += 1
        n.ident = Identity(f"n{n.i}.{n.identities}", f"src{n.i}", True, registered_at=self.w.clock.now)
        n.strategy = self.w.strategy()
