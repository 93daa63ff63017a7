"""One simulated pool: the scenario's nodes, the coordinator, the verifiers and the trainer, on one virtual clock.

`World(scenario, rates).run()` returns every figure of the run (`sim.report` draws and writes them). The
coordinator is a queue of requests at `cpu_per_request_ms` each on `cores`, with the heartbeats of the nodes
online and the polls of the nodes refused work counted as load without being simulated one by one (a 10,000-node
day has 29 million heartbeats; they cost the coordinator time, nothing else).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from swarmrl.coordinator.admission import AdmissionConfig
from swarmrl.protocol.quarantine import Rules, poisoned_share_bound
from swarmrl.sim import attackers
from swarmrl.sim.clock import Clock
from swarmrl.sim.desk import Desk, Identity
from swarmrl.sim.nodes import GEN, IDLE, OFF, WAIT, Node, Nodes
from swarmrl.sim.pipeline import Group, Trainer, Verifiers
from swarmrl.sim.scenario import Scenario
from swarmrl.sim.weights import Fetcher, Versions, Weights
from swarmrl.verifier.budget import IdentityBudget
from swarmrl.verifier.policy import CheckPolicy

REACH_NODES = 300  # nodes whose every fetch is recorded, for the time a version takes to reach them


class RequestQueue:
    """A coordinator's cores as one fluid queue: a request waits for those before it, each costing `cpu_s` of
    `cores`, in the share of the cores that requests not simulated one by one leave free."""

    def __init__(self, cores: float, cpu_s: float):
        self.cores, self.cpu_s = cores, cpu_s
        self.busy_until = 0.0
        self.requests = 0

    def request(self, now: float, side_per_s: float) -> float:
        """One request at `now`, with `side_per_s` other requests a second counted as load; seconds until it is
        answered."""
        self.requests += 1
        free = max(0.05, 1 - side_per_s * self.cpu_s / self.cores)
        self.busy_until = max(now, self.busy_until) + self.cpu_s / self.cores / free
        return self.busy_until - now + self.cpu_s


class Coordinator:
    """The pool's coordinator: its `RequestQueue`, with the heartbeats of the nodes online and the polls of the
    nodes refused work as the load beside the simulated requests."""

    def __init__(self, world: World):
        self.w, self.cfg = world, world.sc.coordinator
        self.queue = RequestQueue(self.cfg.cores, self.cfg.cpu_per_request_ms / 1000)
        self.background = 0.0
        """Requests counted but not simulated (heartbeats, polls of nodes refused work, verifiers, trainer)."""

    @property
    def requests(self) -> int:
        return self.queue.requests

    def request(self) -> float:
        """One request now; seconds until it is answered."""
        w, cfg = self.w, self.cfg
        count = w.nodes.count
        side = (count[GEN] + count[WAIT] + count[IDLE]) / cfg.heartbeat_s + count[IDLE] / w.sc.nodes.poll_interval_s
        return self.queue.request(w.clock.now, side)


class World:
    def __init__(self, sc: Scenario, rates: list[list[float]]):
        self.sc = sc
        self.rng = random.Random(sc.sim.seed)
        self.clock = Clock()
        r = sc.run
        self.rules = Rules(r.warmup_checks, r.sample_rate, r.release_passes, r.max_held)
        self.policy = CheckPolicy(self.rules, seed=sc.sim.seed)
        v = sc.verifiers
        self.budget = (IdentityBudget(v.identity_budget_s, v.identity_budget_window_s, clock=self.clock)
                       if v.identity_budget_s is not None else None)
        self.desk = Desk(AdmissionConfig(), sc.max_buffered, r.max_staleness, r.lease_ttl_s)
        self.versions = Versions()
        self.weights = Weights(sc.model, self.versions)
        self.model_bytes = sc.model.full_bytes
        self.upload_bytes = self.model_bytes * (sc.model.delta_ratio if sc.model.broadcast == "delta" else 1.0)
        """What the trainer uploads per version (the publisher sends deltas when the run broadcasts them)."""
        self.tokens_per_rollout = r.max_tokens * r.mean_token_share
        self.coordinator = Coordinator(self)
        self.nodes = Nodes(self, self.rng)
        self.verifiers = Verifiers(self)
        self.trainer = Trainer(self)
        self.strategy: Callable = attackers.factory(sc.adversaries.strategy, self.rules)
        self.gid = 0
        self.nodes_of: dict[str, list[Node]] = {}
        self.all_nodes = self._make_nodes(rates)
        self.series: dict[str, list[float]] = {k: [] for k in (
            "t_h", "steps", "backlog", "held", "poisoned_share", "online", "generating", "waiting_for_weights",
            "idle", "version", "coordinator_util", "verifier_util")}
        self._last = {"requests": 0, "verifier_busy": 0.0, "t": 0.0, "batches": 0, "steps": 0}

    def _make_nodes(self, rates: list[list[float]]) -> list[Node]:
        sc, rng = self.sc, self.rng
        classes, regions = sc.nodes.speed_classes, sc.nodes.regions
        out = []
        for i in range(sc.nodes.count):
            speed = rng.choices(classes, weights=[c.share for c in classes])[0].tokens_per_s
            ri = rng.choices(range(len(regions)), weights=[x.share for x in regions])[0]
            fetch = Fetcher(rng.choice(rates[ri]), regions[ri].latency_ms / 1000)
            if i < REACH_NODES:
                fetch.reach = []
            n = Node(i, speed, ri, rng.random() < sc.adversaries.share, fetch)
            if n.adversary:
                n.strategy = self.strategy()
            self.nodes_of.setdefault(n.ident.id, []).append(n)
            out.append(n)
        self.nodes.count[OFF] = len(out)
        return out

    # -- what the parts call ------------------------------------------------------------------------------

    def new_group(self, ident: Identity, version: int, cheat: bool) -> Group:
        self.gid += 1
        g = Group(self.gid, ident, version, cheat)
        ident.pending[g.gid] = g
        self.desk.buffer(version, 1)
        self.verifiers.submitted(g)
        return g

    def accept(self, g: Group) -> None:
        g.ident.pending.pop(g.gid, None)
        g.ident.groups_accepted += 1
        if g.cheat:
            g.ident.cheats.discard(g.gid)
        self.trainer.accepted(g)

    def room(self) -> None:
        room, unproven = self.desk.room(self.versions.current)
        if room > 0:
            self.nodes.wake(room, unproven)

    def publish(self) -> None:
        self.versions.publish(self.clock.now)
        self.nodes.published()
        self.room()

    # -- the run ------------------------------------------------------------------------------------------

    def sample(self, now: float) -> None:
        tr, n, ver = self.trainer, self.nodes, self.verifiers
        for node in self.all_nodes[:REACH_NODES]:
            self.weights.advance(node.fetch, now)
        dt = now - self._last["t"]
        cfg = self.sc.coordinator
        online = n.count[GEN] + n.count[WAIT] + n.count[IDLE]
        # Heartbeats, polls of nodes refused work, a claim and a verdict post per verifier batch, a read and an
        # acknowledgement per trainer step.
        side = (online / cfg.heartbeat_s + n.count[IDLE] / self.sc.nodes.poll_interval_s) * dt \
            + 2 * (ver.batches - self._last["batches"]) + 2 * (tr.steps - self._last["steps"])
        reqs = self.coordinator.requests - self._last["requests"] + side
        self.coordinator.background += side
        s = self.series
        s["t_h"].append(now / 3600)
        s["steps"].append(tr.steps)
        s["backlog"].append(ver.alive)
        s["held"].append(ver.stats["held_now"])
        s["poisoned_share"].append(tr.poisoned / tr.trained if tr.trained else 0.0)
        s["online"].append(online)
        s["generating"].append(n.count[GEN])
        s["waiting_for_weights"].append(n.count[WAIT])
        s["idle"].append(n.count[IDLE])
        s["version"].append(self.versions.current)
        s["coordinator_util"].append(reqs * cfg.cpu_per_request_ms / 1000 / (cfg.cores * dt) if dt else 0.0)
        s["verifier_util"].append((ver.busy_s - self._last["verifier_busy"]) / (self.sc.verifiers.count * dt)
                                  if dt else 0.0)
        self._last = {"requests": self.coordinator.requests, "verifier_busy": ver.busy_s, "t": now,
                      "batches": ver.batches, "steps": tr.steps}

    def run(self, on_progress: Callable[[float], None] | None = None) -> None:
        """Run the scenario's hours (`sim.figures.figures` reads the outcome)."""
        sc, clock = self.sc, self.clock
        self.versions.publish(0.0)  # the initial checkpoint
        nc = sc.nodes
        p_online = 1.0 if nc.offline_hours == 0 else nc.session_hours / (nc.session_hours + nc.offline_hours)
        for n in self.all_nodes:
            if self.rng.random() < p_online:
                clock.at(0.0, self.nodes.go_online, n)
            else:
                clock.at(self.rng.expovariate(1 / (nc.offline_hours * 3600)), self.nodes.go_online, n)
        until = sc.sim.hours * 3600
        tick = until / sc.sim.samples

        def on_tick(now: float) -> None:
            self.sample(now)
            if on_progress is not None:
                on_progress(now)

        clock.run(until, on_tick, tick)
        self.nodes.flush()

    @property
    def share_bound(self) -> float:
        a = self.sc.adversaries.share
        return poisoned_share_bound(self.rules, a) if a > 0 else 0.0


def region_rates(sc: Scenario, sample: int | None = None) -> tuple[list[list[float]], dict]:
    """Each region's download rates (bytes/s), from one broadcast of the version size the scenario sends most
    (a delta, with delta broadcasts) to `sample` nodes drawn as the scenario's, driven by the real scheduler.
    Returns the rates and the broadcast's figures."""
    from swarmrl.sim import broadcast

    rng = random.Random(sc.sim.seed + 1)
    regions = sc.nodes.regions
    n = max(2, min(sample or sc.sim.broadcast_sample, sc.nodes.count))
    picked = rng.choices(range(len(regions)), weights=[r.share for r in regions], k=n)
    links = [broadcast.Link(regions[i].down_mbit * 1e6 / 8, regions[i].up_mbit * 1e6 / 8, regions[i].latency_ms / 1000)
             for i in picked]
    m = sc.model
    size = m.full_bytes * (m.delta_ratio if m.broadcast == "delta" else 1.0)
    # The origin's link, scaled to the sample's share of the pool, but never below one node's fastest download:
    # the seed sends every shard once before any twice (SeedLedger), and those first copies leave at its full rate
    # whatever the pool's size.
    full_origin = sc.coordinator.origin_up_mbit * 1e6 / 8
    origin = min(full_origin, max(full_origin * n / sc.nodes.count, max(lk.down_bps for lk in links)))
    out = broadcast.run(links, origin, size, sc.sim.broadcast_shards, sc.sim.broadcast_peers, seed=sc.sim.seed)
    rates: list[list[float]] = [[] for _ in regions]
    for i, done in zip(picked, out.done_s, strict=True):
        rates[i].append(size / max(done - 2 * regions[i].latency_ms / 1000, 1e-6))
    for i, r in enumerate(regions):
        if not rates[i]:  # a region too small to be drawn: its own link, alone
            rates[i].append(r.down_mbit * 1e6 / 8)
    done = sorted(out.done_s)
    info = {"nodes": n, "bytes": size, "shards": sc.sim.broadcast_shards, "median_s": done[len(done) // 2],
            "last_s": done[-1], "origin_share": out.origin_bytes / max(1.0, out.origin_bytes + out.peer_bytes),
            "ideal_s": size / min(lk.down_bps for lk in links)}
    return rates, info
