"""A submission's write transaction as data: what it works out before the transaction, and the plain form in which
it crosses to the store's writer process (`coordinator.db.sqlite.writer`).

`Leases.submit` checks a submission's groups against their lease's terms before its transaction, from what the
process keeps of the leases it granted (`Prechecked`, `coordinator.compose`). The transaction itself needs only
that, a few fields of the request and of the submission, and the next lease's draft: `SubmissionWrite`. With a
writer process, a submission whose groups were prechecked crosses to it as `to_wire` gives, and is rebuilt there by
`from_wire` before its turn to commit, so that no decoding runs while other writes wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.compose import Composed
from swarmrl.coordinator.db.rows import LeasePromptRow
from swarmrl.coordinator.db.store import EncodedJSON
from swarmrl.protocol import messages as m
from swarmrl.protocol.groupsig import verify_group
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.signing import SignatureError
from swarmrl.protocol.validation import group_problem

__all__ = ["Prechecked", "SubmissionWrite", "check_group_signatures", "from_wire", "judged", "to_wire"]


@dataclass(frozen=True)
class Prechecked:
    """A submission's groups judged against their lease's terms (`judged`), and its next lease's draft."""

    prompts: dict[str, LeasePromptRow]
    problems: dict[str, str | None]  # by prompt id, for the groups of leased prompts
    payloads: dict[str, EncodedJSON]  # by prompt id, the stored form of the groups with no problem
    draft: Composed | None


def check_group_signatures(req: Signed) -> None:
    """Refused (`BAD_GROUP_SIGNATURE`) unless every group of the submission `req` that carries a node signature
    carries the signer's own for this lease, version and pool (`protocol.groupsig`): what is stored is then what the
    node signed, and the verifier and the trainer check it again themselves. A group without one is taken (an older
    client's): the verifier refuses it, without a ban."""
    sub: m.RolloutSubmission = req.payload
    for group in sub.groups:
        if group.node_signature is None:
            continue
        try:
            verify_group(group, node_key=req.public_key, node_id=req.signer, lease_id=sub.lease_id,
                         policy_version=sub.policy_version, pool=req.sig.pool)
        except SignatureError as e:
            raise Refused(RefusalCode.BAD_GROUP_SIGNATURE,
                          f"group {group.prompt_id[:64]!r}: its node signature does not verify: {e.reason}") from None


def judged(groups: list[m.RolloutGroup], prompts: dict[str, LeasePromptRow], sampling: m.SamplingSpec,
           draft: Composed | None) -> Prechecked:
    """Each group of a leased prompt: its problem (`group_problem`) and, if none, its stored form."""
    problems: dict[str, str | None] = {}
    payloads: dict[str, EncodedJSON] = {}
    for group in groups:
        leased = prompts.get(group.prompt_id)
        if leased is not None:
            problems[group.prompt_id] = problem = group_problem(group, leased.seeds, sampling)
            if problem is None:
                payloads[group.prompt_id] = EncodedJSON(group.model_dump_json())
    return Prechecked(prompts, problems, payloads, draft)


@dataclass(frozen=True)
class SubmissionWrite:
    """What a submission's transaction reads (`Leases._take`): the request's nonce, signer and Idempotency-Key
    (`req`; its payload is not read), the submission's lease, prompt ids, policy version and next-lease request,
    the time, and the prechecked groups (`pre`), or, when the lease was not prechecked, the groups themselves."""

    req: Signed
    lease_id: str
    prompt_ids: list[str]
    policy_version: int
    ask: m.LeaseRequest | None
    now: float
    pre: Prechecked | None
    groups: list[m.RolloutGroup]
    spans: dict[str, list[tuple[int, int]]]
    """Per group that records version spans (in-flight updates), its spans: the transaction holds them against the
    newest version published (`Leases._take`)."""

    @classmethod
    def of(cls, req: Signed, now: float, pre: Prechecked | None) -> SubmissionWrite:
        sub: m.RolloutSubmission = req.payload
        return cls(req, sub.lease_id, [g.prompt_id for g in sub.groups], sub.policy_version, sub.next_lease, now,
                   pre, sub.groups, {g.prompt_id: list(g.version_spans) for g in sub.groups if g.version_spans})

    @property
    def held(self) -> int | None:
        """The version the node holds, when it asks for its next lease."""
        return self.ask.held_version if self.ask is not None else None


def to_wire(w: SubmissionWrite) -> list[Any]:
    """`w` as plain JSON data; only a prechecked write crosses (its groups are in `pre`'s stored forms)."""
    assert w.pre is not None, "only a prechecked submission crosses to the writer"
    pre, req, draft = w.pre, w.req, w.pre.draft
    return [req.to_wire(), w.lease_id, w.prompt_ids,
            w.policy_version, None if w.ask is None else w.ask.model_dump(), w.now,
            [[r.prompt_id, r.position, r.text, r.answer, r.seeds, r.submitted] for r in pre.prompts.values()],
            pre.problems, pre.payloads,
            None if draft is None else [draft.lease.model_dump_json(), draft.prompts, draft.sampling,
                                        draft.signature, draft.digests], w.spans]


def from_wire(a: list[Any]) -> SubmissionWrite:
    """The write `to_wire` sent."""
    req, lease_id, prompt_ids, version, ask, now, rows, problems, payloads, draft, spans = a
    req = Signed.from_wire(req)
    composed = None if draft is None else Composed(
        m.Lease.model_validate_json(draft[0]), [(p, t, ans, s) for p, t, ans, s in draft[1]], EncodedJSON(draft[2]),
        EncodedJSON(draft[3]), EncodedJSON(draft[4]))
    pre = Prechecked({r[0]: LeasePromptRow(lease_id, *r) for r in rows}, problems,
                     {k: EncodedJSON(v) for k, v in payloads.items()}, composed)
    return SubmissionWrite(req, lease_id, prompt_ids, version,
                           None if ask is None else m.LeaseRequest.model_validate(ask), now, pre, [],
                           {k: [(a, b) for a, b in v] for k, v in spans.items()})
