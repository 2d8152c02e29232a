"""Bench only: every batched step takes a modelled GPU time t(b), so a CPU reproduces a GPU's schedule.

``engine.modelled_step_time: 14b | 5b`` wraps the built policy (``builder.py``) in
:class:`ModelledStepPolicy`: a step of ``b`` sessions runs for real, then sleeps the rest of t(b) (a step
that took longer than t(b) is not shortened: the reply's ``session.modelled_step_overrun`` says so). The
actions are the real ones; only time is modelled. The profiles come from the roofline in
``docs/performance.md``:

* ``14b``: t(1) = 0.61 s (vLLM-Omni's 611 ms per chunk, CFG-parallel on two H200s); compute-bound at full
  size (1.0 PFLOP a chunk), so b sessions cost b times one: t(b) = b t(1).
* ``5b``: t(1) = 0.15 s; a forward of 50 tokens per frame leaves the GPU waiting on its 11.2 GB of weights
  (18 DiT forwards at 4.8 TB/s: 42 ms, with VAE, encoders and launches about 0.15 s), so a batch adds
  little: t(b) = t(1) (1 + 0.1 (b - 1)).

``engine.modelled_step_t1_s`` replaces the profile's t(1) (e.g. with a measured one). The option is
refused at start-up unless the config says ``bench: true`` (``config.py``): a server that sleeps on
purpose must never serve robots by accident.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ardiff_kv import Branch, KVSpec, SessionKV
from ardiff_policies.base import Policy, StepResult
from ardiff_policies.info import PolicyInfo
from ardiff_policies.observation import RobotObservation


@dataclass(frozen=True, slots=True)
class StepTimeProfile:
    """t(b) = t1_s (1 + per_extra_session (b - 1)): seconds one step of ``b`` sessions takes."""

    name: str
    t1_s: float
    per_extra_session: float  # of t(1), what each session past the first adds

    def seconds(self, batch: int) -> float:
        if batch < 1:
            raise ValueError(f"a step holds at least one session, got {batch}")
        return self.t1_s * (1.0 + self.per_extra_session * (batch - 1))

    def formula(self) -> str:
        if self.per_extra_session == 1.0:
            return f"t(b) = b x {self.t1_s:g} s"
        return f"t(b) = {self.t1_s:g} s x (1 + {self.per_extra_session:g} (b - 1))"


PROFILES: dict[str, StepTimeProfile] = {
    "14b": StepTimeProfile("14b", 0.61, 1.0),
    "5b": StepTimeProfile("5b", 0.15, 0.1),
}


def step_time_profile(name: str, t1_s: float | None = None) -> StepTimeProfile:
    """The named profile, its t(1) replaced by ``t1_s`` when given."""
    if name not in PROFILES:
        raise ValueError(f"modelled step time profile: expected one of {sorted(PROFILES)}, got {name!r}")
    profile = PROFILES[name]
    return profile if t1_s is None else StepTimeProfile(profile.name, t1_s, profile.per_extra_session)


class ModelledStepPolicy(Policy):
    """``inner`` with every step lasting at least ``profile.seconds(batch size)``; everything else is ``inner``'s."""

    def __init__(
        self,
        inner: Policy,
        profile: StepTimeProfile,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.inner, self.profile = inner, profile
        self.clock, self.sleep = clock, sleep

    # The engine's interface, passed through.
    @property
    def info(self) -> PolicyInfo:
        return self.inner.info

    def kv_spec(self) -> KVSpec | None:
        return self.inner.kv_spec()

    @property
    def branches(self) -> tuple[Branch, ...]:
        return self.inner.branches

    def check_observation(self, observation: RobotObservation) -> None:
        self.inner.check_observation(observation)

    def start_session(self, session_id: str, kv: SessionKV | None) -> Any:
        return self.inner.start_session(session_id, kv)

    def prepare(self, session: Any, observation: RobotObservation) -> Callable[[], None] | None:
        return self.inner.prepare(session, observation)

    def agree(self, failed: Sequence[bool]) -> list[bool]:
        return self.inner.agree(failed)

    def end_session(self, session: Any) -> None:
        self.inner.end_session(session)

    def warmup_observations(self) -> Iterator[RobotObservation]:
        return self.inner.warmup_observations()

    def decode_prediction(self, predicted: Any):
        return self.inner.decode_prediction(predicted)

    def __getattr__(self, name: str) -> Any:  # a family's own methods (e.g. LingBot-VA's compute_kv_cache)
        return getattr(self.__dict__["inner"], name)

    # The one thing it changes.
    def step_batch(self, items: Sequence[tuple[Any, RobotObservation]]) -> list[StepResult | BaseException]:
        started = self.clock()
        results = self.inner.step_batch(items)
        real_s = self.clock() - started
        modelled_s = self.profile.seconds(len(items))
        self.sleep(max(0.0, modelled_s - real_s))
        for result in results:
            if isinstance(result, StepResult):
                result.info["modelled_step_ms"] = round(modelled_s * 1000.0, 3)
                result.info["real_step_ms"] = round(real_s * 1000.0, 3)
                result.info["modelled_step_overrun"] = real_s > modelled_s
        return results
