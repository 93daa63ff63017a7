"""The replayable sampling rule: a pure function of (logits, seed, position), an exact sample, the same noise bits
wherever it is computed, and computed on the device of the logits."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from swarmrl.protocol import sampling
from swarmrl.protocol.sampling import (
    SAMPLING_BLOCK,
    block_noise,
    decision_margins,
    gumbel_noise,
    replay_tokens,
    sample,
    sample_with_logprobs,
    uniform_noise,
)


def test_noise_is_a_pure_function_of_its_arguments():
    seeds = torch.tensor([1, 2, 3, 2**62])
    pos = torch.tensor([0, 7, 7, 3])
    a = gumbel_noise(seeds, pos, 50)
    b = gumbel_noise(seeds.clone(), pos.clone(), 50)
    assert torch.equal(a, b)
    # Each row depends only on its own (seed, position): batch order does not matter.
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(gumbel_noise(seeds[perm], pos[perm], 50), a[perm])
    # Changing the seed or the position changes the noise.
    assert not torch.equal(gumbel_noise(seeds + 1, pos, 50), a)
    assert not torch.equal(gumbel_noise(seeds, pos + 1, 50), a)


def test_uniforms_are_uniform():
    u = uniform_noise(torch.arange(4000), torch.zeros(4000, dtype=torch.long), 64)
    assert 0.0 < u.min() and u.max() < 1.0
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
    assert torch.all((hist - 0.1).abs() < 0.01), hist


def test_gumbel_max_samples_from_the_softmax():
    n = 40000
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0]).repeat(n, 1)
    for temperature in (1.0, 0.5):
        tokens = sample(logits, torch.arange(n), torch.full((n,), 3), temperature)
        freq = torch.bincount(tokens, minlength=4).double() / n
        expected = torch.softmax(logits[0].double() / temperature, dim=0)
        assert torch.all((freq - expected).abs() < 0.01), (freq, expected)


def test_the_two_levels_sample_from_the_softmax_over_many_blocks():
    """A vocabulary of 2.5 blocks whose mass sits in tokens of all three (the last one short): the block step and
    the token step together draw each token with its softmax probability."""
    n, vocab = 40000, 2 * SAMPLING_BLOCK + SAMPLING_BLOCK // 2
    base = torch.full((vocab,), -30.0)
    hot = {3: 1.0, SAMPLING_BLOCK - 1: 0.5, SAMPLING_BLOCK + 7: 1.5, 2 * SAMPLING_BLOCK + 1: 0.0, vocab - 1: 1.2}
    for v, z in hot.items():
        base[v] = z
    tokens = sample(base.repeat(n, 1), torch.arange(n) * 7 + 1, torch.full((n,), 2), 1.0)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    expected = torch.softmax(base.double(), dim=0)
    for v in hot:
        assert abs(float(freq[v] - expected[v])) < 0.01, (v, float(freq[v]), float(expected[v]))
    assert float(freq[list(hot)].sum()) > 0.999


def test_replay_gaps_are_zero_for_the_sample_and_positive_for_any_other_token():
    vocab = 3 * SAMPLING_BLOCK + 5
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(1)) * 3
    seeds, pos = torch.arange(8) * 13 + 5, torch.arange(8)
    tokens, _ = sample_with_logprobs(logits, seeds, pos, 0.8)
    assert torch.equal(replay_tokens(logits, tokens, seeds, pos, 0.8).gaps, torch.zeros(8, dtype=torch.float64))
    # Another token of the same block fails the token step, a token of another block the block step.
    same_block = tokens // SAMPLING_BLOCK * SAMPLING_BLOCK + (tokens + 1) % SAMPLING_BLOCK
    other_block = (tokens + SAMPLING_BLOCK) % vocab
    for other in (same_block, other_block):
        assert bool((replay_tokens(logits, other, seeds, pos, 0.8).gaps > 0).all())
    margins = decision_margins(logits, seeds, pos, 0.8)
    assert bool((margins > 0).all()) and bool(margins.isfinite().all())
    replayed = replay_tokens(logits, torch.tensor([vocab, -1] + tokens[2:].tolist()), seeds, pos, 0.8)
    outside = replayed.gaps
    assert outside[:2].isinf().all() and bool((outside[2:] == 0).all())
    assert replayed.logprobs[:2].isneginf().all()
    want = torch.log_softmax(logits[2:].double() / 0.8, -1).gather(-1, tokens[2:, None])[:, 0]
    assert torch.allclose(replayed.logprobs[2:], want, rtol=0, atol=1e-5)


def test_the_rule_is_its_definition():
    """The block chosen is the argmax of each block's logsumexp(z / T) plus the block noise, the token the argmax
    of z / T plus the token noise within that block: written out here from the noise functions alone."""
    vocab = 2 * SAMPLING_BLOCK + 77
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5)) * 2
    seeds, pos = _engine_rows()
    temps = torch.tensor([0.7, 1.0, 0.3, 1.7, 0.7, 1.0], dtype=torch.float64)
    scaled = logits.double() / temps[:, None]
    padded = torch.full((6, 3 * SAMPLING_BLOCK), float("-inf"), dtype=torch.float64)
    padded[:, :vocab] = scaled
    lse = torch.logsumexp(padded.reshape(6, 3, SAMPLING_BLOCK), dim=-1)
    block = (lse + block_noise(seeds, pos, vocab)).argmax(-1)
    token_scores = (scaled + gumbel_noise(seeds, pos, vocab)).reshape(6, -1)
    want = []
    for r in range(6):
        lo, hi = int(block[r]) * SAMPLING_BLOCK, min(vocab, (int(block[r]) + 1) * SAMPLING_BLOCK)
        want.append(lo + int(token_scores[r, lo:hi].argmax()))
    tokens, logprobs = sample_with_logprobs(logits, seeds, pos, temps)
    assert tokens.tolist() == want
    ref = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, ref, rtol=0, atol=1e-5)


# -- one noise function, the same bits on every call pattern ---------------------------------------------------

VOCAB = 5003  # not a multiple of any vector width


def _engine_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """(seeds, positions) of a decode step of 6 rows, as an engine samples them (step 4 of six requests)."""
    return torch.tensor([11, 2**62 + 5, -7, 123456789, 42, 0]), torch.full((6,), 4)


def test_noise_is_bit_identical_across_call_patterns():
    """The torch engine (a batch of rows at one step), vLLM's processor (a subset of the batch's rows), the verifier
    (one rollout's positions 0..n-1) and blocked sampling (token ranges) must see the very same noise bits."""
    seeds, pos = _engine_rows()
    batch = gumbel_noise(seeds, pos, VOCAB)
    # The verifier's view: rollout 1's noise at positions 0..5, one row per position.
    rollout = gumbel_noise(torch.full((6,), int(seeds[1])), torch.arange(6), VOCAB)
    assert torch.equal(rollout[4], batch[1])
    # A subset of rows, in another order (vLLM's seeded rows of a mixed batch).
    pick = torch.tensor([5, 1, 3])
    assert torch.equal(gumbel_noise(seeds[pick], pos[pick], VOCAB), batch[pick])
    # Token ranges (the blocks of sample_with_logprobs), including ranges that split vector widths.
    for start, stop in ((0, 1), (1, 9), (7, 4099), (4099, VOCAB)):
        assert torch.equal(gumbel_noise(seeds, pos, VOCAB, start, stop), batch[:, start:stop])
    # Thread count does not change a bit (ATen splits large tensors between threads).
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        big = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 50_000)
        torch.set_num_threads(1)
        assert torch.equal(big, gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 50_000))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("block", [1 << 16, 1000, 7])
def test_row_chunks_do_not_change_the_sample(monkeypatch, block):
    """sample_with_logprobs, whatever its row chunking, picks the same tokens (the verifier's replay gaps are 0) and
    returns log_softmax(z / T) of that token; temperatures may differ per row."""
    seeds, pos = _engine_rows()
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    temps = torch.tensor([0.7, 1.0, 0.3, 1.7, 0.7, 1.0])
    want, _ = sample_with_logprobs(logits, seeds, pos, temps)
    monkeypatch.setitem(sampling._BLOCK_ELEMENTS, "cpu", block)
    tokens, logprobs = sample_with_logprobs(logits, seeds, pos, temps)
    assert torch.equal(tokens, want)
    assert torch.equal(replay_tokens(logits, tokens, seeds, pos, temps).gaps, torch.zeros(6, dtype=torch.float64))
    ref = torch.log_softmax(logits.double() / temps.double()[:, None], -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, ref, rtol=0, atol=1e-5)
    # Per-row temperatures equal one call per temperature.
    for t in (0.7, 1.0):
        rows = (temps == t).nonzero()[:, 0]
        alone, _ = sample_with_logprobs(logits[rows], seeds[rows], pos[rows], t)
        assert torch.equal(alone, tokens[rows])


class _LargeCpuTensors(TorchDispatchMode):
    """Records every op that produces a CPU tensor of at least `numel` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() >= self.numel:
                self.seen.append(str(func))
        return out


def test_noise_is_computed_on_the_device_of_the_logits():
    """With logits on another device (meta: shapes only) and seeds on the CPU, as engines hold them, no op may make a
    CPU tensor of a vocabulary's size: the noise and the scores are computed next to the logits, never on the host
    and copied over."""
    seeds, pos = _engine_rows()
    vocab = 152_064
    logits = torch.empty(6, vocab, device="meta")
    with _LargeCpuTensors(vocab) as mode:
        tokens, logprobs = sample_with_logprobs(logits, seeds, pos, torch.full((6,), 0.7))
        gaps = replay_tokens(logits, torch.zeros(6, dtype=torch.long, device="meta"), seeds, pos, 0.7).gaps
    assert tokens.device.type == logprobs.device.type == gaps.device.type == "meta"
    assert mode.seen == []
    # The recorder does see a CPU computation of that size.
    with _LargeCpuTensors(vocab) as mode:
        gumbel_noise(seeds, pos, vocab)
    assert mode.seen


def test_temperature_must_be_positive():
    seeds, pos = _engine_rows()
    with pytest.raises(ValueError, match="temperature"):
        sample(torch.zeros(6, 10), seeds, pos, 0.0)
    with pytest.raises(ValueError, match="temperatures for"):
        sample(torch.zeros(6, 10), seeds, pos, torch.ones(4))
