"""Tokenizers built locally (no model hub): today's character tokenizer, and a byte-level BPE trained here.

- `build_char_tokenizer`: one token per character of the addition task's alphabet, `<s>` prepended, `</s>` ends
  a completion. No chat template: prompts are encoded as they are (the addition demo's format).
- `build_bpe_tokenizer`: a byte-level BPE (the GPT-2 / Qwen kind) trained with `tokenizers` on a corpus this
  module generates from a seed (or on given texts, e.g. a task's problems), with ChatML special tokens, a Jinja
  chat template, and two stop tokens (`<|im_end|>`, the tokenizer's eos, and `<|endoftext|>`, also its pad
  token), as Qwen's instruct models have.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ALPHABET = "0123456789+="

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, as Qwen's instruct models render a conversation (no default system message)."""


def build_char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
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


_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck"]
_PUNCT = [".", ".", ".", ",", ",", "?", "!", ";", ":"]


def generate_corpus(lines: int = 20_000, seed: int = 0) -> Iterator[str]:
    """Text to train a BPE on, made from `seed` alone: sentences of pseudo-words with Zipf-like frequencies,
    arithmetic with answers, numbers, code-like lines and chat-like turns. Not language, but it has what a BPE
    needs: frequent words and sub-words, digits, punctuation, spaces, new lines, mixed case."""
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 4))))

    lexicon = list(dict.fromkeys(word() for _ in range(20_000)))
    cum = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(len(lexicon))))

    def sentence() -> str:
        words = rng.choices(lexicon, cum_weights=cum, k=rng.randint(3, 16))
        words[0] = words[0].capitalize()
        return " ".join(words) + rng.choice(_PUNCT)

    for _ in range(lines):
        kind = rng.random()
        if kind < 0.55:
            yield " ".join(sentence() for _ in range(rng.randint(1, 4)))
        elif kind < 0.75:
            a, b = rng.randint(0, 10 ** rng.randint(1, 6)), rng.randint(0, 10 ** rng.randint(1, 6))
            op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
            yield f"{a}{op}{b}={value}" if rng.random() < 0.5 else f"What is {a} {op} {b}? The answer is {value}."
        elif kind < 0.85:
            name, other = rng.choice(lexicon), rng.choice(lexicon)
            yield f"    {name} = {other}({rng.randint(0, 999)}, \"{rng.choice(lexicon)}\")  # {sentence()}"
        else:
            yield f"{IM_START}user\n{sentence()}{IM_END}\n{IM_START}assistant\n{sentence()}{IM_END}"


def build_bpe_tokenizer(vocab_size: int = 8192, seed: int = 0, corpus_lines: int = 20_000,
                        texts: Iterable[str] | None = None, individual_digits: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE of (up to) `vocab_size` tokens, trained on `texts` (e.g. a task's problems) or else on
    `generate_corpus(corpus_lines, seed)`: every byte is a token, so any text encodes, and decode(encode(text)) ==
    text. `individual_digits`: every digit is a token of its own (as Qwen's tokenizers do), which helps small
    models learn arithmetic. Special tokens `<|endoftext|>` (id 0, pad), `<|im_start|>`, `<|im_end|>` (eos); the
    chat template is `CHATML_TEMPLATE`."""
    specials = [END_OF_TEXT, IM_START, IM_END]
    if vocab_size < 256 + len(specials):
        raise ValueError(f"a byte-level BPE needs vocab_size >= {256 + len(specials)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if individual_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts if texts is not None else generate_corpus(corpus_lines, seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=END_OF_TEXT, padding_side="left",
        clean_up_tokenization_spaces=False, chat_template=CHATML_TEMPLATE,
        additional_special_tokens=[IM_START],
    )


def tokenizer_stop_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The tokens a model built for one of these tokenizers stops at (written into its generation config): the
    eos token, and for the BPE's ChatML also `<|endoftext|>` (as Qwen's instruct models)."""
    stops = [tokenizer.eos_token_id]
    if tokenizer.eos_token == IM_END:
        stops.append(tokenizer.convert_tokens_to_ids(END_OF_TEXT))
    return sorted(set(stops))
