"""Choosing and building a node's inference engine (vLLM when it is installed, else the torch engine).

Kept apart from `node.engine`, the interface both engines implement, so that the interface imports neither.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from swarmrl.node.engine import EngineConfig, GenerationRequest, InferenceEngine


def vllm_available() -> bool:
    """Whether vllm is installed (cheap: does not import it, which takes 12-23 s)."""
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_kind(cfg: EngineConfig) -> str:
    """The engine `build_engine` will make: 'vllm' or 'torch'."""
    if cfg.kind == "auto":
        return "vllm" if vllm_available() else "torch"
    return cfg.kind


def build_engine(cfg: EngineConfig, ckpt_dir: Path, temperature: float) -> InferenceEngine:
    """An engine of `cfg.kind` with `ckpt_dir` loaded, sampling at `temperature`."""
    kind = resolve_engine_kind(cfg)
    engine: InferenceEngine
    if kind == "vllm":
        from swarmrl.node.vllm_engine import VLLMEngine

        engine = VLLMEngine(cfg, temperature)
    elif kind == "torch":
        from swarmrl.node.torch_engine import TorchEngine

        engine = TorchEngine(cfg, temperature)
    else:  # pragma: no cover - pydantic already restricts kind
        raise ValueError(f"unknown engine kind {kind!r}")
    engine.load(Path(ckpt_dir))
    warm_up(engine)
    return engine


def warm_up(engine: InferenceEngine) -> None:
    """Generate once with `engine`, two tokens from a one-token prompt, and discard the result. vLLM's first call
    costs seconds (3.2 s for the 0.86M model on the CPU). Paid here, it is not paid inside the first lease, whose
    clock is already running. (Here, not in `node.engine`'s base class, so that the base class is never the caller
    of the engine whose helpers it holds.)"""
    if engine.eos_id is None:
        raise RuntimeError("no checkpoint loaded")
    engine.generate([GenerationRequest(prompt_ids=[engine.eos_id], seed=0)], max_tokens=2)
