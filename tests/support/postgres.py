"""The PostgreSQL server tests use: `SWARMRL_TEST_PG_URL` (CI sets it with scripts/test-postgres.sh), a role that
may create databases. Each test gets a database of its own, dropped afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from swarmrl.testing import postgres as testing_postgres

PG_URL = os.environ.get("SWARMRL_TEST_PG_URL")
SKIP_REASON = "SWARMRL_TEST_PG_URL is not set: export SWARMRL_TEST_PG_URL=\"$(scripts/test-postgres.sh)\" (CI does)"
needs_pg = pytest.mark.skipif(not PG_URL, reason=SKIP_REASON)


@contextmanager
def fresh_database() -> Iterator[str]:
    """The URL of a new, empty database on the test server; it is dropped on exit."""
    if not PG_URL:
        pytest.skip(SKIP_REASON)
    with testing_postgres.fresh_database(PG_URL) as url:
        yield url
