"""In-flight weight updates (`SamplingSpec.in_flight_updates`): a node loads a newer version between decode chunks,
its groups record the version of each span of tokens, the verifier replays each span with its version, staleness is
judged by the oldest span, and a node that lies about a span's version is caught and banned
(`testing.byzantine.inflight`; bench/inflight_updates.py runs the same for >= 500 groups).

The pool tests run a real coordinator on loopback and the real verifier; the node engine is the torch one (and vLLM
on the CPU, marked `vllm`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from swarmrl.node.engine import EngineConfig, GenerationRequest, InferenceEngine
from swarmrl.node.engines import build_engine
from swarmrl.node.inflight import Updates, generate_in_flight
from swarmrl.protocol import messages as m
from swarmrl.protocol.run import RunSpec
from swarmrl.protocol.validation import group_problem, version_spans_problem
from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool, perturb_checkpoint
from swarmrl.testing.byzantine.inflight import SAMPLING, SpanLiar
from swarmrl.testing.groups import pending_group
from swarmrl.verifier.checks import CheckContext, check_versions
from tests.support.coordinator import GROUP, MAX_TOKENS, submission


def _group(spans: list[tuple[int, int]], lengths: tuple[int, ...] = (12, 12, 5, 1)) -> m.RolloutGroup:
    rollouts = [m.Rollout(seed=i, completion_ids=[3] * n, logprobs=[-0.5] * n, finish_reason="length")
                for i, n in enumerate(lengths)]
    return m.RolloutGroup(prompt_id="p", prompt_ids=[1, 2], rollouts=rollouts, version_spans=spans)


# -- the protocol -------------------------------------------------------------------------------------------------

def test_the_run_description_refuses_in_flight_updates_it_cannot_honour():
    with pytest.raises(ValidationError, match="in_flight_updates needs max_staleness >= 1"):
        RunSpec(max_staleness=0, sampling=SAMPLING)
    assert RunSpec(max_staleness=1, sampling=SAMPLING).sampling.in_flight_updates
    assert not m.SamplingSpec().in_flight_updates  # off unless the run says so


@pytest.mark.parametrize("spans", [[(1, 0)], [(0, 0), (0, 1)], [(0, 1), (4, 1)], [(0, 2), (4, 1)]])
def test_malformed_spans_are_refused_whole(spans):
    with pytest.raises(ValidationError, match="version span"):
        _group(spans)


def test_the_first_span_is_the_submissions_version():
    with pytest.raises(ValidationError, match="first version span is of version 1"):
        m.RolloutSubmission(lease_id="l", policy_version=0, groups=[_group([(0, 1), (4, 2)])])
    m.RolloutSubmission(lease_id="l", policy_version=1, groups=[_group([(0, 1), (4, 2)])])


def test_spans_are_checked_against_the_run_and_the_published_versions():
    two = _group([(0, 3), (4, 4)])
    assert group_problem(two, seeds=[0, 1, 2, 3], sampling=SAMPLING) is None
    assert "no in-flight updates" in group_problem(two, [0, 1, 2, 3], SAMPLING.model_copy(
        update={"in_flight_updates": False}))
    assert "past every rollout's last token" in group_problem(_group([(0, 3), (12, 4)]), [0, 1, 2, 3], SAMPLING)
    assert version_spans_problem(two, 3, max_staleness=1, newest_published=4) is None
    assert "newer than the newest published 3" in version_spans_problem(two, 3, 1, newest_published=3)
    assert "more than max_staleness 1" in version_spans_problem(_group([(0, 3), (4, 5)]), 3, 1)
    assert version_spans_problem(_group([]), 3, 1, newest_published=3) is None  # an old client's group


def test_the_node_signature_covers_the_spans():
    """A group's spans are signed with it: a coordinator that rewrote them would have the group refused."""
    from swarmrl.protocol.groupsig import sign_group, verify_group
    from swarmrl.protocol.identity import Identity
    from swarmrl.protocol.signing import SignatureError

    node = Identity.generate()
    facts = {"lease_id": "l", "policy_version": 3, "pool": "p"}
    signed = sign_group(node, _group([(0, 3), (4, 4)]), **facts)
    verify_group(signed, node_key=node.public_key_hex, node_id=node.node_id, **facts)
    for spans in ([], [(0, 3), (5, 4)], [(0, 3), (4, 5)]):
        with pytest.raises(SignatureError):
            verify_group(signed.model_copy(update={"version_spans": spans}), node_key=node.public_key_hex,
                         node_id=node.node_id, **facts)


@pytest.mark.parametrize(("oldest", "newest", "lease", "fine"), [
    (3, 4, 3, True),     # swapped to a version published after the lease
    (4, 5, 3, True),     # started on a version newer than the lease's (held when it was in hand): within k
    (2, 3, 3, True),     # the oldest span is one behind
    (1, 2, 3, False),    # the oldest span is two behind: stale, although the newest is not
    (5, 6, 3, False),    # more than k after the lease
])
def test_staleness_is_judged_by_the_oldest_span(oldest, newest, lease, fine):
    g = pending_group(group_id=1, prompt_text="1+1=", answer="2", sampling=SAMPLING, seeds=[0, 1, 2, 3],
                      group=_group([(0, oldest), (4, newest)]), policy_version=oldest, lease_version=lease)
    ctx = CheckContext(tokenizer=None, task=None, run=RunSpec(max_staleness=1, sampling=SAMPLING))  # type: ignore
    assert (check_versions(g, ctx) is None) == fine, check_versions(g, ctx)


# -- the node's chunks ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_a_stopped_and_continued_generation_is_the_same_sample_as_one_go(tmp_path, engine):
    """Stopped by `generate_until` (the engine's own decode loop) and continued from its tokens at their completion
    positions, with no version change in between, a completion is the one a single call samples; so is the
    engines' default, chunked `generate_until`. (vLLM stops here because two of the six requests wait for a place in
    its batch of four: a span must start at one token index in every rollout.)"""
    if engine == "vllm":
        pytest.importorskip("vllm", exc_type=ImportError)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    eng = build_engine(EngineConfig(kind=engine, max_num_seqs=4), ckpt, 0.8)
    try:
        reqs = [GenerationRequest(prompt_ids=[1, 5, 6, 7], seed=s) for s in range(6)]
        whole = eng.generate(reqs, max_tokens=12)
        asked = []
        ready = lambda: asked.append(1) or len(asked) <= 2  # noqa: E731 - ready twice, then never
        calls = []
        until = eng.generate_until
        eng.generate_until = lambda *a, **kw: calls.append(until(*a, **kw)) or calls[-1]  # type: ignore[method-assign]
        out, spans = generate_in_flight(eng, reqs, 12, 3, version=7, updates=Updates(ready, lambda: None))
        in_flight = calls[:]  # the calls of the in-flight generation
        never = eng.generate_until(reqs, 12, lambda: False, every=1)
        chunked = InferenceEngine.generate_until(eng, reqs, 12, lambda: False, every=5)
    finally:
        eng.close()
    assert spans == [(0, 7)] and asked
    # Stopped once (the first look), then went on in one call: nothing ready, nothing stopped.
    assert len(in_flight) == 2 and any(c.interrupted for c in in_flight[0])
    assert not any(c.interrupted for c in in_flight[1])
    assert not any(c.interrupted for c in never + chunked)
    for got in (out, chunked):
        _assert_same_sample(got, whole)


@pytest.mark.vllm
def test_vllm_changes_weights_between_two_steps_without_stopping(tmp_path):
    """vLLM in this process with every completion at one token index loads a version between two steps and goes on
    in the same call: the load preempts the requests, and vLLM prefills their prompt and tokens so far again with the
    new weights. Loading the same weights twice (versions 8 and 9), the completions are the one-go sample, in one
    engine call, with spans at the two looks; loading other weights, the tokens from the first look on are theirs."""
    pytest.importorskip("vllm", exc_type=ImportError)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    other = perturb_checkpoint(ckpt, tmp_path / "other", 0.5)
    eng = build_engine(EngineConfig(kind="vllm"), ckpt, 0.8)
    try:
        assert eng.staged
        reqs = [GenerationRequest(prompt_ids=[1, 5, 6, 7], seed=s) for s in range(6)]
        whole = eng.generate(reqs, max_tokens=12)
        asked, versions = [], iter([8, 9])
        ready = lambda: asked.append(1) or len(asked) <= 2  # noqa: E731 - ready twice, then never
        calls = []
        until = eng.generate_until
        eng.generate_until = lambda *a, **kw: calls.append(until(*a, **kw)) or calls[-1]  # type: ignore[method-assign]
        out, spans = generate_in_flight(eng, reqs, 12, 3, version=7,
                                        updates=Updates(ready, lambda: eng.load(ckpt) or next(versions)))
        assert len(calls) == 1 and not any(c.interrupted for c in calls[0])
        # Other weights from token 3 on: what a continuation from the first 3 tokens samples with them.
        asked.clear()
        ready = lambda: asked.append(1) or len(asked) == 1  # noqa: E731 - once
        mixed, mixed_spans = generate_in_flight(eng, reqs, 12, 3, version=9,
                                                updates=Updates(ready, lambda: eng.load(other) or 10))
        continued = eng.generate([GenerationRequest(prompt_ids=r.prompt_ids + c.token_ids[:3], seed=r.seed,
                                                    position=3) for r, c in zip(reqs, whole, strict=True)], 9)
    finally:
        eng.close()
    assert max(len(c.token_ids) for c in whole) > 6  # every look found completions going
    assert spans == [(0, 7), (3, 8), (6, 9)]
    _assert_same_sample(out, whole)
    assert mixed_spans == [(0, 9), (3, 10)]
    for got, first, rest in zip(mixed, whole, continued, strict=True):
        if len(first.token_ids) <= 3:  # ended before the look
            assert got.token_ids == first.token_ids
            continue
        assert got.token_ids == first.token_ids[:3] + rest.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs[3:], rest.logprobs, strict=True)) < 1e-5
    assert [c.token_ids for c in mixed] != [c.token_ids for c in whole]  # the other weights sample otherwise


def _assert_same_sample(got, whole) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in whole]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in whole]
    assert max(abs(a - b) for c, w in zip(got, whole, strict=True)
               for a, b in zip(c.logprobs, w.logprobs, strict=True)) < 1e-5


# -- a pool ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_two_version_groups_pass_and_span_liars_are_banned(tmp_path, engine):
    if engine == "vllm":
        pytest.importorskip("vllm", exc_type=ImportError)
    v0 = make_checkpoint(tmp_path / "ckpt")
    with open_pool(tmp_path, v0, sampling=SAMPLING, max_staleness=1, verifier={"sample_rate": 1.0}) as pool:
        honest = pool.node(name="honest", engine=engine, max_prompts=2)
        # Four prompts each: a liar has a group that spans two versions to lie about but for all of its rollouts
        # ending before the version change in every group (about 1e-7).
        liars = [pool.node(SpanLiar, name=f"liar-{lie}", max_prompts=4, lie=lie) for lie in ("hide", "late", "early")]
        nodes = [honest, *liars]
        try:
            for n in nodes:
                n.step()  # version 0; the lease that came with the submission is of version 0 too
            pool.publish(perturb_checkpoint(v0, tmp_path / "v1", 0.02))
            for n in nodes:
                n.sync()  # version 1 is ready: not loaded for the lease of version 0 in hand ...
                n.step()  # ... until the first chunk boundary, in place
                assert n.stats.held_version == 1
        finally:
            for n in nodes:
                n.engine.close()
        sub = honest.last_submission
        assert sub.policy_version == 0
        # Every completion going was cut at one token index and continued with version 1: a group spans both
        # versions unless all its rollouts ended before that index (the coordinator's seeds decide; it is rare).
        swaps = {tuple(g.version_spans[1]) for g in sub.groups if g.version_spans}
        assert len(swaps) == 1 and next(iter(swaps))[1] == 1, sub.groups
        (at, _), = swaps
        for g in sub.groups:
            longest = max(len(r.completion_ids) for r in g.rollouts)
            assert g.version_spans == ([(0, 0), (at, 1)] if longest > at else []), (longest, g.version_spans)
        assert pool.verify_all() == sum(n.stats.groups_accepted for n in nodes) >= 4 + 3 * 2
        assert [g["status"] for g in pool.groups(honest.node_id)] == ["accepted"] * 4
        assert not pool.node_row(honest.node_id).banned
        for liar in liars:
            assert any(g.version_spans != t.version_spans for g, t in zip(
                liar.last_submission.groups, sub.groups, strict=False)) or liar.lie == "hide"
            rows = pool.groups(liar.node_id)
            assert any(r["status"] == "rejected" for r in rows), (liar.lie, rows)
            # Caught by the replay of a span with the version it claims (or, first, the probe of the first span).
            assert any(r["reason"].startswith("version ") for r in rows), [r["reason"] for r in rows]
            assert pool.node_row(liar.node_id).banned, liar.lie
        # The trainer's feed: the oldest span is the group's version.
        assert {g.policy_version for g in pool.op.training_batch(0, 100).groups} == {0}


# -- the coordinator's door ---------------------------------------------------------------------------------------

@pytest.mark.both_stores
def test_the_coordinator_refuses_spans_of_versions_not_published_or_too_far_apart(run_factory):
    """A group whose spans claim a version the coordinator has not published, or that lie more than max_staleness
    apart, is refused at submission with its reason; the other groups of the submission are taken, and once the
    version is published the same spans are taken too."""
    run = run_factory(max_staleness=1, sampling=m.SamplingSpec(group_size=GROUP, max_tokens=MAX_TOKENS,
                                                                 in_flight_updates=True))
    run.publish(0)
    run.publish(1)
    node = run.node()

    def spanned(lease: m.Lease, spans: list[list[tuple[int, int]]]) -> m.RolloutSubmission:
        sub = submission(lease)
        groups = [g.model_copy(update={"version_spans": s}) for g, s in zip(sub.groups, spans, strict=True)]
        return sub.model_copy(update={"groups": groups})

    later = run.node("later")
    held = later.lease(1, held_version=1)  # a lease of version 1, in hand while version 2 comes out
    lease = node.lease(3, held_version=1)
    assert held is not None and lease is not None and lease.policy_version == held.policy_version == 1
    ahead, apart, plain = (p.prompt_id for p in lease.prompts)
    result = node.submit(spanned(lease, [[(0, 1), (1, 2)], [(0, 1), (1, 3)], []]))
    assert result.accepted == [plain]
    assert "newer than the newest published 1" in result.rejected[ahead]
    assert "more than max_staleness 1 versions apart" in result.rejected[apart]

    run.publish(2)
    result = later.submit(spanned(held, [[(0, 1), (1, 2)]]))
    assert result.accepted == [held.prompts[0].prompt_id] and not result.rejected
