"""Multi-turn episodes (protocol/episodes.py): played by a node's engines, replayed by the verifier's checks, masked
by the trainer; every way a node could misreport an environment turn or a turn's sampling is caught."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from swarmrl.models.build import ModelConfig, build_model, save_checkpoint
from swarmrl.models.prompts import render_prompt
from swarmrl.models.tokenizers import build_bpe_tokenizer
from swarmrl.node.engine import EngineConfig
from swarmrl.node.engines import build_engine
from swarmrl.node.episodes import play_episodes
from swarmrl.protocol import messages as m
from swarmrl.protocol.episodes import Environment, EnvironmentSpec, check_replay, turns_problem
from swarmrl.protocol.run import RunSpec
from swarmrl.tasks.toolcalc import Calculator, ToolArithmeticTask, evaluate
from swarmrl.testing.groups import pending_group
from swarmrl.testing.local import verify_groups
from swarmrl.trainer.grpo import build_batch
from swarmrl.verifier.models import load_policy

TEXTS = ["What is 7 * 8?", "Say hi.", "12+34="]
GROUP = 4
SAMPLING = m.SamplingSpec(temperature=1.0, max_tokens=10, group_size=GROUP, max_turns=3, max_episode_tokens=80)
RUN = RunSpec(sampling=SAMPLING, environment=EnvironmentSpec(name="calculator"), proofs={"required": True})


class Talker(Environment):
    """Answers every turn (so episodes reach the turn limit), with text that depends on what the model said."""

    name = "talker"

    def respond(self, prompt: str, turns: Sequence[str], seed: int) -> str | None:
        return f"turn {len(turns)}: you wrote {len(turns[-1])} characters ({seed % 7})"


class Clock(Environment):
    name = "clock"

    def respond(self, prompt: str, turns: Sequence[str], seed: int) -> str | None:
        return str(random.random())


class SetOrder(Environment):
    """Iterates a set of strings: the order, and so the reply, follows the process's hash seed."""

    name = "set_order"
    probes = (("p", ("alpha beta gamma delta epsilon zeta eta theta",)),)

    def respond(self, prompt: str, turns: Sequence[str], seed: int) -> str | None:
        return " ".join(set(turns[-1].split()))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = build_bpe_tokenizer(1024)
    # Stops about 15% likely per token: most model turns end with a stop token, some run out of tokens.
    model = build_model(ModelConfig.preset("mini", arch="qwen2", stop_rate=0.15), tok)
    return save_checkpoint(model, tok, tmp_path_factory.mktemp("episodes") / "ckpt")


def _groups(engine, tok, env: Environment) -> list[m.PendingGroup]:
    rng = random.Random(3)
    prompts = [(t, render_prompt(tok, t), [rng.getrandbits(63) for _ in range(GROUP)]) for t in TEXTS]
    played = play_episodes(engine, tok, env, SAMPLING, prompts)
    return [pending_group(group_id=i + 1, prompt_text=t, answer="56", sampling=SAMPLING, seeds=seeds,
                          group=m.RolloutGroup(prompt_id=str(i), prompt_ids=ids, rollouts=rs))
            for i, ((t, ids, seeds), rs) in enumerate(zip(prompts, played, strict=True))]


@pytest.fixture(scope="module", params=["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def played(request, ckpt):
    if request.param == "vllm":
        pytest.importorskip("vllm", exc_type=ImportError)
    policy = load_policy(ckpt, 0)
    with build_engine(EngineConfig(kind=request.param, block_size=32 if request.param == "vllm" else None), ckpt,
                      temperature=1.0) as engine:
        groups = _groups(engine, policy.tokenizer, Talker(Environment.Options()))
    return policy, groups


def _check(policy, groups, env=None) -> list[str | None]:
    env = env or Talker(Environment.Options())
    return verify_groups(policy, groups, task=ToolArithmeticTask(), run=RUN, env=env)[0]


def test_honest_episodes_pass_every_check(played):
    policy, groups = played
    rollouts = [r for g in groups for r in g.group.rollouts]
    turns = [(len(r.turns) + 1) // 2 or 1 for r in rollouts]
    assert max(turns) == SAMPLING.max_turns and min(turns) < SAMPLING.max_turns  # both ways an episode ends
    assert all(turns_problem(r.turns, len(r.completion_ids), 3, 10) is None for r in rollouts)
    assert _check(policy, groups) == [None] * len(groups)


def test_the_trainer_learns_only_from_the_model_turns(played):
    _, groups = played
    feed = [m.TrainingGroup(group_id=g.group_id, policy_version=0, group=g.group, rewards=[0.0, 1.0, 0.0, 1.0],
                            lease_id=g.lease.lease_id, node_key=g.node_key)
            for g in groups]
    batch = build_batch(feed, pad_id=0)
    model_tokens = [sum(n for n in r.turns[0::2]) if r.turns else len(r.completion_ids)
                    for g in groups for r in g.group.rollouts]
    assert batch.loss_mask.sum(dim=1).tolist() == [float(n) for n in model_tokens]
    env_lps = [lp for g in groups for r in g.group.rollouts for k, n in enumerate(r.turns) if k % 2
               for lp in r.logprobs[sum(r.turns[:k]):sum(r.turns[:k]) + n]]
    assert env_lps and set(env_lps) == {0.0}


def _rewritten(g: m.PendingGroup, edit) -> m.PendingGroup:
    group = g.group.model_copy(deep=True)
    r = next(r for r in group.rollouts if len(r.turns) >= 3)
    edit(r)
    return g.model_copy(update={"group": group})


def _env_start(r: m.Rollout) -> int:
    return r.turns[0]


def test_a_faked_environment_turn_is_caught(played):
    policy, groups = played

    def fake(r: m.Rollout) -> None:  # one token of the environment's reply replaced: a different observation
        i = _env_start(r) + 2
        r.completion_ids[i] = (r.completion_ids[i] + 1) % 300 + 10
    reasons = _check(policy, [_rewritten(groups[0], fake)])
    assert "not what the environment answers" in reasons[0]


def test_a_dropped_environment_turn_is_caught(played):
    policy, groups = played

    def drop(r: m.Rollout) -> None:  # the episode cut after its first model turn, as if the environment were done
        n = r.turns[0]
        del r.completion_ids[n:], r.logprobs[n:]
        r.turns, r.finish_reason = [], "stop"
        r.proof = None
    reasons = verify_groups(policy, [_rewritten(groups[0], drop)], task=ToolArithmeticTask(),
                            run=RUN.model_copy(update={"proofs": RUN.proofs.model_copy(update={"required": False})}),
                            env=Talker(Environment.Options()))[0]
    assert "dropped" in reasons[0]


def test_an_environment_turn_claiming_logprobs_is_caught(played):
    policy, groups = played

    def claim(r: m.Rollout) -> None:
        r.logprobs[_env_start(r)] = -0.5
    assert "claims logprobs" in _check(policy, [_rewritten(groups[0], claim)])[0]


def test_a_later_turn_sampled_with_the_leased_seed_fails_replay(ckpt, monkeypatch):
    """Turn seeds are part of the rule: a node that samples every turn with the leased seed (easier to steer) is
    caught by the full check's replay."""
    import swarmrl.node.episodes as node_episodes

    monkeypatch.setattr(node_episodes, "turn_seed", lambda seed, k: seed)
    policy = load_policy(ckpt, 0)
    with build_engine(EngineConfig(kind="torch"), ckpt, temperature=1.0) as engine:
        groups = _groups(engine, policy.tokenizer, Talker(Environment.Options()))
    reasons = _check(policy, groups)
    assert all(r is not None and "replay" in r for r in reasons), reasons


def test_the_calculator_answers_tool_calls_and_nothing_else():
    calc = Calculator(Environment.Options())
    assert calc.reply("q", ["calc 37 * 48"], 0) == "1776"
    assert calc.reply("q", ["calc (2 - 5) * 4"], 0) == "-12"
    assert calc.reply("q", ["1776"], 0) is None  # an answer, not a call: the episode ends
    assert evaluate("2 ** 99").startswith("error")
    assert evaluate("9" * 10 + " * " + "9" * 10) == "error: too large"
    assert evaluate("(" * 30 + "1" + ")" * 30) == "1"  # parentheses alone nest nothing
    assert evaluate("-" * 30 + "1") == "error: nested too deep"
    assert evaluate("__import__('os')").startswith("error")


def test_the_tool_task_scores_the_answer_turn():
    task = ToolArithmeticTask()
    p = task.eval_set()[0]
    assert task.reward(p.answer, p.answer) == 1.0 and task.reward("12", p.answer) < 0.25
    assert p.solution_turns == (f"calc {p.prompt[8:-1]}", p.answer)


def test_an_environment_that_does_not_replay_is_refused():
    with pytest.raises(ValueError, match="differently twice"):
        check_replay(EnvironmentSpec(name="clock"), Clock(Environment.Options()))
    with pytest.raises(ValueError, match="another process"):
        check_replay(EnvironmentSpec(name="set_order"), SetOrder(Environment.Options()))
    check_replay(EnvironmentSpec(name="calculator"), Calculator(Environment.Options()))  # replays: no error


def test_a_multi_turn_run_names_its_environment():
    with pytest.raises(ValueError, match=r"\[run.environment\]"):
        RunSpec(sampling=SAMPLING)
    with pytest.raises(ValueError, match="max_turns"):
        RunSpec(environment=EnvironmentSpec(name="calculator"))


def test_a_coordinator_refuses_an_environment_it_cannot_load_when_the_run_starts(tmp_path):
    from pydantic import ValidationError

    from swarmrl.coordinator.config import CoordinatorConfig

    run = {"sampling": {"max_turns": 2}, "environment": {"name": "calculatorr"}}
    with pytest.raises(ValidationError, match=r"\[run.environment\] name: unknown environment 'calculatorr'"):
        CoordinatorConfig(data_dir=tmp_path, run=run)
    assert CoordinatorConfig(data_dir=tmp_path, run={**run, "environment": {"name": "calculator"}}).run.environment
