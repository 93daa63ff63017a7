"""Bring your own model and task, end to end: a math run that learns through the whole swarm (its code twin is
tests/test_e2e_code.py; each has a file of its own so that the two can run at once on two test workers).

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
warm start is seeded and single-threaded, so every run starts from the same model. Wall time on 2 cores: 3-7 min
(math) and 6-9 min (code, where every rollout's program runs in a fresh sandbox) alone; in the suite, where the two
run side by side, about 8 and 17 min.
"""

from __future__ import annotations

import pytest

from tests.support.e2e_tasks import held_out_reward_rises


@pytest.mark.slow(minutes=10)
@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_held_out_reward_rises_through_the_swarm(tmp_path):
    pytest.importorskip("vllm")
    held_out_reward_rises("math-qwen2", tmp_path)
