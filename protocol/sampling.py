"""Replayable sampling: Gumbel-max with counter-based noise fixed by (seed, position, token id).

A node samples token `t` at completion position `i` as

    t = argmax_v ( z_v / T + g(seed, i, v) )

where `z` are the model's logits and `g` is Gumbel noise computed from a hash of its three integer arguments,
with no generator state. That is an exact sample from softmax(z / T), and it makes the sampled token a function
of the logits and the coordinator's seed: a verifier that recomputes the logits in one prefill pass can check
every token, allowing a margin only where the top two perturbed scores nearly tie. The temperature is applied
here, by the rule itself, never by an engine's model (some model classes ignore a logit-scale override).

The noise, per row (seed, position) and token v:

    key  = mix(mix(seed * C_SEED + C_0) ^ position * C_POS)        one per row
    x    = mix(key ^ v * C_TOK)                                    one mix per token
    u    = (2 * (x >>> 12) + 1) / 2**53                            exact in float64, in (0, 1)
    g    = -log(-log(u))                                           float64

`mix` is splitmix64's finaliser. Every engine (vLLM's logits processor, the torch engine) and the verifier call
`gumbel_noise` (directly or through `perturbed_scores` / `sample_with_logprobs`), on the device of the logits.

What is bit-identical, and what is not:
- the integer hash and u are exact on every device (integer arithmetic, an exact int -> float64 conversion and a
  multiplication by a power of two), and so is z / T + g given z (IEEE division and addition are correctly
  rounded everywhere);
- the two float64 logs are bit-identical wherever the same log kernel runs: on the CPU, ATen's vectorised log
  gives the same bits for an element whatever the tensor's shape, its offset in the tensor and the thread count
  (tests/test_sampling.py checks this for the torch engine's, vLLM's and the verifier's call patterns). CUDA's
  float64 log (within 1 ulp) can differ from the CPU's in the last bit, so g on a GPU node and a CPU verifier
  may differ by ~1e-16 relative (~4e-15 absolute at most). That matters only where two perturbed scores tie to
  within that, while the verifier's tie margin (1e-3 in fp32, more in bf16) is 10^11 times wider, and the
  logits themselves differ between engine and verifier by 1e-7..1e-2 anyway.

Cost: the noise is built block by block (`_BLOCK_ELEMENTS` on the CPU, whole batches on GPUs) with in-place
operations, so a step over [rows x 152k vocab] does not allocate [rows x vocab] float64 tensors; the per-row key
is computed once and each token costs one mix and two logs.
"""

from __future__ import annotations

import threading

import torch

_MASK64 = (1 << 64) - 1
_C_SEED = 0x9E3779B97F4A7C15
_C_0 = 0x632BE59BD9B4E019
_C_POS = 0xD1B54A32D192ED03
_C_TOK = 0x8CB92BA72F3D8DD7
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

_BLOCK_ELEMENTS = {"cpu": 1 << 16, "cuda": 1 << 26}
"""Elements of [rows x vocab] processed at once: on the CPU a block's few buffers stay in the 2 MiB L2 cache
(8.5 against 23 ns per element unblocked at 64 x 152k on one core); on GPUs one kernel per op over the batch."""


def _i64(x: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 shifts)."""
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


def _mix_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """`_mix` in place (`tmp` is scratch of x's shape): the same bits, without allocating."""
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mult is not None:
            x.mul_(_i64(mult))
    return x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The per-row key, int64 [B], on the seeds' device: the hash of (seed, position) every token's noise mixes."""
    seeds = seeds.to(torch.int64).reshape(-1)
    positions = positions.to(device=seeds.device, dtype=torch.int64).reshape(-1)
    return _mix(_mix(seeds * _i64(_C_SEED) + _i64(_C_0)) ^ (positions * _i64(_C_POS)))


_token_terms: dict[str, torch.Tensor] = {}
_token_terms_lock = threading.Lock()


def _token_term(device: torch.device, stop: int) -> torch.Tensor:
    """v * C_TOK for v < stop on `device` (cached: the same for every step)."""
    key = str(device)
    terms = _token_terms.get(key)
    if terms is None or terms.numel() < stop:
        with _token_terms_lock:
            terms = torch.arange(stop, dtype=torch.int64, device=device) * _i64(_C_TOK)
            _token_terms[key] = terms
    return terms[:stop]


def _uniform_block(keys: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64 [B, stop - start], for tokens start..stop-1 of rows with these keys."""
    x = torch.bitwise_xor(keys.reshape(-1, 1), _token_term(keys.device, stop)[start:].reshape(1, -1))
    tmp = torch.empty_like(x)
    _mix_(x, tmp)
    torch.bitwise_right_shift(x, 11, out=tmp)
    tmp.bitwise_and_((1 << 53) - 1).bitwise_or_(1)  # 2 * (x >>> 12) + 1: odd, < 2**53, exact in float64
    u = x.view(torch.float64)  # x's storage is free again: reuse it for the floats
    u.copy_(tmp)
    return u.mul_(2.0 ** -53)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64, shape [B, vocab], on the seeds' device: one per (seed_b, position_b, token)."""
    return _uniform_block(row_keys(seeds, positions), 0, vocab_size)


def _gumbel_block(keys: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return _uniform_block(keys, start, stop).log_().neg_().log_().neg_()


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, start: int = 0,
                 stop: int | None = None) -> torch.Tensor:
    """Standard Gumbel noise, float64 [B, stop - start] (tokens start..stop-1, default the whole vocabulary), on
    the seeds' device: a pure function of (seed_b, position_b, token id)."""
    stop = vocab_size if stop is None else stop
    if not 0 <= start <= stop <= vocab_size:
        raise ValueError(f"token range {start}..{stop} outside a vocabulary of {vocab_size}")
    return _gumbel_block(row_keys(seeds, positions), start, stop)


def _row_temperatures(temperature: float | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """Temperatures as float64 [rows, 1] on `device` (one number for every row, or one per row). A number is
    checked here; a tensor's values are the caller's to check (reading them would sync a GPU every step)."""
    if not isinstance(temperature, torch.Tensor) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    t = torch.as_tensor(temperature, dtype=torch.float64).to(device).reshape(-1, 1)
    if t.shape[0] not in (1, rows):
        raise ValueError(f"{t.shape[0]} temperatures for {rows} rows")
    return t.expand(rows, 1)


def perturbed_scores(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     temperature: float | torch.Tensor) -> torch.Tensor:
    """z / T + Gumbel noise, float64 [B, vocab] on the logits' device. Its argmax over the last dim is the sampled
    token. `temperature` is one number, or one per row ([B]) when rows of several requests are scored together."""
    device = logits.device
    rows, vocab = logits.shape
    temps = _row_temperatures(temperature, rows, device)
    keys = row_keys(seeds.to(device), positions.to(device))
    out = torch.empty(rows, vocab, dtype=torch.float64, device=device)
    # Row blocks: the temporaries stay small (4x faster than whole-tensor temporaries at 4096 x 8192 on a CPU).
    step = max(1, _BLOCK_ELEMENTS.get(device.type, _BLOCK_ELEMENTS["cuda"]) // max(vocab, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out[r0:r1] = _gumbel_block(keys[r0:r1], 0, vocab).add_(logits[r0:r1].to(torch.float64) / temps[r0:r1])
    return out


@torch.no_grad()
def sample_with_logprobs(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                         temperature: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The replayable sample of each row of `logits` [B, vocab] and its policy logprob log_softmax(z / T)[token]
    (float64), both [B] on the logits' device.

    The token is `perturbed_scores(...).argmax(-1)` exactly (same bits, first index on an exact tie), computed in
    blocks so that no [B, vocab] float64 tensor is allocated; the logprob is taken before the noise."""
    rows, vocab = logits.shape
    device = logits.device
    temps = _row_temperatures(temperature, rows, device)
    keys = row_keys(seeds.to(device), positions.to(device))
    block = _BLOCK_ELEMENTS.get(device.type, _BLOCK_ELEMENTS["cuda"])
    cols = min(vocab, block)
    row_step = max(1, block // cols)
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    logprobs = torch.empty(rows, dtype=torch.float64, device=device)
    for r0 in range(0, rows, row_step):
        r1 = min(rows, r0 + row_step)
        t = temps[r0:r1]
        best = arg = lse = None
        for c0 in range(0, vocab, cols):
            c1 = min(vocab, c0 + cols)
            scaled = logits[r0:r1, c0:c1].to(torch.float64).div_(t)
            part = torch.logsumexp(scaled, dim=-1)
            value, index = _gumbel_block(keys[r0:r1], c0, c1).add_(scaled).max(dim=-1)
            if best is None:
                best, arg, lse = value, index, part
            else:
                later = value > best  # strictly: an exact tie keeps the earlier (lower) token id, like argmax
                best = torch.where(later, value, best)
                arg = torch.where(later, index + c0, arg)
                lse = torch.logaddexp(lse, part)
        tokens[r0:r1] = arg
        picked = logits[r0:r1].gather(-1, arg.reshape(-1, 1)).to(torch.float64) / t
        logprobs[r0:r1] = picked.reshape(-1) - lse
    return tokens, logprobs


def sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           temperature: float | torch.Tensor) -> torch.Tensor:
    """The replayable sample for each row of `logits` [B, vocab]."""
    return sample_with_logprobs(logits, seeds, positions, temperature)[0]


_C_TURN = 0xA0761D6478BD642F


def turn_seed(seed: int, turn: int) -> int:
    """The seed model turn `turn` (0 first) of a multi-turn episode is sampled with, at positions 0, 1, ... of that
    turn (`protocol.episodes`): the leased seed itself for turn 0, so a single-turn rollout is unchanged; for later
    turns a 63-bit mix of (seed, turn), so no two turns of one rollout share their noise."""
    if turn == 0:
        return seed
    x = ((seed & _MASK64) ^ (turn * _C_TURN)) & _MASK64
    for m in (_M1, _M2):
        x = ((x ^ (x >> 30)) * m) & _MASK64
    return (x ^ (x >> 31)) >> 1
