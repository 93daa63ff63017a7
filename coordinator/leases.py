"""Leases and submissions: the first half of a rollout's life.

A lease hands an admitted node (`coordinator.admission`: at most its allowance in flight) prompts, abandoned ones
first and then new ones drawn from the run's secret prompt stream, with sampling seeds the coordinator fixes, for
the current policy version, all signed by the coordinator (`protocol.leases`). A submission turns each leased prompt
into a pending group at most once (a conditional update of the prompt's `submitted` flag, under a lock on the
lease's row), after `protocol.validation` has checked its staleness and shape, and settles the lease: what it did
not deliver is leased again to someone else. Deciding on groups is `coordinator.verification`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from swarmrl.coordinator import admission, inflight
from swarmrl.coordinator.auth import Refused, Signed, StaleSubmission
from swarmrl.coordinator.checkpoints import current_version
from swarmrl.coordinator.compose import Composed, LeaseComposer, RecentLeases
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.rows import LeasePromptRow, NodeRow
from swarmrl.coordinator.db.sqlite.asyncwriter import RemoteCall
from swarmrl.coordinator.db.store import Store, Tx
from swarmrl.coordinator.db.writes import PlannedWrite, Writes
from swarmrl.coordinator.gate import admit
from swarmrl.coordinator.idempotency import Answer, remember
from swarmrl.coordinator.leasequeries import (
    buffered_groups,
    count_open_leases,
    get_prompts,
    insert_lease,
    lock_lease,
    take_group,
    until_a_lease_expires,
)
from swarmrl.coordinator.registry import require_node, touch_settled
from swarmrl.coordinator.run_secret import RunSecret
from swarmrl.coordinator.submitwrite import (
    Prechecked,
    SubmissionWrite,
    check_group_signatures,
    from_wire,
    judged,
    to_wire,
)
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.tasks import Task
from swarmrl.protocol.validation import spans_problem, staleness_problem

SWEEP_EVERY_S = 1.0

# -- rules ------------------------------------------------------------------------------------------------


class Leases:
    """Issuing signed leases of `task` prompts to admitted identities, and taking submissions against them."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float], task: Task,
                 identity: Identity, pool: str, secret: RunSecret):
        self.store, self.config, self.clock, self.task = store, config, clock, task
        self.composer = LeaseComposer(config, task, identity, pool, secret)
        self.recent = RecentLeases()
        self.writes = Writes(store)
        """Where submissions are written (`coordinator.db.writes`; the server's, with the store's writer process)."""
        self._version_seen = -1  # the current version, as a transaction of this process last read it
        self._last_sweep = float("-inf")

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
            # Its row locked: one node's lease requests take turns.
            node = touch_settled(tx, req.signer, now, body.held_version)
            granted = self._grant(tx, node, body, now)
            if granted is not None:
                remember(tx, req, granted, now)
            return granted

        return self.store.write(lease)

    def _grant(self, tx: Tx, node: NodeRow, body: m.LeaseRequest, now: float, version: int | None = None,
               pending: dict[inflight.Key, int] | None = None, draft: Composed | None = None) -> m.Lease | None:
        """`issue`'s lease for `node` (its row locked by `tx`), or None; Refused (429) over its allowance or its
        open leases. `version`: the current policy version, when `tx` has read it. `pending`: counter moves of
        `tx` not yet applied (a submission's settlement), counted in what is in flight. Those and the moves of the
        leases it settles and grants are applied in one ordered pass at the end, whether it grants a lease or not
        (a refusal rolls everything back). `draft`: the lease composed before `tx`, stored when it fits. It refuses
        before it writes anything, but when `node` holds prompts in flight: its expired leases are settled first."""
        cfg, run, adm = self.config, self.config.run, self.config.admission
        deltas: dict[inflight.Key, int] = dict(pending or {})
        version = current_version(tx) if version is None else version
        if version < 0:
            inflight.apply(tx, deltas)
            return None
        min_version = version - run.max_staleness
        # Its own expired leases are settled now, so that what it holds is exact when it asks (others' are the
        # sweep's).
        # (A node with no prompt in flight holds no open lease, expired or not.)
        if node.in_flight and admission.settle_own_expired(tx, node.id, now, adm.sweep_batch, deltas):
            node = require_node(tx, node.id)
        flight = admission.in_flight(tx, node, min_version, deltas)
        allowed = min(admission.allowance(node, adm, flight.source_record),
                      admission.identity_cap(adm, cfg.max_buffered_groups))
        if flight.own >= allowed:
            raise Refused(RefusalCode.PROMPTS_IN_FLIGHT,
                          f"this identity may hold {allowed} prompts in flight and holds {flight.own}: submit "
                          "them (or let their leases expire) first",
                          retry_after=until_a_lease_expires(tx, node.id, now))
        # Every open lease holds a prompt in flight at least: with fewer of those than the limit, no need to count.
        if flight.own >= cfg.max_outstanding_leases and \
                count_open_leases(tx, node.id, now) >= cfg.max_outstanding_leases:
            raise Refused(RefusalCode.LEASES_IN_FLIGHT,
                          f"node already holds {cfg.max_outstanding_leases} open leases: submit or let "
                          "them expire first", retry_after=until_a_lease_expires(tx, node.id, now))
        cap = admission.unproven_cap(adm, cfg.max_buffered_groups)
        n = min(body.max_prompts, allowed - flight.own)
        if not admission.is_proven(node, adm):
            # Newcomers share the unproven share by source, in equal parts (`admission.source_share`).
            part = admission.source_share(adm, cap, flight.other_sources + 1)
            n = min(n, part - flight.unproven_same_source, adm.max_unproven_prompts - flight.unproven)
        if n <= 0:
            granted = None  # its source's part of the unproven share is taken (or all of it): only newcomers wait
        elif cfg.max_buffered_groups is not None and buffered_groups(tx, min_version) + \
                admission.counted_in_flight(flight, cap) >= cfg.max_buffered_groups:
            # Backpressure: no point generating groups the trainer will drop as stale before it reaches them.
            granted = None
        else:
            granted = self._sign_and_store(tx, node, n, version, now, deltas, draft, flight.queued)
        inflight.apply(tx, deltas)
        return granted

    def _sign_and_store(self, tx: Tx, node: NodeRow, n: int, version: int, now: float,
                        deltas: dict[inflight.Key, int], draft: Composed | None, queue: bool) -> m.Lease:
        """Compose (or take the `draft` of, when it fits: `coordinator.compose`) and store a lease of `n` prompts,
        queued ones first (`queue`: whether any may wait for this node)."""
        queued = admission.take_queued(tx, node.id, node.source, n, now,
                                       self.config.admission.same_source_after_s) if queue else []
        if queued or draft is None or not draft.fits(n, version):
            draft = self.composer.compose(tx, node.id, version, now, queued, n)
        signed = draft.lease
        counted = insert_lease(tx, signed.lease_id, node.id, version, now, signed.expires_at, draft.sampling,
                               draft.prompts, draft.signature, draft.digests,
                               inflight.counted_as(admission.is_proven(node, self.config.admission), node.source),
                               count_node=True)
        for key, d in counted.items():
            deltas[key] = deltas.get(key, 0) + d
        self.recent.add(draft)
        return signed

    def _next_lease(self, tx: Tx, node: NodeRow, ask: m.LeaseRequest | None, now: float, version: int,
                    pending: dict[inflight.Key, int], draft: Composed | None = None) -> dict[str, Any]:
        """The fields of a submission's answer for the next lease it asks for (`RolloutSubmission.next_lease`): the
        lease `issue` would grant `node` (its row locked by `tx`), or why there is none. The submission's `pending`
        counter moves are applied with the grant's (`_grant`), or alone. A refused grant undoes only its own
        changes, never the submission's."""
        if ask is None:
            inflight.apply(tx, pending)
            return {}
        # A grant refuses before it writes anything, but for the settlement of the node's own expired leases, done
        # first when it holds prompts in flight (`_grant`): only then is a savepoint needed.
        guard = node.in_flight > 0
        cursor = tx.connection.dbapi_connection.cursor()  # type: ignore[union-attr]  # SQLAlchemy's costs more
        if guard:
            cursor.execute("SAVEPOINT next_lease")
        try:
            granted = self._grant(tx, node, ask, now, version, pending, draft)
        except Refused as e:
            if guard:
                cursor.execute("ROLLBACK TO SAVEPOINT next_lease")
            inflight.apply(tx, pending)
            granted, why = None, e.reason
        else:
            why = NO_WORK
        if guard:
            cursor.execute("RELEASE SAVEPOINT next_lease")
        return {"next_lease": granted} if granted is not None else {"next_lease_refused": why}

    def _precheck(self, signer: str, sub: m.RolloutSubmission, now: float) -> Prechecked | None:
        """What a submission's transaction would work out from its lease's terms (`_judged`), worked out before it
        (writes take turns on SQLite), with the next lease's draft for the version last seen (`coordinator.compose`).
        None for a lease this process does not know, or not the signer's: the transaction works it out, or says why."""
        known = self.recent.take(sub.lease_id)
        if known is None or known[0].node_id != signer:
            return None
        lease, prompts = known
        ask = sub.next_lease
        draft = self.composer.draft(signer, ask.max_prompts, self._version_seen, now) if ask is not None else None
        return judged(sub.groups, prompts, lease.sampling, draft)

    def submit(self, req: Signed) -> m.SubmitResult | Answer:
        """Take the submission's valid groups for verification and say why each other group was refused. The
        submission settles its lease: every leased prompt it does not deliver is abandoned (queued for another
        identity, and counted against this one). When it asks for its next lease, the answer holds that lease (or
        why there is none), granted after the settlement, in the same transaction. Written as `plan_submit` plans
        it, where `writes` runs it (`coordinator.db.writes`: the same transaction, `_take`, whatever the store)."""
        return self.writes.run(self.plan_submit(req))

    def plan_submit(self, req: Signed) -> PlannedWrite:
        """`submit` up to its write, worked out now without blocking: its transaction, and, when the store's writer
        process runs and the submission was prechecked here, the same write as that process runs it (answered with
        the answer it stored)."""
        sub: m.RolloutSubmission = req.payload
        now = self.clock()
        ids = [g.prompt_id for g in sub.groups]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise Refused(RefusalCode.DUPLICATE_PROMPT, f"prompt id {dup!r} appears twice in one submission")
        check_group_signatures(req)
        w = SubmissionWrite.of(req, now, self._precheck(req.signer, sub, now))
        settle = partial(self._settle_stale, req)
        planned = PlannedWrite(partial(self._take, w=w), notify=True, recover=settle)
        if not self.writes.crosses or w.pre is None:
            return planned
        draft = w.pre.draft

        def finish(result: list[Any]) -> Answer:
            body, self._version_seen, draft_granted = result
            if draft_granted:
                assert draft is not None
                self.recent.add(draft)
            self.store.notify()
            return Answer(200, body.encode())

        return replace(planned, remote=RemoteCall("submit", to_wire(w), True, finish, settle))

    def _settle_stale(self, req: Signed, error: BaseException) -> None:
        """After a `StaleSubmission`: none of the lease's groups can be accepted any more. Settle it so that it
        stops holding the node's allowance, its prompts leased again, without counting them against the node (the
        one change a refused submission makes)."""
        if isinstance(error, StaleSubmission):
            lease_id, now = req.payload.lease_id, self.clock()
            self.store.write(lambda tx: admission.settle_lease(tx, lease_id, now, penalise=False))

    def write_sent(self, *wire: Any) -> Callable[[Tx], list[Any]]:
        """In the writer process: the write of a submission `to_wire` sent (rebuilt now, before its turn), which
        answers [the stored answer's body, the current version, whether the draft was granted]."""
        w = from_wire(list(wire))
        assert w.pre is not None
        draft = w.pre.draft

        def write(tx: Tx) -> list[Any]:
            result = self._take(tx, w)
            granted = result.next_lease
            if granted is not None:
                self.recent.take(granted.lease_id)  # the process that serves the node keeps it
            return [Answer.of(result).body.decode(), self._version_seen,
                    granted is not None and draft is not None and granted.lease_id == draft.lease.lease_id]

        return write

    def _spans_problem(self, w: SubmissionWrite, prompt_id: str, version: int) -> str | None:
        """Why the version spans of `w`'s group for `prompt_id` cannot be, `version` being the newest published
        (`protocol.validation.spans_problem`), or None (as for a group without spans)."""
        spans = w.spans.get(prompt_id)
        return None if spans is None else spans_problem(spans, w.policy_version, self.config.run.max_staleness,
                                                        version)

    def _take(self, tx: Tx, w: SubmissionWrite) -> m.SubmitResult:
        """A submission's transaction (`submit`)."""
        req, now, held = w.req, w.now, w.held
        admit(tx, req)
        # An unknown or banned node is told so before anything else; on the way that takes the lease's groups,
        # its own row says so (`touch_settled`), and the transaction rolls back.
        found = lock_lease(tx, w.lease_id)
        if found is None or found[0].node_id != req.signer:
            require_node(tx, req.signer)
            raise (Refused(RefusalCode.UNKNOWN_LEASE, "unknown lease") if found is None
                   else Refused(RefusalCode.LEASE_OF_ANOTHER_NODE, "lease belongs to another node"))
        lease, version = found
        self._version_seen = version
        if lease.state != "open":  # a late or repeated submission: each group says why, nothing else changes
            prompts = get_prompts(tx, w.lease_id)
            late = m.SubmitResult(accepted=[], rejected={p: _too_late(prompts.get(p)) for p in w.prompt_ids})
            node = touch_settled(tx, req.signer, now, held)  # heard from (live again, if it was gone)
            late = late.model_copy(update=self._next_lease(tx, node, w.ask, now, version, {}))
            remember(tx, req, late, now)
            return late
        if lease.expires_at < now:
            require_node(tx, req.signer)
            raise Refused(RefusalCode.LEASE_EXPIRED, "lease expired")
        stale = staleness_problem(w.policy_version, version, self.config.run.max_staleness)
        if stale is not None:
            require_node(tx, req.signer)
            raise StaleSubmission(stale)
        # An open lease has no prompt submitted (module docstring): its prompts as read before are as they are.
        checked = w.pre if w.pre is not None else judged(
            w.groups, get_prompts(tx, w.lease_id), m.SamplingSpec.model_validate(lease.sampling), None)
        prompts = checked.prompts
        accepted: list[str] = []
        rejected: dict[str, str] = {}
        for prompt_id in w.prompt_ids:
            leased = prompts.get(prompt_id)
            if leased is None:
                reason: str | None = "unknown prompt id for this lease"
            elif leased.submitted:
                reason = m.ALREADY_SUBMITTED
            else:
                reason = checked.problems[prompt_id] or self._spans_problem(w, prompt_id, version)
            if reason is None and not take_group(tx, req.signer, w.lease_id, prompt_id, w.policy_version,
                                                 checked.payloads[prompt_id], now):
                reason = m.ALREADY_SUBMITTED
            if reason is not None:
                rejected[prompt_id] = reason
                continue
            accepted.append(prompt_id)
        delivered = set(accepted)
        # The lease is settled, the node's row moved by it and touched in one statement, and the counter rows
        # moved once, with its next lease's.
        settled = admission.close_leases(tx, [w.lease_id], now, unused={w.lease_id: [
            (p.text, p.answer, p.seeds) for pid, p in prompts.items() if not p.submitted and pid not in delivered]})
        node = touch_settled(tx, req.signer, now, held, settled.nodes.get(req.signer))
        answer = m.SubmitResult(accepted=accepted, rejected=rejected, **self._next_lease(
            tx, node, w.ask, now, version, settled.counters, checked.draft))
        remember(tx, req, answer, now)
        return answer


NO_WORK = "no work now (no published version yet, or enough work in flight): ask again later"
SETTLED = ("lease settled: this prompt was not in the submission that settled it (or the lease turned stale or "
           "expired), and has been leased again")


def _too_late(leased: LeasePromptRow | None) -> str:
    """Why a group for a lease already settled is refused."""
    if leased is None:
        return "unknown prompt id for this lease"
    return m.ALREADY_SUBMITTED if leased.submitted else SETTLED
