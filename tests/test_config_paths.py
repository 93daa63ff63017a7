"""Configs that run as the README shows on one machine: a path written in a config file is relative to that file, so
a role started from any directory finds its key, data and checkpoint; docker/setup_pool.py's configs give no two
roles one port and listen on loopback unless the pool goes public."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.server import running_server
from swarmrl.node.config import NodeConfig
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.runtime.config import load_config
from swarmrl.trainer.config import TrainerConfig
from swarmrl.verifier.config import VerifierConfig
from tests.support.pool_setup import setup_configs, setup_module

REPO = Path(__file__).resolve().parents[1]
MODELS = {"coordinator": CoordinatorConfig, "verifier": VerifierConfig, "trainer": TrainerConfig, "node": NodeConfig}


def test_a_path_in_a_config_file_is_relative_to_the_file_and_one_in_set_to_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "pool" / "config"
    conf.mkdir(parents=True)
    f = conf / "coordinator.toml"
    f.write_text('data_dir = "../coordinator"\nkey_path = "/etc/abs.key"\n[run]\nrun_id = "a/b"\n'
                 '[pool]\nidentity_path = "dht.key"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(CoordinatorConfig, Path("..") / "pool" / "config" / "coordinator.toml")
    assert cfg.data_dir == tmp_path / "pool" / "coordinator"  # nested tables too, and no "..": the file's dir
    assert cfg.pool is not None and cfg.pool.identity_path == conf / "dht.key"
    assert cfg.key_path == Path("/etc/abs.key")  # absolute: as written
    assert cfg.run.run_id == "a/b"  # a string that is not a path field: untouched
    over = load_config(CoordinatorConfig, f, ["data_dir=mine"])
    assert over.data_dir == Path("mine")  # a command-line path: relative to where the command runs


def test_setup_configs_give_each_role_its_own_port_on_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    pool = tmp_path / "pool"
    paths = setup_configs(pool, monkeypatch)
    cfgs = {role: load_config(MODELS[role], path) for role, path in paths.items()}
    assert cfgs["coordinator"].host == "127.0.0.1" and cfgs["coordinator"].port == 8470
    for role in ("verifier", "trainer", "node"):
        assert cfgs[role].coordinator_url == "http://127.0.0.1:8470"
        assert cfgs[role].metrics_port is None  # off: nothing to clash on one machine
    monkeypatch.setenv("METRICS_PORT", "9300")
    monkeypatch.setenv("COORDINATOR_URL", "http://127.0.0.1:9470")
    paths = setup_module().setup(pool)
    cfgs = {role: load_config(MODELS[role], path) for role, path in paths.items()}
    assert cfgs["coordinator"].port == 9470
    ports = {role: (cfgs[role].metrics_host, cfgs[role].metrics_port) for role in ("verifier", "trainer", "node")}
    assert ports == {"verifier": ("127.0.0.1", 9300), "trainer": ("127.0.0.1", 9301), "node": ("127.0.0.1", None)}
    # In public nginx holds the strangers' connections (tests/test_reverse_proxy.py); the coordinator stays on
    # loopback, believes nginx's header, and the operator roles beside it reach it there.
    monkeypatch.setenv("COORDINATOR_URL", "https://pool.example.org")
    public = {role: load_config(MODELS[role], path) for role, path in setup_module().setup(pool, public=True).items()
              if role in MODELS}
    assert (public["coordinator"].host, public["coordinator"].port) == ("127.0.0.1", 8470)
    limits = public["coordinator"].rate_limits
    assert (limits.source_header, limits.trusted_proxies) == ("x-real-ip", ["127.0.0.1"])
    assert public["node"].coordinator_url == "https://pool.example.org"
    assert public["verifier"].coordinator_url == public["trainer"].coordinator_url == "http://127.0.0.1:8470"
    monkeypatch.delenv("METRICS_PORT")
    monkeypatch.delenv("COORDINATOR_URL")
    inside = setup_module().setup(pool, containers=True)
    cfgs = {role: load_config(MODELS[role], path) for role, path in inside.items()}
    assert cfgs["coordinator"].host == "0.0.0.0"  # one role per container: each has its own addresses
    for role in ("verifier", "trainer", "node"):
        assert (cfgs[role].metrics_host, cfgs[role].metrics_port) == ("0.0.0.0", 9100)
        assert cfgs[role].coordinator_url == "http://coordinator:8470"


def test_setup_configs_find_the_pools_keys_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    pool = tmp_path / "pool"
    paths = setup_configs(pool, monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    relative = {role: Path(os.path.relpath(path, elsewhere)) for role, path in paths.items()}
    cfgs = {role: load_config(MODELS[role], path) for role, path in relative.items()}
    assert cfgs["trainer"].init_checkpoint == pool / "init"
    assert cfgs["trainer"].state_dir == pool / "trainer" and cfgs["verifier"].work_dir == pool / "verifier"
    coordinator = cfgs["coordinator"]
    assert coordinator.data_dir == pool / "coordinator"
    with running_server(coordinator) as url:
        # The keys the operator roles load are the coordinator's operator keys: their requests are not refused.
        verifier = CoordinatorClient(url, Identity.load(cfgs["verifier"].key_path), retries=0)
        assert verifier.pending(limit=1) == []
        trainer = CoordinatorClient(url, Identity.load(cfgs["trainer"].key_path), retries=0)
        assert trainer.training_batch(after_id=0, limit=1).groups == []
    assert not list(elsewhere.iterdir())  # nothing made where the roles were started


def test_pydantic_errors_are_formatted_in_one_place() -> None:
    from pydantic import BaseModel, ValidationError

    from swarmrl.protocol.pydantic_errors import describe_validation_error

    class M(BaseModel):
        a: int
        b: int
        c: int

    with pytest.raises(ValidationError) as caught:
        M.model_validate({"a": "x", "b": "y", "c": "z"})
    said = describe_validation_error(caught.value, limit=2)
    assert said == ("a: Input should be a valid integer, unable to parse string as an integer; "
                    "b: Input should be a valid integer, unable to parse string as an integer; ... and 1 more")
    assert describe_validation_error([{"loc": (), "msg": "bad"}], root="header") == "header: bad"
    assert describe_validation_error([{"loc": ("k",), "msg": "m"}], hint=lambda err: "better") == "k: better"
    # Nowhere else does code take pydantic's messages out of its error list to word them.
    by_hand = []
    for folder in ("protocol", "runtime", "coordinator", "node", "verifier", "trainer", "pools", "swarmrl", "docker",
                   "tasks", "transfer", "models", "testing"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            if path.name != "pydantic_errors.py" and any(f"{w}{q}msg{q}" in text for w in ("[", "get(") for q in "'\""):
                by_hand.append(str(path.relative_to(REPO)))
    assert by_hand == []
