"""Every architecture `swarmrl model` builds works in every role: honest groups from each engine are replayed by
the real verifier with 0 rejects at T = 0.7 and 1.0, and after new weights are loaded into the running engine (the
next policy version), and an edited token is caught; the trainer's logprobs are the sampler's. The README's
compatibility table is this file's output (`test_readme_compatibility_table`), not written by hand.

Models are tiny random checkpoints saved by transformers (`swarmrl model --arch A --size mini --tokenizer bpe`, one
layer, a 512-token BPE); Gemma2's are tied, softcapped and scaled to logits with a spread of 4, where a verifier
that skipped the softcapping rejected every honest group."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from swarmrl.compat import check_model, probe
from swarmrl.modelcmd import build_checkpoint
from swarmrl.models.build import ARCHS, ModelConfig, load_causal_lm, logit_spread
from swarmrl.models.head import head_of
from swarmrl.protocol.run import RunSpec, SamplingSpec

ROOT = Path(__file__).resolve().parents[1]
TEMPERATURES = [0.7, 1.0]
GROUPS = 3
ENGINES = {"torch": "torch engine", "vllm": "vLLM engine"}
RESULTS: dict[tuple[str, str], str] = {}
"""(arch, engine) -> the table cell, filled by the tests that passed."""
CLASSES: dict[str, str] = {}
"""arch -> the checkpoint's transformers class (its config.json's `architectures`)."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per architecture, the checkpoint as `swarmrl model --arch A --size mini --tokenizer bpe` builds it, and
    under `A-next` the same architecture with other weights (the next policy version, seed 1)."""
    root = tmp_path_factory.mktemp("archs")
    out = {}
    for arch in ARCHS:
        for name, seed in ((arch, 0), (f"{arch}-next", 1)):
            cfg = ModelConfig.preset("mini", arch=arch, num_layers=1, max_positions=128, seed=seed)
            build_checkpoint(root / name, cfg, "bpe", bpe_vocab=512, warmup_accuracy=0, console=Console(quiet=True))
            out[name] = root / name
    return out


def _replays(ckpts: dict[str, Path], arch: str, kind: str) -> None:
    results = probe(ckpts[arch], kind, TEMPERATURES, groups=GROUPS, group_size=4, max_tokens=16,
                    then=ckpts[f"{arch}-next"])
    assert [r.version for r in results] == [0] * len(TEMPERATURES) + [1]
    for res in results:
        assert res.rejected == 0, (arch, kind, res.temperature, res.version, res.reasons)
        assert res.edit_caught, (arch, kind, res.temperature, res.version)
        assert res.tokens >= GROUPS * 4  # something was generated and checked
    CLASSES[arch] = json.loads((ckpts[arch] / "config.json").read_text())["architectures"][0]
    RESULTS[(arch, kind)] = (f"0 of {GROUPS * len(results)} honest groups rejected (T "
                             f"{', '.join(f'{t:.1f}' for t in TEMPERATURES)}, and {TEMPERATURES[-1]:.1f} after "
                             "new weights were loaded in place); edited token caught")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_torch_engine_groups_are_replayed(ckpts, arch):
    _replays(ckpts, arch, "torch")


@pytest.mark.vllm
@pytest.mark.slow(minutes=4)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_vllm_engine_groups_are_replayed(ckpts, arch):
    pytest.importorskip("vllm", exc_type=ImportError)
    _replays(ckpts, arch, "vllm")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_trainers_logprobs_are_the_samplers(ckpts, arch):
    """The trainer's loss uses log_softmax(model(...).logits / T) of the sampled tokens: the model's own logits, so
    they match what the node claimed (and the verifier accepted) for every architecture."""
    import random

    from swarmrl.models.build import load_checkpoint
    from swarmrl.node.engine import EngineConfig
    from swarmrl.node.engines import build_engine
    from swarmrl.testing.local import group_requests
    from swarmrl.trainer.grpo import token_logprobs

    model, tok = load_checkpoint(ckpts[arch])
    engine = build_engine(EngineConfig(kind="torch"), ckpts[arch], 0.7)
    try:
        reqs = group_requests(tok, ["What is 3 plus 4?", "12+30="], 4, 0.7, random.Random(0))
        comps = engine.generate(reqs, 12)
    finally:
        engine.close()
    worst = 0.0
    for q, c in zip(reqs, comps, strict=True):
        ids = torch.tensor([q.prompt_ids + c.token_ids])
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature=0.7)
        worst = max(worst, float((lp[0, len(q.prompt_ids) - 1:] - torch.tensor(c.logprobs)).abs().max()))
    assert worst < 1e-4, (arch, worst)


def test_gemma2_logits_are_the_models_own(ckpts):
    """The realistic Gemma2: tied, softcapped, logits spread >= 3; the verifier's head is the model's forward
    (softcapping included), and the head alone (what the verifier used to compute) is far from it."""
    model = load_causal_lm(ckpts["gemma2"])
    assert model.config.tie_word_embeddings and model.config.final_logit_softcapping
    assert logit_spread(model, torch.Generator().manual_seed(0)) >= 3
    ids = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = model(input_ids=ids).logits[0]
        states = model.get_decoder()(input_ids=ids).last_hidden_state[0]
        ours = head_of(model)(states)
        bare = model.get_output_embeddings()(states)
    assert (ours - whole).abs().max() < 1e-4
    assert (bare - whole).abs().max() > 1.0


@pytest.fixture(scope="module")
def nan_ckpt(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama checkpoint with its final norm's weights NaN: every logit is NaN, as an overflow would make it."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path_factory.mktemp("nan")
    for f in ckpts["llama"].iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(bad / "model.safetensors"))
    name = next(k for k in weights if k.endswith("norm.weight") and "layers" not in k)
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad


def test_a_model_the_verifier_cannot_replay_is_named_in_one_line(ckpts, nan_ckpt):
    """Refused when the verifier loads it (its head does not reproduce its forward: NaN), in one line."""
    run = RunSpec(sampling=SamplingSpec(temperature=0.7, max_tokens=8, group_size=4))
    line = check_model(nan_ckpt, run, ["torch"])
    assert line is not None and "\n" not in line and ("verifier cannot load it" in line or "torch engine" in line), line
    assert check_model(ckpts["llama"], run, ["torch"]) is None


@pytest.mark.slow(minutes=2)
def test_the_demo_refuses_a_model_it_cannot_replay_and_bans_no_node(nan_ckpt, tmp_path):
    """The whole local swarm starts (coordinator, two nodes, verifier); the model fails the compatibility check,
    the demo stops with one line, and no node was leased work, rejected or banned."""
    run_dir = tmp_path / "run"
    sets = [f"run_dir={run_dir}", f"model.path={nan_ckpt}", "warmup.target_accuracy=0", "engine=torch", "nodes=2",
            "eval_size=4", "p2p=false"]
    proc = subprocess.run([sys.executable, "-m", "swarmrl.cli", "demo", *[a for v in sets for a in ("--set", v)]],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "refused before it starts" in last and "model nan" in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert len(report["nodes"]) == 2, report
    assert report["nodes_banned"] == 0 and report["groups_rejected"] == 0, report
    assert all(not n["banned"] and n["leased"] == 0 for n in report["nodes"]), report


def test_a_pools_trainer_refuses_a_model_it_cannot_replay_before_publishing(nan_ckpt, tmp_path, run_factory):
    """A pool started role by role: the trainer's start-up check (`check_engine`) refuses the model in one line
    before it publishes anything, so the registered node gets no lease and nobody is banned."""
    from swarmrl.protocol.identity import Identity

    key = tmp_path / "trainer.key"
    op = Identity.generate()
    op.save(key)
    run = run_factory(op_key=op)
    node = run.node("waiting")
    sets = [f"coordinator_url={run.url}", f"key_path={key}", f"state_dir={tmp_path / 'state'}",
            f"init_checkpoint={nan_ckpt}", "check_engine=torch", "progress=false"]
    proc = subprocess.run([sys.executable, "-m", "swarmrl.cli", "trainer", *[a for v in sets for a in ("--set", v)]],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "refused before it starts" in last and "model nan" in last and "Nothing was published" in last, last
    assert run.op.status().run.current_version == -1  # no checkpoint: no lease can be granted
    assert node.lease(max_prompts=1, held_version=-1) is None
    [standing] = run.op.status().nodes
    assert not standing.banned and standing.groups_rejected == 0 and standing.prompts_leased == 0


def _table() -> str:
    rows = ["| architecture | transformers class | what it exercises | " + " | ".join(ENGINES.values()) + " |",
            "|---|---|---|" + "---|" * len(ENGINES)]
    for arch in ARCHS:
        cells = [RESULTS[(arch, kind)] for kind in ENGINES]
        rows.append(f"| {arch} | {CLASSES[arch]} | {_exercises(arch)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _exercises(arch: str) -> str:
    return {"llama": "RoPE, GQA, RMSNorm", "qwen2": "q/k/v biases", "qwen3": "q/k norms, explicit head_dim",
            "mistral": "Mistral's classes", "phi3": "fused qkv and gate/up projections",
            "gemma2": "tied head, final logit softcapping, attention softcapping, logits spread 4",
            "gpt2": "learned positions, LayerNorm, biases, n_embd/n_head config names",
            "opt": "learned positions, decoder.final_layer_norm, biases"}[arch]


def test_readme_compatibility_table():
    """README's table between the markers is what the tests above measured; out of date, it is rewritten here
    and the test fails (commit the new README). Skipped unless every architecture passed on every engine."""
    missing = [key for key in ((a, k) for a in ARCHS for k in ENGINES) if key not in RESULTS]
    if missing:
        pytest.skip(f"not every architecture and engine ran in this session: {missing[:3]}")
    readme = ROOT / "README.md"
    text = readme.read_text()
    pattern = re.compile(r"(<!-- compatibility-table:start -->\n)(.*?)(<!-- compatibility-table:end -->)", re.S)
    assert pattern.search(text), "README.md has no compatibility-table markers"
    want = _table() + "\n"
    got = pattern.search(text).group(2)
    if got != want:
        readme.write_text(pattern.sub(lambda mt: mt.group(1) + want + mt.group(3), text))
        pytest.fail("README.md's compatibility table was out of date: rewritten from this run, commit it")
