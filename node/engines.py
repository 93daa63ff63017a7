"""Choosing and building a node's inference engine (vLLM when it is installed, else the torch engine).

Kept apart from `node.engine`, the interface both engines implement, so that the interface imports neither.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from swarmrl.node.engine import EngineConfig, InferenceEngine


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
    engine.warmup()
    return engine
