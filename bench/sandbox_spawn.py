"""Benchmark: what one sandboxed program run costs the process that starts it (a verifier holding models), with the
run's uid set by setpriv (`tasks.sandbox.Sandbox`, vfork usable) against the same run with the uid set by
`subprocess.Popen(user=..., group=...)` (the baseline: Python then forks, copying the caller's page tables).

The caller first touches `--hold-gib` GiB of memory (a verifier's models and buffers). The two arms alternate
`--rounds` times, `--runs` programs each (`print(int(input()) + 3)`, the code task's shape), and report per run:
wall milliseconds, the caller's own system CPU milliseconds, and the children's CPU milliseconds. Needs root (the
per-run uid is what the sandbox gives root callers).

    python bench/sandbox_spawn.py --hold-gib 1 --runs 50 --rounds 3

The last line printed is one JSON object: `setpriv` and `popen_user` (the medians over rounds of each figure) and
`wall_ratio` / `caller_sys_ratio` (setpriv over popen_user).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from swarmrl.tasks import sandbox as sandbox_mod

_POPEN = subprocess.Popen


def _popen_with_user(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    """The baseline: the uid given to Popen instead of to setpriv (what the sandbox did before)."""
    setpriv, reuid, regid = argv[0], argv[1], argv[2]
    assert os.path.basename(setpriv) == "setpriv" and argv[4] == "--", argv[:5]
    uid, gid = int(reuid.split("=")[1]), int(regid.split("=")[1])
    return _POPEN(argv[5:], user=uid, group=gid, extra_groups=[], **kw)


def _round(sb: sandbox_mod.Sandbox, runs: int) -> dict[str, float]:
    self0, kids0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    for i in range(runs):
        out = sb.run("print(int(input()) + 3)", f"{i}\n".encode())
        assert out.ok and out.stdout == f"{i + 3}\n".encode(), out
    wall = time.perf_counter() - t0
    self1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    kids = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    return {"wall_ms": 1000 * wall / runs, "caller_sys_ms": 1000 * (self1.ru_stime - self0.ru_stime) / runs,
            "children_cpu_ms": 1000 * kids / runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hold-gib", type=float, default=1.0, help="memory the caller holds (touched)")
    ap.add_argument("--runs", type=int, default=50, help="programs per arm and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/sandbox_spawn.py: run it as root (the per-run uid is the sandbox's root path)")
    held = bytearray(int(args.hold_gib * (1 << 30)))
    for i in range(0, len(held), 4096):  # touch every page, as a loaded model's are
        held[i] = 1
    sb = sandbox_mod.Sandbox()
    arms: dict[str, list[dict[str, float]]] = {"setpriv": [], "popen_user": []}
    for r in range(args.rounds):
        for arm in (("setpriv", "popen_user") if r % 2 == 0 else ("popen_user", "setpriv")):
            # The sandbox module calls subprocess.Popen: the baseline swaps it in for its arm only.
            subprocess.Popen = _popen_with_user if arm == "popen_user" else _POPEN  # type: ignore[misc,assignment]
            try:
                arms[arm].append(_round(sb, args.runs))
            finally:
                subprocess.Popen = _POPEN  # type: ignore[misc]
            print(f"round {r}: {arm}: " + ", ".join(f"{k} {v:.1f}" for k, v in arms[arm][-1].items())
                  + f" (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    med = {arm: {k: round(statistics.median(x[k] for x in rows), 2) for k in rows[0]} for arm, rows in arms.items()}
    print(json.dumps({**med, "wall_ratio": round(med["setpriv"]["wall_ms"] / med["popen_user"]["wall_ms"], 3),
                      "caller_sys_ratio": round(med["setpriv"]["caller_sys_ms"]
                                                / max(med["popen_user"]["caller_sys_ms"], 1e-9), 3),
                      "setup": {"hold_gib": args.hold_gib, "runs": args.runs, "rounds": args.rounds,
                                "load_avg_end": round(os.getloadavg()[0], 2)}}), flush=True)


if __name__ == "__main__":
    main()
