"""The coordinator client's request plumbing against a real HTTP server on loopback that answers what each test
scripts: which failures are retried (transport errors, 5xx; 500 only a few times; a 429 after its Retry-After), which
are not (other 4xx), the Idempotency-Key kept across the retries of one request, the outage logged once (or not at
all when quiet), and a stop that ends the wait."""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.run import RunInfo, RunSpec
from swarmrl.protocol.signing import SIGNATURE_HEADER
from swarmrl.runtime.client import IDEMPOTENCY_HEADER, CoordinatorClient, CoordinatorError
from swarmrl.runtime.retry import INTERNAL_ERROR_RETRIES, Outage, RetryPolicy

FAST = dict(base_s=0.001, cap_s=0.01)


class Scripted:
    """A server answering each request with the next scripted status (the last one repeats)."""

    def __init__(self, statuses: list[int]):
        self.statuses = statuses
        self.seen: list[tuple[str, str, str | None, str | None]] = []  # method, path, idempotency key, signature
        script = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                script.seen.append((self.command, self.path, self.headers.get(IDEMPOTENCY_HEADER),
                                    self.headers.get(SIGNATURE_HEADER)))
                status = script.statuses[min(len(script.seen), len(script.statuses)) - 1]
                payload = json.dumps({"detail": f"scripted {status}"} if status >= 400 else {}).encode()
                self.send_response(status)
                if status == 429:
                    self.send_header("retry-after", "0")
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def scripted() -> Iterator:
    servers: list[Scripted] = []

    def make(statuses: list[int]) -> Scripted:
        servers.append(Scripted(statuses))
        return servers[-1]

    yield make
    for s in servers:
        s.server.shutdown()
        s.server.server_close()


def test_full_jitter_stays_within_its_bound() -> None:
    policy = RetryPolicy(base_s=0.5, cap_s=8.0)
    rng = random.Random(0)
    for attempt in range(12):
        bound = min(8.0, 0.5 * 2**attempt)
        draws = [policy.delay(attempt, rng) for _ in range(200)]
        assert all(0 <= d <= bound for d in draws)
        assert max(draws) > 0.8 * bound  # spread over the whole range, not clustered at the bound or at 0
    assert not RetryPolicy(attempts=2).may_retry(2, started=0.0, now=0.0)
    assert RetryPolicy(attempts=None).may_retry(10_000, started=0.0, now=1e9)
    assert not RetryPolicy(attempts=None, give_up_after_s=5).may_retry(0, started=0.0, now=6.0)


def signing_client(url: str, **kw) -> CoordinatorClient:
    """A client with a node key that knows its pool already (a scripted server has no /v1/info)."""
    client = CoordinatorClient(url, Identity.generate(), **kw)
    client.trust(RunInfo.signed(RunSpec(), Identity.generate(), current_version=0))
    return client


def test_unavailable_is_waited_out_with_one_key_and_one_log_line(scripted, caplog) -> None:
    caplog.set_level(logging.INFO, logger="swarmrl.client")
    server = scripted([503, 502, 200])
    client = signing_client(server.url, retry=RetryPolicy(attempts=None, **FAST))
    client.heartbeat(3)
    assert len(server.seen) == 3
    keys = {key for _, _, key, _ in server.seen}
    assert len(keys) == 1 and None not in keys  # one key for the logical request, on every try
    nonces = {json.loads(sig)["nonce"] for _, _, _, sig in server.seen}
    assert len(nonces) == 3  # each try signed afresh
    logged = [r.getMessage() for r in caplog.records if r.name == "swarmrl.client"]
    assert len(logged) == 2 and "unreachable (HTTP 503)" in logged[0] and "reachable again" in logged[1]
    client.heartbeat(3)  # the next request has its own key
    assert server.seen[-1][2] not in keys


def test_a_quiet_outage_is_counted_but_not_logged(scripted, caplog) -> None:
    """A caller waiting for a coordinator it has just started (`swarmrl.localswarm.wait_until_up`) expects refusals:
    the outage is still kept (tries, outages) but no warning is printed."""
    caplog.set_level(logging.INFO, logger="swarmrl.client")
    server = scripted([503, 200])
    outage = Outage(server.url, quiet=True)
    signing_client(server.url, retry=RetryPolicy(attempts=None, **FAST), outage=outage).heartbeat(3)
    assert len(server.seen) == 2 and outage.outages == 1 and outage.down_since is None
    assert not [r for r in caplog.records if r.name == "swarmrl.client"]


def test_internal_errors_retried_a_few_times_and_refusals_not_at_all(scripted) -> None:
    server = scripted([500])
    client = CoordinatorClient(server.url, retry=RetryPolicy(attempts=None, **FAST))
    with pytest.raises(CoordinatorError) as e:
        client.info()
    assert e.value.status == 500 and len(server.seen) == 1 + INTERNAL_ERROR_RETRIES
    assert server.seen[0][2] is None  # a GET changes nothing: no key

    refusing = scripted([409])
    client = signing_client(refusing.url, retry=RetryPolicy(attempts=None, **FAST))
    with pytest.raises(CoordinatorError) as e:
        client.heartbeat(0)
    assert (e.value.status, e.value.reason, e.value.retried, len(refusing.seen)) == (409, "scripted 409", False, 1)

    # A refusal after a try that may have reached the server says so.
    flaky = scripted([503, 404])
    client = signing_client(flaky.url, retry=RetryPolicy(attempts=None, **FAST))
    with pytest.raises(CoordinatorError) as e:
        client.heartbeat(0)
    assert e.value.status == 404 and e.value.retried


def test_a_rate_limit_is_waited_out_as_it_asks_without_an_outage(scripted) -> None:
    server = scripted([429, 429, 200])
    client = signing_client(server.url, retry=RetryPolicy(attempts=None, **FAST))
    client.heartbeat(0)
    assert len(server.seen) == 3 and client.outage.outages == 0
    once = signing_client(scripted([429]).url, retries=0)
    with pytest.raises(CoordinatorError) as e:
        once.heartbeat(0)
    assert e.value.status == 429


def test_stop_ends_an_endless_wait() -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    stop = threading.Event()
    client = CoordinatorClient(url, retry=RetryPolicy(attempts=None, base_s=0.05, cap_s=0.2), stop=stop)
    failures: list[str] = []
    original = client.outage.failed

    def failed(error: str) -> None:
        original(error)
        failures.append(error)
        if len(failures) == 5:
            stop.set()  # e.g. Ctrl-C while the coordinator is down

    client.outage.failed = failed  # type: ignore[method-assign]
    with pytest.raises(httpx.ConnectError):
        client.info()
    assert len(failures) == 5 and client.outage.down_since is not None and client.outage.tries == 5

    gives_up = CoordinatorClient(url, retry=RetryPolicy(attempts=None, give_up_after_s=0.0, **FAST))
    with pytest.raises(httpx.ConnectError):
        gives_up.info()
