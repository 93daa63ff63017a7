"""The tiny policy model and its tokenizer, built locally in Hugging Face layout (no model hub).

A character tokenizer over the task's alphabet and a small Llama. The directory `save_checkpoint` writes
is an ordinary HF checkpoint: `transformers` and vLLM load it as is, which is what nodes and the
verifier do.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ALPHABET = "0123456789+="


@dataclass
class ModelConfig:
    """Shape of the policy model. The defaults are the 0.86M-parameter model that learns addition."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 384
    max_positions: int = 64
    seed: int = 0
    """Seed for the initial weights."""


def build_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character, `<s>` prepended to every encoded text, `</s>` ends a completion."""
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *alphabet])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False,
    )


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(cfg.seed)
    vocab = len(tokenizer)
    # vLLM's CPU attention needs a head size it supports (32, 64, ...): hidden/heads must be one.
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    return model


def save_checkpoint(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path,
                    meta: dict | None = None) -> Path:
    """Write an HF checkpoint (model.safetensors, config, tokenizer) to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if meta is not None:
        (out / "swarmrl.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return out


def load_checkpoint(ckpt_dir: str | Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    model = LlamaForCausalLM.from_pretrained(ckpt_dir, torch_dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(ckpt_dir)
    return model, tokenizer


def describe(cfg: ModelConfig) -> dict:
    return asdict(cfg)
