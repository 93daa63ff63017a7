"""Activation proofs (TOPLOC family): a compact commitment to the final hidden states of a completion.

What is committed. A completion of n tokens was sampled from n logit vectors; each came from a final hidden
state (the output of the model's last norm, the input of the LM head). State i is the one that chose token i:
the prompt's last position for i = 0, completion token i-1 for i > 0. So every sampled token's choice is
committed, the last one included; the last token as an *input* is never run by anyone, and its identity is
checked by replay and logprob recomputation, like every other token's.

Selection. From each state the node takes the `topk` entries of largest magnitude (indices h_0..h_{k-1})
and quantizes their values to float16 (saturating at +-65504). States are grouped in chunks of
`chunk_tokens` consecutive tokens; a chunk's points are (x, y) = (t * hidden_size + h, fp16 bits of value)
for token t of the chunk and each selected h.

Encoding (the TOPLOC trick). Per chunk, the unique polynomial P of degree < #points over GF(p) with
P(x mod p) = y is sent as its coefficients: 2 bytes per point, no indices. A verifier that recomputes the
states evaluates P at *its own* top-k indices; at an index the node did not commit to, P gives an
unrelated value, so a different model or different inputs show up as mismatches. p is a prime in
(64511, 65536): every finite fp16 bit pattern is below 64512, so values survive the reduction mod p.

Binary layout (little endian), then standard base64 for `Rollout.proof`:

    b"SRP1" | value_format u8 (1 = fp16) | chunk_tokens u8 | topk u8 | 0 u8 | hidden_size u32 | n_tokens u32
    per chunk: prime u16 | coefficients u16 x (tokens_in_chunk * topk), lowest degree first

A 4096-token completion at the defaults (32 tokens x top-4) takes 33 KB, 44 KB in base64: inside the
protocol's 64 KiB cap. `decode` checks every field and bound and raises `ProofError` on anything malformed;
it never divides by a value it read, and `evaluate` only runs on a decoded (validated) proof.
"""

from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"SRP1"
VALUE_FP16 = 1
CHUNK_TOKENS = 32
"""Tokens per chunk (the protocol's default)."""
TOPK = 4
"""Entries committed per token state (the protocol's default): 128 points per full chunk."""
MAX_TOKENS = 4096
MAX_POINTS_PER_CHUNK = 2048
MAX_HIDDEN_SIZE = 1 << 20
MAX_PROOF_CHARS = 65536
"""The base64 text's cap, as in `protocol.messages.Rollout.proof`."""
FP16_MAX = 65504.0

_HEADER = struct.Struct("<4sBBBBII")


def _primes_between(lo: int, hi: int) -> tuple[int, ...]:
    """Primes p with lo < p < hi, largest first (trial division: the range is small)."""
    out = []
    for n in range(hi - 1, lo, -1):
        if n % 2 and all(n % d for d in range(3, int(n**0.5) + 1, 2)):
            out.append(n)
    return tuple(out)


PRIMES = _primes_between(0xFBFF, 1 << 16)
"""Allowed moduli: above every finite fp16 bit pattern (<= 0xFBFF), below 2**16. A proof naming any other
modulus (0 included) is malformed."""
_PRIME_SET = frozenset(PRIMES)


class ProofError(ValueError):
    """A proof that cannot be decoded or built: the reason says which field or bound failed."""


@dataclass(frozen=True)
class Proof:
    """A decoded proof. `chunks[j]` = (prime, coefficients as int64) for tokens [j*chunk_tokens, ...)."""

    chunk_tokens: int
    topk: int
    hidden_size: int
    n_tokens: int
    chunks: tuple[tuple[int, np.ndarray], ...]

    def chunk_bounds(self, j: int) -> tuple[int, int]:
        start = j * self.chunk_tokens
        return start, min(start + self.chunk_tokens, self.n_tokens)


# -- arithmetic in GF(p), p < 2**16: every product fits in int64 ----------------------------------------------


def _inv(a: np.ndarray, p: int) -> np.ndarray:
    """Modular inverses of nonzero residues, elementwise (Fermat: a^(p-2), by square and multiply)."""
    result = np.ones_like(a)
    base = a % p
    e = p - 2
    while e:
        if e & 1:
            result = (result * base) % p
        base = (base * base) % p
        e >>= 1
    return result


def interpolate(xs: np.ndarray, ys: np.ndarray, p: int) -> np.ndarray:
    """Coefficients (lowest degree first) of the polynomial of degree < len(xs) through (xs, ys) over GF(p).
    xs must be distinct mod p."""
    return interpolate_many(np.asarray(xs)[None], np.asarray(ys)[None], p)[0]


def interpolate_many(xs: np.ndarray, ys: np.ndarray, p: int) -> np.ndarray:
    """`interpolate` for B point sets of one size at once: xs, ys [B, n] -> coefficients [B, n].

    O(B n^2) work in O(n) vectorised numpy steps, so a node's many short completions cost about what one does.
    """
    xs = np.asarray(xs, dtype=np.int64) % p
    ys = np.asarray(ys, dtype=np.int64) % p
    b, n = xs.shape
    if n > 1 and (np.diff(np.sort(xs, axis=1), axis=1) == 0).any():
        raise ProofError("interpolation points are not distinct modulo p")
    # M(x) = prod (x - x_i), coefficients lowest first: multiply in one linear factor at a time.
    master = np.zeros((b, n + 1), dtype=np.int64)
    master[:, 0] = 1
    for i in range(n):
        shifted = np.zeros_like(master)
        shifted[:, 1:] = master[:, :-1]
        master = (shifted - xs[:, i:i + 1] * master) % p
    # q_i = M / (x - x_i); q_i(x_i) = M'(x_i) = prod_{j != i} (x_i - x_j), nonzero since the x_i are distinct.
    deriv = (np.arange(1, n + 1, dtype=np.int64) * master[:, 1:]) % p
    weights = (ys * _inv(evaluate_many(deriv, xs, p), p)) % p
    # sum_i w_i q_i, with q_i's coefficients from synthetic division, highest first:
    # q_i[n-1] = M[n], q_i[j-1] = M[j] + x_i q_i[j]. Products < 2**32, n <= 2048 terms: < 2**43.
    out = np.empty((b, n), dtype=np.int64)
    acc = np.repeat(master[:, n:n + 1], n, axis=1)
    out[:, n - 1] = (acc * weights).sum(axis=1) % p
    for j in range(n - 1, 0, -1):
        acc = (master[:, j:j + 1] + xs * acc) % p
        out[:, j - 1] = (acc * weights).sum(axis=1) % p
    return out


def evaluate(coeffs: np.ndarray, xs: np.ndarray, p: int) -> np.ndarray:
    """P(x) mod p at every x (Horner)."""
    return evaluate_many(np.asarray(coeffs)[None], np.asarray(xs)[None], p)[0]


def evaluate_many(coeffs: np.ndarray, xs: np.ndarray, p: int) -> np.ndarray:
    """`evaluate` for B polynomials at once: coeffs [B, n], xs [B, m] -> values [B, m]."""
    coeffs = np.asarray(coeffs, dtype=np.int64)
    xs = np.asarray(xs, dtype=np.int64) % p
    acc = np.zeros_like(xs)
    for j in range(coeffs.shape[1] - 1, -1, -1):
        acc = (acc * xs + coeffs[:, j:j + 1]) % p
    return acc


# -- values ------------------------------------------------------------------------------------------------------


def fp16_bits(values: np.ndarray) -> np.ndarray:
    """float16 bit patterns (as int64 in [0, 0xFBFF]) of values, saturated to the finite fp16 range."""
    v = np.clip(np.nan_to_num(np.asarray(values, dtype=np.float32), nan=0.0), -FP16_MAX, FP16_MAX)
    return v.astype(np.float16).view(np.uint16).astype(np.int64)


def fp16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of 16-bit patterns; patterns that are not finite fp16 (or >= 2**16) become NaN."""
    bits = np.asarray(bits, dtype=np.int64)
    ok = (bits >= 0) & (bits < (1 << 16))
    out = np.where(ok, bits, 0).astype(np.uint16).view(np.float16).astype(np.float32)
    out[~ok] = np.nan
    out[~np.isfinite(out)] = np.nan
    return out


def choose_prime(xs: np.ndarray) -> int:
    """The largest allowed prime under which xs are distinct (always the first when xs < 64513)."""
    xs = np.asarray(xs, dtype=np.int64)
    for p in PRIMES:
        if len(xs) < 2 or (np.diff(np.sort(xs % p)) != 0).all():
            return p
    raise ProofError("no allowed modulus separates these indices")  # pragma: no cover - ~1e-9 per chunk


# -- encoding --------------------------------------------------------------------------------------------------


def _check_params(chunk_tokens: int, topk: int, hidden_size: int, n_tokens: int) -> None:
    if not 1 <= chunk_tokens <= 255:
        raise ProofError(f"chunk_tokens {chunk_tokens} outside 1..255")
    if not 1 <= topk <= 255:
        raise ProofError(f"topk {topk} outside 1..255")
    if not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
        raise ProofError(f"hidden_size {hidden_size} outside 1..{MAX_HIDDEN_SIZE}")
    if topk > hidden_size:
        raise ProofError(f"topk {topk} exceeds hidden_size {hidden_size}")
    if chunk_tokens * topk > MAX_POINTS_PER_CHUNK:
        raise ProofError(f"{chunk_tokens * topk} points per chunk exceed {MAX_POINTS_PER_CHUNK}")
    if not 1 <= n_tokens <= MAX_TOKENS:
        raise ProofError(f"n_tokens {n_tokens} outside 1..{MAX_TOKENS}")


def encode(proof: Proof) -> str:
    """The base64 text of a proof (parameters and coefficient counts are checked first)."""
    _check_params(proof.chunk_tokens, proof.topk, proof.hidden_size, proof.n_tokens)
    n_chunks = -(-proof.n_tokens // proof.chunk_tokens)
    if len(proof.chunks) != n_chunks:
        raise ProofError(f"{len(proof.chunks)} chunks for {proof.n_tokens} tokens, expected {n_chunks}")
    parts = [_HEADER.pack(MAGIC, VALUE_FP16, proof.chunk_tokens, proof.topk, 0, proof.hidden_size, proof.n_tokens)]
    for j, (p, coeffs) in enumerate(proof.chunks):
        start, end = proof.chunk_bounds(j)
        if p not in _PRIME_SET or len(coeffs) != (end - start) * proof.topk:
            raise ProofError(f"chunk {j}: bad modulus or coefficient count")
        parts.append(struct.pack("<H", p))
        parts.append(np.asarray(coeffs, dtype="<u2").tobytes())
    text = base64.b64encode(b"".join(parts)).decode("ascii")
    if len(text) > MAX_PROOF_CHARS:
        raise ProofError(f"proof of {len(text)} base64 chars exceeds {MAX_PROOF_CHARS}")
    return text


def decode(text: str) -> Proof:
    """The proof in `text`, or ProofError naming what is malformed. Never raises anything else."""
    if not isinstance(text, str):
        raise ProofError("proof is not a string")
    if len(text) > MAX_PROOF_CHARS:
        raise ProofError(f"proof of {len(text)} chars exceeds {MAX_PROOF_CHARS}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise ProofError("proof is not valid base64") from None
    if len(raw) < _HEADER.size:
        raise ProofError(f"proof of {len(raw)} bytes is shorter than its header")
    magic, fmt, chunk_tokens, topk, reserved, hidden_size, n_tokens = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ProofError("bad proof magic")
    if fmt != VALUE_FP16 or reserved != 0:
        raise ProofError(f"unknown proof value format {fmt}/{reserved}")
    _check_params(chunk_tokens, topk, hidden_size, n_tokens)
    n_chunks = -(-n_tokens // chunk_tokens)
    expected = _HEADER.size + sum(2 + 2 * topk * (min(chunk_tokens, n_tokens - j * chunk_tokens))
                                  for j in range(n_chunks))
    if len(raw) != expected:
        raise ProofError(f"proof has {len(raw)} bytes, its header implies {expected}")
    chunks = []
    off = _HEADER.size
    for j in range(n_chunks):
        tokens = min(chunk_tokens, n_tokens - j * chunk_tokens)
        (p,) = struct.unpack_from("<H", raw, off)
        off += 2
        if p not in _PRIME_SET:
            raise ProofError(f"chunk {j}: modulus {p} is not an allowed prime")
        coeffs = np.frombuffer(raw, dtype="<u2", count=tokens * topk, offset=off).astype(np.int64)
        off += 2 * tokens * topk
        if int(coeffs.max()) >= p:
            raise ProofError(f"chunk {j}: coefficient not reduced modulo {p}")
        chunks.append((p, coeffs))
    return Proof(chunk_tokens=chunk_tokens, topk=topk, hidden_size=hidden_size, n_tokens=n_tokens,
                 chunks=tuple(chunks))


def point_index(token_in_chunk: np.ndarray, dim: np.ndarray, hidden_size: int) -> np.ndarray:
    """The x coordinate of entry `dim` of the chunk's token `token_in_chunk` (before reduction mod p)."""
    return np.asarray(token_in_chunk, dtype=np.int64) * hidden_size + np.asarray(dim, dtype=np.int64)
