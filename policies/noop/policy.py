"""A policy that computes nothing: constant actions, optional simulated compute time.

For wiring up a robot or an evaluator before a GPU is available, and for measuring the
server's own overhead (``scripts/bench_server.py``). Not a model: its actions are zeros.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ardiff_policies.base import Policy, RuntimeOptions, StepResult
from ardiff_policies.info import PolicyInfo, droid_server_config
from ardiff_policies.noop.config import NoopConfig
from ardiff_policies.observation import RobotObservation


class NoopPolicy(Policy[int]):
    def __init__(self, config: NoopConfig, options: RuntimeOptions) -> None:
        self.config = config

    @property
    def info(self) -> PolicyInfo:
        return PolicyInfo(droid_server_config(), self.config.action_horizon, self.config.action_dim, model="noop")

    def start_session(self, session_id: str, kv: None) -> int:
        return 0

    def step_batch(self, items: Sequence[tuple[int, RobotObservation]]) -> list[StepResult | BaseException]:
        return [self._chunk() for _ in items]  # info.max_batch 1: the engine sends one at a time

    def _chunk(self) -> StepResult:
        start = time.perf_counter()
        if self.config.compute_ms:
            time.sleep(self.config.compute_ms / 1000.0)
        actions = np.zeros((self.config.action_horizon, self.config.action_dim), dtype=np.float32)
        return StepResult(actions, {"compute": (time.perf_counter() - start) * 1000.0})


def build_noop(config: NoopConfig, options: RuntimeOptions) -> NoopPolicy:
    return NoopPolicy(config, options)
