"""The verifier's recomputation: one causal prefill over prompt + completion for many rollouts at once.

For completion token i the model's logits come from the final hidden state at position len(prompt) - 1 + i;
the last completion token is never an input, so each sequence is prompt + completion[:-1]. Sequences are
right-padded: with causal attention a real token never attends to a pad after it, so no attention mask is
needed and positions are plain 0..L-1, as in generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Recomputed:
    """One rollout's recomputation: row i is what chose completion token i."""

    logits: torch.Tensor
    """[n, vocab] float32 logits (before temperature)."""
    states: torch.Tensor
    """[n, hidden] float32 final hidden states (the last norm's output, the LM head's input)."""


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    decoder = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if decoder is None or head is None:
        raise TypeError(f"{type(model).__name__}: expected a causal LM with .model and .lm_head")
    return decoder, head


@torch.inference_mode()
def recompute(model: torch.nn.Module, seqs: list[tuple[list[int], list[int]]], pad_id: int,
              max_batch_tokens: int = 16384) -> list[Recomputed]:
    """Logits and final hidden states for each (prompt_ids, completion_ids) of `seqs`, in order.

    Sequences are batched (longest first, so padding stays small) up to `max_batch_tokens` padded tokens per
    forward. Every completion must be non-empty.
    """
    decoder, head = _decoder_and_head(model)
    device = next(model.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: -(len(seqs[i][0]) + len(seqs[i][1])))
    out: list[Recomputed | None] = [None] * len(seqs)
    start = 0
    while start < len(order):
        width = len(seqs[order[start]][0]) + len(seqs[order[start]][1]) - 1
        rows = max(1, max_batch_tokens // max(width, 1))
        batch = order[start:start + rows]
        start += len(batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for b, i in enumerate(batch):
            prompt, completion = seqs[i]
            seq = prompt + completion[:-1]
            ids[b, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        hidden = decoder(input_ids=ids.to(device), use_cache=False).last_hidden_state
        for b, i in enumerate(batch):
            prompt, completion = seqs[i]
            rows_i = hidden[b, len(prompt) - 1:len(prompt) - 1 + len(completion)]
            out[i] = Recomputed(logits=head(rows_i).float().cpu(), states=rows_i.float().cpu())
    return out  # type: ignore[return-value]
