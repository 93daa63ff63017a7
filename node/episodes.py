"""A node plays multi-turn episodes (`protocol.episodes`): every rollout of a lease, turn by turn, batched.

Each round sends the model turn of every episode still going to the engine in one call (model turn k sampled with
`turn_seed(seed, k)`, its prompt the leased prompt and the episode so far, so vLLM's prefix cache serves the
shared part), then asks the run's environment what follows each (`models.episodes.Episode.after_model_turn`, the
very function the verifier checks with). The activation proof is built once per episode over the states of all its
model tokens, in order: what the verifier recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from swarmrl.models.episodes import Episode
from swarmrl.node.engine import GenerationRequest, InferenceEngine
from swarmrl.protocol.episodes import Environment
from swarmrl.protocol.messages import Rollout
from swarmrl.protocol.run import SamplingSpec
from swarmrl.protocol.sampling import turn_seed


@dataclass
class _Play:
    episode: Episode
    prompt_ids: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    model_turns: list[list[int]] = field(default_factory=list)
    states: list = field(default_factory=list)
    finish: str | None = None


def play_episodes(engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase, env: Environment,
                  sampling: SamplingSpec, prompts: list[tuple[str, list[int], list[int]]]) -> list[list[Rollout]]:
    """For each (prompt text, prompt ids, seeds): one rollout per seed, each a whole episode."""
    stops = engine.stop_ids
    plays = [[_Play(Episode(env, tokenizer, sampling, stops, text, len(ids), engine.max_model_len or None), ids, s)
              for s in seeds] for text, ids, seeds in prompts]
    going = [p for group in plays for p in group]
    k = 0
    while going:
        by_budget: dict[int, list[_Play]] = {}
        for p in going:
            by_budget.setdefault(p.episode.turn_budget(len(p.tokens)), []).append(p)
        for budget, batch in by_budget.items():
            requests = [GenerationRequest(prompt_ids=p.prompt_ids + p.tokens, seed=turn_seed(p.seed, k),
                                          keep_states=engine.cfg.proofs) for p in batch]
            for p, c in zip(batch, engine.generate(requests, max_tokens=budget), strict=True):
                p.tokens += c.token_ids
                p.logprobs += c.logprobs
                p.turns.append(len(c.token_ids))
                p.model_turns.append(c.token_ids)
                if c.states is not None:
                    p.states.append(c.states)
                nxt = p.episode.after_model_turn(p.model_turns, len(p.tokens), p.seed)
                if nxt.reply_ids is None:
                    p.finish = nxt.finish
                else:
                    p.tokens += nxt.reply_ids
                    p.logprobs += [0.0] * len(nxt.reply_ids)
                    p.turns.append(len(nxt.reply_ids))
        going = [p for p in going if p.finish is None]
        k += 1
    proofs = _proofs([p for group in plays for p in group]) if engine.cfg.proofs else None
    out, i = [], 0
    for group in plays:
        rollouts = []
        for p in group:
            rollouts.append(Rollout(seed=p.seed, completion_ids=p.tokens, logprobs=p.logprobs,
                                    finish_reason=p.finish,  # type: ignore[arg-type]
                                    turns=p.turns if len(p.turns) > 1 else [],
                                    proof=None if proofs is None else proofs[i]))
            i += 1
        out.append(rollouts)
    return out


def _proofs(plays: list[_Play]) -> list[str]:
    import torch

    from swarmrl.node.proof import build_proofs

    return build_proofs([torch.cat(p.states) for p in plays])
