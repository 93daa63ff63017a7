"""Benchmark: the verifier against the byzantine suite, its calibration, its cost, a swarm with an attacker, and
adaptive attackers, hoarders and men in the middle. Each part's logic lives in `swarmrl.testing.byzantine`; this
script runs them and writes the results.

1. swarm (`testing.byzantine.swarm`): `swarmrl.demo` with two honest nodes plus the rogue attacker process
   (cycling attacks and identities): the run must still learn, and no attacker group may ever reach the trainer;
2. calibration (`testing.byzantine.calibration`): honest groups from the vLLM and torch engines and groups from
   weights perturbed by 0.1% and 1%, recomputed by the verifier on the tiny, the ~27M and the swarm run's models;
3. suite (`testing.byzantine.suite`): a real coordinator and verifier (p = 1) against every attack,
   `--attempts` times each, while honest vLLM and torch nodes keep working until `--honest-groups` were verified;
4. cost (`testing.byzantine.cost`): `verify_cost_ratio` = verifier s/token / vLLM generation s/token on the ~27M
   model (and in one span, as before the early exit); `garbage_verify_cost`; `amortised_verify_cost_ratio`;
5. adaptive: attackers with a third of the throughput and free identities against the check rule
   (`testing.byzantine.adaptive`: `poisoned_share`); a hoarder next to honest nodes with backpressure on
   (`testing.byzantine.hoarding`: `honest_throughput_under_hoarding`, honest accepted groups/s with / without,
   and its `_range` over the repeats; honest newcomers against Sybil hoarders from four addresses:
   `newcomer_throughput_under_sybil_hoarding`; proven honest nodes against a hoarder with a record:
   `proven_throughput_under_proven_hoarder`); a man in the middle rewriting leases (`testing.byzantine.framing`:
   `framed_honest_nodes`, must be 0); two
   verifiers racing for every cheating group, the re-claimer's verdict landing first
   (`testing.byzantine.reclaims`: `cheat_check_rate_with_reclaims`, at least 0.95 p); a man in the
   middle on the verifier's and the trainer's links, and a coordinator that rewrites groups in its own store
   (`testing.byzantine.operator_links`: `operator_path_forgeries_accepted`, must be 0); an attacker that submits only
   the groups it likes (`testing.byzantine.selection`: `selective_submission_gain`, at most 0.02);
6. slowloris (`testing.byzantine.slowloris`): a coordinator process with 1024 open files, one source holding every
   connection it can get, and honest requests from another, each on a new connection: `honest_success_under_slowloris`
   (at least 0.99; the least of `--slowloris-repeats` arms), beside one arm without the connection bounds;
7. multi-turn (`testing.byzantine.episodes`): a multi-turn run on the echo environment, a node that fakes, drops or
   adds an environment turn, one that samples later turns with the leased seed and one whose environment tokens claim
   logprobs, `--attempts` times each, while honest multi-turn nodes work until `--multi-turn-honest-groups` were
   verified: `multi_turn_attacks`, `multi_turn_honest_rejected` of `multi_turn_honest_total`;
8. reward flood (`testing.byzantine.reward_flood`): proven and fresh identities send the costliest code and math
   answers they can build (programs that exit just under each test case's time limit, LaTeX power towers) to the
   real verifier's real scoring, beside honest nodes: `honest_verified_under_reward_flood`, honest groups verified
   per second with them over without them (at least 0.9; the least over the two tasks), beside one arm per task
   without the charging of reward seconds and the sandbox cap.

    python bench/byzantine.py                       # everything (about 60-80 min on 2 busy CPU cores)
    python bench/byzantine.py --skip-swarm --attempts 5 --honest-groups 200   # quicker
    python bench/byzantine.py --skip-swarm --skip-calibration --skip-suite    # cost and adaptive only

Writes <out>/byzantine.json; the last line printed is one JSON object with `attacks` (name -> [detected,
attempted]), `honest_rejected`, `honest_total`, `verify_cost_ratio`, and the other parts' summaries.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

torch.set_num_threads(1)

from swarmrl.testing.byzantine.harness import make_checkpoint  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


ADAPTIVE_PARTS = ("attackers", "hoarding", "framing", "operator-links", "selection", "reclaims")


def adaptive(out: Path, work: dict[str, int], engines: list[str], hoarding_s: float, hoarding_repeats: int,
             reclaim_rounds: int, selection_leases: int, parts: tuple[str, ...] = ADAPTIVE_PARTS,
             earlier: dict[str, Any] | None = None, hoarding_arms: tuple[str, ...] | None = None) -> dict[str, Any]:
    """docs/quarantine.md and docs/admission.md, through the real coordinator and verifier. `parts` run now; the
    others keep their `earlier` results."""
    from swarmrl.testing.byzantine import adaptive as attackers
    from swarmrl.testing.byzantine import framing, hoarding, operator_links, reclaims, selection

    root = out / "adaptive"
    root.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(root / "ckpt")
    res = dict(earlier or {})
    if "attackers" in parts:
        res.update(attackers.section(root, ckpt, work, engines=tuple(engines), log=log) if work else {"runs": {}})
        res["honest_nodes_banned"] = sum(r["honest_nodes_banned"] for r in res["runs"].values())
    if "hoarding" in parts:
        res["hoarding"] = hoarding.section(root / "hoarding", ckpt, duration_s=hoarding_s, repeats=hoarding_repeats,
                                           arms=hoarding_arms or hoarding.ARMS, log=log)
    if "framing" in parts:
        res["framing"] = framing.section(root / "framing", ckpt, log=log)
    if "operator-links" in parts:
        res["operator_links"] = operator_links.section(root / "operator-links", ckpt, log=log)
    if selection_leases and "selection" in parts:
        res["selection"] = selection.section(root / "selection", ckpt, leases=selection_leases, log=log)
    if reclaim_rounds and "reclaims" in parts:
        res["reclaims"] = reclaims.section(root / "reclaims", ckpt, p=0.1, rounds=reclaim_rounds, log=log)
    (out / "adaptive.json").write_text(json.dumps(res, indent=1))
    return res


# -- main ------------------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "byzantine")
    p.add_argument("--attempts", type=int, default=20, help="attempts per attack")
    p.add_argument("--honest-groups", type=int, default=1000)
    p.add_argument("--cost-repeats", type=int, default=3)
    p.add_argument("--swarm-time-limit", type=float, default=900)
    p.add_argument("--swarm-max-steps", type=int, default=150)
    p.add_argument("--quick", action="store_true", help="smaller calibration")
    p.add_argument("--adaptive-work", default="default=3000,old=600,scaled=1500",
                   help="rule=attacker honest groups per run (rules: default, old, scaled)")
    p.add_argument("--adaptive-engines", default="vllm,torch", help="engines of the honest nodes")
    p.add_argument("--hoarding-seconds", type=float, default=60.0, help="seconds per hoarding arm")
    p.add_argument("--hoarding-repeats", type=int, default=3, help="rounds of the hoarding arms (figures: ranges)")
    p.add_argument("--hoarding-arms", default="", help="hoarding arms (rules/hoarder, comma-separated; default: "
                   "testing.byzantine.hoarding.ARMS)")
    p.add_argument("--adaptive-parts", default=",".join(ADAPTIVE_PARTS),
                   help="parts of the adaptive section to run; the others keep their earlier results")
    p.add_argument("--reclaim-rounds", type=int, default=2000, help="cheating groups raced for by two verifiers")
    p.add_argument("--selection-leases", type=int, default=200, help="leases of the attacker that drops by outcome")
    p.add_argument("--slowloris-repeats", type=int, default=3, help="arms with the connection bounds")
    p.add_argument("--multi-turn-honest-groups", type=int, default=500)
    p.add_argument("--multi-turn-engines", default="torch,vllm", help="engines of the honest multi-turn nodes")
    p.add_argument("--reward-flood-seconds", type=float, default=60.0, help="seconds per reward-flood arm")
    p.add_argument("--reward-flood-repeats", type=int, default=3, help="rounds of the reward-flood arms, per task")
    for part in ("calibration", "suite", "cost", "swarm", "adaptive", "slowloris", "multi-turn",
                 "reward-flood"):
        p.add_argument(f"--skip-{part}", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    path = args.out / "byzantine.json"
    if path.exists():  # parts skipped now keep their earlier results
        result = json.loads(path.read_text())

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    if not args.skip_swarm:  # first: its trained checkpoints join the calibration
        from swarmrl.testing.byzantine.swarm import swarm

        result["swarm"] = swarm(args.out, args.swarm_time_limit, args.swarm_max_steps)
        save()
    if not args.skip_calibration:
        from swarmrl.testing.byzantine.calibration import calibrate

        result["calibration"] = calibrate(args.out, args.quick, log)["rows"]
        save()
    if not args.skip_suite:
        from swarmrl.testing.byzantine.suite import suite

        s = suite(args.out, args.attempts, args.honest_groups, log)
        result.update(attacks=s["attacks"], honest_rejected=s["honest_rejected"], honest_total=s["honest_total"],
                      suite=s)
        save()
    if not args.skip_cost:
        from swarmrl.testing.byzantine.cost import cost

        c = cost(args.out, args.cost_repeats, log)
        result.update(verify_cost_ratio=c["verify_cost_ratio"], cost=c)
        save()
    if not args.skip_adaptive:
        work = {k: int(v) for k, v in (kv.split("=") for kv in args.adaptive_work.split(",") if kv)}
        result["adaptive"] = adaptive(args.out, work, args.adaptive_engines.split(","), args.hoarding_seconds,
                                      args.hoarding_repeats, args.reclaim_rounds,
                                      args.selection_leases, tuple(args.adaptive_parts.split(",")),
                                      result.get("adaptive"),
                                      tuple(a for a in args.hoarding_arms.split(",") if a) or None)
        save()
    if not args.skip_slowloris:
        from swarmrl.testing.byzantine import slowloris

        result["slowloris"] = slowloris.section(args.out / "slowloris", args.slowloris_repeats, log=log)
        save()
    if not args.skip_multi_turn:
        from swarmrl.testing.byzantine.episodes import multi_turn_suite

        result["multi_turn"] = multi_turn_suite(args.out, args.attempts, args.multi_turn_honest_groups,
                                                args.multi_turn_engines.split(","), log)
        save()
    if not args.skip_reward_flood:
        from swarmrl.testing.byzantine import reward_flood

        result["reward_flood"] = reward_flood.section(args.out / "reward-flood", duration_s=args.reward_flood_seconds,
                                                      repeats=args.reward_flood_repeats, log=log)
        save()
    last = {k: result.get(k) for k in ("attacks", "honest_rejected", "honest_total", "verify_cost_ratio")}
    mt = result.get("multi_turn", {})
    last.update(multi_turn_attacks=mt.get("attacks"), multi_turn_honest_rejected=mt.get("honest_rejected"),
                multi_turn_honest_total=mt.get("honest_total"))
    ad, co = result.get("adaptive", {}), result.get("cost", {})
    by_rule = ad.get("poisoned_share_by_rule", {})
    hoard, frame = ad.get("hoarding", {}), ad.get("framing", {})
    last.update(poisoned_share=by_rule.get("default"), poisoned_share_by_rule=by_rule,
                honest_nodes_banned=ad.get("honest_nodes_banned"), garbage_verify_cost=co.get("garbage_verify_cost"),
                amortised_verify_cost_ratio=co.get("amortised_verify_cost_ratio"),
                honest_throughput_under_hoarding=hoard.get("honest_throughput_under_hoarding"),
                honest_throughput_under_hoarding_range=hoard.get("honest_throughput_under_hoarding_range"),
                newcomer_throughput_under_sybil_hoarding=hoard.get("newcomer_throughput_under_sybil_hoarding"),
                proven_throughput_under_proven_hoarder=hoard.get("proven_throughput_under_proven_hoarder"),
                framed_honest_nodes=frame.get("framed_honest_nodes"),
                cheat_check_rate_with_reclaims=ad.get("reclaims", {}).get("cheat_check_rate_with_reclaims"),
                reclaims=ad.get("reclaims"),
                selective_submission_gain=ad.get("selection", {}).get("selective_submission_gain"),
                selection=ad.get("selection"),
                operator_path_forgeries_accepted=ad.get("operator_links", {}).get("operator_path_forgeries_accepted"),
                operator_links={k: v for k, v in ad.get("operator_links", {}).items() if k != "rows"},
                honest_success_under_slowloris=result.get("slowloris", {}).get("honest_success_under_slowloris"),
                slowloris={k: v for k, v in result.get("slowloris", {}).items() if k != "runs"},
                honest_verified_under_reward_flood=result.get("reward_flood", {}).get(
                    "honest_verified_under_reward_flood"),
                reward_flood={k: v for k, v in result.get("reward_flood", {}).items() if k != "runs"},
                hoarding={k: v for k, v in hoard.items() if k != "runs"},
                framing={k: v for k, v in frame.items() if k != "rows"})
    last["adaptive"] = {k: {kk: v[kk] for kk in ("poisoned", "trained_on", "poisoned_share", "identities",
                                                 "attacker_share_measured", "honest_check_rate", "honest_rejected",
                                                 "poisoned_per_attacker_honest_group",
                                                 "predicted_poisoned_per_attacker_honest_group",
                                                 "predicted_share_bound")}
                        for k, v in ad.get("runs", {}).items()}
    last["cost"] = {k: v for k, v in co.items() if k != "rounds"}
    last["swarm"] = result.get("swarm")
    print(json.dumps(last), flush=True)


if __name__ == "__main__":
    main()
