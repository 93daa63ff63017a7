"""The reverse proxy in front of a public coordinator: one nginx.conf, written from the coordinator's own config so
that the proxy's bounds and the coordinator's agree (docs/admission.md, "TLS and the reverse proxy").

nginx holds the strangers' connections: it reads a request's head and whole body before it opens a connection to the
coordinator (request buffering), so a slow or stalled client costs nginx about a kilobyte and the coordinator
nothing. The coordinator listens on loopback only (`BEHIND_PROXY`) and takes the client's address from the
`X-Real-IP` header nginx sets, believed only from loopback: its rate limits and its per-source rules see each client,
not the proxy.

    text = nginx_conf(cfg, ProxySite(server_name="alpha.example.org", port=443, tls=True))

Every path the file names besides the certificates is relative to nginx's prefix (`nginx -p DIR`): logs, temp
files and the pid file stay in one directory the operator chooses, and nginx runs as any user (started as root, its
workers run as `nobody`).
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from typing import Any

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.protocol.messages import MAX_WAIT_S

SOURCE_HEADER = "x-real-ip"
BEHIND_PROXY: dict[str, Any] = {"host": "127.0.0.1",
                                "rate_limits": {"source_header": SOURCE_HEADER, "trusted_proxies": ["127.0.0.1"]}}
"""Coordinator settings for a coordinator behind `nginx_conf`'s proxy on the same machine: it listens on loopback
only (so nobody reaches it around the proxy) and believes the proxy's X-Real-IP header from loopback only."""

SHARD_PUT_PREFIX = "/v1/trainer/shards/"
"""coordinator.app's path of shard uploads (not imported: the setup script runs without the coordinator's server
packages)."""
ANSWER_MARGIN_S = 60
"""Seconds the proxy waits for an answer beyond the longest long poll (MAX_WAIT_S): a loaded coordinator may answer
late, and a client waits 30 s for an answer itself (runtime.client)."""
SEND_TIMEOUT_S = 30
"""Seconds a client may go without reading any of its answer (a shard download to a slow reader keeps reading)."""
WORKER_CONNECTIONS = 8192
"""Connections per nginx worker, clients' and the coordinator's together: one still sending its head costs about a
kilobyte, so the cap that counts against slowloris is the head's deadline, not this."""
UPSTREAM_KEEPALIVE = 64
"""Idle connections to the coordinator kept per worker: reused, so that a busy pool does not run loopback out of
ports (each closed connection waits a minute in TIME_WAIT)."""


@dataclass(frozen=True)
class ProxySite:
    """Where nginx listens and how. `server_name`: the name (or address) nodes use in the pool's URL; an IP address
    is also the one address nginx listens on, a name means every interface. `tls`: serve https with the
    operator's certificate (`certificate`, `certificate_key`; default Let's Encrypt's paths for the name), or plain
    http (a test, or TLS ended further out)."""

    server_name: str
    port: int
    tls: bool = True
    certificate: str | None = None
    certificate_key: str | None = None

    @property
    def listen(self) -> str:
        try:
            ip = ipaddress.ip_address(self.server_name)
        except ValueError:
            return str(self.port)
        return f"[{ip}]:{self.port}" if ip.version == 6 else f"{ip}:{self.port}"

    @property
    def cert_paths(self) -> tuple[str, str]:
        live = f"/etc/letsencrypt/live/{self.server_name}"
        return (self.certificate or f"{live}/fullchain.pem", self.certificate_key or f"{live}/privkey.pem")


def nginx_conf(cfg: CoordinatorConfig, site: ProxySite) -> str:
    """A complete nginx.conf that serves `site` and passes every request to the coordinator of `cfg`, with the
    coordinator's connection bounds. ValueError when `cfg` does not sit behind it (`BEHIND_PROXY`): a coordinator
    that listens elsewhere can be reached around the proxy, and one that does not believe the proxy's header sees
    every client as one."""
    limits = cfg.rate_limits
    if not _is_loopback_ip(cfg.host) or cfg.port == 0:
        raise ValueError(f"the coordinator listens on {cfg.host}:{cfg.port}: behind the proxy it listens on a fixed "
                         "loopback port (host = \"127.0.0.1\")")
    if (limits.source_header or "").lower() != SOURCE_HEADER or "127.0.0.1" not in limits.trusted_proxies:
        raise ValueError(f"the coordinator's rate_limits must believe {SOURCE_HEADER} from 127.0.0.1 "
                         "(source_header, trusted_proxies): else every client counts as the proxy")
    conn = cfg.connections
    tls = ""
    if site.tls:
        cert, key = site.cert_paths
        tls = (f"        ssl_certificate {cert};\n        ssl_certificate_key {key};\n"
               "        ssl_protocols TLSv1.2 TLSv1.3;\n        ssl_session_cache shared:tls:10m;\n")
    # nginx counts `limit_conn` only for requests whose head it has read; heads still arriving are bounded by
    # client_header_timeout (a deadline for the whole head, not per read).
    return f"""# nginx in front of the swarmrl coordinator at {cfg.host}:{cfg.port} (written by docker/setup_pool.py).
# Run: nginx -p <the pool dir>/nginx -e error.log -c ../config/nginx.conf (relative paths: in that prefix).
# docs/admission.md says what each bound is for.
worker_processes auto;
worker_rlimit_nofile {4 * WORKER_CONNECTIONS};
pid nginx.pid;
error_log error.log warn;

events {{
    worker_connections {WORKER_CONNECTIONS};
}}

http {{
    access_log access.log combined buffer=64k flush=5s;
    client_body_temp_path temp-body;
    proxy_temp_path temp-proxy;
    fastcgi_temp_path temp-fastcgi;
    uwsgi_temp_path temp-uwsgi;
    scgi_temp_path temp-scgi;
    server_tokens off;

    # A request's head within the coordinator's header deadline; a stalled body or a client that stops reading its
    # answer is cut; an idle kept-alive connection closes as the coordinator's would.
    client_header_timeout {_s(conn.header_timeout_s)};
    client_body_timeout {_s(conn.body_timeout_s)};
    send_timeout {SEND_TIMEOUT_S}s;
    keepalive_timeout {_s(conn.header_timeout_s)};
    keepalive_requests 1000;
    reset_timedout_connection on;
    # Requests in progress per client address, as the coordinator's per-source cap (max_per_source).
    limit_conn_zone $binary_remote_addr zone=per_address:10m;
    limit_conn per_address {conn.max_per_source};
    limit_conn_status 429;
    # The coordinator's body cap: larger bodies are refused (413) before they are read.
    client_max_body_size {cfg.max_body_bytes};

    upstream coordinator {{
        server {cfg.host}:{cfg.port};
        keepalive {UPSTREAM_KEEPALIVE};
        # Idle connections are dropped well before the coordinator's own header deadline closes them, so a request
        # is never sent on a connection the coordinator is closing.
        keepalive_timeout {_s(conn.header_timeout_s / 2)};
    }}

    server {{
        listen {site.listen}{" ssl" if site.tls else ""};{_v6_hint(site)}
        server_name {site.server_name};
{tls}
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        # The client's address, replacing any the client sent: the coordinator's source for every bound.
        proxy_set_header X-Real-IP $remote_addr;
        proxy_set_header X-Forwarded-For "";
        proxy_connect_timeout 5s;
        # Long polls wait up to {MAX_WAIT_S:g} s for work before their answer comes.
        proxy_read_timeout {math.ceil(MAX_WAIT_S) + ANSWER_MARGIN_S}s;

        location / {{
            proxy_pass http://coordinator;
        }}
        # The trainer's checkpoint shards: the coordinator takes up to max_shard_bytes here, and only here.
        location {SHARD_PUT_PREFIX} {{
            client_max_body_size {cfg.max_shard_bytes};
            proxy_pass http://coordinator;
        }}
    }}
}}
"""


def _v6_hint(site: ProxySite) -> str:
    """For a name: how to serve IPv6 too (not on by default: nginx does not start where IPv6 is off)."""
    if site.listen != str(site.port):
        return ""
    return f"\n        # IPv6 clients too: listen [::]:{site.port}{' ssl' if site.tls else ''};"


def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _s(seconds: float) -> str:
    """A duration as nginx reads it: whole milliseconds, never shorter than asked."""
    return f"{math.ceil(seconds * 1000)}ms"
