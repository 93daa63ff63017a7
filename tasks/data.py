"""Data files of file-backed tasks: content-checked JSONL reading and the held-out split.

A task's options name its file by `path` (relative paths resolve against the loading role's `data_dir`, so
every machine points at its own copy) and pin its content by `sha256`. A file whose bytes hash differently
is refused, so the coordinator (who draws prompts), the verifier (who scores) and the trainer (who
evaluates) provably read the same problems. The held-out set is either a second pinned file (`eval_path`,
`eval_sha256`) or a seeded fraction of the first (`eval_fraction`, `split_seed`).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swarmrl.protocol.tasks import Problem

MAX_FILE_BYTES = 1 << 30


class FileTaskOptions(BaseModel):
    """Options every file-backed task shares."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="JSONL file of problems, one JSON object a line; relative to the data dir.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 (hex) of the file's bytes; a file that "
                        "hashes differently is refused.")
    eval_path: str | None = Field(None, description="JSONL file of held-out problems; None: split `path`.")
    eval_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="SHA-256 of `eval_path`.")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Without eval_path: the share of `path` held out.")
    split_seed: int = Field(0, description="Seed of the held-out split (without eval_path).")
    max_new_tokens: int = Field(512, ge=1, le=4096, description="Greedy completion length for evaluation.")

    @model_validator(mode="after")
    def _eval_pinned(self) -> FileTaskOptions:
        if (self.eval_path is None) != (self.eval_sha256 is None):
            raise ValueError("eval_path and eval_sha256 go together")
        return self


def read_pinned(path: Path, sha256: str) -> bytes:
    """The bytes of `path`, after checking they hash to `sha256`; ValueError otherwise."""
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"data file {path} is larger than {MAX_FILE_BYTES} bytes")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"data file {path} has sha256 {digest}, but the task's options pin {sha256}: "
                         "every role must read the same data")
    return data


def read_jsonl(data: bytes, parse: Callable[[dict[str, Any]], Problem], where: str) -> list[Problem]:
    """Problems from JSONL bytes, each line's object turned into a Problem by `parse` (which raises
    ValueError/KeyError/TypeError on a bad record). Blank lines are skipped; any bad line is an error naming it."""
    out: list[Problem] = []
    for i, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise TypeError("not a JSON object")
            out.append(parse(record))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}, line {i}: {e!r}") from None
    if not out:
        raise ValueError(f"{where}: no problems")
    return out


def load_split(opts: FileTaskOptions, data_dir: Path,
               parse: Callable[[dict[str, Any]], Problem]) -> tuple[list[Problem], list[Problem]]:
    """(training problems, held-out problems) as `opts` describe them. No training problem has the prompt of
    a held-out one (duplicates in the data included), and neither list is empty."""
    main = read_jsonl(read_pinned(data_dir / opts.path, opts.sha256), parse, opts.path)
    if opts.eval_path is not None and opts.eval_sha256 is not None:
        held = read_jsonl(read_pinned(data_dir / opts.eval_path, opts.eval_sha256), parse, opts.eval_path)
        pool = main
    else:
        order = list(range(len(main)))
        random.Random(opts.split_seed).shuffle(order)
        n_eval = max(1, round(len(main) * opts.eval_fraction))
        held = [main[i] for i in sorted(order[:n_eval])]
        pool = [main[i] for i in sorted(order[n_eval:])]
    held_prompts = {p.prompt for p in held}
    train = [p for p in pool if p.prompt not in held_prompts]
    if not train:
        raise ValueError(f"{opts.path}: no training problems left after holding out {len(held)}")
    return train, held
