"""Shared test settings and fixtures: one thread per process (2 shared cores), vLLM kept in-process; a coordinator
on loopback (`run_factory`, `run`), on SQLite or, for tests marked `both_stores`, on PostgreSQL too; fresh stores;
the trainer's initial checkpoint. Helpers the fixtures are built from are in tests/support/."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Callable, Iterator  # noqa: E402  (after the environment the imports read)
from contextlib import ExitStack  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from swarmrl.coordinator.config import CoordinatorConfig  # noqa: E402
from swarmrl.coordinator.ratelimit import RateLimitConfig  # noqa: E402
from swarmrl.coordinator.server import running_server  # noqa: E402
from swarmrl.protocol import messages as m  # noqa: E402
from swarmrl.protocol.identity import Identity  # noqa: E402
from swarmrl.protocol.run import RunSpec  # noqa: E402
from swarmrl.runtime.client import CoordinatorClient  # noqa: E402
from tests.support.coordinator import GROUP, MAX_TOKENS, Clock, Run  # noqa: E402
from tests.support.postgres import fresh_database, needs_pg  # noqa: E402

STORES = ["sqlite", pytest.param("postgresql", marks=needs_pg)]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "both_stores: run each test on SQLite and on PostgreSQL (skipped without "
                                       "SWARMRL_TEST_PG_URL)")
    if hasattr(config.option, "loadscopereorder"):  # xdist: keep the order made below (its own: most tests first)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest runs first: files in the order of their longest test (`slow(minutes=N)`), then by how many tests
    they hold, and each file's slow tests before its quick ones. With `-n 2 --dist loadfile` the two workers then
    start on the two longest runs at once and the many short files fill in behind them. In xdist's own order (the
    files with the most tests first), the long runs' small file started late and was the suite's tail: one worker
    busy and the other idle for many minutes."""
    def minutes(item: pytest.Item) -> float:
        marker = item.get_closest_marker("slow")
        return float(marker.kwargs.get("minutes", 1)) if marker is not None else 0.0

    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(files.values(), key=lambda f: (-max(map(minutes, f)), -len(f)))
    items[:] = [item for f in ordered for item in sorted(f, key=lambda i: -minutes(i))]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # A test marked both_stores that starts a coordinator runs once per store.
    if metafunc.definition.get_closest_marker("both_stores") and "store_url_for" in metafunc.fixturenames:
        metafunc.parametrize("store_kind", STORES)


@pytest.fixture
def store_kind() -> str:
    """The coordinator store of a test: SQLite unless the test is marked `both_stores`."""
    return "sqlite"


@pytest.fixture
def store_url_for(store_kind: str) -> Iterator[Callable[[Path], str | None]]:
    """data_dir -> the store URL a coordinator started there uses: None (SQLite in data_dir), or a fresh PostgreSQL
    database per data_dir, kept across restarts within the test and dropped after it."""
    if store_kind == "sqlite":
        yield lambda data_dir: None
        return
    databases: dict[Path, str] = {}
    with ExitStack() as stack:
        def url_for(data_dir: Path) -> str:
            if data_dir not in databases:
                databases[data_dir] = stack.enter_context(fresh_database())
            return databases[data_dir]

        yield url_for


@pytest.fixture(params=STORES)
def store_url(request, tmp_path) -> Iterator[str]:
    """A fresh store URL: an SQLite file, and (when the server is there) a PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'coordinator.sqlite'}"
    else:
        with fresh_database() as url:
            yield url


@pytest.fixture
def run_factory(tmp_path: Path, store_url_for: Callable[[Path], str | None]) -> Iterator:
    """Start a coordinator with config overrides; servers are stopped at the end of the test. Its store is the one
    `store_url_for` gives its data_dir: SQLite, or PostgreSQL in the `postgresql` case of a `both_stores` test."""
    stack = []

    def start(data_dir: Path | None = None, clock: Clock | None = None, **overrides) -> Run:
        op_key = overrides.pop("op_key", None) or Identity.generate()
        run = dict(run_id="test-run", sampling=m.SamplingSpec(group_size=GROUP, max_tokens=MAX_TOKENS))
        run.update({k: overrides.pop(k) for k in ("max_staleness", "task", "proofs", "sampling") if k in overrides})
        settings = dict(data_dir=data_dir or tmp_path / "coord", run=RunSpec(**run),
                        operator_keys=[op_key.public_key_hex],
                        max_body_bytes=256 * 1024, max_shard_bytes=64 * 1024, claim_ttl_s=30.0,
                        rate_limits=RateLimitConfig.off())
        settings.update(overrides)
        settings.setdefault("store_url", store_url_for(settings["data_dir"]))
        cfg = CoordinatorConfig(**settings)
        clock = clock or Clock()
        key = cfg.load_identity()
        cm = running_server(cfg, key, clock=clock)
        url = cm.__enter__()
        stack.append(cm)
        return Run(url, cfg, key, CoordinatorClient(url, op_key, retries=0), clock, tmp_path)

    def stop_last() -> None:
        stack.pop().__exit__(None, None, None)

    start.stop_last = stop_last  # type: ignore[attr-defined]
    yield start
    while stack:
        stack.pop().__exit__(None, None, None)


@pytest.fixture
def run(run_factory) -> Run:
    r = run_factory()
    r.publish(0)
    return r


@pytest.fixture()
def init_ckpt(tmp_path):
    """The trainer's initial checkpoint: a tiny random Llama with the character tokenizer."""
    from swarmrl.trainer.model import build_model, build_tokenizer, save_checkpoint
    from tests.support.trainer import TINY

    tok = build_tokenizer()
    return save_checkpoint(build_model(TINY, tok), tok, tmp_path / "init")
