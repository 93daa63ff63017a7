"""Checkpoint transfer: one way to move a signed checkpoint from the trainer to every node and verifier.

- `store`: content-addressed shards on disk, cutting a checkpoint into them, assembling one from them;
- `delta`: the lossless delta codec between two versions' weights files, and rebuilding a delta checkpoint from the
  base version held (every tensor checked against the signed hashes);
- `sources`: where shards come from, as a fetcher sees it (`ShardSource`), and the coordinator's HTTP origin;
- `schedule`: which shard to fetch next from which source, a pure function of a download's state;
- `download`: the threads that carry the schedule out (fetch, check, store, write into the files);
- `fetcher`: `CheckpointFetcher` (checks the signed manifest, resumes from disk, keeps N versions) and
  `FetchConfig` (the scheduling knobs, a role's `[fetch]`);
- `connect`: a node's or verifier's fetcher for a pool: the HTTP origin, plus the swarm when there is one;
- `p2p`: the libp2p swarm (hivemind DHT + streams) through which peers exchange shards;
- `seed`: the coordinator's DHT bootstrap peer, which seeds every published version.
"""
