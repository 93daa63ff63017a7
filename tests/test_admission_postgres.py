"""The admission tests (test_admission.py) again, on a real PostgreSQL server: each data_dir a coordinator starts
with gets a fresh database of its own. Skipped, saying why, when SWARMRL_TEST_PG_URL is unset."""

from __future__ import annotations

from tests import test_admission as admission
from tests.test_coordinator_api_postgres import needs_pg, store_url_for  # noqa: F401 (a fixture)

pytestmark = needs_pg
run_factory = admission.run_factory
for _name in dir(admission):
    if _name.startswith("test_"):
        globals()[_name] = getattr(admission, _name)
