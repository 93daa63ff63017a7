"""The verifier's config."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field


class VerifierConfig(BaseModel):
    """Everything `swarmrl verifier` needs. Load from TOML with `protocol.config.load_config`."""

    coordinator_url: str = Field("http://127.0.0.1:8470", description="The coordinator to verify for.")
    key_path: Path = Field(Path("verifier.key"), description="Operator identity; its key must be in the "
                           "coordinator's operator_keys.")
    work_dir: Path = Field(Path("verifier-data"), description="Checkpoints fetched for checking are kept here.")
    task: str = Field("addition3", description="Task whose reward is recomputed.")
    batch: int = Field(64, ge=1, description="Pending groups claimed per poll.")
    poll_interval_s: float = Field(0.2, gt=0, description="Wait between polls when nothing is pending.")
