"""Checks a submitted group against the facts only the trusted side knows.

First cut: the prompt tokens must be the leased prompt's; every token id must exist; finish reasons must
follow from the tokens (EOS only at the end and exactly when "stop"; "length" only at max_tokens); and
the reward is recomputed here from the decoded completion, never taken from the node.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from protocol.messages import PendingGroup, Verdict
from protocol.tasks import Task


@dataclass
class CheckContext:
    tokenizer: PreTrainedTokenizerFast
    task: Task


def _reject(g: PendingGroup, reason: str, ban: bool = True) -> Verdict:
    return Verdict(group_id=g.group_id, accepted=False, reason=reason, ban=ban)


def check_shape(g: PendingGroup, ctx: CheckContext) -> str | None:
    """The reason the group's shape is inconsistent with its lease, or None."""
    tok = ctx.tokenizer
    expected_prompt = tok(g.prompt_text).input_ids
    if g.group.prompt_ids != expected_prompt:
        return "prompt tokens do not match the leased prompt"
    if sorted(r.seed for r in g.group.rollouts) != sorted(g.seeds):
        return "rollout seeds do not match the lease"
    vocab = len(tok)
    eos = tok.eos_token_id
    for i, r in enumerate(g.group.rollouts):
        ids = r.completion_ids
        if len(ids) != len(r.logprobs):
            return f"rollout {i}: {len(ids)} tokens but {len(r.logprobs)} logprobs"
        if not ids:
            return f"rollout {i}: empty completion"
        if any(t < 0 or t >= vocab for t in ids):
            return f"rollout {i}: token id outside the vocabulary"
        if len(ids) > g.sampling.max_tokens:
            return f"rollout {i}: longer than max_tokens"
        if eos in ids[:-1]:
            return f"rollout {i}: tokens after EOS"
        ends_eos = ids[-1] == eos
        if r.finish_reason == "stop" and not ends_eos:
            return f"rollout {i}: finish 'stop' without EOS"
        if r.finish_reason == "length" and (ends_eos or len(ids) != g.sampling.max_tokens):
            return f"rollout {i}: finish 'length' before max_tokens"
        if any(not (lp <= 0.0) for lp in r.logprobs):
            return f"rollout {i}: a logprob above 0"
    return None


def rewards(g: PendingGroup, ctx: CheckContext) -> list[float]:
    """Trusted rewards: the completion decoded here, scored against the coordinator's answer."""
    out = []
    for r in g.group.rollouts:
        text = ctx.tokenizer.decode(r.completion_ids, skip_special_tokens=True)
        out.append(ctx.task.reward(text, g.answer))
    return out


def verify_group(g: PendingGroup, ctx: CheckContext) -> Verdict:
    """A verdict for one group: rejected with a reason (and a ban when it proves cheating), or accepted
    with rewards recomputed here."""
    reason = check_shape(g, ctx)
    if reason is not None:
        return _reject(g, reason)
    return Verdict(group_id=g.group_id, accepted=True, rewards=rewards(g, ctx))
