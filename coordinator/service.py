"""The coordinator's rules, independent of HTTP: who may do what, and what every request changes.

Every method either completes its whole effect or raises `Refused` having changed nothing (the store
work of one request runs in one transaction). The one deliberate exception: the nonce of a correctly
signed request is recorded before anything else, so that even a refused request cannot be replayed.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from swarmrl.coordinator.auth import Refused, check_signature, parse_envelope, typed_payload
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.store import Row, Store
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity, node_id_from_public_key
from swarmrl.protocol.manifest import CheckpointManifest, ManifestError, SignedManifest
from swarmrl.protocol.signing import SignedEnvelope
from swarmrl.protocol.tasks import load_task
from swarmrl.protocol.validation import group_problem, staleness_problem
from swarmrl.transfer.store import ShardStore

T = TypeVar("T", bound=BaseModel)

MAX_REASON_CHARS = 1000
STATUS_METRICS_ROWS = 1000
# A node's idle + busy seconds cannot grow faster than the wall time between its heartbeats; this much more is
# allowed for network delay and clock rate differences before its counters are scaled down.
COUNTER_SLACK_FRAC = 0.05
COUNTER_SLACK_S = 10.0
# Trainer metrics the coordinator sets itself (from the nodes' heartbeat counters) when it records a report.
NODE_IDLE_METRICS = ("node_idle_s", "node_idle_frac")


log = logging.getLogger("swarmrl.coordinator")


@dataclass(frozen=True)
class Signed:
    """An authenticated request: its envelope, typed payload and (for node endpoints) the node's row."""

    env: SignedEnvelope
    payload: Any
    node: Row | None = None

    @property
    def signer(self) -> str:
        return self.env.signer_id


class Coordinator:
    """One run's coordinator state and rules, over a `Store` and a `ShardStore` in `config.data_dir`."""

    def __init__(self, config: CoordinatorConfig, identity: Identity, clock: Callable[[], float] = time.time):
        self.config = config
        # Bootstrap multiaddrs of the checkpoint swarm's DHT, sent to nodes in RunInfo (the seed adds its own).
        self.dht_peers: list[str] = list(config.dht_peers)
        # Called with each newly published manifest (e.g. the DHT seed starts serving it).
        self.publish_hooks: list[Callable[[CheckpointManifest], None]] = []
        self.identity = identity
        self.clock = clock
        self.task = load_task(config.run.task)
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(config.data_dir / "coordinator.sqlite")
        self.shards = ShardStore(config.data_dir / "shards")
        self._operators = frozenset(k.lower() for k in config.operator_keys)
        self._publish_lock = threading.Lock()
        # Long polls (verifier `pending`, trainer `training_batch`) sleep on this until the store changes.
        self._changed = threading.Condition()
        self._generation = 0
        self._long_poll_slots = threading.BoundedSemaphore(config.max_long_polls) if config.max_long_polls else None
        self._last_prune = 0.0

    def close(self) -> None:
        self.store.close()

    # -- authentication -------------------------------------------------------------------------------

    def open(self, raw: bytes | str, kind: str, model: type[T], role: str | None = None) -> Signed:
        """Authenticate a signed request for an endpoint of `kind` whose payload is a `model`.

        `role` is "node" (a registered, unbanned node), "operator" (a key in operator_keys) or None.
        """
        now = self.clock()
        env = parse_envelope(raw)
        check_signature(env, kind, now, self.config.clock_skew_s)
        self._prune_nonces(now)
        if not self.store.record_nonce(env.signer_id, env.nonce, env.timestamp):
            raise Refused(409, "replayed request")
        payload = typed_payload(env, model)
        node = None
        if role == "node":
            node = self.require_node(env.signer_id)
        elif role == "operator":
            if env.public_key.lower() not in self._operators:
                raise Refused(403, "this key is not an operator key")
        return Signed(env, payload, node)

    def _prune_nonces(self, now: float) -> None:
        # A nonce only needs remembering while its timestamp is inside the window; 2x for margin.
        if now - self._last_prune > 10.0:
            self._last_prune = now
            self.store.prune_nonces(now - 2 * self.config.clock_skew_s)

    def require_node(self, node_id: str) -> Row:
        node = self.store.get_node(node_id)
        if node is None:
            raise Refused(403, "unknown node: register first")
        if node["banned"]:
            raise Refused(403, f"node is banned: {node['ban_reason']}")
        return node

    # -- public facts ---------------------------------------------------------------------------------

    def current_version(self) -> int:
        return self.store.get_int("current_version", -1)

    def run_info(self) -> m.RunInfo:
        return m.RunInfo(spec=self.config.run, coordinator_key=self.identity.public_key_hex,
                         current_version=self.current_version(), dht_peers=list(self.dht_peers))

    def manifest(self, version: int | None = None) -> SignedManifest | None:
        """The manifest of `version` (default: the current one), or None."""
        if version is None:
            newest = self.store.latest_manifests(1)
            return SignedManifest.model_validate(newest[0]) if newest else None
        data = self.store.get_manifest(version)
        return SignedManifest.model_validate(data) if data else None

    def status(self) -> m.RunStatus:
        counts = self.store.group_counts()
        held = self.store.held_count()
        nodes = [m.NodeStatus(node_id=n["id"], name=n["name"], engine=n["engine"], held_version=n["held_version"],
                              groups_accepted=n["groups_accepted"], groups_rejected=n["groups_rejected"],
                              banned=bool(n["banned"]), last_seen=n["last_seen"], checks_passed=n["checks_passed"],
                              reputation=n["reputation"], idle_s=n["idle_s"], busy_s=n["busy_s"])
                 for n in self.store.list_nodes()]
        metrics = [m.TrainerMetrics(step=r["step"], version=r["version"], metrics=r["data"])
                   for r in self.store.recent_metrics(STATUS_METRICS_ROWS)]
        return m.RunStatus(run=self.run_info(), nodes=nodes, groups_pending=counts["pending"] - held,
                           groups_accepted=counts["accepted"], groups_rejected=counts["rejected"], metrics=metrics,
                           groups_held=held)

    # -- registration ---------------------------------------------------------------------------------

    def challenge(self, req: m.ChallengeRequest) -> m.Challenge:
        """A fresh single-use challenge that only `req.public_key` can redeem, within challenge_ttl_s."""
        key = req.public_key.lower()
        try:
            node_id = node_id_from_public_key(key)
        except ValueError:
            raise Refused(422, "public_key is not a hex Ed25519 public key") from None
        node = self.store.get_node(node_id)
        if node is not None and node["banned"]:
            raise Refused(403, f"node is banned: {node['ban_reason']}")
        now = self.clock()
        ch = m.Challenge(challenge=secrets.token_hex(32), expires_at=now + self.config.challenge_ttl_s)
        if not self.store.add_challenge(ch.challenge, key, ch.expires_at, now, self.config.max_challenges):
            raise Refused(429, "too many outstanding challenges; retry shortly")
        return ch

    def register(self, req: Signed) -> m.Registered:
        """Upsert the signer as a node, redeeming a challenge issued to its key."""
        env, body = req.env, req.payload
        node = self.store.get_node(env.signer_id)
        if node is not None and node["banned"]:
            raise Refused(403, f"node is banned: {node['ban_reason']}")
        now = self.clock()
        with self.store.transaction():
            if not self.store.take_challenge(body.challenge, env.public_key.lower(), now):
                raise Refused(401, "unknown, expired or already used challenge for this key")
            self.store.upsert_node(env.signer_id, env.public_key.lower(), body.name, body.engine, now)
        return m.Registered(node_id=env.signer_id, run=self.run_info())

    def heartbeat(self, req: Signed) -> None:
        """Note the node alive, its held version, and its self-reported idle and busy counters.

        The counters are stored as reported and, as deltas, added to the node's coordinator-side totals that
        the per-step `node_idle_*` metrics are computed from: a counter below its previous value means the node
        restarted (its new values are the deltas); deltas that add up to more than the wall time since the
        node's previous heartbeat (plus slack) are scaled down to it, so a lying node skews only its own share.
        """
        hb: m.Heartbeat = req.payload
        now = self.clock()
        with self.store.transaction():
            node = self.store.get_node(req.signer)
            if node is None:  # cannot happen for an authenticated node (nodes are never deleted)
                raise Refused(403, "unknown node: register first")
            d_idle, d_busy = hb.idle_s - node["idle_s"], hb.busy_s - node["busy_s"]
            if d_idle < 0 or d_busy < 0:  # restarted: the counters began again from 0
                d_idle, d_busy = hb.idle_s, hb.busy_s
            since = node["counters_at"] if node["counters_at"] is not None else node["registered_at"]
            allowed = max(now - since, 0.0) * (1 + COUNTER_SLACK_FRAC) + COUNTER_SLACK_S
            if d_idle + d_busy > allowed:
                scale = allowed / (d_idle + d_busy)
                d_idle, d_busy = d_idle * scale, d_busy * scale
            self.store.set_node_counters(req.signer, hb.idle_s, hb.busy_s, d_idle, d_busy, now)
            self.store.touch_node(req.signer, now, hb.held_version)

    # -- leases and submissions -----------------------------------------------------------------------

    def lease(self, req: Signed) -> m.Lease | None:
        """A new lease of prompts for the signer, or None before the first manifest (no work yet)."""
        body: m.LeaseRequest = req.payload
        now = self.clock()
        version = self.current_version()
        cfg, run = self.config, self.config.run
        if version < 0:
            self.store.touch_node(req.signer, now, body.held_version)
            return None
        if cfg.max_buffered_groups is not None:
            # Backpressure: no point generating groups the trainer will drop as stale before it reaches them.
            cursor = self.store.get_int("trainer_cursor", 0)
            if self.store.buffered_work(version - run.max_staleness, cursor, now) >= cfg.max_buffered_groups:
                self.store.touch_node(req.signer, now, body.held_version)
                return None
        with self.store.transaction():
            if self.store.count_open_leases(req.signer, now) >= cfg.max_outstanding_leases:
                raise Refused(429, f"node already holds {cfg.max_outstanding_leases} open leases: submit or let "
                                   "them expire first")
            counter = self.store.next_int("lease_counter")
            # Deterministic prompts from (prompt_seed, counter): a run's prompt stream is reproducible.
            rng = random.Random(f"{cfg.prompt_seed}/{counter}")
            lease_id = secrets.token_hex(12)
            prompts = []
            for i in range(body.max_prompts):
                problem = self.task.sample(rng)
                seeds = [secrets.randbits(63) for _ in range(run.sampling.group_size)]
                prompts.append((f"{lease_id}.{i}", problem.prompt, problem.answer, seeds))
            expires_at = now + cfg.lease_ttl_s
            self.store.insert_lease(lease_id, req.signer, version, now, expires_at,
                                    run.sampling.model_dump(mode="json"), prompts)
            self.store.touch_node(req.signer, now, body.held_version)
        return m.Lease(lease_id=lease_id, policy_version=version, expires_at=expires_at, sampling=run.sampling,
                       prompts=[m.LeasedPrompt(prompt_id=p, text=t, seeds=s) for p, t, _, s in prompts])

    def submit(self, req: Signed) -> m.SubmitResult:
        """Take the submission's valid groups for verification; say why each other group was refused."""
        sub: m.RolloutSubmission = req.payload
        now = self.clock()
        ids = [g.prompt_id for g in sub.groups]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise Refused(422, f"prompt id {dup!r} appears twice in one submission")
        stale = staleness_problem(sub.policy_version, self.current_version(), self.config.run.max_staleness)
        lease = self.store.get_lease(sub.lease_id)
        if lease is not None and lease["node_id"] == req.signer and stale is not None:
            # None of its groups can be accepted any more: close the lease so it stops holding one of the node's
            # max_outstanding_leases slots (the refusal below still says why).
            self.store.close_lease(sub.lease_id)
        with self.store.transaction():
            lease = self.store.get_lease(sub.lease_id)
            if lease is None:
                raise Refused(404, "unknown lease")
            if lease["node_id"] != req.signer:
                raise Refused(403, "lease belongs to another node")
            if lease["expires_at"] < now:
                raise Refused(410, "lease expired")
            stale = staleness_problem(sub.policy_version, self.current_version(), self.config.run.max_staleness)
            if stale is not None:
                raise Refused(409, f"stale submission, against the current version: {stale}")
            prompts = self.store.lease_prompts(sub.lease_id)
            sampling = m.SamplingSpec.model_validate(lease["sampling"])
            accepted: list[str] = []
            rejected: dict[str, str] = {}
            for group in sub.groups:
                leased = prompts.get(group.prompt_id)
                if leased is None:
                    reason: str | None = "unknown prompt id for this lease"
                elif leased["submitted"]:
                    reason = "already submitted"
                else:
                    reason = group_problem(group, leased["seeds"], sampling)
                if reason is None and not self.store.mark_prompt_submitted(sub.lease_id, group.prompt_id):
                    reason = "already submitted"
                if reason is not None:
                    rejected[group.prompt_id] = reason
                    continue
                self.store.insert_group(req.signer, sub.lease_id, group.prompt_id, sub.policy_version,
                                        group.model_dump(mode="json"), now)
                accepted.append(group.prompt_id)
            self.store.close_lease_if_complete(sub.lease_id)
            self.store.touch_node(req.signer, now)
        if accepted:
            self._notify()
        return m.SubmitResult(accepted=accepted, rejected=rejected)

    # -- verifier -------------------------------------------------------------------------------------

    def _notify(self) -> None:
        """Wake the long polls: groups were submitted or decided."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def _long_poll(self, fetch: Callable[[], list[Row]], wait_s: float) -> list[Row]:
        """`fetch()` now; while it is empty, again after each change of the store, until `wait_s` has passed.

        The generation counter is read before each fetch, so a change between the fetch and the wait is
        never missed. Only operator roles (verifiers, the trainer) long-poll: each wait holds one of the
        server's worker threads, so nodes, which may be thousands, never do, and at most `max_long_polls`
        wait at once (the others are answered at once).
        """
        slots = self._long_poll_slots
        if wait_s <= 0 or slots is None or not slots.acquire(blocking=False):
            return fetch()
        try:
            deadline = time.monotonic() + wait_s
            while True:
                with self._changed:
                    seen = self._generation
                rows = fetch()
                remaining = deadline - time.monotonic()
                if rows or remaining <= 0:
                    return rows
                with self._changed:
                    self._changed.wait_for(lambda seen=seen: self._generation != seen, timeout=remaining)
        finally:
            slots.release()

    def pending(self, req: Signed) -> list[m.PendingGroup]:
        """Claim up to `limit` unclaimed pending groups for the signer for claim_ttl_s (waiting up to `wait_s`
        for one when there is none)."""

        def claim() -> list[Row]:
            now = self.clock()
            return self.store.claim_pending(req.signer, req.payload.limit, now, now + self.config.claim_ttl_s)

        rows = self._long_poll(claim, req.payload.wait_s)
        return [m.PendingGroup(group_id=r["id"], node_id=r["node_id"], prompt_text=r["prompt_text"],
                               answer=r["answer"], lease_version=r["lease_version"],
                               sampling=m.SamplingSpec.model_validate(r["sampling"]), seeds=r["seeds"],
                               policy_version=r["policy_version"], group=m.RolloutGroup.model_validate(r["payload"]),
                               node_checks_passed=r["node_checks_passed"])
                for r in rows]

    def verdicts(self, req: Signed) -> None:
        """Apply verdicts to pending groups; verdicts on groups already decided (held included) or unknown are
        ignored. Quarantine: an accepted verdict with `checked=False` holds the group; a checked acceptance
        releases the node's held groups submitted before it (a later check vouches for them); a ban rejects
        the node's held and pending groups alike."""
        batch: m.VerdictBatch = req.payload
        now = self.clock()
        with self.store.transaction():
            # Validate the whole batch first: a refused batch must change nothing.
            for v in batch.verdicts:
                g = self.store.get_group(v.group_id)
                if v.accepted and g is not None and g["status"] == "pending" and not g["held"]:
                    n = len(g["payload"]["rollouts"])
                    if len(v.rewards) != n:
                        raise Refused(422, f"group {v.group_id}: {len(v.rewards)} rewards for {n} rollouts")
                    if not all(math.isfinite(r) for r in v.rewards):
                        raise Refused(422, f"group {v.group_id}: rewards must be finite")
            for v in batch.verdicts:
                g = self.store.get_group(v.group_id)  # re-read: an earlier verdict (a ban) may have decided it
                if g is None or g["status"] != "pending" or g["held"]:
                    continue
                node_id = g["node_id"]
                if v.accepted and not v.checked:
                    self.store.hold_group(v.group_id, list(v.rewards), now)
                    continue
                if v.accepted:
                    # Held groups first: the trainer's cursor then follows submission order.
                    released = self.store.release_held(node_id, v.group_id, now)
                    self.store.accept_group(v.group_id, list(v.rewards), now)
                    self.store.count_node_check(node_id)
                    self.store.count_node_verdict(node_id, accepted=1 + len(released))
                    continue
                reason = (v.reason or "rejected by the verifier")[:MAX_REASON_CHARS]
                self.store.reject_group(v.group_id, reason, now)
                self.store.count_node_verdict(node_id, rejected=1)
                if v.ban:
                    self.store.ban_node(node_id, reason)
                    dropped = self.store.reject_pending_of_node(node_id, "node banned", now)
                    self.store.count_node_verdict(node_id, rejected=dropped)
        self._notify()

    # -- trainer --------------------------------------------------------------------------------------

    def training_batch(self, req: Signed) -> m.TrainingBatch:
        """Accepted groups after the trainer's cursor, in cursor order; group_id is the cursor value. With
        `wait_s`, waits up to that long for one when there is none yet."""
        body: m.BatchRequest = req.payload
        if body.after_id > self.store.get_int("trainer_cursor", 0):
            self.store.set_int("trainer_cursor", body.after_id)
        rows = self._long_poll(lambda: self.store.accepted_after(body.after_id, body.limit), body.wait_s)
        groups = [m.TrainingGroup(group_id=r["accepted_seq"], policy_version=r["policy_version"],
                                  group=m.RolloutGroup.model_validate(r["payload"]), rewards=r["rewards"])
                  for r in rows]
        return m.TrainingBatch(current_version=self.current_version(), groups=groups)

    def check_shard_upload(self, sha256: str, header: str | None) -> m.ShardUpload:
        """Authenticate a shard upload from its envelope header, before its body is read."""
        if not _is_sha256(sha256):
            raise Refused(400, "not a sha256")
        if header is None:
            raise Refused(401, "missing x-swarmrl-envelope header")
        upload: m.ShardUpload = self.open(header, m.KIND_TRAINER_SHARD, m.ShardUpload, role="operator").payload
        if upload.sha256 != sha256:
            raise Refused(422, "the envelope is for another shard")
        if upload.size > self.config.max_shard_bytes:
            raise Refused(413, f"shard of {upload.size} bytes exceeds max_shard_bytes {self.config.max_shard_bytes}")
        return upload

    def put_shard(self, upload: m.ShardUpload, data: bytes) -> None:
        if len(data) != upload.size:
            raise Refused(422, f"body has {len(data)} bytes, the envelope says {upload.size}")
        try:
            self.shards.put(upload.sha256, data)
        except ManifestError as e:
            raise Refused(422, str(e)) from None

    def shard_path(self, sha256: str) -> Path:
        """Where the shard `sha256` is stored; Refused(400) for a malformed hash, Refused(404) if absent."""
        if not _is_sha256(sha256):
            raise Refused(400, "not a sha256")
        path = self.shards.path(sha256)
        if not path.is_file():
            raise Refused(404, "no such shard")
        return path

    def publish(self, req: Signed) -> SignedManifest:
        """Sign and publish a manifest whose shards are all here; it becomes the current version."""
        manifest: CheckpointManifest = req.payload.manifest
        with self._publish_lock:  # one publish (and its shard collection) at a time
            if manifest.run_id != self.config.run.run_id:
                raise Refused(409, f"manifest is for run {manifest.run_id!r}, this run is {self.config.run.run_id!r}")
            current = self.current_version()
            if manifest.version <= current:
                raise Refused(409, f"version {manifest.version} is not newer than the current version {current}")
            for f in manifest.files:
                if sum(s.size for s in f.shards) != f.size:
                    raise Refused(422, f"file {f.path}: shard sizes do not add up to its size")
            for ref in manifest.shards():
                path = self.shards.path(ref.sha256)
                if not path.is_file():
                    raise Refused(409, f"shard {ref.sha256} is missing: upload it first")
                if path.stat().st_size != ref.size:
                    raise Refused(409, f"shard {ref.sha256} has {path.stat().st_size} bytes, manifest says {ref.size}")
            now = self.clock()
            signed = SignedManifest.sign(manifest.model_copy(update={"created_at": now}), self.identity)
            with self.store.transaction():
                self.store.insert_manifest(manifest.version, signed.model_dump(mode="json"), now)
                self.store.set_int("current_version", manifest.version)
            # Shards are collected only here, right after a publish: a single trainer uploads the shards of
            # version v+1 after publishing v, so nothing it still needs is removed.
            keep = [SignedManifest.model_validate(d).manifest
                    for d in self.store.latest_manifests(self.config.keep_versions)]
            self.shards.remove_unreferenced(keep)
        for hook in self.publish_hooks:
            try:
                hook(signed.manifest)
            except Exception:  # a failing side channel must not undo a publish: nodes still have the origin
                log.exception("publish hook failed for version %d", manifest.version)
        return signed

    def record_metrics(self, req: Signed) -> None:
        body: m.TrainerMetrics = req.payload
        bad = [k for k, v in body.metrics.items() if not math.isfinite(v)]
        if bad:
            raise Refused(422, f"metric {bad[0]!r} is not finite")
        data = {k: v for k, v in body.metrics.items() if k not in NODE_IDLE_METRICS}
        with self.store.transaction():
            totals = self.store.node_time_totals()
            prev = self.store.last_metrics_node_totals()
            # Totals never decrease; max() only guards against float rounding.
            d_idle, d_busy = max(totals[0] - prev[0], 0.0), max(totals[1] - prev[1], 0.0)
            data["node_idle_s"] = d_idle
            if d_idle + d_busy > 0:
                data["node_idle_frac"] = d_idle / (d_idle + d_busy)
            self.store.insert_metrics(body.step, body.version, data, self.clock(), node_totals=totals)


def _is_sha256(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)

