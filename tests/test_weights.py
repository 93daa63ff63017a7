"""New policy versions load in place: the verifier's reused model holds exactly the new checkpoint's weights,
and a checkpoint that does not fit the model is refused."""

from __future__ import annotations

import shutil

import pytest
import torch

from swarmrl.models.weights import architecture_config, load_weights_in_place
from swarmrl.testing.byzantine.harness import make_checkpoint, perturb_checkpoint
from swarmrl.trainer.model import ModelConfig
from swarmrl.transfer.store import cut_checkpoint
from swarmrl.verifier.models import _same_except_weights, load_policy


def test_reused_policy_equals_a_fresh_load(tmp_path):
    v0 = make_checkpoint(tmp_path / "v0")
    v1 = perturb_checkpoint(v0, tmp_path / "v1", 0.01)
    old = load_policy(v0, 0)
    old_model = old.model
    reused = load_policy(v1, 1, reuse=old)
    fresh = load_policy(v1, 1)
    assert reused.model is old_model and reused.version == 1 and reused.path == v1
    want = fresh.model.state_dict()
    got = reused.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    assert torch.equal(reused.model(ids).logits, fresh.model(ids).logits)
    assert not torch.equal(load_policy(v0, 0).model(ids).logits, fresh.model(ids).logits)


def test_a_checkpoint_of_another_shape_is_refused(tmp_path):
    small = make_checkpoint(tmp_path / "small", ModelConfig(num_layers=2))
    big = make_checkpoint(tmp_path / "big")
    assert architecture_config(small) != architecture_config(big)
    with pytest.raises(ValueError, match="does not fit"):
        load_weights_in_place(load_policy(big, 0).model, small)


def test_only_weight_changes_allow_reuse(tmp_path):
    v0 = make_checkpoint(tmp_path / "v0")
    v1 = shutil.copytree(v0, tmp_path / "v1")  # what a trainer publishes next: new weights, same other files
    shutil.copy(perturb_checkpoint(v0, tmp_path / "p", 0.01) / "model.safetensors", v1 / "model.safetensors")
    other = make_checkpoint(tmp_path / "other", ModelConfig(num_layers=2))
    m0 = cut_checkpoint(v0, run_id="r", version=0)
    m1 = cut_checkpoint(v1, run_id="r", version=1)
    m2 = cut_checkpoint(other, run_id="r", version=2)
    assert m0.files != m1.files
    assert _same_except_weights(m0, m1) and not _same_except_weights(m1, m2)
