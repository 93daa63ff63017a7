"""The public default: real nginx, from the nginx.conf that docker/setup_pool.py --public writes (plain HTTP: a test
has no CA; the TLS variant is served once with a self-signed certificate), in front of a real coordinator process
from the same setup, all on loopback (Linux lets a client bind any 127.0.0.x address, so each is a source of its own).

Checked through the proxy: a node registers, leases and submits, and the coordinator sees its address; two sources
are two rate-limit buckets and a client cannot name another address; the slowloris attacker does not keep honest
requests out; one address holds at most its cap of requests in progress. Around the proxy: a client that sends its
own X-Real-IP straight to the coordinator is not believed. Nothing waits a fixed time."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from swarmrl.coordinator.app import SHARD_PUT_PREFIX as APP_SHARD_PREFIX
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.nginx import BEHIND_PROXY, SHARD_PUT_PREFIX, ProxySite, nginx_conf
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.runtime.config import load_config
from swarmrl.testing.byzantine.slowloris import Attacker, probe
from swarmrl.testing.faults import free_port
from swarmrl.testing.processes import RoleProcess
from swarmrl.testing.waiting import wait_for
from tests.support.coordinator import Clock, Run, submission
from tests.support.pool_setup import setup_configs

NGINX = shutil.which("nginx")
needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not on PATH (apt-get install nginx): these tests "
                                 "run the generated nginx.conf in a real nginx")
CHALLENGE = "/v1/register/challenge"
# Registration challenges: 3 per source, then (nearly) none: a source's bucket is empty once and stays so.
LIMITS = ["--set", "rate_limits.registration_burst=3", "--set", "rate_limits.registration_rate_per_s=0.0001"]


class Nginx:
    """`nginx -c CONF` in the foreground with its prefix (logs, temp files, pid) in `prefix`, as the test's user."""

    def __init__(self, conf: Path, prefix: Path, url: str):
        prefix.mkdir(parents=True, exist_ok=True)
        # As root nginx's workers would become `nobody`, who cannot enter the test's private temp directory.
        user = " user root;" if os.geteuid() == 0 else ""
        assert NGINX is not None
        self.proc = subprocess.Popen([NGINX, "-p", str(prefix), "-e", "error.log", "-c", str(conf),
                                      "-g", f"daemon off;{user}"], stderr=subprocess.PIPE, text=True)
        self.url, self.prefix = url, prefix

    def wait_ready(self, verify: ssl.SSLContext | bool = False) -> None:
        def answered() -> bool:
            assert self.proc.poll() is None, f"nginx exited: {self.proc.stderr.read() if self.proc.stderr else ''}"
            try:
                return httpx.get(self.url + "/v1/info", verify=verify, timeout=10).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(answered, "nginx to pass a request to the coordinator", timeout=60)

    def stop(self) -> None:
        self.proc.terminate()  # SIGTERM: nginx's fast shutdown
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Pool:
    proxy: str  # what nodes use: nginx
    direct: str  # the coordinator on loopback, as the operator roles beside it reach it
    cfg: CoordinatorConfig
    key: str  # the coordinator's public key
    verifier: CoordinatorClient


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    if NGINX is None:
        pytest.skip("nginx is not on PATH (apt-get install nginx)")
    root = tmp_path_factory.mktemp("public-pool")
    public, port = free_port(), free_port()
    while port == public:
        port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        paths = setup_configs(root, mp, env={"COORDINATOR_URL": f"http://127.0.0.1:{public}",
                                             "COORDINATOR_PORT": str(port)}, public=True)
    coordinator = RoleProcess("coordinator", paths["coordinator"], root / "coordinator.log", args=LIMITS).start()
    nginx = Nginx(paths["nginx"], root / "nginx", f"http://127.0.0.1:{public}")
    try:
        direct = coordinator.url()
        cfg = load_config(CoordinatorConfig, paths["coordinator"])
        key = cfg.load_identity()
        nginx.wait_ready()
        trainer = CoordinatorClient(direct, Identity.load(root / "keys" / "trainer.key"), retries=0)
        Run(direct, cfg, key, trainer, Clock(), root).publish(0)  # a checkpoint: leases need one
        verifier = CoordinatorClient(direct, Identity.load(root / "keys" / "verifier.key"), retries=0)
        yield Pool(nginx.url, direct, cfg, key.public_key_hex, verifier)
    finally:
        nginx.stop()
        coordinator.stop()


def challenge(url: str, source: str, claimed: str | None = None) -> int:
    """The status of one registration challenge from `source`, sending `X-Real-IP: claimed` if given."""
    headers = {"X-Real-IP": claimed} if claimed else {}
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30) as client:
        body = {"public_key": Identity.generate().public_key_hex}
        return client.post(url + CHALLENGE, json=body, headers=headers).status_code


def drain(url: str, source: str, claimed: str | None = None) -> list[int]:
    """Challenges from `source` until one is refused: the statuses."""
    got: list[int] = []
    while not got or got[-1] == 200:
        got.append(challenge(url, source, claimed))
        assert len(got) <= 10, got
    return got


# -- the generated file ---------------------------------------------------------------------------------------------


def test_the_proxy_bounds_follow_the_coordinators_config() -> None:
    cfg = CoordinatorConfig.model_validate({**BEHIND_PROXY, "port": 9470, "max_body_bytes": 1 << 20,
                                            "connections": {"header_timeout_s": 2.5, "max_per_source": 7}})
    text = nginx_conf(cfg, ProxySite("alpha.example.org", 443))
    for line in ("client_header_timeout 2500ms;", "limit_conn per_address 7;", "client_max_body_size 1048576;",
                 f"client_max_body_size {cfg.max_shard_bytes};", "server 127.0.0.1:9470;", "listen 443 ssl;",
                 "ssl_certificate /etc/letsencrypt/live/alpha.example.org/fullchain.pem;",
                 "proxy_set_header X-Real-IP $remote_addr;", "proxy_read_timeout 70s;"):
        assert line in text, line
    assert "ssl" not in nginx_conf(cfg, ProxySite("127.0.0.1", 8080, tls=False))
    assert SHARD_PUT_PREFIX == APP_SHARD_PREFIX
    for wrong in ({"host": "0.0.0.0"}, {"rate_limits": {}}, {"port": 0}):
        with pytest.raises(ValueError):  # reachable around the proxy, or every client one source
            nginx_conf(CoordinatorConfig.model_validate({**BEHIND_PROXY, **wrong}), ProxySite("a.example.org", 443))


def test_public_setup_needs_the_url_nodes_use_and_a_port_of_its_own_for_the_coordinator(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each load of the script is a module of its own, with a SetupError of its own.
    with pytest.raises(Exception, match="--public needs COORDINATOR_URL") as caught:
        setup_configs(tmp_path / "pool", monkeypatch, public=True)
    assert type(caught.value).__name__ == "SetupError"
    with pytest.raises(Exception, match="not COORDINATOR_URL's 8443, where nginx listens"):
        setup_configs(tmp_path / "pool", monkeypatch, {"COORDINATOR_URL": "https://a.example.org:8443",
                                                       "COORDINATOR_PORT": "8443"}, public=True)
    paths = setup_configs(tmp_path / "pool", monkeypatch, {"COORDINATOR_URL": "https://a.example.org",
                                                           "TLS_CERT": "/srv/tls/a.pem", "TLS_KEY": "/srv/tls/a.key"},
                          public=True)
    text = paths["nginx"].read_text()
    assert "listen 443 ssl;" in text and "ssl_certificate /srv/tls/a.pem;" in text and "server 127.0.0.1:8470;" in text
    assert (tmp_path / "pool" / "nginx").is_dir()  # nginx's prefix


# -- through the proxy ----------------------------------------------------------------------------------------------


@needs_nginx
def test_a_node_registers_leases_and_submits_through_the_proxy_under_its_own_address(pool: Pool) -> None:
    node = CoordinatorClient(pool.proxy, Identity.generate(), retries=0, coordinator_key=pool.key,
                             transport=httpx.HTTPTransport(local_address="127.0.0.30"))
    node.register(name="behind-nginx", engine="torch")
    lease = node.lease(4, held_version=0)
    assert lease is not None and lease.prompts
    assert node.submit(submission(lease)).accepted
    groups = [g for g in pool.verifier.pending(limit=64) if g.node_id == node.identity.node_id]
    assert groups and {g.node_source for g in groups} == {"127.0.0.30"}  # not the proxy's 127.0.0.1


@needs_nginx
def test_two_sources_are_two_buckets_through_the_proxy_and_none_can_name_another(pool: Pool) -> None:
    assert drain(pool.proxy, "127.0.0.10") == [200, 200, 200, 429]
    assert challenge(pool.proxy, "127.0.0.11") == 200  # another address: a bucket of its own
    assert challenge(pool.proxy, "127.0.0.10", claimed="127.0.0.12") == 429  # nginx writes the header itself


@needs_nginx
def test_a_client_that_names_an_address_straight_to_the_coordinator_is_not_believed(pool: Pool) -> None:
    assert drain(pool.proxy, "127.0.0.21") == [200, 200, 200, 429]
    # Around the proxy, claiming the drained address: its own bucket (its peer address), full.
    assert drain(pool.direct, "127.0.0.20", claimed="127.0.0.21") == [200, 200, 200, 429]
    assert challenge(pool.direct, "127.0.0.20", claimed="127.0.0.22") == 429  # a fresh name does not help


NGINX_CLOCK_S = 0.05
"""How far before its deadline nginx may close a connection, as another process's clock sees it (its cached time)."""


@needs_nginx
def test_honest_requests_are_served_while_slowloris_holds_connections_to_the_proxy(pool: Pool) -> None:
    attacker = Attacker(pool.proxy, "127.0.0.40", slots=300, trickle_s=0.2)
    try:
        # At once: connections it held longer than nginx's head deadline were closed (and opened again) meanwhile.
        wait_for(lambda: attacker.tally.most_held >= 300, "the attacker to hold its connections", timeout=60)
        assert probe(pool.proxy, 51, source="127.0.0.41", timeout_s=30) == 51
        wait_for(lambda: attacker.tally.closed > 0, "a held connection to reach nginx's header deadline", timeout=60)
        closed_after_s = attacker.stop().closed_after_s
        # Closed by nginx's head deadline, not sooner. nginx times it from the accept, on a clock it caches per
        # event-loop turn (millisecond resolution), before the attacker's own clock starts: allow that much early.
        assert closed_after_s is not None and closed_after_s >= pool.cfg.connections.header_timeout_s - NGINX_CLOCK_S
    finally:
        if attacker.proc.poll() is None:
            attacker.stop()


def _status(url: str, source: str) -> int:
    """The status of GET /v1/info from `source`."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30) as client:
        return client.get(url + "/v1/info").status_code


@needs_nginx
def test_one_address_holds_at_most_its_cap_of_requests_in_progress(pool: Pool) -> None:
    cap = pool.cfg.connections.max_per_source
    port = int(pool.proxy.rsplit(":", 1)[1])
    held = []
    try:
        for _ in range(cap):  # each a request whose head is in and whose body never comes
            sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=("127.0.0.50", 0))
            sock.sendall(f"POST {CHALLENGE} HTTP/1.1\r\nHost: pool\r\nContent-Type: application/json\r\n"
                         "Content-Length: 1000\r\n\r\n{".encode())
            held.append(sock)
        # nginx's workers take connections each in its own time: the next one is refused once all are counted.
        wait_for(lambda: _status(pool.proxy, "127.0.0.50") == 429, "the address to reach its cap", timeout=60)
        assert _status(pool.proxy, "127.0.0.51") == 200
        held.pop().close()
        wait_for(lambda: _status(pool.proxy, "127.0.0.50") == 200, "a freed slot to serve the address again",
                 timeout=60)
    finally:
        for sock in held:
            sock.close()


# -- the TLS variant --------------------------------------------------------------------------------------------------


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key: the files (certificate, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@needs_nginx
def test_the_tls_variant_serves_the_pool_over_https_with_the_operators_certificate(pool: Pool, tmp_path: Path
                                                                                   ) -> None:
    cert, key = _self_signed(tmp_path)
    port = free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_conf(pool.cfg, ProxySite("127.0.0.1", port, tls=True, certificate=str(cert),
                                                   certificate_key=str(key))))
    nginx = Nginx(conf, tmp_path / "nginx", f"https://127.0.0.1:{port}")
    try:
        trusted = ssl.create_default_context(cafile=str(cert))
        nginx.wait_ready(verify=trusted)
        node = CoordinatorClient(nginx.url, Identity.generate(), retries=0, coordinator_key=pool.key,
                                 transport=httpx.HTTPTransport(verify=trusted))
        assert node.info().spec.run_id == pool.cfg.run.run_id  # the signed run description, checked by its key
        with pytest.raises(httpx.ConnectError):  # a client that trusts only the usual CAs refuses it
            httpx.get(nginx.url + "/v1/info")
    finally:
        nginx.stop()
