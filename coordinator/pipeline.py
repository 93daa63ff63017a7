"""The path of a signed request through the HTTP layer, and its description in the OpenAPI schema.

    signature header (checked on the event loop: `Gate.check_header`, no body read, no database) -> body ->
    one hop to a worker thread -> `Gate.open` (the body's digest, the role, the payload) -> the endpoint's action
    (its transaction begins with `gate.admit`) -> the answer (or the stored answer of an earlier try)

A node's submission or heartbeat is planned without blocking (`plan`) and written where this process writes
(`coordinator.db.writes`: one path, whatever the store). With the store's writer process, one from a node this
process knows is served on the event loop from start to end: the write is awaited from the writer
(`coordinator.db.sqlite.asyncwriter`) instead of waited for on a worker thread. That saves two hand-offs between threads
per request and the worker thread's turns at the GIL, which cost the two server processes about a fifth of their
CPU under load (bench/RESULTS.md).

Signed POST endpoints are served by `SignedDispatch`, an ASGI layer in front of the FastAPI router: nodes send
most of the coordinator's requests, and for each the router, its request objects and exception layers cost about
what the endpoint's own work does (measured in bench/RESULTS.md). A request whose signature header does not
verify is answered before a byte of its body is read. One hop to a worker thread, not one per dependency; the
worker threads are the coordinator's own, each may hold a database connection: `worker_threads` for everyone's
requests, and `operator_threads` for the operator's (verifiers, the trainer), whose long polls wait on them, so
that neither side can take the other's threads. The signature is verified once and the payload parsed once, from
the bytes as sent. Refusals are answered here in the API's shape, `{"detail": reason, "code": code}`
(`coordinator.failures`); anything unexpected goes on to `ErrorMiddleware`.

The schema describes these endpoints as they really are: the endpoint's message as the body, the signature in the
`SIGNATURE_HEADER` header (`protocol.signing`), the optional Idempotency-Key header, answers as their models,
refusals as `protocol.refusals.ErrorBody`. An operator's answer carries the coordinator's signature, bound to the
request's nonce (`protocol.signing.verify_answer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.types import ASGIApp, Receive, Scope, Send

from swarmrl.coordinator.auth import Refused, Replayed, Signed
from swarmrl.coordinator.db.writes import PlannedWrite
from swarmrl.coordinator.failures import refusal_of
from swarmrl.coordinator.idempotency import KEY_PATTERN, Answer, Answered
from swarmrl.coordinator.middleware import send_error
from swarmrl.coordinator.ratelimit import RateLimitConfig, source_of
from swarmrl.coordinator.service import Coordinator
from swarmrl.protocol.refusals import ErrorBody
from swarmrl.protocol.signing import MAX_HEADER_CHARS, SIGNATURE_HEADER, Signature, answer_kind, sign
from swarmrl.runtime.client import IDEMPOTENCY_HEADER

T = TypeVar("T")
_KEY_HEADER = IDEMPOTENCY_HEADER.lower().encode()
_SIGNATURE_HEADER = SIGNATURE_HEADER.lower().encode()
_JSON = [(b"content-type", b"application/json")]


REFUSALS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "Refused, with the reason and its code (protocol.refusals)."},
    503: {"model": ErrorBody, "description": "The coordinator or its database is overloaded or unavailable."},
    507: {"model": ErrorBody, "description": "The coordinator's disk is full: nothing was stored."},
}


class Offload:
    """Runs blocking work on the coordinator's worker threads."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="coordinator")

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class _Route:
    path: str  # what request metrics label it with (`scope["route"].path`, as for the router's routes)
    kind: str
    operator: bool  # signed by an operator: served on the operator's threads, answers signed
    check: Callable[[str | None, bool, str], Signature]
    handle: Callable[[Signature, bytes, str | None, str], Answer]
    plan: Callable[[Signed], PlannedWrite] | None  # a node's request, served on the event loop
    idempotent: bool
    body: type[BaseModel]
    answer: type[BaseModel] | None
    empty: str
    summary: str


class SignedRoutes:
    """The signed endpoints: what serves them (`handle`, run by `SignedDispatch`) and their OpenAPI entries."""

    def __init__(self, svc: Coordinator):
        self.svc = svc
        self.routes: dict[str, _Route] = {}

    def add(self, path: str, kind: str, payload: type[BaseModel], role: str | None,
            action: Callable[[Any], BaseModel | None], *, answer: type[BaseModel] | None = None,
            empty: str = "", idempotent: bool = True, summary: str = "",
            plan: Callable[[Signed], PlannedWrite] | None = None) -> None:
        """POST `path`: `action(request)` for a `kind` request signed by `role` ("node", "operator" or None);
        its result is the answer, an `answer` (None: 204, which `empty` describes when both can happen).
        `idempotent`: the answer is stored under the request's Idempotency-Key and a retry gets it again (the
        action calls `idempotency.remember`). `plan` (a node's request): `action` up to its write, worked out
        without blocking: the write for the store's writer process, or what does the rest on a request thread
        (`SignedDispatch`)."""
        assert plan is None or role == "node"
        svc = self.svc

        def check(header: str | None, keyed: bool, source: str) -> Signature:
            return svc.gate.check_header(header, kind, role, keyed, source)

        def handle(sig: Signature, raw: bytes, key: str | None, source: str) -> Answer:
            req = svc.gate.open(sig, raw, payload, role, key, source)
            try:
                result = action(req)
            except Answered as e:
                return e.answer
            except Replayed:
                raise
            except Refused:
                svc.gate.keep_nonce(req)
                raise
            return Answer.of(result)

        self.routes[path] = _Route(path, kind, role == "operator", check, handle, plan, idempotent, payload, answer,
                                   empty, summary)

    def install_openapi(self, app: FastAPI) -> None:
        """Make `app.openapi()` describe these endpoints beside the router's own."""

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                     routes=app.routes)
                models: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
                    (ErrorBody, "serialization")]
                for route in self.routes.values():
                    models.append((route.body, "validation"))
                    if route.answer is not None:
                        models.append((route.answer, "serialization"))
                _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
                known = schema.setdefault("components", {}).setdefault("schemas", {})
                for name, definition in defs.get("$defs", {}).items():
                    known.setdefault(name, definition)
                for path, route in self.routes.items():
                    schema.setdefault("paths", {})[path] = {"post": self._operation(path, route)}
                app.openapi_schema = schema
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]

    @staticmethod
    def _operation(path: str, route: _Route) -> dict[str, Any]:
        def ref(model: type[BaseModel]) -> dict[str, Any]:
            return {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}

        responses: dict[str, Any] = {str(status): {"description": info["description"], "content": ref(ErrorBody)}
                                     for status, info in REFUSALS.items()}
        if route.answer is not None:
            responses["200"] = {"description": "Done.", "content": ref(route.answer)}
        if route.empty or route.answer is None:
            responses["204"] = {"description": route.empty or "Done."}
        parameters = [{"name": SIGNATURE_HEADER, "in": "header", "required": True,
                       "description": "The sender's Ed25519 signature of the body for this pool "
                                      "(`protocol.signing.Signature`, compact JSON).",
                       "schema": {"type": "string", "maxLength": MAX_HEADER_CHARS}}]
        if route.idempotent:
            parameters.append({"name": IDEMPOTENCY_HEADER, "in": "header", "required": False,
                               "description": "One random key per logical request, the same on each of its retries: "
                                              "a retry gets the first answer instead of being applied again.",
                               "schema": {"type": "string", "pattern": KEY_PATTERN.pattern}})
        return {"operationId": "post" + path.replace("/", "_"), "summary": route.summary or path,
                "parameters": parameters, "requestBody": {"required": True, "content": ref(route.body)},
                "responses": responses}


class SignedDispatch:
    """ASGI: a POST to a signed endpoint is served here (see the module docstring); anything else goes on to
    `app`. Placed inside the rate limits and the body limit, so a body it reads is already bounded."""

    def __init__(self, app: ASGIApp, routes: SignedRoutes, offload: Offload, operator_offload: Offload,
                 limits: RateLimitConfig):
        self.app, self.routes, self.limits = app, routes.routes, limits
        self.offload, self.operator_offload = offload, operator_offload
        self.gate, self.writes = routes.svc.gate, routes.svc.writes
        self.identity, self.pool = routes.svc.identity, routes.svc.pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        scope["route"] = route
        header = key = None
        for k, v in scope["headers"]:
            if k == _SIGNATURE_HEADER:
                header = v.decode("latin-1")
            elif k == _KEY_HEADER and route.idempotent:
                key = v.decode("latin-1")
        try:
            source = source_of(scope, self.limits)
            sig = route.check(header, key is not None, source)  # no body is read for a header that does not verify
            chunks = []
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            offload = self.operator_offload if route.operator else self.offload
            if route.plan is not None and self.writes.on_the_loop and self.gate.knows_node(sig.signer_id):
                answer = await self._on_the_loop(route.plan, sig, b"".join(chunks), key, source, route.body)
            else:
                answer = await offload(route.handle, sig, b"".join(chunks), key, source)
        except Exception as e:
            refusal = refusal_of(e, f"POST {scope['path']}")
            if refusal is None:
                raise
            await send_error(send, *refusal)
            return
        headers = [*_JSON, (b"content-length", str(len(answer.body)).encode())] if answer.status != 204 else []
        if route.operator and answer.status == 200:  # an operator's link may be rewritten: the answer is signed
            signed = sign(self.identity, answer_kind(route.kind), self.pool, answer.body, nonce=sig.nonce)
            headers.append((_SIGNATURE_HEADER, signed.header().encode()))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})

    async def _on_the_loop(self, plan: Callable[[Signed], PlannedWrite], sig: Signature,
                           raw: bytes, key: str | None, source: str, body: type[BaseModel]) -> Answer:
        """What `SignedRoutes.add`'s `handle` does, on the event loop, for a request of a node this process knows:
        nothing of it blocks (its write is awaited from the writer process); what would block (a write here, a
        refused request's nonce) goes to a request thread."""
        req = self.gate.open(sig, raw, body, "node", key, source)
        try:
            result = await self.writes.run_async(plan(req), self.offload)
        except Answered as e:
            return e.answer
        except Replayed:
            raise
        except Refused:
            await self.offload(self.gate.keep_nonce, req)
            raise
        return Answer.of(result)
