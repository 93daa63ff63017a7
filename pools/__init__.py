"""Public compute pools in the hivemind DHT: coordinators announce signed pool records, nodes find and judge them.

- `config`: where the DHT is (bootstrap peers from config or SWARMRL_BOOTSTRAP), what a coordinator announces;
- `records`: the DHT key, and the validator that keeps forged pool records out of the DHT peers we run;
- `announce`: `PoolAnnouncer`, a coordinator's thread that refreshes its signed record every ttl/3;
- `discover`: `list_pools` reads the records and returns the valid ones and the refusals, with reasons;
- `trust`: `PoolTrust`, a node's pins (a pool's key, pinned on first join) and the newest sequence numbers seen.

The record and the rule that refuses one are the protocol's (`swarmrl.protocol.pools`). Importing `records`,
`announce` or `discover` imports hivemind (and torch): a few seconds.
"""
