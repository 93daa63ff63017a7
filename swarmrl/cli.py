"""`swarmrl`: one command, a subcommand per role.

    swarmrl coordinator --config coordinator.toml --set port=8470
    swarmrl node --set coordinator_url=http://pool.example:8470
    swarmrl node --pool NAME          (or: swarmrl node doctor --pool NAME)
    swarmrl pool list --json
    swarmrl ledger --url http://pool.example:8470 --csv
    swarmrl ledger --verify node-data/receipts.jsonl --coordinator-key HEX
    swarmrl demo --report report.json
    swarmrl demo --config examples/math-qwen2/swarm.toml --set data_dir=examples/math-qwen2

Every role takes `--config FILE.toml` and any number of `--set dotted.key=value` overrides, and
`--print-config` shows the resolved config without running.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

from swarmrl.runtime.lifetime import (
    Terminated,
    die_with_parent_if_asked,
    exit_now,
    interrupt_on_sigterm,
    sigterm_received,
)

_SET_EXAMPLES = {"coordinator": "port=8000", "trainer": "lr=0.001", "verifier": "sample_rate=1.0",
                 "node": "engine.kind=torch", "demo": "engine=torch", "pool": "pool=NAME"}
"""A `--set` that each command's config takes, for its --help."""


def _role_args(p: argparse.ArgumentParser, example: str = "engine.kind=torch") -> None:
    p.add_argument("--config", type=Path, help="TOML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a config field (repeatable), e.g. --set {example}")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")


def _load(model: type, args: argparse.Namespace) -> Any:
    from swarmrl.runtime.config import dump_toml, load_config

    cfg = load_config(model, args.config, args.overrides)  # a ConfigError: one message, no traceback (main)
    if args.print_config:
        print(dump_toml(cfg), end="")
        sys.exit(0)
    return cfg


def _single_thread() -> None:
    # A local swarm shares a few cores between several processes: one thread each avoids thrashing.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers follows it: no "Loading weights" / "Writing model shards" bars per checkpoint in every log.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def cmd_coordinator(args: argparse.Namespace) -> None:
    from swarmrl.coordinator.config import CoordinatorConfig

    try:
        from swarmrl.coordinator.server import serve
    except ImportError as e:  # fastapi, uvicorn, sqlalchemy...: the coordinator's own extra
        sys.exit(f"swarmrl coordinator: {e}; the coordinator side installs with pip install 'swarmrl[coordinator]'")

    serve(_load(CoordinatorConfig, args))


def cmd_trainer(args: argparse.Namespace) -> None:
    _single_thread()
    from swarmrl.trainer.config import TrainerConfig

    cfg = _load(TrainerConfig, args)  # a wrong config is said before the trainer's imports take their seconds
    from swarmrl.trainer.loop import run_trainer

    run_trainer(cfg, check_model=None if cfg.check_engine == "off" else _model_check(cfg.check_engine))


def _model_check(engine: str):  # noqa: ANN202 - trainer.loop.ModelCheck
    """The trainer's start-up check: the run's model through `engine` (as nodes run it) and the verifier's checks,
    probed with the run's own task prompts (`swarmrl.compat.check_model`)."""

    def check(ckpt: Path, spec) -> str | None:  # noqa: ANN001 - protocol.run.RunSpec
        import random

        from swarmrl.compat import check_model, engine_kinds
        from swarmrl.protocol.tasks import load_task

        task, rng = load_task(spec.task), random.Random(0)
        logging.getLogger("swarmrl.trainer").info("checking that the verifier replays %s through the %s engine at "
                                                  "T = %g", ckpt.name, engine, spec.sampling.temperature)
        return check_model(ckpt, spec, engine_kinds(engine), prompts=[task.sample(rng).prompt for _ in range(4)])

    return check


def cmd_verifier(args: argparse.Namespace) -> None:
    _single_thread()
    from swarmrl.verifier.config import VerifierConfig

    cfg = _load(VerifierConfig, args)
    from swarmrl.verifier.service import Verifier

    Verifier(cfg).run()


def cmd_node(args: argparse.Namespace) -> None:
    _single_thread()
    import json

    from swarmrl.node.config import NodeConfig
    from swarmrl.node.quietlogs import route_engine_logs
    from swarmrl.node.refusal import PermanentRefusal

    route_engine_logs()  # before vLLM is imported: its logs print above the live panel, not into it
    if args.pool:
        args.overrides.append(f"pool={json.dumps(args.pool)}")
    if args.bootstrap:
        args.overrides.append(f"pools.initial_peers={json.dumps(args.bootstrap)}")
    cfg = _load(NodeConfig, args)
    if args.action == "doctor":
        from swarmrl.node.doctor import report, run_checks

        checks = run_checks(cfg)
        Console(highlight=False).print(report(checks))
        sys.exit(1 if any(c.status == "FAIL" for c in checks) else 0)
    from swarmrl.node.runner import run_node
    from swarmrl.pools.errors import PoolChoiceError, PoolLookupError

    try:
        run_node(cfg)
    except PermanentRefusal as e:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]node stopped for good:[/] {e}")
        sys.exit(2)
    except (PoolChoiceError, PoolLookupError, ConnectionError) as e:  # no such pool, no DHT, coordinator not found
        sys.exit(f"swarmrl node: {e}")


def cmd_pool(args: argparse.Namespace) -> None:
    from swarmrl.node.config import NodeConfig
    from swarmrl.poolcmd import list_command

    list_command(_load(NodeConfig, args), bootstrap=args.bootstrap, as_json=args.json)


def cmd_ledger(args: argparse.Namespace) -> None:
    from swarmrl.ledgercmd import ledger_command

    ledger_command(args.url, args.node, args.csv, args.verify, args.coordinator_key, args.run_id)


def cmd_keys(args: argparse.Namespace) -> None:
    from swarmrl.protocol.identity import Identity

    path = Path(args.path)
    if args.action == "make":
        if path.exists() and not args.force:
            sys.exit(f"{path} exists; pass --force to replace it")
        ident = Identity.generate()
        ident.save(path)
    else:
        ident = Identity.load(path)
    print(f"node id     {ident.node_id}\npublic key  {ident.public_key_hex}\nfile        {path}")


_MODEL_FIELDS = {"hidden": "hidden_size", "layers": "num_layers", "heads": "num_heads", "kv_heads": "num_kv_heads",
                 "head_dim": "head_dim", "intermediate": "intermediate_size", "max_positions": "max_positions",
                 "stop_rate": "stop_rate", "seed": "seed"}


def cmd_model(args: argparse.Namespace) -> None:
    _single_thread()
    from swarmrl.modelcmd import DEFAULT_BPE_VOCAB, build_checkpoint
    from swarmrl.models.build import ModelConfig
    from swarmrl.protocol.tasks import TaskSpec

    given = {field: getattr(args, arg) for arg, field in _MODEL_FIELDS.items() if getattr(args, arg) is not None}
    bpe_vocab = DEFAULT_BPE_VOCAB
    if args.vocab is not None:
        if args.tokenizer == "bpe":
            bpe_vocab = args.vocab
        else:
            given["vocab_size"] = args.vocab  # the char tokenizer's 16 tokens, embedding padded to this
    try:
        cfg = ModelConfig.preset(args.size, arch=args.arch, **given)
    except ValueError as e:
        sys.exit(f"swarmrl model: {e}")
    build_checkpoint(Path(args.out), cfg, args.tokenizer, bpe_vocab=bpe_vocab, warmup_accuracy=args.warmup_accuracy,
                     task=TaskSpec(name=args.task))


def cmd_demo(args: argparse.Namespace) -> None:
    _single_thread()
    from swarmrl.demo import DemoConfig, run_demo

    cfg = _load(DemoConfig, args)
    if args.report:
        cfg.report = args.report
    run_demo(cfg)


def main(argv: list[str] | None = None) -> None:
    interrupt_on_sigterm()  # SIGTERM stops a command as Ctrl-C does, cleaning up what it started
    die_with_parent_if_asked()
    parser = argparse.ArgumentParser(prog="swarmrl", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a user error too (a wrong path "
                        "or setting is otherwise said in one line, with its fix)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_ in [
        ("coordinator", cmd_coordinator, "run a pool's coordinator (HTTP API, SQLite, manifest signing)"),
        ("trainer", cmd_trainer, "run the GRPO trainer that publishes checkpoints"),
        ("verifier", cmd_verifier, "run the verifier that checks every submitted group"),
        ("node", cmd_node, "join a pool as a worker node"),
        ("demo", cmd_demo, "a whole swarm on this machine, end to end: 3-digit addition by default, or the run, "
                           "model and task of a run config (--config)"),
    ]:
        p = sub.add_parser(name, help=help_)
        _role_args(p, _SET_EXAMPLES[name])
        p.set_defaults(fn=fn)
        if name == "demo":
            p.add_argument("--report", type=Path, help="write a JSON report here")
    pk = sub.add_parser("keys", help="make or show an Ed25519 identity")
    pk.add_argument("action", choices=["make", "show"])
    pk.add_argument("path", help="key file (written 0600)")
    pk.add_argument("--force", action="store_true", help="replace an existing key file")
    pk.set_defaults(fn=cmd_keys)
    pn = sub.choices["node"]
    pn.add_argument("action", nargs="?", choices=["doctor"], help="doctor: check this machine and the pool, say what "
                    "to fix, and exit (1 if anything must be fixed)")
    pn.add_argument("--pool", metavar="NAME", help="join the public pool of this name, found in the pools' DHT "
                    "(NAME@KEYPREFIX when several keys claim NAME); same as --set pool=NAME")
    pn.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                    help="a bootstrap peer of the pools' DHT (repeatable), as `pool list` takes it; same as --set "
                    "pools.initial_peers=[...]; default: the config's, else the SWARMRL_BOOTSTRAP environment variable")
    pp = sub.add_parser("pool", help="public pools announced in the DHT")
    pp.add_argument("action", choices=["list"])
    _role_args(pp, _SET_EXAMPLES["pool"])
    pp.add_argument("--json", action="store_true", help="print JSON (the signed records and the refusals)")
    pp.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                    help="a bootstrap peer of the pools' DHT (repeatable); default: pools.initial_peers from the node "
                    "config, else the SWARMRL_BOOTSTRAP environment variable")
    pp.set_defaults(fn=cmd_pool)
    pl = sub.add_parser("ledger", help="the contribution ledger: a coordinator's (--url), or a node's receipts "
                                       "checked offline against the pool's key (--verify)")
    pl.add_argument("--url", help="the coordinator's base URL, e.g. http://pool.example:8470")
    pl.add_argument("--node", metavar="NODE_ID", help="only this node (with --verify: every receipt must be issued "
                    "to it)")
    pl.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    pl.add_argument("--verify", type=Path, metavar="RECEIPTS_JSONL", help="check a node's receipts file (e.g. "
                    "node-data/receipts.jsonl) offline; exit status 1 if any line is not a valid receipt")
    pl.add_argument("--coordinator-key", metavar="HEX", help="the pool's coordinator public key (for --verify)")
    pl.add_argument("--run-id", metavar="RUN", help="with --verify: every receipt must be of this run (default: the "
                    "run of the first valid receipt; the run is printed)")
    pl.set_defaults(fn=cmd_ledger)
    pm = sub.add_parser("model", help="build a checkpoint of any supported architecture and size (default: the tiny "
                                      "adder, warmed up to a target accuracy)")
    pm.add_argument("out", help="output checkpoint directory (Hugging Face layout)")
    pm.add_argument("--arch", default="llama",
                    help="architecture: llama, qwen2, qwen3, mistral, phi3, gemma2, gpt2, opt")
    pm.add_argument("--size", default="tiny", help="preset size: tiny (0.86M adder), mini, small30m")
    pm.add_argument("--tokenizer", choices=["char", "bpe"], default="char",
                    help="char: the addition alphabet; bpe: a byte-level BPE trained here, with a ChatML template")
    pm.add_argument("--vocab", type=int, help="BPE vocabulary size (default 8192); with char, embedding rows")
    for arg in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "max_positions"):
        pm.add_argument(f"--{arg.replace('_', '-')}", type=int, help=f"override the preset's {_MODEL_FIELDS[arg]}")
    pm.add_argument("--stop-rate", type=float, help="make the stop tokens about this likely per token (random model)")
    pm.add_argument("--warmup-accuracy", type=float, default=None,
                    help="warm start on the task to this accuracy; default 0.25 with the char tokenizer, none with "
                         "bpe; 0 skips it")
    pm.add_argument("--task", default="addition", help="task of the warm start (a registered task name)")
    pm.add_argument("--seed", type=int, default=None, help="seed of the weights (and of the BPE corpus)")
    pm.set_defaults(fn=cmd_model)
    from swarmrl.sim.run import add_parser as add_simulate

    add_simulate(sub)

    args = parser.parse_args(argv)
    # Logs go to stderr, so that what a command prints (e.g. `pool list --json`) is all there is on stdout.
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(name)s: %(message)s",
                        handlers=[RichHandler(console=Console(stderr=True), show_time=True, show_path=False,
                                              rich_tracebacks=True)])
    for noisy in ("httpx", "vllm", "hivemind", "urllib3", "transformers", "alembic.runtime.plugins"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        args.fn(args)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: what it stopped was cleaned up on the way out; no traceback
        terminated = isinstance(e, Terminated)
        Console(stderr=True).print("terminated" if terminated else "interrupted")
        if terminated:
            exit_now(143)  # cleaned up: the interpreter's own teardown would only delay the exit by seconds
        sys.exit(130)
    except _user_errors() as e:  # the user's to fix: the message says what and how; --debug adds the traceback
        if args.debug:
            raise
        sys.exit(f"swarmrl {args.command}: {e}")
    if sigterm_received():  # a command that stopped by itself on SIGTERM (the node) and cleaned up on the way
        exit_now(0)


def _user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that are a user's mistake (a path, a setting, a start order), each with a message that says
    the fix."""
    from swarmrl.protocol.identity import IdentityError
    from swarmrl.runtime.config import ConfigError
    from swarmrl.runtime.errors import UserError

    return (UserError, ConfigError, IdentityError)


if __name__ == "__main__":
    main()
