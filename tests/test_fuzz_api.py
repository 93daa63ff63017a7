"""Fuzzing the coordinator's HTTP API from its own OpenAPI schema: schemathesis strategies, drawn by hypothesis with
a fixed seed and a bounded number of examples, for every operation, schema-valid (positive) and schema-violating
(negative). Signed endpoints' bodies and signature headers are drawn from the schema too (so they fail the
signature check) and, for half of the examples, re-signed with real keys (a registered node's, the operator's) for
this pool, so that the drawn payloads reach the rules behind the signature. On any input: no server error (5xx),
every refusal a 4xx with a reason, and the client's keep-alive connection still serves the next request. Real
uvicorn, Ed25519, SQLite."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from swarmrl.coordinator.app import build_app
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.ratelimit import RateLimitConfig
from swarmrl.coordinator.server import running_server
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.run import RunSpec
from swarmrl.protocol.signing import SIGNATURE_HEADER, canonical_json, sign
from swarmrl.runtime.client import CoordinatorClient
from tests.support.coordinator import GROUP, MAX_TOKENS, Run

EXAMPLES = 30
SIGNED = {"/v1/register": (m.KIND_REGISTER, None), "/v1/lease": (m.KIND_LEASE, "node"),
          "/v1/submit": (m.KIND_SUBMIT, "node"), "/v1/heartbeat": (m.KIND_HEARTBEAT, "node"),
          "/v1/verifier/pending": (m.KIND_VERIFIER_PENDING, "operator"),
          "/v1/verifier/verdicts": (m.KIND_VERIFIER_VERDICTS, "operator"),
          "/v1/trainer/batch": (m.KIND_TRAINER_BATCH, "operator"), "/v1/trainer/ack": (m.KIND_TRAINER_ACK, "operator"),
          "/v1/trainer/publish": (m.KIND_TRAINER_PUBLISH, "operator"),
          "/v1/trainer/metrics": (m.KIND_TRAINER_METRICS, "operator")}


def _config(data_dir: Path, operator: Identity) -> CoordinatorConfig:
    run = RunSpec(run_id="fuzz", sampling=m.SamplingSpec(group_size=GROUP, max_tokens=MAX_TOKENS))
    # Rate limits off: every drawn request should reach the rules it is drawn for (tests/test_admission.py tests them).
    # No long polls: a drawn wait_s is still validated, but answered at once instead of holding the test for up to
    # 10 s of an empty queue per example (tests/test_coordinator_api.py and the swarm runs wait for real).
    return CoordinatorConfig(data_dir=data_dir, run=run, operator_keys=[operator.public_key_hex],
                             max_body_bytes=256 * 1024, max_shard_bytes=64 * 1024,
                             rate_limits=RateLimitConfig.off(), max_long_polls=0)


@cache
def api_schema() -> Any:
    """The coordinator's schema as schemathesis reads it (made once, from an app in a scratch directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        app = build_app(_config(Path(tmp), Identity.generate()), Identity.generate())
        schema = app.openapi()
        app.state.coordinator.close()
    return schemathesis.openapi.from_dict(json.loads(json.dumps(schema)))


def operations() -> list[str]:
    return [result.ok().label for result in api_schema().get_all_operations()]


@dataclass
class Live:
    url: str
    pool: str
    http: httpx.Client
    node: Identity
    operator: Identity


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    operator = Identity.generate()
    cfg = _config(tmp_path_factory.mktemp("fuzz"), operator)
    with running_server(cfg) as url:
        run = Run(url, cfg, cfg.load_identity(), CoordinatorClient(url, operator, retries=0), None,  # type: ignore[arg-type]
                  tmp_path_factory.mktemp("fuzz-ckpt"))
        run.publish(0)
        node = run.node("fuzzed")
        # One connection: every answer must come back over it, refusals included.
        with httpx.Client(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1), timeout=30) as http:
            yield Live(url, run.pool, http, node.identity, operator)


def _resign(kwargs: dict[str, Any], path: str, live: Live) -> None:
    """Replace a drawn signature header with a correct signature of the drawn body for this pool (when the body can
    be sent as JSON)."""
    if path not in SIGNED or "json" not in kwargs:
        return
    kind, role = SIGNED[path]
    identity = {"node": live.node, "operator": live.operator}.get(role or "", Identity.generate())
    try:
        body = canonical_json(kwargs["json"])
    except (ValueError, TypeError):
        return  # not JSON: sent as drawn
    kwargs.pop("json")
    kwargs["content"] = body
    header = sign(identity, kind, live.pool, body).header()
    kwargs["headers"] = {**(kwargs.get("headers") or {}), SIGNATURE_HEADER: header}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
@pytest.mark.parametrize("label", operations())
def test_no_input_makes_a_server_error_or_costs_the_connection(label: str, mode: GenerationMode, live: Live) -> None:
    operation = api_schema().find_operation_by_label(label)
    addresses: set[object] = set()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), resign=st.booleans())
    def fuzz(case: schemathesis.Case, resign: bool) -> None:
        kwargs = case.as_transport_kwargs(base_url=live.url)
        if resign:
            _resign(kwargs, case.path, live)
        kwargs.pop("cookies", None)
        if isinstance(kwargs.get("data"), bytes | str):  # raw bodies go as content in httpx
            kwargs["content"] = kwargs.pop("data")
        try:
            request = live.http.build_request(**kwargs)
        except (httpx.InvalidURL, UnicodeEncodeError, ValueError, TypeError):
            return  # a request the HTTP client itself will not send (e.g. a header that cannot be encoded)
        try:
            resp = live.http.send(request)
        except httpx.LocalProtocolError:
            return  # likewise, found out while sending
        summary = f"{label} ({mode.value}): {resp.status_code} {resp.text[:300]!r}\n{case.as_curl_command()[:2000]}"
        assert resp.status_code < 500, summary
        if resp.status_code >= 400:
            detail, code = resp.json().get("detail"), RefusalCode.parse(resp.json().get("code"))
            assert isinstance(detail, str) and detail.strip(), summary
            assert code is not None and code.status == resp.status_code, summary  # every refusal names its code
        addresses.add(resp.extensions["network_stream"].get_extra_info("client_addr"))
        after = live.http.get(live.url + "/v1/info")  # the connection is still good for the next request
        assert after.status_code == 200, summary
        addresses.add(after.extensions["network_stream"].get_extra_info("client_addr"))
        assert len(addresses) == 1, f"the server closed the connection after: {summary}"

    try:
        fuzz()
    except Unsatisfiable:
        pytest.skip(f"{label} takes no input that could violate its schema")
