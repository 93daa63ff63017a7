"""Leases and submissions: the first half of a rollout's life.

A lease hands an admitted node (`coordinator.admission`: at most its allowance in flight) prompts, abandoned ones
first and then new ones drawn from the run's secret prompt stream, with sampling seeds the coordinator fixes, for
the current policy version, all signed by the coordinator (`protocol.leases`). A submission turns each leased prompt
into a pending group at most once (a conditional update of the prompt's `submitted` flag, under a lock on the
lease's row), after `protocol.validation` has checked its staleness and shape, and settles the lease: what it did
not deliver is leased again to someone else. Deciding on groups is `coordinator.verification`'s.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable
from typing import Any

from sqlalchemy import Double, and_, bindparam, func, or_, select, update

from swarmrl.coordinator import admission, feed, inflight
from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.checkpoints import current_version
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.fast import Prepared
from swarmrl.coordinator.db.rows import LeasePromptRow, LeaseRow, NodeRow
from swarmrl.coordinator.db.schema import LEASE_COUNTER, lease_prompts, leases, rollout_groups
from swarmrl.coordinator.db.store import Store, Tx, add_to_counter
from swarmrl.coordinator.gate import admit
from swarmrl.coordinator.idempotency import remember
from swarmrl.coordinator.registry import require_node, touch
from swarmrl.coordinator.run_secret import RunSecret
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.tasks import Task
from swarmrl.protocol.validation import group_problem, staleness_problem

SWEEP_EVERY_S = 1.0

# -- queries ----------------------------------------------------------------------------------------------

_l, _p, _g = leases.c, lease_prompts.c, rollout_groups.c
_OPEN_LEASES = Prepared(select(func.count()).select_from(leases).where(
    _l.node_id == bindparam("b_node"), _l.state == "open", _l.expires_at > bindparam("b_now", type_=Double)))
_GET_LEASE = select(leases).where(_l.id == bindparam("b_lease"))
_GET_LEASE_LOCKED = Prepared(_GET_LEASE.with_for_update())
_GET_LEASE = Prepared(_GET_LEASE)
_PROMPTS = Prepared(select(lease_prompts).where(_p.lease_id == bindparam("b_lease")).order_by(_p.position))
_MARK = Prepared(update(lease_prompts).where(
    _p.lease_id == bindparam("b_lease"), _p.prompt_id == bindparam("b_prompt"), _p.submitted.is_(False)
).values(submitted=True))
_INSERT_LEASE = Prepared(leases.insert(), keys=["id", "node_id", "policy_version", "issued_at", "expires_at",
                                                "sampling", "signature", "digests", "flight_n", "flight_class",
                                                "flight_source", "flight_stripe"])
_INSERT_PROMPT = Prepared(lease_prompts.insert(), keys=["lease_id", "prompt_id", "position", "text", "answer", "seeds"])
_INSERT_GROUP = Prepared(rollout_groups.insert().returning(_g.id),
                         keys=["node_id", "lease_id", "prompt_id", "policy_version", "payload", "submitted_at"])
_EARLIEST = select(func.min(_l.expires_at)).where(_l.node_id == bindparam("b_node"), _l.state == "open",
                                                 _l.expires_at > bindparam("b_now", type_=Double))


def count_open_leases(tx: Tx, node_id: str, now: float) -> int:
    return int(_OPEN_LEASES.scalar(tx, b_node=node_id, b_now=now))


def insert_lease(tx: Tx, lease_id: str, node_id: str, policy_version: int, issued_at: float, expires_at: float,
                 sampling: dict[str, Any], prompts: list[tuple[str, str, str, list[int]]],
                 signature: dict[str, Any] | None = None, digests: list[str] | None = None,
                 counted_as: tuple[str, str] = ("", "")) -> dict[inflight.Key, int]:
    """Store a lease (with its signature and its prompts' digests, as signed) and its prompts, each (prompt_id,
    text, answer, seeds), counted in flight as `counted_as` (`inflight.counted_as`; ('', ''): nowhere). The
    counter moves, for `inflight.apply`."""
    cls, source = counted_as
    stripe = inflight.stripe(node_id)
    _INSERT_LEASE.rowcount(tx, id=lease_id, node_id=node_id, policy_version=policy_version, issued_at=issued_at,
                           expires_at=expires_at, sampling=sampling, signature=signature, digests=digests,
                           flight_n=len(prompts), flight_class=cls, flight_source=source, flight_stripe=stripe)
    deltas: dict[inflight.Key, int] = {}
    inflight.add_to(deltas, cls, source, policy_version, stripe, len(prompts))
    if prompts:
        _INSERT_PROMPT.many(tx, [dict(lease_id=lease_id, prompt_id=p, position=i, text=t, answer=a, seeds=s)
                                 for i, (p, t, a, s) in enumerate(prompts)])
    return deltas


def get_lease(tx: Tx, lease_id: str, *, lock: bool = False) -> LeaseRow | None:
    """The lease; with `lock`, locked until the transaction ends (submissions of one lease take turns)."""
    return (_GET_LEASE_LOCKED if lock else _GET_LEASE).first_as(LeaseRow, tx, b_lease=lease_id)


def get_prompts(tx: Tx, lease_id: str) -> dict[str, LeasePromptRow]:
    """The lease's prompts by prompt id, in leased order, answers included (server side only)."""
    return {r.prompt_id: r for r in _PROMPTS.all_as(LeasePromptRow, tx, b_lease=lease_id)}


def mark_submitted(tx: Tx, lease_id: str, prompt_id: str) -> bool:
    """Flag a prompt submitted; False if it already was (so a racing duplicate cannot slip through)."""
    return _MARK.rowcount(tx, b_lease=lease_id, b_prompt=prompt_id) == 1


def insert_group(tx: Tx, node_id: str, lease_id: str, prompt_id: str, policy_version: int, payload: dict[str, Any],
                 now: float) -> int:
    """A new pending group; its id."""
    return int(_INSERT_GROUP.scalar(tx, node_id=node_id, lease_id=lease_id, prompt_id=prompt_id,
                                    policy_version=policy_version, payload=payload, submitted_at=now))


def buffered_groups(tx: Tx, min_version: int) -> int:
    """Submitted groups in flight that the trainer may still use: submitted and not yet decided, or accepted and not
    yet acknowledged by the trainer; all of policy version >= `min_version`. (Leased prompts in flight are
    `coordinator.inflight`'s, counted per identity.)"""
    g = rollout_groups.c
    return int(tx.execute(select(func.count()).select_from(rollout_groups).where(
        g.policy_version >= min_version,
        or_(g.status == "pending", and_(g.status == "accepted", g.accepted_seq > feed.acked(tx))))).scalar_one())


def until_a_lease_expires(tx: Tx, node_id: str, now: float) -> float:
    """Seconds until the node's first open lease expires (at least 1): the Retry-After of a node whose leases are
    all it may hold."""
    earliest = tx.execute(_EARLIEST, {"b_node": node_id, "b_now": now}).scalar_one()
    return max((earliest if earliest is not None else now) - now, 1.0)


# -- rules ------------------------------------------------------------------------------------------------


class Leases:
    """Issuing signed leases of `task` prompts to admitted identities, and taking submissions against them."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float], task: Task,
                 identity: Identity, pool: str, secret: RunSecret):
        self.store, self.config, self.clock, self.task = store, config, clock, task
        self.identity, self.pool, self.secret = identity, pool, secret
        self._last_sweep = float("-inf")

    def _prompt_rng(self, tx: Tx, lease_id: str) -> random.Random:
        """The prompt stream of a new lease: drawn from the run's secret and the lease's random id (nobody can tell
        what the next lease holds, and no shared counter row makes lease requests wait on each other), or, when the
        operator fixed `prompt_seed` for a reproducible stream, from it and the lease counter."""
        seed = self.config.prompt_seed
        if seed is not None:
            return random.Random(f"{seed}/{add_to_counter(tx, LEASE_COUNTER)}")
        return random.Random(self.secret.derive("prompts", lease_id.encode()))

    def _sweep(self, now: float) -> None:
        """Settle expired leases (`admission.sweep_expired`), in a transaction of its own (it moves other nodes'
        counters: never while holding one node's row): at most once per SWEEP_EVERY_S in this process, and again
        on the next request while it finds a full batch (each lease request then settles up to sweep_batch
        leases and makes at most one: a backlog, and what it holds in flight, shrinks)."""
        if now - self._last_sweep < SWEEP_EVERY_S:
            return
        self._last_sweep = now
        batch = self.config.admission.sweep_batch

        def sweep(tx: Tx) -> int:
            expired = admission.expired_leases(tx, now, batch)
            admission.settle_leases(tx, expired, now)
            return len(expired)

        if self.store.write(sweep) == batch:
            self._last_sweep = float("-inf")

    def issue(self, req: Signed) -> m.Lease | None:
        """A new lease for the signer (`coordinator.admission`: at most its allowance in flight, abandoned prompts
        first), or None before the first manifest or while enough work is in flight (`max_buffered_groups`)."""
        body: m.LeaseRequest = req.payload
        now = self.clock()
        self._sweep(now)

        def lease(tx: Tx) -> m.Lease | None:
            admit(tx, req)
            node = require_node(tx, req.signer, lock=True)  # locked: one node's lease requests take turns
            touch(tx, req.signer, now, body.held_version)
            granted = self._grant(tx, node, body, now)
            if granted is not None:
                remember(tx, req, granted, now)
            return granted

        return self.store.write(lease)

    def _grant(self, tx: Tx, node: NodeRow, body: m.LeaseRequest, now: float) -> m.Lease | None:
        """`issue`'s lease for `node` (its row locked by `tx`), or None; Refused (429) over its allowance or its
        open leases. The counter moves of the leases it settles and grants are applied in one ordered pass at the
        end, whether it grants a lease or not (a refusal rolls everything back)."""
        cfg, run, adm = self.config, self.config.run, self.config.admission
        deltas: dict[inflight.Key, int] = {}
        version = current_version(tx)
        if version < 0:
            return None
        min_version = version - run.max_staleness
        # Its own expired leases are settled now, so that what it holds is exact when it asks (others' are the
        # sweep's).
        if admission.settle_own_expired(tx, node.id, now, adm.sweep_batch, deltas):
            node = require_node(tx, node.id)
        flight = admission.in_flight(tx, node, min_version)
        allowed = admission.allowance(node, adm)
        if flight.own >= allowed:
            raise Refused(429, f"this identity may hold {allowed} prompts in flight and holds {flight.own}: submit "
                               "them (or let their leases expire) first",
                          retry_after=until_a_lease_expires(tx, node.id, now))
        if count_open_leases(tx, node.id, now) >= cfg.max_outstanding_leases:
            raise Refused(429, f"node already holds {cfg.max_outstanding_leases} open leases: submit or let "
                               "them expire first", retry_after=until_a_lease_expires(tx, node.id, now))
        cap = admission.unproven_cap(adm, cfg.max_buffered_groups)
        if not admission.is_proven(node, adm) and (flight.unproven >= cap or
                                                   flight.unproven_same_source >= adm.unproven_per_source):
            granted = None  # the unproven identities' share (or their source's) is taken: only they wait
        elif cfg.max_buffered_groups is not None and buffered_groups(tx, min_version) + \
                admission.counted_in_flight(flight, cap) >= cfg.max_buffered_groups:
            # Backpressure: no point generating groups the trainer will drop as stale before it reaches them.
            granted = None
        else:
            granted = self._sign_and_store(tx, node, min(body.max_prompts, allowed - flight.own), version, now,
                                           deltas)
        inflight.apply(tx, deltas)
        return granted

    def _sign_and_store(self, tx: Tx, node: NodeRow, n: int, version: int, now: float,
                        deltas: dict[inflight.Key, int]) -> m.Lease:
        run, adm = self.config.run, self.config.admission
        lease_id = secrets.token_hex(12)
        drawn = admission.take_queued(tx, node.id, n)
        if len(drawn) < n:
            rng = self._prompt_rng(tx, lease_id)
            while len(drawn) < n:
                problem = self.task.sample(rng)
                drawn.append((problem.prompt, problem.answer))
        prompts = [(f"{lease_id}.{i}", text, answer, [secrets.randbits(63) for _ in range(run.sampling.group_size)])
                   for i, (text, answer) in enumerate(drawn)]
        signed = m.Lease.issue(self.identity, self.pool, lease_id=lease_id, node_id=node.id,
                               policy_version=version, expires_at=now + self.config.lease_ttl_s,
                               sampling=run.sampling,
                               prompts=[m.LeasedPrompt(prompt_id=p, text=t, seeds=s) for p, t, _, s in prompts])
        counted = insert_lease(tx, lease_id, node.id, version, now, signed.expires_at,
                               run.sampling.model_dump(mode="json"), prompts,
                               signed.signature.model_dump(mode="json"), signed.digests(),
                               inflight.counted_as(admission.is_proven(node, adm), node.source))
        admission.count_leased(tx, node.id, n)
        for key, d in counted.items():
            deltas[key] = deltas.get(key, 0) + d
        return signed

    def _next_lease(self, tx: Tx, node_id: str, ask: m.LeaseRequest | None, now: float) -> dict[str, Any]:
        """The fields of a submission's answer for the next lease it asks for (`RolloutSubmission.next_lease`): the
        lease `issue` would grant, or why there is none. In a savepoint: a refused grant undoes only its own
        changes, never the submission's."""
        if ask is None:
            return {}
        cursor = tx.connection.dbapi_connection.cursor()  # type: ignore[union-attr]  # SQLAlchemy's costs more
        cursor.execute("SAVEPOINT next_lease")
        try:
            granted = self._grant(tx, require_node(tx, node_id, lock=True), ask, now)
        except Refused as e:
            cursor.execute("ROLLBACK TO SAVEPOINT next_lease")
            granted, why = None, e.reason
        else:
            why = NO_WORK
        cursor.execute("RELEASE SAVEPOINT next_lease")
        return {"next_lease": granted} if granted is not None else {"next_lease_refused": why}

    def submit(self, req: Signed) -> m.SubmitResult:
        """Take the submission's valid groups for verification and say why each other group was refused. The
        submission settles its lease: every leased prompt it does not deliver is abandoned (queued for another
        identity, and counted against this one). When it asks for its next lease, the answer holds that lease (or
        why there is none), granted after the settlement, in the same transaction."""
        sub: m.RolloutSubmission = req.payload
        now = self.clock()
        ids = [g.prompt_id for g in sub.groups]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise Refused(422, f"prompt id {dup!r} appears twice in one submission")
        max_staleness = self.config.run.max_staleness
        held = sub.next_lease.held_version if sub.next_lease is not None else None

        def take(tx: Tx) -> m.SubmitResult:
            admit(tx, req)
            require_node(tx, req.signer)
            lease = get_lease(tx, sub.lease_id, lock=True)
            if lease is None:
                raise Refused(404, "unknown lease")
            if lease.node_id != req.signer:
                raise Refused(403, "lease belongs to another node")
            if lease.state != "open":  # a late or repeated submission: each group says why, nothing else changes
                prompts = get_prompts(tx, sub.lease_id)
                late = m.SubmitResult(accepted=[], rejected={g.prompt_id: _too_late(prompts.get(g.prompt_id))
                                                             for g in sub.groups})
                touch(tx, req.signer, now, held)  # the node is heard from (live again, if it was gone)
                late = late.model_copy(update=self._next_lease(tx, req.signer, sub.next_lease, now))
                remember(tx, req, late, now)
                return late
            if lease.expires_at < now:
                raise Refused(410, "lease expired")
            stale = staleness_problem(sub.policy_version, current_version(tx), max_staleness)
            if stale is not None:
                raise _Stale(stale)
            prompts = get_prompts(tx, sub.lease_id)
            sampling = m.SamplingSpec.model_validate(lease.sampling)
            accepted: list[str] = []
            rejected: dict[str, str] = {}
            for group in sub.groups:
                leased = prompts.get(group.prompt_id)
                if leased is None:
                    reason: str | None = "unknown prompt id for this lease"
                elif leased.submitted:
                    reason = "already submitted"
                else:
                    reason = group_problem(group, leased.seeds, sampling)
                if reason is None and not mark_submitted(tx, sub.lease_id, group.prompt_id):
                    reason = "already submitted"
                if reason is not None:
                    rejected[group.prompt_id] = reason
                    continue
                insert_group(tx, req.signer, sub.lease_id, group.prompt_id, sub.policy_version,
                             group.model_dump(mode="json"), now)
                accepted.append(group.prompt_id)
            admission.settle_lease(tx, sub.lease_id, now)
            touch(tx, req.signer, now, held)
            answer = m.SubmitResult(accepted=accepted, rejected=rejected,
                                    **self._next_lease(tx, req.signer, sub.next_lease, now))
            remember(tx, req, answer, now)
            return answer

        try:
            return self.store.write(take, notify=True)
        except _Stale as e:
            # None of the lease's groups can be accepted any more: settle it so that it stops holding the node's
            # allowance, its prompts leased again, without counting them against the node (the one change a refused
            # submission makes); then say why.
            self.store.write(lambda tx: admission.settle_lease(tx, sub.lease_id, now, penalise=False))
            raise Refused(409, f"stale submission, against the current version: {e.reason}") from None


NO_WORK = "no work now (no published version yet, or enough work in flight): ask again later"
SETTLED = ("lease settled: this prompt was not in the submission that settled it (or the lease turned stale or "
           "expired), and has been leased again")


def _too_late(leased: LeasePromptRow | None) -> str:
    """Why a group for a lease already settled is refused."""
    if leased is None:
        return "unknown prompt id for this lease"
    return "already submitted" if leased.submitted else SETTLED


class _Stale(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason
