"""An in-process stand-in for the coordinator's trainer API, for the trainer's own tests (the trainer against the real
coordinator is tests/test_trainer_resume.py's last test): same methods and messages as
`runtime.client.CoordinatorClient`; it hands out synthetic verified groups stamped with chosen policy versions,
stores uploaded shards by hash, and, like the real one, refuses a manifest whose version is not above its current
one or whose shards it lacks."""

from __future__ import annotations

import random
import threading

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import CheckpointManifest, SignedManifest
from swarmrl.protocol.messages import TrainingBatch, TrainingGroup
from swarmrl.protocol.run import RunInfo, RunSpec, SamplingSpec
from swarmrl.protocol.tasks import TaskSpec, load_task
from swarmrl.testing.groups import training_group
from swarmrl.trainer.config import TrainerConfig
from swarmrl.trainer.model import ModelConfig, build_tokenizer
from swarmrl.transfer.store import ShardStore

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=1, intermediate_size=64, seed=0)
COORDINATOR = Identity.generate()


class FakeCoordinator:
    """In-memory coordinator for the trainer's calls. `offsets` cycles the staleness of the groups it makes."""

    def __init__(self, tmp, offsets=(0, 1, 3), group_size: int = 4, run_id: str = "test-run", flat_until: int = 0,
                 max_staleness: int = 2):
        self.run_id = run_id
        self.max_staleness = max_staleness
        self.version = -1
        self.offsets = offsets
        self.group_size = group_size
        self.store = ShardStore(tmp / "fake-shards")
        self.published: list[CheckpointManifest] = []
        self.metrics_posted: list[tuple[int, int, dict[str, float]]] = []
        self.acked: list[int] = []
        self.next_id = 0
        self.fail_publish = 0
        self.flat_until = flat_until  # groups with ids up to this one all have one reward for every rollout
        self.tok = build_tokenizer()
        self.task = load_task(TaskSpec())
        self.rng = random.Random(0)
        self.lock = threading.Lock()  # the publisher thread and the main thread call in concurrently

    def info(self) -> RunInfo:
        spec = RunSpec(run_id=self.run_id, max_staleness=self.max_staleness,
                       sampling=SamplingSpec(temperature=1.0, max_tokens=6, group_size=self.group_size))
        return RunInfo.signed(spec, COORDINATOR, current_version=self.version)

    def _group(self) -> TrainingGroup:
        self.next_id += 1
        p = self.task.sample(self.rng)
        if self.next_id % 5 == 0 or self.next_id <= self.flat_until:  # one reward for all: zero advantage
            texts = [p.answer] * self.group_size
        else:
            texts = [p.answer if self.rng.random() < 0.3 else str(self.rng.randint(100, 1999))
                     for _ in range(self.group_size)]
        comps = [self.tok(t, add_special_tokens=False).input_ids + [self.tok.eos_token_id] for t in texts]
        offset = self.offsets[self.next_id % len(self.offsets)]
        return training_group(
            group_id=self.next_id, policy_version=max(self.version, 0) - offset,
            prompt_ids=self.tok(p.prompt).input_ids, completions=comps,
            logprobs=[[-2.4 + 0.1 * self.rng.random() for _ in c] for c in comps],
            finish_reasons=["stop"] * len(comps), rewards=[self.task.reward(t, p.answer) for t in texts],
            pool=self.info().pool)

    def training_batch(self, after_id: int, limit: int, wait_s: float = 0.0) -> TrainingBatch:
        with self.lock:
            assert after_id <= self.next_id
            self.next_id = max(self.next_id, after_id)  # groups up to the cursor were consumed already
            return TrainingBatch(current_version=self.version, groups=[self._group() for _ in range(limit)])

    def ack(self, cursor: int) -> None:
        with self.lock:
            assert cursor <= self.next_id, "acknowledged a group never handed out"
            self.acked.append(cursor)

    def upload_shard(self, sha256: str, data: bytes) -> None:
        with self.lock:
            self.store.put(sha256, data)

    def publish(self, manifest: CheckpointManifest) -> SignedManifest:
        with self.lock:
            if self.fail_publish > 0:
                self.fail_publish -= 1
                raise RuntimeError("simulated coordinator failure")
            if manifest.version <= self.version:
                raise RuntimeError(f"version {manifest.version} is not above {self.version}")
            assert not self.store.missing(manifest), "published before its shards were uploaded"
            self.version = manifest.version
            self.published.append(manifest)
            return SignedManifest(manifest=manifest, public_key="0" * 64, signature="0" * 128)

    def metrics(self, step: int, version: int, metrics: dict[str, float]) -> None:
        with self.lock:
            self.metrics_posted.append((step, version, dict(metrics)))


def trainer_cfg(tmp_path, init_ckpt, **kw) -> TrainerConfig:
    base = dict(state_dir=str(tmp_path / "state"), init_checkpoint=str(init_ckpt), key_path=str(tmp_path / "k"),
                batch_groups=4, max_steps=2, eval_every=2, eval_size=16, poll_interval_s=0.01, progress=False,
                keep_states=2)
    return TrainerConfig(**{**base, **kw})
