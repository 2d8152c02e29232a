"""A small deterministic policy for server tests (loaded by the worker as a config plugin).

It keeps real KV state (one committed page per call, through the same ``kv`` session API as
DreamZero), so page accounting is exercised, and its actions encode what the engine saw:

    actions[0, 0] = calls in this session so far (1, 2, ...)
    actions[0, 1] = joint_position[0] of this request
    actions[0, 2] = a hash of the session id (so mixed-up replies are detectable)

``prompt`` controls behaviour: "explode" raises inside the step; "refuse" refuses the call in the
step before the session changes (an ``UnsupportedObservation``); "sleep:<seconds>" computes
slowly; "die" kills the worker process; "encode:<seconds>" gives a session's first call that much
session-own work (``prepare``: the engine runs it on its encoder thread; the step does it itself
if it did not run).
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pydantic

from ardiff_kv import Branch, KVSpec, SessionKV
from ardiff_policies.base import Policy, RuntimeOptions, StepResult
from ardiff_policies.batch_retry import one_by_one
from ardiff_policies.info import PolicyInfo, droid_server_config
from ardiff_policies.observation import RobotObservation, UnsupportedObservation
from ardiff_policies.registry import register_policy


class FakeConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = "fake"
    delay_s: float = 0.0
    window_pages: int = 4
    fail_start: bool = False  # raise while the worker builds the policy (start-up failure tests)
    max_batch: int = 1  # what info.max_batch claims; batch members still run one after another
    continuations: bool = False  # what info.continuations claims (the front end then takes a request's continuation; the step ignores it)


@dataclass
class FakeSession:
    session_id: str
    kv: SessionKV
    calls: int = 0
    encoded: bool = False  # its first call's session-own work is done


def session_tag(session_id: str) -> float:
    return float(zlib.crc32(session_id.encode()) % 10_000)


class FakePolicy(Policy[FakeSession]):
    def __init__(self, config: FakeConfig, options: RuntimeOptions) -> None:
        self.config = config

    @property
    def info(self) -> PolicyInfo:
        return PolicyInfo(
            droid_server_config(),
            action_horizon=4,
            action_dim=8,
            model="fake",
            max_batch=self.config.max_batch,
            continuations=self.config.continuations,
        )

    def kv_spec(self) -> KVSpec:
        return KVSpec(num_layers=1, num_heads=1, head_dim=8, page_size=4, window_pages=self.config.window_pages, max_new_pages=1)

    @property
    def branches(self) -> tuple[Branch, ...]:
        return (Branch.COND,)

    def start_session(self, session_id: str, kv: SessionKV | None) -> FakeSession:
        return FakeSession(session_id, kv)

    def prepare(self, session: FakeSession, observation: RobotObservation):
        if session.calls or not observation.prompt.startswith("encode:"):
            return None

        def encode() -> None:
            time.sleep(float(observation.prompt.split(":", 1)[1]))
            session.encoded = True

        return encode

    def step_batch(self, items: Sequence[tuple[FakeSession, RobotObservation]]) -> list[StepResult | BaseException]:
        return one_by_one(items, lambda item: self._step(*item))  # batch members run one after another

    def _step(self, session: FakeSession, observation: RobotObservation) -> StepResult:
        prompt = observation.prompt
        delay = self.config.delay_s
        if prompt.startswith("encode:") and not session.encoded:  # its first call's encode did not run beforehand
            time.sleep(float(prompt.split(":", 1)[1]))
            session.encoded = True
        if prompt.startswith("sleep:"):
            delay = float(prompt.split(":", 1)[1])
        if prompt == "refuse":
            raise UnsupportedObservation(f"session {session.session_id} cannot take this call now")
        ctx = session.kv.begin_forward(Branch.COND, num_video_tokens=4, commit=True)
        ctx.prepare()
        if prompt == "explode":
            raise RuntimeError("fake policy exploded on purpose")
        if prompt == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(delay)
        session.kv.complete(Branch.COND)
        session.calls += 1
        actions = np.zeros((4, 8), dtype=np.float32)
        joints = observation.joint_position if observation.joint_position is not None else np.zeros(7)
        actions[0, :3] = [session.calls, joints[0], session_tag(session.session_id)]
        return StepResult(actions, {"compute": delay * 1000.0}, {"resident_pages": len(session.kv.branch(Branch.COND).resident)})

    def warmup_observations(self):
        yield RobotObservation(prompt="warm up")


@register_policy("fake", FakeConfig)
def build_fake(config: FakeConfig, options: RuntimeOptions) -> FakePolicy:
    if config.fail_start:
        raise RuntimeError("fake policy refused to start")
    return FakePolicy(config, options)
