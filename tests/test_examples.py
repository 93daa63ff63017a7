"""examples/ work as written: every run config loads (`swarmrl demo --print-config`), the data scripts write the
bytes the configs pin, the addition example is the zero-argument demo, and the GPU recipe runs here as written,
on the CPU, with the model path swapped for a small random Qwen2 built by `swarmrl model` and the data for a tiny
GSM8K-format file. The small examples' full runs are tests/test_e2e_math.py and tests/test_e2e_code.py, and
tests/test_e2e_swarm.py (addition: the zero-argument demo).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from swarmrl.demo import DemoConfig, run_demo
from swarmrl.runtime.config import load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CONFIGS = sorted(EXAMPLES.glob("*/swarm.toml"))


def test_there_are_the_examples_the_readme_names():
    assert {p.parent.name for p in CONFIGS} >= {"addition", "math-qwen2", "code-qwen2", "gpu-gsm8k", "reasoning-gym",
                                                 "tool-calc"}
    for config in CONFIGS:
        assert (config.parent / "README.md").is_file(), config.parent


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.parent.name)
def test_every_example_config_loads(config):
    out = subprocess.run([sys.executable, "-m", "swarmrl.cli", "demo", "--config", str(config), "--print-config"],
                         capture_output=True, text=True, cwd=config.parent)
    assert out.returncode == 0, out.stderr
    resolved = tomllib.loads(out.stdout)
    assert load_config(DemoConfig, config) == DemoConfig.model_validate(resolved)


@pytest.mark.parametrize("config", [c for c in CONFIGS if (c.parent / "make_data.py").exists()],
                         ids=lambda p: p.parent.name)
def test_make_data_writes_the_bytes_the_config_pins(config, tmp_path):
    subprocess.run([sys.executable, str(config.parent / "make_data.py"), "--dir", str(tmp_path)], check=True,
                   capture_output=True)
    options = load_config(DemoConfig, config).run.task.options
    data = (tmp_path / options["path"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == options["sha256"]


def test_the_addition_example_is_the_zero_argument_demo():
    assert load_config(DemoConfig, EXAMPLES / "addition" / "swarm.toml") == DemoConfig()


def write_gsm8k_like(path: Path, n: int, offset: int) -> str:
    """`n` GSM8K-format problems (a worked solution, then `#### answer`) whose answers are 1, 2 or 3, so that a
    small random model learns to hit some of them in a short warm start; returns the file's sha256."""
    lines = []
    for i in range(offset, offset + n):
        total, eaten = 10 + i, 9 + i - i % 3
        left = total - eaten
        lines.append(json.dumps({
            "question": f"Tom has {total} apples and eats {eaten} of them. How many apples are left?",
            "answer": f"He has {total} - {eaten} = <<{total}-{eaten}={left}>>{left} apples left.\n#### {left}"}))
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


@pytest.mark.slow(minutes=1)
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_the_gpu_gsm8k_recipe_runs_on_the_cpu_with_a_small_random_qwen2(tmp_path):
    pytest.importorskip("vllm")
    model = tmp_path / "models" / "random-qwen2"
    subprocess.run([sys.executable, "-m", "swarmrl.cli", "model", str(model), "--arch", "qwen2", "--size", "mini",
                    "--tokenizer", "bpe", "--vocab", "1024", "--max-positions", "1024", "--stop-rate", "0.05"],
                   check=True, capture_output=True)
    (tmp_path / "data").mkdir()
    train_sha = write_gsm8k_like(tmp_path / "data" / "train.jsonl", 64, 0)
    test_sha = write_gsm8k_like(tmp_path / "data" / "test.jsonl", 8, 1000)
    recipe = EXAMPLES / "gpu-gsm8k" / "swarm.toml"
    # The recipe as written, but: the CPU (fp32 everywhere), the small model and data, a few small steps, and a
    # warm start (a random model never finds a GSM8K answer, and groups whose rollouts all score 0 teach nothing).
    cfg = load_config(DemoConfig, recipe, [
        "device=cpu", f"model.path={model}", f"run.task.options.sha256={train_sha}",
        f"run.task.options.eval_sha256={test_sha}", f"data_dir={tmp_path}", f"run_dir={tmp_path / 'run'}",
        "warmup.target_accuracy=0.3", "warmup.eval_every=5", "max_steps=2", "batch_groups=4",
        "prompts_per_lease=4", "eval_size=8", "time_limit_s=600"])
    written = load_config(DemoConfig, recipe)
    assert (cfg.run.task.options["path"], cfg.run.sampling, cfg.roles) == (
        written.run.task.options["path"], written.run.sampling, written.roles)
    report = run_demo(cfg)
    assert report["stop_reason"] == "trainer finished", report
    assert report["steps"] == 2 and report["final_version"] >= 2, report
    assert report["groups_accepted"] >= 2 * cfg.batch_groups and report["groups_rejected"] == 0, report
    assert report["engine"] == "vllm" and report["eval_problems"] == 8
