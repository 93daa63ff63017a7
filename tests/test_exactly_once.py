"""Exactly once under retries: every state-changing request whose answer is lost after the coordinator applied it
(a proxy drops the first answer of each, `swarmrl.testing.proxy`) is retried by the real client with the same
Idempotency-Key and a fresh signature, gets the original answer, and is applied once: registration, lease,
submission, claim, verdicts, publish, acknowledgement, metrics. Counted in the database itself. Also: a key
reused for another request is a 422, the exact same bytes sent twice get the stored answer, and two tries of one
request at once apply it once. Real uvicorn, Ed25519, SQLite (and the same tests on PostgreSQL: `both_stores`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest
from sqlalchemy import create_engine, text

from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import IDEMPOTENCY_HEADER, CoordinatorClient
from swarmrl.runtime.retry import RetryPolicy
from swarmrl.testing.proxy import LossyProxy, first_try_of
from swarmrl.transfer.store import ShardStore, cut_checkpoint
from tests.support.coordinator import GROUP, Run, signed, submission

pytestmark = pytest.mark.both_stores  # each test on SQLite and on PostgreSQL (conftest.py)


RETRY = RetryPolicy(attempts=4, base_s=0.001, cap_s=0.01)
STATE_CHANGING = {"/v1/register", "/v1/lease", "/v1/submit", "/v1/verifier/pending", "/v1/verifier/verdicts",
                  "/v1/trainer/publish", "/v1/trainer/ack", "/v1/trainer/metrics"}


def count(run: Run, sql: str) -> int:
    """A count straight from the coordinator's database."""
    engine = create_engine(run.cfg.resolved_store_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(sql)).scalar_one())
    finally:
        engine.dispose()


def test_every_request_whose_answer_is_lost_is_applied_once(run_factory: Callable[..., Run]) -> None:
    run = run_factory()
    run.publish(0)
    with LossyProxy(run.url, drop=first_try_of(STATE_CHANGING)) as proxy:
        node = CoordinatorClient(proxy.url, Identity.generate(), retry=RETRY)
        op = CoordinatorClient(proxy.url, run.op.identity, retry=RETRY)

        registered = node.register(name="lossy", engine="torch")
        assert registered.node_id == node.identity.node_id
        assert [e.path for e in proxy.events].count("/v1/register/challenge") == 1  # no second challenge needed

        lease = node.lease(3, 0)
        assert lease is not None and len(lease.prompts) == 3
        assert count(run, "SELECT COUNT(*) FROM leases") == 1

        result = node.submit(submission(lease))
        assert sorted(result.accepted) == sorted(p.prompt_id for p in lease.prompts) and result.rejected == {}
        assert count(run, "SELECT COUNT(*) FROM rollout_groups") == 3

        claimed = op.pending(10)
        assert len(claimed) == 3
        assert count(run, "SELECT COUNT(*) FROM rollout_groups WHERE claimed_by IS NOT NULL") == 3

        op.verdicts([m.Verdict(group_id=g.group_id, accepted=True, rewards=[1.0] * GROUP) for g in claimed])
        st = run.op.status()
        assert st.groups_accepted == 3 and st.nodes[0].groups_accepted == 3  # counted once, not twice
        assert count(run, "SELECT MAX(accepted_seq) FROM rollout_groups") == 3

        acked = op.ack(3)
        assert (acked.acked, acked.head) == (3, 3)

        op.metrics(step=1, version=0, metrics={"reward_mean": 0.5})
        assert count(run, "SELECT COUNT(*) FROM metrics") == 1

        ckpt = run.tmp / "ckpt-1"
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_bytes(b"v1" * 700)
        local = ShardStore(run.tmp / "lossy-shards")
        manifest = cut_checkpoint(ckpt, run_id=run.cfg.run.run_id, version=1, store=local, shard_size=1024)
        for ref in manifest.shards():
            op.upload_shard(ref.sha256, local.get(ref.sha256))
        published = op.publish(manifest)
        assert published.manifest.version == 1 and run.op.latest_manifest() == published

        for path in STATE_CHANGING:  # every kind of request really lost its first answer, and was retried
            assert len(proxy.dropped(path)) == 1, (path, proxy.events)
            assert any(e.path == path and not e.dropped for e in proxy.events), path
        node.close()
        op.close()


def test_a_key_answers_only_the_request_it_was_first_used_for(run: Run) -> None:
    node = run.node()
    key = {IDEMPOTENCY_HEADER: "k" * 32}

    def lease_request(who: Identity, max_prompts: int = 1) -> tuple[bytes, dict[str, str]]:
        body, headers = signed(who, m.KIND_LEASE, run.pool, m.LeaseRequest(max_prompts=max_prompts, held_version=0))
        return body, {**headers, **key}

    first_body, first_headers = lease_request(node.identity)
    resp = httpx.post(run.url + "/v1/lease", content=first_body, headers=first_headers)
    assert resp.status_code == 200
    # The exact same bytes again (a client that resent its request): the stored answer, not a replay refusal.
    again = httpx.post(run.url + "/v1/lease", content=first_body, headers=first_headers)
    assert again.status_code == 200 and again.content == resp.content
    # Without its key, the same bytes are a replay.
    replayed = httpx.post(run.url + "/v1/lease", content=first_body,
                          headers={k: v for k, v in first_headers.items() if k != IDEMPOTENCY_HEADER})
    assert replayed.status_code == 409
    # A fresh signature of the same request: the same answer.
    fresh_body, fresh_headers = lease_request(node.identity)
    assert httpx.post(run.url + "/v1/lease", content=fresh_body, headers=fresh_headers).content == resp.content
    # Another request under the same key: refused, and it changed nothing.
    other_body, other_headers = lease_request(node.identity, max_prompts=2)
    refused = httpx.post(run.url + "/v1/lease", content=other_body, headers=other_headers)
    assert refused.status_code == 422 and "Idempotency-Key" in refused.json()["detail"]
    assert count(run, "SELECT COUNT(*) FROM leases") == 1
    # The key is the signer's own: another node using the same key gets its own answer.
    stranger = run.node("stranger")
    mine_body, mine_headers = lease_request(stranger.identity)
    assert httpx.post(run.url + "/v1/lease", content=mine_body, headers=mine_headers).status_code == 200
    assert count(run, "SELECT COUNT(*) FROM leases") == 2
    # Malformed keys are refused with a reason.
    bad_body, bad_headers = lease_request(node.identity)
    resp = httpx.post(run.url + "/v1/lease", content=bad_body, headers={**bad_headers, IDEMPOTENCY_HEADER: "a b"})
    assert resp.status_code == 422 and "Idempotency-Key" in resp.json()["detail"]


def test_two_tries_at_once_apply_the_request_once(run: Run) -> None:
    node = run.node()
    lease = node.lease(2, 0)
    key = {IDEMPOTENCY_HEADER: "same-request-key"}
    payload = submission(lease)
    answers: list[httpx.Response] = []
    start = threading.Barrier(4)

    def send() -> None:
        body, headers = signed(node.identity, m.KIND_SUBMIT, run.pool, payload)  # each try signed afresh
        start.wait()
        answers.append(httpx.post(run.url + "/v1/submit", content=body, headers={**headers, **key}))

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {a.status_code for a in answers} == {200}
    assert len({a.content for a in answers}) == 1  # every try got the one answer
    assert sorted(m.SubmitResult.model_validate_json(answers[0].content).accepted) == sorted(
        p.prompt_id for p in lease.prompts)
    assert count(run, "SELECT COUNT(*) FROM rollout_groups") == 2


@pytest.fixture
def run(run_factory: Callable[..., Run]) -> Run:
    r = run_factory()
    r.publish(0)
    return r


def test_byte_for_byte_resends_are_charged_to_their_source_not_their_signer(run_factory) -> None:
    """A captured keyed request sent again byte for byte gets the stored answer, which costs the coordinator many
    times what sending it did: such resends are charged to the address sending them (clients sign each retry
    afresh, so an honest one never sends them), never to the signer, whose own requests go on."""
    from swarmrl.coordinator.ratelimit import RateLimitConfig

    run = run_factory(rate_limits=RateLimitConfig(resend_rate_per_s=1e-9, resend_burst=3))
    run.publish(0)
    node = run.node()
    body, headers = signed(node.identity, m.KIND_LEASE, run.pool, m.LeaseRequest(max_prompts=1, held_version=0))
    headers = {**headers, IDEMPOTENCY_HEADER: "c" * 32}
    first = httpx.post(run.url + "/v1/lease", content=body, headers=headers)
    assert first.status_code == 200
    for _ in range(3):  # the burst: the stored answer
        assert httpx.post(run.url + "/v1/lease", content=body, headers=headers).content == first.content
    over = httpx.post(run.url + "/v1/lease", content=body, headers=headers)
    assert over.status_code == 429 and over.json()["code"] == "rate_limited" and "Retry-After" in over.headers
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as elsewhere:
        assert elsewhere.post(run.url + "/v1/lease", content=body, headers=headers).content == first.content
    # The signer is not charged: its own retry (signed afresh, same key) and its next request are answered.
    fresh_body, fresh_headers = signed(node.identity, m.KIND_LEASE, run.pool,
                                       m.LeaseRequest(max_prompts=1, held_version=0))
    retry = httpx.post(run.url + "/v1/lease", content=fresh_body,
                       headers={**fresh_headers, IDEMPOTENCY_HEADER: "c" * 32})
    assert retry.status_code == 200 and retry.content == first.content
    assert node.heartbeat(0) is None
