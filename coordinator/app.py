"""The coordinator's HTTP API: the endpoints `runtime.client.CoordinatorClient` calls, plus a dashboard.

HTTP plumbing only; the rules live in `coordinator.service.Coordinator`. Signed endpoints are sync
functions (FastAPI runs them in its thread pool) whose request is authenticated by a dependency that
reads the raw body on the event loop and then opens the envelope. Every error is `{"detail": reason}`.

No `from __future__ import annotations` here: FastAPI must evaluate the endpoint annotations, some of
which name dependencies local to `build_app`.
"""

import json
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmrl.coordinator import dashboard, metrics
from swarmrl.coordinator.auth import Refused
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.service import Coordinator, Signed
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import ENVELOPE_HEADER

SHARD_PUT_PREFIX = "/v1/trainer/shards/"


def _json(obj: BaseModel) -> Response:
    return Response(obj.model_dump_json(), media_type="application/json")


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"detail": reason}, status_code=status)


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuse (413) a request body over its limit before the app parses any of it.

    A declared Content-Length over the limit is refused at once; an undeclared (chunked) body is counted
    as it streams. The body is drained up to a bound before answering, so that a client still sending
    reads our 413 instead of a reset connection.
    """

    DRAIN_BYTES = 16 * 1024 * 1024

    def __init__(self, app: ASGIApp, limit_for: Callable[[Scope], int]):
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _send_error(send, 400, "malformed Content-Length")
                return
            if length > limit:
                await self._drain(receive)
                await _send_error(send, 413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
                return
        received = 0
        started = False
        body_done = False

        async def counting_receive() -> Message:
            nonlocal received, body_done
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                if not body_done:  # draining a finished body would wait for a message that never comes
                    await self._drain(receive)
                await _send_error(send, 413, f"request body exceeds the limit of {limit} bytes")

    async def _drain(self, receive: Receive) -> None:
        drained = 0
        while drained < self.DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


async def _send_error(send: Send, status: int, reason: str) -> None:
    body = json.dumps({"detail": reason}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def build_app(config: CoordinatorConfig, identity: Identity, clock: Callable[[], float] = time.time) -> FastAPI:
    """The coordinator app over `config.data_dir`, signing manifests with `identity`.

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

    @app.exception_handler(Exception)
    async def _crash(_: Request, e: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the caller gets the same JSON shape as any other error.
        return _error(500, f"internal error ({type(e).__name__})")

    async def raw_body(request: Request) -> bytes:
        return await request.body()

    RawBody = Annotated[bytes, Depends(raw_body)]

    def signed(kind: str, model: type[BaseModel], role: str | None) -> Any:
        def authenticate(body: RawBody) -> Signed:
            return svc.open(body, kind, model, role)

        return Depends(authenticate)

    # -- public ---------------------------------------------------------------------------------------

    @app.get("/v1/info")
    def info() -> Response:
        return _json(svc.run_info())

    @app.get("/v1/status")
    def status() -> Response:
        return _json(svc.status())

    @app.get("/v1/manifest/latest")
    def manifest_latest() -> Response:
        signed_manifest = svc.manifest()
        return Response(status_code=204) if signed_manifest is None else _json(signed_manifest)

    @app.get("/v1/manifest/{version}")
    def manifest_version(version: int) -> Response:
        signed_manifest = svc.manifest(version)
        if signed_manifest is None:
            raise Refused(404, f"no manifest for version {version}")
        return _json(signed_manifest)

    @app.get("/v1/shards/{sha256}")
    def shard(sha256: str) -> Response:
        return FileResponse(svc.shard_path(sha256), media_type="application/octet-stream")

    @app.get("/")
    def index() -> HTMLResponse:
        return HTMLResponse(dashboard.PAGE)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(svc.status()), media_type=metrics.CONTENT_TYPE)

    # -- nodes ----------------------------------------------------------------------------------------

    @app.post("/v1/register/challenge")
    def register_challenge(req: m.ChallengeRequest) -> Response:
        return _json(svc.challenge(req))

    @app.post("/v1/register")
    def register(req: Annotated[Signed, signed(m.KIND_REGISTER, m.RegisterRequest, None)]) -> Response:
        return _json(svc.register(req))

    @app.post("/v1/lease")
    def lease(req: Annotated[Signed, signed(m.KIND_LEASE, m.LeaseRequest, "node")]) -> Response:
        result = svc.lease(req)
        return Response(status_code=204) if result is None else _json(result)

    @app.post("/v1/submit")
    def submit(req: Annotated[Signed, signed(m.KIND_SUBMIT, m.RolloutSubmission, "node")]) -> Response:
        return _json(svc.submit(req))

    @app.post("/v1/heartbeat")
    def heartbeat(req: Annotated[Signed, signed(m.KIND_HEARTBEAT, m.Heartbeat, "node")]) -> Response:
        svc.heartbeat(req)
        return Response(status_code=204)

    # -- verifier -------------------------------------------------------------------------------------

    @app.post("/v1/verifier/pending")
    def pending(req: Annotated[Signed, signed(m.KIND_VERIFIER_PENDING, m.PendingRequest, "operator")]) -> Response:
        groups = svc.pending(req)
        body = '{"groups":[' + ",".join(g.model_dump_json() for g in groups) + "]}"
        return Response(body, media_type="application/json")

    @app.post("/v1/verifier/verdicts")
    def verdicts(req: Annotated[Signed, signed(m.KIND_VERIFIER_VERDICTS, m.VerdictBatch, "operator")]) -> Response:
        svc.verdicts(req)
        return Response(status_code=204)

    # -- trainer --------------------------------------------------------------------------------------

    @app.post("/v1/trainer/batch")
    def trainer_batch(req: Annotated[Signed, signed(m.KIND_TRAINER_BATCH, m.BatchRequest, "operator")]) -> Response:
        return _json(svc.training_batch(req))

    @app.put(SHARD_PUT_PREFIX + "{sha256}")
    async def put_shard(sha256: str, request: Request) -> Response:
        # Authenticate from the header first, so that nobody but an operator makes us buffer a shard.
        upload = await run_in_threadpool(svc.check_shard_upload, sha256, request.headers.get(ENVELOPE_HEADER))
        data = await request.body()
        await run_in_threadpool(svc.put_shard, upload, data)
        return Response(status_code=204)

    @app.post("/v1/trainer/publish")
    def publish(req: Annotated[Signed, signed(m.KIND_TRAINER_PUBLISH, m.PublishRequest, "operator")]) -> Response:
        return _json(svc.publish(req))

    @app.post("/v1/trainer/metrics")
    def trainer_metrics(req: Annotated[Signed, signed(m.KIND_TRAINER_METRICS, m.TrainerMetrics, "operator")]
                        ) -> Response:
        svc.record_metrics(req)
        return Response(status_code=204)

    return app
