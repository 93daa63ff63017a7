"""Staged weight updates of the vLLM engine (`node.vllm_staging`, `EngineConfig.staged_reload`): a version prepared
in the shadow model while the engine generates, then committed between two calls, makes the engine compute exactly
what a fresh engine on that checkpoint computes; and the node's in-flight updates wait for the preparation."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from swarmrl.models.build import ModelConfig as MConfig
from swarmrl.models.tokenizers import build_bpe_tokenizer
from swarmrl.node.engine import Completion, EngineConfig, GenerationRequest
from swarmrl.node.engines import build_engine
from swarmrl.node.stats import NodeStats
from swarmrl.node.weights import Weights
from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer, save_checkpoint

T = 0.7
MAX_TOKENS = 24
# A group per prompt (sharing its prefix-cached prompt) and a prompt longer than the 32-token KV block, so that the
# prefix cache really holds blocks computed with the old weights when the new ones come in.
TEXTS = ["123+456=", "9+9=", "111+222+333+444+555+666+777+888+99="]


@dataclass
class Case:
    a: Path
    b: Path
    requests: list[GenerationRequest]
    tied: bool


def _requests(tok) -> list[GenerationRequest]:
    ids = [tok(t)["input_ids"] for t in TEXTS]
    return [GenerationRequest(prompt_ids=ids[p], seed=9_000 + 10 * p + k) for p in range(len(ids)) for k in range(4)]


@pytest.fixture(scope="module", params=["tied", "untied"])
def case(request, tmp_path_factory) -> Case:
    """Two checkpoints of one architecture: the tiny Llama with a tied lm_head, or a Qwen2 (biases) with its own."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "tied":
        tok = build_tokenizer()
        ckpts = [save_checkpoint(build_model(ModelConfig(seed=s), tok), tok, root / str(s)) for s in (0, 1234)]
    else:
        tok = build_bpe_tokenizer(1024)
        ckpts = [save_checkpoint(build_model(MConfig.preset("mini", arch="qwen2", stop_rate=0.04, seed=s), tok), tok,
                                 root / str(s)) for s in (0, 1)]
    tied = request.param == "tied"
    assert ('"tie_word_embeddings": true' in (ckpts[0] / "config.json").read_text()) == tied
    return Case(ckpts[0], ckpts[1], _requests(tok), tied)


def _engine(ckpt: Path, **cfg) -> object:
    pytest.importorskip("vllm", exc_type=ImportError)
    return build_engine(EngineConfig(kind="vllm", block_size=32, **cfg), ckpt, T)


def _out(completions: list[Completion]) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in completions]


@pytest.mark.vllm
def test_a_committed_version_computes_what_a_fresh_engine_computes(case):
    """Prepared while the engine generates (which it does with the old weights, untouched), then committed: the
    completions and logprobs of fixed seeds are a fresh engine's on the new checkpoint, and differ from the old
    version's; back and forth twice more (the shadow's buffers alternate), still exact."""
    reqs = case.requests
    with _engine(case.b) as fresh:
        want_b = _out(fresh.generate(reqs, MAX_TOKENS))
    with _engine(case.a) as engine:
        assert engine._staged is not None, "staged updates are on for an unquantized fp32 model on the CPU"
        want_a = _out(engine.generate(reqs, MAX_TOKENS))
        assert sum(x[0] != y[0] for x, y in zip(want_a, want_b, strict=True)) >= len(reqs) // 2
        assert not engine.prepared(case.b)
        preparing = threading.Thread(target=engine.prepare, args=(case.b,))
        preparing.start()
        during = [_out(engine.generate(reqs, MAX_TOKENS))]
        while preparing.is_alive():
            during.append(_out(engine.generate(reqs, MAX_TOKENS)))
        preparing.join()
        assert all(d == want_a for d in during)  # the live model was not touched by the preparation
        assert engine.prepared(case.b)
        engine.load(case.b)
        assert not engine.prepared(case.b)
        assert engine.last_commit_s is not None and engine.last_prepare_s is not None
        assert _out(engine.generate(reqs, MAX_TOKENS)) == want_b
        engine.load(case.a)  # not prepared: load prepares it, then commits
        assert _out(engine.generate(reqs, MAX_TOKENS)) == want_a
        engine.prepare(case.b)
        engine.load(case.b)
        assert _out(engine.generate(reqs, MAX_TOKENS)) == want_b
        # The lm_head computes with the new weights (vLLM's own reload left a tied one stale).
        from swarmrl.node.vllm_engine import _lm_head_error

        assert max(engine.llm.apply_model(_lm_head_error)) < 1e-5


@pytest.mark.vllm
def test_without_staging_the_engine_reloads_in_place(case):
    """`staged_reload=False`: vLLM's in-place reload, to the same result; nothing is prepared."""
    reqs = case.requests
    with _engine(case.b) as fresh:
        want_b = _out(fresh.generate(reqs, MAX_TOKENS))
    with _engine(case.a, staged_reload=False) as engine:
        assert engine._staged is None and engine.prepared(case.b)
        engine.prepare(case.b)  # nothing to do
        engine.generate(reqs, MAX_TOKENS)
        engine.load(case.b)
        got = _out(engine.generate(reqs, MAX_TOKENS))
    assert [t for t, _ in got] == [t for t, _ in want_b]
    assert max(abs(x - y) for (_, a), (_, b) in zip(got, want_b, strict=True) for x, y in zip(a, b, strict=True)) < 1e-5


def test_layers_it_does_not_handle_are_named():
    pytest.importorskip("vllm", exc_type=ImportError)
    from swarmrl.node.vllm_staging import StagedWeights, StagingUnsupported, unsupported_layers

    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    assert unsupported_layers(model) == []  # parameters only, read as they are by the forward
    model[1].quant_method = object()  # e.g. a quantized layer: its weights are processed after loading
    assert unsupported_layers(model) == ["1 (Linear, object)"]
    with pytest.raises(StagingUnsupported, match="1 \\(Linear"):
        StagedWeights(model, vllm_config=None)


# -- the node's side ------------------------------------------------------------------------------------------------

class _StagingEngine:
    """What `Weights` asks of an engine that prepares its updates."""

    temperature = T

    def __init__(self) -> None:
        self.prepared_paths: set[Path] = set()
        self.loaded: list[Path] = []

    def prepare(self, path: Path) -> None:
        self.prepared_paths.add(path)

    def prepared(self, path: Path) -> bool:
        return path in self.prepared_paths

    def load(self, path: Path) -> None:
        self.loaded.append(path)


def test_in_flight_updates_wait_for_the_preparation(tmp_path):
    cfg = SimpleNamespace(poll_interval_s=1.0, max_backoff_s=1.0)
    weights = Weights(cfg, client=None, stats=NodeStats(), stop=threading.Event())  # type: ignore[arg-type]
    engine = weights.engine = _StagingEngine()  # type: ignore[assignment]
    updates = weights.in_flight(T, max_version=5)
    weights.offer(1, tmp_path / "v1")
    assert updates.ready()  # no fetch thread preparing: `load` prepares it itself
    weights.preparing = True  # as once the fetch thread runs (`start`)
    assert not updates.ready()
    weights.prepare_ready()
    assert engine.prepared_paths == {tmp_path / "v1"} and updates.ready()
    assert updates.load() == 1 and engine.loaded == [tmp_path / "v1"]
    weights.offer(7, tmp_path / "v7")  # newer than the lease's version: prepared, but not ready for this lease
    weights.prepare_ready()
    assert engine.prepared(tmp_path / "v7") and not updates.ready()
