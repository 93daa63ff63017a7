"""Waiting in tests for an observable condition, never for a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.05


def wait_for(condition: Callable[[], T], what: str = "condition", timeout: float = 120.0) -> T:
    """Poll `condition` until it returns something true and return that; AssertionError naming `what` after
    `timeout` seconds (generous: a busy machine is slow, not wrong)."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL_S)  # the polling interval of the wait, not a stand-in for synchronisation
