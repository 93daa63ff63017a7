"""The last step of a causal LM, found generically: final hidden states in, the model's own logits out.

Every role that turns final hidden states into logits (the verifier's chunked prefill, proofs, calibration) goes
through `OutputHead`, so that whatever an architecture does after its last layer (Gemma2's final logit
softcapping, a logit scale, a tied or untied head, a bias) is the model's own code, not a re-implementation.

transformers' causal LMs compute `decoder(...)` (GPT-2's `transformer`, OPT's `model.decoder`, Llama's `model`:
what `get_decoder()` returns; its `last_hidden_state` is the final norm's output, the LM head's input), then
`lm_head` on it and the architecture's post-processing. `OutputHead` runs the model's own `forward` with the
decoder standing aside and handing back the given states: the rest of `forward` is the model's. It checks at
construction, on a few tokens, that this equals the model's plain forward; a model whose forward does not go
through its decoder that way is refused (`UnsupportedModel`) rather than replayed wrongly.
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions


class UnsupportedModel(TypeError):
    """The trusted side cannot replay this model's logits from its final hidden states."""


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose `last_hidden_state` is the LM head's input (transformers' `get_decoder()`)."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    if decoder is None or decoder is model or getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise UnsupportedModel(f"{type(model).__name__}: expected a transformers causal LM (a decoder and an output "
                               "embedding)")
    return decoder


class OutputHead:
    """`head(states)`: the model's logits [n, vocab] for final hidden states [n, hidden] (the decoder's output).

    The model's forward runs on a placeholder input of n tokens whose decoder returns `states`; the decoder's
    `forward` is swapped for that call only, under a lock (one head per model, callers on several threads are
    serialised). Costs the LM head and the post-processing, nothing of the layers.
    """

    def __init__(self, model: torch.nn.Module, check: bool = True):
        self.model = model
        self.decoder = decoder_of(model)
        self._lock = threading.Lock()
        if check:
            self._check()

    @torch.inference_mode()
    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        if states.ndim != 2:
            raise ValueError(f"expected states [n, hidden], got {tuple(states.shape)}")
        given = BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=states[None])
        placeholder = torch.zeros((1, states.shape[0]), dtype=torch.long, device=states.device)
        with self._lock:
            self.decoder.forward = lambda *_a, **_k: given  # an instance attribute: nn.Module.__call__ takes it
            try:
                out = self.model(input_ids=placeholder, use_cache=False)
            finally:
                del self.decoder.forward
        return out.logits[0]

    @torch.inference_mode()
    def _check(self) -> None:
        """The model's plain forward and decoder-then-head agree on a few tokens; otherwise UnsupportedModel."""
        vocab = self.model.get_output_embeddings().weight.shape[0]
        device = next(self.model.parameters()).device
        ids = (torch.arange(1, 9, device=device) * 7919 % max(vocab - 1, 1))[None]
        training = self.model.training
        self.model.eval()  # dropout (GPT-2's, in a freshly built model) would make two forwards differ
        try:
            whole = self.model(input_ids=ids, use_cache=False).logits[0].float()
            states = self.decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
            got = self(states).float()
        finally:
            self.model.train(training)
        err = float((got - whole).abs().max())
        scale = float(whole.abs().max().clamp_min(1.0))
        if not err <= 1e-3 * scale:
            raise UnsupportedModel(f"{type(self.model).__name__}: its forward does not turn its decoder's output into "
                                   f"logits as expected (max difference {err:.3g}); cannot replay it")


_HEADS: weakref.WeakKeyDictionary[torch.nn.Module, OutputHead] = weakref.WeakKeyDictionary()
_HEADS_LOCK = threading.Lock()


def head_of(model: torch.nn.Module) -> OutputHead:
    """The model's `OutputHead`, built and checked once per model object (new weights loaded in place keep it)."""
    with _HEADS_LOCK:
        head = _HEADS.get(model)
        if head is None:
            head = _HEADS[model] = OutputHead(model)
        return head
