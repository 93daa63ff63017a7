"""The operator's links are signed (protocol.signing.verify_answer): a man in the middle between the coordinator
and its verifier or trainer can rewrite what they are handed, and they refuse it. A coordinator that rewrites a group
in its own store is caught by the node's signature of the group (protocol.groupsig). Real coordinator, verifier and
clients on loopback, through a real proxy."""

from __future__ import annotations

import pytest

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import SignatureError, answer_kind, sign, verify_answer
from swarmrl.testing.byzantine import operator_links
from swarmrl.testing.byzantine.harness import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "v0")


def test_forged_operator_answers_are_refused_and_the_unchecked_baseline_takes_them(tmp_path, ckpt):
    res = operator_links.section(tmp_path, ckpt)
    rows = {(r["what"], r["checked"]): r for r in res["rows"]}
    forgeries = [r for r in res["rows"] if r["what"] in operator_links.FORGERIES]
    assert len(forgeries) == 2 * len(operator_links.FORGERIES) and all(r["rewritten"] >= 1 for r in forgeries)
    assert res["operator_path_forgeries_accepted"] == 0 and res["honest_banned_by_forgeries"] == 0
    assert res["untouched_answers_taken"] == len(operator_links.CONTROLS)  # the check refuses only forgeries
    # Without the check every forgery is acted on; a rewritten token no longer gets the honest node that sent it
    # banned even then: the verifier checks the node's own signature of the group (protocol.groupsig).
    assert res["unchecked_forgeries_accepted"] == len(operator_links.FORGERIES)
    assert not rows[("token", False)]["honest_banned"], res["rows"]
    # The coordinator's own store rewritten: the verifier refuses the group without a ban, the trainer passes it over.
    store = [r for r in res["rows"] if r["what"] in operator_links.STORE_FORGERIES]
    assert len(store) == len(operator_links.STORE_FORGERIES) and res["store_forgeries_accepted"] == 0, store
    assert not any(r["honest_banned"] for r in store)


def test_only_the_coordinators_answer_to_this_very_request_verifies():
    coordinator, verifier = Identity.generate(), Identity.generate()
    kind, body = answer_kind("verifier.pending"), b'{"groups": []}'
    asked, earlier = (sign(verifier, "verifier.pending", "pool", b"{}") for _ in range(2))
    key = coordinator.public_key_hex
    verify_answer(sign(coordinator, kind, "pool", body, nonce=asked.nonce).header(), body, request=asked.header(),
                  key=key)
    forged = {
        "an earlier request's answer": (sign(coordinator, kind, "pool", body, nonce=earlier.nonce).header(), body),
        "unsigned": (None, body),
        "signed by another key": (sign(verifier, kind, "pool", body, nonce=asked.nonce).header(), body),
        "another body": (sign(coordinator, kind, "pool", body, nonce=asked.nonce).header(), b'{"groups": [1]}'),
        "signed as a request": (sign(coordinator, "verifier.pending", "pool", body, nonce=asked.nonce).header(), body),
    }
    for name, (header, content) in forged.items():
        with pytest.raises(SignatureError):
            verify_answer(header, content, request=asked.header(), key=key)
            pytest.fail(name)
