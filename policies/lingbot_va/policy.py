"""LingBot-VA behind the engine's :class:`~ardiff_policies.base.Policy` interface.

The engine opens a session per robot and hands it its KV; this adapter maps its calls onto the episode logic
(``episode.py``):

* a session is an episode: LingBot-VA's ``reset`` is the engine ending the session (its KV pages back to the pool); the
  next request opens a fresh one, whose first step encodes the prompt (beforehand, on the engine's encoder thread,
  when :meth:`prepare` ran) and seeds the session's generator with ``policy.seed``;
* a request with an :class:`~ardiff_policies.episode.EpisodeCall` is one of LingBot-VA's own calls: ``infer`` (predict the next
  chunk) or ``compute_kv_cache`` (commit the key frames in the observation's camera stacks and the executed actions);
* a request without one, or with a ``chunk`` call (OpenPI / RoboArena, with ``session_id``; the call carries the
  request's guidance scales) is a whole chunk: on a session that has a chunk
  out, its frames (4 per latent frame) commit that chunk with the actions the server sent, then the next chunk is
  predicted; the first request of a session carries one frame per camera (of a stack, the newest is used: a robot
  whose session was evicted starts a new episode instead of failing).

:meth:`step_batch` runs all commits of a batch in one video and one action forward, then all predictions batched
(one batched call per step count when requests asked for their own denoising steps, ``num_inference_steps`` /
``action_num_inference_steps`` within ``policy.request_inference_steps`` / ``request_action_inference_steps``; a
failed batch is retried member by member in ``episode.py``, :func:`ardiff_policies.batch_retry.run_batched`:
only a member that fails alone fails).
Actions go back as (frames x actions per frame, channels), time-major (the OpenPI shape); LingBot-VA's wire reshapes
them to upstream's (channels, frames, actions per frame) (``PolicyInfo.details['action_layout']``).

Recordings (``server.record_dir``): every call is a recorded call with its kind in ``ChunkInfo.call`` (``infer``,
``compute_kv_cache``, or ``commit+infer`` on the OpenPI wire); its canvas is the frames it brought, laid out as the
model sees them (the T layout: the wrists side by side above the high camera); an infer's prediction is its denoised
video latents, decoded by the Wan VAE on the recorder's thread (:meth:`LingBotVAPolicy.decode_prediction`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ardiff_kv import Branch, KVSpec, SessionKV
from ardiff_policies.base import ChunkRecording, Policy, RuntimeOptions, StartRefused, StepResult
from ardiff_policies.chunk import ChunkInfo
from ardiff_policies.continuation import CONTRACT
from ardiff_policies.embodiment import ObservationSchema
from ardiff_policies.episode import EpisodeCall
from ardiff_policies.inference_steps import ACTION_STEPS_KEY, VIDEO_STEPS_KEY, StepBounds, check_observation_steps, step_bounds
from ardiff_policies.info import PolicyInfo
from ardiff_policies.lingbot_va import embodiments
from ardiff_policies.lingbot_va.config import BUILTIN_TINY, SYNTHETIC_PREFIX, LingBotVAConfig
from ardiff_policies.lingbot_va.episode import MAX_GUIDANCE, CommitRequest, EpisodeError, InferRequest, LingBotVAEpisodes, LingBotVASession
from ardiff_policies.lingbot_va.memory import describe_loaded
from ardiff_policies.lingbot_va.model import TextKV
from ardiff_policies.observation import RobotObservation, UnsupportedObservation
from ardiff_policies.streams import own_stream

logger = logging.getLogger(__name__)

CAMERA_PREFIX = "observation.images."  # upstream's camera keys; the OpenPI wire uses the names after it
MAX_BATCH = 64  # sessions per forward: any number works, the engine's max_batch and the KV pool bound it
FRAMES_PER_LATENT = 4  # key frames per latent frame (the VAE's temporal stride)


def embodiment_by_name(name: str) -> embodiments.Embodiment:
    from ardiff_policies.lingbot_va import upstream_configs
    from ardiff_policies.lingbot_va.tiny import TINY_EMBODIMENT, TINY_LIBERO_EMBODIMENT

    return {
        "robotwin": embodiments.ROBOTWIN,
        "franka": embodiments.FRANKA,
        "libero": upstream_configs.LIBERO,
        "demo": upstream_configs.DEMO,
        "tiny_robotwin": TINY_EMBODIMENT,
        "tiny_libero": TINY_LIBERO_EMBODIMENT,
    }[name]


def short_camera(name: str) -> str:
    return name.removeprefix(CAMERA_PREFIX)


@dataclass
class ServedSession:
    episode: LingBotVASession
    prompt: str | None = None  # the episode's prompt, once its first step began it
    pending_text: tuple[str, list[TextKV]] | None = None  # the prompt's K/V made by prepare() on the encoder thread
    last_actions: np.ndarray | None = None  # the chunk out, (channels, F, N), until the OpenPI wire commits it
    timing_ms: dict[str, float] = field(default_factory=dict)
    committed: bool = False  # this step committed frames (its recording's call kind)


class LingBotVAPolicy(Policy[ServedSession]):
    family = "lingbot_va"  # the embodiment tag's prefix (a variant of the family names its own)

    def __init__(self, episodes: LingBotVAEpisodes, config: LingBotVAConfig, checkpoint: str, *, record: bool = False) -> None:
        self.episodes = episodes
        self.config = config
        self.checkpoint = checkpoint
        self.record = record  # fill StepResult.recording (server.record_dir)
        episodes.keep_predictions = record
        e = episodes.embodiment
        self.embodiment = e
        self.cameras = tuple(short_camera(c) for c in e.cameras)
        self.channels = len(e.used_action_channel_ids)
        self.frames, self.per_frame = e.frame_chunk_size, e.action_per_frame
        self.tag = f"{self.family}_{config.embodiment_name}"
        sizes = [(e.height, e.width) if i == 0 or e.layout != "robotwin_tshape" else (e.height // 2, e.width // 2) for i in range(len(e.cameras))]
        self.schema = ObservationSchema(self.tag, self.cameras, (), tuple(sizes))
        self.step_bounds = self._step_bounds()
        self._info = self._make_info()

    # -- what clients are told ------------------------------------------------------------------

    def _make_info(self) -> PolicyInfo:
        e = self.embodiment
        frame = {
            **self._frame(),
            "continuations": True,  # a request's continuation: the next chunk inpainted to the executing one (episode.py)
            "guidance": {"video_guidance_scale": e.guidance_scale, "action_guidance_scale": e.action_guidance_scale, "max": MAX_GUIDANCE},
        }
        details = {
            "attn_window": e.attn_window,
            "num_inference_steps": e.num_inference_steps,  # the embodiment's: a request without its own runs these
            "action_num_inference_steps": e.action_num_inference_steps,
            # the shared wire contract; the new chunk is the model's next one, inpainted to the executing one's rows
            "continuation": {**CONTRACT, "mode": "inpaint", "position": "the next chunk (over the executing one's predicted K/V)"},
        }
        return self._policy_info(frame, details, continuations=True)

    def _step_bounds(self) -> dict[str, StepBounds]:
        """The per-request denoising steps it takes: the video loop's and the action loop's (ardiff_policies.inference_steps)."""
        e, config = self.embodiment, self.config
        return {
            VIDEO_STEPS_KEY: step_bounds(config.request_inference_steps, e.num_inference_steps, "request_inference_steps"),
            ACTION_STEPS_KEY: step_bounds(config.request_action_inference_steps, e.action_num_inference_steps, "request_action_inference_steps"),
        }

    @property
    def _commit_frames(self) -> dict[str, int]:
        return {"first_chunk": FRAMES_PER_LATENT * (self.frames - 1), "later_chunks": FRAMES_PER_LATENT * self.frames}

    def _frame(self) -> dict:
        """The metadata frame's keys the family shares (its variants add theirs)."""
        commit_frames = self._commit_frames
        return {
            "embodiment": self.tag,
            "observation": self.schema.describe(),
            "frames_per_call": {"first": 1, "after_first_chunk": commit_frames["first_chunk"], "later": commit_frames["later_chunks"]},
            "actions": {
                "horizon": self.frames * self.per_frame,
                "dim": self.channels,
                "layout": "time-major (frames x actions per frame, channels); LingBot-VA's own wire: (channels, frames, actions per frame)",
                "execute_from": "the reply's session.execute_from: the first chunk's first frame of actions conditions the model and is not executed",
            },
            "needs_session_id": True,
            "image_resolution": list(self.schema.resolutions[0]),
            "protocols": ["openpi", "lingbot_va"],
        }

    def _policy_info(self, frame: dict, details: dict, *, continuations: bool) -> PolicyInfo:
        commit_frames = self._commit_frames
        return PolicyInfo(
            frame,
            action_horizon=self.frames * self.per_frame,
            action_dim=self.channels,
            model=self.tag,
            checkpoint=self.checkpoint,
            details={
                "action_layout": {"channels": self.channels, "frames": self.frames, "per_frame": self.per_frame},
                "commit_frames": commit_frames,
                "layout": self.embodiment.layout,
                "seed": self.config.seed,
                **details,
            },
            max_batch=MAX_BATCH,
            observation_schema=self.schema,
            native_protocol="lingbot_va",
            max_frames_per_call=max(commit_frames.values()),  # every frame sent is read; check_observation refuses other counts
            continuations=continuations,
            inference_steps=dict(self.step_bounds),
        )

    @property
    def info(self) -> PolicyInfo:
        return self._info

    def kv_spec(self) -> KVSpec:
        return self.episodes.kv_spec()

    @property
    def branches(self) -> tuple[Branch, ...]:
        return self.episodes.branches

    # -- requests checked before any session state changes ---------------------------------------

    def check_observation(self, observation: RobotObservation) -> None:
        call = observation.episode
        check_observation_steps(observation, self.step_bounds)
        count = self._frame_count(observation)
        commit_counts = {FRAMES_PER_LATENT * (self.frames - 1), FRAMES_PER_LATENT * self.frames}
        if call is None:
            return
        if call.kind in ("infer", "chunk"):
            for key in ("video_guidance_scale", "action_guidance_scale"):
                self._check_guidance(key, getattr(call, key))
            return
        if count not in commit_counts:
            raise UnsupportedObservation(f"obs: {count} key frames; compute_kv_cache takes {sorted(commit_counts)} (4 per latent frame)")
        expected = (self.channels, self.frames, self.per_frame)
        actions = call.executed_actions
        if actions is None or actions.shape != expected:
            raise UnsupportedObservation(f"state: expected the chunk's actions {expected}, got {None if actions is None else actions.shape}")
        if not np.isfinite(actions).all():
            raise UnsupportedObservation("state: contains NaN or infinity")

    def _frame_count(self, observation: RobotObservation) -> int:
        """The frames per camera a call brings (every camera the same number; an OpenPI request one on a session's
        first call, else the chunk out's key frames), or UnsupportedObservation naming the key."""
        call = observation.episode
        counts: dict[str, int] = {}
        for name in self.cameras:
            stack = observation.cameras.get(name)
            if stack is None:
                raise UnsupportedObservation(f"{_field(call, name)}: camera missing (this server serves {self.tag}: cameras {list(self.cameras)})")
            counts[name] = int(np.shape(stack)[0])
        if len(set(counts.values())) != 1:  # named as the client sent them: OpenPI's camera keys, or LingBot-VA's obs
            sent = (
                ", ".join(f"{_field(call, name)}: {count}" for name, count in counts.items()) if _openpi(call) else f"{sorted(set(counts.values()))}"
            )
            raise UnsupportedObservation(f"{_field(call, None)}: every camera needs the same number of frames, got {sent}")
        (count,) = set(counts.values())
        commit_counts = {FRAMES_PER_LATENT * (self.frames - 1), FRAMES_PER_LATENT * self.frames}
        if _openpi(call) and count not in {1, *commit_counts}:  # a session's first call, or the chunk out's key frames
            raise UnsupportedObservation(
                f"observation: {count} frames per camera; send 1 on a session's first call, then {sorted(commit_counts)} (4 per latent frame)"
            )
        return count

    def _check_guidance(self, key: str, value: float | None) -> None:
        if value is None:
            return
        if not 1.0 <= value <= MAX_GUIDANCE:
            raise UnsupportedObservation(f"{key}: {value} outside [1, {MAX_GUIDANCE}]")
        if value > 1 and len(self.branches) == 1:
            raise UnsupportedObservation(f"{key}: {value} needs the unconditional branch, which this deployment does not run (its scales are 1)")

    # -- sessions ----------------------------------------------------------------------------------

    def start_session(self, session_id: str, kv: SessionKV | None) -> ServedSession:
        if kv is None:
            raise RuntimeError("LingBot-VA needs the engine's paged KV")
        return ServedSession(self.episodes.start_session(session_id, kv))

    def prepare(self, session: ServedSession, observation: RobotObservation) -> Callable[[], None] | None:
        """A new episode's prompt encode (UMT5 and every layer's cross-attention K/V) beside other robots' steps."""
        if session.prompt is not None:
            return None
        prompt = observation.prompt or ""

        def encode() -> None:
            session.pending_text = (prompt, self.episodes.encode_prompt(prompt))

        return encode

    def end_session(self, session: ServedSession) -> None:
        session.episode.text_kv = session.pending_text = session.last_actions = None

    # -- steps -------------------------------------------------------------------------------------

    def step_batch(self, items: Sequence[tuple[ServedSession, RobotObservation]]) -> list[StepResult | BaseException]:
        results: list[StepResult | BaseException | None] = [None] * len(items)
        commits: list[tuple[int, CommitRequest]] = []
        infers: list[int] = []
        for i, (session, observation) in enumerate(items):
            session.timing_ms, session.committed = {}, False
            try:
                self._begin(session, observation)
            except Exception as exc:
                results[i] = exc
                continue
            call = observation.episode
            results[i] = self._without_chunk(session, call)
            if results[i] is not None:
                continue
            frames = self._frames(observation)
            if call is not None and call.kind == "compute_kv_cache":
                commits.append((i, self._commit_request(session, frames, call.executed_actions)))
            elif _openpi(call) and session.last_actions is not None:  # OpenPI: these frames close the chunk out
                expected = FRAMES_PER_LATENT * (self.frames - self._first_chunk(session))
                if len(frames) != expected:  # e.g. the session's first request again
                    results[i] = EpisodeError(
                        f"observation: {len(frames)} frame{'s' * (len(frames) != 1)} per camera; this session has a chunk out, "
                        f"which the {expected} key frames seen while executing it commit (4 per latent frame); a new episode "
                        f"is a new session_id or a reset"
                    )
                    continue
                commits.append((i, self._commit_request(session, frames, session.last_actions)))
                infers.append(i)
            else:
                infers.append(i)
        if commits:
            start = time.perf_counter()
            outcomes = self.episodes.compute_kv_cache_batch([r for _, r in commits])
            ms = (time.perf_counter() - start) * 1000.0
            for (i, _), outcome in zip(commits, outcomes):
                items[i][0].timing_ms["commit"] = ms
                if outcome is not None:
                    results[i] = outcome
                else:
                    items[i][0].last_actions, items[i][0].committed = None, True
        requests, rows = [], []
        for i in infers:
            if results[i] is not None:
                continue
            session, observation = items[i]
            frames = self._frames(observation)
            if _openpi(observation.episode) and self._first_chunk(session):
                # OpenPI: an episode starts from one observation; a stack (a robot whose session was evicted, or a
                # client that always sends its key frames) starts it from its newest frame
                frames = frames[-1:]
            requests.append(self._infer_request(session, observation, frames[0] if len(frames) == 1 else frames))
            rows.append(i)
        if requests:
            start = time.perf_counter()
            outcomes = self.episodes.infer_batch(requests)
            ms = (time.perf_counter() - start) * 1000.0
            for i, outcome in zip(rows, outcomes):
                session = items[i][0]
                if isinstance(outcome, BaseException):
                    results[i] = outcome
                    continue
                session.timing_ms["infer"] = ms
                session.last_actions = outcome
                results[i] = self._result(
                    session, outcome, self._chunk_info(session, "commit+infer" if session.committed else "infer"), self._ran(session)
                )
        for i, (session, _) in enumerate(items):
            if results[i] is None:  # a commit only (LingBot-VA's compute_kv_cache)
                results[i] = self._result(session, None, ChunkInfo(call="compute_kv_cache", execute_from=0))
        if self.record:
            for (session, observation), result in zip(items, results):
                if isinstance(result, StepResult) and result.chunk.call != "reset":  # a reset brings no frames
                    result.recording = self._recording(session, observation, result)
        return results  # type: ignore[return-value]

    # -- what a variant of the family does its own way (Zero-WAM: zero_wam_policy.py) ---------------

    def _without_chunk(self, session: ServedSession, call: EpisodeCall | None) -> StepResult | None:
        """The result of a call that neither commits nor predicts (none in LingBot-VA's protocol)."""
        return None

    def _first_chunk(self, session: ServedSession) -> bool:
        """The session's next chunk is its episode's first (its call brings one observation)."""
        return session.episode.frame_start == 0

    def _commit_request(self, session: ServedSession, frames: list[dict[str, np.ndarray]], actions: np.ndarray) -> CommitRequest:
        return CommitRequest(session.episode, frames, actions)

    def _infer_request(self, session: ServedSession, observation: RobotObservation, frames) -> InferRequest:
        call = observation.episode
        video_g = call.video_guidance_scale if call is not None else None
        action_g = call.action_guidance_scale if call is not None else None
        return InferRequest(
            session.episode,
            frames,
            video_g,
            action_g,
            observation.continuation,
            observation.num_inference_steps,
            observation.action_num_inference_steps,
        )

    def _chunk_info(self, session: ServedSession, kind: str) -> ChunkInfo:
        """What the reply says of the chunk just predicted."""
        served = session.episode.last  # its chunk_id, frozen rows, continuation; the episode's first chunk at 0
        return ChunkInfo(served.chunk_id, served.frozen, served.continuation, kind, self.per_frame if served.position == 0 else 0)

    def _ran(self, session: ServedSession) -> dict:
        """What the reply's ``session`` map says an infer ran: its denoising steps per loop and its transformer forwards."""
        served = session.episode.last
        return {VIDEO_STEPS_KEY: served.video_steps, ACTION_STEPS_KEY: served.action_steps, "dit_forwards": served.forwards}

    def _begin(self, session: ServedSession, observation: RobotObservation) -> None:
        """A session's first step begins its episode (the prompt's K/V, the window, the generator seeded)."""
        prompt = observation.prompt or ""
        if session.prompt is not None:
            if observation.prompt is not None and prompt != session.prompt:
                raise EpisodeError(f"prompt: {prompt!r} differs from this episode's {session.prompt!r}; reset the session for a new task")
            return
        start = time.perf_counter()
        pending, session.pending_text = session.pending_text, None
        text_kv = pending[1] if pending is not None and pending[0] == prompt else None
        self.episodes.reset(session.episode, prompt, self.config.seed, text_kv=text_kv)
        session.prompt = prompt
        session.timing_ms["text"] = (time.perf_counter() - start) * 1000.0

    def _frames(self, observation: RobotObservation) -> list[dict[str, np.ndarray]]:
        """The observation's camera stacks as upstream's list of key-frame dicts (upstream camera names)."""
        stacks = [np.asarray(observation.cameras[name]) for name in self.cameras]
        return [{camera: stack[t] for camera, stack in zip(self.embodiment.cameras, stacks)} for t in range(stacks[0].shape[0])]

    def _result(self, session: ServedSession, actions: np.ndarray | None, chunk: ChunkInfo, ran: dict | None = None) -> StepResult:
        """``ran``: an infer's denoising steps and transformer forwards (the reply's ``session`` map says them)."""
        if actions is None:
            out = np.zeros((0, self.channels), np.float32)
        else:
            out = np.ascontiguousarray(actions.reshape(self.channels, -1).T, dtype=np.float32)
        info = {"frame_start": session.episode.frame_start, **(ran or {})}
        return StepResult(out, dict(session.timing_ms), info, chunk=chunk)

    # -- recordings ------------------------------------------------------------------------------

    def _recording(self, session: ServedSession, observation: RobotObservation, result: StepResult) -> ChunkRecording:
        """References for the recorder: the call's frames as one canvas, the prediction (an infer's latents, else
        None), the normalized actions of all 30 model channels. The episode has no state input: ``state`` is empty."""
        episode = session.episode
        dim = self.episodes.embodiment.action_dim
        predicted, raw = None, np.zeros((0, dim), np.float32)
        if result.chunk.call != "compute_kv_cache":
            predicted = episode.predicted_latents.to("cpu")
            raw = np.ascontiguousarray(episode.predicted_actions.float().cpu()[0, ..., 0].reshape(dim, -1).T.numpy())
        episode.predicted_latents = episode.predicted_actions = None
        return ChunkRecording(canvas=self._canvas(observation), predicted=predicted, raw_actions=raw, state=np.zeros(0, np.float32))

    def _canvas(self, observation: RobotObservation) -> np.ndarray:
        """(T, H, W, 3) uint8: the call's frames at the model's sizes, in the latents' layout (T layout: the two
        wrists side by side above the high camera; otherwise the cameras side by side)."""
        stacks = []
        for name, (h, w) in zip(self.cameras, self.schema.resolutions):
            stack = torch.from_numpy(np.asarray(observation.cameras[name])).permute(0, 3, 1, 2).float()
            if stack.shape[-2:] != (h, w):
                stack = F.interpolate(stack, size=(h, w), mode="bilinear", align_corners=False)
            stacks.append(stack.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1))
        if self.embodiment.layout == "robotwin_tshape":
            canvas = torch.cat([torch.cat(stacks[1:], dim=2), stacks[0]], dim=1)
        else:
            canvas = torch.cat(stacks, dim=2)
        return canvas.numpy()

    @torch.no_grad()
    def decode_prediction(self, predicted: torch.Tensor | None) -> np.ndarray | None:
        """An infer's denoised latents (1, 48, F, h, w) -> (T, H, W, 3) uint8 frames in the canvas layout (None for a
        commit: nothing predicted). The chunk is decoded on its own (no earlier latents as the causal VAE's context)
        and the T layout's three views as one image, so the seams between them are blurred: a view of what the model
        predicted, not its exact pixels. Runs on the recorder's thread beside the steps, on its own CUDA stream (the
        VAE's decode cache is the module's and only decodes use it: encodes carry their own, ``StreamingEncoder``)."""
        if predicted is None:
            return None
        episodes = self.episodes
        shape = (1, -1, 1, 1, 1)
        with own_stream(episodes.device):
            latents = predicted.to(episodes.device, torch.float32)
            latents = latents * episodes.latents_std.to(latents.device).view(shape) + episodes.latents_mean.to(latents.device).view(shape)
            frames = episodes.vae.decode(latents.to(episodes.dtype)).sample  # (1, 3, T, H, W) in [-1, 1]
            frames = ((frames[0].float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
            return frames.permute(1, 2, 3, 0).cpu().numpy()

    def warmup_observations(self) -> Iterator[RobotObservation]:
        """One episode over the OpenPI wire: the first frame, then the key frames of the first and of a later chunk."""
        for count in (1, FRAMES_PER_LATENT * (self.frames - 1), FRAMES_PER_LATENT * self.frames):
            cameras = {name: np.zeros((count, h, w, 3), np.uint8) for name, (h, w) in zip(self.cameras, self.schema.resolutions)}
            yield RobotObservation(cameras=cameras, states={}, prompt="warm up")


def _field(call: EpisodeCall | None, camera: str | None) -> str:
    """The field an error names, as the request's protocol spells it: OpenPI's ``observation/<camera>`` (``observation``
    for all of them), LingBot-VA's ``obs`` (its cameras under upstream's keys)."""
    if _openpi(call):
        return "observation" if camera is None else ObservationSchema.key(camera)
    return "obs" if camera is None else f"obs: {CAMERA_PREFIX}{camera}"


def _openpi(call: EpisodeCall | None) -> bool:
    """An OpenPI request (one whole chunk: its frames commit the chunk out, then the next is predicted), with or
    without per-request guidance."""
    return call is None or call.kind == "chunk"


def build_lingbot_va(config: LingBotVAConfig, options: RuntimeOptions) -> LingBotVAPolicy:
    for name, value in (("engine.compile", options.compile), ("engine.cuda_graphs", options.cuda_graphs)):
        if value:
            raise StartRefused(f"{name}: not supported by the lingbot_va policy yet; unset it")
    if options.guidance.is_parallel:
        raise StartRefused("engine.cfg_parallel_size: lingbot_va runs both CFG branches in one process; set it to 1")
    embodiment, dtype = embodiment_by_name(config.embodiment_name), getattr(torch, options.dtype)
    if config.checkpoint.startswith(SYNTHETIC_PREFIX):
        from ardiff_policies.lingbot_va.synthetic import synthetic_policy

        episodes = synthetic_policy(config.checkpoint, embodiment, device=options.device, dtype=dtype)
        return LingBotVAPolicy(episodes, config, config.checkpoint, record=options.record)
    if config.checkpoint == BUILTIN_TINY:
        from ardiff_policies.lingbot_va.tiny import ensure_tiny_checkpoint

        checkpoint = ensure_tiny_checkpoint()
    else:
        checkpoint = config.local_checkpoint()
    episodes = LingBotVAEpisodes.load(checkpoint, embodiment, device=options.device, dtype=dtype)
    logger.info("%s", describe_loaded(episodes, options.max_sessions))
    return LingBotVAPolicy(episodes, config, str(checkpoint), record=options.record)
