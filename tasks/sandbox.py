"""Run untrusted Python (model-written code) with no network, a bounded share of the machine, and no way out.

Each run is a fresh bubblewrap sandbox (`bwrap`):

- new user, PID, network, IPC, UTS and cgroup namespaces (`--unshare-all`): no network interface but a
  loopback of its own, so a connect to any host port, loopback included, is refused; nested user
  namespaces are disabled;
- a read-only view of the system directories Python needs (`/usr`, `/bin`, `/lib`, ...) and nothing else:
  no home directories, no data files (a program cannot read the tests it is scored by), no keys; the
  sandbox's own root, `/dev` and `/proc` are read-only too;
- a private, size-capped tmpfs at `/tmp` as the throwaway working directory;
- resource limits set by `prlimit` on the sandbox's processes: CPU seconds, address space, processes,
  file size, open files, no core dumps;
- a wall-clock limit: the whole sandbox is killed when it passes (`--die-with-parent` plus the PID
  namespace take every process in it down with bubblewrap), and output beyond a cap kills it too.

Processes are limited per user (RLIMIT_NPROC counts every task of a real user id, and the kernel does not
enforce it for root at all, uid mapping in a user namespace included: measured). So when the caller is
root, each run gets a user id of its own, unused by anyone, for its whole life: its process limit then
counts its own processes only, and it cannot read files private to the caller. A caller that is not root
runs the sandbox under its own id, with the process limit raised by the tasks it already runs.

A run's outcome is data (`RunResult`); only a sandbox that cannot work at all raises (`SandboxUnavailable`
when it is set up, `SandboxError` for a run), never the program's behaviour.
"""

from __future__ import annotations

import itertools
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
PYTHON_SEARCH_PATH = "/usr/bin:/usr/local/bin:/bin"
# bubblewrap's own tasks (the outer process and the namespace's init) count against the process limit too.
BWRAP_TASKS = 2
# Root callers give every run its own uid from this range (above any real account's id).
UID_BASE = 1_900_000_000
UID_SPAN = 100_000_000
MB = 1 << 20


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (bubblewrap or prlimit missing, user namespaces refused, no Python)."""


class SandboxError(RuntimeError):
    """A run failed for a reason of the sandbox's own, not of the program's."""


class SandboxConfig(BaseModel):
    """Limits of one sandboxed run, and the interpreter it uses."""

    model_config = ConfigDict(extra="forbid")

    wall_s: float = Field(10.0, gt=0, le=600, description="Wall-clock limit of one run, seconds.")
    cpu_s: int = Field(5, ge=1, description="CPU-time limit per process, seconds (SIGXCPU, then SIGKILL).")
    memory_mb: int = Field(512, ge=64, description="Address-space limit per process, MiB.")
    nproc: int = Field(16, ge=1, description="Processes and threads the program may have at once, itself "
                                             "included. Memory in all is at most nproc * memory_mb.")
    fsize_mb: int = Field(8, ge=1, description="Largest file the program may write, MiB (SIGXFSZ above).")
    nofile: int = Field(64, ge=16, description="Open file descriptors per process.")
    tmp_mb: int = Field(32, ge=1, description="Size of the throwaway /tmp working directory, MiB.")
    output_bytes: int = Field(1 << 16, ge=1024, description="stdout (and stderr) beyond this kills the run.")
    python: str | None = Field(None, description="Interpreter inside the sandbox (absolute path); None: the "
                               "system's python3 (standard library only). It must be readable by an "
                               "unprivileged user.")


@dataclass(frozen=True)
class RunResult:
    """What a sandboxed run did. `status`: `exited` (on its own; see `returncode`), `timeout` (killed at the
    wall-clock limit) or `output_limit` (killed for writing more than the cap)."""

    status: Literal["exited", "timeout", "output_limit"]
    returncode: int | None
    """Exit code; 128 + n: killed by signal n (SIGXCPU: the CPU limit, SIGXFSZ: file size; bubblewrap's init
    reports a signal death so). None: killed by us (see status)."""
    stdout: bytes
    stderr: bytes
    uid: int
    """The user id it ran as (root callers: its own)."""

    @property
    def ok(self) -> bool:
        return self.status == "exited" and self.returncode == 0

    @property
    def hit_limit(self) -> bool:
        """Stopped by a limit (time, output, CPU, file size), not by its own exit. A program that exits with a
        code above 128 itself is taken at its word: it only loses its own case."""
        return self.status != "exited" or self.returncode is None or not 0 <= self.returncode <= 128


class Sandbox:
    """Runs Python sources under `config`'s limits. Construction checks that a sandbox really works here
    (and raises SandboxUnavailable otherwise): nothing ever runs unsandboxed. Thread-safe."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.is_root = os.geteuid() == 0
        for tool in ("bwrap", "prlimit", *(("setpriv",) if self.is_root else ())):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(f"'{tool}' is not installed: model-written code is never run without a "
                                         "sandbox (apt-get install bubblewrap util-linux; scripts/install.sh does)")
        self.bwrap, self.prlimit, self.setpriv = shutil.which("bwrap"), shutil.which("prlimit"), shutil.which("setpriv")
        python = self.config.python or shutil.which("python3", path=PYTHON_SEARCH_PATH)
        if python is None or not Path(python).is_absolute():
            raise SandboxUnavailable(f"no python3 in {PYTHON_SEARCH_PATH} for the sandbox: set sandbox.python")
        self.python = python
        self._uids = itertools.count()
        self._uid_offset = (os.getpid() * 1000) % UID_SPAN
        self._lock = threading.Lock()
        probe = self.run("print(6 * 7)")
        if not probe.ok or probe.stdout != b"42\n":
            raise SandboxUnavailable(f"the sandbox does not work here ({probe.status}, exit {probe.returncode}): "
                                     f"{probe.stderr.decode(errors='replace')[-800:]}")

    def _next_uid(self) -> int:
        with self._lock:
            return UID_BASE + (self._uid_offset + next(self._uids)) % UID_SPAN

    def _binds(self) -> list[str]:
        args: list[str] = []
        for d in SYSTEM_DIRS:
            args += ["--ro-bind-try", d, d]
        prefix = Path(os.path.realpath(self.python)).parent.parent
        if not any(prefix.is_relative_to(d) for d in SYSTEM_DIRS):
            args += ["--ro-bind", str(prefix), str(prefix)]
        return args

    def _argv(self, program_fd: int, nproc: int) -> list[str]:
        c = self.config
        limits = [f"--cpu={c.cpu_s}:{c.cpu_s + 1}", f"--as={c.memory_mb * MB}", f"--nproc={nproc}",
                  f"--fsize={c.fsize_mb * MB}", f"--nofile={c.nofile}", "--core=0"]
        return [
            self.prlimit, *limits, "--", self.bwrap,
            *self._binds(),
            "--dev", "/dev", "--proc", "/proc",
            "--size", str(c.tmp_mb * MB), "--tmpfs", "/tmp",
            "--ro-bind-data", str(program_fd), "/sandbox/main.py",
            "--remount-ro", "/dev", "--remount-ro", "/",
            "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--chdir", "/tmp",
            self.python, "-I", "-S", "-B", "/sandbox/main.py",
        ]

    def run(self, source: str, stdin: bytes = b"", wall_s: float | None = None) -> RunResult:
        """Run `source` as a Python program with `stdin` as its input; returns what it did. `wall_s`: a wall-clock
        limit for this run, at most the config's (what is left of a per-rollout cap, say)."""
        c = self.config
        wall = c.wall_s if wall_s is None else max(0.0, min(wall_s, c.wall_s))
        if self.is_root:
            uid, nproc = self._next_uid(), c.nproc + BWRAP_TASKS
            # The run's own uid is set by setpriv, not by Popen(user=...): that would make Python fork() instead of
            # vfork(), copying the page tables of this whole process (a verifier holds models) for every run
            # (25 ms of system time per run from a 1 GiB process; bench/RESULTS.md).
            drop = [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        else:
            uid, nproc = os.getuid(), c.nproc + BWRAP_TASKS + _tasks_of(os.getuid())
            drop = []
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
        with tempfile.TemporaryFile() as program, tempfile.TemporaryFile() as written:
            program.write(source.encode("utf-8", errors="replace"))
            program.seek(0)
            written.write(stdin)
            written.flush()
            try:
                inp = open(f"/proc/self/fd/{written.fileno()}", "rb")  # a read-only stdin: nothing to write to
            except OSError as e:
                raise SandboxError(f"cannot reopen the input: {e}") from e
            try:
                proc = subprocess.Popen([*drop, *self._argv(program.fileno(), nproc)], stdin=inp,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(program.fileno(),),
                                        env=env, start_new_session=True)
            except OSError as e:
                raise SandboxError(f"cannot start the sandbox: {e}") from e
            finally:
                inp.close()
            try:
                status, out, err = _collect(proc, time.monotonic() + wall, c.output_bytes)
            finally:
                _kill_group(proc)
        return RunResult(status=status, returncode=None if status != "exited" else proc.returncode,
                         stdout=out, stderr=err, uid=uid)


def _collect(proc: subprocess.Popen[bytes], deadline: float,
             cap: int) -> tuple[Literal["exited", "timeout", "output_limit"], bytes, bytes]:
    """Read the run's stdout and stderr until both close and it exits, the deadline passes, or either
    stream exceeds `cap` bytes (then only `cap` bytes are kept)."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as sel:
        for stream in bufs:
            sel.register(stream, selectors.EVENT_READ)  # type: ignore[arg-type]
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr])
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]  # type: ignore[index]
                buf += chunk
                if len(buf) > cap:
                    del buf[cap:]
                    return "output_limit", bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr])
    try:
        proc.wait(max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return "timeout", bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr])
    return "exited", bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr])


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill prlimit/bwrap's process group; bwrap's death takes its PID namespace, the program's, with it."""
    if proc.returncode is None:  # not reaped yet, so its pid (the group's id) cannot have been reused
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _tasks_of(uid: int) -> int:
    """Tasks (processes and threads) that `uid` runs now: what RLIMIT_NPROC counts against it."""
    n = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = dict(line.split(":", 1) for line in Path(entry.path, "status").read_text().splitlines()
                          if line.startswith(("Uid:", "Threads:")))
            if int(status["Uid"].split()[0]) == uid:
                n += int(status["Threads"])
        except (OSError, KeyError, ValueError):
            continue  # gone meanwhile
    return n
