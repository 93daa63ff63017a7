"""The smoke-test environment of multi-turn runs: `echo`, registered in `swarmrl.environments`.

`echo` answers a model turn with the turn's length in characters and a three-digit digest of (the rollout's seed,
the turn's number, its text), as `<length>+<digest>`: digits and `+` only, so the character tokenizer of the tiny
models writes it without unknown tokens. It never ends an episode by itself (unless `end_every` asks it to), so
episodes of a random checkpoint whose stop tokens are likely (`models.build.ModelConfig.stop_rate`) reach the run's
turn limit, and every environment turn depends on what the model wrote: a node that fakes, drops or adds one differs
from what the verifier replays. The byzantine suite's multi-turn pools (`testing.byzantine.episodes`) run on it.

    [run.sampling]
    max_turns = 3
    [run.environment]
    name = "echo"
    options = {end_every = 3}   # optional: about one turn in three ends the episode
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.protocol.episodes import Environment


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    end_every: int = Field(0, ge=0, le=1000, description="When > 0, the episode ends (no reply) after a turn whose "
                           "digest is a multiple of this: about one turn in end_every. 0: every turn is answered.")


class Echo(Environment):
    """Answers every model turn with `<length>+<digest>` of it; with `end_every`, ends some episodes early."""

    name = "echo"
    Options = EchoOptions
    probes = (("12+34=", ("46", "", "4+6=10")), ("What is 2 + 3?", ("5", "five ü\n")))

    def digest(self, turns: Sequence[str], seed: int) -> int:
        """A number in 0..999 fixed by the seed, how many turns there are and the last one's text."""
        key = f"{seed}/{len(turns)}/{turns[-1]}".encode("utf-8", "surrogatepass")
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 1000

    def respond(self, prompt: str, turns: Sequence[str], seed: int) -> str | None:
        digest = self.digest(turns, seed)
        every = self.options.end_every  # type: ignore[attr-defined]
        if every and digest % every == 0:
            return None
        return f"{len(turns[-1])}+{digest:03d}"
