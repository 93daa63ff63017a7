"""Composing a lease: its prompts (queued ones first, with their seeds, then the run's secret prompt stream, with
fresh seeds), and the coordinator's signature; stored by `coordinator.leases`.

Signing a lease and drawing its prompts take a third of what granting one costs, and on SQLite every write waits
for the one before it. So a submission that asks for its next lease has that lease drafted before its transaction
(`LeaseComposer.draft`): drawn from the prompt stream for the version the coordinator was at, for as many prompts
as the node asked for, and signed. The transaction then only stores the draft, when it is what the grant would
have made anyway: no prompt waits in the queue, the node may hold that many, and the version has not moved.
Otherwise the lease is composed in the transaction, as it always was; a draft not used is never sent nor stored.
Only a submission against a lease this process granted to its signer gets a draft (below): a node cannot make the
coordinator sign more than one draft per lease it was granted.

For the same reason the submission's groups are checked against their lease before its transaction, from what
this process keeps of the leases it granted lately (`RecentLeases`: their prompts, seeds and sampling, which never
change once granted). The transaction still reads and locks the lease (its owner, state and expiry are checked
there); a lease this process does not know of (granted by another worker, before a restart, or pushed out by newer
ones) is checked in the transaction, as it always was.
"""

from __future__ import annotations

import random
import secrets
import threading
from dataclasses import dataclass

from sqlalchemy import select

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.rows import LeasePromptRow
from swarmrl.coordinator.db.schema import LEASE_COUNTER, LEASE_SEQUENCE
from swarmrl.coordinator.db.store import EncodedJSON, Tx, add_to_counter, encode_json
from swarmrl.coordinator.run_secret import RunSecret
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import time_ordered_id
from swarmrl.protocol.tasks import Task

__all__ = ["Composed", "LeaseComposer", "RecentLeases"]


@dataclass(frozen=True)
class Composed:
    """A signed lease, what the coordinator keeps of its prompts: (prompt_id, text, answer, seeds), and the lease's
    JSON columns as they are stored (`coordinator.leasequeries.insert_lease`), encoded when it is composed: a draft's
    are encoded before the transaction that stores it."""

    lease: m.Lease
    prompts: list[tuple[str, str, str, list[int]]]
    sampling: EncodedJSON
    signature: EncodedJSON
    digests: EncodedJSON

    def fits(self, n: int, version: int) -> bool:
        """Whether this draft is the lease a grant of `n` new prompts at `version` would compose."""
        return len(self.prompts) == n and self.lease.policy_version == version


def new_seeds(n: int) -> list[int]:
    """`n` sampling seeds of 63 random bits each, from one read of the system's random source (not one per seed:
    that is a system call each)."""
    raw = secrets.token_bytes(8 * n)
    return [int.from_bytes(raw[i:i + 8], "big") >> 1 for i in range(0, 8 * n, 8)]


def new_lease_id(now: float) -> str:
    """A lease id: 24 hex digits, the issuing time then 52 random bits (`time_ordered_id`). Nobody can guess one,
    and leases issued together sit together in the indexes keyed by it (`leases`, `lease_prompts`)."""
    return time_ordered_id(now, 13)


class LeaseComposer:
    """Composes and signs the leases of one run (`task`, `config.run`'s sampling) as `identity` for `pool`."""

    def __init__(self, config: CoordinatorConfig, task: Task, identity: Identity, pool: str, secret: RunSecret):
        self.config, self.task, self.identity, self.pool, self.secret = config, task, identity, pool, secret
        self._sampling = encode_json(config.run.sampling.model_dump(mode="json"))  # the same in every lease

    def compose(self, tx: Tx | None, node_id: str, version: int, now: float,
                queued: list[tuple[str, str, list[int] | None]], n: int) -> Composed:
        """A lease of `n` prompts for `node_id` at `version`, issued at `now`: the `queued` ones (text, answer, the
        seeds they had) first, then new ones from the prompt stream (`prompt_rng`; `tx` is needed with
        `prompt_seed`), with fresh seeds."""
        lease_id = new_lease_id(now)
        group_size = self.config.run.sampling.group_size
        drawn = [(text, answer, seeds if seeds is not None and len(seeds) == group_size else new_seeds(group_size))
                 for text, answer, seeds in queued]
        if len(drawn) < n:
            rng = self.prompt_rng(tx, lease_id)
            while len(drawn) < n:
                problem = self.task.sample(rng)
                drawn.append((problem.prompt, problem.answer, new_seeds(group_size)))
        prompts = [(f"{lease_id}.{i}", text, answer, seeds) for i, (text, answer, seeds) in enumerate(drawn)]
        lease, digests = m.Lease.issue_with_digests(
            self.identity, self.pool, lease_id=lease_id, node_id=node_id, policy_version=version,
            expires_at=now + self.config.lease_ttl_s, sampling=self.config.run.sampling,
            prompts=[m.LeasedPrompt(prompt_id=p, text=t, seeds=s) for p, t, _, s in prompts])
        return Composed(lease, prompts, self._sampling, encode_json(lease.signature.model_dump(mode="json")),
                        encode_json(digests))

    def draft(self, node_id: str, n: int, version: int, now: float) -> Composed | None:
        """A lease of `n` new prompts, composed outside any transaction (module docstring); None when the prompt
        stream is the reproducible one (`prompt_seed`: a counter moved in the granting transaction) or before the
        first version."""
        if self.config.prompt_seed is not None or version < 0:
            return None
        return self.compose(None, node_id, version, now, [], n)

    def prompt_rng(self, tx: Tx | None, lease_id: str) -> random.Random:
        """The prompt stream of a new lease: drawn from the run's secret and the lease's id (unguessable:
        `new_lease_id`; nobody can tell what the next lease holds, and no shared counter row makes lease requests wait
        on each other), or, when the operator fixed `prompt_seed` for a reproducible stream, from it and the lease
        counter (moved in `tx`)."""
        seed = self.config.prompt_seed
        if seed is not None:
            assert tx is not None, "a reproducible prompt stream is drawn inside the granting transaction"
            return random.Random(f"{seed}/{lease_number(tx)}")
        return random.Random(self.secret.derive("prompts", lease_id.encode()))


def lease_number(tx: Tx) -> int:
    """The next lease number (from 1): the counter row on SQLite, where writes take turns; on PostgreSQL a sequence,
    so that concurrent grants do not wait on one row (a number a rolled-back grant took is skipped)."""
    if tx.dialect.name == "postgresql":
        return int(tx.execute(select(LEASE_SEQUENCE.next_value())).scalar_one())
    return add_to_counter(tx, LEASE_COUNTER)


class RecentLeases:
    """The terms of the leases this process granted lately (at most `capacity`, the oldest forgotten first): what a
    submission's groups are checked against before its transaction (module docstring). Thread-safe."""

    def __init__(self, capacity: int = 16384):
        self.capacity = capacity
        self._leases: dict[str, tuple[m.Lease, dict[str, LeasePromptRow]]] = {}
        self._lock = threading.Lock()

    def add(self, granted: Composed) -> None:
        """Keep `granted`'s terms, as its lease is stored (should that transaction roll back, the lease was never sent,
        and nobody submits against its unguessable id)."""
        lease = granted.lease
        prompts = {p: LeasePromptRow(lease.lease_id, p, i, text, answer, seeds, False)
                   for i, (p, text, answer, seeds) in enumerate(granted.prompts)}
        with self._lock:
            self._leases[lease.lease_id] = (lease, prompts)
            while len(self._leases) > self.capacity:
                del self._leases[next(iter(self._leases))]

    def take(self, lease_id: str) -> tuple[m.Lease, dict[str, LeasePromptRow]] | None:
        """The lease and its prompts (none submitted), forgotten: one submission settles a lease."""
        with self._lock:
            return self._leases.pop(lease_id, None)
