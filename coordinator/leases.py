"""Leases and submissions: the first half of a rollout's life.

A lease hands a node prompts (drawn deterministically from the prompt seed and the lease counter) with sampling
seeds the coordinator fixes, for the current policy version. A submission turns each leased prompt into a pending
group at most once (a conditional update of the prompt's `submitted` flag, under a lock on the lease's row), after
`protocol.validation` has checked its staleness and shape. Deciding on groups is `coordinator.verification`'s.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable
from typing import Any

from sqlalchemy import Double, and_, bindparam, exists, func, or_, select, update

from swarmrl.coordinator import feed
from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.checkpoints import current_version
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.fast import Prepared
from swarmrl.coordinator.db.rows import LeasePromptRow, LeaseRow
from swarmrl.coordinator.db.schema import LEASE_COUNTER, lease_prompts, leases, rollout_groups
from swarmrl.coordinator.db.store import Store, Tx, add_to_counter
from swarmrl.coordinator.gate import admit
from swarmrl.coordinator.idempotency import remember
from swarmrl.coordinator.registry import require_node, touch
from swarmrl.protocol import messages as m
from swarmrl.protocol.tasks import Task
from swarmrl.protocol.validation import group_problem, staleness_problem

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
_CLOSE = update(leases).where(_l.id == bindparam("b_lease")).values(state="done")
_CLOSE_IF_COMPLETE = Prepared(_CLOSE.where(_l.state == "open", ~exists().where(_p.lease_id == bindparam("b_lease"),
                                                                               _p.submitted.is_(False))))
_INSERT_LEASE = Prepared(leases.insert(), keys=["id", "node_id", "policy_version", "issued_at", "expires_at",
                                                "sampling"])
_INSERT_PROMPT = Prepared(lease_prompts.insert(), keys=["lease_id", "prompt_id", "position", "text", "answer", "seeds"])
_INSERT_GROUP = Prepared(rollout_groups.insert().returning(_g.id),
                         keys=["node_id", "lease_id", "prompt_id", "policy_version", "payload", "submitted_at"])


def count_open_leases(tx: Tx, node_id: str, now: float) -> int:
    return int(_OPEN_LEASES.scalar(tx, b_node=node_id, b_now=now))


def insert_lease(tx: Tx, lease_id: str, node_id: str, policy_version: int, issued_at: float, expires_at: float,
                 sampling: dict[str, Any], prompts: list[tuple[str, str, str, list[int]]]) -> None:
    """Store a lease and its prompts, each (prompt_id, text, answer, seeds)."""
    _INSERT_LEASE.rowcount(tx, id=lease_id, node_id=node_id, policy_version=policy_version, issued_at=issued_at,
                           expires_at=expires_at, sampling=sampling)
    if prompts:
        _INSERT_PROMPT.many(tx, [dict(lease_id=lease_id, prompt_id=p, position=i, text=t, answer=a, seeds=s)
                                 for i, (p, t, a, s) in enumerate(prompts)])


def get_lease(tx: Tx, lease_id: str, *, lock: bool = False) -> LeaseRow | None:
    """The lease; with `lock`, locked until the transaction ends (submissions of one lease take turns)."""
    return (_GET_LEASE_LOCKED if lock else _GET_LEASE).first_as(LeaseRow, tx, b_lease=lease_id)


def get_prompts(tx: Tx, lease_id: str) -> dict[str, LeasePromptRow]:
    """The lease's prompts by prompt id, in leased order, answers included (server side only)."""
    return {r.prompt_id: r for r in _PROMPTS.all_as(LeasePromptRow, tx, b_lease=lease_id)}


def mark_submitted(tx: Tx, lease_id: str, prompt_id: str) -> bool:
    """Flag a prompt submitted; False if it already was (so a racing duplicate cannot slip through)."""
    return _MARK.rowcount(tx, b_lease=lease_id, b_prompt=prompt_id) == 1


def close_lease(tx: Tx, lease_id: str) -> None:
    tx.execute(_CLOSE, {"b_lease": lease_id})


def close_lease_if_complete(tx: Tx, lease_id: str) -> bool:
    return _CLOSE_IF_COMPLETE.rowcount(tx, b_lease=lease_id) == 1


def insert_group(tx: Tx, node_id: str, lease_id: str, prompt_id: str, policy_version: int, payload: dict[str, Any],
                 now: float) -> int:
    """A new pending group; its id."""
    return int(_INSERT_GROUP.scalar(tx, node_id=node_id, lease_id=lease_id, prompt_id=prompt_id,
                                    policy_version=policy_version, payload=payload, submitted_at=now))


def buffered_work(tx: Tx, min_version: int, now: float) -> int:
    """Groups in flight that the trainer may still use: leased and not yet submitted, submitted and not yet
    decided, or accepted and not yet acknowledged by the trainer; all of policy version >= `min_version`."""
    p, lc, g = lease_prompts.c, leases.c, rollout_groups.c
    leased = tx.execute(select(func.count()).select_from(lease_prompts.join(leases, lc.id == p.lease_id)).where(
        p.submitted.is_(False), lc.state == "open", lc.expires_at > now, lc.policy_version >= min_version)).scalar_one()
    groups = tx.execute(select(func.count()).select_from(rollout_groups).where(
        g.policy_version >= min_version,
        or_(g.status == "pending", and_(g.status == "accepted", g.accepted_seq > feed.acked(tx))))).scalar_one()
    return int(leased) + int(groups)


# -- rules ------------------------------------------------------------------------------------------------


class Leases:
    """Issuing leases of `task` prompts and taking submissions against them."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float], task: Task):
        self.store, self.config, self.clock, self.task = store, config, clock, task

    def issue(self, req: Signed) -> m.Lease | None:
        """A new lease of prompts for the signer, or None before the first manifest or while enough work is in
        flight (`max_buffered_groups`)."""
        body: m.LeaseRequest = req.payload
        now = self.clock()
        cfg, run = self.config, self.config.run

        def lease(tx: Tx) -> m.Lease | None:
            admit(tx, req)
            require_node(tx, req.signer, lock=True)  # locked: one node's lease requests take turns
            touch(tx, req.signer, now, body.held_version)
            version = current_version(tx)
            if version < 0:
                return None
            if cfg.max_buffered_groups is not None and \
                    buffered_work(tx, version - run.max_staleness, now) >= cfg.max_buffered_groups:
                # Backpressure: no point generating groups the trainer will drop as stale before it reaches them.
                return None  # not remembered: no work was handed out, and a retry may find some
            if count_open_leases(tx, req.signer, now) >= cfg.max_outstanding_leases:
                raise Refused(429, f"node already holds {cfg.max_outstanding_leases} open leases: submit or let "
                                   "them expire first")
            # Deterministic prompts from (prompt_seed, counter): a run's prompt stream is reproducible.
            rng = random.Random(f"{cfg.prompt_seed}/{add_to_counter(tx, LEASE_COUNTER)}")
            lease_id = secrets.token_hex(12)
            prompts = []
            for i in range(body.max_prompts):
                problem = self.task.sample(rng)
                seeds = [secrets.randbits(63) for _ in range(run.sampling.group_size)]
                prompts.append((f"{lease_id}.{i}", problem.prompt, problem.answer, seeds))
            expires_at = now + cfg.lease_ttl_s
            insert_lease(tx, lease_id, req.signer, version, now, expires_at, run.sampling.model_dump(mode="json"),
                         prompts)
            answer = m.Lease(lease_id=lease_id, policy_version=version, expires_at=expires_at, sampling=run.sampling,
                             prompts=[m.LeasedPrompt(prompt_id=p, text=t, seeds=s) for p, t, _, s in prompts])
            remember(tx, req, answer, now)
            return answer

        return self.store.write(lease)

    def submit(self, req: Signed) -> m.SubmitResult:
        """Take the submission's valid groups for verification; say why each other group was refused."""
        sub: m.RolloutSubmission = req.payload
        now = self.clock()
        ids = [g.prompt_id for g in sub.groups]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise Refused(422, f"prompt id {dup!r} appears twice in one submission")
        max_staleness = self.config.run.max_staleness

        def take(tx: Tx) -> m.SubmitResult:
            admit(tx, req)
            require_node(tx, req.signer)
            lease = get_lease(tx, sub.lease_id, lock=True)
            if lease is None:
                raise Refused(404, "unknown lease")
            if lease.node_id != req.signer:
                raise Refused(403, "lease belongs to another node")
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
            if accepted and all(p.submitted or p.prompt_id in accepted for p in prompts.values()):
                # Only a submission that took the lease's last prompts can complete it (the row lock on the lease
                # keeps another one from taking some meanwhile); the statement checks again anyway.
                close_lease_if_complete(tx, sub.lease_id)
            touch(tx, req.signer, now)
            answer = m.SubmitResult(accepted=accepted, rejected=rejected)
            remember(tx, req, answer, now)
            return answer

        try:
            return self.store.write(take, notify=True)
        except _Stale as e:
            # None of the lease's groups can be accepted any more: close it so that it stops holding one of the
            # node's max_outstanding_leases slots (the one change a refused submission makes), then say why.
            self.store.write(lambda tx: close_lease(tx, sub.lease_id))
            raise Refused(409, f"stale submission, against the current version: {e.reason}") from None


class _Stale(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason
