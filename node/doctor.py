"""`swarmrl node doctor`: check what a node needs before it is left running, and say what to fix.

Each check gives OK, WARN (works, but not as well as it could) or FAIL (the node will not work), with a fix:
the engine (GPU or CPU, vLLM importable, dtype), memory and disk against the engine settings, the node's key file,
the ports it listens on, the pool (when joining by name), and the coordinator: reachable, presenting the key the
node trusts, and the clock skew between the two machines (signed requests carry timestamps that the coordinator
refuses beyond its window, 120 s unless its operator changed `clock_skew_s`), measured from its HTTP Date header.
"""

from __future__ import annotations

import email.utils
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
from pydantic import ValidationError

from swarmrl.node.config import NodeConfig
from swarmrl.node.engine import EngineConfig
from swarmrl.node.engines import resolve_engine_kind, vllm_available
from swarmrl.protocol.identity import Identity, IdentityError
from swarmrl.protocol.run import RunInfo
from swarmrl.runtime.errors import not_a_coordinator

GIB = 1024**3
SKEW_WARN_S = 5.0
SKEW_FAIL_S = 90.0  # most of the coordinator's default 120 s window: requests in flight need the rest
DISK_FAIL_GIB, DISK_WARN_GIB = 1.0, 10.0
VLLM_IMPORT_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Check:
    status: Literal["OK", "WARN", "FAIL"]
    name: str
    detail: str
    fix: str = ""


def check_engine(cfg: EngineConfig, vllm_import_timeout_s: float = VLLM_IMPORT_TIMEOUT_S) -> list[Check]:
    """The device the engine will run on, and that its implementation can be imported."""
    import torch

    out = []
    cuda = torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.append(Check("OK", "device", f"GPU {props.name}, {props.total_memory / GIB:.0f} GiB "
                                         f"({torch.cuda.device_count()} visible), torch {torch.__version__}"))
    elif cfg.device == "cuda":
        out.append(Check("FAIL", "device", "engine.device = cuda, but torch sees no GPU",
                         "install the NVIDIA driver and a CUDA build of torch (`pip install 'swarmrl[gpu]'`), or set "
                         "engine.device=cpu"))
    else:
        out.append(Check("OK", "device", f"CPU, {os.cpu_count()} cores (no GPU seen), torch {torch.__version__}"))
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not cuda)
    if on_cpu and cfg.dtype != "float32":
        out.append(Check("WARN", "dtype", f"{cfg.dtype} on the CPU is slow and needs wider verifier margins",
                         "set engine.dtype=float32"))
    kind = resolve_engine_kind(cfg)
    if kind == "torch":
        why = "engine.kind = torch" if cfg.kind == "torch" else "vLLM is not installed"
        status = "OK" if cfg.kind == "torch" else "WARN"
        out.append(Check(status, "engine", f"torch engine ({why})",
                         "" if status == "OK" else "install vLLM for several times the throughput: "
                                                   "`pip install 'swarmrl[gpu]'` (GPU) or `'swarmrl[cpu]'` (CPU)"))
        return out
    if not vllm_available():
        return [*out, Check("FAIL", "engine", "engine.kind = vllm, but vLLM is not installed",
                            "`pip install 'swarmrl[gpu]'` (GPU) or `'swarmrl[cpu]'` (CPU), or set engine.kind=torch")]
    t0 = time.monotonic()
    try:
        # A fresh interpreter: importing vLLM takes seconds and may abort on a broken install (CUDA libraries).
        proc = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                              text=True, timeout=vllm_import_timeout_s)
    except subprocess.TimeoutExpired:
        return [*out, Check("FAIL", "engine", f"importing vLLM took more than {vllm_import_timeout_s:.0f} s",
                            "check the machine's load and the vLLM install")]
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return [*out, Check("FAIL", "engine", f"vLLM is installed but does not import: {last[:200]}",
                            "reinstall vLLM for this torch and CUDA (`pip install --force-reinstall 'swarmrl[gpu]'`), "
                            "or set engine.kind=torch")]
    version = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "?"
    return [*out, Check("OK", "engine", f"vLLM {version} imports ({time.monotonic() - t0:.0f} s)")]


def _available_memory() -> tuple[int, int]:
    """(total, available) bytes of RAM."""
    try:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text()
                .splitlines() if len(line.split()) >= 2}
        return info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError):  # not Linux
        size = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * size, os.sysconf("SC_AVPHYS_PAGES") * size


def check_memory(cfg: EngineConfig) -> Check:
    """RAM (and GPU memory) against the engine's KV cache and share settings."""
    import torch

    engine = (f"max_model_len {cfg.max_model_len or 'of the model'}, max_num_seqs {cfg.max_num_seqs}, "
              f"kv_cache_gib {cfg.kv_cache_gib}"
              + (f", gpu_memory_utilization {cfg.gpu_memory_utilization}" if cfg.gpu_memory_utilization else ""))
    if torch.cuda.is_available() and cfg.device != "cpu":
        free, total = torch.cuda.mem_get_info(0)
        want = cfg.gpu_memory_utilization * total if cfg.gpu_memory_utilization else cfg.kv_cache_gib * GIB
        if want > free:
            return Check("FAIL", "memory", f"GPU memory: {free / GIB:.1f} of {total / GIB:.1f} GiB free, the engine "
                         f"wants {want / GIB:.1f} GiB ({engine})",
                         "free the GPU (other processes), or lower engine.gpu_memory_utilization / kv_cache_gib")
        return Check("OK", "memory", f"GPU memory: {free / GIB:.1f} of {total / GIB:.1f} GiB free ({engine})")
    total, avail = _available_memory()
    need = cfg.kv_cache_gib * GIB + 2 * GIB  # the KV cache plus a small model, tokenizer and runtime
    detail = f"RAM: {avail / GIB:.1f} of {total / GIB:.1f} GiB available ({engine})"
    if avail < cfg.kv_cache_gib * GIB + GIB // 2:
        return Check("FAIL", "memory", detail, "lower engine.kv_cache_gib, or stop other programs")
    if avail < need:
        return Check("WARN", "memory", detail, "the model's own size comes on top: lower engine.kv_cache_gib or "
                     "engine.max_num_seqs if the node runs out of memory")
    return Check("OK", "memory", detail)


def check_disk(work_dir: Path) -> Check:
    """Free space and write access where checkpoints go."""
    target = Path(work_dir).resolve()
    existing = target
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    detail = f"{free / GIB:.1f} GiB free for {target}"
    if not os.access(existing, os.W_OK):
        return Check("FAIL", "disk", f"{existing} is not writable", "set work_dir to a directory this user can write")
    if free < DISK_FAIL_GIB * GIB:
        return Check("FAIL", "disk", detail, "free some space: the node keeps keep_versions checkpoints there")
    if free < DISK_WARN_GIB * GIB:
        return Check("WARN", "disk", detail, "large models need more: free space or lower keep_versions")
    return Check("OK", "disk", detail)


def check_key(key_path: Path) -> Check:
    if not Path(key_path).exists():
        return Check("OK", "identity", f"no key at {key_path} yet: one is made at the first start")
    try:
        ident = Identity.load(key_path)
    except IdentityError as e:
        return Check("FAIL", "identity", str(e), f"chmod 600 {key_path}, or move it away to start with a new key")
    return Check("OK", "identity", f"node id {ident.node_id[:16]}… ({key_path})")


def _tcp_port(maddr: str) -> int | None:
    parts = maddr.split("/")
    return int(parts[parts.index("tcp") + 1]) if "tcp" in parts and parts.index("tcp") + 1 < len(parts) else None


def check_ports(cfg: NodeConfig) -> list[Check]:
    """Fixed TCP ports the node would listen on must be free."""
    out = []
    wanted = [("p2p", a) for a in cfg.p2p.host_maddrs] if cfg.p2p.enabled else []
    for what, addr in wanted:
        port = _tcp_port(addr)
        if not port:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError as e:
                out.append(Check("FAIL", "ports", f"{what} port {port} ({addr}) cannot be used: {e.strerror}",
                                 f"stop what uses port {port}, or change {what}.host_maddrs"))
                continue
        out.append(Check("OK", "ports", f"{what} port {port} is free"))
    if cfg.metrics_port:  # another role of the pool on this machine may serve its metrics there already
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((cfg.metrics_host, cfg.metrics_port))
            except OSError as e:
                out.append(Check("FAIL", "ports", f"metrics_port {cfg.metrics_port} on {cfg.metrics_host} cannot be "
                                 f"used: {e.strerror}", "give each role on this machine its own metrics_port, or "
                                 "leave it unset (off)"))
            else:
                out.append(Check("OK", "ports", f"metrics port {cfg.metrics_port} is free"))
    return out or [Check("OK", "ports", "no fixed port: the node dials out, and listens on any free port")]


def check_coordinator(cfg: NodeConfig, timeout: float = 10.0) -> list[Check]:
    """The coordinator answers /v1/info, with the key the node trusts, and a clock close to ours."""
    url = cfg.coordinator_url.rstrip("/")
    t0 = time.time()
    try:
        resp = httpx.get(url + "/v1/info", timeout=timeout)
        t1 = time.time()
        resp.raise_for_status()
        info = RunInfo.model_validate_json(resp.content)
    except ValidationError as e:  # something answers there, but not a coordinator
        return [Check("FAIL", "coordinator", str(not_a_coordinator(url, e)),
                      "fix coordinator_url (or the pool's name)")]
    except (httpx.HTTPError, ValueError) as e:
        return [Check("FAIL", "coordinator", f"{url} does not answer /v1/info: {type(e).__name__}: {e}"[:300],
                      "check coordinator_url (or the pool's name), your network and firewall; the pool may be down "
                      "(a running node waits for it, but cannot join before it answers once)")]
    out = [Check("OK", "coordinator", f"{url} answers in {1000 * (t1 - t0):.0f} ms: run {info.spec.run_id!r}, "
                                      f"policy v{info.current_version}")]
    pin = Path(str(cfg.key_path) + ".coordinator")
    trusted = cfg.coordinator_key or (pin.read_text().strip() if pin.exists() else None)
    if trusted is None:
        out.append(Check("OK", "key", f"coordinator key {info.coordinator_key[:16]}… will be pinned at the first join"))
    elif trusted != info.coordinator_key:
        out.append(Check("FAIL", "key", f"the coordinator presents key {info.coordinator_key[:16]}…, this node "
                                        f"trusts {trusted[:16]}…",
                         f"if the pool's operator announced a new key, update coordinator_key or delete {pin}; "
                         "otherwise check the URL"))
    else:
        out.append(Check("OK", "key", f"the coordinator presents the trusted key {trusted[:16]}…"))
    out.append(clock_check(resp.headers.get("date"), t0, t1))
    return out


def clock_check(date_header: str | None, sent_at: float, received_at: float) -> Check:
    """The skew of the coordinator's clock (its HTTP Date header, 1 s resolution) against ours, taken at the
    middle of the request."""
    if not date_header:
        return Check("WARN", "clock", "the coordinator sent no Date header: skew not measured",
                     "make sure this machine's clock is synchronised (NTP)")
    try:
        theirs = email.utils.parsedate_to_datetime(date_header).timestamp()
    except (TypeError, ValueError):
        return Check("WARN", "clock", f"unreadable Date header {date_header!r}: skew not measured")
    # The header is truncated to the second: its true time lies in [theirs, theirs + 1).
    skew = theirs + 0.5 - (sent_at + received_at) / 2
    detail = f"coordinator clock {skew:+.1f} s from ours (±{0.5 + (received_at - sent_at) / 2:.1f} s)"
    fix = "turn on time synchronisation (NTP, e.g. `timedatectl set-ntp true`)"
    if abs(skew) > SKEW_FAIL_S:
        return Check("FAIL", "clock", detail + ": signed requests will be refused", fix)
    if abs(skew) > SKEW_WARN_S:
        return Check("WARN", "clock", detail, fix)
    return Check("OK", "clock", detail)


def run_checks(cfg: NodeConfig, vllm_import_timeout_s: float = VLLM_IMPORT_TIMEOUT_S) -> list[Check]:
    """Every check, in the order they are shown. With `cfg.pool`, the pool is looked up (read only: nothing is
    pinned) and its coordinator checked."""
    checks = [*check_engine(cfg.engine, vllm_import_timeout_s), check_memory(cfg.engine), check_disk(cfg.work_dir),
              check_key(cfg.key_path), *check_ports(cfg)]
    if cfg.pool:
        from swarmrl.node.join import find_pool, reachable_url
        from swarmrl.pools.trust import PoolTrust

        try:
            chosen, _ = find_pool(cfg, PoolTrust.in_dir(cfg.work_dir))
        except Exception as e:  # noqa: BLE001 (every reason a pool cannot be joined is a FAIL to show)
            return [*checks, Check("FAIL", "pool", f"{cfg.pool}: {e}", "`swarmrl pool list` shows the pools found")]
        rec = chosen.record
        checks.append(Check("OK", "pool", f"{rec.name!r}: {rec.model or 'model not named'}, {rec.nodes} nodes, "
                                          f"status {rec.status}"))
        cfg = cfg.model_copy(update={"coordinator_url": reachable_url(rec), "coordinator_key": rec.coordinator_key})
    return [*checks, *check_coordinator(cfg)]


def report(checks: list[Check]) -> str:
    """The checks as aligned lines, each FAIL and WARN followed by its fix."""
    colour = {"OK": "green", "WARN": "yellow", "FAIL": "red"}
    lines = []
    for c in checks:
        lines.append(f"[{colour[c.status]}]{c.status:<4}[/] {c.name:<12} {c.detail}")
        if c.fix and c.status != "OK":
            lines.append(f"{'':5}{'':12} [dim]fix:[/] {c.fix}")
    fails = sum(c.status == "FAIL" for c in checks)
    warns = sum(c.status == "WARN" for c in checks)
    lines.append("all good" if not fails and not warns else f"{fails} to fix, {warns} to consider")
    return "\n".join(lines)
