"""The FSDP step (2 processes, gloo on CPU) equals the one-process step on the same batch.

Spawns 2 ranks with torch.multiprocessing; each shards the tiny model with FSDP2, takes one GRPO step on
its half of a fixed batch (5 rollouts: uneven on purpose, so one rank gets a padding row), and rank 0
gathers the full weights. Also checks the sharded save path and the sharded greedy evaluation.
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from swarmrl.protocol.run import CorrectionSpec
from swarmrl.protocol.tasks import TaskSpec, load_task
from swarmrl.testing.groups import training_group
from swarmrl.trainer.evaluate import correct_count
from swarmrl.trainer.grpo import Batch, GRPOConfig, build_batch, grpo_step, make_optimizer
from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=1, intermediate_size=64, seed=0)
EVAL_N = 24
SCENARIOS = {
    "plain": (GRPOConfig(), 0, CorrectionSpec()),
    # KL to a sharded reference, micro-batches of 2
    "kl_micro": (GRPOConfig(kl_coef=0.1, clip_high=0.1), 2, CorrectionSpec()),
    # The mismatch corrections: truncation and masking, their shares summed over ranks and micro-batches.
    "corrected_micro": (GRPOConfig(), 2, CorrectionSpec(tis_cap=1.5, mask_band=(0.3, 3.0))),
}


def fixed_batch(tok) -> Batch:
    """Two groups (3 + 2 rollouts) with sampler logprobs off the model's, so some tokens clip."""
    gen = torch.Generator().manual_seed(0)

    def group(gid, prompt, texts, rewards):
        comps = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
        lps = [(-2.5 + 0.8 * torch.randn(len(c), generator=gen)).tolist() for c in comps]
        return training_group(group_id=gid, policy_version=0, prompt_ids=tok(prompt).input_ids, completions=comps,
                             logprobs=lps, finish_reasons=["stop"] * len(comps), rewards=rewards)

    return build_batch([group(1, "12+34=", ["46", "99", "4"], [1.0, 0.0, 0.2]),
                        group(2, "50+21=", ["71", "712"], [1.0, 0.1])], tok.pad_token_id)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from swarmrl.trainer.distributed import DistEnv, fsdp_grpo_step, full_state, shard_model, unsharded_copy
    from swarmrl.trainer.state import TrainerState, save_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    env = DistEnv(rank, world)
    try:
        tok = build_tokenizer()
        batch = fixed_batch(tok)
        results = {}
        for name, (cfg, micro, correction) in SCENARIOS.items():
            model = shard_model(build_model(TINY, tok))
            ref = shard_model(build_model(TINY, tok)) if cfg.kl_coef > 0 else None
            if ref is not None:  # a reference that differs from the policy, so the KL is not zero
                with torch.no_grad():
                    for p in ref.parameters():
                        p.mul_(0.9)
            opt = make_optimizer(model, lr=1e-3)
            stats = fsdp_grpo_step(model, opt, batch, cfg, env, grad_clip=1.0, micro_batch_size=micro,
                                   ref_model=ref, correction=correction)
            msd, osd = full_state(model, opt, env)
            if rank == 0:
                results[name] = {"stats": stats, "params": msd, "optim": osd}
                if name == "plain":
                    save_state(Path(out_dir) / "state", unsharded_copy(model, msd), tok, osd,
                               TrainerState(step=1, version=1, cursor=7))
            if name == "plain":
                task = load_task(TaskSpec())
                problems = task.eval_set()[:EVAL_N]
                correct = correct_count(model, tok, problems[rank::world], task,
                                        synced_gpus=True)
                t = torch.tensor([correct])
                dist.all_reduce(t)
                results["eval_correct"] = int(t.item())
        if rank == 0:
            torch.save(results, Path(out_dir) / "results.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    init_file = tempfile.mktemp(dir=out, prefix="pg-")
    mp.spawn(_worker, args=(2, init_file, str(out)), nprocs=2, join=True)
    return out, torch.load(out / "results.pt", weights_only=False)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fsdp_step_equals_single_process_step(fsdp_results, name):
    _, results = fsdp_results
    torch.set_num_threads(1)
    cfg, micro, correction = SCENARIOS[name]
    tok = build_tokenizer()
    batch = fixed_batch(tok)
    model = build_model(TINY, tok)
    ref = None
    if cfg.kl_coef > 0:
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(0.9)
    opt = make_optimizer(model, lr=1e-3)
    stats = grpo_step(model, opt, batch, cfg, grad_clip=1.0, micro_batch_size=micro, ref_model=ref,
                      correction=correction)

    got = results[name]
    if correction.tis_cap is None:
        assert 0 < stats["clip_fraction"] < 1  # the batch exercises both clipped and unclipped tokens
    else:  # ... and tokens truncated, masked and neither
        assert 0 < stats["truncated_fraction"] and 0 < stats["masked_fraction"]
        assert stats["truncated_fraction"] + stats["masked_fraction"] < 1
    for key in ("loss", "tokens", "clip_fraction", "mean_abs_ratio_minus_1", "entropy", "kl", "grad_norm",
                "truncated_fraction", "masked_fraction"):
        assert got["stats"][key] == pytest.approx(stats[key], abs=1e-5), key
    if cfg.kl_coef > 0:
        assert got["stats"]["kl"] > 0
    single = model.state_dict()
    for k, v in got["params"].items():
        assert torch.allclose(v, single[k], atol=1e-5), k
    # ... and the parameters actually moved (so the comparison above is not vacuous).
    fresh = build_model(TINY, tok).state_dict()
    assert max((single[k] - fresh[k]).abs().max().item() for k in single) > 1e-4


def test_fsdp_save_and_eval_match(fsdp_results):
    out, results = fsdp_results
    from swarmrl.trainer.distributed import optimizer_state
    from swarmrl.trainer.state import latest, load_state

    loaded = load_state(latest(out / "state"))
    assert loaded.state.version == 1 and loaded.state.cursor == 7
    import json

    assert json.loads((loaded.path / "model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    for k, v in loaded.model.state_dict().items():
        assert torch.allclose(v, results["plain"]["params"][k]), k
    # The name-keyed optimizer state loads into a plain (unsharded) optimizer.
    opt = make_optimizer(loaded.model)
    from swarmrl.trainer.distributed import load_optimizer_state

    load_optimizer_state(loaded.model, opt, loaded.optimizer)
    mine = optimizer_state(loaded.model, opt)["state"]
    theirs = results["plain"]["optim"]["state"]
    for k in theirs:
        assert torch.allclose(mine[k]["exp_avg"], theirs[k]["exp_avg"]), k
    # Sharded greedy evaluation (synced generation, shares summed) = one-process evaluation.
    task = load_task(TaskSpec())
    assert results["eval_correct"] == correct_count(loaded.model, loaded.tokenizer, task.eval_set()[:EVAL_N], task)


# -- run_trainer under torchrun-style launch ------------------------------------------------------------


def _trainer_worker(rank: int, world: int, init_file: str, tmp: str, init: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from swarmrl.trainer.loop import run_trainer
    from tests.support.trainer import FakeCoordinator, trainer_cfg

    # torchrun would set RANK/WORLD_SIZE/MASTER_* and let run_trainer join by env://; a file rendezvous
    # needs no free port. run_trainer then joins the existing group.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fake = FakeCoordinator(Path(tmp)) if rank == 0 else None  # only rank 0 talks to the coordinator
        cfg = trainer_cfg(Path(tmp), Path(init), state_dir=str(Path(tmp) / "fsdp-state"), max_steps=2, eval_every=2)
        summary = run_trainer(cfg, client=fake)
        if rank == 0:
            torch.save({"versions": [m.version for m in fake.published], "metrics": fake.metrics_posted,
                        "cursor": summary.cursor}, Path(tmp) / "fsdp-run.pt")
    finally:
        dist.destroy_process_group()


def test_run_trainer_under_fsdp_matches_one_process(tmp_path):
    """run_trainer on 2 ranks (rank 0 pulls and broadcasts; all step; rank 0 saves and publishes) trains the
    same weights and reports the same numbers as run_trainer in one process, against the same coordinator."""
    from swarmrl.trainer.loop import run_trainer
    from swarmrl.trainer.model import load_checkpoint, save_checkpoint
    from swarmrl.trainer.state import latest, load_state
    from tests.support.trainer import FakeCoordinator, trainer_cfg

    torch.set_num_threads(1)
    tok = build_tokenizer()
    init = save_checkpoint(build_model(TINY, tok), tok, tmp_path / "init")
    init_file = tempfile.mktemp(dir=tmp_path, prefix="pg-")
    mp.spawn(_trainer_worker, args=(2, init_file, str(tmp_path), str(init)), nprocs=2, join=True)
    got = torch.load(tmp_path / "fsdp-run.pt", weights_only=False)

    fake = FakeCoordinator(tmp_path / "single")
    cfg = trainer_cfg(tmp_path, init, state_dir=str(tmp_path / "one-state"), max_steps=2, eval_every=2)
    summary = run_trainer(cfg, client=fake)

    assert got["versions"] == [m.version for m in fake.published] == [0, 1, 2]
    assert got["cursor"] == summary.cursor
    for (s1, v1, m1), (s2, v2, m2) in zip(got["metrics"], fake.metrics_posted, strict=True):
        assert (s1, v1) == (s2, v2)
        for key in ("loss", "clip_fraction", "entropy", "reward_mean", "groups_used", "groups_stale", "eval_accuracy"):
            if key in m2:
                assert m1[key] == pytest.approx(m2[key], abs=1e-5), key
    fsdp_state = load_state(latest(tmp_path / "fsdp-state"))
    one, _ = load_checkpoint(latest(cfg.state_dir) / "model")
    assert fsdp_state.state.version == 2
    for k, v in one.state_dict().items():
        assert torch.allclose(fsdp_state.model.state_dict()[k], v, atol=1e-5), k
