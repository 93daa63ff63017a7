"""The coordinator's HTTP API tests (test_coordinator_api.py) again, on a real PostgreSQL server: each data_dir a
coordinator starts with gets a fresh database of its own, kept across restarts within a test. Skipped, saying
why, when SWARMRL_TEST_PG_URL is unset."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests import test_coordinator_api as api
from tests.postgres import fresh_database, needs_pg

pytestmark = needs_pg
run_factory, run = api.run_factory, api.run
for _name in dir(api):
    if _name.startswith("test_"):
        globals()[_name] = getattr(api, _name)


@pytest.fixture
def store_url_for() -> Iterator[Callable[[Path], str]]:
    databases: dict[Path, str] = {}
    with ExitStack() as stack:
        def url_for(data_dir: Path) -> str:
            if data_dir not in databases:
                databases[data_dir] = stack.enter_context(fresh_database())
            return databases[data_dir]

        yield url_for
