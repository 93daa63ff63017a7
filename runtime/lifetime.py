"""A child process that ends with the process that started it.

A local swarm (the demo, the tests) starts every role as a process in a session of its own, so that it can stop
each role's process group. When the starter itself is killed (SIGKILL, or a test runner stopped by its own
timeout) it has no chance to stop them, and they would go on running. A starter that sets `PARENT_PID_ENV` to its
pid asks each child to take SIGTERM from the kernel when it dies (Linux's PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_PID_ENV = "SWARMRL_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent_if_asked() -> None:
    """If `PARENT_PID_ENV` names our parent, get SIGTERM when it dies; exit now if it already has. Elsewhere a no-op."""
    wanted = os.environ.get(PARENT_PID_ENV)
    if wanted:
        die_with_parent(int(wanted))


def die_with_parent(parent_pid: int) -> None:
    """Get SIGTERM when the process `parent_pid` (our parent, which started us from its main thread) dies; exit now
    if it already has. A no-op off Linux, or where the kernel does not permit it."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not permitted here: the starter's own stop() still applies
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


_PR_SET_NAME = 15


def name_process(name: str) -> None:
    """Name this process's main thread `name` (at most 15 bytes kept), as `ps`, `top` and /proc/<pid>/comm show it,
    so that an operator can tell a process forked for one job from its parent. A no-op off Linux."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
