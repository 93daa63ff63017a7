"""Reward floods (bench/byzantine.py, reward-flood part): answers built to cost the verifier the most to score.

A group's rewards are computed on the trusted side from the completion: a code task runs the program on every test
case in a sandbox, a math task parses the answer with sympy. A sender chooses that text, so it chooses the cost:
a program that exits just under each case's time limit makes every case run, and a short LaTeX power tower costs a
whole parse time limit (about 2 s, some 1,000 times an honest answer). These attackers send such answers through a
real coordinator to the real verifier (its real scoring: bubblewrap sandboxes, the math-verify worker):

- `ProvenFlooder`: a node that works honestly through its warm-up (its groups pass their full checks), then
  replaces every completion by a costly one (annotated with the true model, so the cheap checks pass): its groups
  are held, and scored. Only a drawn full check (probability p) catches it; it then comes back under a new key;
- `FreshFlooder`: a new identity for every group, each made of costly completions from the start: the warm-up's
  full check rejects them (and bans it) before any reward is computed.

`honest_verified_under_reward_flood` (`section`): honest groups verified per second while both attack, over the rate
without them, per task; every second the verifier spends scoring an identity's answers is charged to its budget
(`verifier.budget`), and the code task caps a rollout's sandbox time across its cases. An arm without either shows
what the flood did before.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import string
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarmrl.models.prompts import render_prompt
from swarmrl.models.tokenizers import build_char_tokenizer
from swarmrl.node.config import NodeConfig
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.run import RunSpec
from swarmrl.protocol.tasks import TaskSpec
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.testing.byzantine.harness import Pool, ScriptedNode, open_pool
from swarmrl.testing.byzantine.nodes import Truth
from swarmrl.trainer.model import ModelConfig, build_model, save_checkpoint

ALPHABET = "".join(c for c in string.printable if c not in "\r\x0b\x0c")
"""Characters of the bench's model: enough for programs and LaTeX, one token each."""
K = 3
"""Warm-up checks (the verifier's K): small, so that an attacker is proven within the arm."""
GROUP_SIZE = 2
BUDGET_S, BUDGET_WINDOW_S = 2.5, 10.0
"""The verifier's identity budget in the charged arms: a refill of 0.25 verifier-seconds per second per identity,
above an honest node's use here (about 0.15) and, with the two honest nodes', within one verifier."""
CLAIM_TTL_S = 10.0
CODE_WALL_S = 1.0
MATH_TIMEOUT_S = 1
CASES = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in ((1, 2), (30, 4), (500, 6))]


def make_text_checkpoint(out: Path) -> Path:
    """A random-weight tiny model whose character tokenizer covers printable ASCII (programs, LaTeX)."""
    tok = build_char_tokenizer(ALPHABET)
    # Short honest completions (about 3 characters): an honest group costs the verifier a few sandbox runs, not 12
    # runs of 48 characters of noise, so honest nodes stay well within their budget, as with a trained policy.
    return save_checkpoint(build_model(ModelConfig(max_positions=128, stop_rate=0.3), tok), tok, out)


def task_spec(task: str, data: Path, capped: bool) -> TaskSpec:
    """The run's task: code problems with 3 test cases each, or arithmetic questions; `capped`: the code task's
    per-rollout sandbox cap is 1.5 case limits (else 3: no cap for 3 cases)."""
    if task == "code":
        rows = [{"prompt": f"Print a+b ({i}).", "tests": CASES} for i in range(16)]
    else:
        rows = [{"question": f"{i}+{2 * i}=?", "answer": str(3 * i)} for i in range(16)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path = data / f"{task}.jsonl"
    path.write_text(text)
    options: dict[str, Any] = {"path": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    if task == "code":
        options.update(sandbox={"wall_s": CODE_WALL_S, "cpu_s": 1, "memory_mb": 256, "nproc": 8},
                       rollout_sandbox_s=(1.5 if capped else 3.0) * CODE_WALL_S)
    else:
        options.update(verify_timeout_s=MATH_TIMEOUT_S)
    return TaskSpec(name=task, options=options)


def costly_text(task: str, nonce: int) -> str:
    """The costliest answer the attacker knows for `task`, distinct per `nonce` (so no score cache helps): a program
    that sleeps just under each case's limit, or a power tower (shallow enough for the nesting pre-check)."""
    if task == "code":
        return f"import time\ntime.sleep({0.8 * CODE_WALL_S:.2f})#{nonce}"
    return "\\boxed{9^{9^{9^{9^{9^{9^{9^{" + str(nonce % 1000) + "}}}}}}}}"


def costly_rollouts(task: str, truth: Truth, prompt_ids: list[int], seeds: list[int], temperature: float,
                    nonce: Callable[[], int]) -> list[m.Rollout]:
    """One costly completion per seed, ending in the stop token, with the true model's logprobs and proofs."""
    out = []
    for seed in seeds:
        ids = truth.tokenizer(costly_text(task, nonce()), add_special_tokens=False).input_ids + [truth.eos]
        logprobs, proof = truth.annotate(prompt_ids, ids, temperature)
        out.append(m.Rollout(seed=seed, completion_ids=ids, logprobs=logprobs, finish_reason="stop", proof=proof))
    return out


class Nonces:
    def __init__(self) -> None:
        self._n, self._lock = 0, threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self._n += 1
            return self._n


class ProvenFlooder(ScriptedNode):
    """Honest until it has passed K full checks, then every completion is a costly one."""

    def __init__(self, cfg: NodeConfig, pool: Pool, task: str, truth: Truth, nonce: Nonces, **kw: Any):
        super().__init__(cfg, **kw)
        self.pool, self.task, self.truth, self.nonce = pool, task, truth, nonce
        self.costly_groups = 0

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        if self.pool.node_facts(self.node_id)[0] < K:  # its own standing, as the coordinator reports it
            return submission
        seeds = {p.prompt_id: p.seeds for p in lease.prompts}
        groups = [g.model_copy(update={"rollouts": costly_rollouts(self.task, self.truth, g.prompt_ids,
                                                                   seeds[g.prompt_id], lease.sampling.temperature,
                                                                   self.nonce)})
                  for g in submission.groups]
        self.costly_groups += len(groups)
        return submission.model_copy(update={"groups": groups})


class FreshFlooder:
    """A new key per group: register, lease one prompt, submit costly completions (no model run of its own)."""

    def __init__(self, pool: Pool, task: str, truth: Truth, nonce: Nonces):
        self.pool, self.task, self.truth, self.nonce = pool, task, truth, nonce
        self.identities: list[str] = []
        self.groups = 0

    def step(self) -> None:
        client = CoordinatorClient(self.pool.url, Identity.generate(), retries=0,
                                   coordinator_key=self.pool.coordinator_key)
        client.register(name=f"fresh{len(self.identities)}")
        self.identities.append(client.identity.node_id)
        lease = client.lease(1, max(self.pool.versions))
        if lease is None:
            return
        groups = []
        for p in lease.prompts:
            prompt_ids = render_prompt(self.truth.tokenizer, p.text)
            groups.append(m.RolloutGroup(prompt_id=p.prompt_id, prompt_ids=prompt_ids, rollouts=costly_rollouts(
                self.task, self.truth, prompt_ids, p.seeds, lease.sampling.temperature, self.nonce)))
        client.submit(m.RolloutSubmission(lease_id=lease.lease_id, policy_version=lease.policy_version,
                                          groups=groups))
        self.groups += len(groups)


def _loop(step: Callable[[], Any], pace_s: float, stop: threading.Event, errors: list[str]) -> None:
    """`step` at most once per `pace_s` until `stop` (the pace stands for a node's generation time)."""
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            step()
        except CoordinatorError as e:
            errors.append(e.reason[:120])
        stop.wait(max(0.0, pace_s - (time.monotonic() - t0)))


def _proven_stream(pool: Pool, task: str, truth: Truth, nonce: Nonces, made: list[ProvenFlooder]) -> Callable[[], Any]:
    """A proven flooder's step; a new one (new key, new warm-up) once the current one is banned."""
    def step() -> None:
        if not made or pool.node_facts(made[-1].node_id)[1]:
            if made and made[-1].engine is not None:
                made[-1].engine.close()
            node = pool.node(ProvenFlooder, name=f"proven{len(made)}", max_prompts=1, pool=pool, task=task,
                             truth=truth, nonce=nonce)
            node.load_ready_weights(pool.cfg.run.sampling.temperature)
            made.append(node)
        made[-1].step()
    return step


def _decided(group: dict[str, Any]) -> bool:
    """Whether the verifier gave the group a verdict: accepted, rejected, or held (pending with `held` set)."""
    return group["status"] != "pending" or bool(group["held"])


def arm(root: Path, ckpt: Path, task: str, attack: bool, charged: bool, duration_s: float, honest_nodes: int = 2,
        honest_pace_s: float = 6.0, attack_pace_s: float = 1.0) -> dict[str, Any]:
    """One arm on a fresh pool: honest nodes, one group per `honest_pace_s` each, for `duration_s`; with `attack`,
    a proven and a fresh flooder besides. `charged`: reward seconds charged to a budget of `BUDGET_S` per identity
    refilled in `BUDGET_WINDOW_S`, and the code task's rollout cap on (else no budget and no cap). Claims last
    `CLAIM_TTL_S`, so a deferred group comes back within the arm."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "data").mkdir(parents=True)
    run = RunSpec(run_id="byzantine", max_staleness=1, task=task_spec(task, root / "data", capped=charged),
                  sampling=m.SamplingSpec(temperature=1.0, max_tokens=48, group_size=GROUP_SIZE))
    vcfg = {"warmup_checks": K, "sample_rate": 0.1, "identity_budget_s": BUDGET_S if charged else None,
            "identity_budget_window_s": BUDGET_WINDOW_S}
    with open_pool(root, ckpt, verifier=vcfg, run=run, max_outstanding_leases=4, lease_ttl_s=120.0,
                   claim_ttl_s=CLAIM_TTL_S) as pool:
        v = pool.verifier
        spent: Counter[str] = Counter()
        charged_s: Counter[str] = Counter()
        scored = v._scored

        def timed_scored(g: m.PendingGroup, *a: Any) -> m.Verdict:
            t0 = time.perf_counter()
            try:
                return scored(g, *a)
            finally:
                spent[g.node_id] += time.perf_counter() - t0

        v._scored = timed_scored  # type: ignore[method-assign]
        v.verify([])  # connects (loads the task) before the clock starts
        if v.budget is not None:
            charge = v.budget.charge
            v.budget.charge = lambda node, s: (charged_s.update({node: s}), charge(node, s))[1]  # type: ignore
        honest = [pool.node(name=f"honest{i}", max_prompts=1) for i in range(honest_nodes)]
        for h in honest:
            h.load_ready_weights(run.sampling.temperature)
        stop, errors, bad_errors = threading.Event(), [], []
        steps: list[tuple[Callable[[], Any], float, list[str]]] = [(h.step, honest_pace_s, errors) for h in honest]
        truth, nonce, proven, fresh = Truth(ckpt), Nonces(), [], None
        if attack:
            fresh = FreshFlooder(pool, task, truth, nonce)
            steps += [(_proven_stream(pool, task, truth, nonce, proven), attack_pace_s, bad_errors),
                      (fresh.step, attack_pace_s, bad_errors)]
        threads = [threading.Thread(target=_loop, args=(s, p, stop, e), daemon=True) for s, p, e in steps]

        def verifier() -> None:
            while not stop.is_set():
                if not v.poll_once():
                    stop.wait(0.05)

        threads.append(threading.Thread(target=verifier, daemon=True))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        stop.wait(duration_s)
        ids = {h.node_id for h in honest}
        groups = pool.groups()  # read at the end of the arm: what was decided within it
        wall = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join(timeout=300)
        for n in [*honest, *proven]:
            if n.engine is not None:
                n.engine.close()
    mine = [g for g in groups if g["node_id"] in ids]
    verified = sum(_decided(g) for g in mine)
    attackers = {g["node_id"] for g in groups} - ids
    out: dict[str, Any] = {
        "task": task, "attack": attack, "charged": charged, "wall_s": round(wall, 1),
        "honest_submitted": len(mine), "honest_verified": verified, "honest_verified_per_s": round(verified / wall, 3),
        "honest_rejected": sum(g["status"] == "rejected" for g in mine),
        "honest_reward_s": round(sum(spent[i] for i in ids), 2), "honest_refusals": len(errors),
        "verifier": {k: round(x, 2) for k, x in vars(v.stats).items()}}
    if attack:
        out.update(proven_identities=len(proven), proven_costly_groups=sum(p.costly_groups for p in proven),
                   fresh_identities=len(fresh.identities) if fresh else 0,
                   attacker_groups=sum(g["node_id"] in attackers for g in groups),
                   attacker_groups_decided=sum(g["node_id"] in attackers and _decided(g) for g in groups),
                   attacker_reward_s=round(sum(spent[i] for i in attackers), 2),
                   attacker_charged_s=round(sum(charged_s[i] for i in attackers), 2) if charged else None,
                   attacker_refusals=len(bad_errors), attacker_refusal_examples=sorted(set(bad_errors))[:3])
    return out


def section(root: Path, tasks: tuple[str, ...] = ("code", "math"), duration_s: float = 60.0, repeats: int = 3,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Per task, `repeats` rounds of: no attackers, attackers with charging; then one arm of attackers without it.
    `honest_verified_under_reward_flood`: the least over tasks of (honest groups verified per second with the
    charged attackers / without attackers), over all rounds; each round's ratio goes alongside."""
    ckpt = make_text_checkpoint(root / "ckpt")
    runs: dict[str, list[dict[str, Any]]] = {}
    for task in tasks:
        plan = [(False, True), (True, True)] * repeats + [(True, False)]
        for i, (attack, charged) in enumerate(plan):
            name = f"{task}/{'attack' if attack else 'none'}{'' if charged else '-uncharged'}"
            res = arm(root / f"{task}-{i}", ckpt, task, attack, charged, duration_s)
            log(f"reward flood {name} #{i // 2}: {res}")
            runs.setdefault(name, []).append(res)

    def rate(name: str) -> float:
        return sum(x["honest_verified"] for x in runs[name]) / max(sum(x["wall_s"] for x in runs[name]), 1e-9)

    def ratio(a: str, b: str) -> float | None:
        return round(rate(a) / rate(b), 3) if rate(b) > 0 else None

    by_task = {t: {"charged": ratio(f"{t}/attack", f"{t}/none"), "uncharged": ratio(f"{t}/attack-uncharged",
                                                                                       f"{t}/none"),
                   "rounds": [round(a["honest_verified_per_s"] / b["honest_verified_per_s"], 3)
                              if b["honest_verified_per_s"] else None
                              for a, b in zip(runs[f"{t}/attack"], runs[f"{t}/none"], strict=True)]}
               for t in tasks}
    charged = [r["charged"] for r in by_task.values()]
    return {
        "honest_verified_under_reward_flood": min(charged) if charged and None not in charged else None,
        "by_task": by_task, "honest_verified_per_s": {k: round(rate(k), 3) for k in runs},
        "settings": {"duration_s": duration_s, "repeats": repeats, "honest_nodes": 2, "honest_pace_s": 6.0,
                     "attack_pace_s": 1.0, "warmup_checks": K, "sample_rate": 0.1, "identity_budget_s": BUDGET_S,
                     "identity_budget_window_s": BUDGET_WINDOW_S, "claim_ttl_s": CLAIM_TTL_S,
                     "code_wall_s": CODE_WALL_S, "code_rollout_sandbox_s": 1.5 * CODE_WALL_S,
                     "math_verify_timeout_s": MATH_TIMEOUT_S, "group_size": GROUP_SIZE},
        "runs": runs,
    }
