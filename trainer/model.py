"""The policy model as the trainer sees it: any Hugging Face causal LM checkpoint, loaded through the Auto classes.

Building and loading live in `swarmrl.models` (every role loads checkpoints the same way); the names the trainer,
its tests and the demo have always imported are these:

- `load_checkpoint(dir)`: (model, tokenizer) of a checkpoint directory, the checkpoint's own model class, fp32;
- `save_checkpoint(model, tokenizer, dir)`: what the trainer writes and publishes;
- `ModelConfig`, `build_model`, `build_tokenizer`: the randomly initialised models of `swarmrl model` (the
  default is the 0.86M-parameter Llama with the character tokenizer that learns addition).
"""

from __future__ import annotations

from swarmrl.models.build import ModelConfig, build_model, load_checkpoint, save_checkpoint
from swarmrl.models.tokenizers import ALPHABET, BOS, EOS, PAD, UNK
from swarmrl.models.tokenizers import build_char_tokenizer as build_tokenizer

__all__ = ["ALPHABET", "BOS", "EOS", "PAD", "UNK", "ModelConfig", "build_model", "build_tokenizer", "load_checkpoint",
           "save_checkpoint"]
