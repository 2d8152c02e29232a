"""The DreamZero policy: one call per observation, an AR rollout of video latents and actions.

Per call (upstream ``WANPolicyHead.lazy_joint_video_action``):

1. Frames: the first call of a session uses 1 frame, later calls the last 4 (padded by
   repeating the oldest). A changed prompt resets the session; a full attention window
   (``current_start_frame >= local_attn_size``) restarts the window, keeping the text K/V.
2. Window start: CLIP tokens and the VAE image conditioning ``ys`` (first frame + 32 black
   frames, 4-channel mask on latent 0) from the newest frame; cross-attention K/V cached.
   The Wan2.2-5B (``concat_first_frame_latent=False``) uses no ``ys``: only the newest frame's
   latent (its causal VAE encodes frame 0 on its own) and the CLIP tokens; its stitched video
   is first resized to ``target_video_height/width`` (160x320), as upstream's action head does.
3. KV prefill: at a window start the first frame's latent, later the 2 newly observed latents
   (VAE re-encode: repeat x2, prepend the first frame, keep the last 2). Committed only after
   the forward succeeds.
4. Denoise 2 latent frames + the 24-step action chunk with two flow-matching UniPC samplers
   (16 steps, or the request's ``num_inference_steps``; shift 5, fixed seed). CFG (5.0) on
   video only; actions use the conditional branch. The DiT step cache may reuse the previous velocity instead of running the DiT.
5. Actions: q99-denormalized, relative keys (DROID: the joints) plus the last observed state.

What is robot-specific (cameras and their canvas, state / action keys, statistics, prompt
template) is the served :class:`ardiff_policies.embodiment.Embodiment`, read from the checkpoint
(``policies/dreamzero/embodiments.py``); DROID is one of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ardiff_kv import Branch, KVSpec, ReadOnlyPagedLayer, SessionKV, prepare_batch
from ardiff_kv.attention import allow_batch_shapes
from ardiff_policies import hub
from ardiff_policies.base import ChunkRecording, Policy, RuntimeOptions, StartRefused, StepResult
from ardiff_policies.batch_retry import OtherRankFailed
from ardiff_policies.chunk import ChunkInfo
from ardiff_policies.continuation import APPLIED, CONTRACT
from ardiff_policies.dreamzero import continuation, geometry, memory
from ardiff_policies.dreamzero.batch import (
    Call,
    LocalPredictions,
    PhaseTimer,
    elapsed_ms,
    live,
    local_predictions,
    run_each,
    run_phase,
)
from ardiff_policies.dreamzero.config import SYNTHETIC_PREFIX, DreamZeroConfig
from ardiff_policies.dreamzero.embodiments import DROID_CAMERAS, embodiment_prompt, resolve
from ardiff_policies.dreamzero.inputs import InputEncoder
from ardiff_policies.dreamzero.model import DreamZeroModel
from ardiff_policies.dreamzero.samplers import DecoupledVideoSampler
from ardiff_policies.dreamzero.session import FRAMES_PER_CALL, DreamZeroSession
from ardiff_policies.dreamzero.step_cache import StepCache
from ardiff_policies.dreamzero.transforms import CROP_SCALE, NormStats, denormalize_actions, normalize_state, to_absolute, video_size
from ardiff_policies.dreamzero.undo import SessionUndo
from ardiff_policies.embodiment import Embodiment, ObservationSchema, metadata_frame
from ardiff_policies.inference_steps import VIDEO_STEPS_KEY, check_observation_steps, requested_steps
from ardiff_policies.info import PolicyInfo, droid_server_config
from ardiff_policies.observation import RobotObservation, UnsupportedObservation
from ardiff_policies.safety import SafetyGate, SafetyRejected
from ardiff_policies.streams import own_stream
from ardiff_policies.wan.samplers import FlowUniPCSampler

logger = logging.getLogger(__name__)

# The contract as clients read it (metadata frame, /info): fewer frames are padded, more keep the newest.
FRAMES_CONTRACT = {"first": 1, "later": FRAMES_PER_CALL, "fewer": "padded by repeating the oldest frame sent", "more": "the newest are used"}
# The 95 % center crop must keep at least one pixel: int(side * 0.95) >= 1.
MIN_IMAGE_SIDE = 2


class DreamZeroPolicy(Policy[DreamZeroSession]):
    def __init__(self, config: DreamZeroConfig, options: RuntimeOptions, model: DreamZeroModel | None = None) -> None:
        self.config = config
        self.options = options
        self.device = torch.device(options.device)
        self.dtype = getattr(torch, options.dtype)
        self.text_device = torch.device(memory.resolve_device(config.text_encoder_device, str(self.device)))
        self.image_device = torch.device(memory.resolve_device(config.image_encoder_device, str(self.device)))
        if model is None:
            model = self._load(config, options)
        self.model = model
        self.dit = model.dit
        self.dit_config = model.dit.config
        self.action_head_config = model.action_head_config
        self.guidance = options.guidance
        self.embodiment: Embodiment = resolve(model.metadata, model.experiment_config, tag=config.embodiment, prompt_template=config.prompt_template)
        wan22 = model.vae.is_wan22
        self.view_size = tuple(config.view_size or geometry.default_view_size(self.embodiment, config.checkpoint, wan22=wan22))
        self.image_resolution = tuple(
            config.image_resolution or geometry.family_image_resolution(self.embodiment, self.action_head_config.target_video_size, wan22=wan22)
        )
        head = self.action_head_config
        target = head.target_video_size
        geometry.check_canvas(
            self.canvas_size,
            what=f"target_video_height/width {target[0]}x{target[1]}"
            if target
            else f"view_size {list(self.view_size)} ({self.embodiment.layout} layout)",
            spatial_compression=model.vae.spatial_compression,
            patch_size=self.dit_config.patch_size,
            frame_seqlen=self.dit_config.frame_seqlen,
        )
        geometry.check_embodiment(self.embodiment, max_action_dim=head.max_action_dim, max_state_dim=head.max_state_dim, view_size=config.view_size)
        self.inputs = InputEncoder(
            model,
            self.embodiment,
            view_size=self.view_size,
            camera_sizes=self.camera_sizes,
            negative_prompt=config.negative_prompt,
            device=self.device,
            dtype=self.dtype,
            text_device=self.text_device,
            image_device=self.image_device,
        )
        self.action_stats = NormStats.from_quantiles(self.embodiment.action_stats)
        self.state_stats = NormStats.from_quantiles(self.embodiment.state_stats)
        state_slices = self.embodiment.state_slices
        self._relative = [(a, state_slices[key]) for key, a in self.embodiment.action_slices.items() if key in self.embodiment.relative_action_keys]
        # Reply actions are absolute (relative keys plus the state): every key with a same-named state is a position.
        self.gate = SafetyGate.build(config.safety, embodiment=self.embodiment.tag, actions=self.embodiment.action_slices, states=state_slices)
        self.use_guidance = config.cfg_scale != 1.0
        if self.guidance.is_parallel and not self.use_guidance:
            raise ValueError("CFG-parallel needs cfg_scale != 1 (there is no second branch to run)")
        continuation.check_mode(
            config.continuation, device=self.device, cfg_parallel=self.guidance.is_parallel, cuda_graphs=options.cuda_graphs, compiled=options.compile
        )
        self.graphs = None
        if options.cuda_graphs:
            from ardiff_policies.dreamzero.cuda_graphs import DenoiseGraphs

            self.graphs = DenoiseGraphs(self.dit)
        if options.compile:
            from torch._dynamo import list_backends

            if isinstance(options.compile_backend, str) and options.compile_backend not in list_backends(exclude_tags=()):
                raise StartRefused(
                    f"engine.compile_backend: {options.compile_backend!r} is not a torch.compile backend in this torch; "
                    f"use one of {', '.join(list_backends())} (or aot_eager / eager to debug)"
                )
            # Per block, fullgraph: the paged write + attend is one custom op, so a block is one
            # graph; all blocks share the code object and slot/table/layer changes are values.
            allow_batch_shapes(options.max_batch, len(self.branches))  # a graph per batch shape
            for block in self.dit.blocks:
                block.compile(fullgraph=True, dynamic=False, backend=options.compile_backend)

    @property
    def camera_sizes(self) -> list[tuple[int, int]]:
        """(height, width) advertised per camera, in the embodiment's camera order. The 5B family: every camera at
        ``image_resolution`` (upstream's 5B server resizes every camera to one size); else metadata.json's per camera."""
        if self.model.vae.is_wan22:
            return [tuple(self.image_resolution)] * len(self.embodiment.cameras)
        return [tuple(size or self.image_resolution) for size in self.embodiment.schema(self.image_resolution).resolutions]

    @property
    def canvas_size(self) -> tuple[int, int]:
        """(height, width) of the video the VAE and CLIP see: the stitched views, or the checkpoint's target size."""
        return video_size(self.embodiment.layout, self.view_size, self.action_head_config.target_video_size)

    def _load(self, config: DreamZeroConfig, options: RuntimeOptions) -> DreamZeroModel:
        """The model from its checkpoint (or a synthetic one), after its memory plan was printed and checked."""
        devices = {"device": self.device, "text_encoder_device": self.text_device, "image_encoder_device": self.image_device}
        if config.checkpoint.startswith(SYNTHETIC_PREFIX):
            from ardiff_policies.dreamzero.synthetic import is_resident, synthetic_model

            if not is_resident(config.checkpoint, dtype=self.dtype, **devices):  # else its weights are already there (gpu_check)
                memory.check_plan(memory.synthetic_geometry(config.checkpoint), config, options, self.device)
            return synthetic_model(config.checkpoint, dtype=self.dtype, **devices)
        checkpoint, tokenizer = config.files()
        # The canvas the VAE sees (activations): the view size as it will be, before the model says it.
        geometry = memory.checkpoint_geometry(checkpoint, config.view_size or config.embodiment_of(checkpoint).trained_view_size)
        memory.check_plan(geometry, config, options, self.device)
        return DreamZeroModel.load(checkpoint, tokenizer=tokenizer, dtype=self.dtype, **devices)

    @property
    def branches(self) -> tuple[Branch, ...]:
        return self.guidance.local_branches if self.use_guidance else (Branch.COND,)

    @property
    def info(self) -> PolicyInfo:
        e, horizon = self.embodiment, self.action_head_config.action_horizon
        resolution = self.image_resolution
        schema = ObservationSchema(e.tag, e.cameras, e.states, tuple(self.camera_sizes)) if e.wire == "keys" else None
        return PolicyInfo(
            server_config=droid_server_config(resolution)
            if schema is None
            else metadata_frame(e, schema, horizon, FRAMES_CONTRACT, continuations=True),
            action_horizon=horizon,
            action_dim=self.action_stats.dim,
            model="dreamzero",
            checkpoint=hub.snapshot_label(self.config.checkpoint) or self.config.checkpoint,
            details={
                "dit_step_cache": self.config.dit_step_cache,
                "num_inference_steps": self.config.num_inference_steps,
                "request_inference_steps": [self.config.inference_steps_bounds.low, self.config.inference_steps_bounds.high],
                "backbone": "wan2.2-ti2v-5b" if self.model.vae.is_wan22 else "wan2.1-i2v-14b",
                "embodiment": {**e.describe(resolution), **({"observation": schema.describe()} if schema is not None else {})},
                "frames_per_call": FRAMES_CONTRACT,
                "continuation": {**CONTRACT, "mode": self.config.continuation, "execution_horizon": self.config.continuation_execution_horizon},
                "safety": self.gate.describe() if self.gate is not None else {"mode": "off"},
            },
            max_batch=64,  # step_batch runs any number of sessions in one forward; engine.max_batch caps it
            observation_schema=schema,
            continuations=True,
            max_frames_per_call=FRAMES_PER_CALL,
            keeps_newest_frames=True,  # InputEncoder.canvas: the newest are used
            inference_steps={VIDEO_STEPS_KEY: self.config.inference_steps_bounds},
        )

    def check_observation(self, observation: RobotObservation) -> None:
        """What :meth:`step` cannot take, refused before any session state changes."""
        try:
            embodiment_prompt(self.embodiment, observation.prompt)
        except ValueError as exc:
            raise UnsupportedObservation(f"prompt: {exc}") from None
        if observation.continuation is not None:
            try:
                observation.continuation.check(self.action_head_config.action_horizon)
            except ValueError as exc:
                raise UnsupportedObservation(str(exc)) from None
        check_observation_steps(observation, {VIDEO_STEPS_KEY: self.config.inference_steps_bounds})
        lengths = {name: frames.shape[0] for name, frames in observation.cameras.items() if frames is not None}
        if len(set(lengths.values())) > 1:
            by_key = {self._wire_key(name, observation): n for name, n in lengths.items()}
            raise UnsupportedObservation(f"camera frame stacks differ in length (frames per camera): {by_key}")
        for name, frames in observation.cameras.items():
            if frames is not None and min(frames.shape[1:3]) < MIN_IMAGE_SIDE:
                raise UnsupportedObservation(
                    f"{self._wire_key(name, observation)}: images need at least {MIN_IMAGE_SIDE} pixels per side (DreamZero center-crops "
                    f"to {CROP_SCALE:.0%}), got shape {frames.shape}"
                )

    def _step_cache(self, steps: int) -> StepCache:
        """The configured DiT step cache carried over to ``steps`` denoising steps (``step_cache.py``)."""
        config = self.config
        return StepCache.for_steps(config.dit_step_cache, config.dit_step_mask, config.num_inference_steps, steps)

    def _wire_key(self, camera: str, observation: RobotObservation | None = None) -> str:
        """The request key a camera arrives under (errors name what the client sent): the one the
        decoder recorded, else the convention's."""
        if observation is not None and (sent := observation.wire_key(camera)) is not None:
            return sent
        if self.embodiment.wire == "keys":
            return ObservationSchema.key(camera)
        droid = {name: key for key, name in DROID_CAMERAS.items()}
        return ObservationSchema.key(droid.get(camera, camera))

    def kv_spec(self) -> KVSpec:
        return memory.dit_kv_spec(self.dit_config, self.dtype)

    def start_session(self, session_id: str, kv: SessionKV | None) -> DreamZeroSession:
        if kv is None:
            raise ValueError("DreamZero needs a KV session from the engine")
        return DreamZeroSession(session_id, kv)

    def end_session(self, session: DreamZeroSession) -> None:
        session.frames.clear()
        session.prompt_embeds = session.clip_feature = session.ys = session.first_latent = session.prepared = session.last_chunk = None

    def agree(self, failed: Sequence[bool]) -> list[bool]:
        return self.guidance.agree(list(failed), self.device)

    def prepare(self, session: DreamZeroSession, observation: RobotObservation):
        """The encodes a window start needs (CLIP, the image conditioning, the prompt's text), as a job for the engine's
        encoder thread, so a new robot's first call (or a prompt change, a window restart) never runs them inside
        other robots' batched step. Steady calls have none. The step uses what the job made only for this very
        call, and computes it itself otherwise: the result is the same either way."""
        prompt = embodiment_prompt(self.embodiment, observation.prompt)
        window_start = session.prompt is None or prompt != session.prompt or session.current_start_frame >= self.dit_config.local_attn_size
        need_text = Branch.COND in self.branches and (prompt != session.prompt or session.prompt_embeds is None)
        need_negative = Branch.UNCOND in self.branches and not self.inputs.has_negative_embeds
        if not (window_start or need_text or need_negative):
            return None

        def job() -> None:
            session.prepared = self.inputs.prepare(observation, prompt, text=need_text, negative=need_negative, window_start=window_start)

        return job

    def warmup_observations(self) -> Iterator[RobotObservation]:
        """A session that fills one window and restarts it once: every shape a session meets."""
        e = self.embodiment
        sizes = self.camera_sizes
        window_calls = 1 + -(-(self.dit_config.local_attn_size - 1) // self.dit_config.num_frame_per_block)
        for call in range(window_calls + 1):
            count = 1 if call == 0 else FRAMES_PER_CALL
            cameras = {name: np.zeros((count, h, w, 3), dtype=np.uint8) for name, (h, w) in zip(e.cameras, sizes, strict=True)}
            states = {p.name: np.zeros(p.dim, np.float32) for p in e.states}
            yield RobotObservation(cameras=cameras, states=states, prompt="warm up")

    # -- one call, or several sessions' calls in one batch ------------------------------------

    @torch.no_grad()
    def step_batch(self, items: Sequence[tuple[DreamZeroSession, RobotObservation]]) -> list[StepResult | BaseException]:
        """One call for each of several sessions (distinct), the heavy parts run batched.

        Per session: frame buffering, the reset rules, prompt embeddings and, at a window start,
        the image conditioning (CLIP, ``ys``, cross-attention K/V). Batched: the VAE encode of
        the observed frames (sessions whose frame stacks have one shape), the KV prefill (one
        forward per number of prefilled frames) and every denoise step (one forward over every
        session x local CFG branch, in lockstep on one schedule; sessions that asked for other
        numbers of denoising steps denoise one group per step count, one after the other). The
        DiT step cache decides per session from that session's own velocities, and a step's forward runs only the sessions
        that decided to run, so every session's result is its unbatched result (up to float
        summation order). A failure in a session's own part fails that session; a failure in a
        batched forward fails every session in it (the engine tears each down)."""
        calls = [Call(session, observation, slot) for slot, (session, observation) in enumerate(items)]
        agree = self.agree
        # A rejecting gate sees the chunk after the call's KV commit: each call can be undone until it passes.
        undo = [SessionUndo.take(c.session) for c in calls] if self.gate is not None and self.gate.mode == "reject" else None
        run_each(calls, self._begin, agree)
        pending = [c for c in live(calls) if c.video is not None]  # later calls: their observed frames
        for shape in dict.fromkeys(tuple(c.video.shape) for c in pending):  # one VAE encode per frame-stack shape
            run_phase([c for c in pending if tuple(c.video.shape) == shape], self._encode_observed, agree)
        for frames in sorted({call.prefill_latents.shape[2] for call in live(calls)}):
            run_phase([c for c in live(calls) if c.prefill_latents.shape[2] == frames], self._prefill, agree)
        for steps in sorted({c.steps for c in live(calls)}):  # one lockstep schedule per step count
            run_phase([c for c in live(calls) if c.steps == steps], self._denoise, agree)
        run_each(live(calls), self._finish, agree)
        for call, saved in zip(calls, undo or ()):
            if isinstance(call.error, SafetyRejected):
                saved.restore(self._repopulate_cross)
            else:
                saved.release()  # passed, or failed (the engine then ends the session)
        return [call.error if call.error is not None else call.result for call in calls]

    def _begin(self, call: Call) -> None:
        """The session's own part: frames, resets, text, and at a window start its image conditioning
        (made beforehand by :meth:`prepare`'s job when it ran for this call)."""
        session = call.session
        prepared, session.prepared = session.prepared, None
        if prepared is not None and prepared.observation is not call.observation:
            prepared = None  # made for another call of this session: not this one's
        timer = PhaseTimer(self.device, call.timing)
        call.events = self._advance_session(session, call.observation, None if prepared is None else prepared.canvas)
        video = self.inputs.video_tensor(session)  # (1, 3, T, H, W) in [-1, 1] (H, W: canvas_size)
        timer.mark("frames")
        if prepared is not None:
            for phase, ms in prepared.timing_ms.items():  # the encoder thread's time counts as this call's
                call.add(phase, ms)
            if prepared.prompt_embeds is not None and prepared.prompt == session.prompt and session.prompt_embeds is None:
                session.prompt_embeds = prepared.prompt_embeds
        prompt_embeds = self.inputs.prompt_embeds(session, self.branches)
        timer.mark("text")
        if session.current_start_frame == 0:
            if prepared is not None and prepared.image is not None:
                session.clip_feature, session.ys, session.first_latent = prepared.image
            else:
                newest = video[:, :, -1:]
                session.clip_feature = self.inputs.clip_feature(newest)
                timer.mark("vision")
                session.ys, session.first_latent = self.inputs.image_conditioning(newest)  # ys: None for the 5B
            self._populate_cross(session, prompt_embeds)
            timer.mark("vae")
            call.prefill_latents, call.prefill_start = session.first_latent, 0
        else:
            timer.mark("vision")
            call.video = video
        call.raw_state = self._raw_state(call.observation)
        call.steps = requested_steps(call.observation, VIDEO_STEPS_KEY, self.config.num_inference_steps)
        self._plan_continuation(call)

    def _plan_continuation(self, call: Call) -> None:
        """Whether this call continues its session's last chunk, and how (``continuation.py``)."""
        asked = call.observation.continuation
        call.continuation = continuation.decide(asked, call.session.last_chunk, call.events)
        if call.continuation == APPLIED:
            call.plan = continuation.plan(
                asked,
                call.session.last_chunk,
                call.raw_state,
                mode=self.config.continuation,
                horizon=self.action_head_config.action_horizon,
                execution_horizon=self.config.continuation_execution_horizon,
                stats=self.action_stats,
                relative=self._relative,
                device=self.device,
                dtype=self.dtype,
            )

    def _encode_observed(self, group: list[Call]) -> None:
        """Upstream's re-encode of the newly observed frames: one VAE encode for sessions whose frame stacks have one shape."""
        nfpb = self.dit_config.num_frame_per_block
        started = time.perf_counter()
        latents = self.inputs.observation_latents(torch.cat([c.video for c in group]))  # (B, z, nfpb, h, w)
        elapsed = elapsed_ms(self.device, started)
        for call, latent in zip(group, latents.split(1)):
            call.prefill_latents, call.prefill_start = latent, call.session.current_start_frame - nfpb
            call.video = None
            call.add("vae", elapsed)

    def _prefill(self, calls: list[Call]) -> None:
        """KV prefill of what each session observed, committed only if the forward succeeds."""
        started = time.perf_counter()
        frames = calls[0].prefill_latents.shape[2]
        timestep = torch.zeros(1, frames, dtype=torch.long, device=self.device)
        self._forward(calls, [c.prefill_latents for c in calls], timestep, starts=[c.prefill_start for c in calls], commit=True)
        elapsed = elapsed_ms(self.device, started)
        for call in calls:
            if call.session.current_start_frame == 0:
                call.session.current_start_frame = 1
            call.add("prefill", elapsed)

    def _forward(
        self,
        calls: list[Call],
        latents: list[torch.Tensor],
        timestep: torch.Tensor,
        *,
        starts: list[int],
        commit: bool,
        action: list[torch.Tensor] | None = None,
        timestep_action: torch.Tensor | None = None,
        state: list[torch.Tensor] | None = None,
        differentiable: bool = False,
    ) -> list[dict[Branch, tuple[torch.Tensor, torch.Tensor | None]]]:
        """One DiT forward over every call x local branch (a sequence each, own pages, own scratch).
        Returns, per call, each branch's (video, action) prediction. ``differentiable``: a denoise forward that
        reads the pages and writes nothing, with a backward (guided continuations)."""
        dit = self.dit_config
        frames = latents[0].shape[2]
        extra = dit.action_register_length if action is not None else 0
        sequences = [(call, branch) for call in calls for branch in self.branches]
        contexts = [
            call.session.kv.begin_forward(
                branch, num_video_tokens=frames * dit.frame_seqlen, commit=commit, extra_tokens=extra, scratch_slot=call.slot
            )
            for call, branch in sequences
        ]
        try:
            layer_inputs = prepare_batch(contexts, self.device)
            if differentiable:
                layer_inputs = [ReadOnlyPagedLayer(inputs) for inputs in layer_inputs]
            per_branch = len(self.branches)
            seq_starts = [s for s in starts for _ in range(per_branch)]
            inputs = {
                "x": torch.cat([x for x in latents for _ in range(per_branch)]).to(self.dtype),
                "timestep": timestep.expand(len(sequences), -1),
            }
            if self.dit_config.concat_first_frame_latent:  # the 14B's image conditioning (the 5B has none)
                inputs["y"] = torch.cat([self._y(c.session, start, frames) for c, start in zip(calls, starts) for _ in range(per_branch)])
            if action is not None:
                inputs["action"] = torch.cat([a for a in action for _ in range(per_branch)])
                if timestep_action.shape[0] == 1:
                    inputs["timestep_action"] = timestep_action.expand(len(sequences), -1)
                else:  # one row per call (clean_prefix continuations): repeated per branch like the actions
                    inputs["timestep_action"] = timestep_action.repeat_interleave(per_branch, dim=0)
                inputs["state"] = torch.cat([s for s in state for _ in range(per_branch)])
            per_layer = [call.session.kv.cross_kv(branch) for call, branch in sequences]
            cross_kv = [layer[0] for layer in zip(*per_layer)] if len(sequences) == 1 else [tuple(layer) for layer in zip(*per_layer)]
            out = None
            if self.graphs is not None and not commit and action is not None and len(calls) == 1 and not differentiable:  # one session's denoise step
                key = tuple((int(b), c.session.kv.branch(b).cross_slot, start) for (c, b), start in zip(sequences, seq_starts))
                out = self.graphs.run(key, layer_inputs=layer_inputs, cross_kv=cross_kv, current_start_frame=seq_starts, **inputs)
            video, action_pred = out or self.dit(
                inputs.pop("x"), inputs.pop("timestep"), current_start_frame=seq_starts, self_kv=layer_inputs, cross_kv=cross_kv, **inputs
            )
        except BaseException:
            for call, branch in sequences:
                call.session.kv.abort(branch)
            raise
        for call, branch in sequences:
            call.session.kv.complete(branch)
        results: list[dict[Branch, tuple[torch.Tensor, torch.Tensor | None]]] = [{} for _ in calls]
        for index, (call_index, branch) in enumerate((i, b) for i in range(len(calls)) for b in self.branches):
            results[call_index][branch] = (video[index : index + 1], None if action_pred is None else action_pred[index : index + 1])
        return results

    def _denoise(self, calls: list[Call]) -> None:
        """Denoise every session's next chunk + actions in lockstep on one schedule (calls of one step count; two
        flow-matching UniPC samplers per session: video and actions); CFG on video, actions from the conditional branch."""
        started = time.perf_counter()
        dit, head, config = self.dit_config, self.action_head_config, self.config
        z = self.model.vae.latent_channels
        for call in calls:
            call.start_denoise()  # a retry alone after a batched attempt failed part-way starts clean too
            lh, lw = call.session.first_latent.shape[-2:]
            call.latents = _seeded_noise((1, z, dit.num_frame_per_block, lh, lw), config.seed).to(self.device, self.dtype)
            call.actions = _seeded_noise((1, head.action_horizon, dit.action_dim), config.seed).to(self.device, self.dtype)
            call.state = torch.from_numpy(self._model_state(call.raw_state).reshape(1, 1, -1)).to(self.device, self.dtype)
            if call.plan is not None:
                call.plan.noise = call.actions.clone()
            call.video_sampler = DecoupledVideoSampler(head.video_inference_final_noise) if head.decouple_inference_noise else FlowUniPCSampler()
            call.action_sampler = FlowUniPCSampler()
            call.video_sampler.set_timesteps(call.steps, shift=config.sigma_shift)
            call.action_sampler.set_timesteps(call.steps, shift=config.sigma_shift)
        schedule = list(zip(calls[0].video_sampler.timesteps, calls[0].action_sampler.timesteps))
        failure: BaseException | None = None  # raised on this rank since the CFG ranks last agreed
        for i, (t_video, t_action) in enumerate(schedule):
            running, local, guided = [], None, False
            if failure is None:
                try:
                    running, local, guided = self._step_forward(calls, i, int(t_video), int(t_action))
                except Exception as exc:
                    failure = exc
            # One agreement per step, where the CFG ranks are about to meet in its exchange (_guide's collectives): it
            # covers everything either did since they last met (the last step's guidance and sampler steps, this step's
            # DiT input, step cache and forward), so a failure on one rank stops both here, never leaving the other in
            # a collective it waits in alone (one tiny all-gather per step; nothing in one process).
            if self.agree([failure is not None])[0]:
                raise failure or OtherRankFailed("a batched denoise step failed on the other CFG-parallel rank")
            try:
                self._step_apply(calls, i, running, local, guided)
            except Exception as exc:
                failure = exc
        if failure is not None:  # the last step's, past the last exchange: run_phase's agreement covers it
            raise failure
        for call in calls:
            if call.plan is not None:
                call.actions = continuation.after_denoising(call.plan, call.actions)
        elapsed = elapsed_ms(self.device, started)
        for call in calls:
            call.session.current_start_frame += dit.num_frame_per_block
            call.add("denoise", elapsed)

    def _step_forward(self, calls: list[Call], i: int, t_video: int, t_action: int) -> tuple[list[Call], LocalPredictions | None, bool]:
        """A denoise step up to its CFG exchange: the step cache's decision per call, the forward of the calls that run
        the DiT (a continuation's replacement applied to the DiT's action input). Returns those calls, this rank's
        predictions and whether the step runs guided (RTC's guidance: a VJP per step)."""
        dit, head = self.dit_config, self.action_head_config
        running = []
        for call in calls:
            run, call.countdown = self._step_cache(call.steps).should_run(i, call.history, call.countdown)
            if run:
                running.append(call)
        if not running:
            return [], None, False
        timestep = torch.full((1, dit.num_frame_per_block), t_video, dtype=torch.long, device=self.device)
        timestep_action = torch.full((1, head.action_horizon), t_action, dtype=torch.long, device=self.device)
        if any(c.plan is not None and c.plan.mode == "clean_prefix" for c in running):  # per-call token timesteps
            timestep_action = torch.cat([continuation.action_timesteps(c.plan, timestep_action) for c in running])
        guided = any(c.plan is not None and c.plan.mode == "guided" for c in running)  # RTC's guidance: a VJP per step
        for call in running if guided else ():  # a fresh graph per step, a gradient only for the guided calls' actions
            call.actions = call.actions.detach().requires_grad_(call.plan is not None and call.plan.mode == "guided")
        # The continuation's replacement reaches the DiT here; the samplers keep the raw sample and apply it once themselves.
        dit_actions = [continuation.dit_actions(c.plan, c.actions, c.action_sampler.sigmas[i]) for c in running]
        with torch.set_grad_enabled(guided):
            predictions = self._forward(
                running,
                [c.latents for c in running],
                timestep,
                starts=[c.session.current_start_frame for c in running],
                commit=False,
                action=dit_actions,
                timestep_action=timestep_action,
                state=[c.state for c in running],
                differentiable=guided,
            )
            return running, local_predictions(predictions, running, self.branches), guided

    def _step_apply(self, calls: list[Call], i: int, running: list[Call], local: LocalPredictions | None, guided: bool) -> None:
        """The rest of a denoise step: the exchange and guidance, RTC's guidance, each call's two sampler steps."""
        with torch.set_grad_enabled(guided):
            if running:
                self._guide(running, local)
            if guided:
                continuation.guide_calls(running, float(calls[0].action_sampler.sigmas[i]))
        for call in calls:
            call.latents = call.video_sampler.step(call.velocity, call.latents, i)
            call.actions = call.action_sampler.step(
                call.action_velocity, call.actions, i, constrain=continuation.constraint(call.plan, call.action_sampler.sigmas[i])
            )

    def _guide(self, calls: list[Call], local: LocalPredictions) -> None:
        """Each call's new video velocity (CFG) and action velocity (conditional branch) from one step's forward
        (under CFG-parallel: the ranks' collectives)."""
        action_velocity = self.guidance.broadcast_from_cond(local.cond_action, like=local.actions)
        if self.use_guidance:
            both = self.guidance.gather_video(local.video)
            velocity = both[Branch.UNCOND] + self.config.cfg_scale * (both[Branch.COND] - both[Branch.UNCOND])
        else:
            velocity = local.video[Branch.COND]
        for call, v, a in zip(calls, velocity.split(1), action_velocity.split(1)):
            call.velocity, call.action_velocity = v, a
            call.history = [*call.history, v][-2:]
            call.forwards += 1

    def _finish(self, call: Call) -> None:
        started = time.perf_counter()
        session = call.session
        actions = self._postprocess(call.actions, call.raw_state)
        frozen = 0
        if call.plan is not None:  # exactly what the robot executes, not its round trip through model space
            frozen = call.plan.frozen
            actions[:frozen] = call.plan.executed_actions
        safety = None
        if self.gate is not None:  # before the chunk is the session's: a reject leaves no trace (step_batch undoes the call)
            actions, safety = self.gate.apply(actions, call.raw_state, frozen=frozen)
        session.chunks += 1
        session.last_chunk = continuation.LastChunk(session.chunks, call.actions.detach().clone(), actions.copy(), call.raw_state)
        call.result = StepResult(
            actions=actions,
            timing_ms=call.timing,
            info={
                "dit_forwards": call.forwards,
                "num_inference_steps": call.steps,
                "current_start_frame": session.current_start_frame,
                **call.events,
                **({"safety": safety} if safety is not None else {}),
            },
            chunk=ChunkInfo(chunk_id=session.chunks, frozen=frozen, continuation=call.continuation),
        )
        if self.options.record:  # references for the recorder; its thread decodes the video beside the steps
            seen = list(session.frames)[-(1 if session.calls == 1 else FRAMES_PER_CALL) :]
            call.result.recording = ChunkRecording(
                canvas=np.stack(seen),
                predicted=call.latents.detach().to("cpu"),
                raw_actions=call.actions[0].float().cpu().numpy(),
                state=call.raw_state,
            )
        call.add("decode", (time.perf_counter() - started) * 1000.0)

    @torch.no_grad()
    def decode_prediction(self, predicted: torch.Tensor) -> np.ndarray:
        """The denoised latents of a chunk -> (T, H, W, 3) uint8 frames of the stitched canvas.

        The chunk's latents are decoded on their own (without the window's earlier latents as the
        causal VAE's context), so the first frame is a reconstruction of the chunk's first latent:
        a faithful view of what the model predicted, not bit-equal to a decode of the whole window. On the recorder's
        thread beside the steps: its own CUDA stream, the VAE's decode cache (never waiting for the steps' encodes)."""
        with own_stream(self.device):
            frames = self.model.vae.decode(predicted.to(self.device, self.dtype))  # (1, 3, T, H, W) in [-1, 1]
            frames = ((frames[0].float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
            return frames.permute(1, 2, 3, 0).cpu().numpy()

    def _advance_session(self, session: DreamZeroSession, observation: RobotObservation, canvas: np.ndarray | None = None) -> dict[str, bool]:
        """Buffer the new frames (``canvas``: already stitched) and apply upstream's reset rules. Returns what happened."""
        prompt = embodiment_prompt(self.embodiment, observation.prompt)
        events = {"prompt_change": False, "window_restart": False}
        if session.prompt is not None and prompt != session.prompt:
            session.kv.restart_window(keep_cross_text=False)
            session.prompt_embeds = None
            session.current_start_frame = 0
            events["prompt_change"] = True
        elif session.current_start_frame >= self.dit_config.local_attn_size:
            session.kv.restart_window(keep_cross_text=True)
            session.current_start_frame = 0
            events["window_restart"] = True
        session.prompt = prompt
        session.frames.extend(self.inputs.canvas(observation) if canvas is None else canvas)
        session.calls += 1
        return events

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

    def _repopulate_cross(self, session: DreamZeroSession) -> None:
        """A restored session's cross-attention K/V from its own text and image features (SessionUndo)."""
        self._populate_cross(session, self.inputs.prompt_embeds(session, self.branches))

    def _y(self, session: DreamZeroSession, start: int, frames: int) -> torch.Tensor | None:
        ys = session.ys
        if ys is None:  # a DiT without the ys concat (5B)
            return None
        return ys[:, :, start : start + frames] if start + frames <= ys.shape[2] else ys[:, :, -frames:]

    def _raw_state(self, observation: RobotObservation) -> np.ndarray:
        """The embodiment's state keys concatenated (float64; a key not sent is zeros)."""
        return self.embodiment.raw_state(observation.states)

    def _model_state(self, raw_state: np.ndarray) -> np.ndarray:
        """The state the DiT sees: q99-normalized, clamped, zero-padded to max_state_dim (float64)."""
        return normalize_state(raw_state, self.state_stats, self.action_head_config.max_state_dim)

    def _postprocess(self, actions: torch.Tensor, raw_state: np.ndarray) -> np.ndarray:
        chunk = actions[0].float().cpu().numpy().astype(np.float64)
        real = denormalize_actions(chunk, self.action_stats)
        real = to_absolute(real, raw_state, self._relative)
        return real.astype(np.float32)


def _seeded_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A call's initial noise, from a fresh generator per call: the same seed gives the same chunk, batched or alone."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def build_dreamzero(config: DreamZeroConfig, options: RuntimeOptions) -> DreamZeroPolicy:
    return DreamZeroPolicy(config, options)
