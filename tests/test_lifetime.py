"""A role process started by a local swarm ends with its starter, even when the starter is SIGKILLed and cannot
stop it (runtime/lifetime.py): real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from swarmrl.runtime.lifetime import PARENT_PID_ENV
from swarmrl.testing.waiting import wait_for

CHILD = "from swarmrl.runtime.lifetime import die_with_parent_if_asked; import time; die_with_parent_if_asked(); " \
        "print('ready', flush=True); time.sleep(600)"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has ended, whoever reaps it


def starter(ask: bool) -> tuple[subprocess.Popen, int]:
    """A starter process that starts a child (asking it to end with it, or not), prints the child's pid, waits."""
    env_line = f"env[{PARENT_PID_ENV!r}] = str(os.getpid())" if ask else "pass"
    code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = dict(os.environ)
        {env_line}
        child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=env, stdout=subprocess.PIPE, text=True,
                                 start_new_session=True)
        assert child.stdout.readline().strip() == "ready"
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_that_asked_ends_when_its_starter_is_killed():
    proc, child = starter(ask=True)
    assert alive(child)
    proc.kill()
    proc.wait()
    wait_for(lambda: not alive(child), "the child to end with its starter", timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_that_did_not_ask_outlives_its_starter():
    proc, child = starter(ask=False)
    try:
        proc.kill()
        proc.wait()
        # Its starter is gone for good; the child is reparented and still running (the rule is opt-in).
        wait_for(lambda: _parent(child) != proc.pid, "the child to be reparented")
        assert alive(child)
    finally:
        os.kill(child, signal.SIGKILL)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
