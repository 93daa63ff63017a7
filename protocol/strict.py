"""The base of the protocol's models: `Strict`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown fields are an error, not silently dropped: a sender learns its message was wrong."""

    model_config = ConfigDict(extra="forbid")
