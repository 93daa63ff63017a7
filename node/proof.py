"""Node-side activation proofs: commit to the final hidden states that chose each sampled token.

Both engines collect, for every completion, the n final hidden states (last-norm outputs) whose logits
chose its n tokens, and call `build_proof`. The format and selection rule are `protocol.proofs`'.
"""

from __future__ import annotations

import numpy as np
import torch

from swarmrl.protocol import proofs


def select_topk(states: torch.Tensor, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per state (row), the indices and float32 values of its `topk` largest-magnitude entries, [n, topk]."""
    s = states.detach().to(torch.float32).cpu()
    idx = s.abs().topk(topk, dim=-1).indices
    return idx.numpy().astype(np.int64), s.gather(-1, idx).numpy()


def build_proof(states: torch.Tensor, chunk_tokens: int = proofs.CHUNK_TOKENS, topk: int = proofs.TOPK) -> str:
    """The base64 proof for states [n_tokens, hidden] (row i chose completion token i)."""
    return build_proofs([states], chunk_tokens, topk)[0]


def build_proofs(states: list[torch.Tensor], chunk_tokens: int = proofs.CHUNK_TOKENS,
                 topk: int = proofs.TOPK) -> list[str]:
    """`build_proof` for many completions at once: the chunks of equal size and modulus are interpolated
    together, so a batch of short completions costs about one interpolation, not one per completion."""
    for s in states:
        if s.ndim != 2 or s.shape[0] == 0:
            raise proofs.ProofError(f"expected states [n_tokens >= 1, hidden], got {tuple(s.shape)}")
    # Every chunk of every completion as (completion, xs, ys), in order; then one interpolation per kind.
    points: list[tuple[int, np.ndarray, np.ndarray]] = []
    if len({s.shape[1] for s in states}) == 1:  # the usual case: one top-k over every state at once
        all_idx, all_vals = select_topk(torch.cat(states), topk)
        all_bits = proofs.fp16_bits(all_vals)
        offsets = np.cumsum([0] + [s.shape[0] for s in states])
        selected = [(all_idx[a:b], all_bits[a:b]) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    else:
        selected = [(idx, proofs.fp16_bits(vals)) for idx, vals in (select_topk(s, topk) for s in states)]
    for r, (s, (idx, bits)) in enumerate(zip(states, selected, strict=True)):
        n, hidden = s.shape
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            t = np.repeat(np.arange(end - start), topk)
            points.append((r, proofs.point_index(t, idx[start:end].reshape(-1), hidden), bits[start:end].reshape(-1)))
    kinds: dict[tuple[int, int], list[int]] = {}
    for i, (_, xs, _) in enumerate(points):
        kinds.setdefault((len(xs), proofs.choose_prime(xs)), []).append(i)
    coeffs: list[tuple[int, np.ndarray]] = [(0, np.empty(0))] * len(points)
    for (_, p), members in kinds.items():
        solved = proofs.interpolate_many(np.stack([points[i][1] for i in members]),
                                         np.stack([points[i][2] for i in members]), p)
        for i, c in zip(members, solved, strict=True):
            coeffs[i] = (p, c)
    chunks: list[list[tuple[int, np.ndarray]]] = [[] for _ in states]
    for (r, _, _), c in zip(points, coeffs, strict=True):
        chunks[r].append(c)
    return [proofs.encode(proofs.Proof(chunk_tokens=chunk_tokens, topk=topk, hidden_size=s.shape[1],
                                       n_tokens=s.shape[0], chunks=tuple(c)))
            for s, c in zip(states, chunks, strict=True)]
