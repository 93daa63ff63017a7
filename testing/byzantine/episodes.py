"""Multi-turn attackers (`protocol.episodes`): real nodes that misreport an episode's environment turns or sample its
later model turns with the wrong seed, against a multi-turn pool (the smoke-test environment `echo`).

The attackers play their episodes with the node's own engine and the true weights, so everything but their one
deviation is honest: a node that fakes, drops or adds an environment turn plays on from there by the rules (turn
seeds, logprobs, activation proofs over what it submits), so only the replay of the environment stands between it
and the trainer; the node that samples later turns with the leased seed is otherwise honest, so only the full check's
replay does. These attacks need a multi-turn run, so they are not in `attacks.ATTACKS`: `MULTI_TURN_ATTACKS` holds
them, `open_multi_turn_pool` opens their pool and `run_multi_turn_suite` runs them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from swarmrl.node.config import NodeConfig
from swarmrl.node.engine import Completion, GenerationRequest
from swarmrl.protocol import messages as m
from swarmrl.protocol.episodes import Environment, spans
from swarmrl.protocol.sampling import turn_seed
from swarmrl.testing.byzantine.attacks import Attempt, _node_attack, run_suite
from swarmrl.testing.byzantine.harness import Pool, ScriptedNode, make_checkpoint, open_pool
from swarmrl.testing.byzantine.nodes import Truth

SAMPLING = m.SamplingSpec(temperature=1.0, max_tokens=8, group_size=8, max_turns=3, max_episode_tokens=40)
"""Three model turns of at most 8 tokens; 40 tokens in all leaves room for both replies of the echo environment, so
most episodes end by the environment or the turn limit, and some by a turn that ran out of tokens."""
RUN: dict[str, Any] = {"environment": {"name": "echo", "options": {"end_every": 3}}}
"""The echo environment ending about one turn in three: episodes end every way they can, and an attacker finds
turns the environment answers (to fake or drop) and turns it does not (to add one after)."""
STOP_RATE = 0.25
"""The random checkpoint's stop tokens together about this likely per token: most model turns end with one."""


def make_multi_turn_checkpoint(out: Path) -> Path:
    """The tiny random model (character tokenizer), its stop tokens likely enough that episodes have several turns."""
    from swarmrl.trainer.model import ModelConfig

    return make_checkpoint(out, ModelConfig(stop_rate=STOP_RATE))


@contextmanager
def open_multi_turn_pool(root: Path, checkpoint: Path, **kw: Any) -> Iterator[Pool]:
    """`harness.open_pool` for a multi-turn run on the echo environment (`SAMPLING`, `RUN`), the verifier at p = 1."""
    with open_pool(root, checkpoint, sampling=SAMPLING, run=RUN, verifier={"sample_rate": 1.0}, **kw) as pool:
        yield pool


# -- environments that lie ---------------------------------------------------------------------------------------

Lie = Callable[[str | None, Sequence[str], int], str | None]
"""The attacker's answer given the true one (the true environment's reply or None), the model's turns and the seed."""


class LyingEnvironment(Environment):
    """The run's environment, but after model turn `at` (1: the first) its answer is `lie`'s. Records each lie as
    (seed, at)."""

    name = "lying"

    def __init__(self, true: Environment, lie: Lie, at: int):
        super().__init__(true.options)
        self.true, self.lie, self.at = true, lie, at
        self.lies: set[int] = set()
        """Seeds of the episodes it lied in."""

    def respond(self, prompt: str, turns: Sequence[str], seed: int) -> str | None:
        truth = self.true.reply(prompt, turns, seed)
        if len(turns) != self.at:
            return truth
        out = self.lie(truth, turns, seed)
        if out != truth:
            self.lies.add(seed)
        return out


def faked_reply(truth: str | None, turns: Sequence[str], seed: int) -> str | None:
    """Another observation of the same length: the reply's last digit changed (so the episode's budget is spent
    alike and the episode goes on exactly where the true one does)."""
    if truth is None:
        return None
    return truth[:-1] + str((int(truth[-1]) + 1 + seed % 9) % 10) if truth[-1:].isdigit() else truth + "0"


def dropped_reply(truth: str | None, turns: Sequence[str], seed: int) -> None:
    """No reply: the episode ends as if the environment were done."""
    return None


def added_reply(truth: str | None, turns: Sequence[str], seed: int) -> str | None:
    """A reply where the environment gives none (what echo says when it never ends an episode)."""
    return truth if truth is not None else f"{len(turns[-1])}+{seed % 1000:03d}"


class LyingNode(ScriptedNode):
    """Plays its episodes with `LyingEnvironment(run's environment, lie, at)`. `deviated`: whether a lie changed a
    submitted episode (a faked reply in a turn the budget ended anyway changes nothing)."""

    def __init__(self, cfg: NodeConfig, lie: Lie, at: int):
        super().__init__(cfg)
        self.lie, self.at = lie, at
        self.liar: LyingEnvironment | None = None
        self.deviated: bool | None = None

    def environment(self) -> Environment | None:
        true = super().environment()
        assert true is not None, "a multi-turn run's node"
        if self.liar is None or self.liar.true is not true:
            self.liar = LyingEnvironment(true, self.lie, self.at)
        return self.liar

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        assert self.liar is not None
        rollouts = [r for g in submission.groups for r in g.rollouts if r.seed in self.liar.lies]
        if self.lie is faked_reply:  # the lie shows only where its environment turn made it into the episode
            rollouts = [r for r in rollouts if len(r.turns) > 2 * self.at - 1]
        self.deviated = bool(rollouts)
        return submission


# -- later turns sampled with the leased seed --------------------------------------------------------------------

@dataclass
class LeasedSeedEngine:
    """An engine that samples every model turn with the leased seed (a fixed noise the node can steer the episode
    with), instead of `turn_seed(seed, k)`. `deviated`: whether any turn came out other than honest sampling's."""

    engine: Any
    seeds: dict[int, int]
    """turn_seed(seed, k) -> seed, for the lease's seeds and every later turn k."""
    deviated: bool = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, requests: list[GenerationRequest], max_tokens: int) -> list[Completion]:
        mine = [replace(r, seed=self.seeds.get(r.seed, r.seed)) for r in requests]
        out = self.engine.generate(mine, max_tokens=max_tokens)
        later = [i for i, r in enumerate(requests) if r.seed in self.seeds]
        if later and not self.deviated:  # what honest sampling gives, for comparison only
            honest = self.engine.generate([requests[i] for i in later], max_tokens=max_tokens)
            self.deviated = any(h.token_ids != out[i].token_ids for h, i in zip(honest, later, strict=True))
        return out


class LeasedSeedNode(ScriptedNode):
    """Samples model turn k > 0 with the leased seed instead of `turn_seed(seed, k)`; honest otherwise."""

    deviated: bool | None = None

    def generate(self, lease: m.Lease) -> m.RolloutSubmission:
        real = self.engine
        proxy = LeasedSeedEngine(real, {turn_seed(s, k): s for p in lease.prompts for s in p.seeds
                                        for k in range(1, lease.sampling.max_turns)})
        self.engine = proxy  # type: ignore[assignment]
        try:
            return super().generate(lease)
        finally:
            self.engine = real
            self.deviated = proxy.deviated


# -- environment tokens that claim logprobs ----------------------------------------------------------------------

class EnvLogprobNode(ScriptedNode):
    """Honest episodes, but in one rollout of every group the environment tokens claim the true policy's logprobs
    (as if the model had sampled them, so that the trainer learns to write the environment's text). `deviated`:
    whether a rollout of the submission had an environment turn."""

    def __init__(self, cfg: NodeConfig, seed: int = 0):
        super().__init__(cfg)
        self.rng = random.Random(seed)
        self.deviated: bool | None = None

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        truth = Truth(self.true_checkpoint)
        groups, self.deviated = [], False
        for g in submission.groups:
            rollouts = list(g.rollouts)
            multi = [i for i, r in enumerate(rollouts) if r.turns]
            if multi:
                i = self.rng.choice(multi)
                r = rollouts[i]
                policy, _ = truth.annotate(g.prompt_ids, list(r.completion_ids), lease.sampling.temperature)
                claimed = [lp if is_model else policy[k] for a, b, is_model in spans(r.turns, len(r.completion_ids))
                           for k, lp in zip(range(a, b), r.logprobs[a:b], strict=True)]
                rollouts[i] = r.model_copy(update={"logprobs": claimed})
                self.deviated = True
            groups.append(g.model_copy(update={"rollouts": rollouts}))
        return submission.model_copy(update={"groups": groups})


def _at(i: int) -> int:
    """The model turn after which attempt i lies: the first or the second, alternately."""
    return 1 + i % (SAMPLING.max_turns - 1)


MULTI_TURN_ATTACKS: dict[str, Callable[[Pool, int], Attempt]] = {
    "faked_env_turn": _node_attack(lambda p, i: p.node(LyingNode, name=f"fake-env{i}", lie=faked_reply, at=_at(i)),
                                   tries=4),
    "dropped_env_turn": _node_attack(lambda p, i: p.node(LyingNode, name=f"drop-env{i}", lie=dropped_reply, at=_at(i)),
                                     tries=4),
    "added_env_turn": _node_attack(lambda p, i: p.node(LyingNode, name=f"add-env{i}", lie=added_reply, at=_at(i)),
                                   tries=4),
    "leased_seed_later_turns": _node_attack(lambda p, i: p.node(LeasedSeedNode, name=f"turn-seed{i}"), tries=4),
    "env_tokens_claim_logprobs": _node_attack(lambda p, i: p.node(EnvLogprobNode, name=f"env-lp{i}", seed=i),
                                              tries=4),
}
"""Attack name -> one attempt against a multi-turn pool (`open_multi_turn_pool`). Attempt i of a lying node lies
after model turn 1 + i % 2."""


def run_multi_turn_suite(pool: Pool, attempts: int, names: list[str] | None = None,
                         honest: Callable[[], int] | None = None) -> dict[str, list[Attempt]]:
    """`attempts` attempts of each multi-turn attack (interleaved with `honest()` rounds when given)."""
    return run_suite(pool, attempts, names or list(MULTI_TURN_ATTACKS), honest, attacks=MULTI_TURN_ATTACKS)


def multi_turn_suite(out: Path, attempts: int, honest_groups: int, engines: Sequence[str] = ("torch",),
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """bench/byzantine.py's multi-turn part: every multi-turn attack `attempts` times against a multi-turn pool,
    while honest multi-turn nodes (one per engine of `engines`) keep working until at least `honest_groups` of
    their groups were verified. Writes <out>/multi-turn.json and returns its summary."""
    import json
    import shutil
    import time

    root = out / "multi-turn"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with open_multi_turn_pool(root, make_multi_turn_checkpoint(root / "ckpt")) as pool:
        honest = [pool.node(name=f"honest-{e}", engine=e, max_prompts=8) for e in engines]
        ids = [h.node_id for h in honest]

        def decided() -> int:
            return sum(1 for nid in ids for g in pool.groups(nid) if g["status"] != "pending")

        def honest_round() -> int:
            for h in honest:
                h.sync()
                h.step()
            return pool.verify_all()

        rounds = [0]
        total = attempts * len(MULTI_TURN_ATTACKS)

        def interleaved() -> int:
            """Honest work spread over the attacks, so that the honest target is reached by the last one."""
            rounds[0] += 1
            return honest_round() if decided() < honest_groups * rounds[0] / total else 0

        t0 = time.time()
        honest_round()
        results = run_multi_turn_suite(pool, attempts, honest=interleaved)
        while decided() < honest_groups:
            honest_round()
        log(f"multi-turn suite: {attempts} attempts of {len(results)} attacks, {decided()} honest groups in "
            f"{time.time() - t0:.0f} s")
        groups = [g for nid in ids for g in pool.groups(nid)]
        episodes = [r for h in honest for g in h.last_submission.groups for r in g.rollouts]
        banned = sum(pool.node_row(nid).banned for nid in ids)
        reports = [pool.verifier.reports[g["id"]] for g in groups if g["id"] in pool.verifier.reports]
        for h in honest:
            h.engine.close()
    summary = {
        "attacks": {k: [sum(a.detected for a in v), len(v)] for k, v in results.items()},
        "stages": {k: sorted({a.stage for a in v}) for k, v in results.items()},
        "caught_by": {k: sorted({c for a in v for c in a.caught_by}) for k, v in results.items()},
        "example_reasons": {k: v[0].reason for k, v in results.items()},
        "honest_rejected": sum(g["status"] == "rejected" for g in groups),
        "honest_total": len(groups),
        "honest_rejected_reasons": [g["reason"] for g in groups if g["status"] == "rejected"][:10],
        "honest_nodes_banned": banned,
        "honest_full_checked": len(reports),
        "honest_max_logprob_diff": max((r.max_logprob_diff for r in reports), default=None),
        "honest_max_replay_gap": max((r.max_replay_gap for r in reports), default=None),
        "last_round_model_turns": {n: sum((len(r.turns) + 1) // 2 == n or (n == 1 and not r.turns) for r in episodes)
                                   for n in range(1, SAMPLING.max_turns + 1)},
        "engines": list(engines),
    }
    (out / "multi-turn.json").write_text(json.dumps(summary, indent=1))
    return summary
