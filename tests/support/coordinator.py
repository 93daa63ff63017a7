"""The coordinator under test: a real server on loopback (started by the `run_factory` fixture in conftest.py), the
clients that talk to it, and well-formed or hand-made requests."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import SIGNATURE_HEADER, sign
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.transfer.store import ShardStore, cut_checkpoint

GROUP = 3
MAX_TOKENS = 4


class Clock:
    """The coordinator's clock: real time plus an offset a test can advance."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@dataclass
class Run:
    url: str
    cfg: CoordinatorConfig
    key: Identity  # the coordinator's
    op: CoordinatorClient  # operator (verifier + trainer) client
    clock: Clock
    tmp: Path

    @property
    def pool(self) -> str:
        return self.op.pool  # the run description's, with the store's epoch

    def node(self, name: str = "node", source: str | None = None) -> CoordinatorClient:
        """A freshly registered node; `source`: the loopback address it connects from (127.0.0.x: a machine of its
        own to the coordinator's per-source rules)."""
        transport = httpx.HTTPTransport(local_address=source) if source is not None else None
        client = CoordinatorClient(self.url, Identity.generate(), retries=0, coordinator_key=self.key.public_key_hex,
                                   transport=transport)
        client.register(name=name, engine="torch")
        return client

    def publish(self, version: int, tag: str = "") -> m.SignedManifest:
        """Cut a tiny checkpoint (a few files, several shards), upload its shards and publish it."""
        ckpt = self.tmp / f"ckpt-{version}-{tag}"
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps({"version": version, "tag": tag}))
        (ckpt / "model.safetensors").write_bytes(secrets.token_bytes(2500))
        return self.publish_checkpoint(ckpt, version)

    def publish_checkpoint(self, ckpt: Path, version: int, shard_size: int = 1024) -> m.SignedManifest:
        """Cut the checkpoint directory `ckpt`, upload its shards and publish it as `version`."""
        local = ShardStore(self.tmp / "trainer-shards")
        manifest = cut_checkpoint(ckpt, run_id=self.cfg.run.run_id, version=version, store=local,
                                  shard_size=shard_size)
        for ref in manifest.shards():
            self.op.upload_shard(ref.sha256, local.get(ref.sha256))
        return self.op.publish(manifest)

    def accepted_state(self) -> tuple:
        """What a refused request must never change: group counters, node counters, the trainer's feed."""
        st = self.op.status()
        nodes = sorted((n.node_id, n.groups_accepted, n.groups_rejected, n.banned) for n in st.nodes)
        feed = self.op.training_batch(after_id=0, limit=4096)
        return (st.groups_pending, st.groups_accepted, st.groups_rejected, st.run.current_version, tuple(nodes),
                feed.model_dump_json())


def submission(lease: m.Lease, policy_version: int | None = None, prompts: list[m.LeasedPrompt] | None = None
               ) -> m.RolloutSubmission:
    """A well-formed submission for `prompts` (default: all) of `lease`, seeds in reverse leased order."""
    groups = []
    for p in prompts if prompts is not None else lease.prompts:
        rollouts = [m.Rollout(seed=s, completion_ids=[1, 2], logprobs=[-0.5, -1.25], finish_reason="stop")
                    for s in reversed(p.seeds)]
        groups.append(m.RolloutGroup(prompt_id=p.prompt_id, prompt_ids=[7, 8, 9], rollouts=rollouts))
    version = lease.policy_version if policy_version is None else policy_version
    return m.RolloutSubmission(lease_id=lease.lease_id, policy_version=version, groups=groups)


def signed(identity: Identity, kind: str, pool: str, payload: BaseModel | dict | bytes, ts: float | None = None
           ) -> tuple[bytes, dict[str, str]]:
    """A request (body, headers) correctly signed by `identity` for `pool` (at time `ts`, default now)."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json().encode()
    else:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return body, {SIGNATURE_HEADER: sign(identity, kind, pool, body, ts=ts).header()}


def post(url: str, path: str, body: str | bytes | tuple[bytes, dict[str, str]]) -> tuple[int, str]:
    content, headers = body if isinstance(body, tuple) else (body, {})
    resp = httpx.post(url + path, content=content, headers=headers)
    is_json = resp.headers.get("content-type", "").startswith("application/json")
    detail = resp.json().get("detail", "") if is_json else ""
    return resp.status_code, detail


def refused(call, status: int, contains: str = "") -> CoordinatorError:
    with pytest.raises(CoordinatorError) as info:
        call()
    assert info.value.status == status, info.value.reason
    assert contains in info.value.reason
    return info.value


def busy_pool(run_factory) -> Run:
    """Version 1 current; alpha holds it, bravo holds 0, ghost was last heard from long ago, cheater is banned."""
    run = run_factory(clock_skew_s=3600.0)
    run.publish(0)
    ghost = run.node("ghost")
    ghost.heartbeat(0)
    run.clock.advance(600)  # ghost is not heard from again: gone after node_gone_after_s (60 s)
    alpha, bravo, cheater = run.node("alpha"), run.node("bravo"), run.node("cheater")
    for node, n in ((alpha, 3), (bravo, 2), (cheater, 2)):
        node.submit(submission(node.lease(n, 0)))
    pending = {p.group_id: p.node_id for p in run.op.pending(1024)}
    bad = [g for g, nid in pending.items() if nid == cheater.identity.node_id]
    run.op.verdicts([m.Verdict(group_id=g, accepted=True, rewards=[1.0, 0.5, 0.0][:GROUP])
                     for g, nid in pending.items() if nid != cheater.identity.node_id]
                    + [m.Verdict(group_id=bad[0], accepted=False, reason="rollout 2: tokens after a stop token",
                                 ban=True)])
    run.publish(1)
    alpha.heartbeat(1)
    bravo.heartbeat(0)
    for step, (reward, acc) in enumerate([(0.2, 0.25), (0.35, 0.3), (0.5, 0.42)], 1):
        run.op.metrics(step=step, version=step - 1, metrics={"reward_mean": reward, "eval_accuracy": acc})
    return run


def hoard(node: CoordinatorClient) -> list[m.Lease]:
    """Lease as much as the coordinator gives, never submitting: until it says to wait or refuses (allowance)."""
    held: list[m.Lease] = []
    while True:
        try:
            lease = node.lease(m.MAX_PROMPTS_PER_LEASE, 0)
        except CoordinatorError as e:
            assert e.status == 429 and "may hold" in e.reason, e.reason
            return held
        if lease is None:
            return held
        held.append(lease)
