"""How one batched DreamZero step runs its phases: per-call state, failure isolation, CFG-rank agreement.

A step (:meth:`DreamZeroPolicy.step_batch`) is a sequence of phases over the batch's calls.
Per-session phases run call by call (:func:`run_each`); batched phases run over many calls at
once (:func:`run_phase`) and, if one raises, are retried member by member so only the members
that fail alone lose their call (:mod:`ardiff_policies.batch_retry`). Under CFG-parallel both ranks
agree on every outcome, one byte per call (``agree``: the policy's ``Guidance.agree``), so a failure
on one rank never leaves the other waiting in a collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ardiff_kv import Branch
from ardiff_policies.base import StepResult
from ardiff_policies.batch_retry import Agree, OtherRankFailed, run_batched
from ardiff_policies.dreamzero.session import DreamZeroSession
from ardiff_policies.observation import RobotObservation

if TYPE_CHECKING:
    from ardiff_policies.dreamzero.continuation import ContinuationPlan
    from ardiff_policies.wan.samplers import FlowUniPCSampler

# Marks the Call fields one denoise writes: each denoise (a retry too) starts from their defaults.
PER_DENOISE = {"per_denoise": True}


@dataclass
class Call:
    """One session's call inside a batched step: its inputs and what its phases made."""

    session: DreamZeroSession
    observation: RobotObservation
    slot: int  # its index in the batch: which scratch region its forwards write
    timing: dict[str, float] = field(default_factory=dict)
    events: dict[str, bool] = field(default_factory=dict)
    error: BaseException | None = None
    result: StepResult | None = None
    raw_state: np.ndarray | None = None
    steps: int = 0  # its denoising steps: the request's num_inference_steps, else the configured count
    video: torch.Tensor | None = None  # observed frames to encode (later calls)
    prefill_latents: torch.Tensor | None = None
    prefill_start: int = 0
    # denoise state: the chunk's latents and actions, samplers, the step cache's history (reset by start_denoise)
    latents: torch.Tensor | None = field(default=None, metadata=PER_DENOISE)
    actions: torch.Tensor | None = field(default=None, metadata=PER_DENOISE)
    state: torch.Tensor | None = field(default=None, metadata=PER_DENOISE)
    video_sampler: FlowUniPCSampler | None = field(default=None, metadata=PER_DENOISE)
    action_sampler: FlowUniPCSampler | None = field(default=None, metadata=PER_DENOISE)
    velocity: torch.Tensor | None = field(default=None, metadata=PER_DENOISE)
    action_velocity: torch.Tensor | None = field(default=None, metadata=PER_DENOISE)
    # last video velocities (the dynamic step cache compares them)
    history: list[torch.Tensor] = field(default_factory=list, metadata=PER_DENOISE)
    countdown: int = field(default=0, metadata=PER_DENOISE)
    forwards: int = field(default=0, metadata=PER_DENOISE)
    continuation: str | None = None  # a requested continuation: "applied" or why not (policies/continuation.py)
    plan: ContinuationPlan | None = None

    def add(self, phase: str, ms: float) -> None:
        self.timing[phase] = self.timing.get(phase, 0.0) + ms

    def start_denoise(self) -> None:
        """Every denoise field back to its default. A member retried alone after its batch's denoise failed
        part-way would otherwise carry on from that attempt's step-cache history, countdown and forward count."""
        for f in fields(self):
            if f.metadata.get("per_denoise"):
                setattr(self, f.name, f.default_factory() if f.default_factory is not MISSING else f.default)


Predictions = dict[Branch, tuple[torch.Tensor, torch.Tensor | None]]  # one call's forward: (video, action) per local branch


class LocalPredictions(NamedTuple):
    """One denoise step's predictions made on this rank, stacked over the calls that ran the DiT: what the CFG
    exchange sends (made before it, so a failure here is agreed before either rank joins a collective)."""

    video: dict[Branch, torch.Tensor]  # per local branch
    cond_action: torch.Tensor | None  # the conditional branch's action prediction, where it ran on this rank
    actions: torch.Tensor  # the calls' actions: the shape of the action prediction rank 0 broadcasts


def local_predictions(predictions: list[Predictions], calls: list[Call], branches: Sequence[Branch]) -> LocalPredictions:
    video = {branch: torch.cat([p[branch][0] for p in predictions]) for branch in branches}
    cond_action = torch.cat([p[Branch.COND][1] for p in predictions]) if Branch.COND in branches else None
    return LocalPredictions(video, cond_action, torch.cat([c.actions for c in calls]))


def live(calls: list[Call]) -> list[Call]:
    """The calls no phase has failed yet."""
    return [call for call in calls if call.error is None]


def run_each(calls: list[Call], phase: Callable[[Call], None], agree: Agree) -> None:
    """A per-session phase for each call; a call whose phase raised (on any CFG rank) fails."""
    errors: list[BaseException | None] = []
    for call in calls:
        try:
            phase(call)
            errors.append(None)
        except Exception as exc:
            errors.append(exc)
    for call, error, failed in zip(calls, errors, agree([e is not None for e in errors])):
        if failed:
            call.error = error or OtherRankFailed(f"session {call.session.session_id} failed on the other CFG-parallel rank")


def run_phase(calls: list[Call], phase: Callable[[list[Call]], None], agree: Agree) -> None:
    """A batched phase, retried member by member if it raises (:func:`ardiff_policies.batch_retry.run_batched`): a
    batch-size OOM or one member's bad input never costs the others their call. It needs no undo: a phase changes a
    session only once it has succeeded (KV writes abort on error), and a call's own state from a failed attempt is
    reset when its retry starts (``Call.start_denoise``), so a retry starts clean.

    Under CFG-parallel the ranks agree after every attempt. Inside the denoise the ranks also agree once per
    step, before its exchange, on everything the step did (``DreamZeroPolicy._denoise``), so a failure there
    never leaves one rank in a collective the other does not join."""

    def run(group: list[Call]) -> list[None]:
        phase(group)
        return [None] * len(group)

    for call, outcome in zip(calls, run_batched(calls, run, agree=agree, name=getattr(phase, "__name__", "phase").strip("_"))):
        if isinstance(outcome, BaseException):
            call.error = outcome


class PhaseTimer:
    """Wall time per phase in ms, added into ``ms`` (synchronizing CUDA so phases are not smeared)."""

    def __init__(self, device: torch.device, ms: dict[str, float] | None = None) -> None:
        self.device = device
        self.ms: dict[str, float] = {} if ms is None else ms
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.ms[phase] = self.ms.get(phase, 0.0) + (now - self._last) * 1000.0
        self._last = now


def elapsed_ms(device: torch.device, started: float) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) * 1000.0
