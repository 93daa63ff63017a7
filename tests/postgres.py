"""The PostgreSQL server tests use: `SWARMRL_TEST_PG_URL` (CI sets it with scripts/test-postgres.sh), a role that
may create databases. Each test gets a database of its own, dropped afterwards."""

from __future__ import annotations

import os
import secrets
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

PG_URL = os.environ.get("SWARMRL_TEST_PG_URL")
SKIP_REASON = "SWARMRL_TEST_PG_URL is not set: export SWARMRL_TEST_PG_URL=\"$(scripts/test-postgres.sh)\" (CI does)"
needs_pg = pytest.mark.skipif(not PG_URL, reason=SKIP_REASON)


@contextmanager
def fresh_database() -> Iterator[str]:
    """The URL of a new, empty database on the test server; it is dropped on exit."""
    if not PG_URL:
        pytest.skip(SKIP_REASON)
    name = f"swarmrl_t_{secrets.token_hex(6)}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            # From template0, which nobody can connect to: copying template1 fails while anyone else is on it.
            conn.exec_driver_sql(f'CREATE DATABASE "{name}" TEMPLATE template0')
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        _drop(admin, name)
        admin.dispose()


def _drop(admin: Engine, name: str, attempts: int = 10) -> None:
    """Drop the database, ending whatever is still connected to it. A backend this role may not end (e.g. the
    server's autovacuum working on the fresh tables) makes DROP fail until it is done: try again a few times."""
    for attempt in range(attempts):
        try:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            return
        except DBAPIError as e:
            if attempt == attempts - 1:
                warnings.warn(f"could not drop test database {name}: {e}", stacklevel=2)
                return
            time.sleep(0.5 * (attempt + 1))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=needs_pg)])
def store_url(request, tmp_path) -> Iterator[str]:
    """A fresh store URL: an SQLite file, and (when the server is there) a PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'coordinator.sqlite'}"
    else:
        with fresh_database() as url:
            yield url
