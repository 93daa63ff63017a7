"""The node's engine logs, kept off its live panel: what vLLM logs goes through this process's logging, and so is
printed above the panel like every other log line, instead of through a handler of vLLM's own that writes to the
terminal under the panel (each such write left a stale copy of the panel's header in the scrollback).

One warning is dropped: vLLM's layerwise reload says "ParallelLMHead: Failed to load weights" at every reload of a
model with a tied lm_head (the checkpoint has no lm_head.weight of its own). The engine expects it: after each
reload it refreshes the tied head and checks that the head computes with the new weights (node/vllm_engine.py), so
the warning would only repeat, at every new policy version, something that is not wrong.
"""

from __future__ import annotations

import logging
import os

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
TIED_HEAD_WARNING = "ParallelLMHead: Failed to load weights"


def _not_the_tied_head_warning(record: logging.LogRecord) -> bool:
    return record.getMessage() != TIED_HEAD_WARNING


def route_engine_logs() -> None:
    """Call before vLLM is imported (it reads VLLM_CONFIGURE_LOGGING then): vLLM's loggers get no handler of their
    own and pass their records up to this process's handlers; the tied head's reload warning is dropped."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    reload_logger = logging.getLogger(RELOAD_LOGGER)
    if _not_the_tied_head_warning not in reload_logger.filters:
        reload_logger.addFilter(_not_the_tied_head_warning)
