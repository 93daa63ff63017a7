"""The policy weights each group must be checked against: the checkpoint of the group's policy_version.

Versions are fetched the way a node fetches them (`transfer.CheckpointFetcher`), trusting nothing but the
coordinator's signature: the signed manifest of that version (GET /v1/manifest/{version}), then its shards,
each hash-checked on arrival and written into the checkpoint's files, from the coordinator's HTTP origin and,
with `[p2p]`, from the checkpoint swarm. A fetch cut short resumes from the shards on disk. The last `keep`
versions stay loaded (a group may be up to max_staleness versions old), so versions older than the newest are
fetched too.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.models.build import load_causal_lm
from swarmrl.models.head import head_of
from swarmrl.models.prompts import load_tokenizer, pad_token_id, stop_token_ids
from swarmrl.models.weights import load_weights_in_place
from swarmrl.protocol.manifest import CheckpointManifest, SignedManifest
from swarmrl.protocol.run import RunInfo
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.transfer.connect import open_fetcher
from swarmrl.transfer.fetcher import ShardUnavailable
from swarmrl.transfer.p2p.config import P2PConfig

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
    """Width of the final hidden states (the LM head's input), which proofs commit to."""
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
        head_of(model)  # a model whose logits cannot be replayed is refused here, before any group is judged
        tok = load_tokenizer(path)
    cfg = model.config
    stops = stop_token_ids(path, model=model, tokenizer=tok)
    eos = tok.eos_token_id if tok.eos_token_id in stops else min(stops)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else pad_token_id(tok)
    return PolicyModel(version=version, path=path, model=model, tokenizer=tok, eos_id=int(eos), pad_id=int(pad),
                       hidden_size=int(model.get_output_embeddings().weight.shape[1]),
                       max_positions=int(cfg.max_position_embeddings),
                       stop_ids=stops, vocab_size=int(cfg.vocab_size))


def _same_except_weights(a: CheckpointManifest, b: CheckpointManifest) -> bool:
    """Whether two checkpoints have identical files (config, tokenizer) apart from their safetensors weights."""
    def rest(m: CheckpointManifest) -> dict[str, str]:
        return {path: sha for path, sha in m.checkpoint_files().items() if not path.endswith(".safetensors")}
    return rest(a) == rest(b)


class ModelCache:
    """Loaded policy versions, least recently used evicted beyond `keep` (and their files removed).

    Checkpoints are kept under `work_dir` (`work_dir`/shards, `work_dir`/v{version:08d}); versions left there by an
    earlier run are reused. With `p2p` (and the pool's `run` description, asked of the coordinator if not given)
    the cache also joins the checkpoint swarm; `close` leaves it.
    """

    def __init__(self, client: CoordinatorClient, coordinator_key: str, work_dir: Path, keep: int = 3,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", *, p2p: P2PConfig | None = None,
                 run: RunInfo | None = None):
        self.client = client
        self.coordinator_key = coordinator_key
        self.work_dir = Path(work_dir)
        self.keep = keep
        self.dtype = dtype
        self.device = device
        if p2p is not None and run is None:
            run = client.info()
        # One version more than are loaded: the fetcher then never prunes a loaded version's files before the
        # cache has evicted it (eviction removes them).
        self.fetcher, self.swarm = open_fetcher(self.work_dir, coordinator_key, client, run, p2p=p2p,
                                                keep_versions=keep + 1)
        self._loaded: OrderedDict[int, tuple[PolicyModel, CheckpointManifest]] = OrderedDict()

    def close(self) -> None:
        """Leave the checkpoint swarm, if joined."""
        if self.swarm is not None:
            self.swarm.close()
            self.swarm = None

    def get(self, version: int) -> PolicyModel:
        """The model of `version`; VersionUnavailable when the coordinator cannot supply it, or when this verifier
        cannot load it (an architecture it cannot replay: the trusted side's limit, never a node's fault, so no
        node is banned for it). A manifest or shard that fails its signature or hash raises ManifestError (the
        coordinator's fault, not the node's)."""
        if version in self._loaded:
            self._loaded.move_to_end(version)
            return self._loaded[version][0]
        manifest, path = self._fetch(version)
        reuse = None
        while len(self._loaded) >= self.keep:
            old, (old_policy, old_manifest) = self._loaded.popitem(last=False)
            self.fetcher.remove(old)
            log.info("unloaded policy version %d", old)
            if _same_except_weights(old_manifest, manifest):
                reuse = old_policy
        try:
            policy = load_policy(path, version, self.dtype, self.device, reuse=reuse)
        except Exception as e:  # noqa: BLE001 - whatever stops it loading, the model is what cannot be verified
            raise VersionUnavailable(f"version {version}: this verifier cannot load it: {type(e).__name__}: {e}"
                                     ) from None
        self._loaded[version] = (policy, manifest)
        log.info("loaded policy version %d from %s", version, path)
        return policy

    def _fetch(self, version: int) -> tuple[CheckpointManifest, Path]:
        try:
            signed: SignedManifest | None = self.client.manifest(version)
        except CoordinatorError as e:
            raise VersionUnavailable(f"manifest of version {version}: {e.reason}") from None
        if signed is None:
            raise VersionUnavailable(f"no manifest for version {version}")
        manifest = self.fetcher.verify(signed)
        if manifest.version != version:
            raise VersionUnavailable(f"asked for version {version}, the signed manifest is for {manifest.version}")
        try:
            return self.fetcher.fetch(signed)
        except ShardUnavailable as e:
            raise VersionUnavailable(f"version {version}: {e}") from None
