"""A child process that ends with the process that started it.

A local swarm (the demo, the tests) starts every role as a process in a session of its own, so that it can stop
each role's process group. When the starter itself is killed (SIGKILL, or a test runner stopped by its own
timeout) it has no chance to stop them, and they would go on running. A starter that sets `PARENT_PID_ENV` to its
pid asks each child to take SIGTERM from the kernel when it dies (Linux's PR_SET_PDEATHSIG). SIGTERM, however it
comes, stops a command as Ctrl-C does (`interrupt_on_sigterm`), so that it too takes down what it started.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

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


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (a service manager, a timeout, the process that started this one ending): stop as Ctrl-C
    stops, running the same cleanup on the way out."""


_sigterm = threading.Event()


def interrupt_on_sigterm(then: Callable[[], None] | None = None) -> None:
    """Make SIGTERM raise `Terminated` in the main thread, so that a process takes down what it started (its
    `finally` blocks and KeyboardInterrupt handling run) instead of ending where it stands with its children left
    behind; with `then`, call that instead (a loop that stops by itself, as the node's). Later SIGTERMs are ignored
    while the cleanup runs (a second one would cut it short; SIGKILL still ends the process). `sigterm_received`
    tells afterwards. Only the main thread can set it (elsewhere a no-op)."""

    def on_sigterm(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _sigterm.set()
        if then is None:
            raise Terminated()
        then()

    if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
        signal.signal(signal.SIGTERM, on_sigterm)


def sigterm_received() -> bool:
    """Whether this process got SIGTERM (through `interrupt_on_sigterm`'s handler)."""
    return _sigterm.is_set()


def exit_now(status: int) -> NoReturn:
    """End the process with `status` once its own cleanup has run: stdio and log handlers are flushed, and the
    interpreter's teardown is skipped. With torch and its kin imported, that teardown alone took 3.7-5.8 s on a busy
    2-core machine, which would break a role's promise to exit within 5 s of SIGTERM, and it frees nothing a process
    that is ending needs to free."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more to say there
            pass
    os._exit(status)


_PR_SET_NAME = 15


def name_process(name: str) -> None:
    """Name this process's main thread `name` (at most 15 bytes kept), as `ps`, `top` and /proc/<pid>/comm show it,
    so that an operator can tell a process forked for one job from its parent. A no-op off Linux."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
