"""How every role turns a prompt into token ids, and which tokens end a completion.

The node tokenizes the leased prompt, the verifier checks that the node did it right, and the trainer evaluates
and warms up on prompts: all three call `render_prompt`, so they agree token for token. A tokenizer with a chat
template renders the prompt as one user message followed by the assistant's generation prompt; one without
(the addition demo's character tokenizer) encodes the text as it is.

`stop_token_ids` is the set of tokens that end a completion: the union of the checkpoint's config and
generation-config `eos_token_id` (an int or a list) and the tokenizer's eos token. Engines stop at any of them,
and the verifier's termination check accepts any of them, and only them.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_tokenizer(ckpt_dir: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer (with its chat template, when it has one), exactly as its tokenizer.json says.

    Not `AutoTokenizer` when there is a tokenizer.json: transformers 5 picks the class from config.json's
    model_type, and e.g. `Qwen2Tokenizer` rebuilds its own pre-tokenizer (digits one by one) instead of the
    file's, so a locally trained BPE in a Qwen2 checkpoint would tokenize differently than it was trained."""
    ckpt = Path(ckpt_dir)
    if (ckpt / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(ckpt))
    return AutoTokenizer.from_pretrained(str(ckpt))


def render_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The token ids of prompt `text`: through the chat template (one user message, then the generation prompt)
    when the tokenizer has one, else its plain encoding (with the special tokens it adds, e.g. BOS)."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = out["input_ids"] if not isinstance(out, list) else out
        return [int(i) for i in ids]
    return list(tokenizer(text).input_ids)


_MARK = "\u2063swarmrl-model-turn\u2063"
"""Stands for the model's turn while a chat template renders around it (text no model turn is compared with)."""


def render_env_turn(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The token ids of an environment's reply `text` after a model turn that ended with a stop token: through the
    chat template, the next user message and the assistant's generation prompt (without the end-of-turn text the
    model's stop token already wrote); without one, the text on a line of its own. Nodes, the verifier and the
    trainer all call this, so an episode's environment tokens are the same everywhere (`protocol.episodes`)."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer("\n" + text + "\n", add_special_tokens=False).input_ids)
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
    full = tokenizer.apply_chat_template(chat + [{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    after = full[full.index(_MARK) + len(_MARK):]
    eos = tokenizer.eos_token or ""
    if eos and after.startswith(eos):
        after = after[len(eos):]
    return list(tokenizer(after, add_special_tokens=False).input_ids)


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id to pad batches with: the tokenizer's pad token, else its eos (Llama's tokenizers have no pad).
    Padding is masked out or never attended to, so any id would do; this one is always in the vocabulary."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token")
    return int(pad)


def _ids(value: object) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, list | tuple):
        return {int(v) for v in value}
    return {int(value)}  # type: ignore[call-overload]


def stop_token_ids(ckpt_dir: str | Path | None = None, *, model: PreTrainedModel | None = None,
                   tokenizer: PreTrainedTokenizerBase | None = None) -> frozenset[int]:
    """The tokens that end a completion, from a checkpoint directory (its config.json, generation_config.json
    and tokenizer) or from a loaded model and/or tokenizer. Raises ValueError when there is none."""
    found: set[int] = set()
    if ckpt_dir is not None:
        ckpt = Path(ckpt_dir)
        for name in ("config.json", "generation_config.json"):
            if (ckpt / name).is_file():
                found |= _ids(json.loads((ckpt / name).read_text()).get("eos_token_id"))
        if tokenizer is None:
            tokenizer = load_tokenizer(ckpt)
    if model is not None:
        found |= _ids(model.config.eos_token_id)
        if model.generation_config is not None:
            found |= _ids(model.generation_config.eos_token_id)
    if tokenizer is not None:
        found |= _ids(tokenizer.eos_token_id)
    if not found:
        raise ValueError("no stop token: neither the config, the generation config nor the tokenizer names an eos")
    return frozenset(found)
