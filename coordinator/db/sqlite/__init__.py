"""What makes SQLite fast for a coordinator on one machine, none of it used on PostgreSQL. The coordinator writes
through `Store.write` and `coordinator.db.writes.Writes` whatever the store; beyond those, only the server (which
starts the writer process) and the endpoints that plan a write's plain form for it (`RemoteCall`) name this folder.

- `groupcommit`: the writes that queue up during one commit's fsync are committed together, each in a savepoint
  of its own (`[sqlite] group_commit`);
- `shared`: several processes of one machine on one database file take turns at writing (a file lock) and see
  each other's changes; the write-ahead log is checkpointed by a thread of its own;
- `writer` and `asyncwriter`: with `workers` > 1, one more process, the store's writer, commits every server
  process's submissions and heartbeats (`writer_process`, `writer_commit_interval_ms`), called from each server
  process's event loop.

Their settings, `config.SqliteConfig` (`[sqlite]` in the coordinator's config), are defaulted to what
bench/coordinator_load.py measured best (bench/RESULTS.md); a deployment need not touch them.
"""
