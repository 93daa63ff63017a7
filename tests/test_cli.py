"""The `swarmrl` command line as a user meets it: Ctrl-C stops a command with one word and exit status 130, not a
Python traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def _as_from_a_terminal() -> None:
    # A test worker may run with SIGINT ignored (pytest-xdist's do), and a child inherits that: Python then leaves
    # Ctrl-C ignored too. A shell starts a command with SIGINT at its default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_a_command_without_a_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "swarmrl.cli", "demo", "--set", f"run_dir={tmp_path / 'run'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                            preexec_fn=_as_from_a_terminal, start_new_session=True)
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # the demo is under way (warming its model up) once it says so
            seen.append(line)
            if "warm start on" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        out = "".join(seen) + rest
        assert proc.returncode == 130, out
        assert out.rstrip().endswith("interrupted") and "Traceback" not in out, out
    finally:
        if proc.poll() is None:  # it did not stop: take it and what it started down
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_each_commands_set_example_is_a_setting_it_takes(capsys) -> None:
    """`--help` gives an example `--set` per command: each is accepted by that command's config, and a demo engine
    that does not exist is refused by --print-config, not printed."""
    import pytest

    from swarmrl.cli import _SET_EXAMPLES, main

    for command, example in _SET_EXAMPLES.items():
        with pytest.raises(SystemExit) as done:
            main([command, *(["list"] if command == "pool" else []), "--set", example, "--print-config"])
        assert done.value.code == 0, (command, example)
        key, value = example.split("=")
        assert f"{key.split('.')[-1]} = " in capsys.readouterr().out, (command, example)
    with pytest.raises(SystemExit) as refused:
        main(["demo", "--set", "engine=foo", "--print-config"])
    assert "engine" in str(refused.value.code) and "'torch'" in str(refused.value.code)
