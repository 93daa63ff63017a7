"""The trainer's state on disk: what a killed trainer needs to carry on where it stopped.

    state_dir/state-00000012/
        model/          HF checkpoint (model.safetensors, config, tokenizer): also what gets published
        optimizer.pt    AdamW state, keyed by parameter name (portable between 1 process and FSDP)
        rng.pt          torch and Python RNG states
        trainer.json    step, version (policy version of these weights), cursor (last group id consumed), and
                        the group ids the step that made this state trained on and passed over
    state_dir/steps.jsonl   one line per step ever taken, the same facts: which groups trained which version

A state is written into a temporary sibling directory, fsynced, and renamed into place (the rename fsynced with
its directory), so a state directory either is complete or does not exist, also after a power cut; `latest`
only ever sees complete ones. The step log is appended after the rename; a line lost to a kill between the two
is written again from the state's trainer.json when the trainer starts (`reconcile_step_log`), so the log holds
exactly one line per step of every state saved.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.trainer.model import load_checkpoint, save_checkpoint

STATE_PREFIX = "state-"
STEP_LOG = "steps.jsonl"


@dataclass
class TrainerState:
    """The trainer's counters. `version` is the policy version of the weights saved with it."""

    step: int = 0
    """Optimizer steps taken so far (across restarts)."""
    version: int = 0
    """Policy version of these weights; strictly increasing, one per step."""
    cursor: int = 0
    """The largest TrainingGroup.group_id consumed; the next pull asks for ids above it."""
    run_id: str = ""
    trained: list[int] = field(default_factory=list)
    """Group ids (feed positions) the step that made this state trained on."""
    skipped: list[int] = field(default_factory=list)
    """Group ids consumed since the previous state without being trained on (stale, zero advantage)."""


@dataclass
class LoadedState:
    """What `load_state` returns."""

    path: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    optimizer: dict[str, Any]
    """Optimizer state dict as `get_optimizer_state_dict(..., full_state_dict=True)` returns it."""
    rng: dict[str, Any]
    state: TrainerState


def capture_rng() -> dict[str, Any]:
    """The torch and Python RNG states (restorable with `restore_rng`)."""
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}


def restore_rng(rng: dict[str, Any]) -> None:
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))


def state_path(state_dir: str | Path, step: int) -> Path:
    return Path(state_dir) / f"{STATE_PREFIX}{step:08d}"


def list_states(state_dir: str | Path) -> list[Path]:
    """Complete state directories in `state_dir`, oldest first (by step)."""
    root = Path(state_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name.startswith(STATE_PREFIX) and (p / "trainer.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STATE_PREFIX):]))


def latest(state_dir: str | Path) -> Path | None:
    """The newest complete state directory in `state_dir`, or None when there is none."""
    states = list_states(state_dir)
    return states[-1] if states else None


def save_state(
    state_dir: str | Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    optimizer_state: dict[str, Any],
    state: TrainerState,
    rng: dict[str, Any] | None = None,
) -> Path:
    """Write a complete state for `state.step` atomically; returns its directory.

    `model` must hold full (unsharded) weights: under FSDP, rank 0 passes a gathered copy
    (see `trainer.distributed.full_model_on_rank0`).
    """
    root = Path(state_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = state_path(root, state.step)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-state-"))
    try:
        save_checkpoint(model, tokenizer, tmp / "model",
                        meta={"run_id": state.run_id, "version": state.version, "step": state.step})
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(rng if rng is not None else capture_rng(), tmp / "rng.pt")
        # trainer.json last: `list_states` takes its presence as "complete" (belt and braces with the rename).
        (tmp / "trainer.json").write_text(json.dumps(asdict(state), indent=1, sort_keys=True))
        _fsync_tree(tmp)  # the files' contents are on disk before the rename can be
        if final.exists():  # only when re-saving a step after an odd restart; the new one wins
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        _fsync_path(path)
    _fsync_path(root)


def step_line(state: TrainerState) -> dict[str, Any]:
    """The step log's line for the step that made `state`."""
    return {"step": state.step, "version": state.version, "cursor": state.cursor, "trained": state.trained,
            "skipped": state.skipped}


def append_step_log(state_dir: str | Path, state: TrainerState) -> None:
    """Append (and fsync) the line of the step that made `state`, saved just before."""
    with open(Path(state_dir) / STEP_LOG, "a") as f:
        f.write(json.dumps(step_line(state)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_step_log(state_dir: str | Path) -> list[dict[str, Any]]:
    """Every whole line of the step log (a line cut short by a kill is left out)."""
    path = Path(state_dir) / STEP_LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def reconcile_step_log(state_dir: str | Path, latest_state: TrainerState | None) -> None:
    """At start: cut a line a kill left half written, and write the newest state's line if a kill came between
    saving that state and logging it."""
    path = Path(state_dir) / STEP_LOG
    if path.exists():
        text = path.read_text()
        if text and not text.endswith("\n"):
            path.write_text(text[: text.rfind("\n") + 1])
    lines = read_step_log(state_dir)
    if latest_state is not None and latest_state.step > 0 and (not lines or lines[-1]["step"] < latest_state.step):
        append_step_log(state_dir, latest_state)


def read_state(path: str | Path) -> TrainerState:
    """Just the counters of the state at `path` (cheap: no weights are loaded)."""
    return TrainerState(**json.loads((Path(path) / "trainer.json").read_text()))


def load_state(path: str | Path) -> LoadedState:
    """Everything saved at `path` (a directory from `save_state` / `latest`)."""
    p = Path(path)
    model, tokenizer = load_checkpoint(p / "model")
    optimizer = torch.load(p / "optimizer.pt", weights_only=True, map_location="cpu")
    rng_file = p / "rng.pt"
    rng = torch.load(rng_file, weights_only=True, map_location="cpu") if rng_file.exists() else {}
    return LoadedState(path=p, model=model, tokenizer=tokenizer, optimizer=optimizer, rng=rng,
                       state=read_state(p))


def prune_states(state_dir: str | Path, keep: int, protect: set[Path] | None = None) -> list[Path]:
    """Delete all but the newest `keep` states (never one in `protect`) and stale temp dirs; returns deleted."""
    states = list_states(state_dir)
    protect = {p.resolve() for p in (protect or set())}
    removed = []
    for p in states[: max(len(states) - keep, 0)]:
        if p.resolve() not in protect:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def clean_temp(state_dir: str | Path) -> None:
    """Remove half-written temporary states left by a killed trainer (call at start, before saving)."""
    root = Path(state_dir)
    if root.is_dir():
        for p in root.glob(".tmp-state-*"):
            shutil.rmtree(p, ignore_errors=True)
