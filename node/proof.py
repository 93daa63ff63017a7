"""Node-side activation proofs: commit to the final hidden states that chose each sampled token.

Both engines collect, for every completion, the n final hidden states (last-norm outputs) whose logits
chose its n tokens, and call `build_proof`. The format and selection rule are `protocol.proofs`'.
"""

from __future__ import annotations

import numpy as np
import torch

from protocol import proofs


def select_topk(states: torch.Tensor, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per state (row), the indices and float32 values of its `topk` largest-magnitude entries, [n, topk]."""
    s = states.detach().to(torch.float32).cpu()
    idx = s.abs().topk(topk, dim=-1).indices
    return idx.numpy().astype(np.int64), s.gather(-1, idx).numpy()


def build_proof(states: torch.Tensor, chunk_tokens: int = proofs.CHUNK_TOKENS, topk: int = proofs.TOPK) -> str:
    """The base64 proof for states [n_tokens, hidden] (row i chose completion token i).

    Cost: a top-k per state and one O(points^2) interpolation per chunk (a few ms per 32 tokens; about 2% of
    vLLM's generation time on the 27M model, bench/byzantine.py).
    """
    if states.ndim != 2 or states.shape[0] == 0:
        raise proofs.ProofError(f"expected states [n_tokens >= 1, hidden], got {tuple(states.shape)}")
    n, hidden = states.shape
    idx, vals = select_topk(states, topk)
    bits = proofs.fp16_bits(vals)
    chunks = []
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)
        t = np.repeat(np.arange(end - start), topk)
        xs = proofs.point_index(t, idx[start:end].reshape(-1), hidden)
        p = proofs.choose_prime(xs)
        chunks.append((p, proofs.interpolate(xs, bits[start:end].reshape(-1), p)))
    return proofs.encode(proofs.Proof(chunk_tokens=chunk_tokens, topk=topk, hidden_size=hidden, n_tokens=n,
                                      chunks=tuple(chunks)))
