"""What checking a multi-turn group costs the verifier, against a single-turn group of the same length.

One model (Qwen2 mini, random weights, a stop token about 15% likely per token), one engine (torch, CPU), the same
prompts and seeds. Multi-turn: episodes of up to `--turns` model turns against an environment that always answers
(so every episode plays all its turns unless it runs out of tokens). Single-turn: the same architecture whose stop
tokens almost never win (a stop rate of 1e-6), the same prompts and seeds, each completion exactly as long as the
multi-turn episode in its place. Both go
through what the verifier runs on a group (`testing.local.verify_groups`: the cheap checks, the environment's
replay, the reward, the full check). Run a few rounds, alternating, and compare seconds per group and per token.

    .venv/bin/python bench/episodes.py [--groups 16] [--rounds 3]

Last line: one JSON object with `multi_turn_s_per_group`, `single_turn_s_per_group`, `cost_ratio` (their quotient,
for completions of the same length), `tokens_per_group`, `env_tokens_share` and `rejected` (both kinds; 0 expected).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from swarmrl.models.build import ModelConfig, build_model, save_checkpoint
from swarmrl.models.prompts import render_prompt
from swarmrl.models.tokenizers import build_bpe_tokenizer
from swarmrl.node.engine import EngineConfig, GenerationRequest
from swarmrl.node.engines import build_engine
from swarmrl.node.episodes import play_episodes
from swarmrl.protocol import messages as m
from swarmrl.protocol.episodes import Environment, EnvironmentSpec
from swarmrl.protocol.run import RunSpec
from swarmrl.tasks.addition import AdditionTask
from swarmrl.testing.groups import pending_group
from swarmrl.testing.local import verify_groups
from swarmrl.verifier.models import load_policy

GROUP = 8


class Talker(Environment):
    name = "talker"

    def respond(self, prompt: str, turns: Sequence[str], seed: int) -> str | None:
        return f"turn {len(turns)}: {turns[-1][:12]}"


def _groups(texts, ids, seeds, rollouts, sampling) -> list[m.PendingGroup]:
    return [pending_group(group_id=i + 1, prompt_text=t, answer="0", sampling=sampling, seeds=s,
                          group=m.RolloutGroup(prompt_id=str(i), prompt_ids=p, rollouts=rs))
            for i, (t, p, s, rs) in enumerate(zip(texts, ids, seeds, rollouts, strict=True))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = build_bpe_tokenizer(1024)
    root = Path(tempfile.mkdtemp(prefix="episodes-bench-"))
    ckpt = save_checkpoint(build_model(ModelConfig.preset("mini", arch="qwen2", stop_rate=0.15), tok), tok, root / "c")
    multi = m.SamplingSpec(temperature=1.0, max_tokens=24, group_size=GROUP, max_turns=args.turns,
                           max_episode_tokens=120)
    run_multi = RunSpec(sampling=multi, environment=EnvironmentSpec(name="talker"))
    env = Talker(Environment.Options())
    # The baseline's model: the same shape, stops about one in a million tokens, so a completion is as long as asked.
    flat = save_checkpoint(build_model(ModelConfig.preset("mini", arch="qwen2", stop_rate=1e-6), tok), tok, root / "f")
    policy, flat_policy = load_policy(ckpt, 0), load_policy(flat, 0)
    rng = random.Random(0)
    times: dict[str, list[float]] = {"multi": [], "single": []}
    tokens, env_tokens, rejected = 0, 0, 0
    with build_engine(EngineConfig(kind="torch"), ckpt, temperature=1.0) as engine, \
            build_engine(EngineConfig(kind="torch"), flat, temperature=1.0) as flat_engine:
        for _ in range(args.rounds):
            texts = [f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=" for _ in range(args.groups)]
            ids = [render_prompt(tok, t) for t in texts]
            seeds = [[rng.getrandbits(63) for _ in range(GROUP)] for _ in texts]
            played = play_episodes(engine, tok, env, multi, list(zip(texts, ids, seeds, strict=True)))
            lengths = [[len(r.completion_ids) for r in rs] for rs in played]
            tokens += sum(map(sum, lengths))
            env_tokens += sum(sum(r.turns[1::2]) for rs in played for r in rs)
            # Single-turn groups of as many tokens: each rollout as long as its multi-turn group's mean episode (a
            # group's rollouts one length, so that each ends at max_tokens as the cheap check wants).
            single_rollouts, single_len = [], []
            for p, s, ls in zip(ids, seeds, lengths, strict=True):
                n = round(statistics.mean(ls))
                cs = flat_engine.generate([GenerationRequest(prompt_ids=p, seed=seed) for seed in s], max_tokens=n)
                single_rollouts.append([m.Rollout(seed=seed, completion_ids=c.token_ids, logprobs=c.logprobs,
                                                  finish_reason=c.finish_reason, proof=c.proof)
                                        for seed, c in zip(s, cs, strict=True)])
                single_len.append(n)
            for kind in ("multi", "single"):
                if kind == "multi":
                    groups, run = _groups(texts, ids, seeds, played, multi), run_multi
                else:
                    groups = []
                    for i, (n, rs) in enumerate(zip(single_len, single_rollouts, strict=True)):
                        sampling = m.SamplingSpec(temperature=1.0, max_tokens=n, group_size=GROUP)
                        groups.append(pending_group(group_id=i + 1, prompt_text=texts[i], answer="0",
                                                    sampling=sampling, seeds=seeds[i],
                                                    group=m.RolloutGroup(prompt_id=str(i), prompt_ids=ids[i],
                                                                         rollouts=rs)))
                    run = RunSpec()
                t0 = time.perf_counter()
                reasons, _ = verify_groups(flat_policy if kind == "single" else policy, groups, task=AdditionTask(),
                                           run=run, env=env if kind == "multi" else None)
                times[kind].append((time.perf_counter() - t0) / len(groups))
                rejected += sum(r is not None for r in reasons)
                print(kind, f"{times[kind][-1] * 1e3:.1f} ms/group", [r for r in reasons if r][:2], flush=True)
    mt, st = statistics.median(times["multi"]), statistics.median(times["single"])
    per_group = tokens / (args.rounds * args.groups)
    print(json.dumps({"multi_turn_s_per_group": round(mt, 4), "single_turn_s_per_group": round(st, 4),
                      "cost_ratio": round(mt / st, 3), "tokens_per_group": round(per_group, 1),
                      "env_tokens_share": round(env_tokens / tokens, 3), "rejected": rejected,
                      "rounds": args.rounds, "groups_per_round": args.groups}))


if __name__ == "__main__":
    main()
