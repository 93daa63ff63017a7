"""A typed HTTP client for the coordinator API, used by nodes, the verifier and the trainer.

Every call either returns a protocol object or raises `CoordinatorError` with the coordinator's reason and its code
(`protocol.refusals.RefusalCode`): callers decide on the code, never on the reason's words, which may change.
Transport errors (refused connections, timeouts, resets) and 5xx answers are retried with exponential backoff
and full jitter (`runtime.retry.RetryPolicy`); `retries=None` retries for as long as it takes, which is how a
node waits out a coordinator that is down or restarting; a 429 is retried after its Retry-After. Every try of a
signed request is signed afresh (a new nonce and timestamp), so a retry is neither refused as a replay nor as stale
after a long outage. Requests that change state (POST, PUT) carry an `Idempotency-Key` header, one random key per
logical request, the same on each of its retries, so that a coordinator can recognise a retry of a request it
already applied. An `Outage` shared by the client's users logs the start and the end of each outage once.

What the coordinator signs is checked before it is used: the run description (`RunInfo.verify`) against the
coordinator key the client was given (or, without one, the first one it saw), and every lease (`Lease.verify`: for
this pool, this node, the run's sampling). A response that does not verify raises `UntrustedResponse`: it was
rewritten on the way (use https), and acting on it could get an honest node banned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from swarmrl.protocol import messages as m
from swarmrl.protocol import signing
from swarmrl.protocol.groupsig import sign_group
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.ledger import LedgerPage
from swarmrl.protocol.manifest import CheckpointManifest, SignedManifest
from swarmrl.protocol.overview import Overview, Training
from swarmrl.protocol.receipts import KIND_RECEIPTS, ReceiptPage, ReceiptsRequest
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.signing import PAYLOAD_HEADER, SIGNATURE_HEADER, SignatureError, sign, time_ordered_id
from swarmrl.runtime.errors import not_a_coordinator
from swarmrl.runtime.refused import CoordinatorError, UntrustedResponse, refusal_in
from swarmrl.runtime.retry import INTERNAL_ERROR_RETRIES, UNAVAILABLE_STATUSES, Outage, RetryPolicy

log = logging.getLogger("swarmrl.client")

T = TypeVar("T", bound=BaseModel)

IDEMPOTENCY_HEADER = "Idempotency-Key"
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Failures after which the request cannot have reached the server: its retry cannot be a repeat.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
REGISTER_TRIES = 3


def new_idempotency_key(now: float | None = None) -> str:
    """The Idempotency-Key of a new logical request (sent again, unchanged, with each of its retries): 27 hex
    digits, the time in milliseconds (11) then 64 random bits (16). The time first lets the coordinator store the
    answers to one moment's requests side by side (`coordinator.idempotency`); the random part keeps two requests
    apart."""
    return time_ordered_id(time.time() if now is None else now, 16)


class CoordinatorClient:
    """Talks to one coordinator at `base_url` (e.g. http://127.0.0.1:8470).

    `retries`: retries after the first try of a request (None: until it succeeds or `stop` is set); `retry`, when
    given, replaces it with a full policy. `stop`: an event that ends a retrying request at once (it raises its
    last error). `outage`: shared outage bookkeeping (one is made if not given). `transport`: an httpx transport
    (default: plain HTTP/1.1 connections). `coordinator_key`: the key the coordinator must sign with (a node's
    pinned key); None trusts the key of the first run description fetched, for the client's lifetime.
    """

    def __init__(self, base_url: str, identity: Identity | None = None, timeout: float = 30.0,
                 retries: int | None = 5, *, retry: RetryPolicy | None = None, stop: threading.Event | None = None,
                 outage: Outage | None = None, transport: httpx.BaseTransport | None = None,
                 coordinator_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.identity = identity
        self.coordinator_key = coordinator_key.lower() if coordinator_key else None
        self.run: m.RunInfo | None = None
        """The newest verified run description."""
        self.retry = retry if retry is not None else RetryPolicy(attempts=retries)
        self.stop = stop
        self.outage = outage if outage is not None else Outage(self.base_url)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport)

    @property
    def retries(self) -> int | None:
        return self.retry.attempts

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, *, build: Callable[[], dict[str, Any]] | None = None,
                 **kw: Any) -> httpx.Response:
        """Send a request, retrying per `self.retry`. `build`, when given, makes keyword arguments afresh for
        each try (a signed body or header is signed again); `kw` are the same for every try."""
        idempotency_key = new_idempotency_key() if method in _STATE_CHANGING else None
        policy, started, attempt, internal, maybe_sent = self.retry, time.monotonic(), 0, 0, False
        while True:
            args = {**kw, **(build() if build is not None else {})}
            if idempotency_key is not None:
                args["headers"] = {**args.get("headers", {}), IDEMPOTENCY_HEADER: idempotency_key}
            try:
                resp = self._http.request(method, path, **args)
            except httpx.UnsupportedProtocol:
                raise  # not an http(s) URL: no retry will change that
            except httpx.TransportError as e:
                error: Exception = e
                maybe_sent = maybe_sent or not isinstance(e, _NOT_SENT)
                self.outage.failed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            else:
                status = resp.status_code
                wait = _retry_after(resp) if status == 429 else None
                if wait is not None:  # a rate limit: wait as long as it says, then try again
                    error = refusal_in(resp, maybe_sent)
                    if not policy.may_retry(attempt, started, time.monotonic()):
                        raise error
                    if self.stop is not None:
                        if self.stop.wait(min(wait, policy.cap_s)):
                            raise error
                    else:
                        time.sleep(min(wait, policy.cap_s))
                    attempt += 1
                    continue
                if status in UNAVAILABLE_STATUSES:
                    error = refusal_in(resp, maybe_sent)
                    self.outage.failed(f"HTTP {status}")
                else:
                    self.outage.ok()
                    if status < 400:
                        return resp
                    error = refusal_in(resp, maybe_sent)
                    if status < 500 or internal >= INTERNAL_ERROR_RETRIES:
                        raise error
                    internal += 1
                maybe_sent = True
            if not policy.may_retry(attempt, started, time.monotonic()):
                raise error
            delay = policy.delay(attempt)
            if self.stop is not None:
                if self.stop.wait(delay):
                    raise error
            else:
                time.sleep(delay)
            attempt += 1

    @property
    def pool(self) -> str:
        """The pool every request is signed for (from the verified run description, fetched when first needed)."""
        return (self.run or self.info()).pool

    def signature_header(self, kind: str, body: bytes) -> dict[str, str]:
        """The header that signs `body` as a `kind` request of this pool."""
        if self.identity is None:
            raise ValueError("this call must be signed: give the client an identity")
        return {SIGNATURE_HEADER: sign(self.identity, kind, self.pool, body).header()}

    def _signed(self, path: str, kind: str, payload: BaseModel, out: type[T] | None,
                answer_signed: bool = False) -> T | None:
        """POST `payload` signed as a `kind` request; the answer as `out` (None for 204). `answer_signed` (an
        operator's call): unless the answer carries the coordinator's signature for this very try of the request
        (`protocol.signing.verify_answer`), UntrustedResponse, and nothing in it is used."""
        body = payload.model_dump_json().encode()
        tries: list[dict[str, str]] = []
        resp = self._request("POST", path, build=lambda: {
            "content": body, "headers": tries.append(self.signature_header(kind, body)) or tries[-1]})
        if out is None or resp.status_code == 204:
            return None
        if answer_signed:
            try:
                signing.verify_answer(resp.headers.get(SIGNATURE_HEADER), resp.content,
                                      request=tries[-1][SIGNATURE_HEADER], key=self.coordinator_key or "")
            except SignatureError as e:
                raise UntrustedResponse(f"the answer to {path} does not verify: {e.reason}") from None
        return out.model_validate_json(resp.content)

    def trust(self, run: m.RunInfo) -> m.RunInfo:
        """`run`, once its signature verifies against the coordinator key (pinned on first use when none was
        given); UntrustedResponse otherwise."""
        if self.coordinator_key is not None and run.coordinator_key != self.coordinator_key:
            raise UntrustedResponse(f"the run description names key {run.coordinator_key[:16]}…, not the "
                                    f"coordinator's {self.coordinator_key[:16]}…")
        try:
            run.verify(self.coordinator_key)
        except SignatureError as e:
            raise UntrustedResponse(f"the run description does not verify: {e.reason}") from None
        self.coordinator_key = run.coordinator_key
        self.run = run
        return run

    # -- public endpoints -----------------------------------------------------------------------------

    def info(self, trust: bool = True) -> m.RunInfo:
        """The run description, verified (`trust`). With trust=False it is only checked to carry a valid signature
        of the key it names, and changes nothing here: for a caller that decides itself whether that key is the
        one it trusts (a node's pin)."""
        try:
            run = m.RunInfo.model_validate_json(self._request("GET", "/v1/info").content)
        except (CoordinatorError, ValidationError) as e:  # a 404 or a page that is no run: not a coordinator
            raise not_a_coordinator(self.base_url, e) from None
        if not trust:
            try:
                run.verify()
            except SignatureError as e:
                raise UntrustedResponse(f"the run description does not verify: {e.reason}") from None
            return run
        return self.trust(run)

    def status(self, nodes: int = 100, metrics: int = 100) -> m.RunStatus:
        """Counters of the run, the first `nodes` nodes and the newest `metrics` trainer reports (at most
        `messages.MAX_PAGE` each; `nodes()` and `trainer_reports()` page through all of them)."""
        resp = self._request("GET", "/v1/status", params={"nodes": nodes, "metrics": metrics})
        return m.RunStatus.model_validate_json(resp.content)

    def nodes(self, page: int = m.MAX_PAGE) -> Iterator[m.NodeStatus]:
        """Every registered node, in node id order, fetched a page at a time."""
        after: str | None = ""
        while after is not None:
            got = m.NodePage.model_validate_json(
                self._request("GET", "/v1/nodes", params={"after": after, "limit": page}).content)
            yield from got.nodes
            after = got.next_after

    def trainer_reports(self, after: int = 0, page: int = m.MAX_PAGE) -> Iterator[m.MetricsReport]:
        """Every trainer metrics report recorded after report `after`, oldest first, a page at a time."""
        cursor: int | None = after
        while cursor is not None:
            got = m.MetricsPage.model_validate_json(
                self._request("GET", "/v1/metrics/trainer", params={"after": cursor, "limit": page}).content)
            yield from got.reports
            cursor = got.next_after

    def latest_manifest(self) -> SignedManifest | None:
        resp = self._request("GET", "/v1/manifest/latest")
        return None if resp.status_code == 204 else SignedManifest.model_validate_json(resp.content)

    def manifest(self, version: int) -> SignedManifest | None:
        """The signed manifest of one policy version, or None when the coordinator has none for it."""
        try:
            resp = self._request("GET", f"/v1/manifest/{int(version)}")
        except CoordinatorError as e:
            if e.code is RefusalCode.NO_SUCH_MANIFEST:
                return None
            raise
        return SignedManifest.model_validate_json(resp.content)

    def shard(self, sha256: str) -> bytes:
        return self._request("GET", f"/v1/shards/{sha256}").content

    def overview(self) -> Overview:
        return Overview.model_validate_json(self._request("GET", "/v1/overview").content)

    def training(self) -> Training:
        """Whether the pool's training moves and what blocks it (the coordinator's watchdog)."""
        return Training.model_validate_json(self._request("GET", "/v1/training").content)

    def ledger(self, after: int = 0, limit: int = 100, node_id: str | None = None) -> LedgerPage:
        """One page of the contribution ledger (of one node, when `node_id` is given)."""
        params: dict[str, Any] = {"after": after, "limit": limit}
        if node_id is not None:
            params["node_id"] = node_id
        return LedgerPage.model_validate_json(self._request("GET", "/v1/ledger", params=params).content)

    # -- nodes ----------------------------------------------------------------------------------------

    def register(self, name: str = "", engine: str = "") -> m.Registered:
        """Register this client's key by signing a fresh challenge. A challenge is single use: when the answer
        to a register request is lost and its retry finds the challenge spent (or expired), the exchange is
        done again with a new one (up to REGISTER_TRIES times)."""
        assert self.identity is not None
        for attempt in range(REGISTER_TRIES):
            ch = m.Challenge.model_validate_json(
                self._request("POST", "/v1/register/challenge",
                              json=m.ChallengeRequest(public_key=self.identity.public_key_hex).model_dump()).content
            )
            req = m.RegisterRequest(challenge=ch.challenge, name=name, engine=engine)
            try:
                reg: m.Registered = self._signed("/v1/register", m.KIND_REGISTER, req, m.Registered)  # type: ignore
                self.trust(reg.run)
                return reg
            except UntrustedResponse:
                raise
            except CoordinatorError as e:
                if e.code is not RefusalCode.BAD_CHALLENGE or attempt == REGISTER_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def lease(self, max_prompts: int, held_version: int) -> m.Lease | None:
        """A lease of prompts, or None when the coordinator has no work right now."""
        req = m.LeaseRequest(max_prompts=max_prompts, held_version=held_version)
        lease = self._signed("/v1/lease", m.KIND_LEASE, req, m.Lease)
        if lease is not None:
            self.check_lease(lease)
        return lease

    def check_lease(self, lease: m.Lease) -> None:
        """UntrustedResponse unless `lease` is the coordinator's, for this pool and this node, with the run's
        sampling: a node generates only what it can be judged fairly on."""
        run = self.run or self.info()
        assert self.identity is not None and self.coordinator_key is not None
        try:
            lease.verify(self.coordinator_key, run.pool)
        except SignatureError as e:
            raise UntrustedResponse(f"lease {lease.lease_id[:24]} does not verify: {e.reason}") from None
        if lease.node_id != self.identity.node_id:
            raise UntrustedResponse(f"lease {lease.lease_id[:24]} was issued to another node")
        if lease.sampling != run.spec.sampling:
            raise UntrustedResponse(f"lease {lease.lease_id[:24]} samples otherwise than the run")

    def submit(self, submission: m.RolloutSubmission) -> m.SubmitResult:
        """The coordinator's answer to `submission`, each of its groups signed by this client's key as sent
        (`protocol.groupsig`). A next lease it holds (asked for with `submission.next_lease`) is checked as `lease`
        checks one; one that does not pass is dropped from the answer, the reason put in `next_lease_refused` (the
        submission's own outcome stands)."""
        assert self.identity is not None
        lease_id, version, pool = submission.lease_id, submission.policy_version, self.pool
        signed = [sign_group(self.identity, g, lease_id=lease_id, policy_version=version, pool=pool)
                  for g in submission.groups]
        result: m.SubmitResult = self._signed(  # type: ignore[assignment]
            "/v1/submit", m.KIND_SUBMIT, submission.model_copy(update={"groups": signed}), m.SubmitResult)
        if result.next_lease is not None:
            try:
                self.check_lease(result.next_lease)
            except UntrustedResponse as e:
                log.warning("%s", e.reason)
                result = result.model_copy(update={"next_lease": None, "next_lease_refused": e.reason})
        return result

    def heartbeat(self, held_version: int, status: str = "", idle_s: float = 0.0, busy_s: float = 0.0) -> None:
        """Say the node is alive, which version it holds, and its idle and busy seconds since it started."""
        hb = m.Heartbeat(held_version=held_version, status=status, idle_s=idle_s, busy_s=busy_s)
        self._signed("/v1/heartbeat", m.KIND_HEARTBEAT, hb, None)

    def receipts(self, after: int = 0, limit: int = 200) -> ReceiptPage:
        """This client's receipts with a seq above `after`, oldest first (a signed GET)."""
        if self.identity is None:
            raise ValueError("receipts are asked for with a signed request: give the client an identity")
        payload = ReceiptsRequest(after=after, limit=limit).model_dump_json().encode()
        resp = self._request("GET", "/v1/receipts", build=lambda: {"headers": {
            PAYLOAD_HEADER: payload.decode(), **self.signature_header(KIND_RECEIPTS, payload)}})
        return ReceiptPage.model_validate_json(resp.content)

    # -- verifier -------------------------------------------------------------------------------------

    def pending(self, limit: int = 64, wait_s: float = 0.0) -> list[m.PendingGroup]:
        """Claim up to `limit` pending groups; with `wait_s`, the coordinator waits that long for one to arrive."""
        resp = self._signed("/v1/verifier/pending", m.KIND_VERIFIER_PENDING,
                            m.PendingRequest(limit=limit, wait_s=wait_s), m.PendingGroups, answer_signed=True)
        return resp.groups if resp else []

    def verdicts(self, verdicts: list[m.Verdict]) -> None:
        self._signed("/v1/verifier/verdicts", m.KIND_VERIFIER_VERDICTS, m.VerdictBatch(verdicts=verdicts), None)

    # -- trainer --------------------------------------------------------------------------------------

    def training_batch(self, after_id: int, limit: int, wait_s: float = 0.0) -> m.TrainingBatch:
        """Accepted groups after `after_id`; with `wait_s`, the coordinator waits that long for one to arrive.
        Reading moves nothing on the coordinator: see `ack`."""
        req = m.BatchRequest(after_id=after_id, limit=limit, wait_s=wait_s)
        return self._signed("/v1/trainer/batch", m.KIND_TRAINER_BATCH, req, m.TrainingBatch,  # type: ignore[return-value]
                            answer_signed=True)

    def ack(self, cursor: int) -> m.FeedAcked:
        """Acknowledge that the trainer's saved state has consumed every feed position up to `cursor` (the
        coordinator counts later accepted groups as still in flight). Acknowledgements are cumulative: a lower
        cursor than one already acknowledged changes nothing."""
        return self._signed("/v1/trainer/ack", m.KIND_TRAINER_ACK, m.FeedAck(cursor=cursor),
                            m.FeedAcked, answer_signed=True)  # type: ignore[return-value]

    def upload_shard(self, sha256: str, data: bytes) -> None:
        """Upload a shard; its signature covers its bytes, whose sha256 is its address."""
        self._request("PUT", f"/v1/trainer/shards/{sha256}", content=data,
                      build=lambda: {"headers": self.signature_header(m.KIND_TRAINER_SHARD, data)})

    def publish(self, manifest: CheckpointManifest) -> SignedManifest:
        return self._signed("/v1/trainer/publish", m.KIND_TRAINER_PUBLISH, m.PublishRequest(manifest=manifest),
                            SignedManifest, answer_signed=True)  # type: ignore[return-value]

    def metrics(self, step: int, version: int, metrics: dict[str, float]) -> None:
        self._signed("/v1/trainer/metrics", m.KIND_TRAINER_METRICS,
                     m.TrainerMetrics(step=step, version=version, metrics=metrics), None)


def _retry_after(resp: httpx.Response) -> float | None:
    """The seconds a 429's Retry-After asks for (None without a usable one)."""
    try:
        return max(0.0, float(resp.headers["retry-after"]))
    except (KeyError, ValueError):
        return None
