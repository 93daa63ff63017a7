"""Benchmark: in-flight weight updates against a real pool (`testing.byzantine.inflight`).

A coordinator on loopback (SQLite, Ed25519) and the real verifier at sample rate 1 (every group fully checked); a run
with `sampling.in_flight_updates`. Each round publishes a new version (the last one perturbed by `--frac`) while every
node holds a lease of the version before, so each node loads it in place at its first chunk boundary and its groups
span two versions. Honest nodes (one per `--engines` entry) work until at least `--honest-groups` of their groups that
span two versions were verified; in each of the first `--attempts` rounds a new node of each lie (`hide`, `late`,
`early`: the version change left out, claimed a chunk later, a token earlier) does the same and misreports its spans.

    python bench/inflight_updates.py --honest-groups 500 --attempts 10

The last line printed is one JSON object: `honest_spanning_two_versions` (groups whose tokens come from two versions),
`honest_rejected` of `honest_groups` (must be 0), `lies` ({lie: [caught (rejected and banned), attempts]}), with the
reasons and the time taken.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

from swarmrl.testing.byzantine.inflight import inflight_suite  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--honest-groups", type=int, default=500)
    ap.add_argument("--attempts", type=int, default=10, help="rounds with a new node of each lie")
    ap.add_argument("--engines", default="torch", help="comma-separated: torch, vllm (one honest node each)")
    ap.add_argument("--max-prompts", type=int, default=8, help="prompts per honest lease")
    ap.add_argument("--frac", type=float, default=0.01, help="each version: the last one perturbed by this")
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="inflight-"))
    out.mkdir(parents=True, exist_ok=True)
    summary = inflight_suite(out, args.attempts, args.honest_groups, args.engines.split(","), args.max_prompts,
                             args.frac, log=lambda s: print(s, file=sys.stderr, flush=True))
    summary["load_avg"] = list(os.getloadavg())
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
