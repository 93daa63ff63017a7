"""Broadcast benchmark: how fast does a checkpoint reach N nodes, through the swarm vs from the origin alone?

Runs, in one invocation and on one emulated network:

  (a) swarm: an origin (the coordinator's HTTP app, `coordinator.app`, serving its shard store, plus its DHT
      seed, `transfer.seed`; a minimal shard server if the app cannot be built), N honest
      nodes fetching with `CheckpointFetcher([SwarmSource, HttpOrigin])` (the sources a node uses), and (by
      default) one malicious peer that announces every shard and serves corrupted bytes;
  (b) origin-only: the same N nodes, each pulling every shard from the HTTP origin.

Every host (origin, nodes, malicious peers) is a process in its own network namespace, joined by a veth
pair to a bridge that lives in a namespace of its own; every link is shaped with `tc tbf` in both
directions (default 100 Mbit/s, the origin's too). Addresses are 10.231.0.0/16, inside those namespaces
only; nothing is added to the host's own namespace, and everything (namespaces, processes) is removed at
the end, also on failure. Needs root, `ip` and `tc`.

The checkpoint is a safetensors file of random float32 tensors (default 200 MB) plus a config.json,
written to a temporary directory, cut into content-addressed shards and signed like the coordinator does.
A node is done when `fetch` returned: signature checked, every shard hash-checked and written into the
checkpoint's files, which are moved into place. Reported times run from the moment all nodes are told to go
to the moment the last one is done. The lower bound is S/B: the origin must send every byte once and every
node must receive it once.

    sudo .venv/bin/python bench/broadcast.py --nodes 8 --rate-mbit 100 --size-mb 200

Delta mode (`--delta-changed F`): the checkpoint is bfloat16, and version 2 differs from version 1 in a share F of
its elements (each by one unit in the last place, as RL steps change bf16 weights). Run (a) broadcasts version 2
in full; run (c) broadcasts it as a delta (`transfer.delta`, staged as the trainer's publisher stages it) to the
same N nodes holding version 1 each: every node fetches the payload through the same swarm and origin (the
malicious peer announces the delta's shards too), rebuilds version 2 and checks every tensor's hash.
`delta_vs_full` is (c)'s time over (a)'s.

The last output line is one JSON object: swarm_s, origin_only_s, limit_s, nodes, size_mb, and details (with
`--delta-changed`: delta_s, delta_vs_full, delta_mb).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN_ID = "bench"
SUBNET = "10.231"
HTTP_PORT = 8470
SEED_PORT = 31337
MSG = "@@ "  # prefix of protocol lines on a worker's stdout


# =========================================================================================================
# network namespaces
# =========================================================================================================


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


class Network:
    """A bridge in its own namespace, and hosts (one namespace each) attached to it with shaped links."""

    def __init__(self, rate_mbit: float, prefix: str, queue_ms: float = 50.0, sysctls: list[str] | None = None):
        self.rate = rate_mbit
        self.queue_ms = queue_ms
        self.sysctls = list(sysctls or [])  # KEY=VALUE, set in every host's namespace (e.g. TCP buffer sizes)
        self.prefix = prefix
        self.switch = f"{prefix}sw"
        self.hosts: dict[str, str] = {}  # host name -> namespace
        self.ports: dict[str, str] = {}  # host name -> its port on the switch
        self.namespaces: list[str] = []

    def _ns(self, name: str) -> str:
        ns = f"{self.prefix}{name}"
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def up(self) -> Network:
        self._ns("sw")
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        return self

    def add_host(self, name: str, ip: str) -> str:
        ns = self._ns(name)
        port = self.ports[name] = f"p{len(self.hosts)}"
        sh("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        sh("ip", "-n", self.switch, "link", "set", port, "up")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/16", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        for kv in self.sysctls:
            sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", kv)
        # tbf both ways: the host's egress (its upload) and the switch port's egress (its download).
        shape = ["root", "tbf", "rate", f"{self.rate}mbit", "burst", "128kb", "latency", f"{self.queue_ms:g}ms"]
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *shape)
        sh("ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", port, *shape)
        self.hosts[name] = ns
        return ns

    def cpu_seconds(self) -> dict[str, float]:
        """Host name -> CPU seconds used so far by the processes in its namespace (workers and p2pd)."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for name, ns in self.hosts.items():
            total = 0.0
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    total += (int(fields[11]) + int(fields[12])) / tick
                except (OSError, IndexError, ValueError):
                    continue
            out[name] = total
        return out

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """Host name -> (bytes sent, bytes received) so far on its link, read from its switch port in one
        call for all hosts (the sampler must not take the CPU the swarm needs)."""
        out = sh("ip", "-n", self.switch, "-j", "-s", "link", "show", check=False).stdout
        try:
            stats = {d["ifname"]: d["stats64"] for d in json.loads(out)}
        except (ValueError, LookupError, TypeError):
            return {}
        # The port receives what its host sends, and sends what its host receives.
        return {h: (int(stats[p]["rx"]["bytes"]), int(stats[p]["tx"]["bytes"]))
                for h, p in self.ports.items() if p in stats}

    def kill_processes(self) -> None:
        """End every process still inside our namespaces (our workers and their p2pd daemons), by pid."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = []
            for ns in self.namespaces:
                out = sh("ip", "netns", "pids", ns, check=False).stdout.split()
                pids += [int(p) for p in out if p.isdigit()]
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if not pids:
                return
            time.sleep(1.0)

    def down(self) -> None:
        self.kill_processes()
        for ns in reversed(self.namespaces):
            sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()


# =========================================================================================================
# the checkpoint
# =========================================================================================================


def make_checkpoint(out: Path, size_mb: float) -> None:
    """A safetensors file of random float32 tensors totalling at least `size_mb` MB, and a config.json."""
    import numpy as np
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng()
    remaining = int(size_mb * 1e6) // 4 + 1
    tensors, i = {}, 0
    while remaining > 0:
        n = min(remaining, 1 << 22)
        tensors[f"layers.{i}.weight"] = rng.standard_normal(n, dtype=np.float32)
        remaining -= n
        i += 1
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"model_type": "bench", "tensors": i}))


def make_delta_pair(work: Path, size_mb: float, changed: float) -> tuple[Path, Path]:
    """Versions 1 and 2 of a bfloat16 checkpoint of `size_mb` MB: 2 is 1 with a share `changed` of its elements
    moved by one unit in the last place (up or down at random)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    remaining = int(size_mb * 1e6) // 2 + 1
    v1, v2, i = {}, {}, 0
    while remaining > 0:
        n = min(remaining, 1 << 22)
        w = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
        bits = w.view(torch.int16).clone()
        moved = torch.rand(n, generator=gen) < changed
        bits[moved] += (torch.randint(0, 2, (int(moved.sum()),), generator=gen, dtype=torch.int16) * 2 - 1)
        v1[f"layers.{i}.weight"], v2[f"layers.{i}.weight"] = w, bits.view(torch.bfloat16)
        remaining -= n
        i += 1
    dirs = []
    for version, tensors in ((1, v1), (2, v2)):
        out = work / f"ckpt-v{version}"
        out.mkdir(parents=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({"model_type": "bench", "tensors": i}))
        dirs.append(out)
    return dirs[0], dirs[1]


# =========================================================================================================
# workers (each runs inside one namespace)
# =========================================================================================================


def emit(kind: str, **data: Any) -> None:
    sys.stdout.write(MSG + json.dumps({"kind": kind, **data}) + "\n")
    sys.stdout.flush()


def read_cmd() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the orchestrator went away
    return json.loads(line)


def origin_app(cfg: dict[str, Any]) -> tuple[Any, str]:
    """The real coordinator app over the bench's data dir (its /v1/shards endpoint is what nodes use), or,
    if that cannot be built here, a minimal app serving the same shard store."""
    from swarmrl.protocol.identity import Identity
    from swarmrl.protocol.manifest import ManifestError
    from swarmrl.transfer.store import ShardStore

    try:
        from swarmrl.coordinator.app import build_app
        from swarmrl.coordinator.config import CoordinatorConfig

        ccfg = CoordinatorConfig(host=cfg["ip"], port=HTTP_PORT, data_dir=Path(cfg["data_dir"]), run={"run_id": RUN_ID},
                                 key_path=Path(cfg["key_path"]))
        return build_app(ccfg, Identity.load(cfg["key_path"])), "swarmrl.coordinator.app"
    except Exception as e:  # noqa: BLE001 (the coordinator is someone else's moving target)
        print(f"real coordinator unavailable ({type(e).__name__}: {e}); using a minimal shard server",
              file=sys.stderr)
    from fastapi import FastAPI, HTTPException, Response

    store = ShardStore(Path(cfg["data_dir"]) / "shards")
    app = FastAPI()

    @app.get("/v1/shards/{sha}")
    def shard(sha: str) -> Response:
        try:
            return Response(store.get(sha), media_type="application/octet-stream")
        except (ManifestError, OSError) as e:
            raise HTTPException(404, "no such shard") from e

    return app, "minimal"


def worker_origin(cfg: dict[str, Any]) -> None:
    """HTTP origin serving the shard store (and, in swarm mode, the coordinator's DHT seed)."""
    import uvicorn

    from swarmrl.protocol.manifest import SignedManifest
    from swarmrl.transfer.store import ShardStore

    store = ShardStore(Path(cfg["data_dir"]) / "shards")
    app, kind = origin_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg["ip"], port=HTTP_PORT, log_level="warning",
                                           access_log=False))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    seed = None
    bootstrap: list[str] = []
    if cfg["swarm"]:
        from swarmrl.transfer.p2p.config import P2PConfig
        from swarmrl.transfer.seed import DhtSeed

        signed = SignedManifest.model_validate_json(Path(cfg["manifest"]).read_text())
        pcfg = P2PConfig(host_maddrs=[f"/ip4/{cfg['ip']}/tcp/{SEED_PORT}"], **cfg.get("p2p", {}))
        seed = DhtSeed(pcfg, RUN_ID, store).start()
        seed.publish(signed.manifest)
        bootstrap = seed.bootstrap_peers
    emit("ready", bootstrap=bootstrap, origin=kind)
    while read_cmd().get("cmd") != "stop":
        pass
    stats = seed.peer.stats.__dict__ if seed is not None else {}
    if seed is not None:
        seed.close()
    server.should_exit = True
    emit("bye", seed_stats=stats)


class LyingStore:
    """For the malicious peer: claims every shard and hands out random bytes of the right size."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes

    def has(self, sha: str) -> bool:
        return sha in self.sizes

    def get(self, sha: str) -> bytes:
        return os.urandom(self.sizes[sha])


def worker_node(cfg: dict[str, Any]) -> None:
    """An honest node (swarm or origin-only), or with cfg['malicious'] a peer serving corrupted shards."""
    from swarmrl.protocol.manifest import SignedManifest
    from swarmrl.runtime.client import CoordinatorClient
    from swarmrl.transfer import fetcher as fetcher_module
    from swarmrl.transfer.fetcher import CheckpointFetcher, FetchConfig
    from swarmrl.transfer.sources import HttpOrigin, ShardSource

    peer = None
    if cfg["swarm"]:
        from swarmrl.transfer.p2p.config import P2PConfig
        from swarmrl.transfer.p2p.sources import SwarmSource
        from swarmrl.transfer.p2p.swarm import SwarmPeer

        pcfg = P2PConfig(host_maddrs=[f"/ip4/{cfg['ip']}/tcp/0"], initial_peers=cfg["bootstrap"], **cfg.get("p2p", {}))
        peer = SwarmPeer(pcfg, RUN_ID).start()
    if cfg.get("held"):  # delta mode: the node holds version 1 (fetched and checked before), as its own copy
        shutil.copytree(Path(cfg["held"]), Path(cfg["root"]) / Path(cfg["held"]).name)
    # Made before "ready", as a node has it before a broadcast: an HTTP client loads its TLS certificates,
    # which took 0.3 s after "go" with 8 nodes starting at once on 2 cores.
    client = CoordinatorClient(f"http://{cfg['origin_ip']}:{HTTP_PORT}", timeout=120)
    emit("ready", peer_id=peer.peer_id if peer else "")
    go = read_cmd()
    signed = SignedManifest.model_validate(go["signed"])
    result: dict[str, Any] = {}
    if cfg.get("malicious"):
        assert peer is not None
        peer.serve(signed.manifest, LyingStore({s.sha256: s.size for s in signed.manifest.shards()}))  # type: ignore[arg-type]
        emit("done", t_done=time.time(), malicious=True)
    else:
        sources: list[ShardSource] = [HttpOrigin(client)]
        if peer is not None:
            sources.insert(0, SwarmSource(peer))
        fetcher = CheckpointFetcher(cfg["root"], go["coordinator_key"], sources, keep_versions=2,
                                    config=FetchConfig(**cfg.get("fetch", {})))
        rebuilds: list[tuple[float, float]] = []  # a delta's rebuild: (wall s, CPU s of this process)
        rebuild = fetcher_module.rebuild

        def timed_rebuild(*a: Any, **k: Any) -> Path:
            w, c = time.perf_counter(), time.process_time()
            try:
                return rebuild(*a, **k)
            finally:
                rebuilds.append((time.perf_counter() - w, time.process_time() - c))

        fetcher_module.rebuild = timed_rebuild  # type: ignore[assignment]
        t0, c0 = time.time(), time.process_time()
        profile_dir = os.environ.get("BROADCAST_PROFILE_DIR")  # where each node leaves cProfile stats of its fetch
        profiler = None
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        try:
            manifest, out = fetcher.fetch(signed)
            ok, error = True, ""
        except Exception as e:  # noqa: BLE001 (reported to the orchestrator)
            ok, error = False, f"{type(e).__name__}: {e}"
        t1 = time.time()
        if profiler is not None and profile_dir:
            profiler.disable()
            profiler.dump_stats(str(Path(profile_dir) / f"{Path(cfg['root']).parent.name}-{Path(cfg['root']).name}"))
        stored = sorted(p.stat().st_mtime for p in fetcher.store.root.glob("??/*"))
        result = {"ok": ok, "error": error, "t_start": t0, "t_done": t1, "stats": fetcher.stats.__dict__,
                  "workers": fetcher.workers,
                  "cpu_s": time.process_time() - c0, "rebuild_wall_s": sum(r[0] for r in rebuilds),
                  "rebuild_cpu_s": sum(r[1] for r in rebuilds), "t_half": stored[len(stored) // 2] if stored else t1,
                  "t_last_shard": stored[-1] if stored else t1, "t_first_shard": stored[0] if stored else t1}
        if peer is not None:
            result["banned"] = sorted(peer.banned)
        emit("done", **result)
    while read_cmd().get("cmd") != "stop":
        pass
    swarm_stats = peer.stats.__dict__ if peer is not None else {}
    if peer is not None:
        peer.close()
    emit("bye", swarm_stats=swarm_stats)


def worker_main(role: str, cfg_json: str) -> None:
    import logging

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = json.loads(cfg_json)
    if role == "origin":
        worker_origin(cfg)
    else:
        worker_node(cfg)


# =========================================================================================================
# orchestration
# =========================================================================================================


class Worker:
    def __init__(self, name: str, ns: str, role: str, cfg: dict[str, Any], log_dir: Path):
        self.name = name
        self.log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(Path(__file__).resolve()), "--worker", role,
             json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT,
        )
        self._buf = ""

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            self.send(cmd="stop")
        except (BrokenPipeError, OSError):
            pass


def wait_all(workers: list[Worker], kind: str, timeout: float) -> dict[str, dict[str, Any]]:
    """Wait until every worker has emitted a `kind` message; name -> message."""
    got: dict[str, dict[str, Any]] = {}
    deadline = time.time() + timeout
    by_fd = {w.proc.stdout.fileno(): w for w in workers}  # type: ignore[union-attr]
    while len(got) < len(workers):
        left = deadline - time.time()
        if left <= 0:
            missing = [w.name for w in workers if w.name not in got]
            raise TimeoutError(f"no '{kind}' within {timeout:.0f} s from {missing}")
        ready, _, _ = select.select(list(by_fd), [], [], min(left, 1.0))
        for fd in ready:
            w = by_fd[fd]
            line = w.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                by_fd.pop(fd)
                if w.name not in got:
                    raise RuntimeError(f"worker {w.name} exited (rc={w.proc.wait()}); see its log")
                continue
            if line.startswith(MSG):
                msg = json.loads(line[len(MSG):])
                if msg["kind"] == kind:
                    got[w.name] = msg
    return got


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    f = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return sum(f) - idle, sum(f)


def origin_link_summary(samples: list[tuple[float, int]], t_go: float, rate_mbit: float) -> dict[str, Any]:
    """How busy an upload link (or the sum of several) was: MB sent, and the rate per 2-second window as a
    percentage of `rate_mbit`."""
    if len(samples) < 2:
        return {}
    t0, b0 = samples[0]
    windows = []
    i = 0
    for j, (t, b) in enumerate(samples):
        if t - samples[i][0] >= 2.0 or j == len(samples) - 1:
            if t > samples[i][0]:
                windows.append(round(100 * (b - samples[i][1]) * 8 / (t - samples[i][0]) / (rate_mbit * 1e6)))
            i = j
    sent = samples[-1][1] - b0
    busy_until = next((t for t, b in samples if b - b0 >= 0.99 * sent), samples[-1][0])
    return {"sent_mb": round(sent / 1e6, 1), "pct_per_2s": windows,
            "avg_pct_until_99pct_sent": round(100 * 0.99 * sent * 8 / max(1e-9, busy_until - t0) /
                                              (rate_mbit * 1e6))}


def run_phase(net: Network, args: argparse.Namespace, work: Path, swarm: bool, signed_path: Path,
              coordinator_key: str, data_dir: Path, key_path: Path, held: Path | None = None) -> dict[str, Any]:
    phase = ("swarm" if swarm else "origin") + ("-delta" if held is not None else "")
    logs = work / f"logs-{phase}"
    logs.mkdir(exist_ok=True)
    from swarmrl.runtime.config import apply_overrides

    p2p = apply_overrides({}, args.p2p)
    fetch = apply_overrides({}, args.fetch)
    origin_ip = f"{SUBNET}.0.1"
    workers: list[Worker] = []
    try:
        origin = Worker("origin", net.hosts["origin"], "origin",
                        {"ip": origin_ip, "data_dir": str(data_dir), "key_path": str(key_path), "swarm": swarm,
                         "manifest": str(signed_path), "p2p": apply_overrides({}, args.seed_p2p)}, logs)
        workers.append(origin)
        origin_ready = wait_all([origin], "ready", 120)["origin"]
        boot = origin_ready["bootstrap"]
        nodes = []
        for i in range(args.nodes):
            cfg = {"ip": f"{SUBNET}.1.{i + 1}", "swarm": swarm, "bootstrap": boot, "origin_ip": origin_ip,
                   "root": str(work / phase / f"node{i}"), "p2p": p2p, "fetch": fetch,
                   "held": str(held) if held is not None else None}
            nodes.append(Worker(f"node{i}", net.hosts[f"node{i}"], "node", cfg, logs))
        bad = []
        if swarm:
            for j in range(args.malicious):
                cfg = {"ip": f"{SUBNET}.2.{j + 1}", "swarm": True, "bootstrap": boot, "origin_ip": origin_ip,
                       "malicious": True, "p2p": p2p}
                bad.append(Worker(f"bad{j}", net.hosts[f"bad{j}"], "node", cfg, logs))
        workers += nodes + bad
        wait_all(nodes + bad, "ready", 300)
        signed = json.loads(signed_path.read_text())
        if bad:  # the malicious peers announce everything before the honest nodes start
            for w in bad:
                w.send(cmd="go", signed=signed, coordinator_key=coordinator_key)
            wait_all(bad, "done", 60)
        time.sleep(2.0 if swarm else 0.5)  # let the DHT settle (announcements, routing tables)
        cpu0, ns0 = cpu_times(), net.cpu_seconds()
        samples: list[tuple[float, int]] = []
        node_samples: list[tuple[float, int]] = []
        per_node: list[list[int]] = []
        rx_samples: list[tuple[float, int]] = []
        sampling = threading.Event()

        def sample_origin_link() -> None:
            while not sampling.is_set():
                now, links = time.time(), net.link_bytes()
                samples.append((now, links.get("origin", (0, 0))[0]))
                if swarm:
                    per = [links.get(f"node{i}", (0, 0))[0] for i in range(args.nodes)]
                    per_node.append(per)
                    rx_samples.append((now, sum(links.get(f"node{i}", (0, 0))[1] for i in range(args.nodes))))
                    node_samples.append((now, sum(per)))
                sampling.wait(0.5)

        sampler = threading.Thread(target=sample_origin_link, daemon=True)
        sampler.start()
        t_go = time.time()
        for w in nodes:
            w.send(cmd="go", signed=signed, coordinator_key=coordinator_key)
        limit = args.size_mb * 8 / args.rate_mbit
        done = wait_all(nodes, "done", timeout=max(600.0, 4 * limit * args.nodes))
        cpu1, ns1 = cpu_times(), net.cpu_seconds()
        sampling.set()
        sampler.join()
        used = {h: ns1.get(h, 0.0) - ns0.get(h, 0.0) for h in ns1}
        failed = {n: d["error"] for n, d in done.items() if not d["ok"]}
        if failed:
            raise RuntimeError(f"{phase}: nodes failed: {failed}")
        finish = sorted(d["t_done"] - t_go for d in done.values())
        by_source: dict[str, int] = {}
        for d in done.values():
            for k, v in d["stats"]["by_source"].items():
                kind = k.split(":")[0]
                by_source[kind] = by_source.get(kind, 0) + v
        result = {
            "origin_server": origin_ready["origin"],
            "time_s": finish[-1],
            "first_s": finish[0],
            "median_s": finish[len(finish) // 2],
            "cpu_busy": (cpu1[0] - cpu0[0]) / max(1.0, cpu1[1] - cpu0[1]),
            "shards_by_source": by_source,
            "half_s": round(sum(d["t_half"] - t_go for d in done.values()) / len(done), 2),
            "last_shard_s": round(max(d["t_last_shard"] - t_go for d in done.values()), 2),
            "first_shard_s": sorted(round(d["t_first_shard"] - t_go, 2) for d in done.values()),  # per node
            # per node: seconds from its last shard stored to `fetch` returning (the checkpoint in place)
            "tail_s": sorted(round(d["t_done"] - d["t_last_shard"], 2) for d in done.values()),
            "origin_link": origin_link_summary(samples, t_go, args.rate_mbit),
            "node_uplinks": origin_link_summary(node_samples, t_go, args.rate_mbit * args.nodes) if swarm else {},
            "node_downlinks": origin_link_summary(rx_samples, t_go, args.rate_mbit * args.nodes) if swarm else {},
            "per_node_uplink_pct": [round(100 * (per_node[-1][i] - per_node[0][i]) * 8 /
                                          ((node_samples[-1][0] - node_samples[0][0]) * args.rate_mbit * 1e6))
                                    for i in range(args.nodes)] if swarm and len(per_node) > 1 else [],
            "bad_shards": sum(d["stats"]["bad_shards"] for d in done.values()),
            "failures": sum(d["stats"]["failures"] for d in done.values()),
            "worker_idle_pct": round(100 * sum(d["stats"].get("idle_s", 0.0) for d in done.values()) /
                                     max(1e-9, sum((d["t_done"] - d["t_start"]) * d.get("workers", 1)
                                                   for d in done.values()))),
            "cpu_s": {"origin": round(used.get("origin", 0.0), 1),
                      "nodes": round(sum(v for h, v in used.items() if h.startswith("node")), 1),
                      "malicious": round(sum(v for h, v in used.items() if h.startswith("bad")), 1),
                      "node_python": round(sum(d["cpu_s"] for d in done.values()), 1),
                      # per node, a delta's rebuild (apply, check, write): its CPU and its wall time
                      "rebuild_cpu": sorted(round(d.get("rebuild_cpu_s", 0.0), 3) for d in done.values()),
                      "rebuild_wall": sorted(round(d.get("rebuild_wall_s", 0.0), 2) for d in done.values())},
        }
        if swarm:
            bad_ids = set()
            for d in done.values():
                bad_ids.update(d.get("banned", []))
            result["banned_peers"] = sorted(b[-8:] for b in bad_ids)
            result["nodes_that_banned"] = sum(1 for d in done.values() if d.get("banned"))
        for w in workers:
            w.stop()
        byes = wait_all(workers, "bye", 60)
        if swarm:
            result["busy_answers"] = sum(b.get("swarm_stats", {}).get("busy", 0) for b in byes.values())
            result["have_messages"] = sum(b.get("swarm_stats", {}).get("haves", 0) for b in byes.values())
            # Of the time peer downloads were open, the share spent before the holder answered (its upload
            # queue, the round trip, its disk read) rather than moving bytes.
            waited = sum(b.get("swarm_stats", {}).get("wait_s", 0.0) for b in byes.values())
            moved = sum(b.get("swarm_stats", {}).get("transfer_s", 0.0) for b in byes.values())
            result["peer_download_wait_pct"] = round(100 * waited / max(1e-9, waited + moved))
            downloads = sum(b.get("swarm_stats", {}).get("downloads", 0) for b in byes.values())
            result["peer_download_wait_ms"] = round(1000 * waited / max(1, downloads), 1)
            result["peer_download_transfer_ms"] = round(1000 * moved / max(1, downloads), 1)
            seed = byes["origin"]["seed_stats"]
            result["seed_uploaded_mb"] = round(seed.get("bytes_uploaded", 0) / 1e6, 1)
            result["seed_done_s"] = round(seed.get("last_upload_at", t_go) - t_go, 2)
        return result
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.stop()
        deadline = time.time() + 10
        for w in workers:
            try:
                w.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.log.close()
        net.kill_processes()  # stray p2pd daemons, if a worker died without stopping its own
        shutil.rmtree(work / phase, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="every link, each way (origin's too)")
    ap.add_argument("--size-mb", type=float, default=200.0, help="checkpoint size, MB (1e6 bytes)")
    ap.add_argument("--queue-ms", type=float, default=50.0, help="tbf queue of every link, in ms at its rate")
    ap.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                    help="a kernel setting for every host's namespace, e.g. net.ipv4.tcp_notsent_lowat=16384")
    ap.add_argument("--shard-mb", type=float, default=2.0, help="shard size, MiB (protocol default: 2)")
    ap.add_argument("--malicious", type=int, default=1, help="peers serving corrupted shards in the swarm run")
    ap.add_argument("--p2p", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a P2PConfig field on the nodes, e.g. --p2p max_uploads=5 (repeatable)")
    ap.add_argument("--fetch", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a FetchConfig field on the nodes, e.g. --fetch max_parallel_peers=4 (repeatable)")
    ap.add_argument("--seed-p2p", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a P2PConfig field on the origin's seed, e.g. --seed-p2p seed_max_uploads=2")
    ap.add_argument("--skip-origin-only", action="store_true", help="skip (b); origin_only_s is then N*S/B")
    ap.add_argument("--delta-changed", type=float, default=0.0, metavar="F",
                    help="delta mode: a bf16 checkpoint whose next version changes this share of its elements; "
                    "run (c) broadcasts that version as a delta to nodes holding the one before")
    ap.add_argument("--workdir", default=None, help="default: a temporary directory in /dev/shm or /tmp")
    ap.add_argument("--worker", nargs=2, metavar=("ROLE", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(*args.worker)
        return
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        sys.exit("bench/broadcast.py needs root and the `ip` and `tc` tools (network namespaces, tbf shaping)")

    from swarmrl.protocol.identity import Identity
    from swarmrl.protocol.manifest import SignedManifest
    from swarmrl.transfer.store import ShardStore, cut_checkpoint

    base = args.workdir or ("/dev/shm" if shutil.disk_usage("/dev/shm").free > (args.nodes + 3) * 2.2 *
                            args.size_mb * 1e6 else None)
    work = Path(tempfile.mkdtemp(prefix="swarmrl-bench-", dir=base))
    net = Network(args.rate_mbit, prefix=f"srlb{os.getpid() % 100000}-", queue_ms=args.queue_ms,
                  sysctls=args.sysctl)
    cleaned = False

    def cleanup(*_: Any) -> None:
        nonlocal cleaned
        if not cleaned:
            cleaned = True
            net.down()
            shutil.rmtree(work, ignore_errors=True)

    atexit.register(cleanup)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda *_: sys.exit(1))
    try:
        t = time.time()
        coordinator = Identity.generate()
        data_dir = work / "coordinator"
        key_path = data_dir / "coordinator.key"
        coordinator.save(key_path)
        shard_size = int(args.shard_mb * (1 << 20))
        held, delta_path, delta_manifest = None, work / "manifest-delta.json", None
        if args.delta_changed > 0:
            from swarmrl.protocol.manifest import CheckpointManifest
            from swarmrl.trainer.publisher import published_weights, stage

            v1, v2 = make_delta_pair(work, args.size_mb, args.delta_changed)
            staged = work / "staged"
            staged.mkdir()
            spec = stage(v2, staged, published_weights(v2, "bfloat16"), (1, published_weights(v1, "bfloat16")))
            cut = cut_checkpoint(staged, run_id=RUN_ID, version=2, store=ShardStore(data_dir / "shards"),
                                 shard_size=shard_size)
            delta_manifest = CheckpointManifest.model_validate({**cut.model_dump(), "delta": spec.model_dump()})
            delta_path.write_text(SignedManifest.sign(delta_manifest, coordinator).model_dump_json())
            held = work / "held" / "v00000001"
            held.parent.mkdir()
            os.replace(v1, held)
            shutil.rmtree(staged)
            os.replace(v2, work / "ckpt")
        else:
            make_checkpoint(work / "ckpt", args.size_mb)
        manifest = cut_checkpoint(work / "ckpt", run_id=RUN_ID, version=1 if held is None else 2,
                                  store=ShardStore(data_dir / "shards"), shard_size=shard_size)
        shutil.rmtree(work / "ckpt")
        signed_path = work / "manifest.json"
        signed_path.write_text(SignedManifest.sign(manifest, coordinator).model_dump_json())
        size = manifest.total_bytes
        print(f"checkpoint: {size / 1e6:.1f} MB in {len(manifest.shards())} shards of {args.shard_mb} MiB "
              f"({time.time() - t:.1f} s to make)", flush=True)

        net.up()
        net.add_host("origin", f"{SUBNET}.0.1")
        for i in range(args.nodes):
            net.add_host(f"node{i}", f"{SUBNET}.1.{i + 1}")
        for j in range(args.malicious):
            net.add_host(f"bad{j}", f"{SUBNET}.2.{j + 1}")
        print(f"network: {len(net.hosts)} hosts on a bridge, every link {args.rate_mbit:g} Mbit/s each way",
              flush=True)

        key = coordinator.public_key_hex
        swarm = run_phase(net, args, work, True, signed_path, key, data_dir, key_path)
        print(f"(a) swarm: {swarm['time_s']:.1f} s (first node {swarm['first_s']:.1f} s); shards by source "
              f"{swarm['shards_by_source']}; bad shards caught {swarm['bad_shards']}, "
              f"peers banned {swarm['banned_peers']} by {swarm['nodes_that_banned']} nodes; "
              f"CPU busy {swarm['cpu_busy']:.0%}", flush=True)
        if args.skip_origin_only:
            origin = None
        else:
            origin = run_phase(net, args, work, False, signed_path, key, data_dir, key_path)
            print(f"(b) origin only: {origin['time_s']:.1f} s (first node {origin['first_s']:.1f} s); "
                  f"CPU busy {origin['cpu_busy']:.0%}", flush=True)
        delta = None
        if held is not None and delta_manifest is not None:
            delta = run_phase(net, args, work, True, delta_path, key, data_dir, key_path, held=held)
            print(f"(c) swarm, as a delta of {delta_manifest.total_bytes / 1e6:.2f} MB to nodes holding the version "
                  f"before: {delta['time_s']:.2f} s (first node {delta['first_s']:.2f} s), "
                  f"{delta['time_s'] / swarm['time_s']:.3f} of the full checkpoint's time; bad shards caught "
                  f"{delta['bad_shards']}, peers banned {delta['banned_peers']}; CPU busy {delta['cpu_busy']:.0%}",
                  flush=True)
        limit = size * 8 / (args.rate_mbit * 1e6)
        origin_s = origin["time_s"] if origin else args.nodes * limit
        print(f"lower bound S/B: {limit:.1f} s; swarm is {origin_s / swarm['time_s']:.1f}x faster than origin-only "
              f"and {swarm['time_s'] / limit:.2f}x the bound", flush=True)
        print(json.dumps({
            "swarm_s": round(swarm["time_s"], 2),
            "origin_only_s": round(origin_s, 2),
            "limit_s": round(limit, 2),
            "nodes": args.nodes,
            "size_mb": round(size / 1e6, 1),
            "rate_mbit": args.rate_mbit,
            "shard_mib": args.shard_mb,
            "malicious": args.malicious,
            "origin_only_measured": origin is not None,
            "speedup": round(origin_s / swarm["time_s"], 2),
            "vs_limit": round(swarm["time_s"] / limit, 3),
            "swarm": swarm,
            "origin_only": origin,
            **({"delta_s": round(delta["time_s"], 2), "delta_vs_full": round(delta["time_s"] / swarm["time_s"], 4),
                # the network's part: until the last payload shard was stored on every node (the rest is rebuilding
                # and checking, CPU that the bench's nodes share; a real node has its own)
                "delta_last_shard_s": delta["last_shard_s"],
                "delta_vs_full_last_shard": round(delta["last_shard_s"] / swarm["last_shard_s"], 4),
                "delta_node_cpu_s": round(delta["cpu_s"]["node_python"] / args.nodes, 2),
                "delta_mb": round(delta_manifest.total_bytes / 1e6, 3), "delta_changed": args.delta_changed,
                "delta": delta} if delta is not None and delta_manifest is not None else {}),
        }))
    finally:
        cleanup()


if __name__ == "__main__":
    main()
