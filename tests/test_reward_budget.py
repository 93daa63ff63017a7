"""What the verifier spends computing a stranger's rewards is bounded and charged to the stranger:
- a code rollout's test cases share one sandbox wall-clock cap: a program that exits just under each case's limit
  no longer makes every case run; an honest program is unaffected; a cap smaller than one case's limit is refused;
- math text nested absurdly deep scores 0 before the parser runs (deterministic: never a reason to ban);
- a claimed reward that a time limit decided otherwise is no proof of a lie (no ban), a plainly wrong one still is;
- a held group's reward seconds are charged to its identity's budget, and its next group is deferred.

Needs bubblewrap (scripts/install.sh installs it), like tests/test_sandbox.py.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from swarmrl.protocol import messages as m
from swarmrl.protocol.run import RunSpec
from swarmrl.protocol.tasks import Scored, Task, TaskSpec, load_task
from swarmrl.tasks.code import CodeTask
from swarmrl.tasks.mathcheck import MAX_BRACE_DEPTH, MathChecker, brace_depth
from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool
from swarmrl.testing.groups import pending_group
from swarmrl.trainer.model import build_tokenizer
from swarmrl.verifier.budget import IdentityBudget
from swarmrl.verifier.checks import CheckContext, score

CASES = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in ((1, 2), (3, 4), (5, 6))]
ANSWER = json.dumps(CASES, sort_keys=True, separators=(",", ":"))
SLOW = "import time\ntime.sleep(2.5)\na, b = map(int, input().split())\nprint(a + b)\n"
"""Exits well under the 5 s case limit with the right output: before the cap, every case ran (7.5 s and more)."""


def code_task(tmp_path, wall_s: float, rollout_s: float) -> CodeTask:
    data = "".join(json.dumps({"prompt": f"Add two numbers ({i}).", "tests": CASES}) + "\n" for i in range(4))
    (tmp_path / "p.jsonl").write_text(data)
    task = load_task(TaskSpec(name="code", options={
        "path": "p.jsonl", "sha256": hashlib.sha256(data.encode()).hexdigest(), "rollout_sandbox_s": rollout_s,
        "sandbox": {"wall_s": wall_s, "cpu_s": 2, "memory_mb": 256, "nproc": 8}}), tmp_path)
    assert isinstance(task, CodeTask)
    return task


def test_a_rollouts_test_cases_share_one_sandbox_cap(tmp_path):
    task = code_task(tmp_path, wall_s=5.0, rollout_s=5.0)
    runs = []
    real_run = task.sandbox.run
    task.sandbox.run = lambda *a, **kw: runs.append(kw.get("wall_s")) or real_run(*a, **kw)  # type: ignore
    # Case 1 takes 2.5 s and more; case 2 gets what is left of 5 s, too little for 2.5 s: killed, scored 0.
    assert task.scored(SLOW, ANSWER) == Scored(0.0, limited=True)
    assert len(runs) == 2 and runs[1] < 2.5
    # Scored once: the same program again costs no sandbox run.
    assert task.scored(SLOW, ANSWER) == Scored(0.0, limited=True) and len(runs) == 2


def test_an_honest_program_is_unaffected_by_the_cap(tmp_path):
    task = code_task(tmp_path, wall_s=3.0, rollout_s=3.0)
    assert task.scored("a, b = map(int, input().split())\nprint(a + b)\n", ANSWER) == Scored(1.0, limited=False)
    assert task.scored("print(3)\n", ANSWER) == Scored(1 / 3, limited=False)
    assert task.scored("print('x' * 10**7)\n", ANSWER) == Scored(0.0, limited=False)  # bytes: the same anywhere


def test_a_cap_smaller_than_one_cases_limit_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rollout_sandbox_s"):
        code_task(tmp_path, wall_s=3.0, rollout_s=2.0)


def test_absurdly_nested_latex_scores_zero_before_the_parser_runs():
    assert brace_depth("\\frac{\\sqrt{2}}{2}") == 2 and brace_depth("}}{a}") == 1
    checker = MathChecker()
    deep = "\\boxed{" + "\\frac{1}{" * MAX_BRACE_DEPTH + "2" + "}" * MAX_BRACE_DEPTH + "}"
    try:
        assert checker.check(deep, "1") == (False, False)
        assert checker._proc is None  # no worker was even started: nothing parsed it
        ok, limited = checker.check("The answer is \\boxed{\\frac{1}{2}}", "0.5")
        assert ok and not limited
    finally:
        checker.close()


class Fixed(Task):
    """Every completion scores `outcome`."""

    name = "fixed"

    def __init__(self, outcome: Scored, cost_s: float = 0.0):
        self.outcome, self.cost_s = outcome, cost_s

    def sample(self, rng):
        raise NotImplementedError

    def eval_set(self):
        return []

    def reward(self, completion, answer):
        return self.scored(completion, answer).reward

    def scored(self, completion, answer):
        time.sleep(self.cost_s)  # the cost of a reward (a sandbox run, say), not a wait for anything
        return self.outcome


def claimed(reward: float) -> m.PendingGroup:
    tok = build_tokenizer()
    ids = [tok.convert_tokens_to_ids("5"), tok.eos_token_id]
    rollouts = [m.Rollout(seed=s, completion_ids=ids, logprobs=[-0.5, -0.5], finish_reason="stop",
                          claimed_reward=reward) for s in (1, 2)]
    return pending_group(group_id=1, node_id="n", prompt_text="1+4=", answer="5",
                         sampling=m.SamplingSpec(max_tokens=4, group_size=2), seeds=[1, 2],
                         group=m.RolloutGroup(prompt_id="p", prompt_ids=tok("1+4=").input_ids, rollouts=rollouts))


@pytest.mark.parametrize("limited, banned", [(True, False), (False, True)])
def test_a_claim_a_time_limit_decided_otherwise_is_no_proof_of_a_lie(limited, banned):
    ctx = CheckContext(tokenizer=build_tokenizer(), task=Fixed(Scored(0.0, limited=limited)), run=RunSpec())
    rewards, reason, ban = score(claimed(1.0), ctx)
    assert rewards == [0.0, 0.0] and ban is banned and (reason is None) is not banned  # trained on: 0, never the claim


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "v0")


def test_a_held_groups_reward_seconds_are_charged_and_defer_the_identity(tmp_path, ckpt):
    with open_pool(tmp_path, ckpt, verifier={"warmup_checks": 0, "sample_rate": 0.0, "policy_seed": 0}) as pool:
        v = pool.verifier
        now = [0.0]
        v.budget = IdentityBudget(budget_s=0.01, window_s=1000.0, clock=lambda: now[0])
        node = pool.node(max_prompts=2)
        node.step()
        first, second = pool.op.pending(limit=10)
        v.verify([])  # connects: the task is loaded from the run
        v.task = Fixed(Scored(1.0), cost_s=0.05)  # each rollout's reward costs 50 ms, the budget is 10 ms
        verdicts = v.verify([first])
        assert [(x.accepted, x.checked) for x in verdicts] == [(True, False)]  # held: no full check ran
        assert v.stats.full_checks == 0 and v.budget.level(node.node_id) < 0
        assert v.verify([second]) == [] and v.stats.deferred == 1  # deferred before any work
        now[0] += 1e9  # refilled
        assert [x.accepted for x in v.verify([second])] == [True]


def test_the_flood_bench_sends_answers_that_reach_the_costly_paths():
    from swarmrl.testing.byzantine.reward_flood import costly_text

    # The power tower passes the nesting pre-check, so the bench measures the parser's time limit, not the pre-check.
    assert 0 < brace_depth(costly_text("math", 7)) <= MAX_BRACE_DEPTH
    assert costly_text("code", 1) != costly_text("code", 2)  # no score cache shortcut between rollouts
