"""A vLLM v1 logits processor that turns greedy decoding into the protocol's replayable Gumbel-max sampling.

Requests run at temperature 0 (greedy); for every row whose SamplingParams carry a seed in
`extra_args[SEED_KEY]`, `apply` computes the protocol's perturbed scores, logits / T + gumbel_noise(seed, i),
with i = the number of tokens generated so far, and leaves only their argmax selectable. vLLM's greedy pick is
then exactly the protocol's sample. The engine is built with `logit_scale = 1/T`, so the logits arriving here
are already divided by T (and vLLM's raw logprobs are log_softmax(logits / T), taken before this processor).

Imports vLLM: load it only inside a process that runs a vLLM engine.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from protocol import sampling

SEED_KEY = "swarmrl_seed"
"""Key of the rollout seed in `SamplingParams.extra_args`."""


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
        # batch row -> (seed, the request's live list of output token ids)
        self._rows: dict[int, tuple[int, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        # It changes the argmax: returning False makes vLLM run it before greedy sampling.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: SamplingParams, _prompt: list[int] | None, output_ids: list[int]):
            seed = (params.extra_args or {}).get(SEED_KEY)
            return None if seed is None else (int(seed), output_ids)

        process_dict_updates(self._rows, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        rows = sorted(self._rows)
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
