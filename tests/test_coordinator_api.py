"""The coordinator's HTTP API, end to end: real uvicorn on loopback, real Ed25519, real SQLite (each test on
PostgreSQL too: `both_stores`, conftest.py).

Requests go through `runtime.client.CoordinatorClient` (the client the other roles use) or, for
requests the client would never make (forged, tampered, replayed, malformed), raw httpx. Time-dependent
rules (lease expiry, claim expiry) use an injected clock, so no test waits or asserts on timing.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import SIGNATURE_HEADER, pool_id, sign
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.transfer.store import ShardStore, cut_checkpoint
from tests.support.coordinator import GROUP, MAX_TOKENS, Run, post, refused, signed, submission

pytestmark = pytest.mark.both_stores  # each test on SQLite and on PostgreSQL (conftest.py)

# -- registration -------------------------------------------------------------------------------------


def test_register_by_challenge(run_factory) -> None:
    run = run_factory()
    alice, mallory = Identity.generate(), Identity.generate()
    ch = m.Challenge.model_validate(httpx.post(run.url + "/v1/register/challenge",
                                               json={"public_key": alice.public_key_hex}).json())
    # Mallory signs Alice's challenge with her own key: refused, and Alice's challenge is not used up.
    bad = signed(mallory, m.KIND_REGISTER, run.pool, m.RegisterRequest(challenge=ch.challenge, name="mallory"))
    assert post(run.url, "/v1/register", bad)[0] == 401
    good = signed(alice, m.KIND_REGISTER, run.pool, m.RegisterRequest(challenge=ch.challenge, name="alice",
                                                                      engine="vllm"))
    status, _ = post(run.url, "/v1/register", good)
    assert status == 200
    # The same challenge again, in a fresh request: single use.
    again = signed(alice, m.KIND_REGISTER, run.pool, m.RegisterRequest(challenge=ch.challenge, name="alice"))
    status, detail = post(run.url, "/v1/register", again)
    assert status == 401 and "challenge" in detail
    unknown = signed(alice, m.KIND_REGISTER, run.pool, m.RegisterRequest(challenge="00" * 32))
    assert post(run.url, "/v1/register", unknown)[0] == 401
    forged = signed(alice, m.KIND_REGISTER, run.pool, m.RegisterRequest(challenge=ch.challenge[:-1] + "0"))
    assert post(run.url, "/v1/register", forged)[0] == 401

    nodes = {n.node_id: n for n in run.op.status().nodes}
    assert set(nodes) == {alice.node_id}
    assert (nodes[alice.node_id].name, nodes[alice.node_id].engine) == ("alice", "vllm")

    reg = CoordinatorClient(run.url, alice, retries=0).register(name="alice2")
    assert reg.node_id == alice.node_id and reg.run.coordinator_key == run.key.public_key_hex
    assert reg.run.current_version == -1
    assert run.op.status().nodes[0].name == "alice2"


def test_expired_challenge_refused(run_factory) -> None:
    run = run_factory()
    alice = Identity.generate()
    ch = m.Challenge.model_validate(httpx.post(run.url + "/v1/register/challenge",
                                               json={"public_key": alice.public_key_hex}).json())
    run.clock.advance(run.cfg.challenge_ttl_s + 1)
    req = signed(alice, m.KIND_REGISTER, run.pool, m.RegisterRequest(challenge=ch.challenge), ts=run.clock())
    assert post(run.url, "/v1/register", req)[0] == 401
    assert run.op.status().nodes == []


def test_challenge_request_validated(run_factory) -> None:
    run = run_factory()
    resp = httpx.post(run.url + "/v1/register/challenge", json={"public_key": "zz" * 32})
    assert resp.status_code == 422 and isinstance(resp.json()["detail"], str)
    resp = httpx.post(run.url + "/v1/register/challenge", json={"public_key": "ab" * 32, "extra": 1})
    assert resp.status_code == 422


# -- leases and submissions ---------------------------------------------------------------------------


def test_no_work_before_first_manifest(run_factory) -> None:
    run = run_factory()
    node = run.node()
    assert node.lease(4, -1) is None
    assert node.info().current_version == -1
    assert node.latest_manifest() is None


def test_lease_and_submit_happy_path(run: Run) -> None:
    node = run.node()
    lease = node.lease(3, held_version=0)
    assert lease is not None and lease.policy_version == 0
    assert lease.sampling == run.cfg.run.sampling and len(lease.prompts) == 3
    assert all(len(p.seeds) == GROUP for p in lease.prompts)
    assert len({p.prompt_id for p in lease.prompts}) == 3
    assert all(p.text.endswith("=") for p in lease.prompts)

    result = node.submit(submission(lease))
    assert sorted(result.accepted) == sorted(p.prompt_id for p in lease.prompts) and result.rejected == {}
    st = run.op.status()
    assert (st.groups_pending, st.groups_accepted, st.groups_rejected) == (3, 0, 0)
    assert st.nodes[0].held_version == 0


def test_answers_never_sent_to_nodes(run: Run) -> None:
    node = run.node()
    body, headers = signed(node.identity, m.KIND_LEASE, run.pool, m.LeaseRequest(max_prompts=5))
    resp = httpx.post(run.url + "/v1/lease", content=body, headers=headers)
    assert resp.status_code == 200
    assert "answer" not in resp.text
    m.Lease.model_validate_json(resp.content).verify(run.key.public_key_hex, run.pool)  # the protocol's, signed


def test_prompts_are_deterministic_in_the_seed(run_factory, tmp_path: Path) -> None:
    texts = []
    for name in ("a", "b"):
        r = run_factory(data_dir=tmp_path / name, prompt_seed=1234)
        r.publish(0, tag=name)
        node = r.node()
        texts.append([[p.text for p in node.lease(4, 0).prompts] for _ in range(2)])
        run_factory.stop_last()
    assert texts[0] == texts[1]
    assert texts[0][0] != texts[0][1]  # the lease counter moves the stream on


def test_outstanding_lease_limit(run_factory) -> None:
    run = run_factory(max_outstanding_leases=2)
    run.publish(0)
    node = run.node()
    first, _ = node.lease(1, 0), node.lease(1, 0)
    refused(lambda: node.lease(1, 0), 429)
    node.submit(submission(first))  # completes the lease: a slot frees up
    assert node.lease(1, 0) is not None
    run.clock.advance(run.cfg.lease_ttl_s + 1)  # expired leases do not count either
    assert node.lease(1, 0) is not None and node.lease(1, 0) is not None


def test_unregistered_node_refused(run: Run) -> None:
    stranger = CoordinatorClient(run.url, Identity.generate(), retries=0)
    before = run.accepted_state()
    refused(lambda: stranger.lease(1, 0), 403, "register")
    refused(lambda: stranger.heartbeat(0), 403)
    assert run.accepted_state() == before


def test_other_nodes_lease_refused(run: Run) -> None:
    alice, bob = run.node("alice"), run.node("bob")
    lease = alice.lease(2, 0)
    before = run.accepted_state()
    refused(lambda: bob.submit(submission(lease)), 403, "another node")
    assert run.accepted_state() == before
    assert alice.submit(submission(lease)).rejected == {}  # Bob's attempt consumed nothing


def test_unknown_lease_refused(run: Run) -> None:
    node = run.node()
    lease = node.lease(1, 0)
    fake = lease.model_copy(update={"lease_id": "f" * 24})
    refused(lambda: node.submit(submission(fake)), 404)


def test_a_submission_settles_its_lease(run: Run) -> None:
    node = run.node()
    lease = node.lease(2, 0)
    first = node.submit(submission(lease, prompts=lease.prompts[:1]))
    assert first.accepted == [lease.prompts[0].prompt_id]
    before = run.accepted_state()
    # Settled: neither the prompt submitted nor the one left out can be submitted again (that one was leased again).
    again = node.submit(submission(lease))
    assert again.accepted == [] and again.rejected[lease.prompts[0].prompt_id] == "already submitted"
    assert "settled" in again.rejected[lease.prompts[1].prompt_id]
    assert run.accepted_state() == before
    # The same prompt twice in one submission is malformed: refused whole, and the lease is still open.
    second = node.lease(2, 0)
    refused(lambda: node.submit(submission(second, prompts=[second.prompts[1], second.prompts[1]])), 422, "twice")
    assert run.accepted_state() == before
    assert sorted(node.submit(submission(second)).accepted) == sorted(p.prompt_id for p in second.prompts)
    assert run.op.status().groups_pending == 3


def test_concurrent_duplicate_submissions_counted_once(run: Run) -> None:
    from concurrent.futures import ThreadPoolExecutor

    node = run.node()
    lease = node.lease(4, 0)
    sub = submission(lease)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: CoordinatorClient(run.url, node.identity, retries=0).submit(sub), range(4)))
    taken = [pid for r in results for pid in r.accepted]
    assert sorted(taken) == sorted(p.prompt_id for p in lease.prompts)
    assert [r.rejected for r in results].count({}) == 1
    assert all(reason == "already submitted" for r in results for reason in r.rejected.values())
    assert sum(len(r.rejected) for r in results) == 3 * len(lease.prompts)
    assert run.op.status().groups_pending == len(lease.prompts)


def test_bad_groups_rejected_individually(run: Run) -> None:
    node = run.node()
    lease = node.lease(8, 0)
    sub = submission(lease)
    g = sub.groups
    g[1].rollouts[0].seed += 1  # wrong seeds
    g[2].rollouts.pop()  # wrong group size
    g[3].rollouts.append(g[3].rollouts[0].model_copy())  # too many rollouts (and a duplicated seed)
    g[4].rollouts[1].logprobs.append(-0.1)  # logprobs do not match tokens
    g[5].rollouts[2].logprobs[0] = 0.5  # a positive logprob
    g[6].rollouts[0].completion_ids = [1] * (MAX_TOKENS + 1)
    g[6].rollouts[0].logprobs = [-0.1] * (MAX_TOKENS + 1)  # longer than max_tokens
    g[7].prompt_id = "not-a-leased-prompt"
    result = node.submit(sub)
    assert result.accepted == [g[0].prompt_id]
    reasons = result.rejected
    assert "seeds" in reasons[g[1].prompt_id]
    assert f"expected {GROUP} rollouts" in reasons[g[2].prompt_id]
    assert f"expected {GROUP} rollouts" in reasons[g[3].prompt_id]
    assert "logprobs for" in reasons[g[4].prompt_id]
    assert "<= 0" in reasons[g[5].prompt_id]
    assert "max_tokens" in reasons[g[6].prompt_id]
    assert "unknown prompt" in reasons["not-a-leased-prompt"]
    assert run.op.status().groups_pending == 1
    # The submission settled the lease: its 6 refused groups and the prompt left out were abandoned, counted against
    # the node, and are leased again, with the seeds they had, to the next identity of another source, before any
    # new prompt.
    late = node.submit(submission(lease, prompts=[lease.prompts[1]]))
    assert late.accepted == [] and "settled" in late.rejected[lease.prompts[1].prompt_id]
    row = next(n for n in run.op.status().nodes if n.node_id == node.identity.node_id)
    assert (row.prompts_leased, row.prompts_abandoned) == (8, 7)
    other = run.node("other", source="127.0.0.2").lease(8, 0)
    assert [(p.text, p.seeds) for p in other.prompts[:7]] == [(p.text, p.seeds) for p in lease.prompts[1:]]
    assert not set(other.prompts[7].seeds) & {s for p in lease.prompts for s in p.seeds}  # a new prompt: fresh


def test_seeds_must_match_as_a_multiset(run: Run) -> None:
    node = run.node()
    lease = node.lease(1, 0)
    sub = submission(lease)
    seeds = lease.prompts[0].seeds
    for r, s in zip(sub.groups[0].rollouts, [seeds[0]] * GROUP, strict=True):
        r.seed = s  # right count, right values, wrong multiplicities
    assert "seeds" in node.submit(sub).rejected[lease.prompts[0].prompt_id]


def test_stale_policy_version_refused(run: Run) -> None:
    node = run.node()
    first, second, third = (node.lease(2, 0) for _ in range(3))
    for v in (1, 2, 3):
        run.publish(v)
    before = run.accepted_state()
    err = refused(lambda: node.submit(submission(first, policy_version=0)), 409, "stale submission")
    assert "1..3" in err.reason
    refused(lambda: node.submit(submission(second, policy_version=4)), 409, "stale submission")
    assert run.accepted_state() == before
    # A stale submission settles its lease (its prompts are leased again, not counted against the node).
    late = node.submit(submission(first, policy_version=1))
    assert late.accepted == [] and all("settled" in r for r in late.rejected.values())
    result = node.submit(submission(third, policy_version=1))  # exactly max_staleness behind: taken
    assert len(result.accepted) == 2
    row = next(n for n in run.op.status().nodes if n.node_id == node.identity.node_id)
    assert (row.prompts_leased, row.prompts_abandoned) == (6, 0)


def test_expired_lease_refused(run_factory) -> None:
    run = run_factory(lease_ttl_s=5.0)
    run.publish(0)
    node = run.node()
    lease = node.lease(2, 0)
    run.clock.advance(6.0)
    before = run.accepted_state()
    refused(lambda: node.submit(submission(lease)), 410, "lease expired")
    assert run.accepted_state() == before


def test_heartbeat_updates_node(run: Run) -> None:
    node = run.node()
    node.heartbeat(held_version=7, status="generating")
    assert run.op.status().nodes[0].held_version == 7


# -- signed-request checks ----------------------------------------------------------------------------


def test_forged_tampered_misdirected_replayed_and_stale_requests(run: Run) -> None:
    node = run.node()
    ident = node.identity
    lease_req = m.LeaseRequest(max_prompts=1, held_version=0)
    before = run.accepted_state()

    # Forged: claims the node's key, signed by someone else.
    body, headers = signed(Identity.generate(), m.KIND_LEASE, run.pool, lease_req)
    sig = json.loads(headers[SIGNATURE_HEADER])
    sig["key"] = ident.public_key_hex
    assert post(run.url, "/v1/lease", (body, {SIGNATURE_HEADER: json.dumps(sig)})) == (401, "bad signature")
    # The body changed after signing.
    body, headers = signed(ident, m.KIND_LEASE, run.pool, lease_req)
    status, detail = post(run.url, "/v1/lease", (body.replace(b'"max_prompts":1', b'"max_prompts":200'), headers))
    assert status == 401 and "not the one signed" in detail
    # The right signature for another endpoint.
    status, detail = post(run.url, "/v1/lease", signed(ident, m.KIND_HEARTBEAT, run.pool, m.Heartbeat()))
    assert status == 401 and "expected a 'lease' message" in detail
    # Signed for another pool: another run, or the same run id under another coordinator key (a request replayed
    # from another pool).
    # Or the same run id and key under another store (its epoch).
    for pool in (pool_id("other-run", run.key.public_key_hex), pool_id(run.cfg.run.run_id, "ab" * 32),
                 pool_id(run.cfg.run.run_id, run.key.public_key_hex),
                 pool_id(run.cfg.run.run_id, run.key.public_key_hex, run.op.info().epoch + 1)):
        status, detail = post(run.url, "/v1/lease", signed(ident, m.KIND_LEASE, pool, lease_req))
        assert status == 401 and "another pool" in detail
    # Stale and future timestamps.
    for ts in (time.time() - 600, time.time() + 600):
        status, detail = post(run.url, "/v1/lease", signed(ident, m.KIND_LEASE, run.pool, lease_req, ts=ts))
        assert status == 401 and "timestamp" in detail
    # Unsigned, and a header that is not a signature.
    status, detail = post(run.url, "/v1/lease", lease_req.model_dump_json())
    assert status == 401 and "unsigned" in detail
    status, detail = post(run.url, "/v1/lease", (b"{}", {SIGNATURE_HEADER: '{"kind": "lease"}'}))
    assert status == 400 and "malformed" in detail
    assert run.accepted_state() == before
    # Replayed: the first use works, the second is refused.
    req = signed(ident, m.KIND_LEASE, run.pool, lease_req)
    assert post(run.url, "/v1/lease", req)[0] == 200
    assert post(run.url, "/v1/lease", req) == (409, "replayed request")

    lease = node.lease(1, 0)
    sub_req = signed(ident, m.KIND_SUBMIT, run.pool, submission(lease))
    assert post(run.url, "/v1/submit", sub_req)[0] == 200
    after_first = run.accepted_state()
    assert after_first != before
    assert post(run.url, "/v1/submit", sub_req) == (409, "replayed request")
    assert run.accepted_state() == after_first


def test_the_signature_is_checked_before_the_body_is_parsed(run: Run) -> None:
    """A body that is not even JSON is never parsed (a parse would answer 422) unless a registered node signed it:
    unsigned, with a bad signature, with another body's signature (401) or signed by a key that is no node (403)."""
    node = run.node()
    garbage = b"{" * 100_000
    assert post(run.url, "/v1/submit", garbage)[0] == 401
    headers = signed(Identity.generate(), m.KIND_SUBMIT, run.pool, garbage)[1]
    bad = {**json.loads(headers[SIGNATURE_HEADER]), "sig": "0" * 128}
    assert post(run.url, "/v1/submit", (garbage, {SIGNATURE_HEADER: json.dumps(bad)})) == (401, "bad signature")
    other_body = signed(node.identity, m.KIND_SUBMIT, run.pool, b"{}")[1]
    assert post(run.url, "/v1/submit", (garbage, other_body))[0] == 401
    status, detail = post(run.url, "/v1/submit", signed(Identity.generate(), m.KIND_SUBMIT, run.pool, garbage))
    assert status == 403 and "register" in detail
    status, detail = post(run.url, "/v1/submit", signed(node.identity, m.KIND_SUBMIT, run.pool, garbage))
    assert status == 422 and "JSON" in detail


def test_malformed_requests(run: Run) -> None:
    node = run.node()
    ident = node.identity
    before = run.accepted_state()
    status, detail = post(run.url, "/v1/lease", signed(ident, m.KIND_LEASE, run.pool, b"{not json"))
    assert status == 422 and "JSON" in detail
    # Unknown fields in the payload: correctly signed, still refused with pydantic's reason.
    req = signed(ident, m.KIND_LEASE, run.pool, {"max_prompts": 1, "held_version": 0, "greedy": True})
    status, detail = post(run.url, "/v1/lease", req)
    assert status == 422 and "greedy" in detail and "Extra inputs" in detail
    status, detail = post(run.url, "/v1/lease", signed(ident, m.KIND_LEASE, run.pool, {"max_prompts": 100000}))
    assert status == 422 and "max_prompts" in detail
    # Out-of-bounds lists inside a submission.
    lease = node.lease(1, 0)
    sub = submission(lease).model_dump(mode="json")
    sub["groups"][0]["rollouts"][0]["completion_ids"] = [1] * (m.MAX_COMPLETION_TOKENS + 1)
    status, detail = post(run.url, "/v1/submit", signed(ident, m.KIND_SUBMIT, run.pool, sub))
    assert status == 422 and "completion_ids" in detail
    assert run.accepted_state() == before


def test_oversized_bodies_refused(run: Run) -> None:
    node = run.node()
    before = run.accepted_state()
    big = b"x" * (run.cfg.max_body_bytes + 1)
    status, detail = post(run.url, "/v1/submit", big)
    assert status == 413 and "exceeds" in detail
    # Streamed without a Content-Length: unsigned, it is refused before a byte is read; signed, counted as it
    # arrives.
    chunks = lambda: (b"y" * 65536 for _ in range(run.cfg.max_body_bytes // 65536 + 2))  # noqa: E731
    assert httpx.post(run.url + "/v1/submit", content=chunks()).status_code == 401
    headers = signed(node.identity, m.KIND_SUBMIT, run.pool, b"anything")[1]
    assert httpx.post(run.url + "/v1/submit", content=chunks(), headers=headers).status_code == 413
    # A correctly signed submission that is simply too big.
    lease = node.lease(2, 0)
    sub = submission(lease)
    for g in sub.groups:
        for r in g.rollouts:
            r.proof = "A" * 60000
    assert len(sub.model_dump_json()) > run.cfg.max_body_bytes
    refused(lambda: node.submit(sub), 413)
    assert run.accepted_state() == before


def test_operator_endpoints_refuse_node_keys(run: Run) -> None:
    node = run.node()
    node.submit(submission(node.lease(1, 0)))
    before = run.accepted_state()
    refused(lambda: node.pending(10), 403, "operator")
    refused(lambda: node.verdicts([m.Verdict(group_id=1, accepted=True, rewards=[1.0] * GROUP)]), 403)
    refused(lambda: node.training_batch(0, 10), 403)
    refused(lambda: node.metrics(1, 0, {"reward": 1.0}), 403)
    refused(lambda: node.upload_shard("ab" * 32, b"data"), 403)
    manifest = run.op.latest_manifest().manifest.model_copy(update={"version": 5})
    refused(lambda: node.publish(manifest), 403)
    assert run.accepted_state() == before
    assert run.op.info().current_version == 0
    assert len(run.op.pending(10)) == 1  # the node's call did not claim it


# -- verifier and trainer -----------------------------------------------------------------------------


def test_long_polls_beyond_max_long_polls_are_answered_at_once(run_factory) -> None:
    """Waiting requests hold server threads: past `max_long_polls` of them, a poll is answered at once."""
    run = run_factory(max_long_polls=1)
    run.publish(0)
    first = CoordinatorClient(run.url, run.op.identity, retries=0)
    got: dict[str, list] = {}
    held = threading.Thread(target=lambda: got.update(first=first.pending(10, wait_s=8.0)))
    held.start()
    time.sleep(0.3)
    assert held.is_alive()
    assert run.op.pending(10, wait_s=8.0) == []  # the one slot is taken: no wait
    assert held.is_alive()
    node = run.node()
    node.submit(submission(node.lease(3, 0)))
    held.join(timeout=8.0)
    assert not held.is_alive() and len(got["first"]) == 3
    first.close()


def test_long_polls_answer_when_work_arrives(run: Run) -> None:
    """An empty verifier or trainer poll with wait_s is held until a group arrives, then answered with it."""
    verifier = CoordinatorClient(run.url, run.op.identity, retries=0)
    trainer = CoordinatorClient(run.url, run.op.identity, retries=0)
    got: dict[str, object] = {}
    polls = {
        "pending": threading.Thread(target=lambda: got.update(pending=verifier.pending(10, wait_s=8.0))),
        "batch": threading.Thread(target=lambda: got.update(batch=trainer.training_batch(0, 10, wait_s=8.0))),
    }
    polls["pending"].start()
    time.sleep(0.3)
    assert polls["pending"].is_alive()  # held, not answered empty
    node = run.node()
    node.submit(submission(node.lease(3, 0)))
    polls["pending"].join(timeout=8.0)
    assert not polls["pending"].is_alive() and len(got["pending"]) == 3  # type: ignore[arg-type]

    polls["batch"].start()
    time.sleep(0.3)
    assert polls["batch"].is_alive()
    g = got["pending"][0]  # type: ignore[index]
    run.op.verdicts([m.Verdict(group_id=g.group_id, accepted=True, rewards=[1.0, 0.0, 0.5])])
    polls["batch"].join(timeout=8.0)
    assert not polls["batch"].is_alive()
    assert [x.rewards for x in got["batch"].groups] == [[1.0, 0.0, 0.5]]  # type: ignore[attr-defined]

    # Nothing arrives: the poll is answered empty once its wait is over; longer waits are refused.
    assert trainer.training_batch(after_id=1, limit=10, wait_s=0.2).groups == []
    assert verifier.pending(10, wait_s=0.2) == []
    with pytest.raises(ValueError):
        m.BatchRequest(after_id=0, limit=1, wait_s=m.MAX_WAIT_S + 1)
    for c in (verifier, trainer):
        c.close()


def test_verifier_flow_and_trainer_cursor(run: Run) -> None:
    node = run.node()
    lease = node.lease(3, 0)
    node.submit(submission(lease))

    pending = run.op.pending(limit=10)
    assert len(pending) == 3
    by_prompt = {p.prompt_id: p for p in lease.prompts}
    for pg in pending:
        leased = by_prompt[pg.group.prompt_id]
        assert pg.seeds == leased.seeds and pg.prompt_text == leased.text  # leased order, not submitted order
        a, b = leased.text[:-1].split("+")
        assert pg.answer == str(int(a) + int(b))
        assert (pg.lease_version, pg.policy_version, pg.node_id) == (0, 0, node.identity.node_id)
        assert pg.sampling == run.cfg.run.sampling and len(pg.group.rollouts) == GROUP
    assert run.op.pending(limit=10) == []  # claimed: a second verifier gets nothing
    run.clock.advance(run.cfg.claim_ttl_s + 1)
    assert len(run.op.pending(limit=10)) == 3  # claims expire

    g0, g1, g2 = (p.group_id for p in pending)
    before = run.accepted_state()
    refused(lambda: run.op.verdicts([m.Verdict(group_id=g0, accepted=True, rewards=[1.0]),
                                     m.Verdict(group_id=g1, accepted=True, rewards=[0.0] * GROUP)]), 422, "rewards")
    assert run.accepted_state() == before  # the valid verdict in a refused batch was not applied

    run.op.verdicts([m.Verdict(group_id=g1, accepted=True, rewards=[1.0, 0.0, 0.5]),
                     m.Verdict(group_id=g2, accepted=False, reason="token 3 does not replay"),
                     m.Verdict(group_id=g0, accepted=True, rewards=[0.0, 0.0, 1.0])])
    st = run.op.status()
    assert (st.groups_pending, st.groups_accepted, st.groups_rejected) == (0, 2, 1)
    assert (st.nodes[0].groups_accepted, st.nodes[0].groups_rejected) == (2, 1)

    batch = run.op.training_batch(after_id=0, limit=10)
    assert batch.current_version == 0
    assert [g.group_id for g in batch.groups] == [1, 2]  # the cursor, in verdict order
    first = batch.groups[0]
    assert first.rewards == [1.0, 0.0, 0.5] and first.group.prompt_ids == [7, 8, 9]
    assert [r.completion_ids for r in first.group.rollouts] == [[1, 2]] * GROUP
    assert [r.logprobs for r in first.group.rollouts] == [[-0.5, -1.25]] * GROUP
    assert [r.finish_reason for r in first.group.rollouts] == ["stop"] * GROUP and first.policy_version == 0
    assert [g.group_id for g in run.op.training_batch(after_id=1, limit=10).groups] == [2]
    assert [g.group_id for g in run.op.training_batch(after_id=0, limit=1).groups] == [1]
    assert run.op.training_batch(after_id=2, limit=10).groups == []

    # Verdicts again on decided groups (another verifier's, on groups it claimed again): ignored...
    state = run.accepted_state()
    run.op.verdicts([m.Verdict(group_id=g2, accepted=True, rewards=[1.0] * GROUP),
                     m.Verdict(group_id=g1, accepted=False), m.Verdict(group_id=999, accepted=False)])
    assert run.accepted_state() == state
    assert node.heartbeat(0) is None  # not banned
    # ...except a ban: a failed check is final whatever landed first. What was accepted stays accepted.
    run.op.verdicts([m.Verdict(group_id=g1, accepted=False, ban=True, reason="replay failed")])
    after = run.accepted_state()
    assert after[:4] == state[:4] and after[5] == state[5]  # the same counts and the same feed
    refused(lambda: node.heartbeat(0), 403, "banned")


def test_ban_drops_pending_groups(run: Run) -> None:
    cheat, honest = run.node("cheat"), run.node("honest")
    cheat.submit(submission(cheat.lease(3, 0)))
    honest.submit(submission(honest.lease(1, 0)))
    cheat_lease = cheat.lease(1, 0)
    pending = run.op.pending(limit=10)
    mine = [p.group_id for p in pending if p.node_id == cheat.identity.node_id]
    theirs = [p.group_id for p in pending if p.node_id == honest.identity.node_id]
    run.op.verdicts([m.Verdict(group_id=mine[0], accepted=True, rewards=[1.0] * GROUP)])
    run.op.verdicts([m.Verdict(group_id=mine[1], accepted=False, reason="logprobs forged", ban=True)])

    st = run.op.status()
    nodes = {n.name: n for n in st.nodes}
    assert nodes["cheat"].banned and not nodes["honest"].banned
    assert (nodes["cheat"].groups_accepted, nodes["cheat"].groups_rejected) == (1, 2)
    assert (st.groups_pending, st.groups_accepted, st.groups_rejected) == (1, 1, 2)
    assert [g.group_id for g in run.op.training_batch(0, 10).groups] == [1]  # released groups stay

    run.clock.advance(run.cfg.claim_ttl_s + 1)
    assert [p.group_id for p in run.op.pending(10)] == theirs
    for call in (lambda: cheat.lease(1, 0), lambda: cheat.heartbeat(0), lambda: cheat.register(),
                 lambda: cheat.submit(submission(cheat_lease))):
        refused(call, 403, "logprobs forged")


# -- manifests and shards -----------------------------------------------------------------------------


def test_publish_rules_and_shard_serving(run_factory) -> None:
    run = run_factory(keep_versions=3)
    ckpt = run.tmp / "ckpt"
    ckpt.mkdir()
    payload = secrets.token_bytes(3000)
    (ckpt / "model.safetensors").write_bytes(payload)
    (ckpt / "config.json").write_text("{}")
    local = ShardStore(run.tmp / "local")
    manifest = cut_checkpoint(ckpt, run_id=run.cfg.run.run_id, version=0, store=local, shard_size=1024)
    refs = manifest.shards()

    err = refused(lambda: run.op.publish(manifest), 409, "missing")
    assert refs[0].sha256 in err.reason
    for ref in refs[:-1]:
        run.op.upload_shard(ref.sha256, local.get(ref.sha256))
    refused(lambda: run.op.publish(manifest), 409, refs[-1].sha256)
    refused(lambda: run.op.upload_shard(refs[-1].sha256, b"not the shard"), 422, "another shard")
    run.op.upload_shard(refs[-1].sha256, local.get(refs[-1].sha256))
    refused(lambda: run.op.publish(manifest.model_copy(update={"run_id": "other"})), 409, "run")
    assert run.op.info().current_version == -1

    signed = run.op.publish(manifest)
    info = run.op.info()
    assert info.current_version == 0
    got = signed.verify(info.coordinator_key)
    assert got.version == 0 and got.created_at > 0 and got.files == manifest.files
    latest = CoordinatorClient(run.url).latest_manifest()
    assert latest is not None and latest.verify(info.coordinator_key) == got
    refused(lambda: run.op.publish(manifest), 409, "not newer")

    # Shards come back byte for byte; the checkpoint reassembles from them.
    anon = CoordinatorClient(run.url, retries=0)
    for ref in refs:
        assert anon.shard(ref.sha256) == local.get(ref.sha256)
    from swarmrl.transfer.store import assemble_checkpoint

    out = assemble_checkpoint(got, anon.shard, run.tmp / "assembled")
    assert (out / "model.safetensors").read_bytes() == payload
    assert httpx.get(f"{run.url}/v1/shards/{'0' * 64}").status_code == 404
    assert httpx.get(f"{run.url}/v1/shards/not-a-hash").status_code == 400
    assert httpx.get(f"{run.url}/v1/shards/{'A' * 64}").status_code == 400
    assert httpx.get(f"{run.url}/v1/manifest/0").json()["manifest"]["version"] == 0
    resp = httpx.get(f"{run.url}/v1/manifest/7")
    assert resp.status_code == 404 and "7" in resp.json()["detail"]

    # Only the newest keep_versions manifests keep their shards.
    for v in (1, 2, 3):
        run.publish(v, tag=str(v))
    assert httpx.get(f"{run.url}/v1/shards/{refs[0].sha256}").status_code == 404
    newest = run.op.latest_manifest()
    assert newest is not None and newest.manifest.version == 3
    for v in (1, 2, 3):
        m_v = m.SignedManifest.model_validate_json(httpx.get(f"{run.url}/v1/manifest/{v}").content)
        for ref in m_v.verify(info.coordinator_key).shards():
            assert anon.shard(ref.sha256)


def test_a_pending_groups_weights_are_kept_however_far_the_trainer_moves_on(run_factory) -> None:
    """A group submitted within the staleness bound is verified with its own version's weights, even when the
    trainer publishes faster than the verifiers check: that version's shards are kept while it has pending groups."""
    run = run_factory(keep_versions=3)
    v0 = run.publish(0, tag="0").verify(run.op.info().coordinator_key)
    node = run.node()
    node.submit(submission(node.lease(1, 0)))
    for v in (1, 2, 3, 4):
        run.publish(v, tag=str(v))
    for ref in v0.shards():  # still pending: still served
        assert httpx.get(f"{run.url}/v1/shards/{ref.sha256}").status_code == 200
    (pending,) = run.op.pending(limit=8)
    run.op.verdicts([m.Verdict(group_id=pending.group_id, accepted=True, rewards=[1.0] * GROUP)])
    run.publish(5, tag="5")  # the next collection drops them
    assert all(httpx.get(f"{run.url}/v1/shards/{ref.sha256}").status_code == 404 for ref in v0.shards())


def test_shard_upload_checks(run_factory) -> None:
    run = run_factory()
    data = secrets.token_bytes(2048)
    from swarmrl.protocol.manifest import sha256_bytes

    sha = sha256_bytes(data)
    op = run.op.identity
    put = lambda headers, body=data, path=sha: httpx.put(  # noqa: E731
        f"{run.url}/v1/trainer/shards/{path}", content=body, headers=headers)
    header = lambda body=data, kind=m.KIND_TRAINER_SHARD, who=op: {  # noqa: E731
        SIGNATURE_HEADER: sign(who, kind, run.pool, body).header()}
    assert put({}).status_code == 401
    assert put(header(b"another shard")).status_code == 422  # signed for another shard than the URL's
    assert put(header(kind=m.KIND_TRAINER_PUBLISH)).status_code == 401
    assert put(header(who=Identity.generate())).status_code == 403  # not an operator
    assert put(header(), body=data[:-1] + b"!").status_code == 401  # not the bytes signed
    too_big = b"z" * (run.cfg.max_shard_bytes + 1)
    assert put(header(too_big), too_big, sha256_bytes(too_big)).status_code == 413
    assert httpx.get(f"{run.url}/v1/shards/{sha}").status_code == 404
    headers = header()
    assert put(headers).status_code == 204
    assert put(headers).status_code == 409  # replayed
    assert httpx.get(f"{run.url}/v1/shards/{sha}").content == data


# -- metrics, dashboard, restart ----------------------------------------------------------------------


def test_metrics_status_and_dashboard(run: Run) -> None:
    run.op.metrics(step=1, version=0, metrics={"reward_mean": 0.25, "eval/accuracy": 0.1})
    run.op.metrics(step=2, version=1, metrics={"reward_mean": 0.5, "eval/accuracy": 0.2, "eval_accuracy": 0.3,
                                               "step": 7.0})
    st = run.op.status()
    assert [(x.step, x.metrics["reward_mean"]) for x in st.metrics] == [(1, 0.25), (2, 0.5)]
    page = httpx.get(run.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/status" in page.text and "<svg" in page.text
    assert "cdn" not in page.text.lower() and "src=" not in page.text
    prom = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(httpx.get(run.url + "/metrics").text) for s in f.samples}
    assert prom[("swarmrl_coordinator_groups", (("status", "accepted"),))] == 0
    assert prom[("swarmrl_coordinator_current_version", ())] == 0
    assert prom[("swarmrl_coordinator_info", (("key", run.key.public_key_hex), ("run", "test-run")))] == 1
    assert prom[("swarmrl_coordinator_trainer_metric", (("metric", "reward_mean"),))] == 0.5
    assert prom[("swarmrl_coordinator_trainer_metric", (("metric", "eval/accuracy"),))] == 0.2
    # Keys are label values: keys that would sanitize alike, or match another family's name, stay apart.
    assert prom[("swarmrl_coordinator_trainer_metric", (("metric", "eval_accuracy"),))] == 0.3
    assert prom[("swarmrl_coordinator_trainer_metric", (("metric", "step"),))] == 7
    assert prom[("swarmrl_coordinator_trainer_step", ())] == 2


def test_a_fresh_store_under_the_same_key_and_run_id_is_another_pool(run_factory, tmp_path: Path) -> None:
    op_key = Identity.generate()
    run = run_factory(data_dir=tmp_path / "pool", op_key=op_key)
    run.publish(0)
    node = run.node()
    captured = signed(node.identity, m.KIND_LEASE, run.pool, m.LeaseRequest(max_prompts=1))
    assert post(run.url, "/v1/lease", captured)[0] == 200
    run_factory.stop_last()
    # A fresh store (another data dir: another SQLite file or PostgreSQL database), the same key file and run.
    again = run_factory(data_dir=tmp_path / "fresh", key_path=run.cfg.resolved_key_path, op_key=op_key)
    assert again.key.public_key_hex == run.key.public_key_hex and again.pool != run.pool
    status, detail = post(again.url, "/v1/lease", captured)
    assert status == 401 and "another pool" in detail


def test_restart_keeps_state(run_factory, tmp_path: Path) -> None:
    data_dir = tmp_path / "persist"
    op_key = Identity.generate()
    run = run_factory(data_dir=data_dir, op_key=op_key)
    published = run.publish(0)
    node = run.node("survivor")
    lease = node.lease(2, 0)
    node.submit(submission(lease))
    pending = run.op.pending(10)
    run.op.verdicts([m.Verdict(group_id=pending[0].group_id, accepted=True, rewards=[1.0, 0.5, 0.0]),
                     m.Verdict(group_id=pending[1].group_id, accepted=False, reason="wrong")])
    run.op.metrics(step=3, version=0, metrics={"reward": 0.5})
    state = run.accepted_state()
    info = run.op.info()
    run_factory.stop_last()

    again = run_factory(data_dir=data_dir, op_key=op_key)
    assert again.key.public_key_hex == run.key.public_key_hex  # same key file
    assert again.accepted_state() == state
    assert again.op.info() == info
    assert again.op.latest_manifest() == published
    # node_idle_s is the coordinator's: no node reported any time, so 0 (and no node_idle_frac).
    assert again.op.status().metrics[0].metrics == {"reward": 0.5, "node_idle_s": 0.0}
    node2 = CoordinatorClient(again.url, node.identity, retries=0)  # still registered: no new registration
    lease2 = node2.lease(2, 0)
    assert not {p.prompt_id for p in lease2.prompts} & {p.prompt_id for p in lease.prompts}
    assert node2.submit(submission(lease2)).rejected == {}
    again.publish(1)
    refused(lambda: again.op.publish(published.manifest), 409, "not newer")
