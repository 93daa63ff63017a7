"""The verifier's recomputation: causal prefills over prompt + completion for many rollouts at once.

For completion token i the model's logits come from the final hidden state at position len(prompt) - 1 + i;
the last completion token is never an input, so each sequence is prompt + completion[:-1]. Sequences are
right-padded: with causal attention a real token never attends to a pad after it, so no attention mask is
needed and positions are plain 0..L-1, as in generation.

`recompute` runs whole sequences in one forward and returns every position's logits (for calibration and
tools). The verifier's checks use `ChunkedPrefill`: the same padded batch, run a span of columns at a time
with the model's KV cache, rows dropped as soon as their group has failed; the caller turns only the states
it needs into logits, a bounded number at a time, through the model's own head (`models.head.OutputHead`: what
an architecture does after its last layer, such as Gemma2's logit softcapping, stays the model's code).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from swarmrl.models.head import decoder_of, head_of


@dataclass
class Recomputed:
    """One rollout's recomputation: row i is what chose completion token i."""

    logits: torch.Tensor
    """[n, vocab] float32 logits (before temperature)."""
    states: torch.Tensor
    """[n, hidden] float32 final hidden states (the decoder's output, the LM head's input)."""


@torch.inference_mode()
def recompute(model: torch.nn.Module, seqs: list[tuple[list[int], list[int]]], pad_id: int,
              max_batch_tokens: int = 16384) -> list[Recomputed]:
    """Logits and final hidden states for each (prompt_ids, completion_ids) of `seqs`, in order.

    Sequences are batched (longest first, so padding stays small) up to `max_batch_tokens` padded tokens per
    forward. Every completion must be non-empty. Holds [n, vocab] logits per rollout: for short completions and
    small vocabularies only.
    """
    decoder, head = decoder_of(model), head_of(model)
    device = next(model.parameters()).device
    out: list[Recomputed | None] = [None] * len(seqs)
    for batch in length_batches([len(p) + len(c) - 1 for p, c in seqs], max_batch_tokens):
        ids = padded([seqs[i][0] + seqs[i][1][:-1] for i in batch], pad_id)
        hidden = decoder(input_ids=ids.to(device), use_cache=False).last_hidden_state
        for b, i in enumerate(batch):
            prompt, completion = seqs[i]
            rows_i = hidden[b, len(prompt) - 1:len(prompt) - 1 + len(completion)]
            out[i] = Recomputed(logits=head(rows_i).float().cpu(), states=rows_i.float().cpu())
    return out  # type: ignore[return-value]


def length_batches(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices of sequences of `lengths`, longest first, cut into batches of at most `max_batch_tokens` padded
    tokens (at least one sequence each)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, start = [], 0
    while start < len(order):
        rows = max(1, max_batch_tokens // max(lengths[order[start]], 1))
        batches.append(order[start:start + rows])
        start += rows
    return batches


def padded(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """Right-padded [len(seqs), longest] token ids."""
    ids = torch.full((len(seqs), max(max(len(s) for s in seqs), 1)), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids


class ChunkedPrefill:
    """One right-padded batch of sequences run through the decoder a span of columns at a time, with its KV cache.

    `advance(end)` returns the final hidden states of columns [done, end) of the rows still in the batch; `keep`
    drops rows (from the cache too), so work stops for rollouts whose group has already failed. Up to floating
    point, the states are those of one forward over whole sequences.
    """

    def __init__(self, model: torch.nn.Module, seqs: list[list[int]], pad_id: int):
        self.decoder = decoder_of(model)
        self.device = next(model.parameters()).device
        self.ids = padded(seqs, pad_id)
        self.lengths = [len(s) for s in seqs]
        self.rows = list(range(len(seqs)))
        """Which of the original sequences the batch's rows are now."""
        self.done = 0
        self.cache = DynamicCache(config=getattr(model, "config", None))
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "past_key_values" if "past_key_values" in params else "cache"  # renamed in transformers 5.2x

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @torch.inference_mode()
    def advance(self, end: int) -> torch.Tensor:
        """Final hidden states [rows, end - done, hidden] of the next columns (the model's dtype and device)."""
        end = min(end, self.width)
        if end <= self.done:
            raise ValueError(f"nothing to advance: {self.done} columns done, asked for {end}")
        chunk = self.ids[:, self.done:end].to(self.device)
        out = self.decoder(input_ids=chunk, use_cache=True, **{self._cache_kw: self.cache})
        self.done = end
        return out.last_hidden_state

    def keep(self, rows: list[int]) -> None:
        """Keep only these original sequences (a subset of `rows`, in their current order)."""
        if rows == self.rows:
            return
        if not rows:  # nothing left to run: the cache is not used again
            self.rows = []
            return
        pos = {r: k for k, r in enumerate(self.rows)}
        index = torch.tensor([pos[r] for r in rows], dtype=torch.long)
        self.cache.batch_select_indices(index.to(self.device))
        self.ids = self.ids[index]
        self.rows = list(rows)

    def real_tokens(self, start: int, end: int) -> dict[int, int]:
        """Per kept sequence, how many of columns [start, end) are real tokens (not padding)."""
        return {r: max(0, min(end, self.lengths[r]) - start) for r in self.rows}
