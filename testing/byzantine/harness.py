"""A real pool on loopback for attacks: coordinator server (uvicorn, SQLite, Ed25519), the real verifier logic
(`verifier.service.Verifier`), nodes built on `node.agent.Node`, and read-only access to the coordinator's
database to see where every group ended up.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.ratelimit import RateLimitConfig
from swarmrl.coordinator.server import running_server
from swarmrl.node.agent import Node
from swarmrl.node.config import NodeConfig
from swarmrl.node.engine import EngineConfig
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.run import RunSpec
from swarmrl.protocol.validation import is_fresh
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer, save_checkpoint
from swarmrl.transfer.fetcher import CheckpointFetcher
from swarmrl.transfer.sources import HttpOrigin
from swarmrl.transfer.store import ShardStore, cut_checkpoint
from swarmrl.verifier.config import VerifierConfig
from swarmrl.verifier.service import Verifier


def make_checkpoint(out: Path, cfg: ModelConfig | None = None) -> Path:
    """A random-weight tiny model in HF layout (what a trainer publishes)."""
    tok = build_tokenizer()
    return save_checkpoint(build_model(cfg or ModelConfig(), tok), tok, out)


@torch.no_grad()
def perturb_checkpoint(src: Path, out: Path, frac: float, seed: int = 1) -> Path:
    """A copy of `src` whose every tensor W has Gaussian noise of std frac * RMS(W) added ("perturbed by frac")."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * frac * p.pow(2).mean().sqrt())
    return save_checkpoint(model, PreTrainedTokenizerFast.from_pretrained(src), out)


class RecordingClient(CoordinatorClient):
    """A node's client that remembers every submit outcome (result or refusal)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.submits: list[m.SubmitResult | CoordinatorError] = []

    def submit(self, submission: m.RolloutSubmission) -> m.SubmitResult:
        try:
            result = super().submit(submission)
        except CoordinatorError as e:
            self.submits.append(e)
            raise
        self.submits.append(result)
        return result


class ScriptedNode(Node):
    """`node.agent.Node` driven step by step (no threads): register, fetch, then `step()` = lease, generate,
    submit. Subclasses change what an honest node would do through the hooks below. `source`: the local address it
    connects from (127.0.0.x: on loopback, a machine of its own to the coordinator's per-source rules)."""

    def __init__(self, cfg: NodeConfig, source: str | None = None):
        super().__init__(cfg.model_copy(update={"pipeline": False}))  # each step's submission answered within it
        transport = httpx.HTTPTransport(local_address=source) if source is not None else None
        self.client = RecordingClient(cfg.coordinator_url, self.identity, retries=0,
                                      coordinator_key=cfg.coordinator_key, transport=transport)
        self.true_checkpoint: Path | None = None
        self.last_lease: m.Lease | None = None
        self.last_submission: m.RolloutSubmission | None = None

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def prepare(self) -> ScriptedNode:
        reg = self.client.register(name=self.cfg.name, engine=self.cfg.engine.kind)
        self._run_info = reg.run
        self.fetcher = CheckpointFetcher(self.cfg.work_dir / "checkpoints", reg.run.coordinator_key,
                                         [HttpOrigin(self.client)], keep_versions=self.cfg.keep_versions,
                                         manifests=self.client.manifest)
        self.sync()
        return self

    def sync(self) -> None:
        """Fetch the newest published version now (an honest node's fetch thread does this in the background)."""
        self.fetch_newer()
        if self.weights.ready is not None:
            version, path = self.weights.ready
            self.true_checkpoint = path
            self.weights.offer(version, self.adjust_checkpoint(path))

    # -- hooks ----------------------------------------------------------------------------------------------------

    def adjust_checkpoint(self, path: Path) -> Path:
        """The checkpoint this node really generates with."""
        return path

    def engine_temperature(self, leased: float) -> float:
        return leased

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        return submission

    # -- the agent's steps, with the hooks applied --------------------------------------------------------------

    def load_ready_weights(self, temperature: float, max_version: int | None = None) -> None:
        super().load_ready_weights(self.engine_temperature(temperature), max_version)

    def wait_for_weights(self, lease: m.Lease, max_staleness: int, temperature: float) -> None:
        # No fetch thread here: fetch now if the lease needs newer weights than this node holds.
        if not is_fresh(self.stats.held_version, lease.policy_version, max_staleness):
            self.sync()
        super().wait_for_weights(lease, max_staleness, temperature)

    def generate(self, lease: m.Lease) -> m.RolloutSubmission:
        self.last_lease = lease
        self.last_submission = self.tamper(super().generate(lease), lease)
        return self.last_submission


@dataclass
class Pool:
    url: str
    cfg: CoordinatorConfig
    op: CoordinatorClient
    """Operator client (the verifier's and the trainer's key)."""
    verifier: Verifier
    root: Path
    coordinator_key: str
    versions: dict[int, Path] = field(default_factory=dict)
    nodes: int = 0

    def publish(self, ckpt: Path) -> int:
        """Publish `ckpt` as the next version, as the trainer does (shards uploaded, manifest signed)."""
        version = max(self.versions, default=-1) + 1
        local = ShardStore(self.root / "trainer-shards")
        manifest = cut_checkpoint(ckpt, run_id=self.cfg.run.run_id, version=version, store=local)
        for ref in manifest.shards():
            self.op.upload_shard(ref.sha256, local.get(ref.sha256))
        self.op.publish(manifest)
        self.versions[version] = ckpt
        return version

    def node_config(self, name: str, engine: str = "torch", max_prompts: int = 2) -> NodeConfig:
        self.nodes += 1
        d = self.root / f"node{self.nodes}-{name}"
        return NodeConfig(coordinator_url=self.url, coordinator_key=self.coordinator_key, key_path=d / "node.key",
                          name=name[:60], work_dir=d, max_prompts=max_prompts, progress=False,
                          engine=EngineConfig(kind=engine, torch_batch_size=64))

    def node(self, cls: type[ScriptedNode] = ScriptedNode, name: str = "honest", engine: str = "torch",
             max_prompts: int = 2, **kw) -> ScriptedNode:
        return cls(self.node_config(name, engine, max_prompts), **kw).prepare()

    def verify_all(self) -> int:
        """Run the verifier until nothing is pending; returns how many groups it decided."""
        total = 0
        while n := self.verifier.poll_once():
            total += n
        return total

    def groups(self, node_id: str | None = None) -> list[dict]:
        """Every submitted group (optionally of one node): id, node_id, status, held, vouches, reason,
        accepted_seq."""
        con = sqlite3.connect(f"file:{self.cfg.data_dir / 'coordinator.sqlite'}?mode=ro", uri=True)
        con.row_factory = sqlite3.Row
        try:
            sql = "SELECT id, node_id, status, held, vouches, reason, accepted_seq FROM rollout_groups"
            rows = con.execute(sql + (" WHERE node_id = ?" if node_id else "") + " ORDER BY id",
                               (node_id,) if node_id else ()).fetchall()
        finally:
            con.close()
        return [dict(r) for r in rows]

    def node_facts(self, node_id: str) -> tuple[int, bool]:
        """(full checks passed, banned) of a node, read from the coordinator's database."""
        con = sqlite3.connect(f"file:{self.cfg.data_dir / 'coordinator.sqlite'}?mode=ro", uri=True)
        try:
            row = con.execute("SELECT checks_passed, banned FROM nodes WHERE id = ?", (node_id,)).fetchone()
        finally:
            con.close()
        return (int(row[0]), bool(row[1])) if row else (0, False)

    def node_row(self, node_id: str) -> m.NodeStatus | None:
        return next((n for n in self.op.nodes() if n.node_id == node_id), None)  # every page: many identities


@contextmanager
def open_pool(root: Path, checkpoint: Path, *, sampling: m.SamplingSpec | None = None, max_staleness: int = 1,
              verifier: dict | None = None, run: RunSpec | dict | None = None,
              **coordinator: object) -> Iterator[Pool]:
    """A coordinator on loopback with `checkpoint` published as version 0, and a verifier for it. `run`: the run
    description, or fields of it that replace the defaults (e.g. `environment` for a multi-turn run, whose `sampling`
    then sets `max_turns`)."""
    op_key = Identity.generate()
    spec = run if isinstance(run, RunSpec) else RunSpec(**{
        "run_id": "byzantine", "max_staleness": max_staleness,
        "sampling": sampling or m.SamplingSpec(temperature=0.8, max_tokens=8, group_size=8), **(run or {})})
    settings: dict = dict(data_dir=root / "coordinator", run=spec, operator_keys=[op_key.public_key_hex],
                          keep_versions=max_staleness + 2, max_body_bytes=2 << 20,
                          max_outstanding_leases=64, lease_ttl_s=600.0, rate_limits=RateLimitConfig.off(),
                          # Every identity here stands for a machine of its own, though all dial from loopback: the
                          # per-address share would otherwise starve the suite's later attempts of leases.
                          admission={"unproven_per_source": 10**6})
    settings.update(coordinator)
    cfg = CoordinatorConfig(**settings)
    key = cfg.load_identity()
    with running_server(cfg, key) as url:
        # The harness drains the queue synchronously (verify_all): an empty poll must answer at once, not wait.
        vcfg = VerifierConfig(coordinator_url=url, coordinator_key=key.public_key_hex, work_dir=root / "verifier",
                              **{"long_poll_s": 0.0, **(verifier or {})})
        pool = Pool(url=url, cfg=cfg, op=CoordinatorClient(url, op_key, retries=0, coordinator_key=key.public_key_hex),
                    verifier=Verifier(vcfg, identity=op_key), root=root, coordinator_key=key.public_key_hex)
        pool.publish(checkpoint)
        yield pool
