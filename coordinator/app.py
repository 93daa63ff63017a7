"""The coordinator's HTTP API: the endpoints `runtime.client.CoordinatorClient` calls, the dashboard (`/`) and
Prometheus metrics (`/metrics`).

HTTP plumbing only: each route hands its request to one part of `coordinator.service.Coordinator`. Signed
endpoints are sync functions (FastAPI runs them in its thread pool) whose request is authenticated by a
dependency that reads the raw body on the event loop and then opens the envelope (`coordinator.gate`). Every
error is `{"detail": reason}`; path parameters are bounded like payload fields (422 beyond them).

No `from __future__ import annotations` here: FastAPI must evaluate the endpoint annotations, some of
which name dependencies local to `build_app`.
"""

import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from swarmrl.coordinator import dashboard, metrics
from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.checkpoints import is_sha256
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.middleware import BodyLimitMiddleware, ErrorMiddleware
from swarmrl.coordinator.service import Coordinator
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.ledger import MAX_LEDGER_PAGE
from swarmrl.protocol.receipts import KIND_RECEIPTS, ReceiptsRequest
from swarmrl.runtime.client import ENVELOPE_HEADER

SHARD_PUT_PREFIX = "/v1/trainer/shards/"


def _json(obj: BaseModel) -> Response:
    return Response(obj.model_dump_json(), media_type="application/json")


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"detail": reason}, status_code=status)


def build_app(config: CoordinatorConfig, identity: Identity, clock: Callable[[], float] = time.time) -> FastAPI:
    """The coordinator app over `config.data_dir` and `config.store_url`, signing manifests with `identity`.

    The store opens now (so `app.state.coordinator` is usable at once) and closes on app shutdown.
    """
    svc = Coordinator(config, identity, clock=clock)

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # noqa: ANN202
        try:
            yield
        finally:
            svc.close()

    app = FastAPI(title="swarmrl coordinator", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.coordinator = svc

    def limit_for(scope: Scope) -> int:
        if scope.get("method") == "PUT" and scope.get("path", "").startswith(SHARD_PUT_PREFIX):
            return config.max_shard_bytes
        return config.max_body_bytes

    app.add_middleware(BodyLimitMiddleware, limit_for=limit_for)
    app.add_middleware(ErrorMiddleware)
    prometheus_registry = metrics.coordinator_registry(svc)
    app.add_middleware(metrics.HttpMetrics, registry=prometheus_registry)  # added last: the outermost, counts all

    @app.exception_handler(Refused)
    async def _refused(_: Request, e: Refused) -> JSONResponse:
        return _error(e.status, e.reason)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> Response:
        if e.status_code == 204 or e.status_code == 304:
            return Response(status_code=e.status_code)
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', 'invalid')}" for err in e.errors()]
        return _error(422, "; ".join(parts[:5]) or "invalid request")

    async def raw_body(request: Request) -> bytes:
        return await request.body()

    RawBody = Annotated[bytes, Depends(raw_body)]

    def header_signed(request: Request, kind: str, model: type[BaseModel], role: str | None) -> Signed:
        """A request whose signed envelope travels in the ENVELOPE_HEADER header (its body, if any, is data)."""
        header = request.headers.get(ENVELOPE_HEADER)
        if header is None:
            raise Refused(401, f"missing {ENVELOPE_HEADER} header")
        return svc.gate.open(header, kind, model, role)

    def signed(kind: str, model: type[BaseModel], role: str | None) -> Any:
        def authenticate(body: RawBody) -> Signed:
            return svc.gate.open(body, kind, model, role)

        return Depends(authenticate)

    # -- public ---------------------------------------------------------------------------------------

    @app.get("/v1/info")
    def info() -> Response:
        return _json(svc.status.run_info())

    @app.get("/v1/status")
    def status() -> Response:
        return _json(svc.status.snapshot())

    @app.get("/v1/manifest/latest")
    def manifest_latest() -> Response:
        signed_manifest = svc.checkpoints.manifest()
        return Response(status_code=204) if signed_manifest is None else _json(signed_manifest)

    @app.get("/v1/manifest/{version}")
    def manifest_version(version: Annotated[int, Path(ge=0, lt=m.INT64_END)]) -> Response:
        signed_manifest = svc.checkpoints.manifest(version)
        if signed_manifest is None:
            raise Refused(404, f"no manifest for version {version}")
        return _json(signed_manifest)

    @app.get("/v1/shards/{sha256}")
    def shard(sha256: str) -> Response:
        return FileResponse(svc.checkpoints.shard_path(sha256), media_type="application/octet-stream")

    @app.get("/")
    def index() -> HTMLResponse:
        return HTMLResponse(dashboard.PAGE)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(prometheus_registry), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/overview")
    def overview() -> Response:
        return _json(svc.overviews.overview())

    @app.get("/v1/ledger")
    def ledger(after: Annotated[int, Query(ge=0, lt=m.INT64_END)] = 0,
               limit: Annotated[int, Query(ge=1, le=MAX_LEDGER_PAGE)] = 100,
               node_id: Annotated[str | None, Query(pattern="^[0-9a-f]{40}$")] = None) -> Response:
        return _json(svc.ledger.page(after, limit, node_id))

    @app.get("/v1/receipts")
    def receipts(request: Request) -> Response:
        # A GET: the node's signed request travels in the envelope header. Any key may ask; it gets its own.
        return _json(svc.ledger.receipts_page(header_signed(request, KIND_RECEIPTS, ReceiptsRequest, None)))

    # -- nodes ----------------------------------------------------------------------------------------

    @app.post("/v1/register/challenge")
    def register_challenge(req: m.ChallengeRequest) -> Response:
        return _json(svc.registry.challenge(req))

    @app.post("/v1/register")
    def register(req: Annotated[Signed, signed(m.KIND_REGISTER, m.RegisterRequest, None)]) -> Response:
        return _json(svc.register(req))

    @app.post("/v1/lease")
    def lease(req: Annotated[Signed, signed(m.KIND_LEASE, m.LeaseRequest, "node")]) -> Response:
        result = svc.leases.issue(req)
        return Response(status_code=204) if result is None else _json(result)

    @app.post("/v1/submit")
    def submit(req: Annotated[Signed, signed(m.KIND_SUBMIT, m.RolloutSubmission, "node")]) -> Response:
        return _json(svc.leases.submit(req))

    @app.post("/v1/heartbeat")
    def heartbeat(req: Annotated[Signed, signed(m.KIND_HEARTBEAT, m.Heartbeat, "node")]) -> Response:
        svc.registry.heartbeat(req)
        return Response(status_code=204)

    # -- verifier -------------------------------------------------------------------------------------

    @app.post("/v1/verifier/pending")
    def pending(req: Annotated[Signed, signed(m.KIND_VERIFIER_PENDING, m.PendingRequest, "operator")]) -> Response:
        groups = svc.verification.claim(req)
        body = '{"groups":[' + ",".join(g.model_dump_json() for g in groups) + "]}"
        return Response(body, media_type="application/json")

    @app.post("/v1/verifier/verdicts")
    def verdicts(req: Annotated[Signed, signed(m.KIND_VERIFIER_VERDICTS, m.VerdictBatch, "operator")]) -> Response:
        svc.verification.decide(req)
        return Response(status_code=204)

    # -- trainer --------------------------------------------------------------------------------------

    @app.post("/v1/trainer/batch")
    def trainer_batch(req: Annotated[Signed, signed(m.KIND_TRAINER_BATCH, m.BatchRequest, "operator")]) -> Response:
        return _json(svc.feed.batch(req))

    @app.post("/v1/trainer/ack")
    def trainer_ack(req: Annotated[Signed, signed(m.KIND_TRAINER_ACK, m.FeedAck, "operator")]) -> Response:
        return _json(svc.feed.ack(req))

    @app.put(SHARD_PUT_PREFIX + "{sha256}")
    async def put_shard(sha256: str, request: Request) -> Response:
        # Authenticate from the header first, so that nobody but an operator makes us buffer a shard.
        if not is_sha256(sha256):
            raise Refused(400, "not a sha256")
        opened = await run_in_threadpool(header_signed, request, m.KIND_TRAINER_SHARD, m.ShardUpload, "operator")
        upload = svc.checkpoints.check_shard_upload(sha256, opened.payload)
        data = await request.body()
        await run_in_threadpool(svc.checkpoints.put_shard, upload, data)
        return Response(status_code=204)

    @app.post("/v1/trainer/publish")
    def publish(req: Annotated[Signed, signed(m.KIND_TRAINER_PUBLISH, m.PublishRequest, "operator")]) -> Response:
        return _json(svc.checkpoints.publish(req))

    @app.post("/v1/trainer/metrics")
    def trainer_metrics(req: Annotated[Signed, signed(m.KIND_TRAINER_METRICS, m.TrainerMetrics, "operator")]
                        ) -> Response:
        svc.status.record_metrics(req)
        return Response(status_code=204)

    return app
