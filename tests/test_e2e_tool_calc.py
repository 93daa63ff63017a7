"""A multi-turn tool task learned through the whole swarm: examples/tool-calc/swarm.toml as written (pointed at the
test's directories). Each rollout is an episode of two model turns: a calculator call (`calc 37 * 48`), the
calculator's reply as the next user message, then the answer, which is scored. The nodes (vLLM) play the calculator,
the verifier (every group checked) replays every one of its turns and every model token, the trainer's loss leaves
the calculator's tokens out. A Qwen2 (0.82M parameters) warmed up on reference episodes to about 0.3 held-out
accuracy; RL then raises it (figures in bench/RESULTS.md, "tool use through the whole swarm").

Margins: 300 held-out questions, so one measurement's standard error is at most 0.029; the rise asserted is 0.1.
"""

from __future__ import annotations

import pytest

from tests.support.e2e_tasks import held_out_reward_rises


@pytest.mark.slow(minutes=5)
@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_held_out_reward_rises_on_a_multi_turn_tool_task_through_the_swarm(tmp_path):
    pytest.importorskip("vllm")
    held_out_reward_rises("tool-calc", tmp_path)
