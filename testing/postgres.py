"""Throwaway PostgreSQL databases on a server whose login role may create databases (tests, benchmarks).

    with fresh_database(admin_url) as url:     # postgresql+psycopg://user:pw@host:port/<new database>
        ...
"""

from __future__ import annotations

import secrets
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError


@contextmanager
def fresh_database(admin_url: str) -> Iterator[str]:
    """The URL of a new, empty database on `admin_url`'s server; it is dropped on exit."""
    name = f"swarmrl_t_{secrets.token_hex(6)}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            # From template0, which nobody can connect to: copying template1 fails while anyone else is on it.
            conn.exec_driver_sql(f'CREATE DATABASE "{name}" TEMPLATE template0')
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
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
