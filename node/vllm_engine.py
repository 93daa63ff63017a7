"""The vLLM engine: in-process `vllm.LLM`, greedy decoding over the protocol's Gumbel-perturbed logits.

How the protocol's rule maps onto vLLM (measured on vLLM 0.32, see the field notes):
- every request runs at temperature 0 with its rollout seed and temperature in `extra_args`;
  `GumbelSamplingProcessor` samples by the protocol's rule (z / T + seeded noise, on the logits' device) and
  leaves only that token for the greedy pick. The model itself is untouched: no `logit_scale` override, which
  Qwen2/Qwen3 model classes ignore. One request per rollout (greedy refuses n > 1); prefix caching shares the
  prompt among a group's rollouts; requests of one batch may have different temperatures.
- logprobs: the processor records log_softmax(z / T) of each sampled token; `generate` collects them with
  `apply_model(take_records)` (vLLM's own logprobs are not requested: they would be of z, not z / T).
- stops: `stop_token_ids` = every stop token of the checkpoint (`models.prompts.stop_token_ids`).
- activation proofs (`cfg.proofs`): the processor also records the final hidden state of every sampling step
  (from a pre-hook on the model's `logits_processor`, installed with `apply_model`), collected the same way; the
  proof is built here. This is option (a) of the design notes: the states of the generation itself.
- new weights (`load`): on the CPU, staged (`node.vllm_staging`, `EngineConfig.staged_reload`): `prepare` readies a
  version in a shadow model while the engine generates, `load` swaps it in between two steps; elsewhere vLLM's
  in-place reload (`_reload`).
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from swarmrl.models.weights import architecture_config, model_facts
from swarmrl.node.engine import Completion, EngineConfig, GenerationRequest, InferenceEngine, resolve_device

log = logging.getLogger("swarmrl.node")

_GIB = 1 << 30
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention accepts (0.32)."""


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
def _lm_head_error(model: torch.nn.Module, rows: int = 4) -> float:
    """Relative error of the lm_head's actual GEMM against its weight Parameter, on `rows` random inputs: ~0 when the
    head computes with its current weights, ~1 when it uses a stale copy."""
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or not hasattr(lm_head, "quant_method"):
        return 0.0
    w = lm_head.weight
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w)
    got = lm_head.quant_method.apply(lm_head, x).float()
    want = (x @ w.t()).float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def _model_and_config(worker: object) -> tuple[object, object]:
    """(the model, its vLLM config) of a worker (through `collective_rpc`; objects only in this process)."""
    worker = getattr(worker, "worker", worker)  # vLLM's wrapper around the worker
    return worker.get_model(), worker.vllm_config  # type: ignore[attr-defined]


class VLLMEngine(InferenceEngine):
    """vLLM `LLM` in this process; the temperature is per request (the engine's is the default)."""

    name = "vllm"

    def __init__(self, cfg: EngineConfig, temperature: float) -> None:
        super().__init__(cfg, temperature)
        self.device = resolve_device(cfg.device)
        self.llm = None
        self._ckpt: Path | None = None
        self._tied = False
        self._arch: dict | None = None
        self._capture_keys = itertools.count(1)
        self._staged = None  # node.vllm_staging.StagedWeights, when new versions are prepared before they load
        self._prepare_failed: Path | None = None
        self.last_prepare_s: float | None = None
        """Wall time of the last preparation of a version (`prepare`), and of the last commit (its swap, between two
        decode steps): for benchmarks."""
        self.last_commit_s: float | None = None
        self.last_reset_s: float | None = None  # after a commit: the prefix cache's reset, and the lm_head's check
        self.last_check_s: float | None = None

    # -- loading ---------------------------------------------------------------------------------------------

    def load(self, ckpt_dir: Path) -> None:
        """First call starts vLLM on `ckpt_dir`; later calls load new weights in place (same architecture): with
        `cfg.staged_reload` (where the model allows) by committing the version `prepare` prepared (preparing it
        first if it was not), else by vLLM's in-place reload."""
        key = Path(ckpt_dir)
        ckpt_dir = key.resolve()
        if self.llm is None:
            self._start(ckpt_dir)
        elif self._staged is not None:
            self._commit(key)
        else:
            self._reload(ckpt_dir)
        self._ckpt = ckpt_dir

    @property
    def staged(self) -> bool:
        """Whether new versions are staged (`node.vllm_staging`) rather than reloaded in place by vLLM."""
        return self._staged is not None

    def prepare(self, ckpt_dir: Path) -> None:
        """Prepare `ckpt_dir` for a quick `load` (`node.vllm_staging`), on any thread, while the engine generates
        with the weights it has; nothing to do where versions are not staged. Raises where the checkpoint cannot
        be loaded (the engine's `load` then raises too)."""
        staged, key = self._staged, Path(ckpt_dir)
        if staged is None:
            return
        try:
            resolved = key.resolve()
            if architecture_config(resolved) != self._arch:
                raise ValueError(f"{resolved} has a different architecture than the loaded model; build a new engine")
            t0 = time.perf_counter()
            staged.prepare(resolved, key)
            self.last_prepare_s = time.perf_counter() - t0
            self._prepare_failed = None
        except Exception:
            self._prepare_failed = key
            raise

    def prepared(self, ckpt_dir: Path) -> bool:
        """Whether `load(ckpt_dir)` would be quick: the version is prepared, or versions are not staged (or its
        preparation failed: `load` raises at once then). Cheap: asked between decode steps."""
        staged, key = self._staged, Path(ckpt_dir)
        return staged is None or staged.is_prepared(key) or key == self._prepare_failed

    def _commit(self, key: Path) -> None:
        """The staged load: the prepared version swapped in (prepared here first if it was not), and the prefix
        cache reset (its KV blocks were computed with the old weights). A tied lm_head gets its own packed GEMM of
        the new weights, checked here (`_lm_head_error`): no stale head as with `_reload`."""
        assert self._staged is not None
        t0 = time.perf_counter()
        if not self._staged.commit(key):
            self.prepare(key)
            t0 = time.perf_counter()
            if not self._staged.commit(key):
                raise RuntimeError(f"{key} was prepared but another version replaced it before the commit")
        t1 = time.perf_counter()
        self._reset_kv_cache()
        t2 = time.perf_counter()
        # One row: the cost of one sequence's logits, on this thread (the only one that may run the packed GEMMs).
        error = _lm_head_error(self._staged.live, rows=1)
        if error > 1e-2:
            raise RuntimeError(f"lm_head does not compute with its weights after the update (rel. error {error})")
        self.last_commit_s, self.last_reset_s, self.last_check_s = t1 - t0, t2 - t1, time.perf_counter() - t2

    def _reset_kv_cache(self) -> None:
        """After new weights: no KV computed with the old ones is used again. The prefix cache is emptied, and the
        requests running (an in-flight update, `generate_until`'s `swap`) are preempted by vLLM: they are
        scheduled again with their prompt and tokens so far prefilled with the new weights."""
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")

    def _stage(self) -> None:
        """Set up staged updates (`cfg.staged_reload`) where they are correct: in this process, on the CPU, for a
        model whose every layer `node.vllm_staging` handles; otherwise log why and reload in place."""
        if not self.cfg.staged_reload:
            return
        if self.device != "cpu":  # CUDA: vLLM's in-place reload writes the captured tensors in place (graph-safe)
            log.info("staged weight updates are for the CPU; vLLM on %s reloads in place", self.device)
            return
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            log.warning("vLLM's model is in another process: staged weight updates are off (in-place reload)")
            return
        from swarmrl.node.vllm_staging import StagedWeights, StagingUnsupported

        model, vllm_config = self.llm.collective_rpc(_model_and_config)[0]
        try:
            self._staged = StagedWeights(model, vllm_config)
        except StagingUnsupported as e:
            log.warning("staged weight updates are off for this model, vLLM reloads in place: %s", e)
            return
        _lm_head_error(model, rows=1)  # oneDNN builds its one-row GEMM now, not in the first commit

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
        self._set_checkpoint_meta(ckpt_dir)
        self._arch = architecture_config(ckpt_dir)
        facts = model_facts(ckpt_dir)
        if self.device == "cpu" and facts.head_size not in CPU_HEAD_SIZES:
            raise ValueError(f"head size {facts.head_size}: vLLM's CPU attention takes {CPU_HEAD_SIZES} only "
                             "(use the torch engine, or a model with such heads)")
        self._tied = facts.tied
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
            # Ignore the checkpoint's generation_config: sampling is fixed by the protocol, not the model.
            generation_config="vllm",
            seed=0,
            disable_log_stats=True,
            **memory,
        )
        if self.cfg.proofs:
            from swarmrl.node.gumbel_processor import install_hidden_capture

            self.llm.apply_model(install_hidden_capture)
        self._stage()

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
        self._reset_kv_cache()
        errors = self.llm.apply_model(_lm_head_error)
        if max(errors) > 1e-2:
            raise RuntimeError(f"lm_head does not compute with its weights after reload (rel. error {errors})")

    def close(self) -> None:
        if self._staged is not None:
            self._staged.close()
            self._staged = None
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
        keys, prompts, params = self._requests(requests, max_tokens)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        from swarmrl.node.gumbel_processor import take_records

        records = self.llm.apply_model(functools.partial(take_records, keys))[0]
        completions = [self._completion(o.outputs[0], records[key][0]) for o, key in zip(outputs, keys, strict=True)]
        if self.cfg.proofs:
            self._attach_proofs(requests, completions, [records[key][1] for key in keys])
        return completions

    def generate_until(self, requests: list[GenerationRequest], max_tokens: int, interrupt: Callable[[], bool],
                       every: int = 1, swap: Callable[[int], bool] | None = None) -> list[Completion]:
        """vLLM's own step loop, asking `interrupt()` every `every` engine steps. Once it says True: with `swap`, and
        every request still going running with as many tokens (`_even_progress`), `swap` loads the new weights and
        the requests go on in this call (`load` has vLLM preempt them: their KV cache is recomputed with the new
        weights, as in a continuation); otherwise the requests still going are aborted, and their tokens so far are
        read from the sampling processor's records."""
        if self.llm is None:
            raise RuntimeError("no checkpoint loaded")
        if not requests:
            return []
        from swarmrl.node.gumbel_processor import take_records, taken_tokens

        keys, prompts, params = self._requests(requests, max_tokens)
        internal = self.llm.enqueue(prompts, params, use_tqdm=False)
        # vLLM 0.32 hands back internal ids ("<id>-<suffix>"); outputs carry the request's own id.
        ids = [i.rsplit("-", 1)[0] for i in internal]
        engine = self.llm.llm_engine
        finished: dict[str, object] = {}
        steps, asking = 0, True
        try:
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        if o.request_id not in ids:
                            raise RuntimeError(f"vLLM output for request {o.request_id!r}, not one of {ids[:4]}...")
                        finished[o.request_id] = o
                steps += 1
                if asking and steps % every == 0 and len(finished) < len(ids) and interrupt():
                    n = None if swap is None else self._even_progress(len(ids) - len(finished))
                    if n is not None:
                        asking = swap(n)  # loaded: go on with the new weights; not: nothing more to wait for
                        continue
                    engine.abort_request([i for i, e in zip(internal, ids, strict=True) if e not in finished],
                                         internal=True)
                    asking = False
        except BaseException:  # a failed load or step: none of this call's requests is left in the engine
            engine.abort_request([i for i, e in zip(internal, ids, strict=True) if e not in finished], internal=True)
            raise
        records = self.llm.apply_model(functools.partial(take_records, keys))[0]
        tokens = self.llm.apply_model(functools.partial(taken_tokens, keys))[0]
        completions, states = [], []
        for rid, key in zip(ids, keys, strict=True):
            logprobs, st = records[key]
            if rid in finished:
                completions.append(self._completion(finished[rid].outputs[0], logprobs))  # type: ignore[attr-defined]
                states.append(st)
                continue
            # Stopped: the positions recorded so far (the last one may be cut off with the request); without all of
            # their states (proofs on) none of them, and the completion starts again.
            whole = st is not None or not self.cfg.proofs
            n = min(len(logprobs or []), len(tokens[key] or []), len(st) if st is not None else 1 << 30) if whole else 0
            completions.append(Completion((tokens[key] or [])[:n], (logprobs or [])[:n], "length", interrupted=True))
            states.append(st[:n] if st is not None else torch.zeros(0, 0))
        if self.cfg.proofs:
            self._attach_proofs(requests, completions, states)
        return completions

    def _even_progress(self, going: int) -> int | None:
        """The number of tokens each of the `going` requests still going has, where all of them run (none waits to
        start) with as many, vLLM's scheduler is in this process and schedules synchronously; else None (they
        are stopped instead: a span of a version starts at one token index in every rollout of a lease)."""
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)  # None: vLLM runs in another process
        scheduler = getattr(core, "scheduler", None)
        if scheduler is None or scheduler.scheduler_config.async_scheduling or len(scheduler.waiting) or \
                len(scheduler.running) != going:
            return None
        counts = {r.num_output_tokens for r in scheduler.running}
        return counts.pop() if len(counts) == 1 else None

    def _requests(self, requests: list[GenerationRequest], max_tokens: int) -> tuple[list[int], list, list]:
        """(capture keys, vLLM prompts, sampling params) of `requests`."""
        from vllm import SamplingParams, TokensPrompt

        from swarmrl.node.gumbel_processor import (
            CAPTURE_KEY,
            POSITION_KEY,
            SEED_KEY,
            STATES_KEY,
            TEMP_KEY,
        )

        keys = [next(self._capture_keys) for _ in requests]
        stops = sorted(self.stop_ids)
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [
            SamplingParams(
                temperature=0.0,  # greedy over the processor's pick = the protocol's sample
                max_tokens=self._token_budget(r, max_tokens),
                stop_token_ids=stops,
                detokenize=False,
                extra_args={SEED_KEY: int(r.seed), TEMP_KEY: self._temperature(r), CAPTURE_KEY: key,
                            STATES_KEY: self.cfg.proofs, POSITION_KEY: int(r.position)},
            )
            for r, key in zip(requests, keys, strict=True)
        ]
        return keys, prompts, params

    def _completion(self, out, logprobs: list[float] | None) -> Completion:
        token_ids = list(out.token_ids)
        if logprobs is None or len(logprobs) != len(token_ids):
            got = None if logprobs is None else len(logprobs)
            raise RuntimeError(f"logprob capture incomplete: {got} logprobs for {len(token_ids)} tokens")
        stopped = bool(token_ids) and token_ids[-1] in self.stop_ids
        if stopped != (out.finish_reason == "stop"):
            raise RuntimeError(f"vLLM finish_reason {out.finish_reason!r} does not match tokens {token_ids}")
        return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason="stop" if stopped else "length")
