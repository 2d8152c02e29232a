"""DreamZero's video sampler under upstream's ``decouple_inference_noise``: Wan's flow-matching UniPC
(:class:`ardiff_policies.wan.samplers.FlowUniPCSampler`) over rescaled sigmas."""

from __future__ import annotations

import functools

import torch

from ardiff_policies.wan.samplers import FlowUniPCSampler


class DecoupledVideoSampler(FlowUniPCSampler):
    """The video sampler under upstream's ``decouple_inference_noise`` (``WANPolicyHead.lazy_joint_video_action``).

    The video's sigmas are mapped from [sigma_max, 0] onto [sigma_max, final_noise], so the video takes every step
    but stays partly noisy, while the actions (their own sampler) denoise fully. Both noises are still drawn from
    the per-call seed; only the schedule changes. Upstream computes ``sigmas * (sigma_max - final) / sigma_max +
    final`` on the GPU in float32, where dividing by a Python scalar is a multiplication by its float32 reciprocal;
    the same float32 operations are done here, then ``timesteps = int64(sigmas[:-1] * 1000)``.
    """

    def __init__(self, final_noise: float) -> None:
        super().__init__()
        self.final_noise = final_noise

    def set_timesteps(self, num_inference_steps: int, shift: float) -> None:
        super().set_timesteps(num_inference_steps, shift)
        solver = self._solver
        sigmas = solver.sigmas
        sigma_max = sigmas[0].item()
        f32 = functools.partial(torch.tensor, dtype=torch.float32, device=sigmas.device)
        reciprocal = f32(1.0) / f32(sigma_max)
        solver.sigmas = sigmas * f32(sigma_max - self.final_noise) * reciprocal + f32(self.final_noise)
        solver.timesteps = (solver.sigmas[:-1] * f32(self.num_train_timesteps)).to(torch.int64)
