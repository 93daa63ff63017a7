"""The ledger and receipt tests (test_ledger.py) again, on a real PostgreSQL server: each data_dir gets a fresh
database of its own. Skipped, saying why, when SWARMRL_TEST_PG_URL is unset."""

from __future__ import annotations

from tests import test_coordinator_api_postgres as pg
from tests import test_ledger
from tests.postgres import needs_pg

pytestmark = needs_pg
run_factory, run, store_url_for = pg.run_factory, pg.run, pg.store_url_for
for _name in dir(test_ledger):
    if _name.startswith("test_"):
        globals()[_name] = getattr(test_ledger, _name)
