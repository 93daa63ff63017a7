"""Integers the coordinator would store are bounded in the protocol: 2**63 and 2**64 in any of them is a 422 with
a reason (never a 500) when the right role signed it (a stranger is refused before the payload is read), the largest
storable value works, and the client's keep-alive connection survives every refusal. Real uvicorn on loopback, real
Ed25519, real SQLite."""

from __future__ import annotations

import copy
import json
import secrets

import httpx
import pytest

from swarmrl.coordinator.checkpoints import Checkpoints
from swarmrl.coordinator.status import Status
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import SIGNATURE_HEADER, sign
from tests.support.coordinator import Run, signed, submission

TOO_BIG = (2**63, 2**64)
LARGEST = 2**63 - 1


class Connection:
    """One keep-alive HTTP connection to the coordinator; every response must come back over it."""

    def __init__(self, url: str, pool: str):
        self.http = httpx.Client(base_url=url, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        self.local_addr: object = None
        self.pool = pool

    def send(self, method: str, path: str, **kw) -> httpx.Response:
        resp = self.http.request(method, path, **kw)
        addr = resp.extensions["network_stream"].get_extra_info("client_addr")
        assert self.local_addr in (None, addr), f"{method} {path}: the server closed the previous connection"
        self.local_addr = addr
        return resp

    def post_signed(self, path: str, identity: Identity, kind: str, payload: dict) -> httpx.Response:
        body, headers = signed(identity, kind, self.pool, payload)
        return self.send("POST", path, content=body, headers=headers)


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
    conn = Connection(run.url, run.pool)
    for path, kind, identity, payload, fields in cases:
        for where in fields:
            for value in TOO_BIG:
                bad = _set(payload, where, value)
                resp = conn.post_signed(path, identity, kind, bad)
                assert resp.status_code == 422, (path, where, value, resp.text)
                assert isinstance(resp.json()["detail"], str) and resp.json()["detail"]
                # A stranger's payload is not even read: the role comes first.
                assert conn.post_signed(path, stranger, kind, bad).status_code == 403, (path, where, value)
                # Without a valid signature nothing of the payload is looked at.
                body, headers = signed(identity, kind, run.pool, bad)
                bad_sig = {**json.loads(headers[SIGNATURE_HEADER]), "sig": "0" * 128}
                resp = conn.send("POST", path, content=body, headers={SIGNATURE_HEADER: json.dumps(bad_sig)})
                assert resp.status_code == 401, (path, where, value, resp.text)
    # The signature header's own numbers: a timestamp of 2**64 is malformed.
    for path, kind, identity in (("/v1/heartbeat", m.KIND_HEARTBEAT, node.identity),
                                 (f"/v1/trainer/shards/{'ab' * 32}", m.KIND_TRAINER_SHARD, op)):
        sig = json.loads(sign(identity, kind, run.pool, b"x").header())
        resp = conn.send("PUT" if "shards" in path else "POST", path, content=b"x",
                         headers={SIGNATURE_HEADER: json.dumps({**sig, "ts": float(2**64)})})
        assert resp.status_code == 400 and "ts" in resp.json()["detail"], resp.text
    # A path parameter, with no authentication at all.
    for value in (*TOO_BIG, -1, 10**30):
        resp = conn.send("GET", f"/v1/manifest/{value}")
        assert resp.status_code == 422 and "version" in resp.json()["detail"], resp.text
    assert conn.send("GET", "/v1/info").status_code == 200
    assert run.accepted_state() == before  # refused input changed nothing


def test_the_largest_storable_integers_work(run: Run) -> None:
    node = run.node()
    conn = Connection(run.url, run.pool)
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
    conn = Connection(run.url, run.pool)
    resp = conn.send("GET", path)
    assert resp.status_code == 500
    assert resp.json() == {"detail": "internal error (RuntimeError)", "code": "internal_error"}
    assert conn.send("GET", "/v1/info").status_code == 200
