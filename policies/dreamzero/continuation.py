"""Continuing the chunk a robot is executing (real-time chunking) inside DreamZero's action denoising.

Each session keeps its last chunk (:class:`LastChunk`): the model-space actions (normalized, relative
keys relative to the state they were anchored to), the actions as the robot got them and that raw
state. A request with a :class:`ardiff_policies.continuation.Continuation` (``executed`` e, ``delay`` d) gets a
:class:`ContinuationPlan`: the old chunk's remaining actions ``[e, H)`` re-anchored to the new state,
and how strongly each of the new chunk's actions is pinned to them.

Re-anchoring (relative keys): the robot executes absolute targets ``u = denorm(a) + s_old``. The new
chunk is relative to ``s_new``, so the same targets are ``a' = norm(u - s_new)``: the absolute targets
do not move, only their coordinates. Absolute keys keep their values. Dimensions the statistics do not
cover (padding up to the DiT's action width, q01 == q99) keep their old model values.

Modes (``policy.continuation``), per denoising step at noise level sigma (x = (1 - sigma) x0 + sigma eps):

* ``inpaint``: before each step the actions become ``x + w (x_target - x)``, ``x_target = (1 - sigma) a' +
  sigma eps`` with the call's own initial noise eps and RTC's soft mask ``w`` (1 on the first d actions,
  decaying to 0 at ``H - s``), applied once: the DiT's input and the sample the sampler converts to x0 are
  the same (:func:`dit_actions`); after the last step the same replacement at sigma 0 (the first d exactly ``a'``).
* ``clean_prefix``: the first d action tokens are ``a'`` at timestep 0 in every forward (a checkpoint
  trained with per-token action noise knows clean tokens); the rest denoise as usual.
* ``guided`` (RTC's guidance, Black et al. 2025, eq. 2-4): the actions are left alone; the velocity becomes
  ``v - min(beta, w(sigma)) J^T (W (a' - x0_hat))``, ``x0_hat = x - sigma v``, ``J = d x0_hat / d x`` (a
  vector-Jacobian product through the DiT: the forward runs differentiable, :class:`ardiff_kv.readonly.ReadOnlyPagedLayer`,
  and one backward per step), ``w(sigma) = (sigma^2 + (1 - sigma)^2) / (sigma (1 - sigma))``. CPU only.

Either way the reply's first d rows are the old chunk's ``[e, e + d)`` exactly as the robot executes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from ardiff_policies import action_inpaint
from ardiff_policies.continuation import Continuation, decide_for, soft_mask
from ardiff_policies.dreamzero.transforms import NormStats

RelativeSlices = list[tuple[tuple[int, int], tuple[int, int]]]  # (action columns, state columns) per relative key


@dataclass
class LastChunk:
    """A session's last chunk: what a continuation continues."""

    chunk_id: int
    model: torch.Tensor  # (1, H, model action dim) the denoised actions in model space
    actions: np.ndarray  # (H, action dim) float32: the reply's actions, as the robot executes them
    raw_state: np.ndarray  # the raw state its relative keys were anchored to


@dataclass
class ContinuationPlan:
    """How one call continues its session's last chunk."""

    frozen: int  # d: leading actions taken from the last chunk
    mode: str
    target: torch.Tensor  # (1, H, model action dim): re-anchored old actions [e, H) at rows [0, H - e), zeros after
    weights: torch.Tensor  # (1, H, 1): the soft mask (inpaint) or 1 on the frozen rows (clean_prefix)
    executed_actions: np.ndarray  # (d, action dim) float32: the frozen rows as the robot executes them
    noise: torch.Tensor | None = None  # the call's initial action noise (set when denoising starts)


def decide(continuation: Continuation | None, last: LastChunk | None, events: dict[str, bool]) -> str | None:
    """Whether a requested continuation applies (:func:`ardiff_policies.continuation.decide_for`). A window restart
    does not stop it: the plan needs only the last chunk's actions and the state they were anchored to
    (:class:`LastChunk`), never the KV window; only the video context restarts."""
    return decide_for(continuation, None if last is None else last.chunk_id, events)


def reanchor(last: LastChunk, executed: int, raw_state: np.ndarray, stats: NormStats, relative: RelativeSlices) -> np.ndarray:
    """The last chunk's actions ``[executed, H)`` in the new chunk's model space (float64, (H - e, model dim))."""
    old_model = last.model[0, executed:].double().cpu().numpy()
    absolute = last.actions[executed:].astype(np.float64)
    coords = absolute.copy()
    for (a0, a1), (s0, s1) in relative:
        coords[:, a0:a1] -= raw_state[s0:s1]
    span = stats.q99 - stats.q01
    valid = span != 0
    out = old_model.copy()
    dim = stats.dim
    normalized = out[:, :dim]
    normalized[:, valid] = 2.0 * (coords[:, :dim][:, valid] - stats.q01[valid]) / span[valid] - 1.0
    return out


def plan(
    continuation: Continuation,
    last: LastChunk,
    raw_state: np.ndarray,
    *,
    mode: str,
    horizon: int,
    execution_horizon: int | None,
    stats: NormStats,
    relative: RelativeSlices,
    device: torch.device,
    dtype: torch.dtype,
) -> ContinuationPlan:
    e, d = continuation.executed, continuation.delay
    remaining = reanchor(last, e, raw_state, stats, relative)
    target = np.zeros((horizon, remaining.shape[1]), dtype=np.float64)
    target[: horizon - e] = remaining
    if mode in ("inpaint", "guided"):
        s = e if execution_horizon is None else max(execution_horizon, e)  # no old actions past H - e
        weights = soft_mask(horizon, d, horizon - s)
    else:
        weights = np.zeros(horizon)
        weights[:d] = 1.0
    return ContinuationPlan(
        frozen=d,
        mode=mode,
        target=torch.from_numpy(target).reshape(1, horizon, -1).to(device, dtype),
        weights=torch.from_numpy(weights).reshape(1, horizon, 1).to(device, dtype),
        executed_actions=last.actions[e : e + d].copy(),
    )


def before_step(plan: ContinuationPlan, actions: torch.Tensor, sigma: float) -> torch.Tensor:
    """A step's sample with the continuation's replacement at noise level sigma (see the module docstring)."""
    if plan.mode == "guided":  # guidance acts on the velocity (guide_calls)
        return actions
    if plan.mode == "clean_prefix":
        out = actions.clone()
        out[:, : plan.frozen] = plan.target[:, : plan.frozen]
        return out
    return action_inpaint.toward(actions, plan.target, plan.weights, plan.noise, sigma)


def constraint(plan: ContinuationPlan | None, sigma: float | torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the action sampler applies to the raw sample it is handed (``FlowUniPCSampler.step``'s ``constrain``):
    the replacement of :func:`before_step` at this step's noise level (None under ``guided``, which replaces
    nothing), so that it is what the multistep solver converts to x0 and carries on from (its corrector would
    otherwise recompute the rows without it)."""
    if plan is None or plan.mode == "guided":
        return None
    return partial(before_step, plan, sigma=float(sigma))


def dit_actions(plan: ContinuationPlan | None, actions: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """The DiT's action input for a step from the sampler's raw sample: :func:`constraint` applied once. The
    sampler gets the raw sample and applies the same constraint itself, so the sample it converts to x0 is
    this one (handing it this one would apply the soft mask twice: x + (2w - w^2)(x_target - x))."""
    constrain = constraint(plan, sigma)
    return actions if constrain is None else constrain(actions)


def after_denoising(plan: ContinuationPlan, actions: torch.Tensor) -> torch.Tensor:
    """The final actions: the frozen rows are exactly their targets; under ``inpaint`` the soft-masked rows get
    the replacement at noise level 0 too (the last step moved them by the model's velocity alone)."""
    out = actions + plan.weights * (plan.target - actions) if plan.mode == "inpaint" else actions.clone()
    out[:, : plan.frozen] = plan.target[:, : plan.frozen]
    return out


def action_timesteps(plan: ContinuationPlan | None, timestep_action: torch.Tensor) -> torch.Tensor:
    """Per-token action timesteps for one call: clean (0) on the frozen tokens under ``clean_prefix``."""
    if plan is None or plan.mode != "clean_prefix" or plan.frozen == 0:
        return timestep_action
    out = timestep_action.clone()
    out[:, : plan.frozen] = 0
    return out


# RTC's guidance weight clip (Black et al. 2025: beta = 5).
GUIDANCE_MAX_WEIGHT = 5.0


def check_mode(mode: str, *, device: torch.device, cfg_parallel: bool, cuda_graphs: bool, compiled: bool) -> None:
    """Refuse, at start-up, a continuation mode this process cannot serve (ValueError naming the setting and the fix)."""
    if mode != "guided":
        return
    blockers = [
        name
        for name, on in (
            ("a CUDA device", device.type != "cpu"),
            ("CFG-parallel", cfg_parallel),
            ("CUDA graphs", cuda_graphs),
            ("torch.compile", compiled),
        )
        if on
    ]
    if blockers:
        raise ValueError(
            f"policy.continuation: guided runs on the CPU path only (a backward through the DiT per denoising step, "
            f"through read-only paged attention), not with {', '.join(blockers)}; use policy.continuation=inpaint"
        )


def guidance_weight(sigma: float) -> float:
    """RTC's ``min(beta, (1 - tau) / (tau r_tau^2))`` with tau = 1 - sigma: ``(sigma^2 + (1 - sigma)^2) / (sigma (1 - sigma))``."""
    if not 0.0 < sigma < 1.0:
        return GUIDANCE_MAX_WEIGHT
    return min(GUIDANCE_MAX_WEIGHT, (sigma**2 + (1.0 - sigma) ** 2) / (sigma * (1.0 - sigma)))


def guide_calls(calls: list[Any], sigma: float) -> None:
    """Correct the action velocity of each guided call (``plan.mode == "guided"``) of one denoise step by RTC's guidance.

    ``calls``: the step's calls (``actions`` a leaf that requires grad for the guided ones, ``action_velocity``,
    ``velocity`` and ``history`` from a forward run under autograd). One backward covers all guided calls (their
    sequences do not attend to each other); afterwards every tensor the step keeps is detached."""
    guided = [c for c in calls if c.plan is not None and c.plan.mode == "guided"]
    if guided:
        estimates = [c.actions - sigma * c.action_velocity for c in guided]  # x0_hat
        errors = [c.plan.weights * (c.plan.target - x0).detach() for c, x0 in zip(guided, estimates)]
        corrections = torch.autograd.grad(estimates, [c.actions for c in guided], grad_outputs=errors)
        weight = guidance_weight(sigma)
        for call, correction in zip(guided, corrections):
            call.action_velocity = call.action_velocity - weight * correction
    for call in calls:
        call.actions = call.actions.detach()
        call.action_velocity = call.action_velocity.detach()
        call.velocity = call.velocity.detach()
        call.history = [h.detach() for h in call.history]
