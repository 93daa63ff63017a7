"""The run description is the one source of the run's facts; each invariant has one function; configs refuse
unknown keys."""

import pytest

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.demo import DemoConfig
from swarmrl.node.config import NodeConfig
from swarmrl.protocol import messages as m
from swarmrl.protocol.run import RunSpec, SamplingSpec, check_run
from swarmrl.protocol.validation import group_problem, is_fresh, staleness_problem
from swarmrl.runtime.config import ConfigError, load_config
from swarmrl.trainer.config import TrainerConfig
from swarmrl.trainer.grpo import GRPOConfig
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.verifier.config import VerifierConfig

CONFIGS = [CoordinatorConfig, NodeConfig, VerifierConfig, TrainerConfig, DemoConfig, GRPOConfig, P2PConfig]


@pytest.mark.parametrize("model", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_refuses_an_unknown_key_and_names_the_closest_known_one(model):
    field = next(iter(model.model_fields))
    with pytest.raises(ConfigError, match=f"{field[:-1]}x: unknown key; did you mean {field}"):
        load_config(model, None, [f"{field[:-1]}x=1"])


def test_a_typo_in_a_nested_table_is_refused_with_its_path():
    with pytest.raises(ConfigError, match="engine.kindd: unknown key; did you mean kind"):
        load_config(NodeConfig, None, ["engine.kindd=torch"])
    with pytest.raises(ConfigError, match="run.sampling.temprature"):
        load_config(CoordinatorConfig, None, ["run.sampling.temprature=0.7"])


def test_run_facts_live_only_in_the_run_description():
    for model in (TrainerConfig, VerifierConfig, NodeConfig):
        assert not {"max_staleness", "task", "sampling", "require_proof"} & set(model.model_fields), model


@pytest.mark.parametrize(("version", "reference", "k", "fresh"), [
    (5, 5, 0, True), (4, 5, 0, False), (3, 5, 2, True), (2, 5, 2, False), (6, 5, 2, False),
])
def test_staleness_is_one_rule(version, reference, k, fresh):
    assert is_fresh(version, reference, k) is fresh
    assert (staleness_problem(version, reference, k) is None) is fresh


def _group(rollouts: list[m.Rollout]) -> m.RolloutGroup:
    return m.RolloutGroup(prompt_id="p", prompt_ids=[1, 2], rollouts=rollouts)


def test_group_shape_is_checked_against_the_lease():
    sampling = SamplingSpec(group_size=2, max_tokens=3)
    ok = [m.Rollout(seed=s, completion_ids=[4, 5], logprobs=[-0.1, -0.2], finish_reason="stop") for s in (7, 8)]
    assert group_problem(_group(ok), [8, 7], sampling) is None
    cases = {
        "expected 2 rollouts": (ok[:1], [7, 8]),
        "seeds do not match": (ok, [7, 9]),
        "1 logprobs for 2 tokens": ([ok[0], ok[1].model_copy(update={"logprobs": [-0.1]})], [7, 8]),
        "exceed max_tokens": ([ok[0], ok[1].model_copy(update={"completion_ids": [1, 1, 1, 1],
                                                               "logprobs": [-1.0] * 4})], [7, 8]),
        "empty completion": ([ok[0], ok[1].model_copy(update={"completion_ids": [], "logprobs": []})], [7, 8]),
        "finite and <= 0": ([ok[0], ok[1].model_copy(update={"logprobs": [0.5, -0.1]})], [7, 8]),
        "negative token id": ([ok[0], ok[1].model_copy(update={"completion_ids": [-1, 2]})], [7, 8]),
    }
    for why, (rollouts, seeds) in cases.items():
        assert why in (group_problem(_group(rollouts), seeds, sampling) or ""), why


def test_a_role_configured_for_another_run_refuses_it():
    served = RunSpec(run_id="r", max_staleness=2, sampling=SamplingSpec(temperature=0.7))
    check_run(served, None, "trainer")
    check_run(served, served.model_copy(), "trainer")
    with pytest.raises(ValueError, match="max_staleness: the coordinator's is 2, this role's config says 1"):
        check_run(served, served.model_copy(update={"max_staleness": 1}), "verifier")
