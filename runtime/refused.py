"""What a refusal of the coordinator is to its clients: `CoordinatorError`, with the refusal's code
(`protocol.refusals.RefusalCode`), which callers decide on, and its reason, which they show.
"""

from __future__ import annotations

import json

import httpx

from swarmrl.protocol.refusals import RefusalCode


class CoordinatorError(Exception):
    """The coordinator refused a request: `code` says why for programs (None when the answer carried none: a proxy's
    own error page, an older coordinator), `status` is the HTTP status, `reason` the explanation for people.

    `retried` is True when an earlier try of the same request may have reached the coordinator (its answer was
    lost): the refusal may then be about that earlier try having been applied already."""

    def __init__(self, status: int, reason: str, retried: bool = False, code: RefusalCode | None = None):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason
        self.retried = retried
        self.code = code


class UntrustedResponse(CoordinatorError):
    """A response that should carry the coordinator's signature and does not verify: it is not acted on."""

    def __init__(self, reason: str):
        super().__init__(502, f"refused the coordinator's answer: {reason} (rewritten on the way? use https)")


def refusal_in(resp: httpx.Response, retried: bool) -> CoordinatorError:
    """The CoordinatorError an error answer says: its code and reason from the body (`protocol.refusals.ErrorBody`),
    or the body's text and no code when it is not one (a proxy's own error page, an older coordinator)."""
    code = None
    try:
        body = resp.json()
        detail, code = body.get("detail", resp.text), RefusalCode.parse(body.get("code"))
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        detail = resp.text
    return CoordinatorError(resp.status_code, detail if isinstance(detail, str) else json.dumps(detail), retried, code)
