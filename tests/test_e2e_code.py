"""Bring your own model and task, end to end: a code run that learns through the whole swarm (see
tests/test_e2e_math.py for what both runs do and why their margins hold), and the code task's warm start on
reference programs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.e2e_tasks import held_out_reward_rises


@pytest.mark.slow(minutes=14)
@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_held_out_reward_rises_through_the_swarm(tmp_path):
    pytest.importorskip("vllm")
    held_out_reward_rises("code-qwen2", tmp_path)


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
