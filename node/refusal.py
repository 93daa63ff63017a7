"""Which refusals stop a node, and the message that tells its operator what to do.

A node waits out everything that can change by itself (a coordinator down or restarting, a full lease book, a
stale submission). It stops, with `PermanentRefusal`, only when waiting cannot help: the pool banned its key, the
coordinator presents another key than the one the node trusts, or the two clocks disagree by more than the
coordinator accepts (signed requests carry timestamps). Each decision is made on the refusal's code
(`protocol.refusals.RefusalCode`), never on the words of its reason, which are for people and may change.
"""

from __future__ import annotations

import logging
from pathlib import Path

from swarmrl.protocol.refusals import RefusalCode
from swarmrl.runtime.client import CoordinatorError

log = logging.getLogger("swarmrl.node")


class PermanentRefusal(RuntimeError):
    """The pool refused this node in a way that waiting will not change; the message says what to do."""


def is_unknown_node(e: CoordinatorError) -> bool:
    """The coordinator does not know the node's key (it lost its database, or never had it): register again."""
    return e.code is RefusalCode.UNKNOWN_NODE


def is_other_pool(e: CoordinatorError) -> bool:
    """The coordinator refuses what this node signed as being for another pool: it runs another run, or has another
    key, than the one the node joined (registering again finds out which, and stops on a key it does not trust)."""
    return e.code is RefusalCode.OTHER_POOL


# Refusals of the node itself rather than of one piece of its work: its membership decides (stop, or register again).
_ABOUT_THE_NODE = frozenset({RefusalCode.BANNED, RefusalCode.CLOCK_SKEW, RefusalCode.UNKNOWN_NODE,
                             RefusalCode.OTHER_POOL})


def is_about_the_node(e: CoordinatorError) -> bool:
    """Whether `e` refuses the node itself (banned, its clock, unknown, another pool), which the node's membership
    deals with, rather than one request of its work (a stale submission, a full lease book), which is noted."""
    return e.code in _ABOUT_THE_NODE


def permanent(e: CoordinatorError, coordinator_url: str, key_path: Path) -> PermanentRefusal | None:
    """The PermanentRefusal a refusal amounts to (its message names the coordinator and the node's key file), or
    None when the node should wait and try again."""
    if e.code is RefusalCode.BANNED:
        return PermanentRefusal(
            f"the pool at {coordinator_url} banned this node's key ({key_path}): {e.reason}. Work from this "
            "key is no longer accepted; ask the pool's operator if you think this is a mistake.")
    if e.code is RefusalCode.CLOCK_SKEW:
        return PermanentRefusal(
            f"the coordinator refuses this node's signed requests as out of date: {e.reason}. This machine's clock "
            "is off: turn on time synchronisation (NTP, e.g. `timedatectl set-ntp true`), then start the node "
            "again (`swarmrl node doctor` measures the skew).")
    return None


def pinned_coordinator_key(configured: str | None, reported: str, coordinator_url: str, key_path: Path) -> str:
    """The coordinator key to trust: the `configured` one, else the one pinned on first use next to the node's key
    (`key_path`); PermanentRefusal when the coordinator at `coordinator_url` presents another."""
    if configured:
        if configured != reported:
            raise PermanentRefusal(
                f"the coordinator at {coordinator_url} presents key {reported[:16]}…, not the key this node "
                f"trusts ({configured[:16]}…, configured or pinned for the pool): refusing to work for it. "
                "If the pool's operator announced a new key, update coordinator_key (or remove the pool's pin from "
                "pools.json in the work dir); otherwise check the URL.")
        return configured
    pin = Path(str(key_path) + ".coordinator")
    if pin.exists():
        pinned = pin.read_text().strip()
        if pinned != reported:
            raise PermanentRefusal(
                f"the coordinator at {coordinator_url} presents key {reported[:16]}…, but this node pinned "
                f"{pinned[:16]}… on first use (in {pin}): refusing. If the pool's operator announced a new key, "
                f"delete {pin} (or set coordinator_key) and start again; otherwise check the URL.")
        return pinned
    pin.write_text(reported + "\n")
    log.warning("trusting coordinator key %s… on first use (pinned in %s)", reported[:16], pin)
    return reported
