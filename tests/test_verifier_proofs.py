"""Activation proofs: the wire format round-trips and stays bounded, decoding never crashes on malformed input,
and the verifier's comparison passes honest states (fp16 rounding only) while catching drifted or foreign ones."""

from __future__ import annotations

import base64
import random
import struct

import numpy as np
import pytest
import torch

from swarmrl.node.proof import build_proof, build_proofs
from swarmrl.protocol import proofs, sampling
from swarmrl.verifier.logprobs import compare_logprobs, compare_logprobs_many, policy_logprobs
from swarmrl.verifier.proofs import header_problem, proof_errors, proof_errors_many
from swarmrl.verifier.replay import replay, replay_many

H = 128


def states(n: int, seed: int = 0, hidden: int = H) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 2


def test_interpolation_roundtrip_and_distinct_points():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 128, 300):
        xs = rng.choice(200_000, n, replace=False)
        p = proofs.choose_prime(xs)
        ys = rng.integers(0, 0xFBFF, n)
        assert (proofs.evaluate(proofs.interpolate(xs, ys, p), xs, p) == ys).all()
    with pytest.raises(proofs.ProofError):
        proofs.interpolate(np.array([3, 3 + proofs.PRIMES[0]]), np.array([1, 2]), proofs.PRIMES[0])


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100])
def test_proof_commits_every_state_including_the_last(n):
    s = states(n)
    proof = proofs.decode(build_proof(s))
    assert (proof.n_tokens, proof.hidden_size, len(proof.chunks)) == (n, H, -(-n // 32))
    honest = proof_errors(proof, s + 1e-6 * torch.randn(s.shape), boundary_rel=1e-3)
    assert honest.max_err <= 0.51 and honest.checked >= 0.9 * n * proofs.TOPK
    # The state that chose the last token is committed: changing only it is caught.
    last = s.clone()
    last[-1] = torch.randn(H)
    assert proof_errors(proof, last, 1e-3).max_err > 1.0


def test_honest_errors_are_rounding_and_drift_is_caught():
    s = states(256, seed=1)
    proof = proofs.decode(build_proof(s))
    honest = proof_errors(proof, s, 1e-3)
    mean = honest.err_sum / honest.checked
    assert honest.max_err <= 0.5 + 1e-3 and 0.2 < mean < 0.3
    drift = proof_errors(proof, s * (1 + 1e-3 * torch.randn(s.shape)), 1e-3)
    assert drift.max_err > 1.0 and drift.err_sum / drift.checked > 0.55
    foreign = proof_errors(proof, states(256, seed=2), 1e-3)
    assert foreign.max_err > 100


def test_repeated_activations_stay_within_the_flat_mean_bound():
    """A trained model's top entries often repeat at every position: rounding errors then do not average out,
    but each is still <= 0.5 ulp, so the honest mean stays below proof_mean_ulp = 0.55."""
    s = states(64, seed=3)
    s[:, 7] = 3.0 + 0.000957  # 0.49 fp16 ulp (2**-9 here) above 3.0 at every token: a top entry everywhere
    s[:, 9] = -2.5 - 0.000955
    stats = proof_errors(proofs.decode(build_proof(s)), s, 1e-3)
    assert 0.45 < stats.max_err <= 0.5 + 1e-3 and stats.err_sum / stats.checked < 0.55


def test_header_must_fit_the_rollout():
    proof = proofs.decode(build_proof(states(10)))
    assert header_problem(proof, 10, H, 32, 4) is None
    assert "covers" in header_problem(proof, 11, H, 32, 4)
    assert "hidden" in header_problem(proof, 10, 64, 32, 4)
    assert "chunks" in header_problem(proofs.decode(build_proof(states(10), chunk_tokens=64, topk=2)), 10, H, 32, 4)


def test_longest_completion_fits_the_cap():
    text = build_proof(states(proofs.MAX_TOKENS, hidden=512))
    assert len(text) <= proofs.MAX_PROOF_CHARS
    assert proofs.decode(text).n_tokens == proofs.MAX_TOKENS


def _malformed(valid: bytes, rng: random.Random) -> str:
    kind = rng.randrange(9)
    raw = bytearray(valid)
    if kind == 0:  # random bytes
        raw = bytearray(rng.randbytes(rng.randrange(0, 400)))
    elif kind == 1:  # truncated or extended
        raw = raw[:rng.randrange(len(raw))] if rng.random() < 0.5 else raw + rng.randbytes(rng.randrange(1, 9))
    elif kind == 2:  # flipped bytes anywhere
        for _ in range(rng.randrange(1, 5)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif kind == 3:  # a modulus of 0 (crashed the published toploc verifier) or another non-prime
        struct.pack_into("<H", raw, 16, rng.choice([0, 1, 2, 65535, 64000]))
    elif kind == 4:  # header fields out of range
        offset, fmt = rng.choice([(4, "B"), (5, "B"), (6, "B"), (7, "B"), (8, "I"), (12, "I")])
        values = [0, 2, 255] if fmt == "B" else [0, 2**31, 2**32 - 1, 4097, 39, 41]
        struct.pack_into("<" + fmt, raw, offset, rng.choice(values))
    elif kind == 5:  # coefficient not reduced
        struct.pack_into("<H", raw, 18, 65535)
    elif kind == 6:
        return "not base64 !!" + rng.choice(["", "=", "\u00e9"])
    elif kind == 7:
        return "A" * (proofs.MAX_PROOF_CHARS + 4)
    else:
        raw[:4] = b"TOPL"
    return base64.b64encode(bytes(raw)).decode()


def test_malformed_proofs_raise_proof_error_only():
    valid = base64.b64decode(build_proof(states(40)))
    rng = random.Random(0)
    outcomes = {"error": 0, "decoded": 0}
    for _ in range(3000):
        text = _malformed(valid, rng)
        try:
            proof = proofs.decode(text)
        except proofs.ProofError:
            outcomes["error"] += 1
            continue
        # A flipped coefficient still decodes; the comparison must then run (and catch it) without crashing.
        outcomes["decoded"] += 1
        if proof.hidden_size == H and proof.n_tokens == 40:
            proof_errors(proof, states(40), 1e-3)
    assert outcomes["error"] > 2500
    with pytest.raises(proofs.ProofError):
        proofs.decode(None)  # type: ignore[arg-type]
    with pytest.raises(proofs.ProofError):
        proofs.decode("")


def test_batched_proofs_and_checks_equal_one_at_a_time():
    """Nodes build, and the verifier checks, all of a batch's proofs at once; every result must be the one that
    rollout gets alone (mixed lengths, chunk counts and hidden sizes; one foreign rollout among honest ones)."""
    shapes = [(6, H), (1, H), (33, H), (6, H), (70, H), (5, 64)]
    batch = [states(n, seed=i, hidden=h) for i, (n, h) in enumerate(shapes)]
    texts = build_proofs(batch)
    assert texts == [build_proof(s) for s in batch]
    decoded = [proofs.decode(t) for t in texts]
    mine = [s + 1e-6 * torch.randn(s.shape, generator=torch.Generator().manual_seed(9)) for s in batch]
    mine[3] = states(6, seed=99)  # rollout 3's proof does not match these states
    together = proof_errors_many(decoded, mine, 1e-3)
    assert together == [proof_errors(p, s, 1e-3) for p, s in zip(decoded, mine, strict=True)]
    assert together[3].max_err > 1.0 and max(s.max_err for i, s in enumerate(together) if i != 3) <= 0.51


def test_batched_replay_and_logprobs_equal_one_at_a_time():
    g = torch.Generator().manual_seed(0)
    lens, temps, seeds = [6, 1, 9, 6], [1.0, 0.7, 1.3, 1.0], [11, 12, 13, 14]
    logits = [torch.randn(n, 16, generator=g) * 3 for n in lens]
    tokens = [torch.randint(0, 16, (n,), generator=g).tolist() for n in lens]
    tokens[0] = sampling.sample(logits[0], torch.full((6,), 11), torch.arange(6), 1.0).tolist()  # replays exactly
    claimed = [policy_logprobs(lg, t, T).tolist() for lg, t, T in zip(logits, tokens, temps, strict=True)]
    claimed[2][4] -= 0.5
    rp = replay_many(logits, tokens, seeds, temps)
    assert rp == [replay(*a) for a in zip(logits, tokens, seeds, temps, strict=True)]
    assert rp[0].max_gap == 0.0 and rp[0].mismatches == 0 and rp[2].max_gap > 0
    lp = compare_logprobs_many(logits, tokens, claimed, temps)
    assert lp == [compare_logprobs(*a) for a in zip(logits, tokens, claimed, temps, strict=True)]
    assert lp[2].worst_position == 4 and abs(lp[2].max_abs_diff - 0.5) < 1e-9 and lp[0].max_abs_diff < 1e-12


def test_a_proof_checked_piece_by_piece_gives_the_whole_check():
    s = states(100, seed=3)
    proof = proofs.decode(build_proof(s))
    whole = proof_errors(proof, s, 1e-3)
    cuts = [0, 5, 32, 40, 77, 100]  # pieces across and inside the 32-token chunks
    pieces = [s[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    parts = proof_errors_many([proof] * 5, pieces, 1e-3, starts=cuts[:-1])
    assert sum(p.checked for p in parts) == whole.checked
    assert sum(p.err_sum for p in parts) == pytest.approx(whole.err_sum)
    assert max(p.max_err for p in parts) == whole.max_err
    # A piece of foreign states is caught on its own, at the right token.
    bad = s.clone()
    bad[60] = torch.randn(H)
    part = proof_errors_many([proof], [bad[40:77]], 1e-3, starts=[40])[0]
    assert part.max_err > 1.0 and part.worst_token == 60
