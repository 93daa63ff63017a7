"""Benchmark: a full node's tokens per second against its bare engine (vLLM, or the torch engine with `--engine
torch`) on the same model, machine and prompts.

A child process holds a real pool on loopback (`testing.byzantine.harness.open_pool`: uvicorn, SQLite, Ed25519; no
verifier and no trainer: backpressure is off, so the node is never held back for want of a trainer), as a pool's
coordinator is another machine's process; this one runs one real `node.agent.Node` with the vLLM engine (or
the torch engine: `--engine torch`; proofs on), driven by the same steps as its `run` loop: lease, generate (with
proofs), sign and submit, heartbeats.
The arms, each a wall window of `--window-s`, alternate `--repeats` times (each repeat in another order), so that
the load of other work on the machine hits each alike:

- `node`: the node pipelined (`NodeConfig.pipeline`, the default): submissions on the wire while the next lease is
  generated, a lease asked for ahead;
- `node_unpipelined`: the same node with pipelining off (lease, generate, submit in turn);
- `bare`: the node's own engine (the same `VLLMEngine` with its seeded sampling processor, or `TorchEngine`, and
  proofs) given the prompts and seeds of leases the node was granted, one lease's requests per call, back to back:
  what the machine generates with no coordinator, no network and no signing.

Each arm's rate is the completion tokens generated in its window over the window's wall time (a node arm's window
ends once its last submission is answered). The arms share the engine, so the model, its sampling and the prompts
are the same by construction. The identity is allowed 2 leases of `--max-prompts` in flight (a proven node's
allowance; a new identity's default of 8 prompts would allow one), so that pipelining can ask a lease ahead.

    python bench/node_throughput.py --model tiny                 # the record (bench/RESULTS.md)
    python bench/node_throughput.py --model small30m --max-tokens 64 --repeats 1

The last line printed is one JSON object: `node_tok_s`, `node_unpipelined_tok_s`, `bare_vllm_tok_s` (or
`bare_torch_tok_s`; medians over
the repeats); `ratio` (node / bare: the median over repeats of each repeat's ratio, as other work's load changes
more between repeats than within one) and `ratio_unpipelined`; each run's rates; the share of each window the
engine spent generating (`engine_busy`; `<arm>_engine_busy`, its median, changes little with other load);
`model_params` and the setup. `--rtt-ms` adds a round trip to each of the node's requests (a node across the
internet from its pool; the coordinator here is on loopback). With `--swap`, after the arms a new version (the
checkpoint perturbed by 1%) is published while the pipelined node works: `swap_gap_s` is the time its engine
generated nothing around the change, from the end of vLLM's last engine step with the old version to the start of its
first step with the new one (the torch engine: between engine calls). Without in-flight updates that is at a lease
boundary (the old lease's proofs, its submission, the new lease's requests handed to vLLM, and the load); for
comparison `lease_step_gap_s` is the same between two leases of one version, and `lease_gap_s` the median gap
between two of the node's generations. With `--in-flight` the run has in-flight updates
(`sampling.in_flight_updates`, `--chunk-tokens` decode steps between two looks for a new version): the new version is
loaded between two decode steps of a lease, and vLLM goes on with the requests it preempted
(`node.inflight`); `swapped_mid_lease` says the change fell inside one generation. With the vLLM engine's staged
updates (the default; `--no-staged-reload`: vLLM's in-place reload) the new version is prepared while the engine
generates: `prepare_s` is that preparation, `commit_s` the swap between two steps, `reset_s` and `check_s` the KV
cache's reset (preempting the requests running) and the lm_head's check after it. `first_new_step_s` is the
first step with the new version (it prefills the requests again, or the new lease's prompts), `median_step_s` a
median step.

    python bench/node_throughput.py --model tiny --swap --in-flight --arms node --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import httpx  # noqa: E402

from swarmrl.models.build import ModelConfig, build_model, save_checkpoint  # noqa: E402
from swarmrl.models.prompts import render_prompt  # noqa: E402
from swarmrl.models.tokenizers import build_bpe_tokenizer  # noqa: E402
from swarmrl.node.agent import Node  # noqa: E402
from swarmrl.node.config import NodeConfig  # noqa: E402
from swarmrl.node.engine import EngineConfig, GenerationRequest  # noqa: E402
from swarmrl.protocol import messages as m  # noqa: E402
from swarmrl.runtime.client import CoordinatorClient  # noqa: E402
from swarmrl.runtime.retry import RetryPolicy  # noqa: E402
from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool, perturb_checkpoint  # noqa: E402

ARMS = ("node", "node_unpipelined", "bare")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def checkpoint(out: Path, model: str) -> Path:
    """The tiny model (its 16-token character tokenizer) or a ~30M Qwen2 (`small30m`, an 8192-token BPE)."""
    if model == "tiny":
        return make_checkpoint(out, ModelConfig.preset("tiny"))
    tok = build_bpe_tokenizer(8192)
    return save_checkpoint(build_model(ModelConfig.preset(model, arch="qwen2"), tok), tok, out)


def model_params(ckpt: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).numel() for k in f.keys())


class RecordingNode(Node):
    """`Node` unchanged but for remembering the leases it generated (the bare arm replays their prompts)."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.leases: list[m.Lease] = []
        self.calls: list[tuple[float, float, int]] = []  # each generation's start, end and the version it used
        self.engine_calls: list[tuple[float, float, int]] = []  # the same for each call of the engine (a chunk)
        self.engine_steps: list[tuple[float, float, int]] = []  # the same for each of vLLM's engine steps

    def generate(self, lease: m.Lease) -> m.RolloutSubmission:
        self.leases.append(lease)
        engine = self.engine
        if engine is not None and "generate" not in vars(engine):  # once: the engine is kept across reloads
            for name in ("generate", "generate_until"):
                setattr(engine, name, self._recorded(getattr(engine, name), self.engine_calls))
            llm = getattr(engine, "llm", None)  # vLLM: its steps too (each decodes one token of every request)
            if llm is not None:
                llm.llm_engine.step = self._recorded(llm.llm_engine.step, self.engine_steps)
        t0 = time.perf_counter()
        submission = super().generate(lease)
        self.calls.append((t0, time.perf_counter(), submission.policy_version))
        return submission


    def _recorded(self, call: Callable[..., list], into: list[tuple[float, float, int]]) -> Callable[..., list]:
        """`call` (an engine's generate or generate_until, or vLLM's step), its start, end and the version held at its
        start kept in `into`."""
        def recorded(*a: Any, **kw: Any) -> list:
            t0, version = time.perf_counter(), self.stats.held_version
            out = call(*a, **kw)
            into.append((t0, time.perf_counter(), version))
            return out

        return recorded


class DelayedTransport(httpx.HTTPTransport):
    """Loopback HTTP with a network's round trip added to each request (a simulated wide-area link)."""

    def __init__(self, rtt_s: float):
        super().__init__()
        self.rtt_s = rtt_s

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        time.sleep(self.rtt_s)  # the link's latency, not a synchronisation
        return super().handle_request(request)


class Bench:
    def __init__(self, url: str, coordinator_key: str, work_dir: Path, args: argparse.Namespace):
        self.args = args
        cfg = NodeConfig(coordinator_url=url, coordinator_key=coordinator_key, key_path=work_dir / "node.key",
                         name="bench", work_dir=work_dir, max_prompts=args.max_prompts, progress=False,
                         poll_interval_s=0.05, p2p={"enabled": False},
                         engine=EngineConfig(kind=args.engine, staged_reload=not args.no_staged_reload))
        self.node = RecordingNode(cfg)
        if args.rtt_ms:  # a node across the internet: every request of its client waits one round trip first
            self.node.client = CoordinatorClient(url, self.node.identity, retry=RetryPolicy(attempts=None),
                                                 stop=self.node._stop, coordinator_key=coordinator_key,
                                                 transport=DelayedTransport(args.rtt_ms / 1000))
        self.node.join()
        self.fetch_thread = self.node.weights.start()

    def steps(self, until: float) -> None:
        """The node's `run` loop (step, heartbeat) until `until` (perf_counter), then its submission in flight
        answered."""
        while time.perf_counter() < until:
            self.step()
        self.node.work.settle()

    def step(self) -> None:
        worked = self.node.step()
        self.node.membership.keep_up(worked)
        if not worked:
            self.node._stop.wait(self.node.cfg.poll_interval_s)

    def warm_up(self) -> None:
        """Until the engine is loaded and three leases went through (vLLM's first calls are slow)."""
        while self.node.stats.leases < 3:
            self.step()
        self.node.work.settle()

    def node_arm(self, pipeline: bool) -> tuple[int, float, float]:
        work, stats = self.node.work, self.node.stats
        work.cfg = dataclasses.replace(work.cfg, pipeline=pipeline)
        t0, tokens0, gen0 = time.perf_counter(), stats.tokens, stats.gen_seconds
        self.steps(t0 + self.args.window_s)
        wall = time.perf_counter() - t0
        return stats.tokens - tokens0, wall, (stats.gen_seconds - gen0) / wall

    def bare_arm(self) -> tuple[int, float, float]:
        engine, tok = self.node.engine, self.node.tokenizer
        assert engine is not None and tok is not None
        batches = [([GenerationRequest(prompt_ids=render_prompt(tok, p.text), seed=s)
                     for p in lease.prompts for s in p.seeds], lease.sampling.max_tokens)
                   for lease in self.node.leases[-16:]]
        t0, tokens, i, gen_s = time.perf_counter(), 0, 0, 0.0
        while time.perf_counter() < t0 + self.args.window_s:
            reqs, max_tokens = batches[i % len(batches)]
            t1 = time.perf_counter()
            tokens += sum(len(c.token_ids) for c in engine.generate(reqs, max_tokens))
            gen_s += time.perf_counter() - t1
            i += 1
        wall = time.perf_counter() - t0
        return tokens, wall, gen_s / wall

    def swap_gap(self, publish: Callable[[], int]) -> dict[str, float]:
        """A new version published while the node works: the time its engine generated nothing around the change
        (module docstring), and for comparison the gaps between two leases of one version."""
        start, chunk0, step0 = len(self.node.calls), len(self.node.engine_calls), len(self.node.engine_steps)
        while len(self.node.calls) < start + 3:
            self.step()
        version = publish()
        while sum(v == version for _, _, v in self.node.calls) < 3:
            self.step()
        self.node.work.settle()
        calls = self.node.calls[start:]
        first_new = next(i for i, (_, _, v) in enumerate(calls) if v == version)
        gaps = [b[0] - a[1] for a, b in zip(calls, calls[1:], strict=False)]
        same = [g for i, g in enumerate(gaps) if i + 1 != first_new]
        # The engine's idle time at the change: by vLLM's engine steps (each one decodes a token of every request,
        # or prefills), else by engine call (a lease's one call, or with in-flight updates each chunk).
        chunks = self.node.engine_calls[chunk0:]
        steps = self.node.engine_steps[step0:] or chunks
        at = next(i for i, (_, _, v) in enumerate(steps) if v == version)
        out = {"swap_gap_s": round(steps[at][0] - steps[at - 1][1], 4),
               "lease_gap_s": round(statistics.median(same), 4),
               # Whether the last step of the old version and the first of the new one were of one lease.
               "swapped_mid_lease": any(t0 <= steps[at - 1][0] and steps[at][1] <= t1 for t0, t1, _ in calls)}
        if steps is not chunks:
            # The first step with the new version prefills again what the requests going had (in-flight updates) or
            # the new lease's prompts; beside it, a median step.
            out["first_new_step_s"] = round(steps[at][1] - steps[at][0], 4)
            out["median_step_s"] = round(statistics.median(t1 - t0 for t0, t1, _ in steps), 4)
            # For comparison: the engine's idle time between two leases of one version.
            bounds = [t1 for _, t1, _ in chunks]
            out["lease_step_gap_s"] = round(statistics.median(
                b[0] - a[1] for a, b in zip(steps, steps[1:], strict=False)
                if a[2] == b[2] and any(a[1] <= t < b[0] for t in bounds)), 4)
        engine = self.node.engine  # a staged update (`EngineConfig.staged_reload`): its preparation and its swap
        for name in ("last_prepare_s", "last_commit_s", "last_reset_s", "last_check_s"):
            if getattr(engine, name, None) is not None:
                out[name.removeprefix("last_")] = round(getattr(engine, name), 5)
        return out

    def close(self) -> None:
        self.node.stop()
        self.node.work.close()
        self.fetch_thread.join(timeout=10)
        self.node.weights.close()


def serve(args: argparse.Namespace) -> None:
    """The pool (child process): its address and key on stdout, then up until stdin closes, publishing a new
    version for each line "publish" (its number on stdout)."""
    sampling = m.SamplingSpec(temperature=1.0, max_tokens=args.max_tokens, group_size=args.group_size,
                              in_flight_updates=args.in_flight, update_chunk_tokens=args.chunk_tokens)
    admission = {"unproven_per_source": 10**6, "new_identity_prompts": 2 * args.max_prompts}
    with open_pool(args.out / "pool", args.serve, sampling=sampling, admission=admission) as pool:
        print(json.dumps({"url": pool.url, "key": pool.coordinator_key}), flush=True)
        for i, line in enumerate(sys.stdin):  # each line asks for a new version (the old one, perturbed)
            if line.strip() == "publish":
                new = perturb_checkpoint(args.serve, args.out / f"ckpt-v{i + 1}", 0.01, seed=i + 1)
                print(json.dumps({"version": pool.publish(new)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", "mini", "small30m"])
    ap.add_argument("--engine", default="vllm", choices=["vllm", "torch"], help="the node's (and the bare arm's)")
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-prompts", type=int, default=8, help="prompts per lease")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="round trip added to each of the node's requests")
    ap.add_argument("--swap", action="store_true", help="then publish a new version mid-run: swap_gap_s")
    ap.add_argument("--in-flight", action="store_true", help="in-flight updates (sampling.in_flight_updates)")
    ap.add_argument("--chunk-tokens", type=int, default=1, help="with --in-flight: decode steps between looks")
    ap.add_argument("--no-staged-reload", action="store_true",
                    help="vLLM's in-place reload instead of staged updates (EngineConfig.staged_reload)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)  # the child: the pool
    args = ap.parse_args()
    if args.serve is not None:
        serve(args)
        return
    arms = ["bare" if a == "bare_vllm" else a for a in args.arms.split(",")]
    out = args.out or Path(tempfile.mkdtemp(prefix="node-throughput-"))
    ckpt = checkpoint(out / f"ckpt-{args.model}", args.model)
    params = model_params(ckpt)
    rates: dict[str, list[float]] = {a: [] for a in arms}
    busy: dict[str, list[float]] = {a: [] for a in arms}
    swap: dict[str, float] = {}
    child = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--out", str(out), "--serve", str(ckpt)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        pool = json.loads(child.stdout.readline())
        bench = Bench(pool["url"], pool["key"], out / "node", args)
        try:
            bench.warm_up()
            for r in range(args.repeats):
                for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                    tokens, wall, share = bench.bare_arm() if arm == "bare" else bench.node_arm(arm == "node")
                    rates[arm].append(tokens / wall)
                    busy[arm].append(share)
                    log(f"run {r}: {arm}: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s, engine busy "
                        f"{share:.1%} of the window (load {os.getloadavg()[0]:.1f})")
            if args.swap:
                def publish() -> int:
                    child.stdin.write("publish\n")  # type: ignore[union-attr]
                    child.stdin.flush()  # type: ignore[union-attr]
                    return int(json.loads(child.stdout.readline())["version"])  # type: ignore[union-attr]

                swap.update(bench.swap_gap(publish))
                log(f"version change: {swap}")
            stats = bench.node.stats
            log(f"node: {stats.leases} leases, {stats.groups_accepted} groups accepted, {stats.groups_rejected} "
                f"refused")
        finally:
            bench.close()
    finally:
        child.stdin.close()  # the pool's process ends
        child.wait(timeout=60)
    named = {"bare": f"bare_{args.engine}"}  # bare_vllm_tok_s, bare_torch_tok_s
    rates = {named.get(a, a): v for a, v in rates.items()}
    busy = {named.get(a, a): v for a, v in busy.items()}
    med = {a: statistics.median(v) for a, v in rates.items()}
    result: dict[str, Any] = {f"{a}_tok_s": round(v, 1) for a, v in med.items()}
    bare = named["bare"]
    if bare in med:  # each repeat's ratio (its arms ran back to back), the median of those
        for a, key in (("node", "ratio"), ("node_unpipelined", "ratio_unpipelined")):
            if a in med:
                per_run = [x / b for x, b in zip(rates[a], rates[bare], strict=True)]
                result[key] = round(statistics.median(per_run), 3)
                result[f"{key}_runs"] = [round(x, 3) for x in per_run]
    result.update({f"{a}_engine_busy": round(statistics.median(v), 3) for a, v in busy.items()})
    result.update(swap)
    result.update(model=args.model, engine=args.engine, model_params=params,
                  runs={a: [round(x, 1) for x in v] for a, v in rates.items()},
                  engine_busy={a: [round(x, 3) for x in v] for a, v in busy.items()},
                  setup={"window_s": args.window_s, "repeats": args.repeats, "max_prompts": args.max_prompts,
                         "group_size": args.group_size, "max_tokens": args.max_tokens, "rtt_ms": args.rtt_ms,
                         "in_flight": args.in_flight, "chunk_tokens": args.chunk_tokens if args.in_flight else None,
                         "staged_reload": not args.no_staged_reload,
                         "cpu_threads": 1, "load_avg_end": round(os.getloadavg()[0], 2)})
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
