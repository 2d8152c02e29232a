"""The DreamZero policy: one call per observation, an AR rollout of video latents and actions.

Per call (upstream ``WANPolicyHead.lazy_joint_video_action``):

1. Frames: the first call of a session uses 1 frame, later calls the last 4 (padded by
   repeating the oldest). A changed prompt resets the session; a full attention window
   (``current_start_frame >= local_attn_size``) restarts the window, keeping the text K/V.
2. Window start: CLIP tokens and the VAE image conditioning ``ys`` (first frame + 32 black
   frames, 4-channel mask on latent 0) from the newest frame; cross-attention K/V cached.
3. KV prefill: at a window start the first frame's latent, later the 2 newly observed latents
   (VAE re-encode: repeat x2, prepend the first frame, keep the last 2). Committed only after
   the forward succeeds.
4. Denoise 2 latent frames + the 24-step action chunk with two flow-matching UniPC schedulers
   (16 steps, shift 5, fixed seed). CFG (5.0) on video only; actions use the conditional
   branch. The DiT step cache may reuse the previous velocity instead of running the DiT.
5. Actions: q99-denormalized, joints relative to the last observed joint state.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kv import Branch, KVSpec, SessionKV
from policies import hub
from policies.base import ChunkRecording, Policy, RuntimeOptions, StepResult
from policies.dreamzero.config import BUILTIN_TINY, SYNTHETIC_PREFIX, DreamZeroConfig
from policies.dreamzero.dit import DiTConfig
from policies.dreamzero.model import DreamZeroModel
from policies.dreamzero.scheduler import FlowUniPCScheduler
from policies.dreamzero.transforms import (
    CROP_SCALE,
    NormStats,
    clean_prompt,
    crop_and_resize,
    denormalize_actions,
    droid_prompt,
    normalize_state,
    stitch_views,
    to_absolute_joints,
)
from policies.info import PolicyInfo, droid_server_config
from policies.observation import RobotObservation, UnsupportedObservation

logger = logging.getLogger(__name__)

FRAMES_PER_CALL = 4  # frames a robot sends per call after the first (DreamZero's client contract)
# The 95 % center crop must keep at least one pixel: int(side * 0.95) >= 1.
MIN_IMAGE_SIDE = 2


@dataclass
class DreamZeroSession:
    session_id: str
    kv: SessionKV
    frames: deque = field(default_factory=lambda: deque(maxlen=FRAMES_PER_CALL))  # stitched canvases
    calls: int = 0
    prompt: str | None = None
    prompt_embeds: torch.Tensor | None = None
    current_start_frame: int = 0
    clip_feature: torch.Tensor | None = None
    ys: torch.Tensor | None = None  # (1, 4 + z, latent frames, h, w) image conditioning
    first_latent: torch.Tensor | None = None


class PhaseTimer:
    """Wall time per phase in ms (synchronizing CUDA so phases are not smeared)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.ms[phase] = self.ms.get(phase, 0.0) + (now - self._last) * 1000.0
        self._last = now


class DreamZeroPolicy(Policy[DreamZeroSession]):
    def __init__(self, config: DreamZeroConfig, options: RuntimeOptions, model: DreamZeroModel | None = None) -> None:
        self.config = config
        self.options = options
        self.device = torch.device(options.device)
        self.dtype = getattr(torch, options.dtype)
        self.text_device = torch.device(resolve_device(config.text_encoder_device, str(self.device)))
        self.image_device = torch.device(resolve_device(config.image_encoder_device, str(self.device)))
        if model is None:
            model = self._load(config, options)
        self.model = model
        self.dit = model.dit
        self.dit_config = model.dit.config
        self.action_head_config = model.action_head_config
        self.guidance = options.guidance
        self._check_geometry()
        self.action_stats = NormStats.from_metadata(model.metadata, config.embodiment, "action")
        self.state_stats = NormStats.from_metadata(model.metadata, config.embodiment, "state")
        self.use_guidance = config.cfg_scale != 1.0
        if self.guidance.is_parallel and not self.use_guidance:
            raise ValueError("CFG-parallel needs cfg_scale != 1 (there is no second branch to run)")
        self._negative_embeds: torch.Tensor | None = None  # a model constant: encoded once per process
        self.graphs = None
        if options.cuda_graphs:
            from policies.dreamzero.cuda_graphs import DenoiseGraphs

            self.graphs = DenoiseGraphs(self.dit)
        if options.compile:
            # Per block, fullgraph: the paged write + attend is one custom op, so a block is one
            # graph; all blocks share the code object and slot/table/layer changes are values.
            for block in self.dit.blocks:
                block.compile(fullgraph=True, dynamic=False, backend=options.compile_backend)

    def _load(self, config: DreamZeroConfig, options: RuntimeOptions) -> DreamZeroModel:
        """The model from its checkpoint (or a synthetic one), after its memory plan was printed and checked."""
        from policies.dreamzero import memory

        devices = {"device": self.device, "text_encoder_device": self.text_device, "image_encoder_device": self.image_device}
        if config.checkpoint.startswith(SYNTHETIC_PREFIX):
            from policies.dreamzero.synthetic import is_resident, synthetic_model

            if not is_resident(config.checkpoint, dtype=self.dtype, **devices):  # else its weights are already there (gpu_check)
                check_memory_plan(memory.synthetic_geometry(config.checkpoint), config, options, self.device)
            return synthetic_model(config.checkpoint, dtype=self.dtype, **devices)
        checkpoint, tokenizer = resolve_files(config)
        geometry = memory.checkpoint_geometry(checkpoint, config.view_size)
        check_memory_plan(geometry, config, options, self.device)
        return DreamZeroModel.load(checkpoint, tokenizer=tokenizer, dtype=self.dtype, **devices)

    def _check_geometry(self) -> None:
        h, w = self.config.view_size
        s = self.model.vae.spatial_compression
        _, ph, pw = self.dit_config.patch_size
        tokens = (2 * h // s // ph) * (2 * w // s // pw)
        if (2 * h) % (s * ph) or (2 * w) % (s * pw) or tokens != self.dit_config.frame_seqlen:
            raise ValueError(
                f"view_size {self.config.view_size} gives {tokens} tokens per latent frame; the checkpoint's DiT "
                f"expects frame_seqlen={self.dit_config.frame_seqlen}"
            )

    # -- interface ----------------------------------------------------------------------

    @property
    def branches(self) -> tuple[Branch, ...]:
        return self.guidance.local_branches if self.use_guidance else (Branch.COND,)

    @property
    def info(self) -> PolicyInfo:
        return PolicyInfo(
            server_config=droid_server_config(self.config.image_resolution),
            action_horizon=self.action_head_config.action_horizon,
            action_dim=self.action_stats.dim,
            model="dreamzero",
            checkpoint=hub.snapshot_label(self.config.checkpoint) or self.config.checkpoint,
            details={"dit_step_cache": self.config.dit_step_cache, "num_inference_steps": self.config.num_inference_steps},
        )

    def check_observation(self, observation: RobotObservation) -> None:
        """What :meth:`step` cannot take, refused before any session state changes."""
        try:
            droid_prompt(observation.prompt)
        except ValueError as exc:
            raise UnsupportedObservation(f"prompt: {exc}") from None
        lengths = {name: frames.shape[0] for name, frames in observation.cameras.items() if frames is not None}
        if len(set(lengths.values())) > 1:
            raise UnsupportedObservation(f"camera frame stacks differ in length: {lengths}")
        for name, frames in observation.cameras.items():
            if frames is not None and min(frames.shape[1:3]) < MIN_IMAGE_SIDE:
                raise UnsupportedObservation(
                    f"{name}: images need at least {MIN_IMAGE_SIDE} pixels per side (DreamZero center-crops "
                    f"to {CROP_SCALE:.0%}), got shape {frames.shape}"
                )

    def kv_spec(self) -> KVSpec:
        return dit_kv_spec(self.dit_config, self.dtype)

    def start_session(self, session_id: str, kv: SessionKV | None) -> DreamZeroSession:
        if kv is None:
            raise ValueError("DreamZero needs a KV session from the engine")
        return DreamZeroSession(session_id, kv)

    def end_session(self, session: DreamZeroSession) -> None:
        session.frames.clear()
        session.prompt_embeds = session.clip_feature = session.ys = session.first_latent = None

    def warmup_observations(self) -> Iterator[RobotObservation]:
        """A session that fills one window and restarts it once: every shape a session meets."""
        h, w = self.config.image_resolution
        window_calls = 1 + -(-(self.dit_config.local_attn_size - 1) // self.dit_config.num_frame_per_block)
        for call in range(window_calls + 1):
            frames = np.zeros((1 if call == 0 else FRAMES_PER_CALL, h, w, 3), dtype=np.uint8)
            yield RobotObservation(
                exterior_left=frames, exterior_right=frames, wrist=frames,
                joint_position=np.zeros(7, np.float32), gripper_position=np.zeros(1, np.float32), prompt="warm up",
            )  # fmt: skip

    # -- one call -----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, session: DreamZeroSession, observation: RobotObservation) -> StepResult:
        timer = PhaseTimer(self.device)
        nfpb = self.dit_config.num_frame_per_block
        events = self._advance_session(session, observation)
        video = self._video_tensor(session)  # (1, 3, T, 2h, 2w) in [-1, 1]
        timer.mark("frames")

        # text
        prompt_embeds = self._prompt_embeds(session)
        timer.mark("text")

        # vision: image conditioning at a window start
        if session.current_start_frame == 0:
            newest = video[:, :, -1:]
            session.clip_feature = self.model.image_encoder(newest[:, :, 0].to(self.image_device)).to(self.device, self.dtype)
            timer.mark("vision")
            session.ys, session.first_latent = self._image_conditioning(newest)
            self._populate_cross(session, prompt_embeds)
            timer.mark("vae")
            observed = None
        else:
            timer.mark("vision")
            observed = self._observation_latents(video)  # (1, z, nfpb, h, w)
            timer.mark("vae")

        # KV prefill of what was observed (committed only if the forward succeeds)
        if session.current_start_frame == 0:
            self._prefill(session, session.first_latent, start=0)
            session.current_start_frame = 1
        else:
            self._prefill(session, observed, start=session.current_start_frame - nfpb)
        timer.mark("prefill")

        # denoise the next chunk + actions
        raw_state = self._raw_state(observation)
        actions, video, dit_forwards = self._denoise(session, raw_state)
        timer.mark("denoise")
        session.current_start_frame += nfpb

        out = self._postprocess(actions, raw_state)
        timer.mark("decode")
        recording = None
        if self.options.record:  # references for the recorder; it decodes the video between requests
            seen = list(session.frames)[-(1 if session.calls == 1 else FRAMES_PER_CALL) :]
            recording = ChunkRecording(
                canvas=np.stack(seen), predicted=video.detach().to("cpu"), raw_actions=actions[0].float().cpu().numpy(), state=raw_state
            )
        return StepResult(
            actions=out,
            timing_ms=timer.ms,
            info={"dit_forwards": dit_forwards, "current_start_frame": session.current_start_frame, **events},
            recording=recording,
        )

    @torch.no_grad()
    def decode_prediction(self, predicted: torch.Tensor) -> np.ndarray:
        """The denoised latents of a chunk -> (T, H, W, 3) uint8 frames of the stitched canvas.

        The chunk's latents are decoded on their own (without the window's earlier latents as the
        causal VAE's context), so the first frame is a reconstruction of the chunk's first latent:
        a faithful view of what the model predicted, not bit-equal to a decode of the whole window."""
        frames = self.model.vae.decode(predicted.to(self.device, self.dtype))  # (1, 3, T, H, W) in [-1, 1]
        frames = ((frames[0].float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
        return frames.permute(1, 2, 3, 0).cpu().numpy()

    def _advance_session(self, session: DreamZeroSession, observation: RobotObservation) -> dict[str, bool]:
        """Buffer the new frames and apply upstream's reset rules. Returns what happened."""
        prompt = droid_prompt(observation.prompt)
        events = {"session_reset": False, "window_reset": False}
        if session.prompt is not None and prompt != session.prompt:
            session.kv.restart_window(keep_cross_text=False)
            session.prompt_embeds = None
            session.current_start_frame = 0
            events["session_reset"] = True
        elif session.current_start_frame >= self.dit_config.local_attn_size:
            session.kv.restart_window(keep_cross_text=True)
            session.current_start_frame = 0
            events["window_reset"] = True
        session.prompt = prompt
        session.frames.extend(self._canvas(observation))
        session.calls += 1
        return events

    def _canvas(self, observation: RobotObservation) -> np.ndarray:
        size = tuple(self.config.view_size)
        views = [None if v is None else crop_and_resize(v, size) for v in (observation.wrist, observation.exterior_left, observation.exterior_right)]
        return stitch_views(*views, view_size=size)

    def _video_tensor(self, session: DreamZeroSession) -> torch.Tensor:
        frames = list(session.frames)
        wanted = 1 if session.calls == 1 else FRAMES_PER_CALL
        frames = frames[-wanted:]
        frames = [frames[0]] * (wanted - len(frames)) + frames  # pad by repeating the oldest
        video = torch.from_numpy(np.stack(frames)).to(self.device)
        return pixels_to_model_range(video.permute(3, 0, 1, 2).unsqueeze(0), self.dtype)

    def _encode_text(self, text: str) -> torch.Tensor:
        """Text embeddings on the engine's device, whichever device the text encoder runs on."""
        tokens = self.model.tokenizer(
            text, max_length=self.dit_config.text_len, padding="max_length", truncation=True,
            return_tensors="pt", add_special_tokens=True,
        )  # fmt: skip
        embeds = self.model.text_encoder(tokens["input_ids"].to(self.text_device), tokens["attention_mask"].to(self.text_device))
        return embeds.to(self.device, self.dtype)

    def _prompt_embeds(self, session: DreamZeroSession) -> dict[Branch, torch.Tensor]:
        """Text embeddings of the branches this process runs (the prompt's are cached per session)."""
        embeds = {}
        if Branch.COND in self.branches:
            if session.prompt_embeds is None:
                session.prompt_embeds = self._encode_text(session.prompt)
            embeds[Branch.COND] = session.prompt_embeds
        if Branch.UNCOND in self.branches:
            if self._negative_embeds is None:
                # Upstream's tokenizer cleans the negative prompt too (no template, no lower-casing).
                self._negative_embeds = self._encode_text(clean_prompt(self.config.negative_prompt))
            embeds[Branch.UNCOND] = self._negative_embeds
        return embeds

    def _image_conditioning(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ys``: VAE latents of [image, zeros x (num_frames - 1)] with a mask on latent 0."""
        b, c, _, h, w = image.shape
        zeros = torch.zeros(b, c, self.action_head_config.num_frames - 1, h, w, dtype=image.dtype, device=image.device)
        # Upstream runs this encode under CUDA bf16 autocast (WANPolicyHead.encode_image) and the per-call re-encode
        # without it. A bf16 model on a GPU does the same here: the VAE's RMS norms (upstream's formula, see
        # encoders.UpstreamRMSNorm) then yield float32 up to the next convolution. CPU autocast keeps norms in bf16
        # unlike CUDA's, so elsewhere this encode runs plainly in the model dtype, like upstream's re-encode.
        autocast = self.device.type == "cuda" and self.dtype == torch.bfloat16
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            latents = self.model.vae.encode(torch.cat([image, zeros], dim=2))
        latents = latents.to(self.dtype)
        mask = torch.zeros_like(latents[:, :4])
        mask[:, :, 0] = 1
        return torch.cat([mask, latents], dim=1), latents[:, :, :1]

    def _observation_latents(self, video: torch.Tensor) -> torch.Tensor:
        """Upstream's re-encode: repeat each frame x2, prepend the first, keep the last latents."""
        nfpb = self.dit_config.num_frame_per_block
        t = video.shape[2]
        if (t - 1) // 4 != nfpb:
            if t // 4 != nfpb:
                video = torch.repeat_interleave(video, nfpb // (t // 4), dim=2)
            video = torch.cat([video[:, :, :1], video], dim=2)
        return self.model.vae.encode(video)[:, :, -nfpb:]

    def _populate_cross(self, session: DreamZeroSession, prompt_embeds: dict[Branch, torch.Tensor]) -> None:
        for branch in self.branches:
            text_ready, image_ready = session.kv.cross_ready(branch)
            projected = self.dit.project_cross_kv(
                context=None if text_ready else prompt_embeds[branch],
                clip_feature=None if image_ready else session.clip_feature,
            )
            for layer, (text, image) in enumerate(projected):
                session.kv.write_cross(branch, layer, text=text, image=image)
            session.kv.mark_cross_ready(branch, text=True, image=True)

    def _y(self, session: DreamZeroSession, start: int, frames: int) -> torch.Tensor:
        ys = session.ys
        return ys[:, :, start : start + frames] if start + frames <= ys.shape[2] else ys[:, :, -frames:]

    def _dit(self, session: DreamZeroSession, branch: Branch, latents: torch.Tensor, timestep: torch.Tensor, *,
             start: int, commit: bool, action=None, timestep_action=None, state=None):  # fmt: skip
        frames = latents.shape[2]
        extra = self.dit_config.action_register_length if action is not None else 0
        ctx = session.kv.begin_forward(branch, num_video_tokens=frames * self.dit_config.frame_seqlen, commit=commit, extra_tokens=extra)
        try:
            layer_inputs = ctx.prepare(self.device)
            out = None
            if self.graphs is not None and not commit and action is not None:  # a denoise step
                key = (int(branch), session.kv.branch(branch).cross_slot, start)
                out = self.graphs.run(
                    key, layer_inputs=layer_inputs, cross_kv=session.kv.cross_kv(branch), current_start_frame=start,
                    x=latents.to(self.dtype), timestep=timestep, y=self._y(session, start, frames), action=action,
                    timestep_action=timestep_action, state=state,
                )  # fmt: skip
            out = out or self.dit(
                latents.to(self.dtype), timestep, current_start_frame=start, self_kv=layer_inputs,
                y=self._y(session, start, frames), cross_kv=session.kv.cross_kv(branch),
                action=action, timestep_action=timestep_action, state=state,
            )  # fmt: skip
        except BaseException:
            session.kv.abort(branch)
            raise
        session.kv.complete(branch)
        return out

    def _prefill(self, session: DreamZeroSession, latents: torch.Tensor, start: int) -> None:
        timestep = torch.zeros(1, latents.shape[2], dtype=torch.long, device=self.device)
        for branch in self.branches:
            self._dit(session, branch, latents, timestep, start=start, commit=True)

    def _denoise(self, session: DreamZeroSession, raw_state: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(actions, denoised video latents, DiT forwards run) of the next chunk."""
        dit_config, head, config = self.dit_config, self.action_head_config, self.config
        z = self.model.vae.latent_channels
        lh, lw = session.ys.shape[-2:]
        video = _seeded_noise((1, z, dit_config.num_frame_per_block, lh, lw), config.seed).to(self.device, self.dtype)
        actions = _seeded_noise((1, head.action_horizon, dit_config.action_dim), config.seed).to(self.device, self.dtype)
        model_state = normalize_state(raw_state, self.state_stats, head.max_state_dim).reshape(1, 1, -1)
        state = torch.from_numpy(model_state).to(self.device, self.dtype)
        video_scheduler = FlowUniPCScheduler()
        if head.decouple_inference_noise:
            video_scheduler = DecoupledVideoScheduler(head.video_inference_final_noise)
        action_scheduler = FlowUniPCScheduler()
        video_scheduler.set_timesteps(config.num_inference_steps, shift=config.sigma_shift)
        action_scheduler.set_timesteps(config.num_inference_steps, shift=config.sigma_shift)

        history: list[torch.Tensor] = []  # last video velocities (the dynamic step cache compares them)
        countdown = 0
        velocity = action_velocity = None
        forwards = 0
        start = session.current_start_frame
        for i, (t_video, t_action) in enumerate(zip(video_scheduler.timesteps, action_scheduler.timesteps)):
            run, countdown = self._should_run(i, history, countdown)
            if run:
                forwards += 1
                timestep = torch.full((1, dit_config.num_frame_per_block), int(t_video), dtype=torch.long, device=self.device)
                timestep_action = torch.full((1, head.action_horizon), int(t_action), dtype=torch.long, device=self.device)
                local_video, local_action = {}, None
                for branch in self.branches:
                    v, a = self._dit(session, branch, video, timestep, start=start, commit=False,
                                     action=actions, timestep_action=timestep_action, state=state)  # fmt: skip
                    local_video[branch] = v
                    if branch == Branch.COND:
                        local_action = a
                action_velocity = self.guidance.broadcast_from_cond(local_action, like=actions)
                if self.use_guidance:
                    both = self.guidance.gather_video(local_video)
                    velocity = both[Branch.UNCOND] + config.cfg_scale * (both[Branch.COND] - both[Branch.UNCOND])
                else:
                    velocity = local_video[Branch.COND]
                history = [*history, velocity][-2:]
            video = video_scheduler.step(velocity, video, i)
            actions = action_scheduler.step(action_velocity, actions, i)
        return actions, video, forwards

    def _should_run(self, index: int, history: list[torch.Tensor], countdown: int) -> tuple[bool, int]:
        """DiT step cache: (run the DiT this step?, new skip countdown)."""
        mode = self.config.dit_step_cache
        if mode == "off":
            return True, 0
        if mode == "fixed":
            return self.config.dit_step_mask[index], 0
        # dynamic (upstream's): after two real steps, skip 4 / 2 steps while the last two video
        # velocities stay closer than cosine 0.95 / 0.93.
        if len(history) < 2:
            return True, countdown
        if countdown > 1:
            return False, countdown - 1
        if countdown == 1:
            return True, 0
        similarity = F.cosine_similarity(history[-1].flatten(1).float(), history[-2].flatten(1).float(), dim=1).mean()
        for threshold, skips in ((0.95, 4), (0.93, 2)):
            if similarity > threshold:
                return False, skips
        return True, 0

    def _raw_state(self, observation: RobotObservation) -> np.ndarray:
        joints = observation.joint_position if observation.joint_position is not None else np.zeros(7)
        gripper = observation.gripper_position if observation.gripper_position is not None else np.zeros(1)
        return np.concatenate([np.asarray(joints, np.float64).ravel(), np.asarray(gripper, np.float64).ravel()])

    def _postprocess(self, actions: torch.Tensor, raw_state: np.ndarray) -> np.ndarray:
        chunk = actions[0].float().cpu().numpy().astype(np.float64)
        real = denormalize_actions(chunk, self.action_stats)
        real = to_absolute_joints(real, raw_state, self.config.relative_action_dims)
        return real.astype(np.float32)


def pixels_to_model_range(pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 pixels -> [-1, 1] in ``dtype``, rounded where upstream rounds (``WANPolicyHead.lazy_joint_video_action``):
    ``/ 255`` in float32, cast to the model dtype, then ``Normalize(0.5, 0.5)`` = ``(x - 0.5) / 0.5`` in that dtype.
    (In float32 this is bit for bit ``x / 255 * 2 - 1``: scaling by 2 is exact.)"""
    video = (pixels.float() / 255.0).to(dtype)
    return (video - 0.5) / 0.5


class DecoupledVideoScheduler(FlowUniPCScheduler):
    """The video sampler under upstream's ``decouple_inference_noise`` (``WANPolicyHead.lazy_joint_video_action``).

    The video's sigmas are mapped from [sigma_max, 0] onto [sigma_max, final_noise], so the video takes every step
    but stays partly noisy, while the actions (their own scheduler) denoise fully. Both noises are still drawn from
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


def _seeded_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian noise from a fresh generator per call: the same seed gives the same chunk."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def dit_kv_spec(dit: DiTConfig, dtype: torch.dtype) -> KVSpec:
    """What a DreamZero DiT needs from the paged KV cache (the policy's and the memory plan's)."""
    return KVSpec(
        num_layers=dit.num_layers,
        num_heads=dit.num_heads,
        head_dim=dit.head_dim,
        page_size=dit.frame_seqlen,  # one page = one latent frame
        window_pages=dit.local_attn_size,
        max_new_pages=dit.num_frame_per_block,
        max_extra_tokens=dit.action_register_length,
        cross_text_tokens=dit.text_len,
        cross_image_tokens=dit.num_image_tokens if dit.model_type == "i2v" else 0,
        dtype=dtype,
    )


def resolve_checkpoint(checkpoint: str) -> Path:
    if checkpoint == BUILTIN_TINY:
        from policies.dreamzero.tiny import ensure_tiny_checkpoint

        return ensure_tiny_checkpoint()
    return Path(checkpoint).expanduser()


def resolve_files(config: DreamZeroConfig) -> tuple[Path, Path | None]:
    """Checkpoint and tokenizer directories. The front end has already turned Hugging Face ids
    into local snapshots (``DreamZeroConfig.preflight``); an engine started without it (Ray
    replicas, in-process tests) fetches them here."""
    if config.checkpoint == BUILTIN_TINY:
        return resolve_checkpoint(config.checkpoint), Path(config.tokenizer).expanduser() if config.tokenizer else None
    return config.local_files()


def resolve_device(wanted: str, engine_device: str) -> str:
    """A placement setting (``engine``, ``cpu``, ``cuda``, ``cuda:N``) as a device."""
    from policies.dreamzero.memory import resolve_device as resolve

    return resolve(wanted, engine_device)


def check_memory_plan(geometry, config: DreamZeroConfig, options: RuntimeOptions, device: torch.device) -> None:
    """Log this process's memory plan and refuse (StartRefused, one line) if a device cannot hold its part."""
    from policies.dreamzero import memory

    if device.type == "cuda" and device.index is None:  # "cuda": this process's current GPU, named like the placements
        device = torch.device("cuda", torch.cuda.current_device())
    settings = memory.PlanSettings(
        engine_device=str(device), dtype=getattr(torch, options.dtype),
        text_encoder_device=config.text_encoder_device, image_encoder_device=config.image_encoder_device,
        branches=len(options.guidance.local_branches) if config.cfg_scale != 1.0 else 1,
        cfg_parallel_size=2 if options.guidance.is_parallel else 1, max_sessions=options.max_sessions,
        kv_budget_gib=options.kv_budget_gib, kv_memory_fraction=options.kv_memory_fraction,
    )  # fmt: skip
    used = {settings.device_of(c) for c in memory.COMPONENTS}
    memory.check_devices_exist(sorted(used), torch.cuda.device_count() if any(d.startswith("cuda") for d in used) else 0)
    free = {d: memory.free_bytes(d) for d in used | {"cpu"}}
    plan = memory.plan_memory(geometry, settings, free)
    logger.info("%s", plan.describe())
    plan.check()


def build_dreamzero(config: DreamZeroConfig, options: RuntimeOptions) -> DreamZeroPolicy:
    return DreamZeroPolicy(config, options)
