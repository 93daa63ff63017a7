"""Double-buffered weight updates for the vLLM engine on the CPU (`EngineConfig.staged_reload`).

vLLM's in-place reload (`reload_weights`) stops the engine for its whole run: its layer-by-layer reload machinery and
the re-packing of every linear layer's oneDNN weights (vLLM's CPU linear layers keep only that packed copy). Here the
new version is PREPARED while the engine goes on generating with the old one, and then COMMITTED between two decode
steps by swapping references:

- a second ("shadow") instance of the live model's class, built once at start with another `prefix` (so its
  attention layers get names of their own in vLLM's static forward context, from which they are removed again: the
  shadow is never run), holds the weights being prepared. `prepare` loads a checkpoint into it with the model's own
  `load_weights` (vLLM's name mapping, fused qkv and gate_up), and packs each linear-like layer with vLLM's own
  `dispatch_cpu_unquantized_gemm` on a throw-away module, so nothing the live model's forward reads is touched;
- `commit` swaps, per layer, the packed GEMM (`cpu_linear`, which holds its own copy of the weights) and, for every
  weight the live model still reads as a tensor (embeddings, norms, biases, an untied or tied lm_head), the tensors
  of the live and the shadow Parameter. The shadow then holds the old version's tensors, and the next `prepare`
  writes those, never a live one.

The model then computes exactly what a fresh load of that checkpoint computes: the same loader, the same packing
(tests/test_vllm_staged_reload.py compares completions and logprobs against a fresh engine). A tied lm_head gets its
own packed GEMM from the new (shared) weight, which vLLM's reload leaves stale.

`prepare` only builds packed GEMMs, it never runs one: vLLM's oneDNN GEMMs share one scratchpad per process, and a
GEMM run on another thread while the engine decoded corrupted the engine's results (NaN logprobs, in 8 of 15 tries).

Memory: the shadow keeps a second copy of the tensors the live model reads directly (embeddings, lm_head, norms,
biases); the linear layers' packed weights exist twice from `prepare` until the next `prepare` frees the version
committed away (off the engine's thread); while `prepare` runs, the shadow also holds its linear weights unpacked,
freed once packed. In all up to two more copies of the weights: bench/staged_memory.py measured 1.6 more
after a load than vLLM's in-place reload (bench/RESULTS.md).

Only what is handled is staged: a model with any layer other than vLLM's unquantized linear and embedding layers and
parameter-only modules (norms), or not on the CPU, is refused (`StagingUnsupported`, naming the layers), and the engine
reloads in place instead. On CUDA the engine keeps vLLM's in-place reload (graph-safe, since it writes the captured
tensors in place); it is not staged here.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SHADOW_PREFIX = "swarmrl_shadow"
"""The prefix of the shadow model's layer names (vLLM's static forward context is keyed by them)."""


class StagingUnsupported(ValueError):
    """The model has layers the staged reload does not handle; the engine reloads in place instead."""


@dataclass
class _Layer:
    """A linear-like layer: the live one computes with its packed `cpu_linear`."""

    name: str
    live: torch.nn.Module
    shadow: torch.nn.Module
    shape: torch.Size
    packed_only: bool
    """The live layer keeps only the packed copy (vLLM removed its weight): the shadow's weight is needed only while
    a version is loaded and packed, and is freed in between."""
    plain: bool = False
    """vLLM gave this layer plain `F.linear` (no packing): it reads its weight tensor, which is swapped."""


@dataclass
class _Prepared:
    key: Path
    gemms: list[Any] = field(default_factory=list)


def unsupported_layers(model: torch.nn.Module) -> list[str]:
    """The names (with their class) of the modules of `model` whose weights a commit could not swap: every module with
    parameters must be one of vLLM's unquantized linear or embedding layers on the CPU, or hold nothing but
    parameters (a norm) that its forward reads as they are."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    bad = []
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        method = getattr(module, "quant_method", None)
        if any(p.device.type != "cpu" for p in params):
            bad.append(f"{name} ({type(module).__name__}, not on the CPU)")
        elif method is None:
            if hasattr(module, "process_weights_after_loading"):  # derives state from its weights at load time
                bad.append(f"{name} ({type(module).__name__})")
        elif type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod) or \
                not hasattr(module, "cpu_linear"):
            bad.append(f"{name} ({type(module).__name__}, {type(method).__name__})")
    return bad


class StagedWeights:
    """The shadow model of a live vLLM model, and the version prepared in it. `prepare` may run on any thread, while
    the engine generates; `commit` runs on the engine's thread between two steps. They exclude each other."""

    def __init__(self, live: torch.nn.Module, vllm_config: Any) -> None:
        """Build the shadow (on the engine's thread, at start: model construction sets vLLM's current config, a
        global). Raises `StagingUnsupported` where the model has layers this does not handle."""
        bad = unsupported_layers(live)
        if bad:
            raise StagingUnsupported(f"layers the staged reload does not handle: {', '.join(bad[:8])}")
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.vllm_config, self.live = vllm_config, live
        context = vllm_config.compilation_config.static_forward_context
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            self.shadow = initialize_model(vllm_config, prefix=SHADOW_PREFIX, model_class=type(live))
        for name in [n for n in context if n.startswith(SHADOW_PREFIX + ".")]:
            del context[name]  # nothing else may see (or bind a KV cache to) the shadow's attention layers
        live_params = dict(live.named_parameters())
        shadow_params = dict(self.shadow.named_parameters())
        if live_params.keys() != shadow_params.keys():
            raise StagingUnsupported("the shadow model's parameters are not the live model's: "
                                     f"{sorted(live_params.keys() ^ shadow_params.keys())[:8]}")
        shadow_modules = dict(self.shadow.named_modules())
        self.layers = [_Layer(n, m, shadow_modules[n], shadow_modules[n].weight.shape, m.weight.numel() == 0,
                              plain=bool(getattr(m, "_cpu_skip_gemm_dispatch", False)))
                       for n, m in live.named_modules() if hasattr(m, "cpu_linear")]
        packed_only = {f"{layer.name}.weight" for layer in self.layers if layer.packed_only}
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        """(live, shadow) Parameters whose tensors a commit swaps: all but the packed-only linear weights."""
        for name, p in live_params.items():
            if name in packed_only:
                continue
            twin = shadow_params[name]
            if p.shape != twin.shape:
                raise StagingUnsupported(f"{name}: live shape {tuple(p.shape)}, shadow {tuple(twin.shape)}")
            self.pairs.append((p, twin))
        self.names = set(shadow_params)
        self._lock = threading.Lock()
        self._prepared: _Prepared | None = None
        self._retired: list[Any] = []  # the GEMMs committed away: freed by the next prepare, off the engine's thread
        self._free_packed_weights()
        self.closed = False

    def is_prepared(self, key: Path) -> bool:
        """Whether `key` is prepared, so that `commit(key)` swaps it in at once."""
        prepared = self._prepared
        return prepared is not None and prepared.key == key

    @torch.no_grad()
    def prepare(self, ckpt_dir: Path, key: Path) -> None:
        """Load `ckpt_dir` into the shadow and pack its GEMMs, under the name `key`; the live model is not touched.
        Replaces whatever was prepared. Raises where a weight was not loaded. Packs but never runs a GEMM: vLLM's
        oneDNN GEMMs are not safe to run on two threads at once."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.model_loader import get_model_loader

        with self._lock:
            if self.closed:
                raise RuntimeError("the engine is closed")
            self._prepared = None
            self._retired.clear()
            for layer in self.layers:
                if layer.packed_only:
                    layer.shadow.weight.data = torch.empty(layer.shape, dtype=layer.shadow.weight.dtype)
            model_config = copy.copy(self.vllm_config.model_config)  # the live config keeps naming its own path
            model_config.model, model_config.model_weights, model_config.revision = str(ckpt_dir), "", None
            load_config = copy.copy(self.vllm_config.load_config)
            load_config.use_tqdm_on_load = False
            loader = get_model_loader(load_config)
            loaded = self.shadow.load_weights(loader.get_all_weights(model_config, self.shadow))
            missing = self.names - set(loaded or ())
            if missing:  # the shadow's tensors hold an older version: a commit would compute with it
                self._free_packed_weights()
                raise RuntimeError(f"{ckpt_dir}: weights not loaded: {sorted(missing)[:8]}")
            prepared = _Prepared(key)
            for layer in self.layers:
                gemm = torch.nn.functional.linear
                if not layer.plain:
                    scratch = torch.nn.Module()  # vLLM's dispatch sets attributes on the layer it is given
                    scratch.weight = layer.shadow.weight
                    scratch.bias = getattr(layer.shadow, "bias", None)
                    dispatch_cpu_unquantized_gemm(scratch, remove_weight=False)
                    gemm = scratch.cpu_linear
                # Not run here: vLLM's oneDNN GEMMs are not safe to run on two threads at once (a GEMM on this
                # thread corrupted the engine's results); the engine checks its lm_head after the commit.
                prepared.gemms.append(gemm)
            self._free_packed_weights()
            self._prepared = prepared

    def commit(self, key: Path) -> bool:
        """Swap the version prepared as `key` into the live model (about a millisecond); False, touching nothing, when
        `key` is not what is prepared. Run between two decode steps: the next forward computes entirely with it."""
        with self._lock:
            prepared = self._prepared
            if prepared is None or prepared.key != key:
                return False
            for live, shadow in self.pairs:
                live.data, shadow.data = shadow.data, live.data
            for layer, gemm in zip(self.layers, prepared.gemms, strict=True):
                self._retired.append(layer.live.cpu_linear)
                layer.live.cpu_linear = gemm
            self._prepared = None
            return True

    def close(self) -> None:
        """Drop the shadow and what was prepared (waits for a `prepare` under way)."""
        with self._lock:
            self.closed = True
            self._prepared = None
            self._retired.clear()
            self.pairs, self.layers = [], []
            self.shadow = None  # type: ignore[assignment]

    def _free_packed_weights(self) -> None:
        for layer in self.layers:
            if layer.packed_only:
                layer.shadow.weight.data = torch.empty(0, dtype=layer.shadow.weight.dtype)
