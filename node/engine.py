"""The node's inference-engine interface: replayable sampling of rollouts from a checkpoint.

Every engine samples with the protocol's rule (`protocol.sampling`): at completion position i the token is
argmax_v(logits_v / T + gumbel_noise(seed, i, vocab)_v), so a verifier that recomputes the logits can replay
every token. Engines differ only in how they compute logits (vLLM or a plain transformers decode loop); the
temperature is applied by the rule, per request, never by the model. A completion ends at any of the model's
stop tokens (`models.prompts.stop_token_ids`).

Heavy imports (torch models, vLLM) stay inside the concrete engines so that importing this module is cheap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class GenerationRequest:
    """One rollout to sample."""

    prompt_ids: list[int]
    """Prompt token ids, already tokenized by the caller (`models.prompts.render_prompt`)."""
    seed: int
    """The coordinator's seed for this one rollout; it fixes the Gumbel noise at every position."""
    temperature: float | None = None
    """Sampling temperature of this request; None: the engine's default. Requests of one batch may differ."""
    position: int = 0
    """The completion position of the first token sampled (the sampling rule's position): a completion continued
    from `prompt_ids` = prompt + its tokens so far (in-flight updates, `node.inflight`) starts where they end."""
    keep_states: bool = False
    """With proofs on: hand back the final hidden states (`Completion.states`) instead of a proof, for a caller that
    builds one proof over several generations (the model turns of an episode)."""


@dataclass
class Completion:
    """What an engine sampled for one request."""

    token_ids: list[int]
    """Sampled tokens; ends with a stop token when `finish_reason == "stop"` (and has none before the end)."""
    logprobs: list[float]
    """Per token: log_softmax(logits / T)[token], the policy's logprob, not perturbed by the noise."""
    finish_reason: Literal["stop", "length"]
    """"stop": a stop token was sampled; "length": max_tokens (or the model length) was reached first."""
    proof: str | None = None
    """Activation proof (`protocol.proofs`, base64) over the hidden states that chose each token; None when the
    engine was configured without proofs, or the request asked for its states."""
    states: object | None = None
    """With proofs on and `GenerationRequest.keep_states`: the states [n_tokens, hidden] (a CPU float tensor) that
    chose each token, for `node.proof.build_proofs`."""
    interrupted: bool = False
    """`generate_until` stopped it before it ended (`finish_reason` then means nothing): its tokens so far are what
    `generate` would have sampled, and it may be continued from them."""


class EngineConfig(BaseModel):
    """How a node builds its inference engine. Sampling itself is fixed by the protocol, not by this."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["auto", "vllm", "torch"] = Field(
        "auto", description="Engine implementation; 'auto' picks vLLM when it is installed, else torch.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and activations dtype. float32 on CPU (no fast bf16 there, and replay "
                               "margins are sized for fp32); bf16 is allowed on GPUs but needs a wider "
                               "verifier tie margin.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model runs; 'auto' is cuda when torch sees a GPU, else cpu.")
    max_model_len: int | None = Field(
        None, gt=1, description="Longest prompt + completion in tokens; None: the checkpoint's "
                                "max_position_embeddings (what the verifier assumes), and never more than that. "
                                "Completions that reach it end with 'length': keep it >= the pool's prompt + "
                                "max_tokens, or such completions are rejected as cut short. Sizes vLLM's KV "
                                "cache needs (at least one sequence of this length must fit in kv_cache_gib).")
    kv_cache_gib: float = Field(
        1.0, gt=0, description="KV-cache size in GiB (vLLM on CPU: VLLM_CPU_KVCACHE_SPACE; on GPU: "
                               "kv_cache_memory_bytes unless gpu_memory_utilization is set).")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vLLM on GPU: fraction of GPU memory to use; None sizes the KV cache "
                                      "from kv_cache_gib instead.")
    enforce_eager: bool = Field(
        True, description="vLLM: no CUDA graphs / torch.compile (fast start; required for the tiny CPU model).")
    max_num_seqs: int = Field(256, gt=0, description="vLLM: most sequences decoded in one step.")
    max_num_batched_tokens: int = Field(
        16384, gt=0, description="vLLM: tokens per scheduler step. Kept large so that prefills are never "
                                 "chunked (vLLM's CPU path crashes on seeded chunked prefill).")
    enable_prefix_caching: bool = Field(
        True, description="vLLM: share the KV cache of a prompt among the rollouts of one group.")
    block_size: int | None = Field(
        None, gt=0, description="vLLM: KV-cache block size in tokens; None keeps vLLM's default (128 on CPU, "
                                "16 on GPU). Prefix caching shares only full blocks.")
    torch_batch_size: int = Field(64, gt=0, description="torch engine: requests decoded together.")
    proofs: bool = Field(
        True, description="Build an activation proof per completion (protocol.proofs) from the final hidden states "
                          "of generation itself; verifiers may reject groups without one.")
    staged_reload: bool = Field(
        True, description="vLLM on the CPU: prepare each new version in a second copy of the model while the engine "
                          "generates with the old one, then swap it in between two decode steps (about a "
                          "millisecond; vLLM's in-place reload stops the engine for tens). Costs up to two more "
                          "copies of the weights (1.6 measured after a load, bench/staged_memory.py). Used where it "
                          "is exact: unquantized "
                          "models whose layers it handles, in this process; elsewhere, and on GPUs, vLLM's "
                          "in-place reload (logged).")
    num_threads: int | None = Field(
        None, gt=0, description="torch intra-op threads for this process; None leaves the current setting.")


class InferenceEngine(ABC):
    """Samples rollouts from one checkpoint with the protocol's replayable rule.

    Promises, for every engine: for request r and completion position i, `token_ids[i]` is
    `protocol.sampling.sample(logits_i, seed=r.seed, position=i, temperature)` where `logits_i` are the model's
    logits after prompt + token_ids[:i] (up to floating-point error; a verifier allows near-ties), and
    `logprobs[i]` is log_softmax(logits_i / T)[token_ids[i]]. The result does not depend on which other
    requests share the batch.
    """

    name: str
    temperature: float

    def __init__(self, cfg: EngineConfig, temperature: float) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.cfg = cfg
        self.temperature = float(temperature)
        """The temperature of requests that do not name one."""
        self.stop_ids: frozenset[int] = frozenset()
        """The tokens that end a completion (set by `load`)."""
        self.eos_id: int | None = None
        """One of them (the smallest id), e.g. for a prompt that is always valid."""
        self.max_model_len: int = cfg.max_model_len or 0

    @abstractmethod
    def load(self, ckpt_dir: Path) -> None:
        """Load a checkpoint: the first one, or new weights of the same architecture and tokenizer in place.
        After it returns, every `generate` samples from the new weights."""

    def prepare(self, ckpt_dir: Path) -> None:
        """Ready `ckpt_dir` (new weights of the loaded architecture) so that a later `load` of it is quick; may run on
        another thread while the engine generates. Raises where the checkpoint cannot be loaded. Here: nothing (an
        engine that loads in one go; the vLLM engine on the CPU stages its versions)."""
        return None

    def prepared(self, ckpt_dir: Path) -> bool:
        """Whether `load(ckpt_dir)` would be quick (it was prepared, or the engine prepares nothing). Cheap: asked
        between decode steps."""
        return True

    @abstractmethod
    def generate(self, requests: list[GenerationRequest], max_tokens: int) -> list[Completion]:
        """One completion per request, in request order. Stops at a stop token (included, "stop") or after
        `max_tokens` tokens / at `max_model_len` in total ("length")."""

    def generate_until(self, requests: list[GenerationRequest], max_tokens: int, interrupt: Callable[[], bool],
                       every: int = 1, swap: Callable[[int], bool] | None = None) -> list[Completion]:
        """`generate`, asking `interrupt()` every `every` decode steps: once it answers True, the completions still
        going stop there, `interrupted`. Here: `generate` in chunks of `every` tokens, each continued from the tokens
        so far at their completion position (engines that can stop their decode loop do so instead).

        `swap` (optional): an engine that can change its weights without stopping (vLLM in this process) calls `swap(n)`
        instead of stopping when every completion still going has `n` tokens; it loads the new weights and answers
        whether it did. The completions then go on in this call, recomputed from their prompt and tokens so far
        with the new weights, so that token `n` on is sampled with them: what stopping and continuing computes,
        without the stop. Engines that cannot (this one) ignore it and stop."""
        done: list[Completion | None] = [None] * len(requests)
        tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        states: list[list] = [[] for _ in requests]
        live = list(range(len(requests)))
        at = 0
        while live:
            n = min(every, max_tokens - at)
            chunk = [replace(requests[i], prompt_ids=list(requests[i].prompt_ids) + tokens[i],
                             position=requests[i].position + at, keep_states=self.cfg.proofs) for i in live]
            for i, c in zip(live, self.generate(chunk, max_tokens=n), strict=True):
                tokens[i] += c.token_ids
                logprobs[i] += c.logprobs
                if c.states is not None:
                    states[i].append(c.states)
                if c.finish_reason == "stop" or len(tokens[i]) >= max_tokens or len(c.token_ids) < n:
                    done[i] = Completion(tokens[i], logprobs[i], c.finish_reason)
            at += n
            live = [i for i in live if done[i] is None]
            if live and interrupt():
                for i in live:
                    done[i] = Completion(tokens[i], logprobs[i], "length", interrupted=True)
                break
        out = [c for c in done if c is not None]
        if self.cfg.proofs:
            import torch

            self._attach_proofs(requests, out, [torch.cat(s) if s else torch.zeros(0, 0) for s in states])
        return out

    @abstractmethod
    def close(self) -> None:
        """Release the model and its caches; the engine cannot be used afterwards."""

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _attach_proofs(requests: list[GenerationRequest], completions: list[Completion], states: list) -> None:
        """Each completion's proof from its captured states [n_tokens, hidden] (or the states themselves, where the
        request keeps them); raises when capture failed, since a completion without a valid proof would be rejected
        anyway."""
        from swarmrl.node.proof import build_proofs

        for s, c in zip(states, completions, strict=True):
            if s is None or s.shape[0] != len(c.token_ids):
                got = None if s is None else tuple(s.shape)
                raise RuntimeError(f"hidden-state capture incomplete: got {got} for {len(c.token_ids)} tokens")
        proving = [i for i, r in enumerate(requests) if not r.keep_states]
        for i, proof in zip(proving, build_proofs([states[i] for i in proving]) if proving else [], strict=True):
            completions[i].proof = proof
        for i, r in enumerate(requests):
            if r.keep_states:
                completions[i].states = states[i]

    def _temperature(self, request: GenerationRequest) -> float:
        """The request's temperature (checked), or the engine's default."""
        t = self.temperature if request.temperature is None else float(request.temperature)
        if not t > 0:
            raise ValueError(f"temperature must be > 0, got {request.temperature}")
        return t

    def _set_checkpoint_meta(self, ckpt_dir: Path) -> None:
        """Stop tokens and the length limit of the checkpoint about to be loaded."""
        self.stop_ids, max_pos = read_checkpoint_meta(ckpt_dir)
        self.eos_id = min(self.stop_ids)
        self.max_model_len = min(self.cfg.max_model_len or max_pos, max_pos)

    def _token_budget(self, request: GenerationRequest, max_tokens: int) -> int:
        """Completion tokens this request may take: max_tokens, capped so the total fits max_model_len.
        Both engines use it, so they stop at the same place."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        room = self.max_model_len - len(request.prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens leaves no room in max_model_len "
                             f"{self.max_model_len}")
        return min(max_tokens, room)


def read_checkpoint_meta(ckpt_dir: Path) -> tuple[frozenset[int], int]:
    """(stop token ids, max_position_embeddings) of an HF checkpoint."""
    from swarmrl.models.prompts import stop_token_ids
    from swarmrl.models.weights import model_facts

    return stop_token_ids(ckpt_dir), model_facts(ckpt_dir).max_positions


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
