"""Randomly initialised causal LMs of a named architecture and size, in Hugging Face layout (no model hub).

    cfg = ModelConfig.preset("small30m", arch="qwen2")
    tok = build_bpe_tokenizer(8192)
    save_checkpoint(build_model(cfg, tok), tok, "ckpt/")        # what `swarmrl model` does
    model = load_causal_lm("ckpt/", torch.float32, "cpu")         # every role loads it this way

Architectures (`ARCHS`): llama, qwen2 (q/k/v projections with biases), qwen3 (RMS norms on q and k, explicit
head_dim), mistral, phi3 (fused projections), gemma2 (tied embeddings, logit and attention softcapping, logits
scaled to a realistic spread), gpt2 and opt (learned positions, LayerNorms, biases, no GQA). Adding one is an
entry there: the transformers `model_type` and what makes it differ from llama.
A checkpoint is loaded through the Auto classes from its config.json, so the class is the checkpoint's own
(a Qwen2 checkpoint loaded as Llama would silently drop its biases).

Weights are random: `seed` fixes them. Parameters that transformers initialises to a constant (Qwen2's q/k/v
biases are zeros, Qwen3's q/k norm weights ones) are drawn at random too, so that a loader that dropped them
would change the model's outputs (tests/test_models.py checks that it does not). `stop_rate` optionally makes
the stop tokens about that likely per token, so that random models end completions at chosen average lengths.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.models.head import decoder_of, head_of
from swarmrl.models.prompts import load_tokenizer, render_prompt
from swarmrl.models.tokenizers import tokenizer_stop_ids


@dataclass(frozen=True)
class ArchSpec:
    """What `build_model` needs to know about an architecture."""

    model_type: str
    """transformers' `model_type` (AutoConfig.for_model)."""
    random_init: tuple[str, ...] = ()
    """Name suffixes of parameters initialised to a constant by transformers, drawn at random here instead."""
    extra: tuple[tuple[str, Any], ...] = ()
    """Config fields specific to the architecture; a callable value is called with the ModelConfig."""
    names: tuple[tuple[str, str], ...] = ()
    """Generic config fields this architecture names otherwise (GPT-2's n_inner for intermediate_size); the
    ones transformers maps itself (its config's attribute_map: n_embd, n_head, ...) need no entry."""
    absent: tuple[str, ...] = ()
    """Generic config fields the architecture does not have (not written to its config)."""
    gqa: bool = True
    """Whether it has fewer key/value heads than query heads and a free head size; without, num_kv_heads and
    head_dim are ignored (every head is hidden_size / num_heads wide)."""
    logit_std: float | None = None
    """The default `ModelConfig.logit_std`."""


_NO_GQA = ("num_key_value_heads", "head_dim", "rope_theta")
ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", extra=(("attention_bias", False), ("mlp_bias", False))),
    "qwen2": ArchSpec("qwen2", random_init=("q_proj.bias", "k_proj.bias", "v_proj.bias"),
                      extra=(("use_sliding_window", False),)),
    "qwen3": ArchSpec("qwen3", random_init=("q_norm.weight", "k_norm.weight"),
                      extra=(("attention_bias", False), ("use_sliding_window", False))),
    "mistral": ArchSpec("mistral", extra=(("sliding_window", None),)),
    "phi3": ArchSpec("phi3", extra=(("sliding_window", None),)),
    # Tied embeddings, final logit softcapping (30) and attention softcapping (50) are Gemma2's defaults; its
    # logits are scaled to a realistic spread, where a verifier that skipped the softcapping would be far off.
    "gemma2": ArchSpec("gemma2", extra=(("query_pre_attn_scalar", lambda c: c.head_size),),
                       logit_std=4.0),
    "gpt2": ArchSpec("gpt2", random_init=("ln_1.weight", "ln_2.weight", "ln_f.weight", "bias"),
                     names=(("intermediate_size", "n_inner"), ("rms_norm_eps", "layer_norm_epsilon")),
                     absent=_NO_GQA, gqa=False),
    "opt": ArchSpec("opt", random_init=("layer_norm.weight", "bias"), names=(("intermediate_size", "ffn_dim"),),
                    absent=(*_NO_GQA, "rms_norm_eps"),
                    extra=(("word_embed_proj_dim", lambda c: c.hidden_size), ("do_layer_norm_before", True)),
                    gqa=False),
}


class ModelConfig(BaseModel):
    """Architecture and size of a model to build. The defaults are the 0.86M-parameter Llama that learns
    3-digit addition with the character tokenizer (the `tiny` preset)."""

    model_config = ConfigDict(extra="forbid")

    arch: str = Field("llama", description=f"Architecture, one of {sorted(ARCHS)}.")
    hidden_size: int = Field(128, gt=0, description="Width of the residual stream.")
    num_layers: int = Field(4, gt=0, description="Decoder layers.")
    num_heads: int = Field(4, gt=0, description="Attention (query) heads.")
    num_kv_heads: int | None = Field(None, gt=0, description="Key/value heads (GQA); None: num_heads.")
    head_dim: int | None = Field(None, gt=0, description="Size of one head; None: hidden_size / num_heads. vLLM's "
                                                         "CPU attention takes 32, 64, 80, 96, 112, 128, ... only.")
    intermediate_size: int = Field(384, gt=0, description="Width of the MLP.")
    max_positions: int = Field(64, gt=1, description="max_position_embeddings: longest prompt + completion.")
    vocab_size: int | None = Field(None, gt=0, description="Embedding rows; None: the tokenizer's size. Larger pads "
                                                           "the vocabulary, as Qwen's 151936 rows for 151665 tokens.")
    tie_embeddings: bool = Field(True, description="Share the input embedding and the LM head (not with stop_rate).")
    rms_norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    stop_rate: float | None = Field(None, gt=0, lt=1, description="Make the stop tokens together about this "
                                    "likely per token, roughly (calibrated on a few prompts; others can be a few "
                                    "times off), for random models; None leaves the initialisation. Unties the "
                                    "LM head, so that the stop tokens' input embeddings stay as initialised.")
    logit_std: float | None = Field(None, gt=0, description="Scale the final norm's output so that the logits' "
                                    "standard deviation over the vocabulary is about this; None: the architecture's "
                                    "default (gemma2: 4, others: as initialised, about 0.2).")
    seed: int = Field(0, description="Seed of the initial weights.")

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; known: {sorted(ARCHS)}")
        if (self.head_dim is None or not ARCHS[self.arch].gqa) and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"head size {self.head_size} must be even (RoPE)")
        return self

    @property
    def kv_heads(self) -> int:
        return (self.num_kv_heads or self.num_heads) if ARCHS[self.arch].gqa else self.num_heads

    @property
    def head_size(self) -> int:
        return (self.head_dim or self.hidden_size // self.num_heads) if ARCHS[self.arch].gqa else \
            self.hidden_size // self.num_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named size (`PRESETS`) with some fields overridden (e.g. arch)."""
        if name not in PRESETS:
            raise ValueError(f"unknown size {name!r}; known: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # The addition demo's model: 0.86M parameters with the 16-token character tokenizer.
    "tiny": {},
    # Small and fast for tests of every architecture: 4 heads of 32, GQA, 512 positions (~0.9M with 2048 tokens).
    "mini": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 384,
             "max_positions": 512},
    # About 30M parameters with an 8192-token BPE (25.2M in the layers, 4.2M tied embedding): heads of 64, GQA.
    "small30m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536,
                 "max_positions": 1024},
}


def hf_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> Any:
    """The transformers config of `cfg` for `tokenizer` (vocabulary and special token ids)."""
    vocab = cfg.vocab_size or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    spec = ARCHS[cfg.arch]
    fields = dict(
        vocab_size=vocab,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size,
        max_position_embeddings=cfg.max_positions,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings and cfg.stop_rate is None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    names = dict(spec.names)
    fields = {names.get(k, k): v for k, v in fields.items() if k not in spec.absent}
    fields.update({k: v(cfg) if callable(v) else v for k, v in spec.extra})
    return AutoConfig.for_model(spec.model_type, torch_dtype="float32", **fields)


@torch.no_grad()
def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A randomly initialised causal LM of `cfg` for `tokenizer`, float32. Its generation config
    names every stop token of the tokenizer (`tokenizer_stop_ids`), so that `generate` stops at any of them."""
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_config(cfg, tokenizer))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    for name, p in model.named_parameters():
        if name.endswith(ARCHS[cfg.arch].random_init):
            # Biases around 0, norm weights around 1, with spreads that change the outputs clearly.
            base = 1.0 if name.endswith("weight") else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    stops = tokenizer_stop_ids(tokenizer)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=stops if len(stops) > 1 else stops[0])
    logit_std = cfg.logit_std if cfg.logit_std is not None else ARCHS[cfg.arch].logit_std
    model.eval()  # measured without dropout (GPT-2 and OPT have some), as every role runs the model
    if logit_std is not None:
        _scale_logits(model, logit_std, gen)
    if cfg.stop_rate is not None:
        _set_stop_rate(model, tokenizer, stops, cfg.stop_rate, gen)
    return model.train()  # as transformers hands out a new model


def logit_spread(model: PreTrainedModel, gen: torch.Generator) -> float:
    """Mean standard deviation over the vocabulary of the model's logits (its own forward, post-processing
    included), on random token sequences."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (8, 16), generator=gen)
    return float(model(input_ids=ids).logits.float().std(dim=-1).mean())


def _scale_logits(model: PreTrainedModel, target: float, gen: torch.Generator) -> None:
    """Scale the final norm's output (the LM head's input) until the logits' spread is about `target`. A few
    rounds: the logits are about linear in the scale, softcapping bends them. Not the embedding: in a tied model
    that would scale the residual stream's token embedding too, and every position would predict its own token."""
    norm = _final_norm(model, gen)
    for _ in range(4):
        _scale_norm(model, norm, target / max(logit_spread(model, gen), 1e-6), gen)


def _final_norm(model: PreTrainedModel, gen: torch.Generator) -> torch.nn.Module:
    """The last module with a 1-D weight whose output is the decoder's output (Llama's model.norm, GPT-2's
    transformer.ln_f, OPT's decoder.final_layer_norm), found by running the decoder once."""
    decoder = decoder_of(model)
    ran: list[tuple[torch.nn.Module, Any]] = []
    hooks = [mod.register_forward_hook(lambda mod, _args, out: ran.append((mod, out)))
             for mod in decoder.modules() if isinstance(getattr(mod, "weight", None), torch.nn.Parameter)
             and mod.weight.ndim == 1]
    try:
        ids = torch.randint(0, model.get_output_embeddings().weight.shape[0], (2, 8), generator=gen)
        last = decoder(input_ids=ids).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    for mod, out in reversed(ran):
        if isinstance(out, torch.Tensor) and out.shape == last.shape and torch.equal(out, last):
            return mod
    raise ValueError(f"{type(model).__name__}: no final norm found to scale the logits with")


def _scale_norm(model: PreTrainedModel, norm: torch.nn.Module, scale: float, gen: torch.Generator) -> None:
    """Make `norm`'s output `scale` times larger: weight (and bias) times `scale`, or for norms that multiply by
    1 + weight (Gemma's) the weight moved accordingly; whichever is checked to do it, else ValueError."""
    decoder = decoder_of(model)
    ids = torch.randint(0, model.get_output_embeddings().weight.shape[0], (2, 8), generator=gen)
    before = decoder(input_ids=ids).last_hidden_state
    params = [p for p in (norm.weight, getattr(norm, "bias", None)) if isinstance(p, torch.nn.Parameter)]
    saved = [p.detach().clone() for p in params]
    for offset in (0.0, 1.0):
        for p, old in zip(params, saved, strict=True):
            base = offset if p is norm.weight else 0.0
            p.copy_((old + base) * scale - base)
        after = decoder(input_ids=ids).last_hidden_state
        if torch.allclose(after, before * scale, rtol=1e-4, atol=1e-5 * scale):
            return
        for p, old in zip(params, saved, strict=True):
            p.copy_(old)
    raise ValueError(f"{type(norm).__name__}: cannot scale its output by changing its weights")


def _set_stop_rate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, stops: list[int], rate: float,
                   gen: torch.Generator) -> None:
    """Point the stop tokens' output embeddings along the mean final hidden state, scaled (by bisection) so that
    they together have a mean probability of `rate` per completion token: measured on prompts rendered as every
    role renders them (`render_prompt`), each followed by random tokens standing in for a completion."""
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    ordinary = [i for i in range(len(tokenizer)) if i not in set(stops)]
    completion = 24
    rows, where = [], []
    for k in range(64):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        text = f"{a}+{b}=" if k % 2 else f"What is {a} plus {b}? Answer briefly."
        prompt = render_prompt(tokenizer, text)
        rows.append(prompt + [rng.choice(ordinary) for _ in range(completion)])
        where.append(len(prompt) - 1)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows])  # right padding: causal, never attended
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    states = torch.stack([hidden[i, w:w + completion] for i, w in enumerate(where)])  # [64, completion, hidden]
    # The direction from one half, the scale from the other: a mean taken over the very states it is measured on
    # points at them in particular (each state is part of it), and the rate would come out too high elsewhere.
    mean = states[:32].reshape(-1, states.shape[-1]).mean(0)
    held_out = states[32:].reshape(-1, states.shape[-1])
    direction = mean / mean.norm() ** 2
    head = model.get_output_embeddings()
    logits_of = head_of(model)  # the model's own logits (Gemma2's softcapping included)

    def stop_rate(scale: float) -> float:
        for s in stops:
            head.weight[s] = scale * direction
        return float(torch.softmax(logits_of(held_out).float(), dim=-1)[:, stops].sum(-1).mean())

    lo, hi = -60.0, 60.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stop_rate(mid) < rate else (lo, mid)
    stop_rate((lo + hi) / 2)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path,
                    meta: dict | None = None) -> Path:
    """Write an HF checkpoint (model.safetensors, config, generation config, tokenizer with its chat template) to
    `out_dir`; `meta` goes to swarmrl.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if meta is not None:
        (out / "swarmrl.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return out


def load_causal_lm(ckpt_dir: str | Path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
                   ) -> PreTrainedModel:
    """The checkpoint's own model class (Auto classes, from its config.json) in `dtype` on `device`, eval mode.
    What every role uses: the trainer, the torch engine and the verifier."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=dtype)
    return model.to(device).eval()


def load_checkpoint(ckpt_dir: str | Path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
                    ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(`load_causal_lm`, `load_tokenizer`) of a checkpoint directory."""
    return load_causal_lm(ckpt_dir, dtype, device), load_tokenizer(ckpt_dir)
