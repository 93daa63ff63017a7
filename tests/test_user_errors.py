"""A user's mistake is one line that names the file or setting and says the fix, never a traceback (`--debug` shows
one): each mistake a new user made following the README, made again here through the real command line."""

from __future__ import annotations

import http.server
import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmrl.protocol.identity import Identity

REPO = Path(__file__).resolve().parents[1]
# Wide lines: a log line is not wrapped, so a test can find a whole sentence on one line.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}


def swarmrl(*args: str, cwd: Path, timeout: float = 180, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarmrl.cli", *args], cwd=cwd, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    """The error line `proc` ended with, after checking it failed without a traceback and that its last line (the
    message) holds every one of `words`."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    last = proc.stderr.strip().splitlines()[-1]
    for w in words:
        assert w in last, (w, out)
    return last


def output_until(proc: subprocess.Popen[str], marker: str) -> str:
    """What the running `proc` printed up to and including its first line holding `marker` (or all of it, when it
    ends first)."""
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            break
    return "".join(seen)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- config files -----------------------------------------------------------------------------------------------


def test_a_missing_config_file_is_named_with_the_fix_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    proc = swarmrl("verifier", "--config", "nowhere/verifier.toml", cwd=tmp_path)
    line = one_line_error(proc, "swarmrl verifier:", "nowhere/verifier.toml", "check the --config path")
    assert line.startswith("swarmrl verifier: no config file")
    debug = swarmrl("--debug", "verifier", "--config", "nowhere/verifier.toml", cwd=tmp_path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_a_config_that_is_not_toml_is_named_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "coordinator.toml"
    bad.write_text('port = 8470\nhost = \n')
    proc = swarmrl("coordinator", "--config", str(bad), cwd=tmp_path)
    one_line_error(proc, str(bad), "not valid TOML", "line 2", "fix that line")


def test_a_setting_that_moved_names_its_new_place(tmp_path: Path) -> None:
    old = tmp_path / "coordinator.toml"
    old.write_text("store_group_commit = 8\n")
    proc = swarmrl("coordinator", "--config", str(old), cwd=tmp_path)
    one_line_error(proc, "store_group_commit moved: write it as [sqlite] group_commit")


def test_a_bad_override_is_one_line(tmp_path: Path) -> None:
    proc = swarmrl("verifier", "--set", "batch", cwd=tmp_path)
    one_line_error(proc, "--set", "'batch'", "key=value")


# -- keys -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("problem", ["readable by others", "a directory"])
def test_a_key_file_that_cannot_be_used_says_how_to_fix_it(tmp_path: Path, problem: str) -> None:
    key = tmp_path / "verifier.key"
    if problem == "a directory":
        key.mkdir()
        words = [str(key), "is a directory", "set key_path to a file"]
    else:
        Identity.generate().save(key)
        os.chmod(key, 0o644)
        words = [str(key), "readable by others (mode 0o644)", f"chmod 600 {key}"]
    proc = swarmrl("verifier", "--set", f"key_path={key}", "--set", f"coordinator_url=http://127.0.0.1:{free_port()}",
                   cwd=tmp_path)
    one_line_error(proc, "swarmrl verifier:", *words)
    if problem == "a directory":
        assert not any(key.iterdir())  # nothing made inside it
    else:
        assert stat.S_IMODE(key.stat().st_mode) == 0o644  # left as it was: the user decides


# -- ports ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_a_coordinator_port_in_use_is_found_before_the_store_is_opened(tmp_path: Path, workers: int) -> None:
    with socket.socket() as taken:
        # Held as another coordinator holds it: with SO_REUSEPORT, which a second SO_REUSEPORT socket could share.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data = tmp_path / "coordinator"
        proc = swarmrl("coordinator", "--set", f"port={port}", "--set", f"data_dir={data}", "--set",
                       f"workers={workers}", cwd=tmp_path)
    one_line_error(proc, "swarmrl coordinator:", f"port {port} on 127.0.0.1 is in use", "set port to a free port")
    assert not list(data.glob("coordinator.sqlite*"))  # no migration ran on the store of the pool already there


def test_a_metrics_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = swarmrl("verifier", "--set", f"metrics_port={port}", "--set", f"key_path={tmp_path / 'v.key'}",
                       "--set", f"coordinator_url=http://127.0.0.1:{free_port()}", cwd=tmp_path)
    one_line_error(proc, "swarmrl verifier:", f"metrics_port {port} on 127.0.0.1 is in use",
                   "set metrics_port to a free port")


# -- the coordinator --------------------------------------------------------------------------------------------


def test_the_trainer_started_before_the_coordinator_waits_for_it_and_says_so(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "swarmrl.cli", "trainer", "--set", f"coordinator_url={url}",
                             "--set", f"key_path={tmp_path / 'trainer.key'}", "--set", "progress=false"],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = output_until(proc, "start the coordinator first")
        assert f"coordinator {url} unreachable" in out and "the trainer starts once it answers" in out, out
        # It made a key, and said so with what to do about it.
        assert "a new key was made there" in out and "operator_keys" in out, out
        assert proc.poll() is None, out  # still waiting
        assert "Traceback" not in out
    finally:
        proc.kill()
        proc.wait()


class _NotACoordinator(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"<!doctype html><html><body>Welcome to nginx!</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def web_page() -> Iterator[str]:
    """A URL where an ordinary web server answers every GET with an HTML page."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotACoordinator)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("role", ["verifier", "trainer", "node"])
def test_a_coordinator_url_that_points_at_something_else_is_one_line(tmp_path: Path, web_page: str,
                                                                     role: str) -> None:
    extra = ["--set", "progress=false", "--set", f"work_dir={tmp_path / 'work'}"] if role == "node" else []
    proc = swarmrl(role, "--set", f"coordinator_url={web_page}", "--set", f"key_path={tmp_path / 'k.key'}", *extra,
                   cwd=tmp_path)
    line = one_line_error(proc, f"swarmrl {role}:", f"{web_page} is not a swarmrl coordinator", "check coordinator_url")
    assert "Welcome to nginx" in line and "ValidationError" not in proc.stderr


def test_a_key_the_coordinator_does_not_list_stops_the_verifier_with_one_line(tmp_path: Path, run_factory) -> None:
    run = run_factory()
    key = tmp_path / "elsewhere" / "verifier.key"
    proc = swarmrl("verifier", "--set", f"coordinator_url={run.url}", "--set", f"key_path={key}", cwd=tmp_path)
    new_key = Identity.load(key)
    assert "a new key was made there" in proc.stderr and new_key.public_key_hex in proc.stderr, proc.stderr
    one_line_error(proc, "swarmrl verifier:", "does not list the verifier's key as an operator key", str(key),
                   new_key.public_key_hex, "add that public key to the coordinator's operator_keys")


# -- the setup script -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("setting", "value", "words"), [
    ("METRICS_PORT", "ninety", ["METRICS_PORT='ninety'", "not a port number", "set a free port"]),
    ("COORDINATOR_URL", "coordinator:8470", ["COORDINATOR_URL='coordinator:8470'", "http://127.0.0.1:8470"]),
    ("COORDINATOR_URL", "http://pool.example.org:8470", ["names pool.example.org", "pass --public"]),
    ("WARMUP_ACCURACY", "1.5", ["WARMUP_ACCURACY='1.5'", "[0, 1)"]),
    ("RUN_ID", "r" * 200, ["run.run_id", "at most 128 characters", "fix that setting"]),
])
def test_a_setup_setting_that_does_not_fit_is_one_line(tmp_path: Path, setting: str, value: str,
                                                        words: list[str]) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "docker" / "setup_pool.py"), str(tmp_path / "pool")],
                          env={**ENV, setting: value}, capture_output=True, text=True, timeout=120)
    one_line_error(proc, "setup_pool.py:", *words)
    assert proc.returncode == 2
    assert not (tmp_path / "pool" / "init").exists()  # refused before the model was built


def test_a_setup_directory_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    target = tmp_path / "pool"
    target.write_text("")
    proc = subprocess.run([sys.executable, str(REPO / "docker" / "setup_pool.py"), str(target)], env=ENV,
                          capture_output=True, text=True, timeout=120)
    one_line_error(proc, "setup_pool.py:", f"{target} is a file", "give setup_pool.py a directory")


def test_the_trainer_says_what_is_wrong_with_its_key_and_its_checkpoint(tmp_path: Path, run_factory,
                                                                        init_ckpt: Path) -> None:
    listed = tmp_path / "keys" / "listed.key"
    op = Identity.generate()
    op.save(listed)
    run = run_factory(op_key=op)
    common = ["--set", f"coordinator_url={run.url}", "--set", "progress=false", "--set", "eval_every=0",
              "--set", f"state_dir={tmp_path / 'state'}"]
    # A key the coordinator does not list: made, said so, then refused in one line before any work.
    new = tmp_path / "keys" / "trainer.key"
    proc = swarmrl("trainer", *common, "--set", f"key_path={new}", "--set", f"init_checkpoint={init_ckpt}",
                   cwd=tmp_path)
    one_line_error(proc, "swarmrl trainer:", "does not list the trainer's key as an operator key", str(new),
                   Identity.load(new).public_key_hex, "add that public key to the coordinator's operator_keys")
    assert "a new key was made there" in proc.stderr
    # A checkpoint path that is no directory here is never taken for a model hub's name.
    proc = swarmrl("trainer", *common, "--set", f"key_path={listed}", "--set", "init_checkpoint=mypool/init",
                   cwd=tmp_path)
    one_line_error(proc, "swarmrl trainer:", f"init_checkpoint {tmp_path / 'mypool' / 'init'} is not a checkpoint "
                   "directory", "fix init_checkpoint")
    assert "huggingface" not in (proc.stdout + proc.stderr).lower() and "new key" not in proc.stderr


def test_the_doctor_finds_a_metrics_port_another_role_holds() -> None:
    from swarmrl.node.config import NodeConfig
    from swarmrl.node.doctor import check_ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        checks = check_ports(NodeConfig(metrics_port=port, p2p={"enabled": False}))
    assert [(c.status, c.name) for c in checks] == [("FAIL", "ports")]
    assert f"metrics_port {port} on 127.0.0.1 cannot be used" in checks[0].detail
    assert "its own metrics_port" in checks[0].fix
    free = check_ports(NodeConfig(metrics_port=port, p2p={"enabled": False}))  # released: free again
    assert [c.status for c in free] == ["OK"] and f"metrics port {port} is free" in free[0].detail


def test_the_verifier_started_before_the_coordinator_says_the_start_order(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "swarmrl.cli", "verifier", "--set", f"coordinator_url={url}",
                             "--set", f"key_path={tmp_path / 'verifier.key'}"],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = output_until(proc, "start the coordinator first")
        assert f"coordinator {url} unreachable" in out and "the verifier checks groups once it answers" in out, out
        assert proc.poll() is None and "Traceback" not in out, out  # waiting, not stopped
    finally:
        proc.kill()
        proc.wait()


def test_the_doctor_and_the_ledger_say_when_a_url_is_not_a_coordinator(tmp_path: Path, web_page: str) -> None:
    from swarmrl.node.config import NodeConfig
    from swarmrl.node.doctor import check_coordinator

    [check] = check_coordinator(NodeConfig(coordinator_url=web_page))
    assert check.status == "FAIL" and f"{web_page} is not a swarmrl coordinator" in check.detail
    assert "Welcome to nginx" in check.detail and "validation error" not in check.detail.lower()
    proc = swarmrl("ledger", "--url", web_page, cwd=tmp_path)
    one_line_error(proc, "swarmrl ledger:", f"{web_page} is not a swarmrl coordinator", "check coordinator_url")
