"""Groups generated locally by an engine, checked by the real verifier code, without a pool (tests and benches).

    reqs = group_requests(tokenizer, texts, group_size=8, temperature=0.7, rng=random.Random(0))
    comps = engine.generate(reqs, max_tokens)
    groups = pending_groups(texts, reqs, comps, group_size=8, max_tokens=max_tokens)
    reasons = verify_groups(load_policy(ckpt, 0), groups)      # None per group that passed

`verify_groups` runs what the verifier service runs on a group: the cheap checks (prompt rendering, seeds,
termination at the model's stop tokens, proofs decode, reward) and the full check (prefill, replay, logprobs,
activation proofs), with the verifier's tolerances for the policy's dtype.
"""

from __future__ import annotations

import random

from swarmrl.models.prompts import render_prompt
from swarmrl.node.engine import Completion, GenerationRequest
from swarmrl.protocol import messages as m
from swarmrl.protocol.episodes import Environment
from swarmrl.protocol.run import RunSpec
from swarmrl.protocol.tasks import Task
from swarmrl.testing.groups import pending_group
from swarmrl.verifier.checks import CheckContext, cheap_checks
from swarmrl.verifier.config import Tolerances
from swarmrl.verifier.full_check import GroupReport, full_check
from swarmrl.verifier.models import PolicyModel


def group_requests(tokenizer, texts: list[str], group_size: int, temperature: float, rng: random.Random
                   ) -> list[GenerationRequest]:
    """`group_size` requests per prompt text (rendered as every role renders it), each with its own seed."""
    return [GenerationRequest(render_prompt(tokenizer, t), seed=rng.getrandbits(63), temperature=temperature)
            for t in texts for _ in range(group_size)]


def pending_groups(texts: list[str], reqs: list[GenerationRequest], comps: list[Completion], group_size: int,
                   max_tokens: int, first_id: int = 1) -> list[m.PendingGroup]:
    """The verifier's view of locally generated groups, as the coordinator would hand them out."""
    out = []
    for gi, text in enumerate(texts):
        rq, cs = reqs[gi * group_size:(gi + 1) * group_size], comps[gi * group_size:(gi + 1) * group_size]
        rs = [m.Rollout(seed=q.seed, completion_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                        proof=c.proof) for q, c in zip(rq, cs, strict=True)]
        temperature = rq[0].temperature if rq[0].temperature is not None else 1.0
        out.append(pending_group(
            group_id=first_id + gi, node_id="local", prompt_text=text, answer="0",
            sampling=m.SamplingSpec(temperature=temperature, max_tokens=max_tokens, group_size=group_size),
            seeds=[r.seed for r in rs],
            group=m.RolloutGroup(prompt_id=str(gi), prompt_ids=rq[0].prompt_ids, rollouts=rs)))
    return out


def verify_groups(policy: PolicyModel, groups: list[m.PendingGroup], tol: Tolerances | None = None,
                  task: Task | None = None, run: RunSpec | None = None, max_batch_tokens: int = 16384,
                  env: Environment | None = None) -> tuple[list[str | None], list[GroupReport | None]]:
    """(reason per group: None when it passed every check; the full check's report, None where a cheap check
    already failed). `tol` defaults to the tolerances of the policy's dtype, `task` to addition (rewards only;
    built directly, so that this also runs from a checkout that is not installed, without the task entry
    points), `run` to the default run description (proofs required, the protocol's proof parameters); `env`
    replays multi-turn episodes."""
    if task is None:
        from swarmrl.tasks.addition import AdditionTask

        task = AdditionTask()
    dtype = str(next(policy.model.parameters()).dtype).removeprefix("torch.")
    tol = tol or Tolerances.for_dtype(dtype)
    ctx = CheckContext(tokenizer=policy.tokenizer, task=task, run=run or RunSpec(), max_positions=policy.max_positions,
                       hidden_size=policy.hidden_size, stop_ids=policy.stop_ids, vocab_size=policy.vocab_size,
                       env=env)
    reasons: list[str | None] = [cheap_checks(g, ctx)[0] for g in groups]
    passed = [i for i, r in enumerate(reasons) if r is None]
    reports: list[GroupReport | None] = [None] * len(groups)
    for i, rep in zip(passed, full_check([groups[i] for i in passed], policy, tol, max_batch_tokens), strict=True):
        reports[i], reasons[i] = rep, rep.reason
    return reasons, reports
