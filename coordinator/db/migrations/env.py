"""Alembic environment of the coordinator's database.

The store runs the migrations itself when it opens (`coordinator.db.store.migrate`), handing over its connection
in `config.attributes["connection"]`. For the `alembic` command line (e.g. `alembic revision`), point
`sqlalchemy.url` at a database: `alembic -c <an ini naming this directory> -x url=sqlite:///scratch.sqlite ...`.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from swarmrl.coordinator.db.schema import metadata


def _run(connection) -> None:  # noqa: ANN001
    context.configure(connection=connection, target_metadata=metadata,
                      # SQLite alters most of a table only by copying it: Alembic's batch mode does that.
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("the coordinator's migrations run online only (they inspect the database they upgrade)")
connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or context.config.get_main_option("sqlalchemy.url")
    engine = create_engine(url)
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
