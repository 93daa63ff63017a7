"""Benchmark: the coordinator under thousands of signed nodes (issue 14).

A real coordinator process (`swarmrl coordinator`) on loopback, on SQLite or PostgreSQL, and `--workers` load
processes of simulated nodes (`swarmrl.testing.load`: real Ed25519 keys and signatures, real HTTP/1.1). Every node
registers (challenge + signed registration); then, for `--warmup` + `--duration` seconds, the nodes take turns
over `--concurrency` connections per process: a heartbeat every `--heartbeat-s`, a first lease of `--prompts`
prompts, and one submission per lease (a submission settles its lease) carrying an 8-rollout group of `--tokens`
tokens per rollout with an activation proof per rollout for each leased prompt, and asking for the node's next
lease, as nodes do. The coordinator runs `--coordinator-workers` server processes.

The coordinator runs with its default rate limits and admission rules, configured as a deployment behind a
reverse proxy is (`coordinator_settings`): the load processes stand in for that proxy and name each node's own
address in X-Forwarded-For, so every node is its own source; and since no verifier runs, every node stays a
newcomer (unproven), so the pool is configured for that many newcomers at once (`max_unproven_prompts`).

Measured over `--duration`: submissions/s (answered 200), their p50/p99 latency, errors (any answer but 2xx, or a
transport error, of any request kind), and, after the coordinator is killed with SIGKILL at the end, lost
submissions: groups a 200 answer said were taken that its database does not hold. The CPU is sampled too: the
whole machine's busy share, and the coordinator's and the load processes' CPU seconds.

Each store runs at every `--nodes` count (the scaling curve in nodes), at the largest count with every number of
coordinator processes in `--scaling` (the scaling curve in processes, e.g. `--scaling 1,2,4`), and the baselines
beside it at the largest count (`--baselines`): nodes that send a lease request before each submission instead,
one coordinator process, and on SQLite group commit off (`sqlite.group_commit=1`: one commit, one fsync, per write)
and no writer process (each worker commits its own submissions, in turn: `sqlite.writer_process=false`).

    python bench/coordinator_load.py                                   # the recorded run: both stores, 100..10,000
    python bench/coordinator_load.py --stores sqlite --nodes 100 --duration 5 --warmup 2   # a smoke run
    python bench/coordinator_load.py --nodes 1000 --scaling 1,2,4 --no-baseline   # 1, 2 and 4 processes, both stores

PostgreSQL needs `--pg-url` or SWARMRL_TEST_PG_URL (scripts/test-postgres.sh prints one): each run gets a fresh
database on it. The last line printed is one JSON object: `submissions_per_s`, `p99_ms`, `errors`, `lost`, `nodes`,
`store` of the headline run (SQLite at the largest node count), with every run under `runs`, and with `--scaling`
the submissions/s per store and number of coordinator processes under `scaling`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.runtime.lifetime import interrupt_on_sigterm
from swarmrl.testing.load import LoadPlan, LoadSwarm, percentile, publish_version_zero
from swarmrl.testing.postgres import fresh_database
from swarmrl.testing.processes import RoleProcess


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql")
    p.add_argument("--nodes", default="100,1000,10000", help="comma-separated simulated node counts")
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=None, help="seconds of load before measuring (default: 5 + "
                   "nodes / 200, so that every node has had its first lease and the mix of requests is steady)")
    p.add_argument("--workers", type=int, default=2, help="load generator processes")
    p.add_argument("--coordinator-workers", type=int, default=2, help="the coordinator's server processes (its "
                   "`workers` setting); the baseline runs with one")
    p.add_argument("--concurrency", type=int, default=16, help="connections (requests in flight) per process")
    p.add_argument("--prompts", type=int, default=1, help="prompts per lease (= groups per submission)")
    p.add_argument("--tokens", type=int, default=32, help="completion tokens per rollout")
    p.add_argument("--heartbeat-s", type=float, default=30.0, help="seconds between a node's heartbeats")
    p.add_argument("--scaling", default="", help="comma-separated numbers of coordinator processes, each run at the "
                   "largest node count beside the headline (e.g. 1,2,4); a run already planned is not repeated")
    p.add_argument("--baselines", default="separate-leases,one-worker,no-group-commit,no-writer-process",
                   help="comma-separated baselines, each run beside the headline at the largest node count: "
                        "separate-leases (a lease request before each submission instead of the next lease asked "
                        "for with it), one-worker (one coordinator process), no-group-commit (SQLite: one commit "
                        "per write), no-writer-process (SQLite: each worker commits its own submissions, in turn, "
                        "instead of the store's writer process); empty: none")
    p.add_argument("--no-baseline", action="store_true", help="run no baseline (as --baselines '')")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a coordinator setting (TOML value; a table's as a dotted key), e.g. --set worker_threads=4 "
                   "or --set sqlite.request_nice=0; repeatable")
    p.add_argument("--pg-url", default=os.environ.get("SWARMRL_TEST_PG_URL"), help="PostgreSQL server URL (a "
                   "role that may create databases)")
    p.add_argument("--out", type=Path, default=None, help="write every run's figures here as JSON")
    return p.parse_args(argv)


# -- CPU accounting -------------------------------------------------------------------------------------


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process and its live children (a coordinator's other workers). A process
    or thread that ends while it is read counts 0 (its threads come and go: a coordinator's pool threads do)."""
    try:
        parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    own = (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    children: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        tasks = []
    for task in tasks:
        try:
            children.update(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended between the listing and the read
    return own + sum(process_cpu_s(c) for c in children)


# -- one load process -----------------------------------------------------------------------------------


def _load_process(plan: dict[str, Any], conn: Any) -> None:
    """A load generator process: register its nodes, say so, wait for the schedule, run it, send the report."""

    async def main() -> None:
        swarm = LoadSwarm(LoadPlan(**plan), [Identity.generate() for _ in range(plan["nodes"])])
        t0 = time.time()
        await swarm.register()
        conn.send(("registered", time.time() - t0))
        measure_from, until = await asyncio.to_thread(conn.recv)
        report = await swarm.run(measure_from, until)
        conn.send(("report", report.to_json()))

    asyncio.run(main())


# -- one run --------------------------------------------------------------------------------------------


def stored_groups(store_url: str) -> set[str]:
    engine = create_engine(store_url)
    try:
        with engine.connect() as c:
            return {f"{lease}/{prompt}" for lease, prompt in c.execute(text(
                "SELECT lease_id, prompt_id FROM rollout_groups"))}
    finally:
        engine.dispose()


def coordinator_settings(nodes: int, prompts: int) -> str:
    """The TOML of the bench coordinator's admission and rate-limit settings (every other one is its default)."""
    return ("\n[rate_limits]\n# The load processes are the reverse proxy: they name each node's address here.\n"
            'source_header = "x-forwarded-for"\ntrusted_proxies = ["127.0.0.1"]\n'
            "\n[admission]\n# No verifier runs, so every node stays a newcomer: room for all of them at once.\n"
            f"max_unproven_prompts = {max(nodes * prompts, 1)}\n")


def run_one(args: argparse.Namespace, store: str, nodes: int, group_commit: bool, workers: int, next_lease: bool,
            writer_process: bool, work: Path) -> dict[str, Any]:
    """One coordinator, one load: the figures of its measured window."""
    operator = Identity.generate()
    run_id = "load"
    with ExitStack() as stack:
        if store == "postgresql":
            if not args.pg_url:
                raise SystemExit("postgresql: give --pg-url or set SWARMRL_TEST_PG_URL")
            store_url = stack.enter_context(fresh_database(args.pg_url))
        else:
            store_url = f"sqlite:///{work / 'coordinator.sqlite'}"
        config = work / "coordinator.toml"
        config.write_text(
            f'host = "127.0.0.1"\nport = 0\ndata_dir = "{work / "data"}"\nstore_url = "{store_url}"\n'
            f'operator_keys = ["{operator.public_key_hex}"]\nlease_ttl_s = 3600.0\nclock_skew_s = 600.0\n'
            f"sqlite.group_commit = {64 if group_commit else 1}\nworkers = {workers}\n"
            f"sqlite.writer_process = {'true' if writer_process else 'false'}\n"
            + "".join(f"{setting}\n" for setting in args.set) +
            f"node_gone_after_s = {max(120.0, 4 * args.heartbeat_s)}\n"
            f"{coordinator_settings(nodes, args.prompts)}"
            f'\n[run]\nrun_id = "{run_id}"\nmax_staleness = 2\n\n[run.sampling]\ngroup_size = 8\n'
            f"max_tokens = {args.tokens}\n")
        coord = RoleProcess("coordinator", config, work / "coordinator.log").start()
        stack.callback(coord.kill)
        url = coord.url()
        publish_version_zero(url, operator, work, run_id)
        with CoordinatorClient(url) as anyone:
            pool = anyone.info().pool

        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        per = [nodes // args.workers + (1 if i < nodes % args.workers else 0) for i in range(args.workers)]
        for i, n in enumerate(per):
            plan = dict(url=url, nodes=n, pool=pool, concurrency=args.concurrency, prompts_per_lease=args.prompts,
                        next_lease=next_lease, tokens=args.tokens, heartbeat_s=args.heartbeat_s, seed=i)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_load_process, args=(plan, child), daemon=True)
            proc.start()
            pipes.append(parent)
            procs.append(proc)
            stack.callback(proc.kill)
        registration_s = max(p.recv()[1] for p in pipes)
        warmup = args.warmup if args.warmup is not None else 5.0 + nodes / 200
        start = time.time() + 0.5
        measure_from, until = start + warmup, start + warmup + args.duration
        for p in pipes:
            p.send((measure_from, until))
        time.sleep(max(0.0, measure_from - time.time()))  # the schedule is wall-clock: sample the CPU at its edges
        busy0, total0 = machine_ticks()
        cpu0 = process_cpu_s(coord.pid), sum(process_cpu_s(p.pid) for p in procs)
        load0 = os.getloadavg()[0]
        time.sleep(max(0.0, until - time.time()))
        busy1, total1 = machine_ticks()
        cpu1 = process_cpu_s(coord.pid), sum(process_cpu_s(p.pid) for p in procs)
        reports = [p.recv()[1] for p in pipes]
        coord.kill()  # SIGKILL: what was answered must already be in the database
        held = stored_groups(store_url)

    tallies: dict[str, dict[str, Any]] = {}
    for r in reports:
        for kind, t in r["tallies"].items():
            agg = tallies.setdefault(kind, {"ok": 0, "errors": 0, "latencies_ms": [], "reasons": {}})
            agg["ok"] += t["ok"]
            agg["errors"] += t["errors"]
            agg["latencies_ms"] += t["latencies_ms"]
            for reason, n in t["reasons"].items():
                agg["reasons"][reason] = agg["reasons"].get(reason, 0) + n
    accepted = {key for r in reports for key in r["accepted"]}
    sub = tallies.get("submit", {"ok": 0, "latencies_ms": []})
    seconds = args.duration
    return {
        "store": store, "nodes": nodes, "group_commit": group_commit, "coordinator_workers": workers,
        "next_lease": next_lease, "writer_process": writer_process and store == "sqlite" and workers > 1,
        "submissions_per_s": round(sub["ok"] / seconds, 1),
        "requests_per_s": round(sum(t["ok"] for t in tallies.values()) / seconds, 1),
        "p50_ms": round(percentile(sub["latencies_ms"], 0.50), 2),
        "p99_ms": round(percentile(sub["latencies_ms"], 0.99), 2),
        "errors": sum(t["errors"] for t in tallies.values()),
        "error_reasons": {k: t["reasons"] for k, t in tallies.items() if t["reasons"]},
        "lost": len(accepted - held),
        "accepted_total": len(accepted),
        "refused_groups": sum(r["refused_groups"] for r in reports),
        "per_kind": {k: {"ok_per_s": round(t["ok"] / seconds, 1),
                         "p99_ms": round(percentile(t["latencies_ms"], 0.99), 2)} for k, t in tallies.items()},
        "registration_s": round(registration_s, 1),
        "warmup_s": round(warmup, 1),
        "machine_busy": round((busy1 - busy0) / max(total1 - total0, 1), 3),
        "load_avg_1m": round(load0, 2),
        "coordinator_cpu_s_per_s": round((cpu1[0] - cpu0[0]) / seconds, 3),
        "coordinator_cpu_ms_per_request": round(1000 * (cpu1[0] - cpu0[0]) / max(1, sum(t["ok"] + t["errors"]
                                                                                       for t in tallies.values())), 3),
        "load_procs_cpu_s_per_s": round((cpu1[1] - cpu0[1]) / seconds, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    interrupt_on_sigterm()  # SIGTERM runs each run's cleanup (its ExitStack): the coordinator and load processes go
    args = parse_args(argv)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    counts = [int(n) for n in args.nodes.split(",")]
    baselines = set() if args.no_baseline else {b.strip() for b in args.baselines.split(",") if b.strip()}
    scaling = [int(k) for k in args.scaling.split(",") if k.strip()]
    unknown = baselines - {"separate-leases", "one-worker", "no-group-commit", "no-writer-process"}
    if unknown:
        raise SystemExit(f"unknown baselines: {', '.join(sorted(unknown))}")
    runs = []
    for store in stores:
        # The baselines run at the largest node count; no-group-commit only where group commit applies
        # (PostgreSQL commits each transaction itself, and groups concurrent commits' WAL flushes on its own).
        many, top = args.coordinator_workers, max(counts)
        plans = [(n, True, many, True, True) for n in counts]
        plans += [(top, True, k, True, True) for k in scaling]
        plans += [(top, True, many, False, True)] if "separate-leases" in baselines else []
        plans += [(top, True, 1, True, True)] if "one-worker" in baselines and many > 1 else []
        plans += [(top, False, many, True, True)] if "no-group-commit" in baselines and store == "sqlite" else []
        sqlite_workers = store == "sqlite" and many > 1
        plans += [(top, True, many, True, False)] if "no-writer-process" in baselines and sqlite_workers else []
        plans = list(dict.fromkeys(plans))  # each run once, in the order planned
        for nodes, group_commit, workers, next_lease, writer_process in plans:
            with tempfile.TemporaryDirectory(prefix="coordinator-load-") as tmp:
                result = run_one(args, store, nodes, group_commit, workers, next_lease, writer_process, Path(tmp))
            runs.append(result)
            print(json.dumps({k: v for k, v in result.items() if k not in ("per_kind", "error_reasons")}), flush=True)
            if result["error_reasons"]:
                print("  errors:", json.dumps(result["error_reasons"])[:2000], flush=True)
    headline = next((r for r in runs if r["store"] == "sqlite" and r["group_commit"] and r["nodes"] == max(counts)
                     and r["coordinator_workers"] == args.coordinator_workers and r["next_lease"]
                     and r["writer_process"] == (args.coordinator_workers > 1)), runs[0])
    summary = {k: headline[k] for k in ("submissions_per_s", "p99_ms", "errors", "lost", "nodes", "store")}
    # The scaling curve in processes: submissions/s by store and number of coordinator processes (largest count).
    summary["scaling"] = {store: {str(r["coordinator_workers"]): r["submissions_per_s"] for r in runs
                                  if r["store"] == store and r["nodes"] == max(counts) and r["group_commit"]
                                  and r["next_lease"] and r["writer_process"] == (store == "sqlite"
                                                                                  and r["coordinator_workers"] > 1)}
                          for store in stores} if scaling else {}
    summary["runs"] = runs
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
