"""The trainer's step log (`steps.jsonl`): one line per step of every state saved, whatever moment a kill picks:
a line cut short is dropped, and a state saved but not yet logged is logged when the trainer starts again."""

from __future__ import annotations

from pathlib import Path

from swarmrl.trainer.state import STEP_LOG, TrainerState, append_step_log, read_step_log, reconcile_step_log


def test_a_kill_between_saving_and_logging_is_mended_at_start(tmp_path: Path) -> None:
    s1 = TrainerState(step=1, version=1, cursor=4, trained=[1, 2, 4], skipped=[3])
    s2 = TrainerState(step=2, version=2, cursor=8, trained=[5, 6, 7, 8])
    append_step_log(tmp_path, s1)
    reconcile_step_log(tmp_path, s2)  # state 2 was saved, then the trainer was killed before logging it
    reconcile_step_log(tmp_path, s2)  # starting again changes nothing more
    assert read_step_log(tmp_path) == [
        {"step": 1, "version": 1, "cursor": 4, "trained": [1, 2, 4], "skipped": [3]},
        {"step": 2, "version": 2, "cursor": 8, "trained": [5, 6, 7, 8], "skipped": []}]


def test_a_line_cut_short_is_dropped(tmp_path: Path) -> None:
    append_step_log(tmp_path, TrainerState(step=1, version=1, cursor=2, trained=[1, 2]))
    with open(tmp_path / STEP_LOG, "a") as f:
        f.write('{"step": 2, "version": 2, "cur')  # killed while appending
    assert [line["step"] for line in read_step_log(tmp_path)] == [1]
    reconcile_step_log(tmp_path, TrainerState(step=1, version=1, cursor=2))  # the newest state is step 1
    append_step_log(tmp_path, TrainerState(step=2, version=2, cursor=4, trained=[3, 4]))
    assert [line["step"] for line in read_step_log(tmp_path)] == [1, 2]


def test_no_state_no_line(tmp_path: Path) -> None:
    reconcile_step_log(tmp_path, None)
    reconcile_step_log(tmp_path, TrainerState())  # the initial weights' state (step 0) made no step
    assert read_step_log(tmp_path) == []


def test_without_a_terminal_the_trainer_logs_its_steps_and_lines(caplog) -> None:
    """A local swarm's trainer runs with its progress bar off: its steps and its permanent lines (evaluations, a
    step not taken for want of reward spread) go to its log file instead of nowhere."""
    import logging

    from swarmrl.trainer.metrics import StepDisplay

    with caplog.at_level(logging.INFO, logger="swarmrl.trainer.metrics"), StepDisplay(10, enabled=False) as d:
        d.step(3, 3, {"loss": 0.5, "reward_mean": 0.25})
        d.print("v3: no step: all 8 fresh groups had zero advantage (no spread in reward within any group)")
        d.status("waiting")  # a transient status is not a log line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("step 3:") and "no spread in reward" in lines[1], lines


def test_the_status_line_shows_the_mismatch_corrections_only_where_they_acted() -> None:
    from swarmrl.trainer.metrics import status_line

    line = status_line(3, 3, {"clip_fraction": 0.5, "truncated_fraction": 0.25, "masked_fraction": 0.125})
    assert "clip 0.500 | trunc 0.250 | mask 0.125 | idle" in line, line
    line = status_line(3, 3, {"clip_fraction": 0.5, "truncated_fraction": 0.0, "masked_fraction": 0.125})
    assert "clip 0.500 | mask 0.125 | idle" in line, line
    assert "trunc" not in status_line(3, 3, {"truncated_fraction": 0.0, "masked_fraction": 0.0})
