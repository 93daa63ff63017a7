"""The exactly-once tests (test_exactly_once.py) again, on a real PostgreSQL server, where tries of one request
run in concurrent transactions. Skipped, saying why, when SWARMRL_TEST_PG_URL is unset."""

from __future__ import annotations

from tests import test_exactly_once as once
from tests.postgres import needs_pg
from tests.test_coordinator_api_postgres import store_url_for  # noqa: F401  (the fixture that picks PostgreSQL)

pytestmark = needs_pg
run_factory, run = once.run_factory, once.run
for _name in dir(once):
    if _name.startswith("test_"):
        globals()[_name] = getattr(once, _name)
