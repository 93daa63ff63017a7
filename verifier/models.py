"""The policy weights each group must be checked against: the checkpoint of the group's policy_version.

Versions are fetched like a node fetches them, trusting nothing but the coordinator's signature: the signed
manifest of that version (GET /v1/manifest/{version}), its shards (hash-checked on arrival), files assembled
and hash-checked. The last `keep` versions stay loaded (a group may be up to max_staleness versions old).
"""

from __future__ import annotations

import logging
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from swarmrl.models.build import load_causal_lm
from swarmrl.models.prompts import load_tokenizer, pad_token_id, stop_token_ids
from swarmrl.models.weights import load_weights_in_place
from swarmrl.protocol.manifest import CheckpointManifest
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.transfer.store import ShardStore, assemble_checkpoint
from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("swarmrl.verifier")


class VersionUnavailable(Exception):
    """The coordinator no longer has (or never had) this version's manifest or shards."""


@dataclass
class PolicyModel:
    version: int
    path: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_id: int
    pad_id: int
    hidden_size: int
    max_positions: int
    stop_ids: frozenset[int] = frozenset()
    """Every token that ends a completion (`models.prompts.stop_token_ids`); eos_id is one of them."""
    vocab_size: int = 0
    """Rows of the model's logits (may exceed the tokenizer's size: padded vocabularies)."""


def load_policy(path: Path, version: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                reuse: PolicyModel | None = None) -> PolicyModel:
    """A checkpoint directory as the verifier uses it: the checkpoint's own model class (Auto classes) in `dtype`
    on `device`, eval mode, no grad. With `reuse` (a policy no longer needed, whose checkpoint has the same config
    and tokenizer files), its model takes the new weights in place and its tokenizer is kept: a new version then
    costs a file read, not a model construction."""
    if reuse is not None:
        load_weights_in_place(reuse.model, path)
        model, tok = reuse.model, reuse.tokenizer
    else:
        model = load_causal_lm(path, dtype, device)
        model.requires_grad_(False)
        tok = load_tokenizer(path)
    cfg = model.config
    stops = stop_token_ids(path, model=model, tokenizer=tok)
    eos = tok.eos_token_id if tok.eos_token_id in stops else min(stops)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else pad_token_id(tok)
    return PolicyModel(version=version, path=path, model=model, tokenizer=tok, eos_id=int(eos), pad_id=int(pad),
                       hidden_size=int(cfg.hidden_size), max_positions=int(cfg.max_position_embeddings),
                       stop_ids=stops, vocab_size=int(cfg.vocab_size))


def _same_except_weights(a: CheckpointManifest, b: CheckpointManifest) -> bool:
    """Whether two checkpoints have identical files (config, tokenizer) apart from their safetensors weights."""
    def rest(m: CheckpointManifest) -> dict[str, str]:
        return {f.path: f.sha256 for f in m.files if not f.path.endswith(".safetensors")}
    return rest(a) == rest(b)


class ModelCache:
    """Loaded policy versions, least recently used evicted beyond `keep` (and their files removed)."""

    def __init__(self, client: CoordinatorClient, coordinator_key: str, work_dir: Path, keep: int = 3,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.client = client
        self.coordinator_key = coordinator_key
        self.work_dir = Path(work_dir)
        self.keep = keep
        self.dtype = dtype
        self.device = device
        self.shards = ShardStore(self.work_dir / "shards")
        self._loaded: OrderedDict[int, tuple[PolicyModel, CheckpointManifest]] = OrderedDict()

    def get(self, version: int) -> PolicyModel:
        """The model of `version`; VersionUnavailable when the coordinator cannot supply it. A manifest or shard
        that fails its signature or hash raises ManifestError (the coordinator's fault, not the node's)."""
        if version in self._loaded:
            self._loaded.move_to_end(version)
            return self._loaded[version][0]
        manifest = self._fetch(version)
        path = assemble_checkpoint(manifest, self.shards.get, self.work_dir / f"v{version:08d}")
        reuse = None
        while len(self._loaded) >= self.keep:
            old, (old_policy, old_manifest) = self._loaded.popitem(last=False)
            shutil.rmtree(old_policy.path, ignore_errors=True)
            log.info("unloaded policy version %d", old)
            if _same_except_weights(old_manifest, manifest):
                reuse = old_policy
        policy = load_policy(path, version, self.dtype, self.device, reuse=reuse)
        self._loaded[version] = (policy, manifest)
        self.shards.remove_unreferenced([m for _, m in self._loaded.values()])
        log.info("loaded policy version %d from %s", version, path)
        return policy

    def _fetch(self, version: int) -> CheckpointManifest:
        try:
            signed = self.client.manifest(version)
        except CoordinatorError as e:
            raise VersionUnavailable(f"manifest of version {version}: {e.reason}") from None
        if signed is None:
            raise VersionUnavailable(f"no manifest for version {version}")
        manifest = signed.verify(self.coordinator_key)
        if manifest.version != version:
            raise VersionUnavailable(f"asked for version {version}, the signed manifest is for {manifest.version}")
        for ref in self.shards.missing(manifest):
            try:
                data = self.client.shard(ref.sha256)
            except CoordinatorError as e:
                raise VersionUnavailable(f"shard {ref.sha256[:12]} of version {version}: {e.reason}") from None
            self.shards.put(ref.sha256, data)
        return manifest
