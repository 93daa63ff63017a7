"""The coordinator's HTTP API: the endpoints `runtime.client.CoordinatorClient` calls, the dashboard (`/`) and
Prometheus metrics (`/metrics`).

HTTP plumbing only: each route hands its request to one part of `coordinator.service.Coordinator`. Signed endpoints
go through `coordinator.pipeline` (the signature header checked before the body is read, one hop to a worker
thread, the gate, the action, a stored answer for a retry). Every request passes the per-source rate limits first
(`coordinator.ratelimit`; inside the HTTP metrics, so that 429s are counted), then the body-size limit. Every
error is `{"detail": reason, "code": code}` (`protocol.refusals`): refusals are 4xx (a 429 with Retry-After),
failures of the coordinator's own storage 503/507 (`coordinator.failures`), anything else a 500 that keeps the
connection (`coordinator.middleware`).
Path and query parameters are bounded like payload fields (422 beyond them); every list is a page. The OpenAPI
schema is served at /openapi.json.

No `from __future__ import annotations` here: FastAPI must evaluate the endpoint annotations.
"""

import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Header, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from swarmrl.coordinator import dashboard, metrics
from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.checkpoints import is_sha256
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.failures import refusal_of
from swarmrl.coordinator.middleware import BodyLimitMiddleware, ErrorMiddleware, error_response
from swarmrl.coordinator.pipeline import REFUSALS, Offload, SignedDispatch, SignedRoutes
from swarmrl.coordinator.ratelimit import RateLimitMiddleware
from swarmrl.coordinator.service import Coordinator
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.ledger import MAX_LEDGER_PAGE, Contributors, LedgerPage
from swarmrl.protocol.manifest import SignedManifest
from swarmrl.protocol.overview import Overview, Training
from swarmrl.protocol.pydantic_errors import describe_validation_error
from swarmrl.protocol.receipts import KIND_RECEIPTS, ReceiptPage, ReceiptsRequest
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.signing import MAX_HEADER_CHARS, PAYLOAD_HEADER, SIGNATURE_HEADER

SHARD_PUT_PREFIX = "/v1/trainer/shards/"
log = logging.getLogger("swarmrl.coordinator")


def _json(obj: BaseModel) -> Response:
    return Response(obj.model_dump_json(), media_type="application/json")


def _error(code: RefusalCode, reason: str, headers: dict[str, str] | None = None) -> Response:
    status, head, body = error_response(code, reason, headers)
    response = Response(body, status_code=status)
    response.raw_headers = head
    return response


_HTTP_CODES = {404: RefusalCode.NOT_FOUND, 405: RefusalCode.METHOD_NOT_ALLOWED}
"""What the router's own refusals (no such path, another method) are."""


def build_app(config: CoordinatorConfig, identity: Identity, clock: Callable[[], float] = time.time,
              writer: str | None = None) -> FastAPI:
    """The coordinator app over `config.data_dir` and `config.store_url`, signing manifests with `identity`;
    `writer`: the socket of the store's writer process, when one runs (`coordinator.db.sqlite.writer`).

    The store opens now (so `app.state.coordinator` is usable at once) and closes on app shutdown.
    """
    svc = Coordinator(config, identity, clock=clock, writer=writer)
    offload = Offload(config.worker_threads)
    operator_offload = Offload(config.operator_threads)

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # noqa: ANN202
        try:
            yield
        finally:
            offload.close()
            operator_offload.close()
            svc.close()

    app = FastAPI(title="swarmrl coordinator", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description=f"A signed request's body is the endpoint's message; its Ed25519 signature, over the "
                              f"body's sha256 and this pool, travels in the {SIGNATURE_HEADER} header (see "
                              "protocol.signing). Refusals are {\"detail\": reason, \"code\": code}: "
                              "programs act on the code (protocol.refusals.RefusalCode).")
    app.state.coordinator = svc

    def limit_for(scope: Scope) -> int:
        if scope.get("method") == "PUT" and scope.get("path", "").startswith(SHARD_PUT_PREFIX):
            return config.max_shard_bytes
        return config.max_body_bytes

    signed = SignedRoutes(svc)
    signed.install_openapi(app)
    app.add_middleware(SignedDispatch, routes=signed, offload=offload, operator_offload=operator_offload,
                       limits=config.rate_limits)
    app.add_middleware(BodyLimitMiddleware, limit_for=limit_for)
    app.add_middleware(RateLimitMiddleware, cfg=config.rate_limits)  # outside the body limit: before any body
    app.add_middleware(ErrorMiddleware)
    prometheus_registry = metrics.coordinator_registry(svc)
    app.add_middleware(metrics.HttpMetrics, registry=prometheus_registry)  # added last: the outermost, counts all

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> Response:
        if e.status_code == 204 or e.status_code == 304:
            return Response(status_code=e.status_code)
        return _error(_HTTP_CODES.get(e.status_code, RefusalCode.INVALID_REQUEST), str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> Response:
        in_body = any(tuple(err.get("loc", ()))[:1] == ("body",) for err in e.errors())
        return _error(RefusalCode.INVALID_PAYLOAD if in_body else RefusalCode.INVALID_REQUEST,
                      describe_validation_error(e, root="request") or "invalid request")

    async def _refusal(request: Request, e: Exception) -> Response:
        refusal = refusal_of(e, f"{request.method} {request.url.path}")
        if refusal is None:
            log.error("%s %s failed", request.method, request.url.path, exc_info=e)
            return _error(RefusalCode.INTERNAL_ERROR, f"internal error ({type(e).__name__})")
        return _error(*refusal)

    for exc in (Refused, SQLAlchemyError, OSError):
        app.add_exception_handler(exc, _refusal)

    Signature = Annotated[str | None, Header(alias=SIGNATURE_HEADER, max_length=MAX_HEADER_CHARS,
                                             description="The Ed25519 signature of the request (protocol.signing).")]
    Payload = Annotated[str, Header(alias=PAYLOAD_HEADER, max_length=MAX_HEADER_CHARS,
                                    description="A signed GET's payload (JSON), signed as its body.")]

    def header_signed(signature: str | None, payload: bytes, kind: str, model: type[BaseModel] | None,
                      role: str | None) -> Signed:
        """A request that is not a signed POST (a GET, whose payload travels in PAYLOAD_HEADER; a shard upload,
        whose body is data), authenticated and its nonce recorded (`Gate.admit_alone`: such requests store no
        answer)."""
        opened = svc.gate.open(svc.gate.check_header(signature, kind, role), payload, model, role)
        svc.gate.admit_alone(opened)
        return opened

    # -- public ---------------------------------------------------------------------------------------

    Page = Annotated[int, Query(ge=0, le=m.MAX_PAGE)]

    @app.get("/v1/info", response_model=m.RunInfo, responses=REFUSALS)
    def info() -> Response:
        return _json(svc.status.run_info())

    @app.get("/v1/status", response_model=m.RunStatus, responses=REFUSALS)
    def status(nodes: Page = 100, metrics: Page = 100) -> Response:
        """Counters of the run, the first `nodes` nodes and the newest `metrics` trainer reports."""
        return _json(svc.status.snapshot(nodes_limit=nodes, metrics_limit=metrics))

    @app.get("/v1/nodes", response_model=m.NodePage, responses=REFUSALS)
    def nodes(after: Annotated[str, Query(max_length=64)] = "",
              limit: Annotated[int, Query(ge=1, le=m.MAX_PAGE)] = 100) -> Response:
        """Registered nodes in id order, `limit` after node id `after`."""
        return _json(svc.status.nodes_page(after, limit))

    @app.get("/v1/metrics/trainer", response_model=m.MetricsPage, responses=REFUSALS)
    def trainer_reports(after: Annotated[int, Query(ge=0, lt=m.INT64_END)] = 0,
                        limit: Annotated[int, Query(ge=1, le=m.MAX_PAGE)] = 100) -> Response:
        """Trainer metrics reports, oldest first, `limit` after report `after`."""
        return _json(svc.status.metrics_page(after, limit))

    @app.get("/v1/manifest/latest", response_model=SignedManifest, responses={**REFUSALS, 204: {}})
    def manifest_latest() -> Response:
        signed_manifest = svc.checkpoints.manifest()
        return Response(status_code=204) if signed_manifest is None else _json(signed_manifest)

    @app.get("/v1/manifest/{version}", response_model=SignedManifest, responses=REFUSALS)
    def manifest_version(version: Annotated[int, Path(ge=0, lt=m.INT64_END)]) -> Response:
        signed_manifest = svc.checkpoints.manifest(version)
        if signed_manifest is None:
            raise Refused(RefusalCode.NO_SUCH_MANIFEST, f"no manifest for version {version}")
        return _json(signed_manifest)

    @app.get("/v1/shards/{sha256}", response_class=FileResponse, responses=REFUSALS)
    def shard(sha256: Annotated[str, Path(max_length=64)]) -> Response:
        return FileResponse(svc.checkpoints.shard_path(sha256), media_type="application/octet-stream")

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(dashboard.PAGE)

    @app.get("/metrics", include_in_schema=False)
    def prometheus() -> Response:
        return Response(metrics.render(prometheus_registry), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/overview", response_model=Overview, responses=REFUSALS)
    def overview() -> Response:
        return _json(svc.overviews.overview())

    @app.get("/v1/training", response_model=Training, responses=REFUSALS)
    def training() -> Response:
        """Whether training moves and what blocks it (the watchdog's; at most a few seconds old): what a node
        shows when it gets no work."""
        return _json(svc.watchdog.training())

    @app.get("/v1/ledger", response_model=LedgerPage, responses=REFUSALS)
    def ledger(after: Annotated[int, Query(ge=0, lt=m.INT64_END)] = 0,
               limit: Annotated[int, Query(ge=1, le=MAX_LEDGER_PAGE)] = 100,
               node_id: Annotated[str | None, Query(pattern="^[0-9a-f]{40}$")] = None) -> Response:
        return _json(svc.ledger.page(after, limit, node_id))

    @app.get("/v1/ledger/nodes", response_model=Contributors, responses=REFUSALS)
    def contributors(limit: Annotated[int, Query(ge=1, le=MAX_LEDGER_PAGE)] = 50) -> Response:
        """The largest contributors, one row per node (the dashboard's ledger table)."""
        return _json(svc.ledger.contributors(limit))

    @app.get("/v1/receipts", response_model=ReceiptPage, responses=REFUSALS)
    def receipts(signature: Signature = None, payload: Payload = "") -> Response:
        # A signed GET (payload and signature in headers). Any key may ask; it gets its own.
        return _json(svc.ledger.receipts_page(header_signed(signature, payload.encode(), KIND_RECEIPTS,
                                                            ReceiptsRequest, None)))

    # -- nodes ----------------------------------------------------------------------------------------

    @app.post("/v1/register/challenge", response_model=m.Challenge, responses=REFUSALS)
    def register_challenge(req: m.ChallengeRequest) -> Response:
        return _json(svc.registry.challenge(req))

    signed.add("/v1/register", m.KIND_REGISTER, m.RegisterRequest, None, svc.register, answer=m.Registered)
    signed.add("/v1/lease", m.KIND_LEASE, m.LeaseRequest, "node", svc.leases.issue, answer=m.Lease,
               empty="No work now (no published version yet, or enough work in flight): ask again later.")
    signed.add("/v1/submit", m.KIND_SUBMIT, m.RolloutSubmission, "node", svc.leases.submit, answer=m.SubmitResult,
               plan=svc.leases.plan_submit)
    signed.add("/v1/heartbeat", m.KIND_HEARTBEAT, m.Heartbeat, "node", svc.registry.heartbeat, idempotent=False,
               plan=svc.registry.plan_heartbeat)

    # -- verifier -------------------------------------------------------------------------------------

    signed.add("/v1/verifier/pending", m.KIND_VERIFIER_PENDING, m.PendingRequest, "operator",
               svc.verification.claim, answer=m.PendingGroups)
    signed.add("/v1/verifier/verdicts", m.KIND_VERIFIER_VERDICTS, m.VerdictBatch, "operator", svc.verification.decide)

    # -- trainer --------------------------------------------------------------------------------------

    signed.add("/v1/trainer/batch", m.KIND_TRAINER_BATCH, m.BatchRequest, "operator", svc.feed.batch,
               answer=m.TrainingBatch, idempotent=False)
    signed.add("/v1/trainer/ack", m.KIND_TRAINER_ACK, m.FeedAck, "operator", svc.feed.ack, answer=m.FeedAcked)
    signed.add("/v1/trainer/publish", m.KIND_TRAINER_PUBLISH, m.PublishRequest, "operator", svc.checkpoints.publish,
               answer=SignedManifest)
    signed.add("/v1/trainer/metrics", m.KIND_TRAINER_METRICS, m.TrainerMetrics, "operator", svc.status.record_metrics)

    @app.put(SHARD_PUT_PREFIX + "{sha256}", status_code=204, responses=REFUSALS)
    async def put_shard(sha256: Annotated[str, Path(max_length=64)], request: Request, signature: Signature = None
                        ) -> Response:
        """Upload one content-addressed shard (the body), signed by an operator: the signed body digest is the
        shard's address."""
        # The header is checked before a byte of the body is read, so that nobody else makes us buffer a shard.
        if not is_sha256(sha256):
            raise Refused(RefusalCode.NOT_SHA256, "not a sha256")
        sig = svc.gate.check_header(signature, m.KIND_TRAINER_SHARD, "operator")
        if sig.body != sha256:
            raise Refused(RefusalCode.SHARD_NOT_SIGNED, "the signature is for another shard")
        opened = await operator_offload(svc.gate.open, sig, await request.body(), None, "operator")
        await operator_offload(svc.gate.admit_alone, opened)
        await operator_offload(svc.checkpoints.put_shard, sha256, opened.payload)
        return Response(status_code=204)

    return app
