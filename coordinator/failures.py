"""Failures of the coordinator's own storage, told apart from its bugs: a full disk is a 507, a database that is
busy, unreachable or out of connections a 503, both with a reason and a Retry-After, so that clients keep their
work and try again later (`runtime.client` waits such answers out). Nothing was stored by the request that got
one: a transaction that failed rolled back, and shard files are written under a temporary name and renamed
only when whole.
"""

from __future__ import annotations

import errno
import logging
import sqlite3

from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from swarmrl.coordinator.auth import Refused
from swarmrl.protocol.refusals import RefusalCode

log = logging.getLogger("swarmrl.coordinator")

RETRY_AFTER_S = 5
DISK_FULL = "the coordinator's disk is full: nothing was stored; its operator must free space, then retry"

# SQLite primary result codes (https://sqlite.org/rescode.html).
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_IOERR, _SQLITE_FULL, _SQLITE_CANTOPEN = 5, 6, 10, 13, 14
_PG_DISK_FULL = "53100"
_PG_UNAVAILABLE_CLASSES = ("08", "53", "57")  # connection exceptions, insufficient resources, operator intervention


class StorageUnavailable(Exception):
    """A storage failure told by another process (`coordinator.db.sqlite.writer`): `code` (UNAVAILABLE, 503, or
    DISK_FULL, 507) and `reason`, as `storage_failure` gave them there."""

    def __init__(self, code: RefusalCode, reason: str):
        if not isinstance(code, RefusalCode):
            raise TypeError(f"a storage failure needs its RefusalCode, got {code!r}")
        super().__init__(f"{code.status} {code}: {reason}")
        self.code, self.status, self.reason = code, code.status, reason


def storage_failure(e: BaseException) -> tuple[RefusalCode, str] | None:
    """(code, reason) when `e` is a failure of the coordinator's storage rather than of the request or the code;
    None otherwise."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return RefusalCode.DISK_FULL, DISK_FULL
    if isinstance(e, PoolTimeout):
        return RefusalCode.UNAVAILABLE, ("the coordinator is overloaded (no database connection free in time); "
                                         "retry later")
    if not isinstance(e, DBAPIError):
        return None
    orig = e.orig
    if isinstance(orig, sqlite3.Error):
        code = getattr(orig, "sqlite_errorcode", 0) & 0xFF
        if code == _SQLITE_FULL:
            return RefusalCode.DISK_FULL, DISK_FULL
        if code in (_SQLITE_BUSY, _SQLITE_LOCKED):
            return RefusalCode.UNAVAILABLE, "the coordinator's database is busy; retry later"
        if code in (_SQLITE_IOERR, _SQLITE_CANTOPEN):
            return RefusalCode.UNAVAILABLE, ("the coordinator's database cannot be read or written (I/O error); "
                                             "retry later")
        return None
    sqlstate = getattr(orig, "sqlstate", None) or ""
    if sqlstate == _PG_DISK_FULL:
        return RefusalCode.DISK_FULL, DISK_FULL
    if sqlstate[:2] in _PG_UNAVAILABLE_CLASSES or (e.connection_invalidated and not sqlstate):
        return RefusalCode.UNAVAILABLE, "the coordinator's database is unavailable; retry later"
    return None


def refusal_of(e: BaseException, what: str) -> tuple[RefusalCode, str, dict[str, str]] | None:
    """(code, reason, headers) of the answer to a request that raised `e` while serving `what` (e.g.
    "POST /v1/submit"): a refusal, or a failure of the storage (logged); None for anything else (a bug)."""
    if isinstance(e, Refused):
        return e.code, e.reason, e.headers
    if isinstance(e, StorageUnavailable):
        log.warning("%s: %s", what, e.reason)
        return e.code, e.reason, {"Retry-After": str(RETRY_AFTER_S)}
    if not isinstance(e, OSError | SQLAlchemyError):
        return None
    failure = storage_failure(e)
    if failure is None:
        return None
    log.warning("%s: %s (%s)", what, failure[1], e)
    return failure[0], failure[1], {"Retry-After": str(RETRY_AFTER_S)}
