"""The vLLM engine's rollouts pass the full check: replay, logprobs, and activation proofs built from hidden
states captured inside vLLM during generation, also after an in-place weight reload to a new policy version;
the same engine with perturbed weights is caught."""

from __future__ import annotations

import pytest

from swarmrl.testing.byzantine import nodes as bad
from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool, perturb_checkpoint

pytestmark = pytest.mark.vllm


def test_vllm_node_passes_and_vllm_wrong_model_is_caught(tmp_path):
    pytest.importorskip("vllm", exc_type=ImportError)
    with open_pool(tmp_path, make_checkpoint(tmp_path / "ckpt")) as pool:
        honest = pool.node(name="vllm", engine="vllm", max_prompts=8)
        try:
            honest.step()
            pool.publish(perturb_checkpoint(pool.versions[0], tmp_path / "v1", 0.01))
            honest.sync()
            honest.step()  # the lease that came with the first submission is for version 0: it keeps those weights
            honest.step()  # the engine reloaded version 1 in place: the capture hook must still work
        finally:
            honest.engine.close()
        assert pool.verify_all() == 24
        groups = pool.groups(honest.node_id)
        assert [g["status"] for g in groups] == ["accepted"] * 24
        assert [g.policy_version for g in pool.op.training_batch(0, 100).groups] == [0] * 16 + [1] * 8
        reports = [pool.verifier.reports[g["id"]] for g in groups]
        assert all(r.proof_checked > 0 for r in reports)
        assert max(r.max_logprob_diff for r in reports) < 1e-5
        assert max(r.proof_max_ulp for r in reports) <= 0.51

        cheat = pool.node(bad.WrongModelNode, name="vllm-wrong", engine="vllm", max_prompts=1, frac=0.001)
        try:
            cheat.step()
        finally:
            cheat.engine.close()
        pool.verify_all()
        (g,) = pool.groups(cheat.node_id)
        assert g["status"] == "rejected" and pool.node_row(cheat.node_id).banned
        # Each of these checks recomputes from the verifier's weights and sees the other ones; which fails first
        # depends on the CPU's float kernels (a sampled token the seeded rule would not pick, a logprob, a proof).
        assert g["reason"].startswith(("replay", "logprobs", "activation proof")), g["reason"]
