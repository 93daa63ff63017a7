"""Admission and fairness against a real coordinator (uvicorn on loopback, real Ed25519, SQLite): hoarding does not
stall honest nodes, allowances follow verified work and abandoned prompts, abandoned and expired prompts are leased
again to others, fresh identities fill only their share of the buffer, rate limits per source and per identity
answer 429 with Retry-After, registration cannot be locked by one source, and the prompt stream is secret.

Time-dependent rules use the coordinator's injected clock; rate limits use rates so low that no bucket refills
during a test, so nothing here depends on how fast the machine is."""

from __future__ import annotations

import httpx
import pytest

from swarmrl.coordinator.ratelimit import RateLimitConfig
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient
from tests.support.coordinator import Run, hoard, post, refused, signed, submission

pytestmark = pytest.mark.both_stores  # each test on SQLite and on PostgreSQL (conftest.py)

NEW = 8  # admission.new_identity_prompts, the default


def _accept_and_train(run: Run) -> int:
    """The verifier accepts (checked) everything pending; the trainer takes and acknowledges the feed."""
    pending = run.op.pending(1000)
    if pending:
        run.op.verdicts([m.Verdict(group_id=g.group_id, accepted=True, rewards=[0.0] * len(g.group.rollouts))
                         for g in pending])
    batch = run.op.training_batch(after_id=0, limit=4096)
    if batch.groups:
        run.op.ack(batch.groups[-1].group_id)
    return len(pending)


def _row(run: Run, node: CoordinatorClient) -> m.NodeStatus:
    return next(n for n in run.op.status().nodes if n.node_id == node.identity.node_id)


# -- leases ---------------------------------------------------------------------------------------------------


def test_a_hoarder_does_not_stall_honest_nodes(run_factory) -> None:
    """Backpressure on, as in the demo: a fresh identity that leases the most it can and never submits holds its
    small allowance only, and an honest node keeps getting full leases round after round."""
    run = run_factory(max_buffered_groups=32, max_staleness=1)
    run.publish(0)
    hoarder = run.node("hoarder")
    assert sum(len(lease.prompts) for lease in hoard(hoarder)) == NEW
    honest = run.node("honest")
    for _ in range(6):
        lease = honest.lease(NEW, 0)
        assert lease is not None and len(lease.prompts) == NEW
        assert honest.submit(submission(lease)).rejected == {}
        assert _accept_and_train(run) == NEW
        hoard(hoarder)  # the hoarder takes whatever it may, every round
    assert _row(run, honest).groups_accepted == 6 * NEW and _row(run, hoarder).prompts_leased == NEW


def test_fresh_identities_fill_only_the_unproven_share(run_factory) -> None:
    """Any number of free identities together hold at most admission.unproven_share of the buffer: a node with a
    verified record is not kept waiting by them."""
    # The unproven share: 8 prompts; one identity may hold the whole buffer here.
    run = run_factory(max_buffered_groups=16, max_staleness=1, admission={"max_identity_share": 1.0})
    run.publish(0)
    proven = run.node("proven", source="127.0.0.2")  # another machine: the sybils' abandoned leases are not its
    proven.submit(submission(proven.lease(NEW, 0)))
    _accept_and_train(run)
    sybils = [run.node(f"sybil{i}") for i in range(4)]
    got = [s.lease(NEW, 0) for s in sybils]
    assert got[0] is not None and len(got[0].prompts) == NEW and got[1:] == [None, None, None]
    run.clock.advance(80.0)  # allowance grows no faster than time: 8 prompts take 80 s (allowance_growth_per_s)
    lease = proven.lease(2 * NEW, 0)  # its allowance grew with its 8 accepted groups: 16
    assert lease is not None and len(lease.prompts) == 2 * NEW


def test_one_source_shares_one_newcomers_allowance(run_factory) -> None:
    """Identities made on one machine share `admission.unproven_per_source` while unproven; other sources do not."""
    run = run_factory(max_buffered_groups=1000)
    run.publish(0)
    here = [run.node(f"here{i}") for i in range(3)]
    assert [len(lease.prompts) if lease else None for lease in (n.lease(NEW, 0) for n in here)] == [NEW, NEW, None]
    there = CoordinatorClient(run.url, Identity.generate(), retries=0,
                              transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    there.register(name="there")
    assert len(there.lease(NEW, 0).prompts) == NEW


def test_allowance_grows_with_verified_work_and_falls_with_abandoned_prompts(run_factory) -> None:
    run = run_factory(lease_ttl_s=30.0)
    run.publish(0)
    node = run.node()
    first = node.lease(m.MAX_PROMPTS_PER_LEASE, 0)
    assert len(first.prompts) == NEW and _row(run, node).lease_allowance == NEW
    body, headers = signed(node.identity, m.KIND_LEASE, run.pool, m.LeaseRequest(max_prompts=1, held_version=0))
    resp = httpx.post(run.url + "/v1/lease", content=body, headers=headers)
    assert resp.status_code == 429 and "may hold" in resp.json()["detail"]
    assert 1 <= int(resp.headers["retry-after"]) <= 30  # until its lease expires
    node.submit(submission(first))
    _accept_and_train(run)
    run.clock.advance(80.0)  # no faster than time: 0.1 prompt per second since it registered
    grown = node.lease(m.MAX_PROMPTS_PER_LEASE, 0)
    assert len(grown.prompts) == 2 * NEW  # 8 + 1 per accepted group
    run.clock.advance(31.0)  # it expires unsubmitted: 16 prompts abandoned of 24 leased
    later = node.lease(m.MAX_PROMPTS_PER_LEASE, 0)
    row = _row(run, node)
    assert (row.prompts_leased, row.prompts_abandoned) == (24 + len(later.prompts), 16)
    # Earned 16, less 1 per abandoned prompt, times (1 - 16 / (24 + 8))^2: 0 -> the floor of 1.
    assert len(later.prompts) == 1


def test_expired_and_left_out_prompts_are_leased_again_to_other_sources_with_their_seeds(run_factory) -> None:
    run = run_factory(lease_ttl_s=30.0, admission={"same_source_after_s": 100.0})
    run.publish(0)
    a, b, sybil = run.node("a"), run.node("b", source="127.0.0.2"), run.node("a's other identity")
    expired = a.lease(4, 0)
    partial = a.lease(4, 0)
    a.submit(submission(partial, prompts=partial.prompts[:1]))  # settles the lease: 3 left out
    run.clock.advance(31.0)
    # An identity of the abandoner's own source gets none of them (it could pass them round until it liked one).
    kept = {p.text for lease in (expired, partial) for p in lease.prompts}
    assert not {p.text for p in sybil.lease(NEW, 0).prompts} & kept
    again = b.lease(NEW, 0)
    texts = [p.text for p in again.prompts]
    assert texts[:3] == [p.text for p in partial.prompts[1:]]  # oldest abandoned first
    assert texts[3:7] == [p.text for p in expired.prompts]
    # With the seeds they had: on the same version, whoever generates a prompt again makes the same group.
    assert [p.seeds for p in again.prompts[:7]] == [p.seeds for p in (*partial.prompts[1:], *expired.prompts)]
    assert again.lease_id not in {expired.lease_id, partial.lease_id}
    # The answers went along: the verifier is handed the same ground truth for the re-leased prompt.
    b.submit(submission(again))
    pending = {g.prompt_text: g for g in run.op.pending(100)}
    a_text = partial.prompts[1].text
    x, y = a_text[:-1].split("+")
    assert pending[a_text].answer == str(int(x) + int(y))
    # And never back to the identity that abandoned them.
    assert _row(run, a).prompts_abandoned == 7
    refill = a.lease(NEW, 0)
    assert not {p.text for p in refill.prompts} & set(texts[:7])


def test_the_prompt_stream_is_secret(run_factory, tmp_path) -> None:
    """Drawn from a secret made on first start (0600, never served): two runs with the default settings lease
    different prompts, neither is the stream of the old default seed, and the secret appears in no answer."""
    texts = {}
    for name, extra in (("a", {}), ("b", {}), ("seed0", {"prompt_seed": 0})):
        run = run_factory(data_dir=tmp_path / name, **extra)
        run.publish(0, tag=name)
        texts[name] = [p.text for p in run.node().lease(NEW, 0).prompts]
        secret = (tmp_path / name / "run.secret").read_text().strip()
        assert oct((tmp_path / name / "run.secret").stat().st_mode & 0o777) == "0o600"
        for path in ("/v1/info", "/v1/status", "/metrics", "/"):
            assert secret not in httpx.get(run.url + path).text
        run_factory.stop_last()
    assert len({tuple(t) for t in texts.values()}) == 3


# -- rate limits and registration -----------------------------------------------------------------------------

SLOW = 1e-4  # tokens per second: no bucket refills during a test


def _from(address: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address))


def test_a_source_over_its_rate_is_answered_429_before_its_body_is_read(run_factory) -> None:
    run = run_factory(rate_limits=RateLimitConfig(source_rate_per_s=SLOW, source_burst=3))
    noisy, other = _from("127.0.0.1"), _from("127.0.0.2")
    assert [noisy.get(run.url + "/v1/info").status_code for _ in range(3)] == [200] * 3
    resp = noisy.post(run.url + "/v1/submit", content=b"x" * (run.cfg.max_body_bytes + 1))
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1  # not 413: the body was never read
    assert "address" in resp.json()["detail"]
    assert other.get(run.url + "/v1/info").status_code == 200  # another source is not affected


def test_one_source_cannot_lock_registration(run_factory) -> None:
    """Challenges cost nothing to store (a MAC under the run's secret) and are limited per source: a source asking
    for them without end is refused, and every other source still registers."""
    run = run_factory(rate_limits=RateLimitConfig(registration_rate_per_s=SLOW, registration_burst=5))
    flood = _from("127.0.0.1")
    codes = [flood.post(run.url + "/v1/register/challenge", json={"public_key": Identity.generate().public_key_hex}
                        ).status_code for _ in range(50)]
    assert codes[:5] == [200] * 5 and set(codes[5:]) == {429}
    resp = flood.post(run.url + "/v1/register/challenge", json={"public_key": Identity.generate().public_key_hex})
    assert int(resp.headers["retry-after"]) >= 1
    newcomer = CoordinatorClient(run.url, Identity.generate(), retries=0,
                                 transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    assert newcomer.register(name="newcomer").node_id == newcomer.identity.node_id


def test_a_trusted_proxys_header_names_the_source(run_factory) -> None:
    limits = RateLimitConfig(source_rate_per_s=SLOW, source_burst=2, source_header="x-forwarded-for",
                             trusted_proxies=["127.0.0.1"])
    run = run_factory(rate_limits=limits)
    proxy, stranger = _from("127.0.0.1"), _from("127.0.0.2")
    via = lambda client, ip: client.get(run.url + "/v1/info", headers={"x-forwarded-for": f"10.0.0.9, {ip}"})  # noqa
    assert [via(proxy, "192.0.2.1").status_code for _ in range(3)] == [200, 200, 429]
    assert via(proxy, "192.0.2.2").status_code == 200  # another client behind the proxy
    # From an address that is not a trusted proxy the header is ignored: the connection is the source.
    assert [via(stranger, f"192.0.2.{i}").status_code for i in range(10, 13)] == [200, 200, 429]


def test_an_identity_over_its_rate_is_refused_and_nobody_else_pays(run_factory) -> None:
    run = run_factory(rate_limits=RateLimitConfig(identity_rate_per_s=SLOW, identity_burst=4))
    run.publish(0)
    node, other = run.node("busy"), run.node("other")  # registering cost each one request
    replay = signed(node.identity, m.KIND_HEARTBEAT, run.pool, m.Heartbeat())
    assert post(run.url, "/v1/heartbeat", replay)[0] == 204
    for _ in range(5):  # replays are refused without spending the signer's requests
        assert post(run.url, "/v1/heartbeat", replay) == (409, "replayed request")
    node.heartbeat(0)
    node.heartbeat(0)
    err = refused(lambda: node.heartbeat(0), 429, "identity")
    assert err.reason
    other.heartbeat(0)  # its own budget
    for _ in range(10):
        run.op.pending(1)  # operators are not limited
