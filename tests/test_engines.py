"""Inference engines: every sampled token must replay under a plain transformers prefill (protocol.sampling),
logprobs must match it, engines must agree with each other, and in-place reloads must really swap the weights.

Random tiny Llama weights (near-uniform next-token distributions) are enough: the sampling rule, stops and
reloads do not depend on the model being trained, and EOS comes up often, so "stop" and "length" both occur.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarmrl.models.build import ModelConfig as MConfig
from swarmrl.models.tokenizers import END_OF_TEXT, IM_END, build_bpe_tokenizer
from swarmrl.node.engine import Completion, EngineConfig, GenerationRequest, InferenceEngine
from swarmrl.node.engines import build_engine
from swarmrl.protocol import sampling
from swarmrl.testing.local import group_requests, pending_groups, verify_groups
from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer, save_checkpoint
from swarmrl.verifier.models import load_policy

T = 0.7  # not 1, so that the engines' temperature handling is exercised
MAX_TOKENS = 24
TIE_MARGIN = 1e-4  # a replay mismatch is excused only where its replay gap is below this (a near-tie)
LOGPROB_TOL = 1e-4

# Prompts of several lengths: a group of rollouts per prompt (as nodes run them, sharing a prefix-cached
# prompt), one prompt longer than the 32-token KV block (so vLLM's prefix cache really holds it), and one so
# long that the model length (64) cuts its completion before MAX_TOKENS.
PROMPTS = ["123+456=", "9+9=", "111+222+333+444+555+666+777+888+99=", "1234567890" * 6]
ROLLOUTS_PER_PROMPT = 6


@dataclass
class Replay:
    tokens: int = 0
    mismatches: int = 0
    unexplained: int = 0
    """Tokens whose replay gap under the reference is >= TIE_MARGIN (must be 0)."""
    max_logprob_diff: float = 0.0
    min_gap: float = float("inf")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tok) -> dict[str, Path]:
    """Two checkpoints of one architecture with different random weights."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: save_checkpoint(build_model(ModelConfig(seed=seed), tok), tok, root / name)
            for name, seed in (("a", 0), ("b", 1234))}


@pytest.fixture(scope="module")
def reference(ckpts):
    """Plain transformers fp32 models, the verifier's view of each checkpoint."""
    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in ckpts.items()}


@pytest.fixture(scope="module")
def requests_(tok) -> list[GenerationRequest]:
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    return [GenerationRequest(prompt_ids=ids[p], seed=7_000_000 + 100 * p + k)
            for p in range(len(PROMPTS)) for k in range(ROLLOUTS_PER_PROMPT)]


@pytest.fixture(scope="module")
def torch_engine(ckpts):
    engine = build_engine(EngineConfig(kind="torch", torch_batch_size=8), ckpts["a"], T)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def vllm_engine(ckpts):
    pytest.importorskip("vllm", exc_type=ImportError)
    # block_size 32 (vLLM's CPU default is 128, longer than the model) so that prefix caching is active.
    engine = build_engine(EngineConfig(kind="vllm", block_size=32), ckpts["a"], T)
    yield engine
    engine.close()


@pytest.fixture(params=["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request) -> InferenceEngine:
    return request.getfixturevalue(f"{request.param}_engine")


@torch.no_grad()
def reference_replay(model, req: GenerationRequest,
                     comp: Completion) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From one prefill, per completion token (float64 [n] each): its replay gap (0 when it is the rule's sample of
    the reference logits), the decision's margin (how near another outcome was), and its reference logprob."""
    ids = torch.tensor([req.prompt_ids + comp.token_ids])
    n = len(comp.token_ids)
    logits = model(ids).logits[0, len(req.prompt_ids) - 1:-1].float()
    seeds, positions, tokens = torch.full((n,), req.seed), torch.arange(n), torch.tensor(comp.token_ids)
    gaps = sampling.replay_tokens(logits, tokens, seeds, positions, T).gaps
    margins = sampling.decision_margins(logits, seeds, positions, T)
    logp = torch.log_softmax(logits.double() / T, dim=-1)
    return gaps, margins, logp.gather(-1, tokens[:, None])[:, 0]


def replay(model, reqs: list[GenerationRequest], comps: list[Completion]) -> Replay:
    """Check every token the way a verifier does: its replay gap under the reference logits."""
    r = Replay()
    for req, comp in zip(reqs, comps, strict=True):
        gaps, margins, ref_lp = reference_replay(model, req, comp)
        r.tokens += len(comp.token_ids)
        r.mismatches += int((gaps > 0).sum())
        r.unexplained += int((gaps >= TIE_MARGIN).sum())
        r.max_logprob_diff = max(r.max_logprob_diff,
                                 float((ref_lp - torch.tensor(comp.logprobs, dtype=torch.float64)).abs().max()))
        r.min_gap = min(r.min_gap, float(margins.min()))
    return r


def budget(req: GenerationRequest, max_tokens: int, engine: InferenceEngine) -> int:
    return min(max_tokens, engine.max_model_len - len(req.prompt_ids))


def assert_well_formed(engine: InferenceEngine, reqs, comps, max_tokens: int) -> None:
    """Stop exactly at a stop token (kept), else exactly at the token budget."""
    assert len(comps) == len(reqs)
    for req, c in zip(reqs, comps, strict=True):
        assert len(c.logprobs) == len(c.token_ids) >= 1
        assert not engine.stop_ids & set(c.token_ids[:-1])
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in engine.stop_ids
            assert len(c.token_ids) <= budget(req, max_tokens, engine)
        else:
            assert c.finish_reason == "length"
            assert c.token_ids[-1] not in engine.stop_ids
            assert len(c.token_ids) == budget(req, max_tokens, engine)
        assert all(lp <= 0.0 for lp in c.logprobs)


# -- (1), (2): each engine replays under a plain transformers prefill -----------------------------------------


def test_engine_replays_under_transformers(engine, requests_, reference):
    comps = engine.generate(requests_, MAX_TOKENS)
    assert_well_formed(engine, requests_, comps, MAX_TOKENS)
    r = replay(reference["a"], requests_, comps)
    assert r.unexplained == 0, r
    assert r.max_logprob_diff < LOGPROB_TOL, r
    # The set exercises both endings, including the model-length cap of the longest prompt.
    reasons = {c.finish_reason for c in comps}
    assert reasons == {"stop", "length"}
    long_prompt = [c for q, c in zip(requests_, comps, strict=True) if len(q.prompt_ids) > 60]
    assert any(c.finish_reason == "length" and len(c.token_ids) < MAX_TOKENS for c in long_prompt)


# -- (3): vLLM and torch agree ---------------------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_and_torch_agree(vllm_engine, torch_engine, requests_, reference):
    a = vllm_engine.generate(requests_, MAX_TOKENS)
    b = torch_engine.generate(requests_, MAX_TOKENS)
    unexplained = 0
    for req, ca, cb in zip(requests_, a, b, strict=True):
        if ca.token_ids == cb.token_ids:
            assert ca.finish_reason == cb.finish_reason
            diff = max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs, strict=True))
            assert diff < 2 * LOGPROB_TOL
            continue
        # After the first divergence the two continuations are unrelated; the divergence itself must be a
        # near-tie under the reference.
        i = next(k for k, (x, y) in enumerate(zip(ca.token_ids, cb.token_ids, strict=False)) if x != y)
        _, margins, _ = reference_replay(reference["a"], req, ca)
        unexplained += int(margins[i] >= TIE_MARGIN)
    assert unexplained == 0


# -- (4): seeds ----------------------------------------------------------------------------------------------


def test_seed_determines_sample_regardless_of_batch(engine, tok):
    prompt = tok("555+444=")["input_ids"]
    group = [GenerationRequest(prompt, seed=s) for s in range(100, 116)]
    out = engine.generate(group, 12)
    # Different seeds give different samples (16 near-uniform 12-token samples: a repeat is very unlikely).
    assert len({tuple(c.token_ids) for c in out}) >= 14

    others = [GenerationRequest(tok(p)["input_ids"], seed=900 + i) for i, p in enumerate(PROMPTS)]
    target = group[3]
    alone = engine.generate([target], 12)[0]
    mixed = engine.generate([others[0], others[1], target, others[2], group[5], others[3]], 12)[2]
    reversed_mix = engine.generate([target, *others[::-1]], 12)[0]
    for c in (out[3], mixed, reversed_mix):
        assert c.token_ids == alone.token_ids
        assert c.finish_reason == alone.finish_reason
        assert max(abs(x - y) for x, y in zip(c.logprobs, alone.logprobs, strict=True)) < 1e-5


# -- (5): in-place reload --------------------------------------------------------------------------------------


def test_reload_in_place_follows_new_weights(engine, ckpts, requests_, reference):
    before = engine.generate(requests_, MAX_TOKENS)
    try:
        engine.load(ckpts["b"])
        after = engine.generate(requests_, MAX_TOKENS)
        changed = sum(x.token_ids != y.token_ids for x, y in zip(before, after, strict=True))
        assert changed >= len(requests_) // 2
        new = replay(reference["b"], requests_, after)
        assert new.unexplained == 0, new
        assert new.max_logprob_diff < LOGPROB_TOL, new
        # The replay discriminates: the same tokens do not pass under the old weights.
        old = replay(reference["a"], requests_, after)
        assert old.unexplained > 0 and old.max_logprob_diff > 1e-2, old
    finally:
        engine.load(ckpts["a"])  # the engine is shared by the module's tests
    again = engine.generate(requests_, MAX_TOKENS)
    assert [c.token_ids for c in again] == [c.token_ids for c in before]


def test_reload_rejects_other_architecture(torch_engine, tmp_path, tok):
    other = save_checkpoint(build_model(ModelConfig(num_layers=2), tok), tok, tmp_path / "small")
    with pytest.raises(ValueError, match="architecture"):
        torch_engine.load(other)


# -- (6): stopping -------------------------------------------------------------------------------------------


def test_eos_and_max_tokens(engine, requests_, tok):
    one = engine.generate(requests_, 1)
    assert_well_formed(engine, requests_, one, 1)
    assert all(len(c.token_ids) == 1 for c in one)
    three = engine.generate(requests_, 3)
    assert_well_formed(engine, requests_, three, 3)
    # An EOS sampled within 3 tokens ends that completion early; the rest run to exactly 3 tokens.
    assert {c.finish_reason for c in three} <= {"stop", "length"}
    full = engine.generate(requests_, MAX_TOKENS)
    for short, long_ in zip(three, full, strict=True):
        # Same seeds: the 3-token completion is a prefix of the longer one.
        assert long_.token_ids[:len(short.token_ids)] == short.token_ids
    with pytest.raises(ValueError):
        engine.generate([GenerationRequest(tok("1" * 70)["input_ids"], seed=1)], 4)


# -- (7) every architecture, through the real verifier -----------------------------------------------------------
#
# Random "mini" Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms) with a byte-level BPE, a ChatML template and two
# stop tokens. vLLM's Qwen2/Qwen3 classes ignore a logit_scale override, so an engine that applied T through the
# model would fail replay there at T != 1: here requests at T = 0.7 and 1.0 share one engine and one batch.

ARCHES = ["llama", "qwen2", "qwen3"]
ARCH_TEXTS = [f"{a}+{b}=" for a, b in ((123, 456), (5, 77), (901, 12), (44, 444))] + ["What is 7 * 8?", "Say hi."]
ARCH_GROUP = 4
ARCH_MAX_TOKENS = 40


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(1024)


@pytest.fixture(scope="module")
def arch_ckpts(tmp_path_factory, bpe) -> dict[str, Path]:
    """One checkpoint per architecture; stops about 4% likely per token, so completions end both ways."""
    root = tmp_path_factory.mktemp("arch")
    return {arch: save_checkpoint(build_model(MConfig.preset("mini", arch=arch, stop_rate=0.04), bpe), bpe, root / arch)
            for arch in ARCHES}


def _arch_engine(kind: str, ckpt: Path) -> InferenceEngine:
    if kind == "vllm":
        pytest.importorskip("vllm", exc_type=ImportError)
    return build_engine(EngineConfig(kind=kind, block_size=32 if kind == "vllm" else None), ckpt, temperature=1.0)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("kind", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_every_arch_replays_at_any_temperature(kind, arch, arch_ckpts, bpe):
    """Groups at T = 0.7 and 1.0 in one batch pass the verifier's checks (cheap + full) with 0 rejections; both
    stop tokens end completions; the per-request temperature gives what a batch of that temperature alone gives."""
    rng = random.Random(hash(arch) % 1000)
    reqs = [r for t in (0.7, 1.0) for r in group_requests(bpe, ARCH_TEXTS, ARCH_GROUP, t, rng)]
    with _arch_engine(kind, arch_ckpts[arch]) as engine:
        assert engine.stop_ids == {bpe.convert_tokens_to_ids(IM_END), bpe.convert_tokens_to_ids(END_OF_TEXT)}
        comps = engine.generate(reqs, ARCH_MAX_TOKENS)
        alone = engine.generate(reqs[:len(ARCH_TEXTS) * ARCH_GROUP], ARCH_MAX_TOKENS)
    assert [c.token_ids for c in alone] == [c.token_ids for c in comps[:len(alone)]]
    assert_well_formed(engine, reqs, comps, ARCH_MAX_TOKENS)
    groups = pending_groups(ARCH_TEXTS * 2, reqs, comps, ARCH_GROUP, ARCH_MAX_TOKENS)
    reasons, reports = verify_groups(load_policy(arch_ckpts[arch], 0), groups)
    assert reasons == [None] * len(groups), [r for r in reasons if r]
    assert max(r.max_logprob_diff for r in reports) < LOGPROB_TOL
    assert {c.finish_reason for c in comps} == {"stop", "length"}
    assert {c.token_ids[-1] for c in comps if c.finish_reason == "stop"} == engine.stop_ids
    # The verifier's replay is not satisfied by tokens sampled at the other temperature.
    swapped = [g.model_copy(update={"lease": g.lease.model_copy(update={
        "sampling": g.sampling.model_copy(update={"temperature": 1.7 - g.sampling.temperature})})}) for g in groups]
    assert sum(r is not None for r in verify_groups(load_policy(arch_ckpts[arch], 0), swapped)[0]) >= len(groups) // 2


@pytest.mark.parametrize("kind", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_long_completions_with_proofs(kind, tmp_path, bpe):
    """Completions of 300 tokens (ten proof chunks each) at T = 0.7 on Qwen2 pass the full check."""
    ckpt = save_checkpoint(build_model(MConfig.preset("mini", arch="qwen2", stop_rate=1e-4), bpe), bpe, tmp_path / "q")
    reqs = group_requests(bpe, ["Write a long story."], 4, 0.7, random.Random(5))
    with _arch_engine(kind, ckpt) as engine:
        comps = engine.generate(reqs, 300)
    assert [len(c.token_ids) for c in comps] == [300] * 4 and {c.finish_reason for c in comps} == {"length"}
    groups = pending_groups(["Write a long story."], reqs, comps, 4, 300)
    reasons, reports = verify_groups(load_policy(ckpt, 0), groups)
    assert reasons == [None], reasons
    assert reports[0].tokens == 1200 and reports[0].proof_checked > 0
