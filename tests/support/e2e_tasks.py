"""The examples' full runs through the whole swarm (tests/test_e2e_math.py, tests/test_e2e_code.py,
tests/test_e2e_reasoning_gym.py): make the example's data with its own script (where it has one), run its config
as written (pointed at the test's directories, without the trainer's periodic evaluations), check that the held-out
reward rose. Why the margins hold:
tests/test_e2e_math.py's docstring."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from swarmrl.demo import DemoConfig, run_demo
from swarmrl.models.prompts import load_tokenizer
from swarmrl.runtime.config import load_config

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
RISE = 0.1


def make_data(example: str, data_dir: Path) -> None:
    """Run the example's data script into `data_dir` (it writes data/*.jsonl there)."""
    subprocess.run([sys.executable, str(EXAMPLES / example / "make_data.py"), "--dir", str(data_dir)], check=True)


def held_out_reward_rises(example: str, tmp_path: Path) -> None:
    """Run `example` through the swarm (a Qwen2 with a BPE and ChatML, vLLM nodes); assert that it learned. An
    example without a data script (reasoning-gym: the run's options are its data) runs in an empty directory."""
    if (EXAMPLES / example / "make_data.py").exists():
        make_data(example, tmp_path)
    # A busy machine is slow, not wrong: the test wants every step. The trainer's periodic held-out evaluations
    # (which hold its steps) are off: the test asserts on the demo's own measurement before and after.
    cfg = load_config(DemoConfig, EXAMPLES / example / "swarm.toml",
                      [f"data_dir={tmp_path}", f"run_dir={tmp_path / 'run'}", f"report={tmp_path / 'report.json'}",
                       "time_limit_s=1400", "eval_every=0"])
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
