"""Answer equivalence by math-verify, in a worker process that a hostile completion cannot stall.

sympy can take minutes (or all memory) on a short, model-written expression such as `9^{9^{9^{9}}}`.
math-verify bounds each step with `signal.alarm`, which works only in a process's main thread, while the
verifier and trainer may score from any thread. So scoring runs in a child process (this module's `main`):
there math-verify's own timeouts apply, its memory is capped, and if it still does not answer in time the
parent kills it, scores the completion 0 and starts a fresh one for the next request.

Protocol: one JSON line per request on the worker's stdin, `{"gold": ..., "pred": ...}`; one line per
answer on its stdout, `{"ok": true|false}`. The worker prints `{"ready": true}` once math-verify is imported.

What scoring costs is bounded twice. Text sympy would choke on by its shape alone (braces nested deeper than
`MAX_BRACE_DEPTH`, as in a tower of fractions) scores 0 before any parsing: a pure function of the text, so every
machine agrees, and about 2 s of parsing saved each time. Short text can still cost a whole time limit
(`9^{9^{9^{9}}}`, `100000000!`): that is bounded by the timeouts, and an answer that took at least half the time
limit is reported `limited`: a timeout depends on the machine, so another may have scored it otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from functools import lru_cache
from typing import IO, Any

log = logging.getLogger("swarmrl.tasks.math")

START_TIMEOUT_S = 120.0  # importing sympy on a busy machine; only a worker that never starts is an error
MAX_PRED_CHARS = 20_000  # a completion's tail; the final answer is at its end
MAX_BRACE_DEPTH = 24  # an honest final answer nests a few levels (\frac{\sqrt{2}}{2}: 2); 60 cost 2.6 s to parse


def brace_depth(text: str) -> int:
    """The deepest nesting of `{...}` in `text` (unbalanced closing braces are ignored)."""
    depth = deepest = 0
    for ch in text:
        if ch == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == "}" and depth:
            depth -= 1
    return deepest


class MathChecker:
    """Thread-safe `equivalent(pred, gold)` backed by one worker process (started on first use)."""

    def __init__(self, timeout_s: int = 2, memory_mb: int = 2048):
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        # math-verify times out parsing and each of up to 4 comparisons separately; beyond that it is stuck.
        self.hard_timeout_s = 6.0 * timeout_s + 5.0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self.restarts = 0
        """Workers killed for not answering in time (tests and logs)."""

    def _start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarmrl.tasks.mathcheck", str(self.timeout_s), str(self.memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = _readline(proc.stdout, START_TIMEOUT_S)  # type: ignore[arg-type]
        if line is None or json.loads(line) != {"ready": True}:
            _kill(proc)
            raise RuntimeError(f"the math-verify worker did not start (got {line!r})")
        return proc

    def equivalent(self, pred: str, gold: str) -> bool:
        """Whether the final answer math-verify extracts from `pred` equals `gold` (both may be LaTeX)."""
        return self.check(pred, gold)[0]

    def check(self, pred: str, gold: str) -> tuple[bool, bool]:
        """(`equivalent(pred, gold)`, whether a time limit may have decided it: the answer took at least half the
        parse time limit, or none came)."""
        pred = pred[-MAX_PRED_CHARS:]
        if brace_depth(pred) > MAX_BRACE_DEPTH:
            return False, False
        request = json.dumps({"gold": gold, "pred": pred}) + "\n"
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            t0 = time.monotonic()  # the answer's own time, not the worker's start
            try:
                proc.stdin.write(request)  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
                line = _readline(proc.stdout, self.hard_timeout_s)  # type: ignore[arg-type]
            except (BrokenPipeError, OSError):
                line = None
            if line is None:  # stuck, or died (memory): the completion gets nothing, the next a fresh worker
                log.warning("math-verify worker gave no answer in %.0f s; restarting it", self.hard_timeout_s)
                _kill(proc)
                self._proc = None
                self.restarts += 1
                return False, True
            return bool(json.loads(line)["ok"]), time.monotonic() - t0 >= self.timeout_s / 2

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                _kill(self._proc)
                self._proc = None


def _readline(stream: IO[str], timeout_s: float) -> str | None:
    """One line from `stream` within `timeout_s`, or None (timeout or end of stream)."""
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return None
    line = stream.readline()  # the worker writes whole lines, so a readable pipe holds one
    return line or None


def _kill(proc: subprocess.Popen[Any]) -> None:
    proc.kill()
    proc.wait()


# -- the worker ----------------------------------------------------------------------------------------


def main(timeout_s: int, memory_mb: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    logging.disable(logging.WARNING)  # math-verify logs every timeout; the parent's answer says enough
    from math_verify import parse, verify

    @lru_cache(maxsize=4096)
    def gold_of(text: str) -> list[Any]:
        return parse("\\boxed{" + text + "}", parsing_timeout=timeout_s)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            gold = gold_of(str(req["gold"]))
            pred = parse(str(req["pred"]), parsing_timeout=timeout_s)
            ok = bool(gold and pred and verify(gold, pred, timeout_seconds=timeout_s))
        except Exception:  # anything the text provokes (MemoryError, RecursionError, ...) scores 0
            ok = False
        print(json.dumps({"ok": ok}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
