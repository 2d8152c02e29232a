"""A policy that computes nothing: constant actions, optional simulated compute time.

For wiring up a robot or an evaluator before a GPU is available, and for measuring the
server's own overhead (``scripts/bench_server.py``). Not a model: its actions are zeros.
"""

from __future__ import annotations

import time
from typing import Literal

import numpy as np
import pydantic

from policies.base import Policy, RuntimeOptions, StepResult, droid_server_config, register_policy
from policies.observation import RobotObservation


class NoopConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: Literal["noop"] = "noop"
    action_horizon: int = pydantic.Field(24, ge=1)
    action_dim: int = pydantic.Field(8, ge=1)
    compute_ms: float = pydantic.Field(0.0, ge=0)  # simulated inference time (sleeps)


class NoopPolicy(Policy[int]):
    def __init__(self, config: NoopConfig, options: RuntimeOptions) -> None:
        self.config = config

    @property
    def metadata(self) -> dict:
        shape = [self.config.action_horizon, self.config.action_dim]
        return {**droid_server_config(), "action_shape": shape, "model": "noop"}

    def start_session(self, session_id: str, kv: None) -> int:
        return 0

    def step(self, session: int, observation: RobotObservation) -> StepResult:
        start = time.perf_counter()
        if self.config.compute_ms:
            time.sleep(self.config.compute_ms / 1000.0)
        actions = np.zeros((self.config.action_horizon, self.config.action_dim), dtype=np.float32)
        return StepResult(actions, {"compute": (time.perf_counter() - start) * 1000.0})


@register_policy("noop", NoopConfig)
def build_noop(config: NoopConfig, options: RuntimeOptions) -> NoopPolicy:
    return NoopPolicy(config, options)
