"""Malicious nodes: `node.agent.Node` subclasses (through `ScriptedNode`) that cheat in one way each.

The strong variants are used where there is one: a node that edits tokens, makes up completions or samples at
the wrong temperature also recomputes logprobs and activation proofs for what it submits with the *true*
model, so that only the check meant for that attack (replay) stands between it and the trainer.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from swarmrl.node.config import NodeConfig
from swarmrl.node.proof import build_proof
from swarmrl.protocol import messages as m
from swarmrl.testing.byzantine.harness import ScriptedNode, perturb_checkpoint
from swarmrl.trainer.model import save_checkpoint
from swarmrl.verifier.logprobs import policy_logprobs
from swarmrl.verifier.prefill import recompute
from swarmrl.verifier.replay import replay


class Truth:
    """The true policy, as a cheating node holding it could run it: logprobs and proofs for any tokens."""

    def __init__(self, ckpt: Path):
        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(ckpt)
        self.eos = int(self.tokenizer.eos_token_id)
        self.special = set(self.tokenizer.all_special_ids)
        self.ordinary = [i for i in range(len(self.tokenizer)) if i not in self.special]

    def annotate(self, prompt_ids: list[int], completion: list[int], temperature: float) -> tuple[list[float], str]:
        rc = recompute(self.model, [(prompt_ids, completion)], pad_id=0)[0]
        return policy_logprobs(rc.logits, completion, temperature).tolist(), build_proof(rc.states)


def _reannotate(r: m.Rollout, truth: Truth, prompt_ids: list[int], tokens: list[int], temperature: float,
                finish: str | None = None) -> m.Rollout:
    logprobs, proof = truth.annotate(prompt_ids, tokens, temperature)
    return r.model_copy(update={"completion_ids": tokens, "logprobs": logprobs, "proof": proof,
                                "finish_reason": finish or r.finish_reason})


class WrongModelNode(ScriptedNode):
    """Generates with other weights: the published ones perturbed by `frac`, or a model initialised from another
    seed. Everything else (logprobs, proofs, sampling rule) is honest for the weights it runs."""

    def __init__(self, cfg: NodeConfig, frac: float | None = None, other_seed: int | None = None, noise_seed: int = 1):
        super().__init__(cfg)
        self.frac, self.other_seed, self.noise_seed = frac, other_seed, noise_seed

    def adjust_checkpoint(self, path: Path) -> Path:
        out = self.cfg.work_dir / f"wrong-{path.name}"
        if self.frac is not None:
            return perturb_checkpoint(path, out, self.frac, self.noise_seed)
        torch.manual_seed(self.other_seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
        return save_checkpoint(model, PreTrainedTokenizerFast.from_pretrained(path), out)


class TemperatureNode(ScriptedNode):
    """Samples (with the leased seeds and rule) at `factor` x the leased temperature. `clever`: reports the
    policy's logprobs at the leased temperature, recomputed with the true model, instead of its engine's."""

    def __init__(self, cfg: NodeConfig, factor: float = 1.5, clever: bool = True):
        super().__init__(cfg)
        self.factor, self.clever = factor, clever
        self.deviated: bool | None = None
        """Whether any token differs from what the leased temperature gives: a confident model can sample the
        very same tokens at both temperatures, and then this node sent only honest groups."""

    def engine_temperature(self, leased: float) -> float:
        return leased * self.factor

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        truth = Truth(self.true_checkpoint)
        T = lease.sampling.temperature
        # Only the groups in which some token differs are dishonest; one whose tokens all came out the same is
        # an honest group, rightly accepted. So this node sends only the former (and none: honest, not judged).
        hot = [g for g in submission.groups if any(
            replay(recompute(truth.model, [(g.prompt_ids, r.completion_ids)], pad_id=0)[0].logits,
                   r.completion_ids, r.seed, T).mismatches > 0 for r in g.rollouts)]
        self.deviated = bool(hot)
        if not hot:
            return submission
        if self.clever:
            hot = [g.model_copy(update={"rollouts": [
                _reannotate(r, truth, g.prompt_ids, r.completion_ids, T) for r in g.rollouts]}) for g in hot]
        return submission.model_copy(update={"groups": hot})


Edit = Callable[[m.Rollout, list[int], Truth, random.Random, m.SamplingSpec], m.Rollout | None]
"""Changes one rollout (prompt ids given), or None when this rollout does not lend itself to the edit."""


class EditNode(ScriptedNode):
    """Honest generation, then `edit` applied to one rollout of every group (re-annotated with the true model)."""

    def __init__(self, cfg: NodeConfig, edit: Edit, seed: int = 0, truth: Truth | None = None):
        super().__init__(cfg)
        self.edit, self.rng = edit, random.Random(seed)
        self.truth = truth
        """The true model, if one is already loaded (attackers that come back under new keys share one)."""

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        truth = self.truth if self.truth is not None else Truth(self.true_checkpoint)
        groups = []
        for g in submission.groups:
            rollouts = list(g.rollouts)
            for i in self.rng.sample(range(len(rollouts)), len(rollouts)):
                edited = self.edit(rollouts[i], g.prompt_ids, truth, self.rng, lease.sampling)
                if edited is not None:
                    rollouts[i] = edited
                    break
            else:
                fallback = getattr(self.edit, "fallback", None)
                i = self.rng.randrange(len(rollouts))
                edited = fallback(rollouts[i], g.prompt_ids, truth, self.rng, lease.sampling) if fallback else None
                if edited is None:
                    raise RuntimeError("no rollout of the group could be edited")
                rollouts[i] = edited
            groups.append(g.model_copy(update={"rollouts": rollouts}))
        return submission.model_copy(update={"groups": groups})


def _other(tok: int, truth: Truth, rng: random.Random) -> int:
    return rng.choice([t for t in truth.ordinary if t != tok])


def edit_token(r, prompt_ids, truth, rng, sampling):
    """One token before the last replaced by another ordinary token."""
    ids = list(r.completion_ids)
    if len(ids) < 2:
        return None
    i = rng.randrange(len(ids) - 1)
    ids[i] = _other(ids[i], truth, rng)
    return _reannotate(r, truth, prompt_ids, ids, sampling.temperature)


def edit_span(r, prompt_ids, truth, rng, sampling):
    """Up to 4 consecutive tokens before the last replaced."""
    ids = list(r.completion_ids)
    if len(ids) < 3:
        return None
    span = min(4, len(ids) - 1)
    start = rng.randrange(len(ids) - span)
    for i in range(start, start + span):
        ids[i] = _other(ids[i], truth, rng)
    return _reannotate(r, truth, prompt_ids, ids, sampling.temperature)


def edit_last_token(r, prompt_ids, truth, rng, sampling):
    """The last token of a completion that ran to max_tokens replaced (by EOS half of the time: then it 'stops')."""
    if r.finish_reason != "length":
        return None
    ids = list(r.completion_ids)
    new = truth.eos if rng.random() < 0.5 else _other(ids[-1], truth, rng)
    ids[-1] = new
    return _reannotate(r, truth, prompt_ids, ids, sampling.temperature, "stop" if new == truth.eos else "length")


def _edit_stopped_last_token(r, prompt_ids, truth, rng, sampling):
    """When no completion ran to max_tokens: the final EOS replaced by an ordinary token, claimed as 'length'."""
    ids = list(r.completion_ids)
    ids[-1] = _other(truth.eos, truth, rng)
    return _reannotate(r, truth, prompt_ids, ids, sampling.temperature, "length")


edit_last_token.fallback = _edit_stopped_last_token


def made_up_completion(r, prompt_ids, truth, rng, sampling):
    """A completion of random ordinary tokens to max_tokens, with the true model's logprobs and proof."""
    ids = [rng.choice(truth.ordinary) for _ in range(sampling.max_tokens)]
    return _reannotate(r, truth, prompt_ids, ids, sampling.temperature, "length")


def faked_logprobs(r, prompt_ids, truth, rng, sampling):
    """Honest tokens, every logprob lowered by 0.005-0.05 (as if the sampler had been less sure): the trainer's
    importance ratios for this rollout grow by 0.5-5%."""
    return r.model_copy(update={"logprobs": [lp - rng.uniform(0.005, 0.05) for lp in r.logprobs]})


class ClaimNode(ScriptedNode):
    """Honest rollouts whose claimed rewards are inflated: 0.5 above what each completion really earns (the node
    can score its own completions: it sees the prompt, and the task's answer follows from it)."""

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        from swarmrl.protocol.tasks import load_task

        task = load_task(self._run_info.spec.task)
        texts = {p.prompt_id: p.text for p in lease.prompts}
        groups = []
        for g in submission.groups:
            a, b = texts[g.prompt_id].rstrip("=").split("+")
            answer = str(int(a) + int(b))
            rollouts = [r.model_copy(update={"claimed_reward": task.reward(
                self.tokenizer.decode(r.completion_ids, skip_special_tokens=True), answer) + 0.5}) for r in g.rollouts]
            groups.append(g.model_copy(update={"rollouts": rollouts}))
        return submission.model_copy(update={"groups": groups})


class ProofForgerNode(ScriptedNode):
    """Honest tokens and logprobs; one rollout's activation proof replaced by a malformed or forged one."""

    def __init__(self, cfg: NodeConfig, seed: int = 0):
        super().__init__(cfg)
        self.rng = random.Random(seed)

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        from swarmrl.testing.byzantine.proofs_fuzz import forged_proof

        groups = []
        for g in submission.groups:
            rollouts = list(g.rollouts)
            i = self.rng.randrange(len(rollouts))
            rollouts[i] = rollouts[i].model_copy(update={"proof": forged_proof(rollouts[i], self.rng)})
            groups.append(g.model_copy(update={"rollouts": rollouts}))
        return submission.model_copy(update={"groups": groups})


class OldWeightsNode(ScriptedNode):
    """Generates with the weights of an old `version` and declares version `declare` in its submission."""

    def __init__(self, cfg: NodeConfig, version: int = 0, declare: int = 0):
        super().__init__(cfg)
        self.version, self.declare = version, declare

    def sync(self) -> None:
        signed = self.client.manifest(self.version)
        manifest, path = self.fetcher.fetch(signed)
        self.true_checkpoint = path
        self.weights.offer(manifest.version, path)

    def wait_for_weights(self, lease: m.Lease, max_staleness: int, temperature: float) -> None:
        pass  # it stays on the old weights on purpose

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        return submission.model_copy(update={"policy_version": self.declare})
