"""The policy interface the session engine drives, and the registry configs name policies by.

A policy is built once per worker process. The engine owns the KV cache: it opens a
:class:`kv.SessionKV` per robot session and hands it to :meth:`Policy.start_session`; the policy
keeps whatever else a session needs (frame buffers, conditioning) in the object it returns.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import pydantic

from kv import Branch, KVSpec, SessionKV
from policies.cfg_parallel import CFGGroup
from policies.observation import RobotObservation


@dataclass(frozen=True)
class RuntimeOptions:
    """Engine settings a policy needs to build itself."""

    device: str = "cpu"
    dtype: str = "float32"
    cfg: CFGGroup = field(default_factory=CFGGroup.single)
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile backend ("eager" checks graph capture only)
    cuda_graphs: bool = False


@dataclass
class StepResult:
    actions: np.ndarray  # (horizon, action_dim) float32
    timing_ms: dict[str, float]  # per phase, for the reply's policy_timing
    info: dict[str, Any] = field(default_factory=dict)  # e.g. DiT forwards run, window position


S = TypeVar("S")


def droid_server_config(image_resolution: tuple[int, int] = (180, 320)) -> dict[str, Any]:
    """RoboArena's ``PolicyServerConfig`` for a DROID joint-position policy (the metadata frame)."""
    return {
        "image_resolution": list(image_resolution),
        "needs_wrist_camera": True,
        "n_external_cameras": 2,
        "needs_stereo_camera": False,
        "needs_session_id": True,
        "action_space": "joint_position",
    }


class Policy(abc.ABC, Generic[S]):
    @property
    @abc.abstractmethod
    def metadata(self) -> dict[str, Any]:
        """The frame sent to every client on connect (RoboArena's PolicyServerConfig and more)."""

    def kv_spec(self) -> KVSpec | None:
        """Pages the policy needs per session branch, or None if it keeps no KV."""
        return None

    @property
    def branches(self) -> tuple[Branch, ...]:
        """CFG branches this process runs (both, or one under CFG-parallel)."""
        return (Branch.COND,)

    @abc.abstractmethod
    def start_session(self, session_id: str, kv: SessionKV | None) -> S: ...

    @abc.abstractmethod
    def step(self, session: S, observation: RobotObservation) -> StepResult:
        """One call: observation in, action chunk out. Raising leaves the session unusable; the
        engine then ends it (and frees its KV) and the next request starts a fresh one."""

    def end_session(self, session: S) -> None:  # noqa: B027 - optional hook
        """Drop per-session model state. The engine closes the session's KV itself."""

    def warmup_observations(self) -> Iterator[RobotObservation]:
        """Synthetic observations that walk every shape a session goes through (engine warm-up)."""
        return iter(())


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class PolicyEntry:
    config_model: type[pydantic.BaseModel]
    build: Callable[[Any, RuntimeOptions], Policy]


_REGISTRY: dict[str, PolicyEntry] = {}


def register_policy(name: str, config_model: type[pydantic.BaseModel]) -> Callable:
    def decorator(build: Callable[[Any, RuntimeOptions], Policy]) -> Callable:
        _REGISTRY[name] = PolicyEntry(config_model, build)
        return build

    return decorator


# Built-in policies are imported on first use (DreamZero pulls in transformers and diffusers).
_BUILTIN = {"dreamzero": "policies.dreamzero.policy", "noop": "policies.noop"}


def policy_entry(name: str) -> PolicyEntry:
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        raise KeyError(f"unknown policy {name!r}; available: {sorted(set(_REGISTRY) | set(_BUILTIN))}")
    return _REGISTRY[name]


def build_policy(name: str, config: pydantic.BaseModel | dict, options: RuntimeOptions) -> Policy:
    entry = policy_entry(name)
    if not isinstance(config, entry.config_model):
        config = entry.config_model.model_validate(config)
    return entry.build(config, options)

