"""Settings of the zero-compute ``noop`` policy (torch-free: the front end validates them)."""

from __future__ import annotations

from typing import Literal

import pydantic


class NoopConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: Literal["noop"] = "noop"  # the zero-compute policy: actions of zeros
    action_horizon: int = pydantic.Field(24, ge=1)  # rows of the action chunk
    action_dim: int = pydantic.Field(8, ge=1)  # columns of the action chunk
    compute_ms: float = pydantic.Field(0.0, ge=0)  # simulated inference time (sleeps)
