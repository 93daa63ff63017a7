"""Bring your own model and task, end to end: a math run and a code run that learn through the whole swarm.

Each test makes its JSONL set with the example's own script (`examples/<name>/make_data.py`), then runs the
example's run config as written (`examples/<name>/swarm.toml`), only pointed at the test's directories: a Qwen2-
architecture model built from random weights with a byte-level BPE trained on the problems' text and a ChatML
chat template, a short supervised warm start on the training split to a low held-out reward, then GRPO through a
coordinator, a verifier (every group fully checked), a trainer and two vLLM-CPU nodes, each a process of its own
on loopback. The demo itself measures the held-out reward (greedy, mean trusted reward: math-verify for math, the
sandboxed tests for code) of the warm-started model and of the newest checkpoint the trainer published.

Margins: the held-out sets have 422 (math) and 270 (code) problems, so one measurement's standard error is at most
0.024 and 0.030 (sqrt(p(1 - p) / n) at p = 0.5): the rise asserted, 0.1, is four and three of them, while the runs
measured rose by 0.17-0.21 (math) and 0.32-0.38 (code) (bench/RESULTS.md, "Bring your own model and task"). The
warm start is seeded and single-threaded, so every run starts from the same model. Wall time on 2 busy cores:
3-7 min (math), about 9 min (code, where every rollout's program runs in a fresh sandbox).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarmrl.demo import DemoConfig, run_demo
from swarmrl.models.prompts import load_tokenizer
from swarmrl.runtime.config import load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RISE = 0.1


def make_data(example: str, data_dir: Path) -> None:
    """Run the example's data script into `data_dir` (it writes data/*.jsonl there)."""
    subprocess.run([sys.executable, str(EXAMPLES / example / "make_data.py"), "--dir", str(data_dir)], check=True)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("example", ["math-qwen2", "code-qwen2"])
def test_held_out_reward_rises_through_the_swarm(example, tmp_path):
    pytest.importorskip("vllm")
    make_data(example, tmp_path)
    cfg = load_config(DemoConfig, EXAMPLES / example / "swarm.toml",
                      [f"data_dir={tmp_path}", f"run_dir={tmp_path / 'run'}", f"report={tmp_path / 'report.json'}",
                       "time_limit_s=1400"])  # a busy machine is slow, not wrong: the test wants every step
    assert cfg.model.build.arch == "qwen2" and cfg.model.build.tokenizer == "bpe"
    report = run_demo(cfg)
    print(json.dumps(report))  # the figures, for the record (pytest -s)

    init = tmp_path / "run" / "init"
    assert json.loads((init / "config.json").read_text())["model_type"] == "qwen2"
    assert "<|im_start|>" in load_tokenizer(init).chat_template  # prompts went through the ChatML template
    # A low but non-zero start: the warm start taught the format, RL has room to improve.
    assert 0.05 <= report["initial_reward"] <= 0.6, report
    assert report["final_reward"] >= report["initial_reward"] + RISE, report
    assert report["steps"] == cfg.max_steps, report  # the trainer ran to the end, nothing died
    assert report["groups_accepted"] >= cfg.max_steps * cfg.batch_groups
    assert report["groups_rejected"] == 0  # every node here is honest
    assert report["engine"] == "vllm"


def _code_task(tmp_path: Path, with_solutions: bool):
    from swarmrl.protocol.tasks import TaskSpec, load_task

    rows = [{"prompt": f"Print the input number plus {k}.", "tests": [{"input": "5\n", "output": f"{5 + k}\n"}],
             **({"solution": f"print(int(input())+{k})"} if with_solutions else {})} for k in range(1, 21)]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "code.jsonl").write_bytes(data)
    import hashlib

    return load_task(TaskSpec(name="code", options={"path": "code.jsonl", "sha256": hashlib.sha256(data).hexdigest(),
                                                    "max_new_tokens": 12}), tmp_path)


def test_a_recipe_trains_its_bpe_on_the_task_and_warms_up_on_reference_programs(tmp_path):
    from swarmrl.modelcmd import ModelRecipe, build_from_recipe
    from swarmrl.trainer.warmup import WarmupConfig, warm_start

    task = _code_task(tmp_path, with_solutions=True)
    try:
        recipe = ModelRecipe(arch="qwen2", size="mini", tokenizer="bpe", bpe_vocab=300, bpe_corpus="task",
                             individual_digits=True, shape={"max_positions": 64})
        model, tok, meta = build_from_recipe(recipe, seed=0, task=task)
        assert type(model).__name__ == "Qwen2ForCausalLM" and meta["vocab"] == len(tok) <= 300
        assert tok.tokenize("print(int(input())+17)")[-3:] == ["1", "7", ")"]  # digits one by one
        assert "print" in tok.get_vocab()  # a word of the task's text became one token
        # Steps on the reference programs (rendered through the chat template) move the model toward them.
        losses: list[float] = []
        record = lambda step, loss, acc: losses.append(loss)
        warm_start(model, tok, task, WarmupConfig(target_accuracy=1.0, max_steps=1, batch_size=16, eval_every=1),
                   record)
        warm_start(model, tok, task, WarmupConfig(target_accuracy=1.0, max_steps=40, batch_size=16, eval_every=40),
                   record)
        assert len(losses) == 2 and losses[1] < losses[0] / 2, losses
    finally:
        task.close()


def test_a_warm_start_needs_reference_solutions(tmp_path):
    from swarmrl.modelcmd import ModelRecipe, build_from_recipe
    from swarmrl.trainer.warmup import WarmupConfig, warm_start

    task = _code_task(tmp_path, with_solutions=False)
    try:
        model, tok, _ = build_from_recipe(ModelRecipe(arch="qwen2", size="mini", tokenizer="bpe", bpe_vocab=300,
                                                      bpe_corpus="task"), seed=0, task=task)
        with pytest.raises(ValueError, match="no reference solution"):
            warm_start(model, tok, task, WarmupConfig(max_steps=1, batch_size=2))
    finally:
        task.close()
