"""How an episode goes on after each model turn, decided by one function that nodes, the verifier and the trainer
all call (`after_model_turn`), and the verifier's check of a whole episode against it (`episode_problem`).

The rules (`protocol.episodes` has the why):
- a model turn that did not end with a stop token was cut by a token limit: the episode ends there, "length";
- after the run's last model turn (`sampling.max_turns`), or when the environment answers None, it ends "stop";
- otherwise the environment's reply follows (`render_env_turn`), unless it would leave no room for one more model
  token within the episode's cap or the model's length limit: then the episode ends "length".
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedTokenizerBase

from swarmrl.models.prompts import render_env_turn
from swarmrl.protocol.episodes import Environment, spans
from swarmrl.protocol.run import SamplingSpec


@dataclass(frozen=True)
class Next:
    """What follows a model turn: the environment's tokens, or (None) the end of the episode and how it ended."""

    reply_ids: list[int] | None
    finish: Literal["stop", "length"] = "stop"


@dataclass(frozen=True)
class Episode:
    """What one episode is played in: the environment, the tokenizer, the run's limits, the prompt."""

    env: Environment
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingSpec
    stops: Collection[int]
    prompt_text: str
    prompt_len: int
    max_positions: int | None = None
    """The model's length limit (prompt + completion); None: only the run's caps apply."""

    def turn_budget(self, used: int) -> int:
        """Tokens the next model turn may take when `used` completion tokens are already written (0: none left)."""
        room = self.sampling.episode_tokens - used
        if self.max_positions is not None:
            room = min(room, self.max_positions - self.prompt_len - used)
        return max(0, min(self.sampling.max_tokens, room))

    def after_model_turn(self, model_turns: Sequence[Sequence[int]], used: int, seed: int) -> Next:
        """What follows the last of `model_turns` (token ids of each model turn so far; `used` completion tokens in
        all, the environment's included), for the rollout of leased `seed`."""
        last = model_turns[-1]
        if not last or last[-1] not in self.stops:
            return Next(None, "length")
        if len(model_turns) >= self.sampling.max_turns:
            return Next(None, "stop")
        texts = [self.tokenizer.decode(list(t), skip_special_tokens=True) for t in model_turns]
        reply = self.env.reply(self.prompt_text, texts, seed)
        if reply is None:
            return Next(None, "stop")
        ids = render_env_turn(self.tokenizer, reply)
        if not ids or self.turn_budget(used + len(ids)) < 1:
            return Next(None, "length")
        return Next(ids)


def last_model_turn(completion_ids: Sequence[int], turns: Sequence[int]) -> list[int]:
    """The tokens of an episode's last model turn (the whole completion for a single-turn rollout): what the task
    scores."""
    a, b, _ = spans(turns, len(completion_ids))[-1]
    return list(completion_ids[a:b])


def episode_problem(ep: Episode, completion_ids: Sequence[int], logprobs: Sequence[float], turns: Sequence[int],
                    finish_reason: str, seed: int) -> str | None:
    """Why this episode (shape already checked by `protocol.episodes.turns_problem`) is not what the rules and the
    environment make of its model turns, or None: every model turn ends right, every environment turn is exactly
    the environment's reply (none faked, dropped or added), environment tokens claim logprob 0.0, and the finish
    reason is the one the episode ended with."""
    parts = spans(turns, len(completion_ids))
    model_turns: list[list[int]] = []
    for i, (a, b, is_model) in enumerate(parts):
        if not is_model:
            continue
        k = len(model_turns)
        ids = list(completion_ids[a:b])
        if any(t in ep.stops for t in ids[:-1]):
            return f"model turn {k}: tokens after a stop token"
        if ids[-1] not in ep.stops and len(ids) != ep.turn_budget(a):
            return f"model turn {k}: ends after {len(ids)} tokens, neither at a stop token nor at its limit"
        model_turns.append(ids)
        nxt = ep.after_model_turn(model_turns, b, seed)
        if i == len(parts) - 1:
            if nxt.reply_ids is not None:
                return f"model turn {k}: the environment answers it, but the episode ends there (a dropped turn)"
            if finish_reason != nxt.finish:
                return f"finish {finish_reason!r}, but the episode ended {nxt.finish!r}"
            return None
        ea, eb, _ = parts[i + 1]
        if nxt.reply_ids is None:
            return f"model turn {k}: an environment turn follows, but the episode ends there"
        if list(completion_ids[ea:eb]) != nxt.reply_ids:
            return f"environment turn {k}: not what the environment answers"
        if any(lp != 0.0 for lp in logprobs[ea:eb]):
            return f"environment turn {k}: claims logprobs (environment tokens claim 0.0)"
    return "an episode must end with a model turn"
