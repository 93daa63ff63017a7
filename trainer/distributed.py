"""The GRPO step under FSDP (torch.distributed: gloo on CPU, nccl on GPUs), launched with torchrun.

Data parallel with sharded parameters (FSDP2, `fully_shard`): every rank holds the whole batch (rank 0
pulled it and broadcast it), takes its contiguous slice of the rows, and runs `grpo.grpo_step` on it with
two adjustments that make the result equal to the one-process step on the whole batch:

- the token-mean divides by the token count of the *whole* batch, not the slice;
- FSDP averages gradients over ranks, so each rank's loss is multiplied by the world size to turn the
  average back into the sum of the slices' contributions.

Grad-norm clipping sees the global norm (the parameters are DTensors), and the stat sums are all-reduced.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoModelForCausalLM, PreTrainedModel

from swarmrl.protocol.run import CorrectionSpec
from swarmrl.trainer.grpo import NO_CORRECTION, Batch, GRPOConfig, grpo_step


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job. A plain run is rank 0 of 1, not distributed."""

    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str = "cpu") -> torch.device:
    """The torch device for `device` ('cpu', 'cuda', 'auto'); a GPU process uses its LOCAL_RANK's GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)


def init_distributed(device: str = "cpu", timeout_s: float = 1800.0) -> DistEnv:
    """Join the torchrun job described by the environment (WORLD_SIZE, RANK, MASTER_ADDR...), if any.

    Without torchrun (WORLD_SIZE unset or 1) this does nothing and returns rank 0 of 1; a process group
    that already exists is joined as is. Backend: gloo on CPU; on GPUs nccl for CUDA tensors and gloo for
    the few CPU ones (counters). The long timeout is on purpose: ranks other than 0 wait in a collective
    while rank 0 waits for groups from the swarm.
    """
    if dist.is_available() and dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    backend = "cpu:gloo,cuda:nccl" if resolve_device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return DistEnv(dist.get_rank(), dist.get_world_size())


def broadcast_object(obj: Any, env: DistEnv) -> Any:
    """Rank 0's `obj` on every rank (pickled); the identity when not distributed."""
    if not env.distributed:
        return obj
    box = [obj if env.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wrap_classes(model: PreTrainedModel) -> set[str]:
    """Names of the module classes that become FSDP units: the model's `_no_split_modules` (its decoder layer
    class, as transformers declares it for every architecture)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: cannot tell its layers apart")
    return names


def shard_model(model: PreTrainedModel) -> PreTrainedModel:
    """Wrap `model` in FSDP2 in place: one unit per module of a `wrap_classes` class (the decoder layers), plus
    the root (embeddings, tied head, final norm)."""
    from torch.distributed.fsdp import fully_shard

    names = wrap_classes(model)
    units = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not units:
        raise ValueError(f"no module of {sorted(names)} in {type(model).__name__}")
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    return model


def pad_rows(batch: Batch, multiple: int) -> Batch:
    """`batch` with copies of its first row appended (loss-masked out) until its size is a multiple.

    Every rank must run the same number of forward passes (each one is a collective), so every rank gets
    the same number of rows. A copy of a real row, rather than an all-padding one, keeps attention finite.
    """
    extra = (-len(batch)) % multiple
    if extra == 0:
        return batch
    filler = batch.rows(torch.zeros(extra, dtype=torch.long))
    filler.loss_mask = torch.zeros_like(filler.loss_mask)
    return Batch(*(torch.cat([getattr(batch, f), getattr(filler, f)]) for f in
                   ("input_ids", "attention_mask", "loss_mask", "sampler_logprobs", "advantages", "rewards")))


def rank_slice(batch: Batch, env: DistEnv) -> Batch:
    """This rank's contiguous share of the rows of `batch` (padded so every rank's share is the same size)."""
    padded = pad_rows(batch, env.world_size)
    n = len(padded) // env.world_size
    return padded.rows(slice(env.rank * n, (env.rank + 1) * n))


def _all_reduce_sum(t: Tensor) -> Tensor:
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def fsdp_grpo_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: GRPOConfig,
    env: DistEnv,
    *,
    temperature: float = 1.0,
    grad_clip: float = 1.0,
    micro_batch_size: int = 0,
    ref_model: nn.Module | None = None,
    correction: CorrectionSpec = NO_CORRECTION,
) -> dict[str, float]:
    """One GRPO step of an FSDP-sharded `model` on the global `batch` (the same on every rank).

    Promises: the same parameters, loss and stats as `grpo.grpo_step` on the whole batch in one process
    (up to float summation order). Every rank must call it with the same batch.
    """
    if not env.distributed:
        return grpo_step(model, optimizer, batch, cfg, temperature=temperature, grad_clip=grad_clip,
                         micro_batch_size=micro_batch_size, ref_model=ref_model, correction=correction)
    local = rank_slice(batch, env)
    return grpo_step(
        model, optimizer, local, cfg,
        temperature=temperature,
        grad_clip=grad_clip,
        micro_batch_size=micro_batch_size,
        ref_model=ref_model,
        normaliser=max(float(batch.num_tokens), 1.0),
        loss_scale=float(env.world_size),
        reduce_sums=_all_reduce_sum,
        correction=correction,
    )


def all_reduce_int(value: int, env: DistEnv) -> int:
    """The sum of `value` over ranks."""
    if not env.distributed:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv
               ) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
    """Unsharded (model, optimizer) state dicts, parameter-name keyed. A collective under FSDP: call on all
    ranks; rank 0 gets the full dicts, the others empty ones."""
    msd = get_model_state_dict(model, options=_FULL)
    osd = get_optimizer_state_dict(model, optimizer, options=_FULL) if optimizer is not None else None
    return msd, osd


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The parameter-name keyed optimizer state of an unsharded model, on the CPU (no collective)."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a full, name-keyed optimizer state (from `full_state`) into a sharded or plain optimizer."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def unsharded_copy(model: PreTrainedModel, state_dict: dict[str, Tensor]) -> PreTrainedModel:
    """A plain model of the checkpoint's own class holding `state_dict` (rank 0's gathered weights) without
    copying them.

    Saving through it keeps the checkpoint an ordinary HF one (an FSDP-wrapped model would record its
    wrapper class as the architecture).
    """
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(model.config)
    plain.load_state_dict(state_dict, assign=True, strict=False)
    plain.tie_weights()
    plain.generation_config = copy.deepcopy(model.generation_config)  # its stop tokens; from_config has only one
    return plain
