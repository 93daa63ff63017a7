"""Checking an activation proof (`protocol.proofs`) against the verifier's own final hidden states.

For each token state the verifier takes its own top-k entries by magnitude and evaluates the node's chunk
polynomial at their indices. An entry is *checked* only when it is clearly inside the top-k: its magnitude
exceeds the (k+1)-th largest by more than `boundary_rel` of itself, so that floating-point noise cannot have
made the node select a different set; entries at the boundary are skipped. A checked entry's error is
|committed value - own value| in fp16 ulps of the own value. Honest errors are fp16 rounding (<= 0.5 ulp,
mean 0.25) plus engine noise; an index the node did not commit to evaluates to an unrelated value.

Two tests (thresholds in `verifier.config.Tolerances`): no checked entry may be off by more than
`proof_max_ulp`, and the mean error over a group's checked entries must stay below `proof_mean_ulp`. The
mean bound is flat, not a statistical one: entries of one group are far from independent (a trained model's
largest activations often sit in the same few dimensions at every position, so their rounding errors repeat),
but no honest entry can be off by more than 0.5 ulp plus engine noise, hence neither can the mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from swarmrl.protocol import proofs


@dataclass(frozen=True)
class ProofStats:
    """Errors of one rollout's checked entries."""

    checked: int
    """Entries compared (clearly inside the verifier's top-k)."""
    skipped: int
    """Entries at the top-k boundary, not compared."""
    err_sum: float
    max_err: float
    worst_token: int


def fp16_ulp(values: np.ndarray) -> np.ndarray:
    """The fp16 ulp at each value (subnormal spacing below 2**-14; values are saturated at 65504)."""
    a = np.abs(values).astype(np.float64)
    exp = np.floor(np.log2(np.maximum(a, 2.0**-14)))
    return np.exp2(np.clip(exp, -14, 15) - 10)


def proof_errors(proof: proofs.Proof, states: torch.Tensor, boundary_rel: float) -> ProofStats:
    """Compare a decoded proof with the verifier's states [n_tokens, hidden]; the caller has checked the
    proof's header against the states' shape."""
    return proof_errors_many([proof], [states], boundary_rel)[0]


def proof_errors_many(proof_list: list[proofs.Proof], states: list[torch.Tensor], boundary_rel: float,
                      starts: list[int] | None = None) -> list[ProofStats]:
    """`proof_errors` of many rollouts at once: one top-k over all their states (when they share a hidden size
    and top-k), and the chunk polynomials of equal size and modulus evaluated together.

    With `starts`, states[i] holds the states of tokens starts[i] .. starts[i] + len - 1 only, and only their
    entries are compared (a polynomial can be evaluated at any subset of its points): the verifier checks a
    proof piece by piece as its recomputation advances. `worst_token` is then counted from token 0."""
    starts = list(starts) if starts is not None else [0] * len(proof_list)
    shapes = {(s.shape[1], p.topk) for p, s in zip(proof_list, states, strict=True)}
    if len(shapes) > 1:
        return [proof_errors_many([p], [s], boundary_rel, [s0])[0]
                for p, s, s0 in zip(proof_list, states, starts, strict=True)]
    if not proof_list:
        return []
    ((hidden, k),) = shapes
    s = torch.cat([x.detach().float().cpu() for x in states])
    top = s.abs().topk(min(k + 1, hidden), dim=-1)
    idx = top.indices[:, :k].numpy().astype(np.int64)
    mags = top.values[:, :k].numpy().astype(np.float64)
    if hidden > k:
        nxt = top.values[:, k].numpy().astype(np.float64)[:, None]
        inside = (mags - nxt) > boundary_rel * mags
    else:
        inside = np.ones_like(mags, dtype=bool)
    own = np.clip(s.gather(-1, top.indices[:, :k]).numpy().astype(np.float64), -proofs.FP16_MAX, proofs.FP16_MAX)
    # Every piece of a chunk as (first row in `own`, rows, xs, coeffs); pieces of one (size, modulus, point count)
    # are evaluated together.
    offsets = np.cumsum([0] + [x.shape[0] for x in states])
    kinds: dict[tuple[int, int, int], list[tuple[int, int, np.ndarray, np.ndarray]]] = {}
    for proof, base, s0, n in zip(proof_list, offsets[:-1], starts, np.diff(offsets), strict=True):
        for j, (p, coeffs) in enumerate(proof.chunks):
            start, end = proof.chunk_bounds(j)
            lo, hi = max(start, s0), min(end, s0 + int(n))
            if lo >= hi:
                continue
            t = np.repeat(np.arange(lo - start, hi - start), k)
            xs = proofs.point_index(t, idx[base + lo - s0:base + hi - s0].reshape(-1), hidden)
            kinds.setdefault((len(coeffs), p, len(xs)), []).append((base + lo - s0, hi - lo, xs, coeffs))
    committed = np.zeros_like(own)
    for (_, p, _), chunks in kinds.items():
        values = proofs.fp16_values(proofs.evaluate_many(np.stack([c[3] for c in chunks]),
                                                         np.stack([c[2] for c in chunks]), p))
        for (row, n, _, _), v in zip(chunks, values, strict=True):
            committed[row:row + n] = v.reshape(n, k)
    errs = np.nan_to_num(np.abs(committed - own) / fp16_ulp(own), nan=np.inf)
    checked = np.where(inside, errs, 0.0)
    per_token = checked.max(axis=1)
    out = []
    for a, b, s0 in zip(offsets[:-1], offsets[1:], starts, strict=True):
        worst = int(per_token[a:b].argmax())
        out.append(ProofStats(checked=int(inside[a:b].sum()), skipped=int((~inside[a:b]).sum()),
                              err_sum=float(checked[a:b].sum()), max_err=float(per_token[a + worst]),
                              worst_token=s0 + worst))
    return out


def header_problem(proof: proofs.Proof, n_tokens: int, hidden_size: int, chunk_tokens: int, topk: int) -> str | None:
    """Why the proof's parameters do not fit this rollout and the pool's proof settings, or None."""
    if proof.n_tokens != n_tokens:
        return f"proof covers {proof.n_tokens} tokens, completion has {n_tokens}"
    if proof.hidden_size != hidden_size:
        return f"proof hidden size {proof.hidden_size}, model has {hidden_size}"
    if (proof.chunk_tokens, proof.topk) != (chunk_tokens, topk):
        return f"proof uses chunks of {proof.chunk_tokens} x top-{proof.topk}, required {chunk_tokens} x top-{topk}"
    return None
