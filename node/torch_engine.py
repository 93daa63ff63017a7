"""A plain transformers engine: batched decoding with left padding and a KV cache, sampled by the protocol rule.

The fallback when vLLM is not installed, and a second, independent implementation to check vLLM against.
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch

from swarmrl.models.build import load_causal_lm
from swarmrl.models.weights import architecture_config, load_weights_in_place
from swarmrl.node.engine import Completion, EngineConfig, GenerationRequest, InferenceEngine, resolve_device
from swarmrl.protocol import sampling


class TorchEngine(InferenceEngine):
    """transformers `AutoModelForCausalLM` with the engine's own decode loop.

    Requests are decoded together in batches of `cfg.torch_batch_size`, left-padded, with explicit position
    ids (so padding does not shift RoPE positions) and a KV cache; finished rows leave the batch. Each step
    samples every row with `protocol.sampling.sample_with_logprobs` on the model's device (temperature per row).

    With `cfg.proofs`, a forward pre-hook on the model's output embedding (its LM head) keeps the last position's
    input (the final hidden state the head turns into the step's logits) for the activation proof.
    """

    name = "torch"

    def __init__(self, cfg: EngineConfig, temperature: float) -> None:
        super().__init__(cfg, temperature)
        self.device = torch.device(resolve_device(cfg.device))
        self.dtype = getattr(torch, cfg.dtype)
        self.model: torch.nn.Module | None = None
        self._arch: dict | None = None
        self._pad_id = 0
        self._cache_kw = "past_key_values"
        self._last_state: torch.Tensor | None = None
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)

    def load(self, ckpt_dir: Path) -> None:
        """First call builds the model; later calls copy new weights into it in place (same architecture)."""
        ckpt_dir = Path(ckpt_dir)
        arch = architecture_config(ckpt_dir)
        if self.model is None:
            self._build(ckpt_dir)
            self._arch = arch
            return
        if arch != self._arch:
            raise ValueError(f"{ckpt_dir} has a different architecture than the loaded model; build a new engine")
        load_weights_in_place(self.model, ckpt_dir)

    def _build(self, ckpt_dir: Path) -> None:
        self._set_checkpoint_meta(ckpt_dir)
        model = load_causal_lm(ckpt_dir, self.dtype, self.device)
        self.model = model
        pad = model.config.pad_token_id
        self._pad_id = int(pad) if pad is not None else self.eos_id
        # transformers renamed `past_key_values` to `cache` in 5.2x: use whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
        if self.cfg.proofs:
            head = model.get_output_embeddings()
            if head is None:
                raise ValueError(f"{type(model).__name__} has no output embedding: cannot capture states for proofs")
            # The LM head's input is the final hidden state whatever the architecture calls its last norm (Llama's
            # model.norm, GPT-2's transformer.ln_f, OPT's decoder.final_layer_norm): what vLLM captures too.
            head.register_forward_pre_hook(self._keep_last_state)

    def _keep_last_state(self, _module: torch.nn.Module, args: tuple) -> None:
        self._last_state = args[0][:, -1, :].detach().float()

    def close(self) -> None:
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def generate(self, requests: list[GenerationRequest], max_tokens: int) -> list[Completion]:
        return self.generate_until(requests, max_tokens, lambda: False, every=1 << 30)

    def generate_until(self, requests: list[GenerationRequest], max_tokens: int, interrupt: Callable[[], bool],
                       every: int = 1, swap: Callable[[int], bool] | None = None) -> list[Completion]:
        """Stops the decode loop itself (it ignores `swap`): requests of a batch not yet started when `interrupt()`
        said True come back interrupted with no tokens."""
        if self.model is None:
            raise RuntimeError("no checkpoint loaded")
        budgets = [self._token_budget(r, max_tokens) for r in requests]
        out: list[Completion] = []
        bs = self.cfg.torch_batch_size
        for start in range(0, len(requests), bs):
            batch = requests[start:start + bs]
            if any(c.interrupted for c in out):
                out.extend(Completion([], [], "length", states=torch.zeros(0, 0) if r.keep_states else None,
                                      interrupted=True) for r in batch)
                continue
            out.extend(self._generate_batch(batch, budgets[start:start + bs], interrupt, every))
        return out

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: object | None) -> tuple[torch.Tensor, object]:
        """Last-position logits (float32, [B, vocab]) and the updated cache (and, with proofs, the last position's
        final hidden state in `self._last_state`)."""
        kwargs = {self._cache_kw: cache} if cache is not None else {}
        res = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **kwargs)
        new_cache = getattr(res, "past_key_values", None)
        if new_cache is None:
            new_cache = res.cache
        return res.logits[:, -1, :].float(), new_cache

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest], budgets: list[int], interrupt: Callable[[], bool],
                        every: int) -> list[Completion]:
        dev = self.device
        n = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((n, width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for b, r in enumerate(requests):
            ids[b, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[b, width - len(r.prompt_ids):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        # Positions count real tokens only, so a left-padded row sees the same RoPE positions as alone.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # Seeds and temperatures go to the model's device once: the noise is computed there, next to the logits.
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64).to(dev)
        temps = torch.tensor([self._temperature(r) for r in requests], dtype=torch.float64).to(dev)
        offsets = torch.tensor([r.position for r in requests], dtype=torch.int64).to(dev)

        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[Literal["stop", "length"]] = ["length"] * n
        stopped = [False] * n
        states: list[list[torch.Tensor]] = [[] for _ in range(n)]
        active = list(range(n))  # request index of each batch row
        logits, cache = self._forward(ids, mask, positions, None)
        next_pos = positions[:, -1:] + 1
        step = 0
        while active:
            rows = torch.tensor(active, dtype=torch.long, device=dev)
            rows_seeds = seeds[rows]
            picked, picked_lp_t = sampling.sample_with_logprobs(logits, rows_seeds, offsets[rows] + step, temps[rows])
            picked_lp = picked_lp_t.tolist()
            picked_list = picked.tolist()
            step_states = self._last_state.cpu() if self.cfg.proofs else None
            keep: list[int] = []
            for row, req in enumerate(active):
                if step_states is not None:
                    states[req].append(step_states[row])
                tok = int(picked_list[row])
                tokens[req].append(tok)
                logprobs[req].append(float(picked_lp[row]))
                if tok in self.stop_ids:
                    finish[req] = "stop"
                elif len(tokens[req]) < budgets[req]:
                    keep.append(row)
            step += 1
            if not keep:
                break
            if step % every == 0 and interrupt():
                for row in keep:
                    stopped[active[row]] = True
                break
            if len(keep) < len(active):
                # Finished rows leave the batch (and the cache), so later steps cost only live rows.
                idx = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(idx)
                mask, next_pos, picked = mask[idx], next_pos[idx], picked[idx]
                active = [active[row] for row in keep]
            step_ids = picked.view(-1, 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits, cache = self._forward(step_ids, mask, next_pos, cache)
            next_pos = next_pos + 1
        out = [Completion(token_ids=tokens[i], logprobs=logprobs[i], finish_reason=finish[i], interrupted=stopped[i])
               for i in range(n)]
        if self.cfg.proofs:
            self._attach_proofs(requests, out, [torch.stack(rows) for rows in states])
        return out
