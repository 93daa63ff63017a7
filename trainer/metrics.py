"""What the trainer reports per step: rollout statistics, the staleness histogram, and a live status line."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from swarmrl.protocol.messages import TrainingGroup

log = logging.getLogger(__name__)

EXACT_REWARD = 1.0
"""The reward of an exactly right completion (tasks give partial credit below it)."""


def rollout_metrics(groups: Sequence[TrainingGroup]) -> dict[str, float]:
    """reward_mean and accuracy (fraction of rollouts with reward == 1.0) over every rollout of `groups`.

    Pass all fresh groups of the step, including zero-advantage ones the loss skips: leaving out the
    all-right groups would make the policy look worse than it is.
    """
    rewards = [r for g in groups for r in g.rewards]
    if not rewards:
        return {"reward_mean": 0.0, "accuracy": 0.0}
    return {
        "reward_mean": sum(rewards) / len(rewards),
        "accuracy": sum(r == EXACT_REWARD for r in rewards) / len(rewards),
    }


def staleness_histogram(groups: Sequence[TrainingGroup], version: int, max_staleness: int) -> dict[str, float]:
    """{"staleness_0": n0, ..., "staleness_k": nk}: how many groups were sampled that many versions ago.

    `version` is the trainer's version when the groups were used. Every key up to `max_staleness` is
    present (zeros included) so dashboards get stable series.
    """
    counts = Counter(max(version - g.policy_version, 0) for g in groups)
    top = max([max_staleness, *counts])
    return {f"staleness_{s}": float(counts.get(s, 0)) for s in range(top + 1)}


def status_line(step: int, version: int, m: dict[str, float]) -> str:
    """One compact line of the step's key numbers."""
    parts = [f"v{version}", f"reward {m.get('reward_mean', 0):.3f}", f"acc {m.get('accuracy', 0):.3f}"]
    if "eval_accuracy" in m:
        parts.append(f"eval {m['eval_accuracy']:.3f}")
    parts += [
        f"H {m.get('entropy', 0):.3f}",
        f"clip {m.get('clip_fraction', 0):.3f}",
        # The mismatch corrections' shares of tokens (`trainer.grpo`), only where a correction acted.
        *[f"{label} {m[key]:.3f}" for key, label in (("truncated_fraction", "trunc"), ("masked_fraction", "mask"))
          if m.get(key)],
        f"idle {m.get('trainer_idle_s', 0):.1f}s",
        f"step {m.get('step_s', 0):.2f}s",
        f"stale {int(m.get('groups_stale', 0))}",
    ]
    return " | ".join(parts)


class StepDisplay:
    """A rich progress bar with a status field. Disabled (no terminal: a local swarm's trainer, a service), its steps
    and permanent lines go to the log instead, so that the trainer's log file says what it did."""

    def __init__(self, total: int, done: int = 0, enabled: bool = True, console: Console | None = None):
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task = None
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]trainer"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[status]}"),
                console=console or Console(stderr=True), transient=False,
            )
            self._task = self._progress.add_task("train", total=total, completed=done, status="starting")

    def __enter__(self) -> StepDisplay:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()

    def status(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, status=text)

    def step(self, step: int, version: int, metrics: dict[str, float]) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status_line(step, version, metrics))
        else:
            log.info("step %d: %s", step, status_line(step, version, metrics))

    def print(self, text: str) -> None:
        """A permanent line above the bar (evaluations, warnings); a log line when disabled."""
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            log.info("%s", text)


def _process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc); the import time of this module elsewhere."""
    try:
        import os

        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, counted after the name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()
PROCESS_STARTED_AT = _process_start_time()


def elapsed_s() -> float:
    """Seconds since the trainer process started (its imports and model loading included)."""
    return time.time() - PROCESS_STARTED_AT
