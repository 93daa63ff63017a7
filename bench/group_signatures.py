"""Benchmark: what a group's node signature (`protocol.groupsig`) costs each role, by group size.

For groups of `--rollouts` rollouts of n completion tokens each (n in `--tokens`; random token ids and logprobs,
as an engine writes them), the median seconds of:

- `sign_s`: the node signing one group (`sign_group`, in the client's `submit`);
- `verify_s`: checking it as the coordinator's door, the verifier and the trainer each do (`verify_group`, on the
  group parsed from its JSON, as they read it);
- `parse_s`: parsing the group from its JSON, for scale (every receiver does it anyway).

    python bench/group_signatures.py [--rollouts 8] [--tokens 16 256 1024] [--repeats 20]

The last line printed is one JSON object: per token count, the three medians, and `verify_over_parse`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from swarmrl.protocol import messages as m
from swarmrl.protocol.groupsig import sign_group, verify_group
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import pool_id


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """The median thread CPU seconds of `fn` over `repeats` calls (CPU, not wall: the machine is shared)."""
    out = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        out.append(time.thread_time() - t0)
    return statistics.median(out)


def group_of(rollouts: int, tokens: int, rng: random.Random) -> m.RolloutGroup:
    return m.RolloutGroup(prompt_id="p0", prompt_ids=[rng.randrange(32000) for _ in range(64)], rollouts=[
        m.Rollout(seed=rng.getrandbits(63), completion_ids=[rng.randrange(32000) for _ in range(tokens)],
                  logprobs=[-rng.expovariate(1.0) for _ in range(tokens)], finish_reason="length")
        for _ in range(rollouts)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    rng = random.Random(0)
    node = Identity.generate()
    pool = pool_id("bench", Identity.generate().public_key_hex)
    facts = dict(lease_id="0" * 27, policy_version=3, pool=pool)
    res: dict[str, Any] = {"rollouts": args.rollouts}
    for n in args.tokens:
        group = group_of(args.rollouts, n, rng)
        wire = sign_group(node, group, **facts).model_dump_json()
        read = m.RolloutGroup.model_validate_json(wire)
        row = {"sign_s": timed(lambda g=group: sign_group(node, g, **facts), args.repeats),
               "verify_s": timed(lambda g=read: verify_group(g, node_key=node.public_key_hex, node_id=node.node_id,
                                                             **facts), args.repeats),
               "parse_s": timed(lambda w=wire: m.RolloutGroup.model_validate_json(w), args.repeats)}
        row["verify_over_parse"] = row["verify_s"] / row["parse_s"]
        res[f"tokens_{n}"] = {k: float(f"{v:.3g}") for k, v in row.items()}
        print(f"{n} tokens x {args.rollouts}: {res[f'tokens_{n}']}", flush=True)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
