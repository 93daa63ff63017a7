"""A typed HTTP client for the coordinator API, used by nodes, the verifier and the trainer.

Every call either returns a protocol object or raises `CoordinatorError` with the coordinator's reason.
Connection failures are retried with backoff (every endpoint is safe to retry: signed requests carry a
fresh nonce per attempt, and submissions are deduplicated by lease and prompt id on the server).
"""

from __future__ import annotations

import json
import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import CheckpointManifest, SignedManifest
from swarmrl.protocol.signing import sign

T = TypeVar("T", bound=BaseModel)

ENVELOPE_HEADER = "x-swarmrl-envelope"


class CoordinatorError(Exception):
    """The coordinator refused a request (`status` is the HTTP status, `reason` its explanation)."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


class CoordinatorClient:
    """Talks to one coordinator at `base_url` (e.g. http://127.0.0.1:8470)."""

    def __init__(self, base_url: str, identity: Identity | None = None, timeout: float = 30.0,
                 retries: int = 5):
        self.base_url = base_url.rstrip("/")
        self.identity = identity
        self.retries = retries
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                resp = self._http.request(method, path, **kw)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if resp.status_code >= 400:
                try:
                    detail = resp.json().get("detail", resp.text)
                except (json.JSONDecodeError, AttributeError):
                    detail = resp.text
                raise CoordinatorError(resp.status_code, detail if isinstance(detail, str) else json.dumps(detail))
            return resp
        raise AssertionError("unreachable")

    def _signed(self, path: str, kind: str, payload: BaseModel, out: type[T] | None) -> T | None:
        if self.identity is None:
            raise ValueError("this call must be signed: give the client an identity")
        env = sign(self.identity, kind, payload)
        resp = self._request("POST", path, content=env.model_dump_json())
        if out is None or resp.status_code == 204:
            return None
        return out.model_validate_json(resp.content)

    # -- public endpoints -----------------------------------------------------------------------------

    def info(self) -> m.RunInfo:
        return m.RunInfo.model_validate_json(self._request("GET", "/v1/info").content)

    def status(self) -> m.RunStatus:
        return m.RunStatus.model_validate_json(self._request("GET", "/v1/status").content)

    def latest_manifest(self) -> SignedManifest | None:
        resp = self._request("GET", "/v1/manifest/latest")
        return None if resp.status_code == 204 else SignedManifest.model_validate_json(resp.content)

    def manifest(self, version: int) -> SignedManifest | None:
        """The signed manifest of one policy version, or None when the coordinator has none for it."""
        try:
            resp = self._request("GET", f"/v1/manifest/{int(version)}")
        except CoordinatorError as e:
            if e.status == 404:
                return None
            raise
        return SignedManifest.model_validate_json(resp.content)

    def shard(self, sha256: str) -> bytes:
        return self._request("GET", f"/v1/shards/{sha256}").content

    # -- nodes ----------------------------------------------------------------------------------------

    def register(self, name: str = "", engine: str = "") -> m.Registered:
        assert self.identity is not None
        ch = m.Challenge.model_validate_json(
            self._request("POST", "/v1/register/challenge",
                          json=m.ChallengeRequest(public_key=self.identity.public_key_hex).model_dump()).content
        )
        req = m.RegisterRequest(challenge=ch.challenge, name=name, engine=engine)
        return self._signed("/v1/register", m.KIND_REGISTER, req, m.Registered)  # type: ignore[return-value]

    def lease(self, max_prompts: int, held_version: int) -> m.Lease | None:
        """A lease of prompts, or None when the coordinator has no work right now."""
        req = m.LeaseRequest(max_prompts=max_prompts, held_version=held_version)
        return self._signed("/v1/lease", m.KIND_LEASE, req, m.Lease)

    def submit(self, submission: m.RolloutSubmission) -> m.SubmitResult:
        return self._signed("/v1/submit", m.KIND_SUBMIT, submission, m.SubmitResult)  # type: ignore[return-value]

    def heartbeat(self, held_version: int, status: str = "", idle_s: float = 0.0, busy_s: float = 0.0) -> None:
        """Say the node is alive, which version it holds, and its idle and busy seconds since it started."""
        hb = m.Heartbeat(held_version=held_version, status=status, idle_s=idle_s, busy_s=busy_s)
        self._signed("/v1/heartbeat", m.KIND_HEARTBEAT, hb, None)

    # -- verifier -------------------------------------------------------------------------------------

    def pending(self, limit: int = 64, wait_s: float = 0.0) -> list[m.PendingGroup]:
        """Claim up to `limit` pending groups; with `wait_s`, the coordinator waits that long for one to arrive."""
        resp = self._signed("/v1/verifier/pending", m.KIND_VERIFIER_PENDING,
                            m.PendingRequest(limit=limit, wait_s=wait_s), _PendingList)
        return resp.groups if resp else []

    def verdicts(self, verdicts: list[m.Verdict]) -> None:
        self._signed("/v1/verifier/verdicts", m.KIND_VERIFIER_VERDICTS, m.VerdictBatch(verdicts=verdicts), None)

    # -- trainer --------------------------------------------------------------------------------------

    def training_batch(self, after_id: int, limit: int, wait_s: float = 0.0) -> m.TrainingBatch:
        """Accepted groups after `after_id`; with `wait_s`, the coordinator waits that long for one to arrive.
        Reading moves nothing on the coordinator: see `ack`."""
        req = m.BatchRequest(after_id=after_id, limit=limit, wait_s=wait_s)
        return self._signed("/v1/trainer/batch", m.KIND_TRAINER_BATCH, req, m.TrainingBatch)  # type: ignore[return-value]

    def ack(self, cursor: int) -> m.FeedAcked:
        """Acknowledge that the trainer's saved state has consumed every feed position up to `cursor` (the
        coordinator counts later accepted groups as still in flight). Acknowledgements are cumulative: a lower
        cursor than one already acknowledged changes nothing."""
        return self._signed("/v1/trainer/ack", m.KIND_TRAINER_ACK, m.FeedAck(cursor=cursor),
                            m.FeedAcked)  # type: ignore[return-value]

    def upload_shard(self, sha256: str, data: bytes) -> None:
        assert self.identity is not None
        env = sign(self.identity, m.KIND_TRAINER_SHARD, m.ShardUpload(sha256=sha256, size=len(data)))
        self._request("PUT", f"/v1/trainer/shards/{sha256}", content=data,
                      headers={ENVELOPE_HEADER: env.model_dump_json()})

    def publish(self, manifest: CheckpointManifest) -> SignedManifest:
        return self._signed("/v1/trainer/publish", m.KIND_TRAINER_PUBLISH, m.PublishRequest(manifest=manifest),
                            SignedManifest)  # type: ignore[return-value]

    def metrics(self, step: int, version: int, metrics: dict[str, float]) -> None:
        self._signed("/v1/trainer/metrics", m.KIND_TRAINER_METRICS,
                     m.TrainerMetrics(step=step, version=version, metrics=metrics), None)


class _PendingList(BaseModel):
    groups: list[m.PendingGroup]
