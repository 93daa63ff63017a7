"""Refusals carry codes, and clients steer on the codes only.

- Every code is documented (docs/refusals.md) with its status, and used: the coordinator's sources name a code at
  every place that refuses, and build no error body but through the one helper (a scan of the sources).
- A refusal cannot be made without a code (the exception types check).
- With every reason the coordinator sends reworded (the one helper that writes error bodies is wrapped), a real
  node still recovers as before: it registers again after "unknown node" and "another pool", stops on a ban and on
  a clock it must fix (saying what to do, as before: a clock off by more than the coordinator accepts does not
  heal by waiting), and a registration whose challenge expired is done again with a new one.

Real parts: in-process coordinators (uvicorn on loopback, SQLite, Ed25519) behind a forwarding proxy whose upstream
is switched when a coordinator is replaced, a torch-engine node with a tiny random Llama.
"""

from __future__ import annotations

import ast
import hashlib
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarmrl.coordinator import middleware
from swarmrl.coordinator.auth import Refused
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.failures import StorageUnavailable
from swarmrl.coordinator.server import running_server
from swarmrl.node.agent import Node
from swarmrl.node.refusal import PermanentRefusal
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.signing import SignatureError
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.testing.proxy import LossyProxy
from swarmrl.testing.waiting import wait_for
from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer, save_checkpoint
from swarmrl.transfer.store import ShardStore, cut_checkpoint
from tests.support.node import NodeThread, node_config

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "refusals.md"
CODE_ROOTS = ["coordinator", "protocol"]
CLIENT_ROOTS = ["node", "runtime", "verifier", "trainer", "transfer", "pools", "swarmrl"]


def _sources(roots: list[str]) -> Iterator[tuple[Path, ast.Module]]:
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings (of the module, a class, a function, or an attribute)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and \
                        isinstance(stmt.value.value, str):
                    out.add(id(stmt.value))
    return out


# -- the contract ---------------------------------------------------------------------------------------------


def test_every_code_is_documented_with_its_status() -> None:
    rows = re.findall(r"^\| `([a-z_0-9]+)` \| (\d{3}) \|", DOCS.read_text(), re.MULTILINE)
    assert sorted(rows) == sorted((c.value, str(c.status)) for c in RefusalCode)


def test_a_refusal_cannot_be_made_without_its_code() -> None:
    with pytest.raises(TypeError):
        Refused(403, "unknown node: register first")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        StorageUnavailable(503, "gone")  # type: ignore[arg-type]
    refused = Refused(RefusalCode.BANNED, "node is banned: cheating")
    assert (refused.status, refused.code) == (403, RefusalCode.BANNED)
    assert RefusalCode.parse("banned") is RefusalCode.BANNED and RefusalCode.parse("no such code") is None


_CODED_CALLS = {"Refused", "StorageUnavailable", "SignatureError", "send_error", "error_response", "error_body",
                "_error"}


def _names_a_code(arg: ast.expr) -> bool:
    """`RefusalCode.X`, a code carried along (`e.code`, `failure[0]`), or a refusal's parts passed on (`*refusal`)."""
    if isinstance(arg, ast.Attribute):
        return (isinstance(arg.value, ast.Name) and arg.value.id == "RefusalCode") or arg.attr == "code"
    if isinstance(arg, ast.IfExp):
        return _names_a_code(arg.body) and _names_a_code(arg.orelse)
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id == "RefusalCode":
        return True  # rebuilt from the wire (the writer process's answer)
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "get":
        return isinstance(arg.func.value, ast.Name) and arg.func.value.id.isupper()  # a table of codes
    return isinstance(arg, ast.Starred | ast.Name) and (not isinstance(arg, ast.Name) or arg.id == "code")


def test_every_refusal_site_names_its_code_and_bodies_have_one_writer() -> None:
    unnamed, bodies, used = [], [], set()
    for path, tree in _sources(CODE_ROOTS):
        docstrings = _docstrings(tree)
        where = path.relative_to(REPO)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else \
                    node.func.attr if isinstance(node.func, ast.Attribute) else ""
                if name in _CODED_CALLS and node.args:
                    first = node.args[1] if name == "send_error" else node.args[0]
                    if not _names_a_code(first):
                        unnamed.append(f"{where}:{node.lineno}: {ast.unparse(node)[:100]}")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "RefusalCode":
                used.add(node.attr)
            if isinstance(node, ast.Constant) and node.value == "detail" and id(node) not in docstrings:
                bodies.append(f"{where}:{node.lineno}")
    assert unnamed == [], "refusals without a code:\n" + "\n".join(unnamed)
    assert bodies == [], "error bodies written by hand (use coordinator.middleware.send_error/error_response)"
    unused = {c.name for c in RefusalCode} - used
    assert unused == set(), f"codes nothing sends: {sorted(unused)}"


def test_clients_decide_on_codes_not_on_the_words_of_reasons() -> None:
    """No client code looks inside a refusal's reason (`"x" in e.reason`, `str(e).startswith(...)`), nor tells
    refusals apart by their 4xx status (several codes share one)."""
    found = []
    for path, tree in _sources(CLIENT_ROOTS):
        for node in ast.walk(tree):
            text = ""
            if isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
                text = ast.unparse(node.comparators[0])
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("startswith", "endswith", "find", "count"):
                text = ast.unparse(node.func.value)
            if re.search(r"\.reason\b|\bstr\(e\)|\bstr\(err\)", text):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:100]}")
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "status":
                statuses = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, int)]
                if any(400 <= v < 500 and v != 429 for v in statuses):  # 429 and 5xx are HTTP's: wait, retry
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert found == [], "decisions on the words of a reason, or on a 4xx status instead of the code:\n" + \
        "\n".join(found)


def test_signature_errors_carry_the_codes_the_gate_answers_with() -> None:
    from swarmrl.protocol.signing import parse_header, sign, verify

    me = Identity.generate()
    with pytest.raises(SignatureError) as e:
        parse_header(None)
    assert e.value.code is RefusalCode.UNSIGNED and e.value.code.status == 401
    with pytest.raises(SignatureError) as e:
        parse_header("{")
    assert e.value.code is RefusalCode.MALFORMED_SIGNATURE and e.value.code.status == 400
    sig = sign(me, "k", "pool-a", b"{}")
    with pytest.raises(SignatureError) as e:
        verify(sig, kind="k", pool="pool-b")
    assert e.value.code is RefusalCode.OTHER_POOL
    with pytest.raises(SignatureError) as e:
        verify(sig, kind="k", pool="pool-a", now=time.time() + 3600)
    assert e.value.code is RefusalCode.CLOCK_SKEW


# -- recovery with every reason reworded ----------------------------------------------------------------------


@pytest.fixture
def reworded(monkeypatch) -> list[RefusalCode]:
    """Every error body the coordinator writes gets a reason that shares no word with the real one; the codes
    sent are listed, in order."""
    sent: list[RefusalCode] = []
    real = middleware.error_body

    def reword(code: RefusalCode, reason: str) -> bytes:
        sent.append(code)
        return real(code, f"(reworded {hashlib.sha256(reason.encode()).hexdigest()[:12]})")

    monkeypatch.setattr(middleware, "error_body", reword)
    return sent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tok = build_tokenizer()
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=64), tok)
    return save_checkpoint(model, tok, tmp_path_factory.mktemp("ckpt") / "v0")


def _publish(url: str, operator: Identity, ckpt: Path, tmp: Path, run_id: str) -> None:
    store = ShardStore(tmp / f"trainer-shards-{secrets.token_hex(4)}")
    manifest = cut_checkpoint(ckpt, run_id=run_id, version=0, store=store, shard_size=64 * 1024)
    with CoordinatorClient(url, operator) as op:
        for ref in manifest.shards():
            op.upload_shard(ref.sha256, store.get(ref.sha256))
        op.publish(manifest)


def _coordinator(tmp: Path, operator: Identity, run_id: str, data: str, **over: Any) -> CoordinatorConfig:
    return CoordinatorConfig(data_dir=tmp / data, key_path=tmp / "coordinator.key",
                             run={"run_id": run_id, "sampling": {"group_size": 2, "max_tokens": 4}},
                             operator_keys=[operator.public_key_hex], **over)


class OneAddress:
    """One address (a forwarding proxy) at which coordinators replace one another: `serve` starts the next one,
    publishes version 0 of its run, points the proxy at it, then stops the one before (its connections close, and
    clients reconnect through the proxy to the new one)."""

    def __init__(self, tmp: Path, operator: Identity, checkpoint: Path):
        self.tmp, self.operator, self.checkpoint = tmp, operator, checkpoint
        self.proxy = LossyProxy("http://127.0.0.1:9", drop=lambda _: False).__enter__()
        self.current: Any = None
        self.url = ""

    def serve(self, cfg: CoordinatorConfig) -> str:
        server = running_server(cfg)
        url = server.__enter__()
        _publish(url, self.operator, self.checkpoint, self.tmp, cfg.run.run_id)
        self.proxy.port = int(url.rsplit(":", 1)[1])
        self.close_current()
        self.current, self.url = server, url
        return url

    def close_current(self) -> None:
        if self.current is not None:
            self.current.__exit__(None, None, None)
            self.current = None

    def close(self) -> None:
        self.close_current()
        self.proxy.__exit__(None, None, None)


def test_a_node_recovers_on_codes_with_every_reason_reworded(tmp_path, checkpoint, reworded) -> None:
    operator = Identity.generate()
    address = OneAddress(tmp_path, operator, checkpoint)
    runner = None
    try:
        address.serve(_coordinator(tmp_path, operator, "codes", "first"))
        runner = NodeThread(node_config(tmp_path, coordinator_url=address.proxy.url))
        node = runner.node
        wait_for(lambda: runner.accepted_at_least(2), "the node to submit groups")
        assert node.stats.registrations == 1 and reworded == []

        # 1. Another coordinator (same key, same run, an empty database) takes the address. Its store's epoch makes
        # it another pool: "another pool", or "unknown node" if the node read the new run description first.
        address.serve(_coordinator(tmp_path, operator, "codes", "second"))
        wait_for(lambda: node.stats.registrations == 2, "the node to register again")
        assert {RefusalCode.OTHER_POOL, RefusalCode.UNKNOWN_NODE} & set(reworded)
        done = node.stats.groups_accepted
        wait_for(lambda: runner.accepted_at_least(done + 2), "the node to work for the new database")

        # 2. A coordinator of another run (another pool, same key) takes the address: the node joins it. Which
        # refusal it meets first depends on whether its weights thread read the new run description before its
        # next signed request ("another pool") or after ("unknown node"): the next test makes the first happen.
        base = len(reworded)
        address.serve(_coordinator(tmp_path, operator, "codes-2", "third"))
        wait_for(lambda: node.stats.registrations == 3, "the node to register with the new run")
        assert {RefusalCode.OTHER_POOL, RefusalCode.UNKNOWN_NODE} & set(reworded[base:])
        done = node.stats.groups_accepted
        wait_for(lambda: runner.accepted_at_least(done + 2), "the node to work for the new run")

        # 3. The pool bans the node: it stops, and says why in its own words.
        with CoordinatorClient(address.url, operator) as op:
            group = op.pending(limit=1)[0]
            op.verdicts([m.Verdict(group_id=group.group_id, accepted=False, reason="cheat", ban=True)])
        runner.thread.join(120)
        assert not runner.thread.is_alive()
    finally:
        if runner is not None and runner.thread.is_alive():
            runner.stop()
        address.close()
    assert isinstance(runner.error, PermanentRefusal), runner.error
    assert "banned this node's key" in str(runner.error) and "reworded" in str(runner.error)
    assert RefusalCode.BANNED in reworded


def test_a_request_for_another_pool_makes_the_node_register_again(tmp_path, checkpoint, reworded) -> None:
    operator = Identity.generate()
    address = OneAddress(tmp_path, operator, checkpoint)
    try:
        address.serve(_coordinator(tmp_path, operator, "pool-a", "first"))
        node = Node(node_config(tmp_path, coordinator_url=address.proxy.url))
        node.membership.register()
        address.serve(_coordinator(tmp_path, operator, "pool-b", "second"))  # same key, another run
        with pytest.raises(CoordinatorError) as refused:
            node.client.heartbeat(held_version=-1)  # still signed for pool-a's run
        assert refused.value.code is RefusalCode.OTHER_POOL and "reworded" in refused.value.reason
        node.membership.refused(refused.value)  # as the node's main loop does with it
        assert node.stats.registrations == 2 and node.client.run is not None
        assert node.client.run.run_id == "pool-b"
        node.client.heartbeat(held_version=-1)  # signed for the new pool now: taken
    finally:
        address.close()
    assert reworded == [RefusalCode.OTHER_POOL]


def test_a_clock_skew_stops_the_node_with_what_to_fix(tmp_path, reworded) -> None:
    operator = Identity.generate()
    cfg = _coordinator(tmp_path, operator, "skewed", "coord")
    with running_server(cfg, clock=lambda: time.time() + 3600) as url:  # the coordinator's clock is an hour ahead
        node = Node(node_config(tmp_path, coordinator_url=url))
        with pytest.raises(PermanentRefusal) as stopped:
            node.run()
    assert "clock is off" in str(stopped.value) and "reworded" in str(stopped.value)
    assert reworded == [RefusalCode.CLOCK_SKEW]


def test_an_expired_challenge_is_asked_again(tmp_path, reworded) -> None:
    """The registration's challenge expires on the way (the coordinator's clock moves on before the signed answer
    arrives): the client asks a new one and registers, on the code alone."""
    operator, me = Identity.generate(), Identity.generate()
    cfg = _coordinator(tmp_path, operator, "challenged", "coord", challenge_ttl_s=5.0)
    ahead = [0.0]
    paths: list[str] = []

    class LateFirstRegister(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            paths.append(request.url.path)
            if paths.count("/v1/register") == 1 and request.url.path == "/v1/register":
                ahead[0] += 10.0  # past the challenge's 5 s, well inside the 120 s clock window
            return super().handle_request(request)

    with running_server(cfg, clock=lambda: time.time() + ahead[0]) as url, \
            CoordinatorClient(url, me, transport=LateFirstRegister()) as client:
        registered = client.register(name="late")
    assert registered.node_id == me.node_id
    asked = [p for p in paths if p.startswith("/v1/register")]
    assert asked == ["/v1/register/challenge", "/v1/register"] * 2
    assert reworded == [RefusalCode.BAD_CHALLENGE]
