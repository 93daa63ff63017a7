"""In-flight weight updates (`SamplingSpec.in_flight_updates`): a newer policy version loaded in place while a
lease is generated, between two decode steps, without draining.

The engine decodes as usual, asking every `update_chunk_tokens` steps whether a newer version is ready
(`InferenceEngine.generate_until`: vLLM's own step loop, the torch engine's decode loop). When one is:
- vLLM in this process, with every completion going at one token index, loads it between two steps and goes on: the
  load has vLLM preempt the requests running, which it schedules again with their prompt and tokens so far
  prefilled under the new weights (`swap`);
- otherwise the engine stops the completions still going, the version is loaded, and they are continued from their
  prompt and their tokens so far at the completion position where those end (`GenerationRequest.position`), so the
  sampling rule sees the very positions it would have seen in one go (`protocol.sampling`).
Either way prompt and tokens so far are prefilled again under the new weights, and every token from there on is
that version's: the group records where its span starts
(`RolloutGroup.version_spans`), and the verifier replays each span by prefilling the whole sequence with its
version. With no version ready, a lease is generated in one go, exactly as without in-flight updates. The activation
proof is built once per completion over the states of all its tokens, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from swarmrl.node.engine import Completion, GenerationRequest, InferenceEngine


@dataclass(frozen=True)
class Updates:
    """Where a newer version comes from while a lease is generated (`node.weights.Weights.in_flight`)."""

    ready: Callable[[], bool]
    """Whether a newer version is ready to load: asked between decode steps, so it must be cheap."""
    load: Callable[[], int | None]
    """Load it in place; its version, or None when nothing was loaded."""


@dataclass
class _Going:
    request: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    states: list = field(default_factory=list)
    finish: str | None = None


def generate_in_flight(engine: InferenceEngine, requests: list[GenerationRequest], max_tokens: int, every: int,
                       version: int, updates: Updates) -> tuple[list[Completion], list[tuple[int, int]]]:
    """(one completion per request, in order; the version spans: (first token index, version), the first (0,
    `version`)). The engine asks `updates.ready()` every `every` decode steps (`InferenceEngine.generate_until`). For a
    ready version it either loads it between two steps and goes on (`swap`: every completion going at one token
    index), or stops: every completion still going is then cut to the fewest tokens any of them has (so a span
    starts at one token index in every rollout), the version is loaded in place, and they go on from there."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    proofs = bool(engine.cfg.proofs)
    going = [_Going(r) for r in requests]
    spans = [(0, version)]
    interrupt = updates.ready
    at = 0

    def new_span(start: int) -> bool:
        """Load what is ready; its span starts at token `start` of every completion going. False: nothing loaded."""
        nonlocal interrupt
        new = updates.load()
        if new is None:  # what was ready is no longer (or not for this lease): stop asking
            interrupt = _never
            return False
        if new <= spans[-1][1]:
            raise RuntimeError(f"an in-flight update to version {new} after version {spans[-1][1]}")
        if spans[-1][0] == start:  # no token came from the version before (a batch not yet started)
            spans.pop()
        spans.append((start, new))
        return True

    def swap(n: int) -> bool:  # the engine changes weights between two steps, every completion going at token n
        return new_span(at + n)

    while live := [g for g in going if g.finish is None]:
        at = len(live[0].tokens)  # every completion going has as many tokens
        chunk = [replace(g.request, prompt_ids=list(g.request.prompt_ids) + g.tokens,
                         position=g.request.position + at, keep_states=proofs) for g in live]
        done = engine.generate_until(chunk, max_tokens - at, interrupt, every, swap)
        cut = min((len(c.token_ids) for c in done if c.interrupted), default=None)
        for g, c in zip(live, done, strict=True):
            n = len(c.token_ids) if cut is None else min(len(c.token_ids), cut)
            g.tokens += c.token_ids[:n]
            g.logprobs += c.logprobs[:n]
            if c.states is not None:
                g.states.append(c.states[:n])
            if n == len(c.token_ids) and not c.interrupted:
                g.finish = c.finish_reason
            elif g.tokens and g.tokens[-1] in engine.stop_ids:
                g.finish = "stop"
            elif len(g.tokens) >= max_tokens or (engine.max_model_len and
                                                 len(g.request.prompt_ids) + len(g.tokens) >= engine.max_model_len):
                g.finish = "length"
        if cut is not None and any(g.finish is None for g in going):
            new_span(at + cut)
    out = [Completion(token_ids=g.tokens, logprobs=g.logprobs, finish_reason=g.finish)  # type: ignore[arg-type]
           for g in going]
    if proofs:
        _prove(engine, [g.request for g in going], out, going)
    return out, spans


def _never() -> bool:
    return False


def _prove(engine: InferenceEngine, requests: list[GenerationRequest], out: list[Completion],
           going: list[_Going]) -> None:
    """Each completion's proof over all its pieces' states (or the states, where its request keeps them)."""
    import torch

    engine._attach_proofs(requests, out, [torch.cat([s for s in g.states if len(s)]) if g.tokens else None
                                          for g in going])
