"""The policy interface the session engine drives.

A policy is built once per worker process. The engine owns the KV cache: it opens a
:class:`ardiff_kv.SessionKV` per robot session and hands it to :meth:`Policy.start_session`; the policy
keeps whatever else a session needs (frame buffers, conditioning) in the object it returns.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import pydantic

from ardiff_kv import Branch, KVSpec, SessionKV
from ardiff_policies import registry
from ardiff_policies.batch_retry import single
from ardiff_policies.chunk import ChunkInfo
from ardiff_policies.errors import StartRefused  # noqa: F401 - where policies and workers import it from
from ardiff_policies.guidance import Guidance
from ardiff_policies.info import PolicyInfo
from ardiff_policies.observation import RobotObservation


@dataclass(frozen=True)
class RuntimeOptions:
    """Engine settings a policy needs to build itself."""

    device: str = "cpu"
    dtype: str = "float32"
    guidance: Guidance = field(default_factory=Guidance.single)  # which CFG branches run in this process
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile backend ("eager" checks graph capture only)
    cuda_graphs: bool = False
    record: bool = False  # fill StepResult.recording (server.record_dir)
    # How the engine sizes the KV pool (a policy's memory plan checks it before loading weights).
    max_sessions: int = 8
    kv_budget_gib: float | None = None
    kv_memory_fraction: float = 0.5
    max_batch: int = 1  # sessions per forward (engine.max_batch): KV scratch and activations scale with it


@dataclass
class ChunkRecording:
    """What a step saw and imagined, for session recordings (only when RuntimeOptions.record)."""

    canvas: np.ndarray  # (T, H, W, 3) uint8: the frames the model saw this call
    predicted: Any  # the policy's prediction of the chunk; Policy.decode_prediction turns it into frames
    raw_actions: np.ndarray  # (horizon, model action dim) before denormalization
    state: np.ndarray  # (state dim,) the raw state the actions are relative to


@dataclass
class StepResult:
    actions: np.ndarray  # (horizon, action_dim) float32
    timing_ms: dict[str, float]  # per phase, for the reply's policy_timing
    info: dict[str, Any] = field(default_factory=dict)  # diagnostics for the reply's session map, e.g. DiT forwards run, window position
    recording: ChunkRecording | None = None
    chunk: ChunkInfo = field(default_factory=ChunkInfo)  # what the reply says about its chunk (the protocol's keys)


S = TypeVar("S")


class Policy(abc.ABC, Generic[S]):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        # step() is the one-member case of step_batch(), defined here once; an override would be bypassed by the
        # engine (it always calls step_batch) and serve scripts something else than robots get.
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} overrides Policy.step: implement step_batch (step is its one-member case)")

    @property
    @abc.abstractmethod
    def info(self) -> PolicyInfo:
        """The metadata frame (RoboArena's PolicyServerConfig, or an embodiment's with ``observation_schema``) and ``/info``."""

    def kv_spec(self) -> KVSpec | None:
        """Pages the policy needs per session branch, or None if it keeps no KV."""
        return None

    @property
    def branches(self) -> tuple[Branch, ...]:
        """CFG branches this process runs (both, or one under CFG-parallel)."""
        return (Branch.COND,)

    def check_observation(self, observation: RobotObservation) -> None:  # noqa: B027 - optional hook
        """Raise :class:`ardiff_policies.observation.UnsupportedObservation` for an observation this policy
        cannot take. The engine calls it before any session state changes, so a bad observation
        is a ``bad request`` and never costs a robot its episode."""

    @abc.abstractmethod
    def start_session(self, session_id: str, kv: SessionKV | None) -> S: ...

    def prepare(self, session: S, observation: RobotObservation) -> Callable[[], None] | None:
        """This call's session-own work (e.g. a first call's text and image encodes), as a job the
        engine runs on its encoder thread while other robots' batched steps go on; None if the call
        has none. The job keeps what it made on the session for :meth:`step_batch` to use, and
        must not touch anything else the session shares (KV pages): the step still runs without it,
        doing that work itself (so a job that failed or was never run changes nothing but time).

        Called on the serving thread at admission, after :meth:`check_observation`; the session's
        state does not change until this call's step."""
        return None

    def agree(self, failed: Sequence[bool]) -> list[bool]:
        """Under CFG-parallel, which of these requests failed on *any* rank (a collective: every
        rank calls it with its own view), so that every rank drops the same ones. One process: as given."""
        return list(failed)

    @abc.abstractmethod
    def step_batch(self, items: Sequence[tuple[S, RobotObservation]]) -> list[StepResult | BaseException]:
        """One call (observation in, action chunk out) for each of several distinct sessions (at most
        ``engine.max_batch`` and ``info.max_batch``), results in order; a failed session's entry is its
        exception: the engine ends that session (and frees its KV), the others carry on, and that robot's
        next request starts a fresh one. A batched phase that fails is retried member by member before any
        member is failed (:func:`ardiff_policies.batch_retry.run_batched`): a session fails only for what
        fails when it is alone. An entry that is an :class:`~ardiff_policies.observation.UnsupportedObservation`
        is a refusal made before the session changed (what only the session's state can tell, e.g. a call out
        of its episode's order): the engine answers ``bad request`` and keeps the session.

        A policy that runs several sessions in one forward says how many in ``PolicyInfo.max_batch``; one that
        runs them one after another keeps ``max_batch`` 1 (the engine then never batches).

        Observation arrays are read-only views valid during this call only (they may live in shared memory):
        copy what the session keeps."""

    def step(self, session: S, observation: RobotObservation) -> StepResult:
        """One session's call: :meth:`step_batch` of one, its entry raised if it is an exception (scripts,
        tests, benchmarks; the engine always calls :meth:`step_batch`)."""
        return single(self.step_batch([(session, observation)]))

    def end_session(self, session: S) -> None:  # noqa: B027 - optional hook
        """Drop per-session model state. The engine closes the session's KV itself."""

    def warmup_observations(self) -> Iterator[RobotObservation]:
        """Synthetic observations that walk every shape a session goes through (engine warm-up)."""
        return iter(())

    def decode_prediction(self, predicted: Any) -> np.ndarray | None:
        """A recorded prediction as (T, H, W, 3) uint8 frames (None: the policy predicts no video).
        Runs on the recorder's thread, beside the steps (and the encoder thread's jobs): it must not
        wait for them nor touch state they use (on a GPU: its own stream, ``policies/streams.py``)."""
        return None


def build_policy(name: str, config: pydantic.BaseModel | dict, options: RuntimeOptions) -> Policy:
    entry = registry.policy_entry(name)
    model = entry.config_model()
    if not isinstance(config, model):
        config = model.model_validate(config)
    return entry.builder()(config, options)
