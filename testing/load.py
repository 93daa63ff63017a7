"""Simulated nodes for load tests and benchmarks: real Ed25519 keys and signatures, real HTTP/1.1 on loopback, no
model.

Each simulated node registers (a challenge, then a signed registration). Then, whenever it gets a turn, it makes
its next request: a heartbeat when one is due, else a lease when it holds no leased prompt, else one submission of
its leased prompts (a submission settles its lease, as a real node's does, and asks for the next lease, as a real
node's does unless `plan.next_lease` is off), each an 8-rollout group with an activation proof per rollout in the
protocol's format (token ids and proof contents are random: only a verifier
would notice). `concurrency` connections per process carry the requests, each node's always over the same one (as a
real node's go over its own keep-alive connection), so the node count sets how many identities, rows and heartbeats
the coordinator handles, not how many sockets it holds.

Every request is signed for the pool `plan.pool` (`protocol.signing`) and carries an Idempotency-Key, as a real
node's client sends with every request that changes something (the coordinator stores each answer with the
request's effect). With `plan.source_header`, each names its node's own address in that header, as a reverse proxy
in front of a coordinator does for its clients: the coordinator's per-source rate limits and admission then see one
source per node, as they would in a deployment.

A submission's canonical JSON is spliced from per-rollout pieces encoded once (a generator process shares the
cores with the server it measures); `SubmissionEncoder` checks at start that the splice equals
`canonical_json` of the same payload.

    plan = LoadPlan(url="http://127.0.0.1:8470", nodes=1000)
    swarm = LoadSwarm(plan, [Identity.generate() for _ in range(plan.nodes)])
    await swarm.register()
    report = await swarm.run(measure_from=t0, until=t1)
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import orjson

from swarmrl.protocol import messages as m
from swarmrl.protocol import proofs
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import SIGNATURE_HEADER, canonical_json, sign
from swarmrl.runtime.client import IDEMPOTENCY_HEADER, CoordinatorClient, new_idempotency_key
from swarmrl.testing.http1 import Connection, ProtocolError
from swarmrl.transfer.store import ShardStore, cut_checkpoint

JSON = {"content-type": "application/json"}
REQUEST_TIMEOUT_S = 60.0
"""A request unanswered this long counts as a transport error (status 0), so that a coordinator that stops answering
fails the run instead of hanging it."""


@dataclass(frozen=True)
class LoadPlan:
    """What the simulated nodes of one process do."""

    url: str
    nodes: int
    pool: str
    """The pool every request is signed for (`RunInfo.pool`)."""
    concurrency: int = 16
    prompts_per_lease: int = 1
    """Prompts per lease: each submission carries a group for every one."""
    next_lease: bool = True
    """Each submission asks for the node's next lease (`RolloutSubmission.next_lease`), as nodes do; False: a lease
    request of its own before each submission."""
    source_header: str | None = "x-forwarded-for"
    """The header each request names its node's address in (None: every node is the load process's address)."""
    tokens: int = 32
    group_size: int = 8
    heartbeat_s: float = 30.0
    hidden_size: int = 128
    seed: int = 0


@dataclass
class Tally:
    """One request kind's outcomes inside the measured window."""

    ok: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    reasons: collections.Counter = field(default_factory=collections.Counter)


@dataclass
class LoadReport:
    """What one process measured: tallies per request kind (measured window only) and every group a submission
    answer said was taken (whole run), as "lease_id/prompt_id"."""

    tallies: dict[str, Tally]
    accepted: list[str]
    refused_groups: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"tallies": {k: {**asdict(t), "reasons": dict(t.reasons)} for k, t in self.tallies.items()},
                "accepted": self.accepted, "refused_groups": self.refused_groups}


class SubmissionEncoder:
    """Canonical submission JSON for leased prompts, spliced from rollout templates encoded once."""

    def __init__(self, group_size: int, tokens: int, hidden_size: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.prefixes: list[bytes] = []
        self.prompt_ids = canonical_json(list(range(3, 15)))
        self.templates: list[dict[str, Any]] = []
        for _ in range(group_size):
            chunks = []
            for j in range(-(-tokens // proofs.CHUNK_TOKENS)):
                n = min(proofs.CHUNK_TOKENS, tokens - j * proofs.CHUNK_TOKENS) * proofs.TOPK
                chunks.append((proofs.PRIMES[0], rng.integers(0, 60000, n)))
            proof = proofs.encode(proofs.Proof(chunk_tokens=proofs.CHUNK_TOKENS, topk=proofs.TOPK,
                                               hidden_size=hidden_size, n_tokens=tokens, chunks=tuple(chunks)))
            rollout = {"completion_ids": [int(t) for t in rng.integers(0, 16, tokens)],
                       "finish_reason": "length", "logprobs": [float(-x) for x in rng.random(tokens) * 4],
                       "proof": proof}
            self.templates.append(rollout)
            # Keys sort: completion_ids, finish_reason, logprobs, proof, seed: the seed goes last.
            self.prefixes.append(canonical_json(rollout)[:-1] + b',"seed":')
        sample: dict[str, Any] = {"lease_id": "l", "policy_version": 0, "gen_seconds": 0.0,
                                  "groups": [{"prompt_id": "p", "prompt_ids": list(range(3, 15)),
                                              "rollouts": [{**t, "seed": i} for i, t in enumerate(self.templates)]}]}
        for ask in (None, {"held_version": 0, "max_prompts": 2}):
            if ask is not None:
                sample["next_lease"] = ask
            if self.encode("l", 0, [("p", list(range(group_size)))], ask) != canonical_json(sample):
                raise AssertionError("the spliced submission differs from its canonical JSON")

    def encode(self, lease_id: str, version: int, prompts: list[tuple[str, list[int]]],
               next_lease: dict[str, int] | None = None) -> bytes:
        """The canonical JSON of a submission of one group per (prompt_id, seeds), asking for `next_lease` (a
        `LeaseRequest`'s fields) when given."""
        groups = []
        for prompt_id, seeds in prompts:
            rollouts = b",".join(p + str(s).encode() + b"}" for p, s in zip(self.prefixes, seeds, strict=True))
            groups.append(b'{"prompt_id":' + json.dumps(prompt_id).encode() + b',"prompt_ids":' + self.prompt_ids
                          + b',"rollouts":[' + rollouts + b"]}")
        ask = b"" if next_lease is None else b',"next_lease":' + canonical_json(next_lease)
        return (b'{"gen_seconds":0.0,"groups":[' + b",".join(groups) + b'],"lease_id":' + json.dumps(lease_id).encode()
                + ask + b',"policy_version":' + str(version).encode() + b"}")


@dataclass
class SimNode:
    identity: Identity
    name: str
    address: str
    lease_id: str = ""
    version: int = 0
    prompts: list[tuple[str, list[int]]] = field(default_factory=list)
    next_beat: float = 0.0


class LoadSwarm:
    """`plan.nodes` simulated nodes driven over `plan.concurrency` keep-alive connections."""

    def __init__(self, plan: LoadPlan, identities: list[Identity]):
        self.plan = plan
        url = urlsplit(plan.url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        base = plan.seed << 20  # each load process's nodes have addresses of their own
        self.nodes = [SimNode(identity, f"sim-{i}", _address(base + i)) for i, identity in enumerate(identities)]
        self.encoder = SubmissionEncoder(plan.group_size, plan.tokens, plan.hidden_size, plan.seed)
        self.tallies: dict[str, Tally] = collections.defaultdict(Tally)
        self.accepted: list[str] = []
        self.refused_groups = 0
        self._measuring = False

    async def _call(self, conn: Connection | None, node: SimNode, kind: str, path: str, body: bytes,
                    signed: str | None = None) -> tuple[Connection | None, int, bytes]:
        """One POST from `node` on `conn` (reopened when closed), signed as a `signed` request when given;
        (connection, status, body), status 0 for a transport error. Counted under `kind` while measuring."""
        t0 = time.perf_counter()
        headers = {**JSON, IDEMPOTENCY_HEADER: new_idempotency_key()}  # as a real node's client sends (no retries here)
        if self.plan.source_header is not None:
            headers[self.plan.source_header] = node.address
        if signed is not None:
            headers[SIGNATURE_HEADER] = sign(node.identity, signed, self.plan.pool, body).header()
        try:
            if conn is None or conn.closed:
                conn = await Connection.open(self.host, self.port)
            resp = await asyncio.wait_for(conn.request("POST", path, body, headers), REQUEST_TIMEOUT_S)
            status, out = resp.status, resp.body
        except (OSError, ProtocolError, asyncio.IncompleteReadError, TimeoutError) as e:  # the connection is closed
            conn, status, out = None, 0, type(e).__name__.encode()
        if self._measuring:
            tally = self.tallies[kind]
            if 200 <= status < 300:
                tally.ok += 1
                tally.latencies_ms.append((time.perf_counter() - t0) * 1000)
            else:
                tally.errors += 1
                tally.reasons[f"{status} {out[:120].decode(errors='replace')}"] += 1
        return conn, status, out

    async def register(self) -> None:
        """Register every node (challenge + signed registration), `concurrency` at a time."""
        queue = collections.deque(self.nodes)

        async def lane() -> None:
            conn = None
            while queue:
                node = queue.popleft()
                body = orjson.dumps({"public_key": node.identity.public_key_hex})
                conn, status, out = await self._call(conn, node, "challenge", "/v1/register/challenge", body)
                if status != 200:
                    raise RuntimeError(f"challenge refused: {status} {out[:200]!r}")
                req = {"challenge": orjson.loads(out)["challenge"], "engine": "sim", "name": node.name}
                body = canonical_json(req)
                conn, status, out = await self._call(conn, node, "register", "/v1/register", body, m.KIND_REGISTER)
                if status != 200:
                    raise RuntimeError(f"registration refused: {status} {out[:200]!r}")

        await asyncio.gather(*(lane() for _ in range(self.plan.concurrency)))

    async def run(self, measure_from: float, until: float) -> LoadReport:
        """Drive the nodes until the wall clock reads `until`; count what happens from `measure_from` on."""
        rnd, start = random.Random(self.plan.seed), time.time()
        for node in self.nodes:  # first heartbeats spread over one interval
            node.next_beat = start + rnd.uniform(0, self.plan.heartbeat_s)

        # Each node keeps to one connection, as a real node's requests go over its own keep-alive connection (so a
        # coordinator of several processes sees each node's requests in the process its connection landed in).
        async def lane(queue: collections.deque[SimNode]) -> None:
            conn = None
            while time.time() < until:
                self._measuring = time.time() >= measure_from
                node = queue.popleft()
                try:
                    conn = await self._turn(conn, node)
                finally:
                    queue.append(node)

        lanes = min(self.plan.concurrency, len(self.nodes))
        await asyncio.gather(*(lane(collections.deque(self.nodes[i::lanes])) for i in range(lanes)))
        return LoadReport(dict(self.tallies), self.accepted, self.refused_groups)

    async def _turn(self, conn: Connection | None, node: SimNode) -> Connection | None:
        plan, now = self.plan, time.time()
        if now >= node.next_beat:
            node.next_beat = now + plan.heartbeat_s
            hb = {"busy_s": 1.0, "held_version": node.version, "idle_s": 0.0, "status": "generating"}
            conn, _, _ = await self._call(conn, node, "heartbeat", "/v1/heartbeat", canonical_json(hb),
                                          m.KIND_HEARTBEAT)
            return conn
        if not node.prompts:
            req = {"held_version": node.version, "max_prompts": plan.prompts_per_lease}
            conn, status, out = await self._call(conn, node, "lease", "/v1/lease", canonical_json(req), m.KIND_LEASE)
            if status == 200:
                self._take_lease(node, orjson.loads(out))
            return conn
        batch, node.prompts = node.prompts, []
        ask = {"held_version": node.version, "max_prompts": plan.prompts_per_lease} if plan.next_lease else None
        payload = self.encoder.encode(node.lease_id, node.version, batch, ask)
        conn, status, out = await self._call(conn, node, "submit", "/v1/submit", payload, m.KIND_SUBMIT)
        if status == 200:
            result = orjson.loads(out)
            self.accepted += [f"{node.lease_id}/{p}" for p in result["accepted"]]
            self.refused_groups += len(result["rejected"])
            if result.get("next_lease") is not None:
                self._take_lease(node, result["next_lease"])
        return conn

    @staticmethod
    def _take_lease(node: SimNode, lease: dict[str, Any]) -> None:
        node.lease_id, node.version = lease["lease_id"], lease["policy_version"]
        node.prompts = [(p["prompt_id"], p["seeds"]) for p in lease["prompts"]]


def publish_version_zero(url: str, operator: Identity, work: Path, run_id: str) -> None:
    """Publish version 0 of `run_id` through the coordinator at `url` as `operator`: a few KiB of random bytes in a
    few shards (simulated nodes load no weights), cut and kept under `work`."""
    ckpt = work / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(secrets.token_bytes(4096))
    local = ShardStore(work / "op-shards")
    manifest = cut_checkpoint(ckpt, run_id=run_id, version=0, store=local, shard_size=2048)
    with CoordinatorClient(url, operator) as op:
        for ref in manifest.shards():
            op.upload_shard(ref.sha256, local.get(ref.sha256))
        op.publish(manifest)


def _address(i: int) -> str:
    """The `i`-th simulated node's address (10.0.0.0/8, one per node)."""
    return f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values` by the nearest-rank method; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]
