"""A man in the middle rewrites the leases an honest node is handed (a prompt, max_tokens, the temperature): the node
refuses every one of them and is not banned, and once the path is clean its work is accepted. The same node with the
lease check turned off is banned for the rewritten prompt: what the coordinator's signature prevents. Real pool on
loopback (uvicorn, SQLite, Ed25519), the real verifier (every group fully checked), the torch engine, an HTTP proxy
(`swarmrl.testing.mitm`) in between."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmrl.protocol import messages as m
from swarmrl.runtime.client import UntrustedResponse
from swarmrl.testing.byzantine.framing import ONE_PROXY, REWRITES, behind, run_rewrite
from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool
from swarmrl.testing.mitm import Mitm, rewrite_lease


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mitm") / "ckpt")


def test_rewritten_leases_are_refused_and_frame_nobody(tmp_path: Path, checkpoint: Path) -> None:
    sampling = m.SamplingSpec(temperature=1.0, max_tokens=16, group_size=4)
    with open_pool(tmp_path, checkpoint, sampling=sampling, verifier={"sample_rate": 1.0}, admission=ONE_PROXY) as pool:
        for what in REWRITES:
            row = run_rewrite(pool, what, leases=2, checked=True)
            assert row["leases_rewritten"] == row["leases_refused"] == 2, row
            assert row["outcomes"] == ["refused", "refused"] and not row["banned"] and row["groups_rejected"] == 0

        # The refusal is the node's check: the proxy passes everything else through untouched.
        with Mitm(pool.url, rewrite_lease("prompt"), when=lambda: False) as clean:
            node = behind(pool, clean, "clean-path")
            assert node.step() and clean.rewritten == 0
            node.engine.close()
        pool.verify_all()
        groups = pool.groups(node.node_id)
        assert groups and all(g["status"] != "rejected" for g in groups)

        unchecked = run_rewrite(pool, "prompt", leases=1, checked=False)
        assert unchecked["outcomes"] == ["submitted"] and unchecked["banned"], unchecked
        assert "prompt" in unchecked["ban_reason"], unchecked
        assert sum(n.banned for n in pool.op.status().nodes) == 1  # that one only


def test_a_rewritten_run_description_is_refused(tmp_path: Path, checkpoint: Path) -> None:
    """The run description is signed too: a node pinned to the pool's key refuses one rewritten on the way."""

    with open_pool(tmp_path, checkpoint) as pool:
        node = pool.node(name="pinned")
        info = node.client.info()
        hotter = info.model_copy(update={"spec": info.spec.model_copy(update={
            "sampling": info.spec.sampling.model_copy(update={"temperature": 3.0})})})
        with pytest.raises(UntrustedResponse, match="does not verify"):
            node.client.trust(hotter)


def test_the_verifier_judges_a_group_against_the_signed_lease(tmp_path: Path, checkpoint: Path) -> None:
    """A group whose lease excerpt does not verify (a prompt, a seed or the sampling not as the coordinator signed
    them, or another node's lease) is rejected without a ban: its node is not to blame. The untouched ones pass."""
    with open_pool(tmp_path, checkpoint, verifier={"sample_rate": 1.0}) as pool:
        node = pool.node(name="honest", max_prompts=5)
        assert node.step()
        node.engine.close()
        groups = pool.verifier.client.pending(limit=10)
        assert len(groups) == 5
        first = groups[0].lease
        tampered = [
            groups[0].model_copy(update={"lease": first.model_copy(update={
                "prompt": first.prompt.model_copy(update={"text": "999+999="})})}),
            groups[1].model_copy(update={"lease": groups[1].lease.model_copy(update={
                "prompt": groups[1].lease.prompt.model_copy(update={"seeds": groups[0].seeds})})}),
            groups[2].model_copy(update={"lease": groups[2].lease.model_copy(update={
                "sampling": groups[2].sampling.model_copy(update={"max_tokens": 2})})}),
            groups[3].model_copy(update={"node_id": "0" * 40}),
        ]
        verdicts = {v.group_id: v for v in pool.verifier.verify([*tampered, groups[4]])}
        for g in tampered:
            v = verdicts[g.group_id]
            assert not v.accepted and not v.ban and v.reason.startswith("cannot verify"), v
        assert verdicts[groups[4].group_id].accepted

