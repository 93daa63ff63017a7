"""Checkpoint transfer: one way to move a signed checkpoint from the trainer to every node and verifier.

- `store`: content-addressed shards on disk, cutting a checkpoint into them, assembling one from them;
- `sources`: where shards come from, as a fetcher sees it (`ShardSource`), and the coordinator's HTTP origin;
- `fetcher`: `CheckpointFetcher`, which checks the signed manifest and every shard and resumes from disk;
- `p2p`: the libp2p swarm (hivemind DHT + streams) through which peers exchange shards;
- `seed`: the coordinator's DHT bootstrap peer, which seeds every published version.
"""
