"""What an operator role (trainer, verifier) needs before it works: its key, and a coordinator that answers.

- The key: the coordinator's `operator_keys` must list it. A role never makes one silently: a new key is useless
  until the coordinator lists it, so making one is logged with its public key and what to do; and a coordinator
  that refuses the key (a 403 on an operator endpoint) stops the role with one line naming the key file
  (`not_an_operator`).
- The coordinator: a role started before it waits for it, saying so once (`wait_for_coordinator`), as nodes wait
  out an outage; a URL that answers as something else stops the role with one line (`NotACoordinator`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.messages import RunInfo
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.runtime.errors import UserError
from swarmrl.runtime.retry import Outage, RetryPolicy

log = logging.getLogger("swarmrl.operator")


def operator_identity(path: str | Path, role: str) -> Identity:
    """The key at `path`; made there first when the file does not exist, and said so (a warning with the public
    key to add to the coordinator's operator_keys)."""
    path = Path(path)
    if path.exists():
        return Identity.load(path)
    ident = Identity.generate()
    ident.save(path)
    log.warning("%s: no key file at %s, so a new key was made there (public key %s); the coordinator accepts it only "
                "once its operator_keys lists it: add it there, or set key_path to the key that is listed",
                role, path.absolute(), ident.public_key_hex)
    return ident


def not_an_operator(role: str, path: str | Path, identity: Identity, url: str) -> UserError:
    """The one line for a coordinator that refuses this role's key as an operator key (a 403)."""
    return UserError(f"the coordinator at {url} does not list the {role}'s key as an operator key (key_path "
                     f"{Path(path).absolute()}, public key {identity.public_key_hex}): add that public key to the "
                     "coordinator's operator_keys and restart it, or set key_path to a key it lists")


def wait_for_coordinator(url: str, role: str, stop: threading.Event | None = None, cap_s: float = 5.0) -> RunInfo:
    """The coordinator's run description, once it answers at `url`: an unreachable coordinator (not started yet,
    restarting, a 5xx) is waited for as long as it takes (until `stop` is set), logged once, with the start order;
    a URL answering as something else raises NotACoordinator."""
    outage = Outage(url, context=lambda: f"the {role} starts once it answers (start the coordinator first)")
    with CoordinatorClient(url, retry=RetryPolicy(attempts=None, cap_s=cap_s), stop=stop, outage=outage) as client:
        return client.info()
