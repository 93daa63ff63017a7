"""Reading a checkpoint's weights (Hugging Face layout: one or several *.safetensors files) into a model that
is already built, so a new policy version costs a file read and a copy, not a model construction.

Nodes (the torch engine) and the verifier load every published version this way.
"""

from __future__ import annotations

import json
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
