"""Where checkpoint shards come from, as a fetcher sees it: the `ShardSource` interface, its signals, and the
coordinator's HTTP origin.

Shared by every implementation of a source (`HttpOrigin` here, the libp2p swarm in `transfer.p2p.sources`)
and by `transfer.fetcher.CheckpointFetcher`, which schedules over them (`transfer.schedule`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from swarmrl.protocol.manifest import CheckpointManifest, ShardRef
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.transfer.store import ShardStore

WAIT = object()
"""What `ShardSource.suggest` returns for "take none of these from me now" (a seed whose copies of them are
on their way to other peers: they will be announced shortly)."""


class SourceBusy(Exception):
    """A source cannot take the request now (all its upload slots are in use); not a failure: ask it again
    after `retry_after_s`, and meanwhile take this shard, or another, elsewhere."""

    def __init__(self, message: str = "busy", retry_after_s: float = 0.25):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BadShardBytes(Exception):
    """A source sent something that is certainly not the shard (e.g. a wrong length): treated as bad bytes."""


class ShardNotHeld(Exception):
    """The source does not have the shard (the origin no longer keeps it): it is not asked for it again in this
    fetch, and if no source has it the fetch fails with `ShardUnavailable`."""


class ShardSource(ABC):
    """Somewhere shards can be read from. Implementations may be slow, fail, or lie about bytes.

    Only `get` is required; the other members have defaults that describe a plain source holding every
    shard (like the HTTP origin). How many requests the fetcher keeps open to one source is the fetcher's
    choice (`FetchConfig.requests_per_peer`, `FetchConfig.origin_parallel`), not the source's.
    """

    name: str = "source"
    #: A seed holds every shard but its link is shared by all nodes: used for shards no peer holds.
    seed: bool = True

    @property
    def key(self) -> str:
        """Identifies this source across `expand` calls (load and failure bookkeeping)."""
        return f"{type(self).__name__}@{id(self):x}"

    @abstractmethod
    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        """The bytes of `shard` (not yet verified: the caller checks the hash). Raises on failure: `SourceBusy`
        (ask again later), `ShardNotHeld`, `BadShardBytes`, or anything else for a failed request."""

    def expand(self, manifest: CheckpointManifest) -> list[ShardSource]:
        """The concrete sources this one stands for right now (called often: keep it cheap)."""
        return [self]

    def holds(self, manifest: CheckpointManifest, shard: ShardRef) -> bool:
        return True

    def held(self, manifest: CheckpointManifest, wanted: dict[str, ShardRef]) -> set[str]:
        """The hashes in `wanted` (sha256 -> shard) that this source holds: `holds` for many shards at once.
        The fetcher calls it for every pick; override it where a set operation can answer."""
        return {sha for sha, shard in wanted.items() if self.holds(manifest, shard)}

    def suggest(self, manifest: CheckpointManifest, wanted: list[ShardRef]) -> ShardRef | object | None:
        """Which of `wanted` this source would rather send next (a seed spreading its uploads): one of them,
        `WAIT` (none now), or None (no opinion: the fetcher takes the rarest)."""
        return None

    def prepare(self, manifest: CheckpointManifest, store: ShardStore) -> None:  # noqa: B027 (optional hook)
        """A fetch of `manifest` into `store` begins (verified shards of it may already be there)."""

    def stored(self, manifest: CheckpointManifest, shard: ShardRef) -> None:  # noqa: B027 (optional hook)
        """`shard` has been verified and stored (from whichever source)."""

    def on_success(self, manifest: CheckpointManifest, shard: ShardRef) -> None:  # noqa: B027 (optional hook)
        """This source delivered `shard` correctly."""

    def on_failure(self, manifest: CheckpointManifest, shard: ShardRef, error: str, bad_bytes: bool) -> None:  # noqa: B027 (optional hook)
        """This source failed to deliver `shard`; `bad_bytes`: it sent bytes that do not match the hash."""


class HttpOrigin(ShardSource):
    """The coordinator's HTTP origin (GET /v1/shards/{sha256}): a seed holding every published shard."""

    name = "origin"

    def __init__(self, client: CoordinatorClient):
        self.client = client

    def held(self, manifest: CheckpointManifest, wanted: dict[str, ShardRef]) -> set[str]:
        return set(wanted)

    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        try:
            return self.client.shard(shard.sha256)
        except CoordinatorError as e:  # the coordinator refused (404: it no longer keeps this shard)
            raise ShardNotHeld(f"the origin refused shard {shard.sha256[:12]}: {e.reason}") from None
