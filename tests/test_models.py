"""Model building and loading (swarmrl.models): every architecture through the Auto classes, tokenizers, chat
template rendering, stop tokens, and `swarmrl model`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from swarmrl.modelcmd import build_checkpoint
from swarmrl.models.build import (
    ARCHS,
    PRESETS,
    ModelConfig,
    build_model,
    count_parameters,
    load_causal_lm,
    save_checkpoint,
)
from swarmrl.models.prompts import load_tokenizer, pad_token_id, render_prompt, stop_token_ids
from swarmrl.models.tokenizers import END_OF_TEXT, IM_END, build_bpe_tokenizer, build_char_tokenizer

ARCH_NAMES = ["llama", "qwen2", "qwen3"]
TEXTS = ["123+456=", "Hello, wörld!\n\tTabs  and  spaces ", "naïve café ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "", "<|im_end|> is special",
         "x = f(12, \"y\")  # comment"]


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(1024)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, bpe) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("arch")
    return {arch: save_checkpoint(build_model(ModelConfig.preset("mini", arch=arch), bpe), bpe, root / arch)
            for arch in ARCH_NAMES}


def _ids(tok, n: int = 3, length: int = 24) -> torch.Tensor:
    return torch.randint(3, len(tok), (n, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ARCH_NAMES)
@torch.no_grad()
def test_auto_loading_keeps_every_weight(arch, ckpts, bpe):
    """The reloaded model is the checkpoint's own class and computes exactly the built model's logits: Qwen2's
    q/k/v biases and Qwen3's q/k norms are random (not their constant init), so dropping them would show."""
    built = build_model(ModelConfig.preset("mini", arch=arch), bpe).eval()
    loaded = load_causal_lm(ckpts[arch])
    assert type(loaded).__name__ == type(built).__name__ == f"{arch.capitalize()}ForCausalLM"
    assert json.loads((ckpts[arch] / "config.json").read_text())["model_type"] == arch
    ids = _ids(bpe)
    assert torch.equal(built(ids).logits, loaded(ids).logits)
    distinctive = [p for n, p in loaded.named_parameters() if n.endswith(ARCHS[arch].random_init)]
    assert len(distinctive) == (3 * 2 if arch == "qwen2" else 2 * 2 if arch == "qwen3" else 0)  # 2 layers
    for p in distinctive:
        base = 1.0 if p.ndim == 1 and arch == "qwen3" else 0.0
        assert (p - base).abs().mean() > 0.05


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@torch.no_grad()
def test_loading_a_qwen_checkpoint_as_llama_changes_its_logits(arch, ckpts, bpe):
    """What the Auto classes avoid: Llama's class drops Qwen2's biases / Qwen3's norms without an error."""
    ids = _ids(bpe)
    right = load_causal_lm(ckpts[arch])(ids).logits
    wrong = LlamaForCausalLM.from_pretrained(ckpts[arch], dtype=torch.float32).eval()(ids).logits
    assert (right - wrong).abs().max() > 1e-2


def test_tiny_preset_is_the_addition_model():
    tok = build_char_tokenizer()
    a, b = build_model(ModelConfig(), tok), build_model(ModelConfig.preset("tiny"), tok)
    assert type(a).__name__ == "LlamaForCausalLM" and a.config.vocab_size == len(tok) == 16
    assert 0.85e6 < count_parameters(a) < 0.87e6
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    c = build_model(ModelConfig(seed=1), tok)
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)
    assert render_prompt(tok, "12+34=") == tok("12+34=").input_ids  # no chat template: plain encoding, with BOS
    assert render_prompt(tok, "12+34=")[0] == tok.bos_token_id


def test_small30m_has_about_30m_parameters():
    model = build_model(ModelConfig.preset("small30m", arch="qwen2"), build_bpe_tokenizer(8192))
    assert 28e6 < count_parameters(model) < 32e6
    assert model.config.num_key_value_heads == 4 and model.config.head_dim == 64


def test_model_config_refuses_bad_shapes():
    with pytest.raises(ValueError, match="unknown arch"):
        ModelConfig(arch="gpt9")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        ModelConfig(hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="unknown size"):
        ModelConfig.preset("huge")
    assert set(PRESETS) >= {"tiny", "mini", "small30m"}


def test_bpe_round_trip_and_specials(bpe):
    assert len(bpe) == 1024
    for text in TEXTS:
        ids = bpe(text).input_ids
        assert bpe.decode(ids) == text
    # Merges were learned: common text takes fewer tokens than bytes.
    text = "What is 12 + 345? The answer is 357."
    assert len(bpe(text).input_ids) < len(text.encode()) / 2
    for special in (END_OF_TEXT, IM_END, "<|im_start|>"):
        assert len(bpe(special).input_ids) == 1
    assert bpe.eos_token == IM_END and bpe.pad_token == END_OF_TEXT and pad_token_id(bpe) == bpe.pad_token_id
    # The same seed trains the same tokenizer; another seed's corpus gives other merges.
    assert build_bpe_tokenizer(1024).get_vocab() == bpe.get_vocab()
    assert build_bpe_tokenizer(1024, seed=1).get_vocab() != bpe.get_vocab()


def test_chat_template_rendering(bpe, ckpts):
    ids = render_prompt(bpe, "12+34=")
    assert bpe.decode(ids) == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    assert ids == bpe("<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n").input_ids
    # Every role loads the tokenizer from the checkpoint and must render the same ids; for Qwen2, transformers'
    # AutoTokenizer would swap in Qwen2Tokenizer's own pre-tokenizer and split digits differently.
    for arch in ARCH_NAMES:
        loaded = load_tokenizer(ckpts[arch])
        for text in TEXTS:
            assert render_prompt(loaded, text) == render_prompt(bpe, text)


def test_stop_tokens(bpe, ckpts, tmp_path):
    stops = {bpe.convert_tokens_to_ids(IM_END), bpe.convert_tokens_to_ids(END_OF_TEXT)}
    for arch in ARCH_NAMES:
        assert stop_token_ids(ckpts[arch]) == stops
        model = load_causal_lm(ckpts[arch])
        assert stop_token_ids(model=model, tokenizer=load_tokenizer(ckpts[arch])) == stops
        assert set(model.generation_config.eos_token_id) == stops
    tok = build_char_tokenizer()
    char = save_checkpoint(build_model(ModelConfig(), tok), tok, tmp_path / "char")
    assert stop_token_ids(char) == {tok.eos_token_id}
    # A config listing several eos ids (as some hub checkpoints do) counts every one.
    cfg = json.loads((char / "config.json").read_text())
    (char / "config.json").write_text(json.dumps(cfg | {"eos_token_id": [tok.eos_token_id, 5]}))
    assert stop_token_ids(char) == {tok.eos_token_id, 5}


@pytest.mark.parametrize("arch", ARCH_NAMES)
@torch.no_grad()
def test_stop_rate_makes_stops_about_that_likely(arch, bpe):
    """On average over prompts the calibration never saw (rendered with the chat template, then random tokens).
    One prompt alone can be several times off: a random model's states depend much on the prompt."""
    def stop_probability(model) -> float:
        gen = torch.Generator().manual_seed(7)
        stops = sorted(stop_token_ids(model=model, tokenizer=bpe))
        rates = []
        for k in range(16):
            prompt = render_prompt(bpe, f"Please add {k} and {3 * k + 25} for me." if k % 2 else f"{k}*{k + 9}=")
            ids = torch.cat([torch.tensor([prompt] * 4), torch.randint(3, len(bpe), (4, 24), generator=gen)], 1)
            rates.append(torch.softmax(model(ids).logits[:, len(prompt) - 1:], -1)[..., stops].sum(-1).mean())
        return float(torch.stack(rates).mean())

    assert 0.0125 < stop_probability(build_model(ModelConfig.preset("mini", arch=arch, stop_rate=0.05), bpe)) < 0.15
    assert stop_probability(build_model(ModelConfig.preset("mini", arch=arch), bpe)) < 0.01


def test_swarmrl_model_builds_any_arch(tmp_path):
    meta = build_checkpoint(tmp_path / "q3", ModelConfig.preset("mini", arch="qwen3"), "bpe", bpe_vocab=512)
    assert meta["arch"] == "qwen3" and meta["vocab"] == 512 and "warmup_accuracy" not in meta
    model = load_causal_lm(tmp_path / "q3")
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == 512
    assert load_tokenizer(tmp_path / "q3").chat_template
    assert json.loads((tmp_path / "q3" / "swarmrl.json").read_text())["parameters"] == count_parameters(model)


# -- the trainer's side: FSDP units, evaluation and warm start on any architecture --------------------------------


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_fsdp_units_come_from_the_model(arch, ckpts):
    from swarmrl.trainer.distributed import wrap_classes

    model = load_causal_lm(ckpts[arch])
    names = wrap_classes(model)
    assert names == {f"{arch.capitalize()}DecoderLayer"}
    assert sum(type(m).__name__ in names for m in model.modules()) == model.config.num_hidden_layers


@torch.no_grad()
def test_greedy_evaluation_stops_at_any_stop_token(tmp_path, bpe):
    """trainer.evaluate.greedy_complete (left-padded batch, chat template, every stop token) gives what a plain
    one-prompt-at-a-time greedy loop gives."""
    from swarmrl.trainer.evaluate import greedy_complete

    ckpt = save_checkpoint(build_model(ModelConfig.preset("mini", arch="qwen2", stop_rate=0.15), bpe), bpe,
                           tmp_path / "q")
    model, tok = load_causal_lm(ckpt), load_tokenizer(ckpt)
    stops = stop_token_ids(ckpt)
    texts = ["1+1=", "What is the sum of 123 and 456, please?", "Hi", "x"]
    got = greedy_complete(model, tok, texts, max_new_tokens=12)
    ended = set()
    for text, out in zip(texts, got, strict=True):
        ids = render_prompt(tok, text)
        new: list[int] = []
        while len(new) < 12:
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt in stops:
                ended.add(nxt)
                break
            new.append(nxt)
        assert out == tok.decode(new, skip_special_tokens=True)
    assert ended  # at least one prompt ended at a stop token rather than at max_new_tokens


def test_warm_start_runs_on_a_chat_model(tmp_path, bpe):
    from swarmrl.protocol.tasks import TaskSpec, load_task
    from swarmrl.trainer.warmup import WarmupConfig, warm_start

    model = build_model(ModelConfig.preset("mini", arch="qwen3"), bpe)
    before = model.model.layers[0].self_attn.q_norm.weight.clone()
    task = load_task(TaskSpec(name="addition"))
    acc = warm_start(model, bpe, task, WarmupConfig(max_steps=2, batch_size=4, eval_every=1000))
    assert acc == 0.0  # no evaluation within 2 steps
    assert not torch.equal(before, model.model.layers[0].self_attn.q_norm.weight)
