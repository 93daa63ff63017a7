"""Benchmark: the CPU of a submission's write transaction, this checkout against a baseline commit, side by side.

On SQLite the coordinator's writes take turns, one transaction at a time across its processes, so what one
submission's transaction costs bounds the submissions per second (`bench/coordinator_load.py` measures those end to
end). On a shared machine whose speed moves by 2x within minutes, end-to-end figures of two versions measured one
after the other cannot tell a 10% change from the machine's. Here both versions run at the same time, each in a
process of its own: an in-process coordinator (the app's signed routes, its store and group commit on an SQLite
file of its own; no HTTP) and `--nodes` simulated nodes that submit one after another, each submission with its
next lease, as nodes send them. Whatever the machine does, it does to both. Each round reports, per submission,
the CPU seconds of its write transaction (the committer thread's, from the first statement to the last, the commit
excluded) and of the whole process (the simulated nodes' signing included); the medians of the rounds' ratios are
the figures.

    python bench/write_path.py --baseline HEAD~1            # this checkout against its parent commit
    python bench/write_path.py --baseline HEAD --rounds 4   # the same code twice: how far apart pairs land

The baseline is checked out into a temporary worktree (removed at the end); it must be recent enough to have the
in-process pieces used here (`coordinator.app.build_app` with `SignedDispatch`, the group commit's committer).
The last line printed is one JSON object: `write_cpu_ratio`, `process_cpu_ratio` (this / baseline), the medians
of both versions' `write_cpu_us` and `process_cpu_us`, and each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def import_from(checkout: Path) -> None:
    """Make `import swarmrl.<package>` load the checkout at `checkout`, not the installed one: each package from the
    folder its pyproject.toml maps it to (a baseline worktree is not installed)."""
    import importlib.abc
    import importlib.util
    import tomllib

    folders = tomllib.loads((checkout / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

    class CheckoutFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: object = None, target: object = None) -> Any:
            if name not in folders:
                return None
            where = checkout / folders[name]
            return importlib.util.spec_from_file_location(name, where / "__init__.py",
                                                          submodule_search_locations=[str(where)])

    sys.meta_path.insert(0, CheckoutFinder())


def _backends_cpu_s(store: Any) -> float:
    """PostgreSQL: the CPU seconds of the server processes serving `store`'s database (on this machine)."""
    from sqlalchemy import text

    with store.engine.connect() as conn:
        pids = [r[0] for r in conn.execute(text(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"))]
    total = 0.0
    for pid in pids:
        try:
            parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone, or another machine's
        total += (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    return total


def worker(nodes: int, warmup: int, submissions: int, pg_url: str | None = None) -> dict[str, Any]:
    """Run the in-process coordinator and its nodes (imports from the checkout `import_from` named); on a fresh
    PostgreSQL database of the server at `pg_url` when one is given, else on an SQLite file."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        store_url = None
        if pg_url is not None:
            from swarmrl.testing.postgres import fresh_database

            store_url = stack.enter_context(fresh_database(pg_url))
        return _worker(nodes, warmup, submissions, store_url)


def _worker(nodes: int, warmup: int, submissions: int, store_url: str | None) -> dict[str, Any]:
    import orjson

    from swarmrl.coordinator.admission import AdmissionConfig
    from swarmrl.coordinator.app import build_app
    from swarmrl.coordinator.config import CoordinatorConfig
    try:
        from swarmrl.coordinator.db.sqlite import groupcommit
    except ImportError:  # a baseline from before the SQLite-only machinery had a folder of its own
        from swarmrl.coordinator.db import groupcommit  # type: ignore[no-redef]
    from swarmrl.coordinator.db.schema import CURRENT_VERSION
    from swarmrl.coordinator.db.store import Store, raise_counter
    from swarmrl.coordinator.pipeline import SignedDispatch
    from swarmrl.coordinator.ratelimit import RateLimitConfig
    from swarmrl.protocol import messages as m
    from swarmrl.protocol.identity import Identity
    from swarmrl.protocol.run import RunSpec
    from swarmrl.protocol.signing import canonical_json, sign
    from swarmrl.runtime.client import new_idempotency_key
    from swarmrl.testing.load import SubmissionEncoder

    work = Path(tempfile.mkdtemp(prefix="write-path-"))
    # A baseline from before the SQLite settings had a table of their own has the setting at the top level.
    no_realtime: dict[str, Any] = ({"sqlite": {"realtime_committer": False}}
                                   if "sqlite" in CoordinatorConfig.model_fields else {"realtime_committer": False})
    config = CoordinatorConfig(
        data_dir=work / "coord", store_url=store_url or f"sqlite:///{work / 'coordinator.sqlite'}", **no_realtime,
        run=RunSpec(run_id="write-path", sampling=m.SamplingSpec(group_size=8, max_tokens=64)),
        operator_keys=[Identity.generate().public_key_hex], rate_limits=RateLimitConfig.off(),
        admission=AdmissionConfig(max_unproven_prompts=max(nodes, 1)))
    app = build_app(config, config.load_identity())
    svc = app.state.coordinator
    dispatch = next(mw for mw in app.user_middleware if mw.cls is SignedDispatch)
    routes = dispatch.kwargs["routes"].routes

    # SQLite: the committer runs a write alone when nothing else is queued (always, here: one node at a time).
    # PostgreSQL: the request's own thread runs its transaction, the commit included.
    spent = {"cpu": 0.0, "writes": 0}
    postgres = svc.store.dialect == "postgresql"
    run_alone = Store._write_pg if postgres else groupcommit.GroupCommit._run_alone

    def timed(*args: Any) -> Any:
        start = time.thread_time()
        try:
            return run_alone(*args)
        finally:
            spent["cpu"] += time.thread_time() - start
            spent["writes"] += 1

    if postgres:
        Store._write_pg = timed  # type: ignore[method-assign]
    else:
        groupcommit.GroupCommit._run_alone = staticmethod(timed)  # type: ignore[method-assign]
    sources: dict[str, str] = {}

    def post(identity: Identity, path: str, kind: str, body: bytes) -> Any:
        route = routes[path]
        source = sources.setdefault(identity.node_id, f"10.0.{len(sources) >> 8}.{len(sources) & 255}")
        sig = route.check(sign(identity, kind, svc.pool, body).header(), True, source)
        answer = route.handle(sig, body, new_idempotency_key(), source)
        if answer.status != 200:
            raise RuntimeError(f"{path}: {answer.status} {answer.body[:200]!r}")
        return orjson.loads(answer.body)

    encoder = SubmissionEncoder(8, 64, 64)
    ask = {"held_version": 0, "max_prompts": 1}
    svc.store.write(lambda tx: raise_counter(tx, CURRENT_VERSION, 0))  # version 0 published (no weights needed)
    held: list[tuple[Identity, dict[str, Any]]] = []
    for i in range(nodes):
        identity = Identity.generate()
        challenge = svc.registry.challenge(m.ChallengeRequest(public_key=identity.public_key_hex)).challenge
        post(identity, "/v1/register", m.KIND_REGISTER,
             canonical_json({"challenge": challenge, "engine": "sim", "name": f"n{i}"}))
        held.append((identity, post(identity, "/v1/lease", m.KIND_LEASE, canonical_json(ask))))

    def submit(i: int) -> None:
        identity, lease = held[i % nodes]
        prompts = [(p["prompt_id"], p["seeds"]) for p in lease["prompts"]]
        result = post(identity, "/v1/submit", m.KIND_SUBMIT, encoder.encode(lease["lease_id"], 0, prompts, ask))
        if not result["accepted"] or result.get("next_lease") is None:
            raise RuntimeError(f"submission not taken whole: {result}")
        held[i % nodes] = (identity, result["next_lease"])

    for i in range(warmup):
        submit(i)
    spent.update(cpu=0.0, writes=0)
    server0 = _backends_cpu_s(svc.store) if postgres else 0.0
    cpu0 = time.process_time()
    for i in range(warmup, warmup + submissions):
        submit(i)
    cpu = time.process_time() - cpu0
    server = _backends_cpu_s(svc.store) - server0 if postgres else 0.0
    svc.close()
    return {"write_cpu_us": round(spent["cpu"] / spent["writes"] * 1e6, 1),
            "process_cpu_us": round(cpu / submissions * 1e6, 1), "writes": spent["writes"],
            "server_cpu_us": round(server / submissions * 1e6, 1)}


def _worktree(rev: str, into: Path) -> Path:
    path = into / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev], check=True,
                   capture_output=True)
    return path


def _round(checkouts: dict[str, Path], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both versions at once; each one's figures."""
    from swarmrl.runtime.lifetime import PARENT_PID_ENV  # here, not above: a worker imports its own checkout's

    procs = {}
    for name, root in checkouts.items():
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(root), "--nodes", str(args.nodes),
               "--warmup", str(args.warmup), "--submissions", str(args.submissions),
               *(["--pg-url", args.pg_url] if args.store == "postgresql" else [])]
        procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{stderr[-3000:]}")
            out[name] = json.loads(stdout.strip().splitlines()[-1])
    finally:  # stopped early (SIGTERM, a failure): the workers go too
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="HEAD~1", help="the commit to compare this checkout with (git revision)")
    p.add_argument("--rounds", type=int, default=6, help="pairs run side by side")
    p.add_argument("--nodes", type=int, default=50, help="simulated nodes, taking turns")
    p.add_argument("--warmup", type=int, default=200, help="submissions before measuring, per round")
    p.add_argument("--submissions", type=int, default=800, help="measured submissions per round and version")
    p.add_argument("--store", choices=["sqlite", "postgresql"], default="sqlite", help="each version's store: an "
                   "SQLite file of its own, or a fresh database on the PostgreSQL server at --pg-url")
    p.add_argument("--pg-url", default=os.environ.get("SWARMRL_TEST_PG_URL"), help="PostgreSQL server URL (a role "
                   "that may create databases)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        import_from(args.worker)
        from swarmrl.runtime.lifetime import die_with_parent_if_asked

        die_with_parent_if_asked()
        print(json.dumps(worker(args.nodes, args.warmup, args.submissions, args.pg_url)))
        return
    from swarmrl.runtime.lifetime import interrupt_on_sigterm

    interrupt_on_sigterm()  # SIGTERM runs the cleanup below: the workers and the baseline's worktree go
    if args.store == "postgresql" and not args.pg_url:
        raise SystemExit("postgresql: give --pg-url or set SWARMRL_TEST_PG_URL")
    from rich.console import Console

    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="write-path-") as tmp:
        base = _worktree(args.baseline, Path(tmp))
        try:
            rounds = []
            for i in range(args.rounds):
                with console.status(f"round {i + 1}/{args.rounds}: both versions at once"):
                    got = _round({"this": ROOT, "baseline": base}, args)
                rounds.append(got)
                console.print(f"round {i + 1}: write CPU {got['this']['write_cpu_us']:.0f} us (this) vs "
                              f"{got['baseline']['write_cpu_us']:.0f} us (baseline); process CPU "
                              f"{got['this']['process_cpu_us']:.0f} vs {got['baseline']['process_cpu_us']:.0f} us")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False,
                           capture_output=True)
    result: dict[str, Any] = {"baseline": args.baseline, "rounds": len(rounds), "submissions": args.submissions}
    result["store"] = args.store
    for key in ("write_cpu_us", "process_cpu_us", *(["server_cpu_us"] if args.store == "postgresql" else [])):
        ratios = [r["this"][key] / r["baseline"][key] for r in rounds]
        name = key.removesuffix("_us")
        result[f"{name}_ratio"] = round(statistics.median(ratios), 3)
        result[f"{name}_ratios"] = [round(x, 3) for x in ratios]
        result[key] = {name: round(statistics.median(r[name][key] for r in rounds), 1) for name in ("this", "baseline")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
