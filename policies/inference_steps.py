"""Per-request denoising steps, one rule for every policy (torch-free: the wire, the configs and both families read it).

A request may ask for other denoising steps than the deployment's: opt-in, never changed by the server on its own,
within bounds the deployment sets. The keys are the ones each family's upstream config names its step counts with:

* ``num_inference_steps``: DreamZero's denoising steps (video and actions on one schedule); LingBot-VA's video loop;
* ``action_num_inference_steps``: LingBot-VA's action loop (DreamZero has no separate one: it refuses the key).

A policy says which keys it takes and their bounds in ``PolicyInfo.inference_steps`` (key -> :class:`StepBounds`);
the wire decodes a key only for a policy that takes it (``ardiff_server.wire.fields.decode_inference_steps``: any
other is refused by name) and the policy checks the bounds (:func:`check_steps`) before any session state changes,
the message naming the setting that sets them. The default bounds are 1 to the configured count (fewer steps, never
more); a deployment's ``request_*`` setting widens them, to at most :data:`MAX_INFERENCE_STEPS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ardiff_policies.observation import RobotObservation, UnsupportedObservation

# The DiTs' timesteps are integers in [0, 1000) (both families' schedulers are set on 1000 training steps): more steps
# than that repeat noise levels.
MAX_INFERENCE_STEPS = 1000
VIDEO_STEPS_KEY = "num_inference_steps"
ACTION_STEPS_KEY = "action_num_inference_steps"
STEP_KEYS = (VIDEO_STEPS_KEY, ACTION_STEPS_KEY)  # RobotObservation's attributes of the same names


@dataclass(frozen=True)
class StepBounds:
    """[low, high] steps a request may ask for, and the setting that sets them (named in a refusal)."""

    low: int
    high: int
    setting: str  # e.g. "policy.request_inference_steps"

    def describe(self) -> dict[str, Any]:
        return {"min": self.low, "max": self.high, "setting": self.setting}


def bounds_setting(setting: str, value: tuple[int, int] | None) -> tuple[int, int] | None:
    """A config's ``request_*`` bounds: [min, max] with 1 <= min <= max <= MAX_INFERENCE_STEPS (ValueError naming it)."""
    if value is None:
        return None
    low, high = value
    if not 1 <= low <= high <= MAX_INFERENCE_STEPS:
        raise ValueError(f"{setting}: expected [min, max] with min <= max <= {MAX_INFERENCE_STEPS}, got [{low}, {high}]")
    return (low, high)


def step_bounds(requested: tuple[int, int] | None, configured: int, setting: str) -> StepBounds:
    """The bounds a deployment takes: its ``request_*`` setting, else 1 to the configured count."""
    low, high = requested if requested is not None else (1, configured)
    return StepBounds(low, high, f"policy.{setting}")


def check_steps(key: str, steps: Any, bounds: StepBounds) -> None:
    """A request's ``key`` within ``bounds`` (UnsupportedObservation naming the key, the bound and its setting)."""
    if type(steps) is not int:
        raise UnsupportedObservation(f"{key}: expected an integer, got {steps!r}")
    if not bounds.low <= steps <= bounds.high:
        side = f"below the minimum {bounds.low}" if steps < bounds.low else f"above the maximum {bounds.high}"
        raise UnsupportedObservation(f"{key}: {steps} is {side} this server takes ({bounds.setting}: [{bounds.low}, {bounds.high}])")


def check_observation_steps(observation: RobotObservation, taken: Mapping[str, StepBounds]) -> None:
    """Every step key the observation carries: one the policy takes (``taken``, its ``PolicyInfo.inference_steps``)
    and within its bounds; a key it does not take is refused by name (the wire refuses it first; this is for callers
    in process)."""
    for key in STEP_KEYS:
        steps = getattr(observation, key)
        if steps is None:
            continue
        if key not in taken:
            raise UnsupportedObservation(f"{key}: this policy takes no per-request {key}; leave it out")
        check_steps(key, steps, taken[key])


def requested_steps(observation: RobotObservation, key: str, configured: int) -> int:
    """The steps a call runs: the request's ``key``, else the configured count."""
    steps = getattr(observation, key)
    return configured if steps is None else steps
