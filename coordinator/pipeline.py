"""The path of a signed request through the HTTP layer, and its description in the OpenAPI schema.

    body (read on the event loop) -> one hop to a worker thread -> Gate.open (no database) -> the endpoint's action
    (its transaction begins with `gate.admit`) -> the answer (or the stored answer of an earlier try)

One hop, not one per dependency: a coordinator under load spends its CPU per request, and a thread hop costs about
what verifying a signature does. The worker threads are the coordinator's own (`store_pool_size` of them, each
may hold a database connection); the envelope is parsed once and its signature verified once.

A signed endpoint's request body is documented as what it really is: an envelope (`Signed<Payload>`) whose
`payload` is the endpoint's message, with the optional Idempotency-Key header; answers as their models, refusals
as `{"detail": reason}`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.json_schema import models_json_schema

from swarmrl.coordinator.auth import Refused, Replayed, Signed
from swarmrl.coordinator.idempotency import KEY_PATTERN, Answer, Answered
from swarmrl.coordinator.service import Coordinator
from swarmrl.runtime.client import IDEMPOTENCY_HEADER

T = TypeVar("T")


class Refusal(BaseModel):
    """Every refusal: a 4xx (or 503/507) status and the reason, in words a node operator can act on."""

    detail: str


REFUSALS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": Refusal, "description": "Refused, with the reason."},
    503: {"model": Refusal, "description": "The coordinator or its database is overloaded or unavailable."},
    507: {"model": Refusal, "description": "The coordinator's disk is full: nothing was stored."},
}


def respond(answer: Answer) -> Response:
    if answer.status == 204:
        return Response(status_code=204)
    return Response(answer.body, status_code=answer.status, media_type="application/json")


class Offload:
    """Runs blocking work on the coordinator's worker threads."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="coordinator")

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def envelope_model(kind: str, payload: type[BaseModel]) -> type[BaseModel]:
    """The request body of an endpoint of `kind`: a signed envelope (`protocol.signing.SignedEnvelope`) whose
    payload is a `payload` (for the schema only: requests are parsed by `Gate.open`)."""
    return create_model(
        f"Signed{payload.__name__}", __config__=ConfigDict(extra="forbid"),
        __doc__=f"A `{kind}` message signed with the sender's Ed25519 key (see protocol.signing).",
        kind=(Literal[kind], Field(description="The message type; must match the endpoint.")),  # type: ignore[valid-type]
        public_key=(str, Field(min_length=64, max_length=64, description="The signer's Ed25519 public key, hex.")),
        nonce=(str, Field(min_length=32, max_length=32, description="16 random bytes, hex; never reused.")),
        timestamp=(float, Field(description="The signer's clock, unix seconds.")),
        payload=(payload, Field(description="The message.")),
        signature=(str, Field(min_length=128, max_length=128, description="Ed25519 signature, hex.")),
    )


class SignedRoutes:
    """Adds signed endpoints to `app`, each with its envelope in the OpenAPI schema."""

    def __init__(self, app: FastAPI, svc: Coordinator, offload: Offload):
        self.app, self.svc, self.offload = app, svc, offload
        self.envelopes: list[type[BaseModel]] = []
        app.openapi = self._openapi  # type: ignore[method-assign]

    def add(self, path: str, kind: str, payload: type[BaseModel], role: str | None,
            action: Callable[[Signed], BaseModel | None], *, answer: type[BaseModel] | None = None,
            empty: str = "", idempotent: bool = True, summary: str = "") -> None:
        """POST `path`: `action(request)` for a `kind` request signed by `role` ("node", "operator" or None);
        its result is the answer, an `answer` (None: 204, which `empty` describes when both can happen).
        `idempotent`: the answer is stored under the request's Idempotency-Key and a retry gets it again (the
        action calls `idempotency.remember`)."""
        envelope = envelope_model(kind, payload)
        self.envelopes.append(envelope)
        svc = self.svc

        def handle(raw: bytes, key: str | None) -> Response:
            req = svc.gate.open(raw, kind, payload, role, key)
            try:
                result = action(req)
            except Answered as e:
                return respond(e.answer)
            except Replayed:
                raise
            except Refused:
                svc.gate.keep_nonce(req)
                raise
            return respond(Answer.of(result))

        async def endpoint(request: Request) -> Response:
            raw = await request.body()
            return await self.offload(handle, raw, request.headers.get(IDEMPOTENCY_HEADER) if idempotent else None)

        parameters = [{"name": IDEMPOTENCY_HEADER, "in": "header", "required": False,
                       "description": "One random key per logical request, the same on each of its retries: a retry "
                                      "gets the first answer instead of being applied again.",
                       "schema": {"type": "string", "pattern": KEY_PATTERN.pattern}}] if idempotent else []
        responses: dict[int | str, dict[str, Any]] = {**REFUSALS}
        if answer is not None:
            responses[200] = {"model": answer, "description": "Done."}
        if empty:
            responses[204] = {"description": empty}
        self.app.add_api_route(
            path, endpoint, methods=["POST"], summary=summary or None, responses=responses,
            status_code=200 if answer is not None else 204, response_class=Response,
            openapi_extra={"parameters": parameters, "requestBody": {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{envelope.__name__}"}}}}})

    def _openapi(self) -> dict[str, Any]:
        app = self.app
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(e, "validation") for e in self.envelopes],
                                         ref_template="#/components/schemas/{model}")
            known = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                known.setdefault(name, definition)
            app.openapi_schema = schema
        return app.openapi_schema
