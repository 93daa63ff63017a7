"""In-flight weight updates (`SamplingSpec.in_flight_updates`): a lease's completions generated in chunks of
`update_chunk_tokens` tokens, with a newer policy version loaded in place between two chunks, without draining.

After each chunk, the completions still going are continued from their prompt and their tokens so far, at the
completion position where those end (`GenerationRequest.position`), so the sampling rule sees the very positions it
would have seen in one go (`protocol.sampling`): a completion with no version change is the same sample as without
chunks. When `update` loaded a newer version between two chunks, the continuation re-prefills prompt and tokens so
far under the new weights, and every token from there on is that version's: the group records where its span starts
(`RolloutGroup.version_spans`), and the verifier replays each span by prefilling the whole sequence with its
version. The activation proof is built once per completion over the states of all its tokens, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from swarmrl.node.engine import Completion, GenerationRequest, InferenceEngine


@dataclass
class _Going:
    request: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    states: list = field(default_factory=list)
    finish: str | None = None


def generate_in_flight(engine: InferenceEngine, requests: list[GenerationRequest], max_tokens: int, chunk_tokens: int,
                       version: int, update: Callable[[], int | None]
                       ) -> tuple[list[Completion], list[tuple[int, int]]]:
    """(one completion per request, in order; the version spans: (first token index, version), the first (0,
    `version`)). Between chunks, `update()` may load newer weights into `engine` in place and return their version
    (None: nothing loaded); it is not called after the last chunk. Every request's tokens from a span's first index
    on are that span's version's."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    proofs = bool(engine.cfg.proofs)
    going = [_Going(r) for r in requests]
    spans = [(0, version)]
    at = 0
    while live := [g for g in going if g.finish is None]:
        n = min(chunk_tokens, max_tokens - at)
        chunk = [replace(g.request, prompt_ids=list(g.request.prompt_ids) + g.tokens, position=at, keep_states=proofs)
                 for g in live]
        for g, c in zip(live, engine.generate(chunk, max_tokens=n), strict=True):
            g.tokens += c.token_ids
            g.logprobs += c.logprobs
            if c.states is not None:
                g.states.append(c.states)
            room = engine.max_model_len - len(g.request.prompt_ids) - len(g.tokens) if engine.max_model_len else 1
            if c.finish_reason == "stop":
                g.finish = "stop"
            elif len(g.tokens) >= max_tokens or room < 1 or len(c.token_ids) < n:
                g.finish = "length"
        at += n
        if any(g.finish is None for g in going) and (new := update()) is not None:
            if new <= spans[-1][1]:
                raise RuntimeError(f"an in-flight update to version {new} after version {spans[-1][1]}")
            spans.append((at, new))
    out = [Completion(token_ids=g.tokens, logprobs=g.logprobs, finish_reason=g.finish)  # type: ignore[arg-type]
           for g in going]
    if proofs:
        _prove(engine, [g.request for g in going], out, going)
    return out, spans


def _prove(engine: InferenceEngine, requests: list[GenerationRequest], out: list[Completion],
           going: list[_Going]) -> None:
    """Each completion's proof over all its chunks' states (or the states, where its request keeps them)."""
    import torch

    engine._attach_proofs(requests, out, [torch.cat(g.states) if g.states else None for g in going])
