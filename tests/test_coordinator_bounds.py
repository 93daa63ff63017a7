"""Integers the coordinator would store are bounded in the protocol: 2**63 and 2**64 in any of them is a 422 with
a reason (never a 500), signed by the right role or by a stranger, the largest storable value works, and the
client's keep-alive connection survives every refusal. Real uvicorn on loopback, real Ed25519, real SQLite."""

from __future__ import annotations

import copy
import secrets

import httpx
import pytest

from swarmrl.coordinator.checkpoints import Checkpoints
from swarmrl.coordinator.status import Status
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import sign
from swarmrl.runtime.client import ENVELOPE_HEADER
from tests import test_coordinator_api as api
from tests.test_coordinator_api import Run, submission

run_factory, run = api.run_factory, api.run  # the coordinator fixtures, shared with the API tests

TOO_BIG = (2**63, 2**64)
LARGEST = 2**63 - 1


class Connection:
    """One keep-alive HTTP connection to the coordinator; every response must come back over it."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        self.local_addr: object = None

    def send(self, method: str, path: str, **kw) -> httpx.Response:
        resp = self.http.request(method, path, **kw)
        addr = resp.extensions["network_stream"].get_extra_info("client_addr")
        assert self.local_addr in (None, addr), f"{method} {path}: the server closed the previous connection"
        self.local_addr = addr
        return resp

    def post_signed(self, path: str, identity: Identity, kind: str, payload: dict) -> httpx.Response:
        return self.send("POST", path, content=sign(identity, kind, payload).model_dump_json())


def _set(payload: dict, where: tuple, value: int) -> dict:
    """A copy of `payload` with the field at path `where` (keys and list indexes) set to `value`."""
    out = copy.deepcopy(payload)
    target = out
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    return out


def test_oversized_integers_are_refused_and_the_connection_survives(run: Run) -> None:
    node = run.node()
    lease = node.lease(1, 0)
    sub = submission(lease).model_dump(mode="json")
    manifest = run.op.latest_manifest().manifest.model_copy(update={"version": 1}).model_dump(mode="json")
    op, stranger = run.op.identity, Identity.generate()
    # (endpoint, envelope kind, role's identity, a valid payload, the integer fields in it)
    cases = [
        ("/v1/lease", m.KIND_LEASE, node.identity, {"max_prompts": 1, "held_version": 0}, [("held_version",)]),
        ("/v1/heartbeat", m.KIND_HEARTBEAT, node.identity, {"held_version": 0}, [("held_version",)]),
        ("/v1/submit", m.KIND_SUBMIT, node.identity, sub,
         [("policy_version",), ("groups", 0, "rollouts", 0, "seed"), ("groups", 0, "rollouts", 0, "completion_ids", 0),
          ("groups", 0, "prompt_ids", 0)]),
        ("/v1/verifier/pending", m.KIND_VERIFIER_PENDING, op, {"limit": 1}, [("limit",)]),
        ("/v1/verifier/verdicts", m.KIND_VERIFIER_VERDICTS, op, {"verdicts": [{"group_id": 1, "accepted": False}]},
         [("verdicts", 0, "group_id")]),
        ("/v1/trainer/batch", m.KIND_TRAINER_BATCH, op, {"after_id": 0, "limit": 1}, [("after_id",), ("limit",)]),
        ("/v1/trainer/ack", m.KIND_TRAINER_ACK, op, {"cursor": 0}, [("cursor",)]),
        ("/v1/trainer/metrics", m.KIND_TRAINER_METRICS, op, {"step": 1, "version": 0, "metrics": {}},
         [("step",), ("version",)]),
        ("/v1/trainer/publish", m.KIND_TRAINER_PUBLISH, op, {"manifest": manifest},
         [("manifest", "version"), ("manifest", "shard_size"), ("manifest", "files", 0, "size"),
          ("manifest", "files", 0, "shards", 0, "size")]),
    ]
    before = run.accepted_state()
    conn = Connection(run.url)
    for path, kind, identity, payload, fields in cases:
        for where in fields:
            for value in TOO_BIG:
                bad = _set(payload, where, value)
                for signer in (identity, stranger):  # the payload is checked before the signer's role
                    resp = conn.post_signed(path, signer, kind, bad)
                    assert resp.status_code == 422, (path, where, value, resp.text)
                    assert isinstance(resp.json()["detail"], str) and resp.json()["detail"]
                # Without a valid signature nothing of the payload is looked at.
                env = sign(identity, kind, bad).model_copy(update={"signature": "0" * 128})
                resp = conn.send("POST", path, content=env.model_dump_json())
                assert resp.status_code == 401, (path, where, value, resp.text)
    # The envelope's own numbers: a timestamp of 2**64 is outside the clock window.
    env = sign(node.identity, m.KIND_HEARTBEAT, {}).model_copy(update={"timestamp": float(2**64)})
    assert conn.send("POST", "/v1/heartbeat", content=env.model_dump_json()).status_code == 401
    # The shard upload's size travels in a header envelope.
    sha = "ab" * 32
    for value in TOO_BIG:
        header = sign(op, m.KIND_TRAINER_SHARD, {"sha256": sha, "size": value}).model_dump_json()
        resp = conn.send("PUT", f"/v1/trainer/shards/{sha}", content=b"x", headers={ENVELOPE_HEADER: header})
        assert resp.status_code == 422 and "size" in resp.json()["detail"]
    # A path parameter, with no authentication at all.
    for value in (*TOO_BIG, -1, 10**30):
        resp = conn.send("GET", f"/v1/manifest/{value}")
        assert resp.status_code == 422 and "version" in resp.json()["detail"], resp.text
    assert conn.send("GET", "/v1/info").status_code == 200
    assert run.accepted_state() == before  # refused input changed nothing


def test_the_largest_storable_integers_work(run: Run) -> None:
    node = run.node()
    conn = Connection(run.url)
    op = run.op.identity
    assert conn.post_signed("/v1/heartbeat", node.identity, m.KIND_HEARTBEAT, {"held_version": LARGEST}
                            ).status_code == 204
    assert run.op.status().nodes[0].held_version == LARGEST
    resp = conn.post_signed("/v1/lease", node.identity, m.KIND_LEASE, {"max_prompts": 1, "held_version": LARGEST})
    assert resp.status_code == 200
    resp = conn.post_signed("/v1/verifier/verdicts", op, m.KIND_VERIFIER_VERDICTS,
                            {"verdicts": [{"group_id": LARGEST, "accepted": False}]})
    assert resp.status_code == 204  # an unknown group: ignored
    resp = conn.post_signed("/v1/trainer/batch", op, m.KIND_TRAINER_BATCH, {"after_id": LARGEST, "limit": 1})
    assert resp.status_code == 200 and resp.json()["groups"] == []
    resp = conn.post_signed("/v1/trainer/ack", op, m.KIND_TRAINER_ACK, {"cursor": LARGEST})
    assert resp.status_code == 409 and "beyond" in resp.json()["detail"]
    resp = conn.post_signed("/v1/trainer/metrics", op, m.KIND_TRAINER_METRICS,
                            {"step": LARGEST, "version": LARGEST, "metrics": {"x": 1.0}})
    assert resp.status_code == 204 and run.op.status().metrics[-1].step == LARGEST
    resp = conn.post_signed("/v1/submit", node.identity, m.KIND_SUBMIT,
                            {"lease_id": secrets.token_hex(12), "policy_version": LARGEST,
                             "groups": submission(node.lease(1, 0)).model_dump(mode="json")["groups"]})
    assert resp.status_code == 404  # an unknown lease, refused before the (storable) version is compared
    assert conn.send("GET", f"/v1/manifest/{LARGEST}").status_code == 404


@pytest.mark.parametrize("path", ["/v1/manifest/0", "/v1/status"])
def test_an_internal_error_keeps_the_connection(run: Run, path: str, monkeypatch) -> None:
    """An unexpected exception answers 500 with its type, and the keep-alive connection stays usable."""

    def broken(*_a, **_kw):
        raise RuntimeError("a bug")

    # The test server runs in this process: break the parts behind both paths.
    monkeypatch.setattr(Checkpoints, "manifest", broken)
    monkeypatch.setattr(Status, "snapshot", broken)
    conn = Connection(run.url)
    resp = conn.send("GET", path)
    assert resp.status_code == 500 and resp.json() == {"detail": "internal error (RuntimeError)"}
    assert conn.send("GET", "/v1/info").status_code == 200
