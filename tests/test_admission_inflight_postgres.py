"""The in-flight counter tests (test_admission_inflight.py) again, on a real PostgreSQL server: each data_dir a
coordinator starts with gets a fresh database of its own. Skipped, saying why, when SWARMRL_TEST_PG_URL is unset."""

from __future__ import annotations

from tests import test_admission_inflight as inflight
from tests.test_coordinator_api_postgres import needs_pg, store_url_for  # noqa: F401 (a fixture)

pytestmark = needs_pg
run_factory = inflight.run_factory
for _name in dir(inflight):
    if _name.startswith("test_"):
        globals()[_name] = getattr(inflight, _name)
