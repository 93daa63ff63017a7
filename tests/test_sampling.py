"""The replayable sampling rule: a pure function of (logits, seed, position), and an exact sample."""

import torch

from swarmrl.protocol.sampling import gumbel_noise, sample, uniform_noise


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
