"""A user's mistake, said in one line with its fix.

Every role raises `UserError` (or a subclass) for what the person running it must change: a path, a setting, the
order in which roles start. The command line prints its message alone, without a traceback (`swarmrl --debug ...`
shows one); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno

from pydantic import ValidationError

from swarmrl.protocol.pydantic_errors import describe_validation_error


class UserError(Exception):
    """Something the person running the command must fix; the message names the file or setting, and the fix."""


class NotACoordinator(UserError, ValueError):
    """A coordinator URL whose server answers, but not as a swarmrl coordinator does (a ValueError too, as the
    unparsable answer was before: callers trying several URLs skip it)."""


def not_a_coordinator(url: str, error: Exception) -> Exception:
    """What to raise when GET /v1/info at `url` failed with `error`: NotACoordinator for an answer no coordinator
    gives (a 404: every coordinator serves /v1/info; a page that is not a run description), else `error` itself."""
    if isinstance(error, ValidationError):
        first = error.errors()[0] if error.error_count() else {}
        seen = first.get("input") if first.get("type") == "json_invalid" else None
        if isinstance(seen, bytes):
            seen = seen.decode("utf-8", "replace")
        page = " ".join(seen[:80].split()) if isinstance(seen, str) else ""
        answer = f"a page that is not a run description ({page!r})" if page else \
            f"JSON that is not a run description ({describe_validation_error(error, limit=1)})"
    elif getattr(error, "status", None) == 404:
        answer = "HTTP 404: it has no such endpoint"
    else:
        return error
    return NotACoordinator(f"{url} is not a swarmrl coordinator: GET /v1/info answered with {answer}; check "
                           "coordinator_url (a coordinator prints its url when it starts)")


def port_problem(port_setting: str, host_setting: str, host: str, port: int, error: OSError) -> str:
    """One line for a listening socket that could not bind `host`:`port` (the settings `host_setting` and
    `port_setting`), with the fix."""
    if error.errno == errno.EADDRINUSE:
        return (f"{port_setting} {port} on {host} is in use (another role or coordinator on this machine, or another "
                f"program): stop it, or set {port_setting} to a free port")
    if error.errno == errno.EADDRNOTAVAIL:
        return f"{host_setting} {host!r} is not an address of this machine: set {host_setting} to one (127.0.0.1)"
    if error.errno == errno.EACCES:
        return f"{port_setting} {port} needs privileges on {host}: set {port_setting} above 1023"
    return f"cannot listen on {host}:{port} ({host_setting}, {port_setting}): {error.strerror or error}"
