"""Dropping groups by their outcome gains nothing (coordinator.admission): a dropped prompt is leased again, to
another source, with the seeds it had, and on the same policy version the honest node that takes it makes the very
group the attacker dropped. Real coordinator, verifier and nodes on loopback."""

from __future__ import annotations

import pytest

from swarmrl.testing.byzantine import selection
from swarmrl.testing.byzantine.harness import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "v0")


def test_every_dropped_group_comes_back_identical_so_selection_gains_nothing(tmp_path, ckpt):
    res = selection.section(tmp_path, ckpt, leases=8, log=lambda s: None)
    assert res["dropped"] >= 4  # the attacker did drop groups (about half of 32)
    assert res["dropped_regenerated_identically"] == res["dropped"]
    assert res["trained"] == res["generated"] and res["selective_submission_gain"] == 0
