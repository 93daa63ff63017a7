"""The vLLM engine: in-process `vllm.LLM`, greedy decoding over the protocol's Gumbel-perturbed logits.

How the protocol's rule maps onto vLLM (measured on vLLM 0.32, see the field notes):
- `hf_overrides={"logit_scale": 1/T}`: the model's logits are z / T, so vLLM's raw logprobs (taken before
  logits processors, the default `logprobs_mode`) are the policy's log_softmax(z / T).
- every request runs at temperature 0 with its rollout seed in `extra_args`; `GumbelSamplingProcessor` adds
  the seeded noise so the greedy pick is the protocol's sample. One request per rollout (greedy refuses
  n > 1); prefix caching shares the prompt among a group's rollouts.
- activation proofs (`cfg.proofs`): each request also carries a capture key; the processor records the final
  hidden state of every sampling step (from a pre-hook on the model's `logits_processor`, installed with
  `apply_model`), and `generate` collects them with `apply_model(take_captured)` and builds the proof here.
  This is option (a) of the design notes: the states of the generation itself, no second pass.
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
from pathlib import Path

import torch

from swarmrl.models.weights import architecture_config
from swarmrl.node.engine import (
    Completion,
    EngineConfig,
    GenerationRequest,
    InferenceEngine,
    read_checkpoint_meta,
    resolve_device,
)

_GIB = 1 << 30


def _prepare_env() -> None:
    """Settings vLLM reads from the environment; must run before `import vllm`."""
    # In-process engine: starts in seconds instead of a minute, and lets the logits processor and weight
    # reloads run in this process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")



# Run inside vLLM's worker through `LLM.apply_model` (module-level so they pickle if ever out of process).

def _refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Rebuild the lm_head's GEMM from its (tied, already updated) weight: on the CPU this re-packs it."""
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and hasattr(lm_head, "quant_method"):
        lm_head.quant_method.process_weights_after_loading(lm_head)


@torch.no_grad()
def _lm_head_error(model: torch.nn.Module) -> float:
    """Relative error of the lm_head's actual GEMM against its weight Parameter, on random inputs: ~0 when the
    head computes with its current weights, ~1 when it uses a stale copy."""
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or not hasattr(lm_head, "quant_method"):
        return 0.0
    w = lm_head.weight
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w)
    got = lm_head.quant_method.apply(lm_head, x).float()
    want = (x @ w.t()).float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


class VLLMEngine(InferenceEngine):
    """vLLM `LLM` in this process. T is fixed at construction (it is baked into the model's logit scale)."""

    name = "vllm"

    def __init__(self, cfg: EngineConfig, temperature: float) -> None:
        super().__init__(cfg, temperature)
        self.device = resolve_device(cfg.device)
        self.llm = None
        self._ckpt: Path | None = None
        self._tied = False
        self._arch: dict | None = None
        self._proof_keys = itertools.count(1)

    # -- loading ---------------------------------------------------------------------------------------------

    def load(self, ckpt_dir: Path) -> None:
        """First call starts vLLM on `ckpt_dir`; later calls reload new weights in place (same architecture)."""
        ckpt_dir = Path(ckpt_dir).resolve()
        if self.llm is None:
            self._start(ckpt_dir)
        else:
            self._reload(ckpt_dir)
        self._ckpt = ckpt_dir

    def _start(self, ckpt_dir: Path) -> None:
        _prepare_env()
        from vllm import LLM
        from vllm.platforms import current_platform

        from swarmrl.node.gumbel_processor import GumbelSamplingProcessor

        platform = current_platform.device_type
        if platform != self.device:
            raise ValueError(f"EngineConfig.device is {self.device!r} but this vLLM build runs on {platform!r}")
        if self.device == "cpu" and self.cfg.dtype != "float32":
            # Works, but ran 8x slower (no native bf16 on these CPUs) and needs wider replay margins.
            raise ValueError("use dtype float32 for vLLM on the CPU")
        eos, max_pos = read_checkpoint_meta(ckpt_dir)
        self.eos_id = eos
        self.max_model_len = min(self.cfg.max_model_len, max_pos)
        self._arch = architecture_config(ckpt_dir)
        self._tied = bool(self._arch.get("tie_word_embeddings", False))
        memory: dict = {"kv_cache_memory_bytes": int(self.cfg.kv_cache_gib * _GIB)}
        if self.device == "cuda" and self.cfg.gpu_memory_utilization is not None:
            memory = {"gpu_memory_utilization": self.cfg.gpu_memory_utilization}
        if self.cfg.block_size is not None:
            memory["block_size"] = self.cfg.block_size
        self.llm = LLM(
            model=str(ckpt_dir),
            dtype=self.cfg.dtype,
            max_model_len=self.max_model_len,
            enforce_eager=self.cfg.enforce_eager,
            max_num_seqs=self.cfg.max_num_seqs,
            # Large enough that no prefill is ever chunked: seeded chunked prefill crashes vLLM's CPU path.
            max_num_batched_tokens=max(self.cfg.max_num_batched_tokens, self.max_model_len),
            enable_prefix_caching=self.cfg.enable_prefix_caching,
            logits_processors=[GumbelSamplingProcessor],
            hf_overrides={"logit_scale": 1.0 / self.temperature},
            # Ignore the checkpoint's generation_config: sampling is fixed by the protocol, not the model.
            generation_config="vllm",
            seed=0,
            disable_log_stats=True,
            **memory,
        )
        if self.cfg.proofs:
            from swarmrl.node.gumbel_processor import install_hidden_capture

            self.llm.apply_model(install_hidden_capture)

    def _reload(self, ckpt_dir: Path) -> None:
        """New weights into the running engine. Two things vLLM 0.32 leaves stale, both fixed here (and tested):
        - a tied lm_head: the checkpoint has no lm_head.weight, so vLLM's layerwise reload skips the layer
          ("ParallelLMHead: Failed to load weights"). Its Parameter is the embedding's and does get the new
          values, but on the CPU the GEMM runs from a packed copy made at load time, which keeps the old head;
        - the prefix cache: KV blocks computed with the old weights would be reused for equal prompts.
        """
        if architecture_config(ckpt_dir) != self._arch:
            raise ValueError(f"{ckpt_dir} has a different architecture than the loaded model; build a new engine")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt_dir)})
        if self._tied:
            self.llm.apply_model(_refresh_tied_lm_head)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")
        errors = self.llm.apply_model(_lm_head_error)
        if max(errors) > 1e-2:
            raise RuntimeError(f"lm_head does not compute with its weights after reload (rel. error {errors})")

    def close(self) -> None:
        if self.llm is None:
            return
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None),
                                                                 "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.llm = None
        gc.collect()

    # -- sampling --------------------------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest], max_tokens: int) -> list[Completion]:
        if self.llm is None:
            raise RuntimeError("no checkpoint loaded")
        if not requests:
            return []
        from vllm import SamplingParams, TokensPrompt

        from swarmrl.node.gumbel_processor import PROOF_KEY, SEED_KEY, take_captured

        keys = [next(self._proof_keys) for _ in requests] if self.cfg.proofs else [None] * len(requests)
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [
            SamplingParams(
                temperature=0.0,  # greedy over the perturbed logits = the protocol's sample
                max_tokens=self._token_budget(r, max_tokens),
                logprobs=0,  # the sampled token's raw logprob = log_softmax(z / T)
                stop_token_ids=[self.eos_id],
                detokenize=False,
                extra_args={SEED_KEY: int(r.seed)} | ({PROOF_KEY: key} if key is not None else {}),
            )
            for r, key in zip(requests, keys, strict=True)
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        completions = [self._completion(o.outputs[0]) for o in outputs]
        if self.cfg.proofs:
            states = self.llm.apply_model(functools.partial(take_captured, keys))[0]
            built = self._proofs([states.get(key) for key in keys], [len(c.token_ids) for c in completions])
            for c, proof in zip(completions, built, strict=True):
                c.proof = proof
        return completions

    def _completion(self, out) -> Completion:
        token_ids = list(out.token_ids)
        logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, out.logprobs, strict=True)]
        stopped = bool(token_ids) and token_ids[-1] == self.eos_id
        if stopped != (out.finish_reason == "stop"):
            raise RuntimeError(f"vLLM finish_reason {out.finish_reason!r} does not match tokens {token_ids}")
        return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason="stop" if stopped else "length")
