"""Prepare a pool's directory: keys, the initial checkpoint and one config per role, for one machine or for
docker/compose.yaml (its one-shot `setup` service).

    python docker/setup_pool.py mypool                 # one machine, as README.md's "Operating a pool" runs it
    COORDINATOR_URL=https://alpha.example.org python docker/setup_pool.py mypool --public   # nodes elsewhere, nginx
    python docker/setup_pool.py /pool --containers     # compose.yaml's setup job: one role per container

Makes what the roles need and nothing they make themselves (the coordinator makes its own key in its data dir):
the trainer's and the verifier's keys (their public keys become the coordinator's operator keys), the initial
checkpoint (`swarmrl model`, warmed up to WARMUP_ACCURACY, default 0.25; 0 keeps it random), and one config file
per role under <dir>/config, each checked against the role's config model. Paths in the configs are relative to
<dir>/config (a config's paths resolve against its own directory), so every role runs from any directory and the
pool's directory can move. Nodes share one config; each further node gets its name, key and work dir with --set.
Safe to run again: keys and the checkpoint are kept.

Listening: on one machine everything listens on loopback, and metrics are off unless METRICS_PORT is set: then
the verifier serves them on METRICS_PORT and the trainer on the next port (nodes share a config: give each
`--set metrics_port=N`). In containers each role has its own address:
the coordinator, the verifier, the trainer and the nodes listen on every interface of their container, metrics on
METRICS_PORT (9100) in each.

In public (--public): nodes reach the pool at COORDINATOR_URL through nginx (<dir>/config/nginx.conf, from
`coordinator.nginx`: TLS with the operator's certificate for an https URL, the connection bounds, the client's address
in X-Real-IP), which listens on the URL's port (443 for https) and holds the strangers' connections. The coordinator
listens on loopback only, on COORDINATOR_PORT (default 8470), and believes X-Real-IP from loopback only; the verifier
and the trainer on this machine reach it there directly. nginx runs with `nginx -p <dir>/nginx -e error.log -c
../config/nginx.conf` (logs, temp files and its pid in <dir>/nginx; docs/admission.md).

Environment: COORDINATOR_URL (default http://127.0.0.1:8470; in containers http://coordinator:8470, the compose
service; on one machine its port is the coordinator's; with --public the URL nodes use, required), COORDINATOR_PORT
(--public: the coordinator's loopback port), TLS_CERT and TLS_KEY (--public with https: the certificate's and the
key's files; default Let's Encrypt's for the URL's host), METRICS_PORT, RUN_ID (default compose-pool),
WARMUP_ACCURACY. A setting that does not fit is said in one line, with its fix (exit status 2).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.nginx import BEHIND_PROXY, ProxySite, nginx_conf
from swarmrl.node.config import NodeConfig
from swarmrl.protocol.identity import Identity, IdentityError
from swarmrl.protocol.pydantic_errors import describe_validation_error
from swarmrl.runtime.config import dump_toml
from swarmrl.trainer.config import TrainerConfig
from swarmrl.verifier.config import VerifierConfig

CONTAINER_URL = "http://coordinator:8470"
LOCAL_URL = "http://127.0.0.1:8470"
CONTAINER_METRICS_PORT = 9100


class SetupError(Exception):
    """A setting of this script that does not fit; the message names it and says the fix."""


def _env(name: str, default: str | None) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or default


def _metrics_port(containers: bool) -> int | None:
    raw = _env("METRICS_PORT", str(CONTAINER_METRICS_PORT) if containers else None)
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= (65535 if containers else 65534):  # one machine: the trainer takes the next port
        raise SetupError(f"METRICS_PORT={raw!r} is not a port number (1-65534): set a free port, or unset it "
                         "(on one machine: metrics off)")
    return port


def _coordinator_url(containers: bool, public: bool) -> tuple[str, int]:
    """COORDINATOR_URL and the port the coordinator listens on."""
    url = _env("COORDINATOR_URL", CONTAINER_URL if containers else None if public else LOCAL_URL)
    if url is None:
        raise SetupError("--public needs COORDINATOR_URL, the URL nodes reach the pool at: set it like "
                         "https://alpha.example.org (nginx.conf serves it with your certificate)")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise SetupError(f"COORDINATOR_URL={url!r} is not an http(s) URL with a host: set it like {LOCAL_URL}")
    if containers:
        return url, 8470
    if public:
        return url, _proxied_port(_site(url).port)
    if not _is_loopback(parts.hostname):
        raise SetupError(f"COORDINATOR_URL={url!r} names {parts.hostname}, but on one machine the coordinator "
                         f"listens on loopback only: pass --public (nginx in front of it, README 'In public'), or "
                         f"use http://127.0.0.1:{port or 8470}")
    # Plain http names the coordinator's own port; https is a TLS proxy in front of it, on 8470.
    return url, port if parts.scheme == "http" and port else 8470


def _site(url: str) -> ProxySite:
    """Where nginx serves the pool's URL (already checked by `_coordinator_url`)."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    assert parts.hostname is not None
    return ProxySite(server_name=parts.hostname, port=parts.port or (443 if tls else 80), tls=tls,
                     certificate=_env("TLS_CERT", None), certificate_key=_env("TLS_KEY", None))


def _proxied_port(public_port: int) -> int:
    """COORDINATOR_PORT: the coordinator's port behind nginx, on loopback."""
    raw = _env("COORDINATOR_PORT", "8470")
    assert raw is not None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535 or port == public_port:
        raise SetupError(f"COORDINATOR_PORT={raw!r} is not a free port for the coordinator behind nginx (1-65535, "
                         f"not COORDINATOR_URL's {public_port}, where nginx listens): set another, e.g. 8470")
    return port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _warmup() -> str:
    raw = _env("WARMUP_ACCURACY", "0.25")
    assert raw is not None
    try:
        ok = 0.0 <= float(raw) < 1.0
    except ValueError:
        ok = False
    if not ok:
        raise SetupError(f"WARMUP_ACCURACY={raw!r} is not an accuracy in [0, 1): set e.g. 0.25 (0: a random model)")
    return raw


def setup(pool: Path, *, containers: bool = False, public: bool = False) -> dict[str, Path]:
    """Write keys, checkpoint and configs under `pool`; the config files by role (and nginx.conf as "nginx" with
    `public`). SetupError for a setting (an environment variable or the directory) that does not fit, saying which
    and the fix."""
    if pool.exists() and not pool.is_dir():
        raise SetupError(f"{pool} is a file: give setup_pool.py a directory (it is made if missing)")
    url, port = _coordinator_url(containers, public)
    metrics_port = _metrics_port(containers)
    warmup = _warmup()
    run_id = _env("RUN_ID", "compose-pool")
    config_dir = pool / "config"
    config_dir.mkdir(parents=True, exist_ok=True)
    try:
        keys = {name: Identity.load_or_create(pool / "keys" / f"{name}.key") for name in ("trainer", "verifier")}
    except IdentityError as e:
        raise SetupError(str(e)) from None

    def rel(*parts: str) -> str:  # as the config files say it: relative to their directory
        return os.path.join("..", *parts)

    listen = "0.0.0.0" if containers else "127.0.0.1"
    # The operator roles of a public pool run beside the coordinator: they reach it directly, not through nginx.
    operator_url = f"http://127.0.0.1:{port}" if public else url
    metrics_host = "0.0.0.0" if containers else "127.0.0.1"

    def metrics(offset: int) -> dict[str, Any]:
        if metrics_port is None:
            return {}
        return {"metrics_host": metrics_host, "metrics_port": metrics_port + (0 if containers else offset)}

    try:
        configs = {
            "coordinator": CoordinatorConfig.model_validate({
                "host": listen, "port": port, "data_dir": rel("coordinator"),
                "run": {"run_id": run_id, "model": "tiny Llama (0.86M), character tokenizer",
                        "task": {"name": "addition"},
                        "sampling": {"temperature": 1.0, "max_tokens": 6, "group_size": 8}},
                "operator_keys": [k.public_key_hex for k in keys.values()], "max_buffered_groups": 64,
                **(BEHIND_PROXY if public else {})}),
            "verifier": VerifierConfig(coordinator_url=operator_url, key_path=rel("keys", "verifier.key"),
                                       work_dir=rel("verifier"), **metrics(0)),
            "trainer": TrainerConfig(coordinator_url=operator_url, key_path=rel("keys", "trainer.key"),
                                     state_dir=rel("trainer"), init_checkpoint=rel("init"), batch_groups=32,
                                     progress=False, **metrics(1)),
            # Nodes: one node runs as is; each further one takes --set name=..., key_path=..., work_dir=...
            # (compose.yaml), and on one machine a metrics_port of its own.
            "node": NodeConfig(coordinator_url=url, key_path=rel("keys", "node.key"), work_dir=rel("node-data"),
                               progress=False, max_prompts=8, engine={"kind": "auto"}, p2p={"enabled": False},
                               **(metrics(0) if containers else {})),
        }
    except ValidationError as e:
        raise SetupError(f"the settings (RUN_ID, COORDINATOR_URL, METRICS_PORT) make an invalid config: "
                         f"{describe_validation_error(e)}; fix that setting") from None
    init = pool / "init"
    if not (init / "config.json").exists():
        # The same command a lab runs by hand; a fresh process, so its threads and memory go away with it.
        subprocess.run([sys.executable, "-m", "swarmrl.cli", "model", str(init), "--warmup-accuracy", warmup],
                       check=True)
    paths = {}
    for role, cfg in configs.items():
        paths[role] = config_dir / f"{role}.toml"
        paths[role].write_text(dump_toml(cfg))
    if public:
        (pool / "nginx").mkdir(exist_ok=True)  # nginx's prefix: its logs, temp files and pid
        paths["nginx"] = config_dir / "nginx.conf"
        coordinator = configs["coordinator"]
        assert isinstance(coordinator, CoordinatorConfig)
        paths["nginx"].write_text(nginx_conf(coordinator, _site(url)))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", nargs="?", type=Path, default=Path(os.environ.get("POOL_DIR", "/pool")),
                        help="the pool's directory (default: POOL_DIR, else /pool)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--containers", action="store_true", help="one role per container (docker/compose.yaml)")
    where.add_argument("--public", action="store_true", help="nodes elsewhere reach the pool at COORDINATOR_URL "
                       "through nginx (config/nginx.conf; TLS for https), the coordinator on loopback behind it")
    args = parser.parse_args(argv)
    try:
        paths = setup(args.dir, containers=args.containers, public=args.public)
    except SetupError as e:
        print(f"setup_pool.py: {e}", file=sys.stderr)
        sys.exit(2)
    for role, path in paths.items():
        print(f"{role:12s} {path}")


if __name__ == "__main__":
    main()
