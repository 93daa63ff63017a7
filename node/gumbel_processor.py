"""A vLLM v1 logits processor that turns greedy decoding into the protocol's replayable Gumbel-max sampling.

Requests run at temperature 0 (greedy); for every row whose SamplingParams carry a seed in `extra_args[SEED_KEY]`
(and their temperature in `extra_args[TEMP_KEY]`), `apply` computes the protocol's sample (`protocol.sampling.
sample_with_logprobs`: the two-level Gumbel-max of z / T with the noise of (seed, i), i = the number of tokens
generated so far) on the device of the logits, and leaves only that token selectable. vLLM's greedy pick is then
exactly the protocol's sample. The temperature is applied here, not by the model: some vLLM model classes ignore
a `logit_scale` override (Qwen2 and Qwen3 build their logits processor without a scale), and doing it here lets
every request of one engine have its own temperature.

Per request (`extra_args[CAPTURE_KEY]`, an id the engine picks) `apply` also records, at each completion position:
- the policy logprob of the sampled token, log_softmax(z / T)[token], taken before the noise: the engine returns
  these instead of vLLM's logprobs (which would be of z, not z / T);
- with `extra_args[STATES_KEY]` set, the final hidden state that produced the row's logits, for the activation
  proof (captured by `install_hidden_capture`, a forward pre-hook on the model's `logits_processor` module, whose
  input is exactly the hidden states of the rows being sampled, in the same row order).
The engine collects both after generation with `take_records` (through `LLM.apply_model`, so it also works when
the worker runs in another process). Logprobs stay on the device until then (no host copy per step); states go to
host memory per step, so GPU memory does not grow with completion length.

Imports vLLM: load it only inside a process that runs a vLLM engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from swarmrl.protocol import sampling

SEED_KEY = "swarmrl_seed"
"""Key of the rollout seed in `SamplingParams.extra_args`."""
TEMP_KEY = "swarmrl_temperature"
"""Key of the rollout's sampling temperature in `SamplingParams.extra_args`."""
CAPTURE_KEY = "swarmrl_capture_key"
"""Key of a request's record id in `SamplingParams.extra_args`: its logprobs (and states) are recorded under it."""
POSITION_KEY = "swarmrl_position"
"""Key of the completion position of a request's first sampled token in `SamplingParams.extra_args` (0 if absent):
a completion continued after a weight update samples on from where its tokens end."""
STATES_KEY = "swarmrl_states"
"""Key of a flag in `SamplingParams.extra_args`: record the request's hidden states too (for proofs)."""


@dataclass(frozen=True)
class _Row:
    seed: int
    temperature: float
    output_ids: list[int]
    """The request's live list of output token ids (vLLM appends to it): its length is the position."""
    key: int | None
    states: bool
    offset: int = 0
    """The completion position of the request's first output token."""


# Worker-side state (one vLLM engine per process). The pre-hook stores the hidden states handed to the LM head;
# `apply`, which runs right after in the same step, takes the seeded rows' states from it.
_pending_hidden: torch.Tensor | None = None
_step_logprobs: list[tuple[list[int], list[int], torch.Tensor, torch.Tensor]] = []
"""Per step: (capture keys, positions, logprobs and sampled tokens on the logits' device) of the recorded rows."""
_tokens: dict[int, list[int] | None] = {}
"""What the last `take_records` found of each key's sampled tokens (`taken_tokens`)."""
_states: dict[int, dict[int, torch.Tensor]] = {}


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


def take_records(keys: list[int], _model: torch.nn.Module | None = None
                 ) -> dict[int, tuple[list[float] | None, torch.Tensor | None]]:
    """Run through `LLM.apply_model` (with `functools.partial`): per key, (the logprobs of positions 0..n-1, the
    states [n, hidden] float32 (row i produced token i)); either is None when a position is missing or nothing was
    recorded. Forgets everything recorded."""
    logprobs: dict[int, dict[int, float]] = {}
    tokens: dict[int, dict[int, int]] = {}
    # One device-to-host copy for the whole generation; then in step order (a later record of a position wins).
    values = torch.cat([v for _, _, v, _ in _step_logprobs]).cpu().tolist() if _step_logprobs else []
    picked = torch.cat([w for _, _, _, w in _step_logprobs]).cpu().tolist() if _step_logprobs else []
    flat = ((k, p) for step_keys, positions, _, _ in _step_logprobs for k, p in zip(step_keys, positions, strict=True))
    for (key, pos), value, token in zip(flat, values, picked, strict=True):
        logprobs.setdefault(key, {})[pos] = value
        tokens.setdefault(key, {})[pos] = int(token)
    out = {key: (_in_order(logprobs.get(key, {})), _stack(_states.get(key, {}))) for key in keys}
    _tokens.clear()
    _tokens.update({key: _in_order(tokens.get(key, {})) for key in keys})
    _step_logprobs.clear()
    _states.clear()
    return out


def taken_tokens(keys: list[int], _model: torch.nn.Module | None = None) -> dict[int, list[int] | None]:
    """Run through `LLM.apply_model` after `take_records`: per key, the tokens it sampled at positions 0..n-1 (for a
    request stopped before it ended, whose output vLLM does not hand back)."""
    return {key: _tokens.get(key) for key in keys}


def _in_order(by_pos: dict) -> list | None:
    n = len(by_pos)
    return [by_pos[i] for i in range(n)] if n and all(i in by_pos for i in range(n)) else None


def _stack(by_pos: dict[int, torch.Tensor]) -> torch.Tensor | None:
    n = len(by_pos)
    return torch.stack([by_pos[i] for i in range(n)]) if n and all(i in by_pos for i in range(n)) else None


class GumbelSamplingProcessor(LogitsProcessor):
    """Samples each seeded row by the protocol's rule (its temperature, its noise); rows without a seed are left
    untouched."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args or {}
        seed = extra.get(SEED_KEY)
        if seed is None:
            return
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"extra_args[{SEED_KEY!r}] must be an int, got {seed!r}")
        temperature = extra.get(TEMP_KEY)
        if not isinstance(temperature, int | float) or isinstance(temperature, bool) or not temperature > 0:
            raise ValueError(f"extra_args[{TEMP_KEY!r}] must be a number > 0, got {temperature!r}")
        if sampling_params.temperature != 0.0:
            # At T > 0 vLLM would sample randomly from the processed logits: the result would not replay.
            raise ValueError(f"requests with extra_args[{SEED_KEY!r}] must use temperature=0 (greedy)")

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        # It changes the argmax: returning False makes vLLM run it before greedy sampling.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: SamplingParams, _prompt: list[int] | None, output_ids: list[int]) -> _Row | None:
            extra = params.extra_args or {}
            if extra.get(SEED_KEY) is None:
                return None
            key = extra.get(CAPTURE_KEY)
            return _Row(seed=int(extra[SEED_KEY]), temperature=float(extra[TEMP_KEY]), output_ids=output_ids,
                        key=None if key is None else int(key), states=bool(extra.get(STATES_KEY, False)),
                        offset=int(extra.get(POSITION_KEY, 0)))

        process_dict_updates(self._rows, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        global _pending_hidden
        hidden, _pending_hidden = _pending_hidden, None  # used by this step only, never by a later one
        if not self._rows:
            return logits
        rows = sorted(self._rows)
        state = [self._rows[r] for r in rows]
        dev = logits.device
        # The output list is live (vLLM appends each sampled token, or a placeholder under async scheduling),
        # so its length is the completion position of the token sampled now.
        positions = [len(s.output_ids) for s in state]
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        seeds = torch.tensor([s.seed for s in state], dtype=torch.int64, device=dev)
        temps = torch.tensor([s.temperature for s in state], dtype=torch.float64, device=dev)
        every_row = len(rows) == logits.shape[0]
        winners, logprobs = sampling.sample_with_logprobs(logits if every_row else logits[idx], seeds,
                                                          torch.tensor([p + s.offset for p, s in zip(positions, state,
                                                                       strict=True)], device=dev), temps)
        self._record(rows, state, positions, logprobs, winners, hidden, logits.shape[0])
        # Only the winner stays finite. The argmax was taken in float64, as the protocol does: rounding perturbed
        # scores back to the logits' dtype could otherwise flip near-ties.
        logits.index_fill_(0, idx, float("-inf"))
        logits[idx, winners] = 0.0
        return logits

    def _record(self, rows: list[int], state: list[_Row], positions: list[int], logprobs: torch.Tensor,
                winners: torch.Tensor, hidden: torch.Tensor | None, n_logits: int) -> None:
        """Keep each keyed row's logprob (and, when asked, hidden state) at its completion position. A step whose
        hidden states do not line up with the logits rows records no state, so the affected proofs come out
        incomplete (None), not wrong."""
        keyed = [i for i, s in enumerate(state) if s.key is not None]
        if not keyed:
            return
        pick = torch.tensor(keyed, dtype=torch.long, device=logprobs.device)
        _step_logprobs.append(([state[i].key for i in keyed], [positions[i] for i in keyed],  # type: ignore[misc]
                               logprobs[pick], winners[pick]))
        with_states = [i for i in keyed if state[i].states]
        if not with_states or hidden is None or hidden.shape[0] != n_logits:
            return
        at = torch.tensor([rows[i] for i in with_states], dtype=torch.long, device=hidden.device)
        for i, vec in zip(with_states, hidden[at].float().cpu(), strict=True):
            _states.setdefault(state[i].key, {})[positions[i]] = vec.clone()  # type: ignore[arg-type]
