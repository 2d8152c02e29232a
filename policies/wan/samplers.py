"""Wan's flow-matching samplers: the sigma shift both families use, and the two schedules built on it.

Both families denoise by flow matching (velocity ``v``; ``x0 = x - sigma * v``) over sigmas shifted towards the
noisy end, ``s * sigma / (1 + (s - 1) * sigma)`` (:func:`shift_sigmas`); the samplers differ:

* LingBot-VA: plain Euler (upstream ``FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True)``), sigmas
  :func:`flow_match_sigmas`, ``x += v * (sigma_next - sigma)``, written out in its episode loop;
* DreamZero: :class:`FlowUniPCSampler`, below.

The UniPC sampler is numerically identical to DreamZero's: upstream samples video latents and actions with Wan's
``FlowUniPCMultistepScheduler`` (a flow-matching port of diffusers' UniPC: order 2, bh2, x0-prediction with
``x0 = x - sigma * v``, lower order on the last step, corrector on every step after the first). Its only
behavioural difference from diffusers' ``UniPCMultistepScheduler`` in flow mode is the sigma schedule:

* upstream: ``linspace(sigma_max, 0, N + 1)[:-1]`` with ``sigma_max = float32(1 - 1/T)``
  (0.999 for T = 1000, so 0.99980 after a shift of 5), then the shift
  ``s * sigma / (1 + (s - 1) * sigma)``;
* diffusers' default: ``linspace(1, 1/T, N + 1)[:-1]``, shifted, first sigma nudged to
  ``1 - 1e-6``. Against the recorded upstream trajectory (16 steps, shift 5) that moves
  the result by 1.0e-2 max abs (4.5e-3 relative); 4 steps: 3.5e-3; 16 steps, shift 1:
  2.8e-3; and every timestep after the first differs.

diffusers (>= 0.37) accepts explicit flow sigmas, so this module computes upstream's
schedule and hands it to ``UniPCMultistepScheduler``; everything else is diffusers'
solver. That reproduces the reference trajectories in
``shared/reference/flow_unipc_reference.json`` bit for bit (float64), and matches the
upstream class bit for bit on CPU for float32 and bfloat16 latents and actions.

Dtype handling is upstream's (and diffusers'): nothing is upcast. Sigmas are float32;
the solver coefficients are float32 0-dim tensors, so by PyTorch's promotion rules the
tensor arithmetic runs in the sample's dtype (bfloat16 stays bfloat16) and the result has
the sample's dtype. Upstream additionally wraps its update functions in
``torch.compile`` on CUDA, whose fused bfloat16 kernels may round differently from eager
mode by a few ulps; that is not reproduced here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler

Sigmas = TypeVar("Sigmas", np.ndarray, torch.Tensor)


def shift_sigmas(sigmas: Sigmas, shift: float) -> Sigmas:
    """Wan's timestep shift ``s * sigma / (1 + (s - 1) * sigma)``, in the sigmas' own type and precision."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_match_sigmas(steps: int, shift: float) -> torch.Tensor:
    """Upstream's ``FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True).set_timesteps(steps)`` sigmas."""
    return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1)[:-1], shift)


class FlowUniPCSampler:
    """Multistep flow-matching UniPC sampler for one trajectory.

    Usage, per denoising call::

        sampler.set_timesteps(num_inference_steps, shift)
        for step_index, t in enumerate(sampler.timesteps):
            velocity = model(sample, t)  # or the previous velocity (DiT step cache)
            sample = sampler.step(velocity, sample, step_index)

    The solver keeps the last ``solver_order`` x0-predictions between steps, so use one
    instance per trajectory (e.g. one for video latents, one for actions) and call
    ``set_timesteps`` before each new trajectory; it resets all multistep state.
    """

    def __init__(self, num_train_timesteps: int = 1000, solver_order: int = 2) -> None:
        if "sigmas" not in inspect.signature(UniPCMultistepScheduler.set_timesteps).parameters:
            raise ImportError("FlowUniPCSampler needs diffusers >= 0.37 (UniPC with custom flow sigmas)")
        self.num_train_timesteps = num_train_timesteps
        self.solver_order = solver_order
        # Upstream's training grid is sigma = 1 - linspace(1, 1/T, T)[::-1], stored as float32;
        # inference schedules run from its first entry down to 0.
        self._sigma_max = float(np.float32(1.0 - 1.0 / num_train_timesteps))
        self._solver = UniPCMultistepScheduler(
            num_train_timesteps=num_train_timesteps,
            solver_order=solver_order,
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            # We pass sigmas that are already shifted; 1.0 makes diffusers' own shift the identity.
            flow_shift=1.0,
            predict_x0=True,
            solver_type="bh2",
            lower_order_final=True,
            final_sigmas_type="zero",
        )
        self._next_step_index: int | None = None  # None until set_timesteps is called

    @property
    def timesteps(self) -> torch.Tensor:
        """(N,) int64 model timesteps: float64 ``sigma * T`` truncated, e.g. [999, 986, ...]."""
        return self._solver.timesteps

    @property
    def sigmas(self) -> torch.Tensor:
        """(N + 1,) float32 noise levels, decreasing, the last one 0."""
        return self._solver.sigmas

    def set_timesteps(self, num_inference_steps: int, shift: float) -> None:
        """Builds upstream's shifted schedule and resets all multistep state."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        if shift <= 0:
            raise ValueError(f"shift must be > 0, got {shift}")
        # float64, exactly as upstream computes it before casting sigmas to float32.
        sigmas = shift_sigmas(np.linspace(self._sigma_max, 0.0, num_inference_steps + 1)[:-1], shift)
        # diffusers annotates `sigmas` as a list but does numpy arithmetic on it: pass an array.
        self._solver.set_timesteps(sigmas=sigmas)
        # diffusers nudges a first sigma within 1e-6 of 1 (shift > ~1000 here); upstream does not.
        if self._solver.sigmas[0].item() != float(np.float32(sigmas[0])):
            raise ValueError(f"shift={shift} pushes the first sigma to 1, which upstream's schedule cannot match")
        # Index steps by position, not by looking the timestep up (int timesteps can repeat).
        self._solver.set_begin_index(0)
        self._next_step_index = 0

    def step(
        self,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        step_index: int,
        constrain: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Advances ``sample`` from ``sigmas[step_index]`` to ``sigmas[step_index + 1]``.

        ``model_output`` is the predicted velocity ``noise - x0`` at ``sample`` (any shape with a
        leading batch dimension; same shape and dtype as ``sample``). Returns a new tensor with
        the shape and dtype of ``sample``. Steps must be taken in order 0, 1, ..., N - 1.

        ``constrain`` (inpainting: pinned rows at this step's noise level) is applied to ``sample``, which is
        then the sample converted to x0 (``x0 = constrain(sample) - sigma * model_output``): pass the raw
        sample and evaluate the model at ``constrain(sample)``. Handing in an already constrained sample
        applies it twice, which only idempotent constraints (fully pinned rows) survive. From the second
        step on UniPC's corrector recomputes the sample from the previous one and the model outputs,
        discarding any edit the caller made to ``sample`` (which only reached the model's input): the
        constraint is applied again after the corrector, inside diffusers' step, so that it is what the
        solver stores and predicts from.
        """
        if self._next_step_index is None:
            raise RuntimeError("call set_timesteps before step")
        if step_index != self._next_step_index:
            raise ValueError(f"steps must be taken in order: expected step_index {self._next_step_index}, got {step_index}")
        if step_index >= len(self.timesteps):
            raise ValueError(f"step_index {step_index} is past the last of {len(self.timesteps)} steps")
        if sample.ndim < 2:
            # The order-2 update contracts over a stacked dim inserted after the batch dim.
            raise ValueError(f"sample needs a leading batch dimension, got shape {tuple(sample.shape)}")
        if model_output.shape != sample.shape:
            raise ValueError(f"model_output shape {tuple(model_output.shape)} != sample shape {tuple(sample.shape)}")
        timestep = self.timesteps[step_index]  # only recorded by diffusers; the step uses step_index
        if constrain is None:
            next_sample = self._solver.step(model_output, timestep, sample, return_dict=False)[0]
        else:
            # An instance attribute shadows the corrector for this one step (diffusers has no hook there).
            corrector = self._solver.multistep_uni_c_bh_update
            self._solver.multistep_uni_c_bh_update = lambda *args, **kwargs: constrain(corrector(*args, **kwargs))
            try:
                next_sample = self._solver.step(model_output, timestep, constrain(sample), return_dict=False)[0]
            finally:
                del self._solver.multistep_uni_c_bh_update
        self._next_step_index += 1
        return next_sample
