"""A coordinator with `workers = 2` on SQLite: two real server processes share the port and the database. The kernel
spreads connections over both, and one node's requests may land on either: a challenge made by one is taken by the
other (the run's secret is shared), a lease granted by one is submitted to the other. And processes that share
the SQLite file take turns at writing, and hear of each other's commits (long polls wake on them). A third process,
the store's writer, writes the heartbeats and the submissions whose lease the serving process granted
(`coordinator.db.sqlite.writer`); when it ends, the coordinator stops."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import orjson

from swarmrl.coordinator.db.store import Store, add_to_counter
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import SIGNATURE_HEADER, canonical_json, sign
from swarmrl.runtime.client import IDEMPOTENCY_HEADER, CoordinatorClient, new_idempotency_key
from swarmrl.testing.http1 import Connection
from swarmrl.testing.load import publish_version_zero
from swarmrl.testing.processes import RoleProcess
from tests.support.coordinator import submission


def test_a_process_sharing_the_database_hears_of_the_others_commits(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.sqlite'}"
    one, other = Store(url, processes=2), Store(url, processes=2)
    try:
        seen = other.generation
        one.write(lambda tx: add_to_counter(tx, "lease_counter"))  # no notify: only the shared file says so
        other.wait_for_change(seen, timeout=60)
        assert other.generation != seen
    finally:
        one.close()
        other.close()


def test_processes_take_turns_at_writing(tmp_path: Path) -> None:
    """While another process holds the writer lock, a write waits for it (instead of SQLite's sleep-and-retry)."""
    url = f"sqlite:///{tmp_path / 'shared.sqlite'}"
    store = Store(url, processes=2)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from swarmrl.coordinator.db.sqlite.shared import "
         f"WriterLock; lock = WriterLock(Path({str(tmp_path / 'shared.sqlite')!r} + '-writer.lock')); "
         "lock.__enter__(); print('held', flush=True); sys.stdin.readline(); lock.__exit__(None, None, None)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    done = threading.Event()
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        writer = threading.Thread(target=lambda: (store.write(lambda tx: add_to_counter(tx, "lease_counter")),
                                                  done.set()))
        writer.start()
        assert not done.wait(1.0)  # held elsewhere: the write waits (it cannot finish early, however fast)
        assert holder.stdin is not None
        holder.stdin.write("release\n")
        holder.stdin.flush()
        assert done.wait(60)  # released: the write goes through
        writer.join()
    finally:
        holder.kill()
        store.close()


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _serving_pid(server_port: int, client_port: int, pids: list[int]) -> int:
    """The process holding the server's end of the loopback connection from `client_port`."""
    inode = next(fields[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if (fields := line.split()) and int(fields[1].split(":")[1], 16) == server_port
                 and int(fields[2].split(":")[1], 16) == client_port)
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no worker holds the connection from port {client_port}")


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


async def _post(conn: Connection, identity: Identity, pool: str, path: str, kind: str | None, payload: dict,
                key: str | None = None) -> dict:
    body = canonical_json(payload)
    headers = {"content-type": "application/json"}
    if kind is not None:
        headers[SIGNATURE_HEADER] = sign(identity, kind, pool, body).header()  # a fresh nonce on every try
    if key is not None:
        headers[IDEMPOTENCY_HEADER] = key
    resp = await conn.request("POST", path, body, headers)
    assert resp.status == 200, (path, resp.status, resp.body[:300])
    return orjson.loads(resp.body)


def test_two_workers_share_the_port_and_one_nodes_requests(tmp_path: Path) -> None:
    operator = Identity.generate()
    config = tmp_path / "coordinator.toml"
    config.write_text(f'host = "127.0.0.1"\nport = 0\ndata_dir = "{tmp_path / "data"}"\nworkers = 2\n'
                      f'operator_keys = ["{operator.public_key_hex}"]\n'
                      '\n[run]\nrun_id = "workers"\n[run.sampling]\ngroup_size = 3\nmax_tokens = 4\n')
    coord = RoleProcess("coordinator", config, tmp_path / "coordinator.log").start()
    try:
        url = coord.url()
        port = int(url.rsplit(":", 1)[1])
        publish_version_zero(url, operator, tmp_path, "workers")
        with CoordinatorClient(url) as anyone:
            pool = anyone.info().pool
        children = _children(coord.pid)
        writers = [c for c in children if _comm(c) == "swarmrl-writer"]
        workers = [coord.pid, *(c for c in children if c not in writers)]
        assert len(workers) == 2 and len(writers) == 1, [_comm(c) for c in children]

        async def scenario() -> None:
            conns = [await Connection.open("127.0.0.1", port) for _ in range(32)]
            by_worker: dict[int, list[Connection]] = {}
            for conn in conns:
                await conn.request("GET", "/v1/info")  # accepted and answered: its worker holds it
                client_port = conn.writer.get_extra_info("sockname")[1]
                by_worker.setdefault(_serving_pid(port, client_port, workers), []).append(conn)
            assert sorted(by_worker) == sorted(workers), "the kernel gave every connection to one worker"
            a, b = (by_worker[w][0] for w in workers)
            node = Identity.generate()
            challenge = await _post(a, node, pool, "/v1/register/challenge", None,
                                    {"public_key": node.public_key_hex})
            await _post(b, node, pool, "/v1/register", m.KIND_REGISTER,
                        {"challenge": challenge["challenge"], "engine": "torch", "name": "n"})
            lease = m.Lease.model_validate(await _post(a, node, pool, "/v1/lease", m.KIND_LEASE,
                                                       {"held_version": 0, "max_prompts": 2}))
            sub = submission(lease).model_copy(update={"next_lease": m.LeaseRequest(max_prompts=1)})
            result = m.SubmitResult.model_validate(await _post(b, node, pool, "/v1/submit", m.KIND_SUBMIT,
                                                               sub.model_dump(mode="json")))
            assert sorted(result.accepted) == sorted(p.prompt_id for p in lease.prompts)
            assert result.next_lease is not None
            # b granted that lease: its submission to b is written by the writer process. While the writer is
            # stopped it waits (it cannot finish early, however fast); once the writer runs, it is taken.
            nxt = submission(result.next_lease).model_copy(update={"next_lease": m.LeaseRequest(max_prompts=1)})
            key = new_idempotency_key()
            beat = canonical_json({"held_version": 0, "idle_s": 1.0, "busy_s": 2.0})
            os.kill(writers[0], signal.SIGSTOP)
            try:
                pending = asyncio.ensure_future(_post(b, node, pool, "/v1/submit", m.KIND_SUBMIT,
                                                      nxt.model_dump(mode="json"), key))
                heartbeat = asyncio.ensure_future(a.request("POST", "/v1/heartbeat", beat, {
                    "content-type": "application/json",
                    SIGNATURE_HEADER: sign(node, m.KIND_HEARTBEAT, pool, beat).header()}))
                done, _ = await asyncio.wait([pending, heartbeat], timeout=1.0)
                assert not done, "a submission or a heartbeat was not written by the writer"
            finally:
                os.kill(writers[0], signal.SIGCONT)
            assert (await heartbeat).status == 204
            first = await pending
            assert m.SubmitResult.model_validate(first).accepted == [result.next_lease.prompts[0].prompt_id]
            assert first["next_lease"] is not None
            # A retry (fresh signature, same key) after a lost answer gets the answer the writer stored.
            again = await _post(a, node, pool, "/v1/submit", m.KIND_SUBMIT, nxt.model_dump(mode="json"), key)
            assert again == first
            # Refusals on the path served on the event loop (a node b knows): a replayed heartbeat (the same
            # signature) and a submission naming a prompt twice; the connection stays usable.
            hb = {"content-type": "application/json",
                  SIGNATURE_HEADER: sign(node, m.KIND_HEARTBEAT, pool, beat).header()}
            assert (await b.request("POST", "/v1/heartbeat", beat, hb)).status == 204
            replayed = await b.request("POST", "/v1/heartbeat", beat, hb)
            assert replayed.status == 409 and b"replayed" in replayed.body
            twice = canonical_json(nxt.model_copy(update={"groups": [nxt.groups[0]] * 2}).model_dump(mode="json"))
            refused = await b.request("POST", "/v1/submit", twice, {
                "content-type": "application/json", SIGNATURE_HEADER: sign(node, m.KIND_SUBMIT, pool, twice).header()})
            assert refused.status == 422 and b"appears twice" in refused.body
            assert (await b.request("POST", "/v1/heartbeat", beat, {
                "content-type": "application/json",
                SIGNATURE_HEADER: sign(node, m.KIND_HEARTBEAT, pool, beat).header()})).status == 204
            for conn in conns:
                conn.close()

        asyncio.run(scenario())
        with CoordinatorClient(url, operator) as op:
            st = op.status()
        assert st.groups_pending == 3 and st.nodes[0].prompts_leased == 4
        assert (st.nodes[0].idle_s, st.nodes[0].busy_s) == (1.0, 2.0)  # the heartbeat's
        # The writer ends: the whole coordinator stops, for its supervisor to restart it.
        os.kill(writers[0], signal.SIGKILL)
        assert coord.proc is not None
        coord.proc.wait(timeout=60)
    finally:
        coord.kill()
