"""Trainer state survives a kill; run_trainer resumes with monotonic versions and the right cursor (against
`tests.support.trainer.FakeCoordinator`, then against the real coordinator)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import CheckpointManifest
from swarmrl.protocol.run import RunSpec, SamplingSpec
from swarmrl.protocol.tasks import TaskSpec, load_task
from swarmrl.testing.groups import training_group
from swarmrl.trainer.distributed import optimizer_state
from swarmrl.trainer.grpo import GRPOConfig, build_batch, grpo_step, make_optimizer
from swarmrl.trainer.loop import run_trainer
from swarmrl.trainer.model import build_tokenizer, load_checkpoint
from swarmrl.trainer.state import (
    TrainerState,
    capture_rng,
    latest,
    list_states,
    load_state,
    prune_states,
    restore_rng,
    save_state,
)
from swarmrl.transfer.delta import rebuild
from swarmrl.transfer.store import assemble_checkpoint
from tests.support.trainer import FakeCoordinator, trainer_cfg

torch.set_num_threads(1)


# -- state on disk ----------------------------------------------------------------------------------


def test_state_round_trip_after_kill(tmp_path, init_ckpt):
    model, tok = load_checkpoint(init_ckpt)
    opt = make_optimizer(model, lr=1e-3)
    g = training_group(group_id=5, policy_version=0, prompt_ids=tok("12+34=").input_ids,
                      completions=[[10, 2], [13, 2]], logprobs=[[-2.0, -1.0], [-2.0, -1.0]],
                      finish_reasons=["stop"] * 2, rewards=[1.0, 0.0])
    grpo_step(model, opt, build_batch([g], tok.pad_token_id), GRPOConfig())
    torch.manual_seed(123)
    random.seed(7)
    rng = capture_rng()
    path = save_state(tmp_path / "st", model, tok, optimizer_state(model, opt),
                      TrainerState(step=1, version=1, cursor=5, run_id="r"), rng)
    expected_params = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = {k: {n: t.clone() for n, t in s.items()} for k, s in optimizer_state(model, opt)["state"].items()}
    want_torch, want_py = torch.rand(3), random.random()
    del model, opt  # "kill"

    # A half-written state (no trainer.json, as a kill mid-save would leave) is not a state.
    (tmp_path / "st" / "state-00000009" / "model").mkdir(parents=True)
    assert latest(tmp_path / "st") == path

    loaded = load_state(latest(tmp_path / "st"))
    assert (loaded.state.step, loaded.state.version, loaded.state.cursor, loaded.state.run_id) == (1, 1, 5, "r")
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v, expected_params[k]), k
    opt2 = make_optimizer(loaded.model, lr=1e-3)
    from swarmrl.trainer.distributed import load_optimizer_state

    load_optimizer_state(loaded.model, opt2, loaded.optimizer)
    got_opt = optimizer_state(loaded.model, opt2)["state"]
    assert got_opt.keys() == expected_opt.keys()
    for k, s in expected_opt.items():
        for n, t in s.items():
            assert torch.equal(got_opt[k][n], t), (k, n)
    restore_rng(loaded.rng)
    assert torch.equal(torch.rand(3), want_torch) and random.random() == want_py


def test_states_are_pruned_but_protected_ones_kept(tmp_path, init_ckpt):
    model, tok = load_checkpoint(init_ckpt)
    opt = make_optimizer(model)
    paths = [save_state(tmp_path / "st", model, tok, optimizer_state(model, opt), TrainerState(step=s, version=s))
             for s in range(4)]
    prune_states(tmp_path / "st", keep=2, protect={paths[0]})
    assert list_states(tmp_path / "st") == [paths[0], paths[2], paths[3]]


# -- the loop against a coordinator -----------------------------------------------------------------


def _received(published: list[CheckpointManifest], get_shard: Callable[[str], bytes], root: Path) -> Path:
    """The checkpoint of the last of `published` as a receiver of all of them makes it: a full one assembled, a
    delta rebuilt on the version before it."""
    out = root
    for m in published:
        out = root / f"v{m.version}"
        if m.delta is None:
            assemble_checkpoint(m, get_shard, out)
        else:
            staged = assemble_checkpoint(m, get_shard, root / f"staged-{m.version}")
            rebuild(root / f"v{m.delta.base_version}", staged, m.delta, out)
    return out


def test_run_trainer_resumes_with_monotonic_versions(tmp_path, init_ckpt):
    fake = FakeCoordinator(tmp_path)
    cfg = trainer_cfg(tmp_path, init_ckpt, max_steps=2)
    s1 = run_trainer(cfg, client=fake)
    # Version 0 (the initial model) was published before any training, then one version per step.
    assert [m.version for m in fake.published] == [0, 1, 2]
    assert (s1.step, s1.version) == (2, 2)
    assert s1.cursor == fake.next_id  # every group handed out was consumed (used, stale or filtered)
    # Each saved state's cursor is acknowledged after the save: one per step, never going back.
    assert len(fake.acked) == 2 and fake.acked == sorted(fake.acked) and fake.acked[-1] == s1.cursor

    by_step = {step: m for step, _, m in fake.metrics_posted}
    assert set(by_step) == {0, 1, 2} and "eval_accuracy" in by_step[0] and "eval_accuracy" in by_step[2]
    m = by_step[2]
    for key in ("reward_mean", "accuracy", "entropy", "clip_fraction", "mean_abs_ratio_minus_1", "kl", "loss",
                "staleness_0", "staleness_1", "staleness_2", "trainer_idle_s", "step_s", "groups_used",
                "groups_stale"):
        assert key in m, key
    for s in (1, 2):  # batch_groups fresh groups per step, the zero-advantage ones among them skipped
        assert by_step[s]["groups_used"] + by_step[s]["groups_filtered"] == cfg.batch_groups
        assert sum(v for k, v in by_step[s].items() if k.startswith("staleness_")) == by_step[s]["groups_used"]
    assert sum(by_step[s]["groups_stale"] for s in (1, 2)) > 0  # offset-3 groups are beyond k = 2
    assert sum(by_step[s]["groups_filtered"] for s in (1, 2)) > 0
    assert 0 < m["clip_fraction"] <= 1  # the fake's sampler logprobs are not the model's
    # The training clock (TRL's: setup and evaluations excluded) runs forward and behind the process clock.
    clocks = [by_step[s]["train_clock_s"] for s in (0, 1, 2)]
    assert 0 <= clocks[0] < clocks[1] < clocks[2] < m["elapsed_s"] - m["eval_total_s"]
    assert 0 < by_step[0]["eval_total_s"] < by_step[2]["eval_total_s"]  # two evaluations by step 2

    # "Kill" and restart with a larger budget: it resumes at step 2 and publishes 3, 4 only.
    s2 = run_trainer(cfg.model_copy(update={"max_steps": 4}), client=fake)
    assert [m.version for m in fake.published] == [0, 1, 2, 3, 4]
    assert (s2.step, s2.version) == (4, 4) and s2.cursor == fake.next_id
    assert fake.acked[2] == s1.cursor and fake.acked[-1] == s2.cursor  # the resumed state first, then each step's
    assert 0 not in {step for step, _, _ in fake.metrics_posted[len(by_step):]}  # no second step-0 eval
    assert len(list_states(cfg.state_dir)) == cfg.keep_states

    # What the coordinator received is exactly the trainer's newest weights: versions after the first of each
    # start go as deltas (full_every's default), rebuilt on the version before as a receiver does.
    assert [m.delta.base_version if m.delta else None for m in fake.published] == [None, 0, 1, None, 3]
    out = _received(fake.published, fake.store.get, tmp_path / "received")
    received, _ = load_checkpoint(out)
    saved = load_state(latest(cfg.state_dir))
    assert saved.state.version == 4
    for k, v in saved.model.state_dict().items():
        assert torch.equal(v, received.state_dict()[k]), k


def test_versions_stay_above_the_coordinators(tmp_path, init_ckpt):
    fake = FakeCoordinator(tmp_path)
    cfg = trainer_cfg(tmp_path, init_ckpt, max_steps=1, eval_every=0)
    run_trainer(cfg, client=fake)
    assert fake.version == 1
    # The coordinator moved on without us (say another trainer state was used): we continue above it.
    fake.version = 10
    summary = run_trainer(cfg.model_copy(update={"max_steps": 2}), client=fake)
    assert summary.version == 11 and fake.published[-1].version == 11


def test_a_lost_publish_is_made_up_at_restart(tmp_path, init_ckpt):
    fake = FakeCoordinator(tmp_path)
    cfg = trainer_cfg(tmp_path, init_ckpt, max_steps=1, eval_every=0, publish_in_background=False)
    run_trainer(cfg, client=fake)
    fake.fail_publish = 2  # the next version is saved but never reaches the coordinator (both tries fail)
    run_trainer(cfg.model_copy(update={"max_steps": 2}), client=fake)
    assert fake.version == 1 and load_state(latest(cfg.state_dir)).state.version == 2
    # Restart: the coordinator lacks our version 2, so it is published before any training.
    stop = threading.Event()
    stop.set()  # stop as soon as it would wait for groups
    summary = run_trainer(cfg.model_copy(update={"max_steps": 5}), client=fake, stop=stop)
    assert [m.version for m in fake.published] == [0, 1, 2] and summary.step == 2


def test_synchronous_mode_uses_only_current_version_groups(tmp_path, init_ckpt):
    fake = FakeCoordinator(tmp_path, offsets=(0, 1), max_staleness=0)
    cfg = trainer_cfg(tmp_path, init_ckpt, max_steps=2, eval_every=0)
    run_trainer(cfg, client=fake)
    for step, _, m in fake.metrics_posted:
        assert m["staleness_0"] == m["groups_used"] > 0 and "staleness_1" not in m, (step, m)
        assert m["groups_stale"] > 0


def test_zero_advantage_batches_are_skipped_or_refilled(tmp_path, init_ckpt):
    # The first 4 groups all have equal rewards: that whole batch is skipped, no version is made for it.
    fake = FakeCoordinator(tmp_path, offsets=(0,), flat_until=4)
    cfg = trainer_cfg(tmp_path, init_ckpt, max_steps=1, eval_every=0)
    summary = run_trainer(cfg, client=fake)
    assert [m.version for m in fake.published] == [0, 1] and summary.cursor == 8
    assert fake.metrics_posted[-1][2]["groups_used"] == 3  # groups 5..8, and 5 is flat too

    # Filling with informative groups (DAPO's dynamic sampling): every step trains on batch_groups groups.
    fake = FakeCoordinator(tmp_path / "fill", offsets=(0,), flat_until=2)
    cfg = trainer_cfg(tmp_path / "fill", init_ckpt, max_steps=2, eval_every=0, fill_with_informative=True)
    run_trainer(cfg, client=fake)
    for _, _, m in fake.metrics_posted:
        assert m["groups_used"] == cfg.batch_groups and m["groups_filtered"] >= 1


def _feed_swarm(url: str, verifier_key, stop: threading.Event) -> None:
    """A node and a verifier in one thread: lease, answer (right 40% of the time), verify, until `stop`."""
    from swarmrl.protocol.messages import Rollout, RolloutGroup, RolloutSubmission, Verdict
    from swarmrl.runtime.client import CoordinatorClient

    tok, task, rng = build_tokenizer(), load_task(TaskSpec()), random.Random(1)
    node = CoordinatorClient(url, Identity.generate())
    node.register(name="test-node", engine="fake")
    verifier = CoordinatorClient(url, verifier_key)
    try:
        while not stop.is_set():
            version = node.info().current_version
            lease = node.lease(4, held_version=version) if version >= 0 else None
            if lease is not None:
                groups = []
                for p in lease.prompts:
                    answer = str(sum(int(x) for x in p.text[:-1].split("+")))
                    texts = [answer if rng.random() < 0.4 else str(rng.randint(100, 1999)) for _ in p.seeds]
                    comps = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
                    groups.append(RolloutGroup(prompt_id=p.prompt_id, prompt_ids=tok(p.text).input_ids, rollouts=[
                        Rollout(seed=s, completion_ids=c, logprobs=[-2.4] * len(c), finish_reason="stop")
                        for s, c in zip(p.seeds, comps, strict=True)]))
                node.submit(RolloutSubmission(lease_id=lease.lease_id, policy_version=lease.policy_version,
                                              groups=groups))
            verdicts = []
            for pg in verifier.pending(64):
                texts = [tok.decode(r.completion_ids, skip_special_tokens=True) for r in pg.group.rollouts]
                verdicts.append(Verdict(group_id=pg.group_id, accepted=True,
                                        rewards=[task.reward(t, pg.answer) for t in texts]))
            if verdicts:
                verifier.verdicts(verdicts)
            stop.wait(0.05)
    finally:
        node.close()
        verifier.close()


def test_run_trainer_against_the_real_coordinator(tmp_path, init_ckpt):
    server = pytest.importorskip("swarmrl.coordinator.server", reason="swarmrl.coordinator.server is not there")
    if not hasattr(server, "running_server"):
        pytest.skip("swarmrl.coordinator.server.running_server is not there yet")
    from swarmrl.coordinator.config import CoordinatorConfig
    from swarmrl.runtime.client import CoordinatorClient

    trainer_key = Identity.load_or_create(tmp_path / "trainer.key")
    verifier_key = Identity.generate()
    ccfg = CoordinatorConfig(data_dir=tmp_path / "coord", port=0,
                             run=RunSpec(run_id="real-run", sampling=SamplingSpec(group_size=4, max_tokens=6)),
                             operator_keys=[trainer_key.public_key_hex, verifier_key.public_key_hex])
    with server.running_server(ccfg) as url:
        stop = threading.Event()
        feeder = threading.Thread(target=_feed_swarm, args=(url, verifier_key, stop), daemon=True)
        feeder.start()
        cfg = trainer_cfg(tmp_path, init_ckpt, coordinator_url=url, key_path=str(tmp_path / "trainer.key"),
                          max_steps=2, eval_every=2)
        try:
            first = run_trainer(cfg)
            # Kill and restart: it resumes at step 2 and goes on publishing above version 2.
            second = run_trainer(cfg.model_copy(update={"max_steps": 3}))
        finally:
            stop.set()
            feeder.join(timeout=30)
        with CoordinatorClient(url) as anon:
            signed, status, info = anon.latest_manifest(), anon.status(), anon.info()
            assert (first.version, second.version, info.current_version) == (2, 3, 3)
            manifest = signed.verify(info.coordinator_key)
            out = assemble_checkpoint(manifest, anon.shard, tmp_path / "got")
        received, _ = load_checkpoint(out)
        saved = load_state(latest(cfg.state_dir))
        for k, v in saved.model.state_dict().items():
            assert torch.equal(v, received.state_dict()[k]), k
        steps = [mt.step for mt in status.metrics]
        assert steps.count(0) == 1 and {1, 2, 3} <= set(steps)
        last = next(mt for mt in status.metrics if mt.step == 3)
        assert last.metrics["groups_used"] + last.metrics["groups_filtered"] == cfg.batch_groups
        assert "staleness_0" in last.metrics
