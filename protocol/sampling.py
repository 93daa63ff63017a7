"""Replayable sampling: Gumbel-max with counter-based noise fixed by (seed, position, token id).

A node samples token `t` at completion position `i` as

    t = argmax_v ( logits_v / T + g(seed, i, v) )

where `g` is Gumbel noise computed from a hash of its three integer arguments, with no generator
state. That is an exact sample from softmax(logits / T), and it makes the sampled token a function of
the logits and the coordinator's seed: a verifier that recomputes the logits in one prefill pass can
check every token, allowing a margin only where the top two perturbed scores nearly tie.

Every engine (vLLM's logits processor, the torch engine) and the verifier call `gumbel_noise`, so the
noise is bit-identical everywhere: integer hashing, then float64 logs.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_C_SEED = 0x9E3779B97F4A7C15
_C_POS = 0xD1B54A32D192ED03
_C_TOK = 0x8CB92BA72F3D8DD7
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _i64(x: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on negative values)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words with good avalanche."""
    x = (x ^ _shr(x, 30)) * _i64(_M1)
    x = (x ^ _shr(x, 27)) * _i64(_M2)
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64, shape [B, vocab]: one per (seed_b, position_b, token id)."""
    seeds = seeds.to(torch.int64).reshape(-1, 1)
    positions = positions.to(torch.int64).reshape(-1, 1)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device).reshape(1, -1)
    x = _mix(seeds * _i64(_C_SEED) + _i64(0x632BE59BD9B4E019))
    x = _mix(x ^ (positions * _i64(_C_POS)))
    x = _mix(x ^ (tokens * _i64(_C_TOK)))
    top53 = _shr(x, 11).to(torch.float64)
    return (top53 + 0.5) / float(1 << 53)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, float64, shape [B, vocab], a pure function of its arguments."""
    u = uniform_noise(seeds, positions, vocab_size)
    return -torch.log(-torch.log(u))


def perturbed_scores(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     temperature: float | torch.Tensor) -> torch.Tensor:
    """logits / T + Gumbel noise, in float64. Its argmax over the last dim is the sampled token. `temperature`
    is one number, or one per row ([B], as float64) when rows of several requests are scored together."""
    noise = gumbel_noise(seeds, positions, logits.shape[-1]).to(logits.device)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device=logits.device, dtype=torch.float64).reshape(-1, 1)
    return logits.to(torch.float64) / temperature + noise


def sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: float) -> torch.Tensor:
    """The replayable sample for each row of `logits` [B, vocab]."""
    return perturbed_scores(logits, seeds, positions, temperature).argmax(dim=-1)


def sample_seed(request_seed: int, rollout_index: int = 0) -> int:
    """The seed used for one rollout. The coordinator leases one seed per rollout, so this is the identity;
    it exists so that every engine derives it the same way if that ever changes."""
    del rollout_index
    return int(request_seed)
