"""A vLLM v1 logits processor that turns greedy decoding into the protocol's replayable Gumbel-max sampling.

Requests run at temperature 0 (greedy); for every row whose SamplingParams carry a seed in
`extra_args[SEED_KEY]`, `apply` computes the protocol's perturbed scores, logits / T + gumbel_noise(seed, i),
with i = the number of tokens generated so far, and leaves only their argmax selectable. vLLM's greedy pick is
then exactly the protocol's sample. The engine is built with `logit_scale = 1/T`, so the logits arriving here
are already divided by T (and vLLM's raw logprobs are log_softmax(logits / T), taken before this processor).

Activation proofs: for rows whose SamplingParams carry a key in `extra_args[PROOF_KEY]`, `apply` also records
the final hidden state that produced the row's logits (captured by `install_hidden_capture`, a forward pre-hook
on the model's `logits_processor` module, whose input is exactly the hidden states of the rows being sampled, in
the same row order). The engine collects them after generation with `take_captured` (through
`LLM.apply_model`, so it also works when the worker runs in another process).

Imports vLLM: load it only inside a process that runs a vLLM engine.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from swarmrl.protocol import sampling

SEED_KEY = "swarmrl_seed"
"""Key of the rollout seed in `SamplingParams.extra_args`."""
PROOF_KEY = "swarmrl_proof_key"
"""Key of a request's capture id in `SamplingParams.extra_args`: its hidden states are recorded when set."""

# Worker-side capture state (one vLLM engine per process). The pre-hook stores the hidden states handed to the
# LM head; `apply`, which runs right after in the same step, takes the seeded rows' states from it.
_pending_hidden: torch.Tensor | None = None
_captured: dict[int, dict[int, torch.Tensor]] = {}


def _capture_pre_hook(_module: torch.nn.Module, args: tuple) -> None:
    global _pending_hidden
    _pending_hidden = args[1] if len(args) > 1 else None


def install_hidden_capture(model: torch.nn.Module) -> bool:
    """Run through `LLM.apply_model`: hook the model's `logits_processor` so that its input hidden states (the
    final norm's output at the rows being sampled) are visible to `GumbelSamplingProcessor.apply`. Idempotent;
    the hook survives in-place weight reloads (it is on the module, not on the weights)."""
    module = getattr(model, "logits_processor", None)
    if module is None:
        raise RuntimeError(f"{type(model).__name__} has no logits_processor module: cannot capture hidden states")
    if not getattr(module, "_swarmrl_capture", False):
        module.register_forward_pre_hook(_capture_pre_hook)
        module._swarmrl_capture = True
    return True


def take_captured(keys: list[int], _model: torch.nn.Module | None = None) -> dict[int, torch.Tensor | None]:
    """Run through `LLM.apply_model` (with `functools.partial`): the recorded states of each key as [n, hidden]
    float32 (row i produced token i), or None when a position is missing. Forgets everything recorded."""
    out: dict[int, torch.Tensor | None] = {}
    for key in keys:
        rows = _captured.get(key, {})
        n = len(rows)
        out[key] = torch.stack([rows[i] for i in range(n)]) if n and all(i in rows for i in range(n)) else None
    _captured.clear()
    return out


class GumbelSamplingProcessor(LogitsProcessor):
    """Adds the seeded Gumbel noise of the protocol to each seeded row; rows without a seed are untouched."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        seed = (sampling_params.extra_args or {}).get(SEED_KEY)
        if seed is None:
            return
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"extra_args[{SEED_KEY!r}] must be an int, got {seed!r}")
        if sampling_params.temperature != 0.0:
            # At T > 0 vLLM would sample randomly from the perturbed logits: the result would not replay.
            raise ValueError(f"requests with extra_args[{SEED_KEY!r}] must use temperature=0 (greedy)")

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (seed, the request's live list of output token ids, proof capture key or None)
        self._rows: dict[int, tuple[int, list[int], int | None]] = {}

    def is_argmax_invariant(self) -> bool:
        # It changes the argmax: returning False makes vLLM run it before greedy sampling.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: SamplingParams, _prompt: list[int] | None, output_ids: list[int]):
            extra = params.extra_args or {}
            seed = extra.get(SEED_KEY)
            key = extra.get(PROOF_KEY)
            return None if seed is None else (int(seed), output_ids, None if key is None else int(key))

        process_dict_updates(self._rows, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        global _pending_hidden
        hidden, _pending_hidden = _pending_hidden, None  # used by this step only, never by a later one
        if not self._rows:
            return logits
        rows = sorted(self._rows)
        self._record_states(rows, hidden, logits.shape[0])
        # The output list is live (vLLM appends each sampled token, or a placeholder under async scheduling),
        # so its length is the completion position of the token sampled now.
        seeds = torch.tensor([self._rows[r][0] for r in rows], dtype=torch.int64)
        positions = torch.tensor([len(self._rows[r][1]) for r in rows], dtype=torch.int64)
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        # Logits are already z / T (logit_scale), hence temperature 1 here. The argmax is taken in float64, as
        # the protocol does, and only it is left finite: rounding perturbed scores back to the logits' dtype
        # could otherwise flip near-ties.
        winners = sampling.sample(logits[idx], seeds, positions, temperature=1.0)
        picked = torch.full((len(rows), logits.shape[-1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        picked[torch.arange(len(rows), device=logits.device), winners] = 0.0
        logits[idx] = picked
        return logits

    def _record_states(self, rows: list[int], hidden: torch.Tensor | None, n_logits: int) -> None:
        """Store each keyed row's hidden state at its completion position. A step whose hidden states do not line
        up with the logits rows records nothing, so the affected proofs come out incomplete (None), not wrong."""
        keyed = [r for r in rows if self._rows[r][2] is not None]
        if not keyed or hidden is None or hidden.shape[0] != n_logits:
            return
        states = hidden[torch.tensor(keyed, dtype=torch.long, device=hidden.device)].float().cpu()
        for r, state in zip(keyed, states, strict=True):
            _, output_ids, key = self._rows[r]
            _captured.setdefault(key, {})[len(output_ids)] = state.clone()
