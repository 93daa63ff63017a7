"""A pool in virtual time: `swarmrl simulate SCENARIO.toml` runs thousands of nodes for hours through the project's
own policy code (lease sizing and admission, the quarantine rule and the verifier's budget, the staleness rule,
backpressure, the transfer scheduler), on a virtual clock of its own (`sim.clock` says why not SimPy).
Nothing here opens a socket or sleeps.

- `scenario`: the TOML scenario, validated;
- `broadcast`: a checkpoint broadcast shard by shard, picked by `transfer.schedule.choose`;
- `desk`, `nodes`, `weights`, `pipeline`, `world`: the pool (coordinator's lease desk, nodes, their weights,
  verifiers and trainer);
- `figures`, `report`, `run`: what comes out, and the command;
- `validate`: the simulator against runs measured on the development machine (bench/simulate.py).
"""
