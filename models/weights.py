"""Reading a checkpoint's weights (Hugging Face layout: one or several *.safetensors files) into a model that
is already built, so a new policy version costs a file read and a copy, not a model construction.

Nodes (the torch engine) and the verifier load every published version this way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

_NON_ARCH_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}
"""config.json keys that may change between checkpoints of one model without changing its architecture."""


def architecture_config(ckpt_dir: Path) -> dict:
    """A checkpoint's config.json without the keys that may differ between checkpoints of one architecture:
    equal dicts mean new weights can be loaded in place."""
    config = json.loads((Path(ckpt_dir) / "config.json").read_text())
    return {k: v for k, v in config.items() if k not in _NON_ARCH_KEYS}


@dataclass(frozen=True)
class ModelFacts:
    """What engines need to know of a checkpoint's shape, whatever the architecture names it."""

    hidden_size: int
    num_heads: int
    head_size: int
    tied: bool
    """The LM head is the input embedding (a checkpoint then stores no lm_head.weight)."""
    max_positions: int
    """max_position_embeddings: the longest prompt + completion."""


def model_facts(ckpt_dir: Path) -> ModelFacts:
    """`ModelFacts` read through transformers' config class, whose attribute map turns GPT-2's `n_embd`, `n_head`
    and `n_positions` into `hidden_size`, `num_attention_heads` and `max_position_embeddings`, and which fills in
    the defaults a saved config.json leaves out (Gemma2's and GPT-2's `tie_word_embeddings`)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt_dir)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
    head = getattr(cfg, "head_dim", None) or hidden // heads
    return ModelFacts(hidden_size=hidden, num_heads=heads, head_size=int(head),
                      tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                      max_positions=int(getattr(cfg, "max_position_embeddings", None) or 1 << 30))


def read_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint (single file or shards)."""
    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {ckpt_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_weights_in_place(model: torch.nn.Module, ckpt_dir: Path) -> None:
    """Copy the checkpoint's tensors into `model` (same architecture; the caller compares
    `architecture_config`). Raises ValueError when a tensor is missing or unexpected; a tied LM head, which
    checkpoints do not store, is the embedding and so is updated with it."""
    state = read_state_dict(ckpt_dir)
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(state, strict=False)
    # transformers 5 keeps `_tied_weights_keys` as a dict target -> source, 4.x as a list.
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    real_missing = [k for k in missing if k not in tied]
    if real_missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not fit the model: missing {real_missing}, "
                         f"unexpected {unexpected}")
