"""The coordinator's SQLite settings (`CoordinatorConfig.sqlite`, TOML `[sqlite]`): none of them matters on
PostgreSQL. Their defaults are what bench/coordinator_load.py measured best (bench/RESULTS.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SqliteConfig(BaseModel):
    """How an SQLite store commits, and how the coordinator's threads and processes share its write lock."""

    model_config = ConfigDict(extra="forbid")

    group_commit: int = Field(
        64, ge=1, le=4096, description="Writes committed together at most, in one transaction with one fsync (each "
        "answered only after that commit); batches form only while a commit is in progress; 1: one commit per write.")
    realtime_committer: bool = Field(
        True, description="Run the committer thread (which holds the write lock) under real-time FIFO scheduling "
        "where the process may (Linux with CAP_SYS_NICE; elsewhere the log says it does not). "
        "(measured: bench/RESULTS.md)")
    request_nice: int = Field(
        5, ge=0, le=19, description="Nice steps the request threads run below the committer thread; 0: the same. "
        "(measured: bench/RESULTS.md)")
    writer_process: bool = Field(
        True, description="With workers > 1: one more process, the store's writer, commits every worker's "
        "submissions and heartbeats together (`coordinator.db.sqlite.writer`); other writes stay in their worker. "
        "(measured: bench/RESULTS.md)")
    writer_commit_interval_ms: float = Field(
        2.0, ge=0, le=100, description="The writer process commits at most once this often under load (an idle "
        "store commits at once); 0: as soon as the previous commit ends. (measured: bench/RESULTS.md)")

