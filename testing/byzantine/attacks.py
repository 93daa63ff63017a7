"""Every attack of the byzantine suite as one runnable attempt against a `Pool`.

An attempt makes (or takes) an attacker identity, cheats once through the real protocol, lets the real
verifier decide everything pending, and reports whether the attack was *detected*: every group it produced
was refused by the coordinator or rejected by the verifier, so none reached the trainer (and whether the
rejection banned the node). Attempt i of an attack may pick a variant by i.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import SIGNATURE_HEADER, sign
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.testing.byzantine import nodes as bad
from swarmrl.testing.byzantine.harness import Pool, ScriptedNode


@dataclass
class Attempt:
    detected: bool
    stage: str
    """'coordinator' (refused at submit), 'verifier' (rejected), or 'missed'."""
    reason: str
    caught_by: tuple[str, ...] = ()
    """Every full-check test that failed on the attacker's groups (replay, logprobs, activation proof)."""
    banned: bool = False
    """The verifier's rejection banned the attacker (every verifier-stage rejection does, except a missing proof,
    which is refused without a ban)."""


def _outcome(pool: Pool, node_ids: list[str], before: int, refused: list[str]) -> Attempt:
    """Judge the groups the attacker identities submitted after group id `before`."""
    pool.verify_all()
    mine = [g for nid in node_ids for g in pool.groups(nid) if g["id"] > before]
    if any(g["status"] == "accepted" for g in mine):
        return Attempt(False, "missed", "a group reached the trainer")
    if any(g["held"] or g["status"] == "pending" for g in mine):
        return Attempt(False, "missed", "a group is still undecided")
    if mine:  # all rejected
        banned = all(pool.node_row(nid).banned for nid in {g["node_id"] for g in mine})
        reports = [pool.verifier.reports[g["id"]] for g in mine if g["id"] in pool.verifier.reports]
        failures = [f for rep in reports for f in rep.failures]
        # The cheap check of claimed logprobs (rollouts sharing a prefix) is the logprob layer, run early.
        failures += ["logprobs: (cheap)" for g in mine if "claim logprobs" in g["reason"]]
        caught = tuple(sorted({f.split(":")[0] for f in failures}))
        # The reason that decided it, rather than "not checked" of a group dropped along with its node.
        first = next((g for g in mine if not g["reason"].startswith("not checked")), mine[0])
        return Attempt(True, "verifier", first["reason"][:200], caught, banned)
    if refused:
        return Attempt(True, "coordinator", refused[0][:200])
    return Attempt(False, "missed", "nothing was submitted or refused")


def _last_id(pool: Pool) -> int:
    return max((g["id"] for g in pool.groups()), default=0)


def _refusals(node: ScriptedNode) -> list[str]:
    out = []
    for s in node.client.submits:
        if isinstance(s, CoordinatorError):
            out.append(f"{s.status}: {s.reason}")
        else:
            out.extend(f"refused: {r}" for r in s.rejected.values())
    return out


def _node_attack(make: Callable[[Pool, int], ScriptedNode], tries: int = 1) -> Callable[[Pool, int], Attempt]:
    """An attack carried out by a fresh malicious node's ordinary `step()`. A node that reports
    `deviated = False` sent nothing dishonest (its deviation happened to change no token); with `tries` > 1 a
    fresh node tries again, and only the last one is judged."""
    def run(pool: Pool, i: int) -> Attempt:
        for _ in range(tries):
            pool.verify_all()
            before = _last_id(pool)
            node = make(pool, i)
            try:
                node.step()
            finally:
                if node.engine is not None:
                    node.engine.close()
            if getattr(node, "deviated", True) is not False:
                break
        return _outcome(pool, [node.node_id], before, _refusals(node))
    return run


def _honest_submission(pool: Pool, name: str) -> tuple[ScriptedNode, m.Lease, m.RolloutSubmission]:
    """A node with an honestly generated, not yet submitted submission (for protocol-level attacks)."""
    node = pool.node(name=name, max_prompts=1)
    node.load_ready_weights(node._run_info.spec.sampling.temperature)
    lease = node.client.lease(1, held_version=node.stats.held_version)
    sub = node.generate(lease)
    node.engine.close()
    return node, lease, sub


def replayed_group(pool: Pool, i: int) -> Attempt:
    """Variants: 0 resend the exact signed request; 1 re-sign and resubmit an accepted group; 2 put an accepted
    group's rollouts (seeds relabelled) under a new lease's prompt."""
    node, lease, sub = _honest_submission(pool, f"replay{i}")
    node.client.submit(sub)
    pool.verify_all()
    before = _last_id(pool)
    refused: list[str] = []
    variant = i % 3
    if variant == 0:
        body = sub.model_dump_json().encode()
        headers = node.client.signature_header(m.KIND_SUBMIT, body)
        for _ in range(2):  # the first copy is refused as its lease is settled, the second as a replayed request
            r = httpx.post(pool.url + "/v1/submit", content=body, headers=headers)
            refused.append(f"{r.status_code}: {r.text[:100]}")
    elif variant == 1:
        try:
            refused += [f"refused: {x}" for x in node.client.submit(sub).rejected.values()]
        except CoordinatorError as e:  # the lease was settled by the first submission
            refused.append(f"{e.status}: {e.reason}")
    else:
        new = node.client.lease(1, held_version=node.stats.held_version)
        old = sub.groups[0]
        rollouts = [r.model_copy(update={"seed": s}) for r, s in zip(old.rollouts, new.prompts[0].seeds, strict=True)]
        group = old.model_copy(update={"prompt_id": new.prompts[0].prompt_id, "rollouts": rollouts})
        try:
            res = node.client.submit(sub.model_copy(update={"lease_id": new.lease_id, "groups": [group]}))
            refused += [f"refused: {x}" for x in res.rejected.values()]
        except CoordinatorError as e:
            refused.append(f"{e.status}: {e.reason}")
    return _outcome(pool, [node.node_id], before, refused)


def stale_policy_version(pool: Pool, i: int) -> Attempt:
    """Variants: 0 declare a version older than the staleness bound; 1 generate with old weights but declare
    the current version (needs a newer published version: the pool publishes perturbed weights once)."""
    from swarmrl.testing.byzantine.harness import perturb_checkpoint

    if len(pool.versions) < pool.cfg.run.max_staleness + 2:
        base = pool.versions[max(pool.versions)]
        for _ in range(pool.cfg.run.max_staleness + 2 - len(pool.versions)):
            nxt = perturb_checkpoint(base, pool.root / f"published-v{len(pool.versions)}", 0.01, len(pool.versions))
            pool.publish(nxt)
    current = max(pool.versions)
    node = pool.node(bad.OldWeightsNode, name=f"stale{i}", max_prompts=1, version=0, declare=current if i % 2 else 0)
    before = _last_id(pool)
    try:
        node.step()
    finally:
        node.engine.close()
    return _outcome(pool, [node.node_id], before, _refusals(node))


def forged_signature(pool: Pool, i: int) -> Attempt:
    """An honest-looking submission whose signature (or signed payload) was altered after signing."""
    node, lease, sub = _honest_submission(pool, f"forger{i}")
    body = sub.model_dump_json().encode()
    headers = node.client.signature_header(m.KIND_SUBMIT, body)
    if i % 2:
        sig = json.loads(headers[SIGNATURE_HEADER])
        sig["sig"] = ("0" if sig["sig"][0] != "0" else "1") + sig["sig"][1:]
        headers = {SIGNATURE_HEADER: json.dumps(sig)}
    else:
        payload = json.loads(body)
        payload["groups"][0]["rollouts"][0]["logprobs"][0] -= 0.5
        body = json.dumps(payload).encode()
    before = _last_id(pool)
    r = httpx.post(pool.url + "/v1/submit", content=body, headers=headers)
    return _outcome(pool, [node.node_id], before, [f"{r.status_code}: {r.text[:100]}"] if r.status_code >= 400 else [])


def other_node_identity(pool: Pool, i: int) -> Attempt:
    """Variants: 0 claim a victim's public key without its private key; 1 submit into a victim's lease."""
    victim, vlease, vsub = _honest_submission(pool, f"victim{i}")
    thief = Identity.generate()
    before = _last_id(pool)
    if i % 2 == 0:
        body = vsub.model_dump_json().encode()
        sig = sign(thief, m.KIND_SUBMIT, victim.client.pool, body).model_copy(
            update={"key": victim.identity.public_key_hex})
        r = httpx.post(pool.url + "/v1/submit", content=body, headers={SIGNATURE_HEADER: sig.header()})
        refused = [f"{r.status_code}: {r.text[:100]}"] if r.status_code >= 400 else []
        ids = [victim.node_id]
    else:
        client = CoordinatorClient(pool.url, thief, retries=0)
        client.register(name="thief")
        try:
            res = client.submit(vsub)
            refused = [f"refused: {x}" for x in res.rejected.values()]
        except CoordinatorError as e:
            refused = [f"{e.status}: {e.reason}"]
        ids = [thief.node_id]
    return _outcome(pool, ids, before, refused)


def oversized_body(pool: Pool, i: int) -> Attempt:
    """A signed submission padded past the coordinator's body limit (declared or streamed)."""
    node, lease, sub = _honest_submission(pool, f"big{i}")
    body = (sub.model_dump_json()[:-1] + ', "pad": "' + "x" * (pool.cfg.max_body_bytes + 1) + '"}').encode()
    headers = node.client.signature_header(m.KIND_SUBMIT, body)
    before = _last_id(pool)
    if i % 2:
        r = httpx.post(pool.url + "/v1/submit", headers=headers,
                       content=iter([body[k:k + 65536] for k in range(0, len(body), 65536)]))
    else:
        r = httpx.post(pool.url + "/v1/submit", content=body, headers=headers)
    return _outcome(pool, [node.node_id], before, [f"{r.status_code}: {r.text[:100]}"] if r.status_code >= 400 else [])


def identity_flood(pool: Pool, i: int, identities: int = 4) -> Attempt:
    """Fresh identities, each submitting made-up completions at once (new nodes are always fully checked)."""
    before = _last_id(pool)
    ids, refused = [], []
    for k in range(identities):
        node = pool.node(bad.EditNode, name=f"sybil{i}.{k}", max_prompts=1, edit=bad.made_up_completion, seed=k)
        try:
            node.step()
        finally:
            node.engine.close()
        ids.append(node.node_id)
        refused += _refusals(node)
    return _outcome(pool, ids, before, refused)


def _edit(edit: bad.Edit) -> Callable[[Pool, int], ScriptedNode]:
    return lambda pool, i: pool.node(bad.EditNode, name=f"{edit.__name__}{i}", edit=edit, seed=i)


ATTACKS: dict[str, Callable[[Pool, int], Attempt]] = {
    "wrong_model_1pct": _node_attack(lambda p, i: p.node(bad.WrongModelNode, name=f"w1-{i}", frac=0.01,
                                                         noise_seed=i + 1)),
    "wrong_model_0.1pct": _node_attack(lambda p, i: p.node(bad.WrongModelNode, name=f"w01-{i}", frac=0.001,
                                                           noise_seed=i + 1)),
    "wrong_model_other_seed": _node_attack(lambda p, i: p.node(bad.WrongModelNode, name=f"wseed{i}",
                                                               other_seed=1000 + i)),
    "edited_token": _node_attack(_edit(bad.edit_token)),
    "edited_span": _node_attack(_edit(bad.edit_span)),
    "edited_last_token": _node_attack(_edit(bad.edit_last_token)),
    "made_up_completion": _node_attack(_edit(bad.made_up_completion)),
    "faked_logprobs": _node_attack(_edit(bad.faked_logprobs)),
    "temperature_1.5x": _node_attack(lambda p, i: p.node(bad.TemperatureNode, name=f"hot{i}", clever=i % 2 == 0),
                                     tries=8),
    "inflated_claimed_reward": _node_attack(lambda p, i: p.node(bad.ClaimNode, name=f"claim{i}")),
    "bad_activation_proof": _node_attack(lambda p, i: p.node(bad.ProofForgerNode, name=f"proof{i}", seed=i)),
    "replayed_group": replayed_group,
    "stale_policy_version": stale_policy_version,
    "forged_signature": forged_signature,
    "other_node_identity": other_node_identity,
    "oversized_body": oversized_body,
    "identity_flood": identity_flood,
}
"""Attack name -> one attempt. Order matters only for `stale_policy_version`, which publishes new versions:
it runs last among the attacks that use the current weights (see `run_suite`)."""

LAST = ("stale_policy_version",)


def run_suite(pool: Pool, attempts: int, names: list[str] | None = None,
              honest: Callable[[], int] | None = None, rng: random.Random | None = None,
              attacks: dict[str, Callable[[Pool, int], Attempt]] | None = None) -> dict[str, list[Attempt]]:
    """`attempts` attempts of each attack of `attacks` (default `ATTACKS`), interleaved with `honest()` rounds when
    given."""
    attacks = ATTACKS if attacks is None else attacks
    names = names or list(attacks)
    order = [n for n in names if n not in LAST] + [n for n in names if n in LAST]
    results: dict[str, list[Attempt]] = {n: [] for n in order}
    for i in range(attempts):
        for name in order:
            results[name].append(attacks[name](pool, i))
            if honest is not None:
                honest()
    return results
