"""Replayable sampling: a two-level Gumbel-max with counter-based noise fixed by (seed, position, index).

The vocabulary is cut into blocks of `SAMPLING_BLOCK` token ids (the last one shorter). A node samples token `t`
at completion position `i` in two steps:

    b* = argmax_b ( logsumexp_{v in block b}(z_v / T) + G(seed, i, b) )        the block
    t  = argmax_{v in block b*} ( z_v / T + g(seed, i, v) )                    the token in it

where `z` are the model's logits and `G`, `g` are Gumbel noise computed from hashes of their integer arguments
(two domains, so the two levels are independent), with no generator state. The first step picks block b with
probability sum_{v in b} softmax(z / T)_v, the second picks v within it with probability proportional to
softmax(z / T)_v: together an exact sample from softmax(z / T). The sampled token is a function of the logits and
the coordinator's seed, so a verifier that recomputes the logits in one prefill pass checks every token, allowing
a margin only where the top two scores of either step nearly tie (`replay_tokens`). The temperature is applied here,
by the rule itself, never by an engine's model (some model classes ignore a logit-scale override).

Why two levels: the one-level rule (argmax over the whole vocabulary of z / T + g) needs a hash and two float64
logs per token of the vocabulary, 9.7M per step at 64 rows x 152k, which cost the node ~14% of its tokens/s on
a CPU against vLLM's own sampler. Here a step costs one float32 exp per token (the block logsumexps, which the
logprob needs anyway) and noise for ~n/256 + 256 entries per row: less per element than vLLM's plain sampler, on
the node and on the verifier.

The noise, per row (seed, position) and index j (a token id, or a block number in the block domain):

    key  = mix(mix(seed * C_SEED + C_0) ^ position * C_POS)        one per row (block domain: mix(key ^ C_BLOCK))
    x    = mix(key ^ j * C_TOK)                                    one mix per index
    u    = (2 * (x >>> 12) + 1) / 2**53                            exact in float64, in (0, 1)
    g    = -log(-log(u))                                           float64

`mix` is splitmix64's finaliser. Every engine (vLLM's logits processor, the torch engine) and the verifier call
this module on the device of the logits.

What is bit-identical, and what is not:
- the integer hash and u are exact on every device (integer arithmetic, an exact int -> float64 conversion and a
  multiplication by a power of two); the float64 logs are bit-identical wherever the same log kernel runs
  (tests/test_sampling.py checks the CPU's for the engines' and the verifier's call patterns); CUDA's may differ
  in the last bit (~4e-15 absolute);
- the block logsumexps are float32 sums: node and verifier differ there by ~1e-6, as their logits differ by
  1e-7..1e-2 anyway. Only a near-tie within the verifier's margin (1e-3 in fp32, more in bf16) can be affected.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

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


def _uniforms(keys: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64 [B, n], for rows with these keys and indices j given as j * C_TOK ([1 or B, n])."""
    x = torch.bitwise_xor(keys.reshape(-1, 1), terms)
    tmp = torch.empty_like(x)
    _mix_(x, tmp)
    torch.bitwise_right_shift(x, 11, out=tmp)
    tmp.bitwise_and_((1 << 53) - 1).bitwise_or_(1)  # 2 * (x >>> 12) + 1: odd, < 2**53, exact in float64
    u = x.view(torch.float64)  # x's storage is free again: reuse it for the floats
    u.copy_(tmp)
    return u.mul_(2.0 ** -53)


def _uniform_block(keys: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Uniforms for indices start..stop-1 of every row."""
    return _uniforms(keys, _token_term(keys.device, stop)[start:].reshape(1, -1))


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return u.log_().neg_().log_().neg_()


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64, shape [B, vocab], on the seeds' device: one per (seed_b, position_b, token)."""
    return _uniform_block(row_keys(seeds, positions), 0, vocab_size)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, start: int = 0,
                 stop: int | None = None) -> torch.Tensor:
    """The token-level Gumbel noise g, float64 [B, stop - start] (tokens start..stop-1, default the whole
    vocabulary), on the seeds' device: a pure function of (seed_b, position_b, token id)."""
    stop = vocab_size if stop is None else stop
    if not 0 <= start <= stop <= vocab_size:
        raise ValueError(f"token range {start}..{stop} outside a vocabulary of {vocab_size}")
    return _gumbel(_uniform_block(row_keys(seeds, positions), start, stop))


SAMPLING_BLOCK = 256
"""Token ids per block of the two-level rule (a protocol constant: nodes and verifiers must agree). About the square
root of a large vocabulary, which minimises the noise a step needs (blocks + one block's tokens per row)."""
_C_BLOCK = 0xE7037ED1A0B428DB


def _block_keys(keys: torch.Tensor) -> torch.Tensor:
    """The block domain's row keys: independent of the token domain's."""
    return _mix(keys ^ _i64(_C_BLOCK))


def block_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The block-level Gumbel noise G, float64 [B, blocks of the vocabulary], on the seeds' device."""
    keys = _block_keys(row_keys(seeds, positions))
    return _gumbel(_uniform_block(keys, 0, -(-vocab_size // SAMPLING_BLOCK)))


def _row_temperatures(temperature: float | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """Temperatures as float64 [rows, 1] on `device` (one number for every row, or one per row). A number is
    checked here; a tensor's values are the caller's to check (reading them would sync a GPU every step)."""
    if not isinstance(temperature, torch.Tensor) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    t = torch.as_tensor(temperature, dtype=torch.float64).to(device).reshape(-1, 1)
    if t.shape[0] not in (1, rows):
        raise ValueError(f"{t.shape[0]} temperatures for {rows} rows")
    return t.expand(rows, 1)


def block_logsumexp(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """logsumexp(z / T) over each block of each row, float64 [B, blocks], summed in float32 (or the logits' dtype
    where wider) in row chunks, so that no [B, vocab] temporary is made. `temps` float64 [B, 1]."""
    rows, vocab = logits.shape
    k = SAMPLING_BLOCK
    full, blocks = vocab // k, -(-vocab // k)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = torch.empty(rows, blocks, dtype=torch.float64, device=logits.device)
    step = max(1, _BLOCK_ELEMENTS.get(logits.device.type, _BLOCK_ELEMENTS["cuda"]) // max(vocab, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        scaled = logits[r0:r1].to(dtype).div(temps[r0:r1].to(dtype))
        if full:
            out[r0:r1, :full] = torch.logsumexp(scaled[:, :full * k].reshape(r1 - r0, full, k), dim=-1)
        if full < blocks:
            out[r0:r1, full] = torch.logsumexp(scaled[:, full * k:], dim=-1)
    return out


def _block_scores(lse: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The first step's scores: each block's logsumexp plus its noise G, float64 [B, blocks]."""
    return _gumbel(_uniform_block(_block_keys(keys), 0, lse.shape[1])).add_(lse)


def _token_scores(logits: torch.Tensor, keys: torch.Tensor, temps: torch.Tensor,
                  blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The second step's scores z_v / T + g_v over the tokens of each row's block, float64 [B, SAMPLING_BLOCK]
    (-inf past the vocabulary's end), and their token ids."""
    vocab = logits.shape[1]
    ids = blocks.reshape(-1, 1) * SAMPLING_BLOCK + torch.arange(SAMPLING_BLOCK, device=logits.device)
    inside = ids < vocab
    ids = ids.clamp_(max=vocab - 1)
    z = logits.gather(-1, ids).to(torch.float64).div_(temps)
    scores = _gumbel(_uniforms(keys, ids * _i64(_C_TOK))).add_(z).masked_fill_(~inside, float("-inf"))
    return scores, ids


@torch.no_grad()
def sample_with_logprobs(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                         temperature: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The replayable sample of each row of `logits` [B, vocab] and its policy logprob log_softmax(z / T)[token]
    (float64), both [B] on the logits' device. `temperature` is one number, or one per row ([B]) when rows of
    several requests are sampled together. An exact tie keeps the lower index, as argmax does."""
    rows, _vocab = logits.shape
    device = logits.device
    temps = _row_temperatures(temperature, rows, device)
    keys = row_keys(seeds.to(device), positions.to(device))
    lse = block_logsumexp(logits, temps)
    block = _block_scores(lse, keys).argmax(dim=-1)
    scores, ids = _token_scores(logits, keys, temps, block)
    tokens = ids.gather(-1, scores.argmax(dim=-1, keepdim=True))
    picked = logits.gather(-1, tokens).to(torch.float64) / temps
    return tokens.reshape(-1), (picked - torch.logsumexp(lse, dim=-1, keepdim=True)).reshape(-1)


def sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           temperature: float | torch.Tensor) -> torch.Tensor:
    """The replayable sample for each row of `logits` [B, vocab]."""
    return sample_with_logprobs(logits, seeds, positions, temperature)[0]


class Replayed(NamedTuple):
    gaps: torch.Tensor
    """float64 [B]: how far each token is from being the rule's sample (0 when it is; inf outside the vocabulary)."""
    logprobs: torch.Tensor
    """float64 [B]: log_softmax(z / T) of each token (-inf outside the vocabulary)."""


@torch.no_grad()
def replay_tokens(logits: torch.Tensor, tokens: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  temperature: float | torch.Tensor) -> Replayed:
    """A verifier's check of each row's `tokens` [B] against `logits` [B, vocab] it recomputed. The gap is the larger
    of (best block score - its block's score) and (best token score in its block - its score): 0 when the token is
    the sample; a verifier whose logits differ from the engine's by floating-point error sees small gaps at
    near-ties only. The logprob is computed as the node's is, from the same block sums."""
    rows, vocab = logits.shape
    device = logits.device
    tokens = tokens.to(device=device, dtype=torch.long).reshape(-1, 1)
    outside = ((tokens < 0) | (tokens >= vocab))[:, 0]
    tokens = tokens.clamp(0, vocab - 1)
    temps = _row_temperatures(temperature, rows, device)
    keys = row_keys(seeds.to(device), positions.to(device))
    lse = block_logsumexp(logits, temps)
    block_scores = _block_scores(lse, keys)
    blocks = tokens // SAMPLING_BLOCK
    block_gap = block_scores.max(dim=-1).values - block_scores.gather(-1, blocks)[:, 0]
    scores, _ = _token_scores(logits, keys, temps, blocks)
    token_gap = scores.max(dim=-1).values - scores.gather(-1, tokens - blocks * SAMPLING_BLOCK)[:, 0]
    logprobs = logits.gather(-1, tokens).to(torch.float64) / temps - torch.logsumexp(lse, dim=-1, keepdim=True)
    return Replayed(gaps=torch.maximum(block_gap, token_gap).masked_fill_(outside, float("inf")),
                    logprobs=logprobs[:, 0].masked_fill_(outside, float("-inf")))


@torch.no_grad()
def decision_margins(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     temperature: float | torch.Tensor) -> torch.Tensor:
    """How near each row's sample came to another outcome, float64 [B]: the smaller of the top-two gaps of the
    block step and of the token step (inf where a step had one candidate). Calibration reads it: a verifier's
    `tie_margin` must exceed the engine/verifier score error, and honest margins below it are rare."""
    rows, _vocab = logits.shape
    device = logits.device
    temps = _row_temperatures(temperature, rows, device)
    keys = row_keys(seeds.to(device), positions.to(device))

    def top2_gap(scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[1] < 2:
            return torch.full((rows,), float("inf"), dtype=torch.float64, device=device)
        top = scores.topk(2, dim=-1).values
        return top[:, 0] - top[:, 1]

    block_scores = _block_scores(block_logsumexp(logits, temps), keys)
    scores, _ = _token_scores(logits, keys, temps, block_scores.argmax(dim=-1))
    return torch.minimum(top2_gap(block_scores), top2_gap(scores))


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
