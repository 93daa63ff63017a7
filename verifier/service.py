"""The verifier process: claim pending groups from the coordinator, check them, post verdicts."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from protocol.client import CoordinatorClient
from protocol.identity import Identity
from protocol.manifest import ShardStore, assemble_checkpoint
from protocol.tasks import get_task
from verifier.checks import CheckContext, verify_group
from verifier.config import VerifierConfig

log = logging.getLogger("swarmrl.verifier")


class Verifier:
    def __init__(self, cfg: VerifierConfig):
        self.cfg = cfg
        self.identity = Identity.load_or_create(cfg.key_path)
        self.client = CoordinatorClient(cfg.coordinator_url, self.identity)
        self.task = get_task(cfg.task)
        self.ctx: CheckContext | None = None
        self.checked = 0
        self.rejected = 0

    def _load_tokenizer(self) -> bool:
        """Fetch the current checkpoint (signature and hashes checked) for its tokenizer."""
        signed = self.client.latest_manifest()
        if signed is None:
            return False
        info = self.client.info()
        manifest = signed.verify(info.coordinator_key)
        out = Path(self.cfg.work_dir) / f"v{manifest.version:08d}"
        store = ShardStore(Path(self.cfg.work_dir) / "shards")
        for s in store.missing(manifest):
            store.put(s.sha256, self.client.shard(s.sha256))
        assemble_checkpoint(manifest, store.get, out)
        self.ctx = CheckContext(tokenizer=PreTrainedTokenizerFast.from_pretrained(out), task=self.task)
        return True

    def poll_once(self) -> int:
        """Verify one batch of pending groups; returns how many were verified."""
        if self.ctx is None and not self._load_tokenizer():
            return 0
        assert self.ctx is not None
        groups = self.client.pending(self.cfg.batch)
        if not groups:
            return 0
        verdicts = [verify_group(g, self.ctx) for g in groups]
        self.client.verdicts(verdicts)
        self.checked += len(verdicts)
        for v in verdicts:
            if not v.accepted:
                self.rejected += 1
                log.warning("group %d rejected: %s", v.group_id, v.reason)
        return len(verdicts)

    def run(self, stop_after_s: float | None = None) -> None:
        t0 = time.time()
        while stop_after_s is None or time.time() - t0 < stop_after_s:
            if self.poll_once() == 0:
                time.sleep(self.cfg.poll_interval_s)
