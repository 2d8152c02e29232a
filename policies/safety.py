"""The safety gate: a chunk's actions checked against limits before they leave the server (torch-free).

Off by default; configured per served embodiment under ``policy.safety`` (its action keys by name). Three checks,
per dimension of an action key:

* ``first``: the chunk's first action against the observed state of the same key (``max_first_step``);
* ``step``: each action against the one before it (``max_step``);
* ``velocity``: that step times the control rate (``max_velocity``, units per second at ``control_hz``).

``clamp`` limits the actions (a rate limiter: each action moves at most the limit from the one before it as
clamped, so a clamped chunk catches up with the model's at the limit) and reports which checks clamped, how many
values and by how much at most. ``reject`` refuses the chunk with one line naming the check, the key and dimension,
the value and the limit: a :class:`SafetyRejected` (an ``UnsupportedObservation``: the engine answers ``bad
request`` and keeps the session, which the policy rolls back to before the call).

A continuation's frozen rows (``frozen`` leading actions, ``ardiff_policies.continuation``) were already sent to the
robot: clamp never alters them and reject never blames them; the step from the last frozen row to the first free
one is checked like any other. Only position keys can be gated (an action key with a state key of the same name
and width, absolute or made absolute by the policy): a step between velocities or deltas has no meaning, and such a
key in ``policy.safety.limits`` is refused at start-up by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pydantic

from ardiff_policies.errors import StartRefused
from ardiff_policies.observation import UnsupportedObservation

Mode = Literal["off", "clamp", "reject"]
CHECKS = ("first", "step", "velocity")
LIMIT_FIELDS = {"first": "max_first_step", "step": "max_step", "velocity": "max_velocity"}
# The control rate of embodiments whose rate is known (DROID: 15 Hz); others give policy.safety.control_hz.
KNOWN_CONTROL_HZ = {"oxe_droid": 15.0}
REJECT_PREFIX = "safety gate: "  # every reject's message starts so (the front end counts them by check)
_TOLERANCE = 1e-6  # float32 actions: a value at its limit is within it


class KeyLimits(pydantic.BaseModel):
    """Limits of one action key, the same for each of its dimensions (None: not checked)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    max_first_step: float | None = pydantic.Field(None, gt=0, description="|first action - observed state|")
    max_step: float | None = pydantic.Field(None, gt=0, description="|action - previous action|")
    max_velocity: float | None = pydantic.Field(None, gt=0, description="|action - previous action| * control_hz, per second")


class SafetyConfig(pydantic.BaseModel):
    """``policy.safety``: the gate before a chunk leaves the server (``ardiff_policies.safety``)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    mode: Mode = pydantic.Field("off", description="off, clamp (limit the actions, say so in the reply) or reject (a bad request, the session kept)")
    control_hz: float | None = pydantic.Field(
        None, gt=0, description="the robot's control rate for max_velocity (default: the embodiment's, oxe_droid 15)"
    )
    limits: dict[str, KeyLimits] = pydantic.Field(
        default_factory=dict, description="per action key (the metadata's action split names): max_first_step, max_step, max_velocity"
    )

    @pydantic.model_validator(mode="after")
    def _check_limits(self) -> SafetyConfig:
        if self.mode != "off" and not any(v is not None for limits in self.limits.values() for v in limits.model_dump().values()):
            raise ValueError(f"mode {self.mode} needs limits: policy.safety.limits.<action key>.max_first_step / max_step / max_velocity")
        return self


class SafetyRejected(UnsupportedObservation):
    """A chunk outside the gate's limits (mode reject). The session is as before the call."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(REJECT_PREFIX + f"{check}: {message}")
        self.check = check


def rejected_check(message: str) -> str | None:
    """The check a reject's message names (``SafetyRejected``), else None: the front end counts rejects by it."""
    if not message.startswith(REJECT_PREFIX):
        return None
    check = message[len(REJECT_PREFIX) :].split(":", 1)[0]
    return check if check in CHECKS else None


@dataclass(frozen=True)
class _Key:
    """One gated action key: its reply columns, its state columns, its limits."""

    name: str
    columns: tuple[int, int]
    state: tuple[int, int]
    limits: KeyLimits


class SafetyGate:
    """The checks for one embodiment's action keys. Build with :meth:`build` (None when the gate is off)."""

    def __init__(self, config: SafetyConfig, keys: tuple[_Key, ...], control_hz: float | None) -> None:
        self.config = config
        self.mode = config.mode
        self.keys = keys
        self.control_hz = control_hz

    @classmethod
    def build(
        cls,
        config: SafetyConfig,
        *,
        embodiment: str,
        actions: Mapping[str, tuple[int, int]],
        states: Mapping[str, tuple[int, int]],
    ) -> SafetyGate | None:
        """The gate for an embodiment's action and state columns (name -> (start, stop)), or None when off. Raises
        :class:`StartRefused` naming the ``policy.safety`` key that cannot apply to this embodiment."""
        if config.mode == "off":
            return None
        keys = []
        for name, limits in config.limits.items():
            where = f"policy.safety.limits.{name}"
            if name not in actions:
                raise StartRefused(f"{where}: embodiment {embodiment} has no action key {name!r}; its action keys are {list(actions)}")
            start, stop = actions[name]
            state = states.get(name)
            if state is None or state[1] - state[0] != stop - start:
                raise StartRefused(
                    f"{where}: embodiment {embodiment}'s {name!r} is not a position (no state key of that name and width), "
                    f"so its first action, steps and velocity have nothing to be checked against; leave it out of policy.safety.limits"
                )
            keys.append(_Key(name, (start, stop), state, limits))
        control_hz = config.control_hz or KNOWN_CONTROL_HZ.get(embodiment)
        if control_hz is None and any(k.limits.max_velocity is not None for k in keys):
            raise StartRefused(f"policy.safety.control_hz: embodiment {embodiment} has no known control rate; give the robot's (Hz) for max_velocity")
        return cls(config, tuple(keys), control_hz)

    def describe(self) -> dict[str, Any]:
        """The gate's settings for ``GET /info``."""
        return {
            "mode": self.mode,
            "control_hz": self.control_hz,
            "limits": {k.name: k.limits.model_dump(exclude_none=True) for k in self.keys},
            "checks": {"first": "first action vs observed state", "step": "action vs previous action", "velocity": "step x control_hz"},
            "frozen_rows": "never altered by clamp, never blamed by reject",
        }

    def apply(self, actions: np.ndarray, state: np.ndarray, *, frozen: int = 0) -> tuple[np.ndarray, dict[str, Any]]:
        """The chunk as it may leave (clamp: limited; rows ``[:frozen]`` as they were) and the reply's ``safety``
        entry ``{mode, clamped: {check: {values, max_excess, first_at}}}``. Raises :class:`SafetyRejected` (reject)."""
        out = np.array(actions, dtype=np.float64)
        clamped: dict[str, dict[str, Any]] = {}
        for key in self.keys:
            self._apply_key(key, out, np.asarray(state, dtype=np.float64), frozen, clamped)
        return out.astype(actions.dtype, copy=False), {"mode": self.mode, "clamped": clamped}

    def _apply_key(self, key: _Key, out: np.ndarray, state: np.ndarray, frozen: int, clamped: dict[str, dict[str, Any]]) -> None:
        a0, a1 = key.columns
        s0, s1 = key.state
        limits = key.limits
        step_limit = self._step_limit(limits)
        for row in range(frozen, out.shape[0]):
            if row == 0:
                if limits.max_first_step is None:
                    continue
                check, limit, previous = "first", limits.max_first_step, state[s0:s1]
            else:
                if step_limit is None:
                    continue
                check, limit = step_limit
                previous = out[row - 1, a0:a1]
            delta = out[row, a0:a1] - previous
            size = np.where(np.isfinite(delta), np.abs(delta), np.inf)
            over = size > limit + _TOLERANCE
            if not over.any():
                continue
            dim = int(np.argmax(np.where(over, size, -1.0)))
            if self.mode == "reject":
                raise SafetyRejected(check, self._describe(check, key, dim, row, float(size[dim]), limit))
            # Clamp: a non-finite value holds the previous one; the others move at most the limit towards the model's.
            out[row, a0:a1] = previous + np.where(np.isfinite(delta), np.clip(delta, -limit, limit), 0.0)
            entry = clamped.setdefault(check, {"values": 0, "max_excess": 0.0, "first_at": f"{key.name}[{dim}] action {row}"})
            entry["values"] += int(over.sum())
            entry["max_excess"] = max(entry["max_excess"], float(np.max(size[over]) - limit))

    def _step_limit(self, limits: KeyLimits) -> tuple[str, float] | None:
        """The binding limit between consecutive actions: max_step or max_velocity / control_hz, whichever is smaller."""
        candidates = []
        if limits.max_step is not None:
            candidates.append(("step", limits.max_step))
        if limits.max_velocity is not None:
            candidates.append(("velocity", limits.max_velocity / self.control_hz))
        return min(candidates, key=lambda c: c[1]) if candidates else None

    def _describe(self, check: str, key: _Key, dim: int, row: int, size: float, limit: float) -> str:
        where = f"(policy.safety.limits.{key.name}.{LIMIT_FIELDS[check]})"
        channel = f"{key.name}[{dim}]"
        if check == "first":
            return f"{channel}: the first action is {size:.4g} from the observed state, limit {limit:.4g} {where}"
        if check == "step":
            return f"{channel}: action {row} moves {size:.4g} from action {row - 1}, limit {limit:.4g} {where}"
        hz = self.control_hz
        return f"{channel}: action {row} moves at {size * hz:.4g}/s from action {row - 1} at {hz:g} Hz, limit {limit * hz:.4g}/s {where}"
