"""The code sandbox against each way out: network, files outside, fork bombs, endless loops, output floods,
memory bombs; and the `code` task's reward on right, wrong and hostile programs. The test process plays the
verifier: it must come through every one of them and go on scoring.

Needs bubblewrap (scripts/install.sh installs it): these tests fail, not skip, without it, because a
verifier without a sandbox refuses code tasks.
"""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from swarmrl.protocol.tasks import TaskSpec, load_task
from swarmrl.tasks.code import CodeTask, extract_program, same_output
from swarmrl.tasks.sandbox import Sandbox, SandboxConfig, SandboxUnavailable

LIMITS = SandboxConfig(wall_s=3.0, cpu_s=2, memory_mb=256, nproc=8, output_bytes=4096)


@pytest.fixture(scope="module")
def box() -> Sandbox:
    assert shutil.which("bwrap"), "bubblewrap is not installed (scripts/install.sh installs it)"
    return Sandbox(LIMITS)


def run(box: Sandbox, source: str, stdin: bytes = b""):
    return box.run(textwrap.dedent(source), stdin)


def _uid_processes(uid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def assert_contained(box: Sandbox, result) -> None:
    """Nothing of the run is left, the machine still starts processes, and the sandbox still works."""
    if result.uid != os.getuid():  # root callers: the run had a uid of its own, which must now own nothing
        deadline = time.monotonic() + 60  # the kernel tears the PID namespace down asynchronously
        while _uid_processes(result.uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _uid_processes(result.uid) == []
    assert subprocess.run(["true"]).returncode == 0
    again = box.run("print(sum(range(10)))")
    assert again.ok and again.stdout == b"45\n"


def test_a_program_runs_and_reads_stdin(box):
    r = run(box, "import sys; print(sum(int(x) for x in sys.stdin.read().split()))", b"1 2 3\n")
    assert r.ok and r.stdout == b"6\n" and not r.hit_limit
    r = run(box, "raise SystemExit(3)")
    assert r.status == "exited" and r.returncode == 3 and not r.ok


def test_network_is_refused(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        r = run(box, f"""
            import socket
            for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("10.0.0.1", 80)]:
                try:
                    socket.create_connection(addr, timeout=2).close()
                    print("connected", addr)
                except OSError as e:
                    print("refused", type(e).__name__)
            """)
        assert r.ok, r.stderr
        lines = r.stdout.decode().splitlines()
        assert len(lines) == 3 and all(line.startswith("refused") for line in lines), lines
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody reached the host's loopback
    finally:
        server.close()
    assert_contained(box, r)


def test_files_outside_are_untouched(box, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    host_probe = Path("/usr/swarmrl-sandbox-probe")
    r = run(box, f"""
        import os
        for path in [{str(victim)!r}, "/usr/swarmrl-sandbox-probe", "/sandbox/main.py", "/escape", "/dev/escape"]:
            try:
                with open(path, "w") as f:
                    f.write("pwned")
                print("wrote", path)
            except OSError as e:
                print("denied", path, type(e).__name__)
        open("scratch.txt", "w").write("mine")  # the working directory is writable, and thrown away
        print("cwd", os.getcwd(), open("scratch.txt").read())
        """)
    assert r.ok, r.stderr
    out = r.stdout.decode()
    assert "wrote" not in out and out.count("denied") == 5, out
    assert "cwd /tmp mine" in out
    assert victim.read_text() == "original"
    assert not host_probe.exists()
    # The next run starts from an empty directory.
    again = run(box, "import os; print(os.listdir('.'))")
    assert again.stdout == b"[]\n"
    assert_contained(box, r)


def test_host_files_are_not_even_readable(box, tmp_path):
    secret = tmp_path / "tests.jsonl"  # e.g. the code task's data, with the expected outputs
    secret.write_text("expected output")
    r = run(box, f"""
        for path in [{str(secret)!r}, "/etc/passwd", "/root", "/home"]:
            try:
                print("read", path, open(path).read()[:10])
            except OSError as e:
                print("hidden", path, type(e).__name__)
        """)
    assert r.ok, r.stderr
    assert "read" not in r.stdout.decode() and r.stdout.decode().count("hidden") == 4


def test_no_nested_namespaces(box):
    # A fresh user namespace would be a way to more privileges (and to more kernel attack surface).
    r = run(box, "import ctypes\nprint(ctypes.CDLL(None, use_errno=True).unshare(0x10000000), ctypes.get_errno())")
    assert r.ok, r.stderr
    rc, errno = map(int, r.stdout.split())
    assert rc == -1 and errno != 0


def test_process_limit_holds(box):
    r = run(box, """
        import os, time
        n = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            n += 1
        print(n)
        """)
    assert r.ok, r.stderr
    assert int(r.stdout) < LIMITS.nproc  # itself included: at most nproc - 1 children
    assert_contained(box, r)  # the sleeping children went down with the sandbox


def test_fork_bomb_is_contained(box):
    r = run(box, """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """)
    assert r.hit_limit and not r.ok
    assert_contained(box, r)


def test_infinite_loop_is_killed(box):
    r = run(box, "while True:\n    pass\n")
    assert r.hit_limit and not r.ok  # CPU limit (SIGXCPU) or wall clock, whichever comes first here
    r = run(box, "import time\nwhile True:\n    time.sleep(1)\n")
    assert r.status == "timeout"  # uses no CPU: only the wall clock stops it
    assert_contained(box, r)


def test_output_flood_is_capped(box):
    r = run(box, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    assert r.status == "output_limit" and len(r.stdout) <= LIMITS.output_bytes
    r = run(box, "import sys\nwhile True:\n    sys.stderr.write('y' * 65536)\n")
    assert r.status == "output_limit" and len(r.stderr) <= LIMITS.output_bytes
    assert_contained(box, r)


def test_memory_bomb_is_stopped(box):
    r = run(box, "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n")
    assert not r.ok and b"MemoryError" in r.stderr
    r = run(box, "x = bytearray(8 << 30)\n")
    assert not r.ok and b"MemoryError" in r.stderr
    assert_contained(box, r)


def test_big_files_are_stopped(box):
    r = run(box, "f = open('big', 'wb')\nwhile True:\n    f.write(bytes(1 << 20))\n")
    assert not r.ok  # SIGXFSZ at fsize_mb, or the tmpfs is full: either way the run fails
    assert_contained(box, r)


def test_no_sandbox_no_code(monkeypatch, tmp_path):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap" else real_which(name, *a, **k))
    with pytest.raises(SandboxUnavailable, match="bwrap"):
        Sandbox()
    sha = _write_problems(tmp_path)
    with pytest.raises(SandboxUnavailable, match="never run without a sandbox"):
        load_task(TaskSpec(name="code", options={"path": "p.jsonl", "sha256": sha}), data_dir=tmp_path)


# -- the code task ----------------------------------------------------------------------------------------------

CASES = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6\n"}, {"input": "0 0\n", "output": "0"}]
PROBLEMS = [{"prompt": "Read two integers from stdin and print their sum.", "tests": CASES}] + [
    {"prompt": f"Print {i}.", "tests": [{"input": "", "output": str(i)}]} for i in range(9)]


def _write_problems(d: Path) -> str:
    (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROBLEMS))
    return hashlib.sha256((d / "p.jsonl").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def code_task(tmp_path_factory) -> CodeTask:
    d = tmp_path_factory.mktemp("code")
    sha = _write_problems(d)
    task = load_task(TaskSpec(name="code", options={"path": "p.jsonl", "sha256": sha,
                                                    "sandbox": LIMITS.model_dump()}), data_dir=d)
    assert isinstance(task, CodeTask)
    return task


ANSWER = json.dumps(CASES, sort_keys=True, separators=(",", ":"))
SOLUTION = "a, b = map(int, input().split())\nprint(a + b)\n"
RIGHT = f"Here you go:\n```python\n{SOLUTION}```\n"


def test_code_reward_right_wrong_and_partial(code_task):
    assert code_task.reward(RIGHT, ANSWER) == 1.0 and code_task.is_correct(RIGHT, ANSWER)
    assert code_task.reward("a, b = map(int, input().split())\nprint(a - b + 1)", ANSWER) == 0.0
    partial = "a, b = map(int, input().split())\nprint(a + b if a != 10 else 0)"
    assert code_task.reward(partial, ANSWER) == pytest.approx(2 / 3)
    assert not code_task.is_correct(partial, ANSWER)
    assert code_task.reward("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)", ANSWER) == 0.0
    assert code_task.reward("", ANSWER) == 0.0
    assert code_task.reward("this is not python", ANSWER) == 0.0


HOSTILE = {
    "loop": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "flood": "while True:\n    print('5' * 10000)\n",
    # Prints the right answer only if it reached the network (a port that listens on the host) or wrote outside
    # its directory.
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n" + SOLUTION,
    "write outside": "open('/usr/x', 'w').write('x')\n" + SOLUTION,
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_completions_score_zero_and_scoring_goes_on(code_task, name):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        completion = HOSTILE[name].replace("{port}", str(server.getsockname()[1]))
        assert code_task.reward(completion, ANSWER) == 0.0
    assert code_task.reward(RIGHT, ANSWER) == 1.0


def test_code_data_and_split(code_task):
    held = {p.prompt for p in code_task.eval_set()}
    assert len(held) == 1
    import random
    rng = random.Random(0)
    drawn = {code_task.sample(rng).prompt for _ in range(100)}
    assert drawn and not drawn & held
    p = next(p for p in [*code_task.eval_set(), *code_task._train] if p.prompt.startswith("Read two"))
    assert json.loads(p.answer) == CASES


def test_program_extraction_and_output_comparison():
    assert extract_program("x\n```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("```python\nprint(4)\n") == "print(4)\n"  # cut off before the closing fence
    assert extract_program("print(5)") == "print(5)"
    assert same_output(b"5  \n\n", "5\n") and same_output(b"a\nb\n", "a \nb")
    assert not same_output(b"5\n6\n", "5\n") and not same_output(b" 5\n", "5")
