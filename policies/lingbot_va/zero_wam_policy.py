"""Zero-WAM behind the engine's :class:`~ardiff_policies.base.Policy` interface: a variant of LingBot-VA's
(:class:`~ardiff_policies.lingbot_va.policy.LingBotVAServing`, whose sessions, recordings and replies it keeps) over
Zero-WAM's episode logic (``zero_wam_episode.py``).

* A session is an episode. It begins on its first step: the prompt and how the episode begins
  (:class:`~ardiff_policies.episode.EpisodeStart`: ``use_icl``, the demonstration's id, the guidance scales), its
  demonstration pinned. Upstream's RoboTwin protocol sends that as its ``reset``, a step of its own (an
  :class:`~ardiff_policies.episode.EpisodeCall` of kind ``reset``: no chunk, so a missing demonstration is answered at
  the reset, as upstream raises there); an OpenPI request carries it on its session's first call (later calls may
  repeat the same values, not change them).
* Upstream's ``infer`` / ``compute_kv_cache`` are its own calls (``compute_kv_cache``'s ``state`` is not read: the
  history is the model's own actions, as upstream); an OpenPI request is a whole chunk, as LingBot-VA's: its key frames
  commit the chunk out, then the next is predicted.
* Continuations (real-time chunking) are not served: upstream's action loop keeps no K/V of the chunk it predicts,
  which the next chunk would have to stand on, and its actions have no frozen rows to inpaint towards; a request
  carrying ``continuation`` is refused by name (``PolicyInfo.continuations``).

Registered as ``zero_wam`` (not a ``lingbot_va`` embodiment): its checkpoint holds another transformer class, its
episodes take options LingBot-VA's do not (a demonstration root, in-context guidance), and ``/info`` names the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ardiff_policies.base import RuntimeOptions, StartRefused, StepResult
from ardiff_policies.chunk import ChunkInfo
from ardiff_policies.episode import EpisodeCall, EpisodeStart
from ardiff_policies.info import PolicyInfo
from ardiff_policies.lingbot_va.config import BUILTIN_TINY, SYNTHETIC_PREFIX
from ardiff_policies.lingbot_va.embodiments import ZERO_WAM_ROBOTWIN
from ardiff_policies.lingbot_va.episode_io import TEXT_LENGTH
from ardiff_policies.lingbot_va.policy import FRAMES_PER_LATENT, MAX_BATCH, LingBotVAServing, ServedSession, _openpi
from ardiff_policies.lingbot_va.zero_wam_config import BUILTIN_DEMONSTRATIONS, MAX_GUIDANCE, ZeroWAMPolicyConfig
from ardiff_policies.lingbot_va.zero_wam_demonstration import DemonstrationGeometry
from ardiff_policies.lingbot_va.zero_wam_episode import CommitRequest, EpisodeError, InferRequest, ZeroWAMPolicy
from ardiff_policies.observation import RobotObservation, UnsupportedObservation

logger = logging.getLogger(__name__)

DEMONSTRATION_KEY = "icl_demo_id"  # upstream's reset key, and the OpenPI request's on a session's first call


class ZeroWAMServing(LingBotVAServing):
    family = "zero_wam"

    def __init__(self, episodes: ZeroWAMPolicy, config: ZeroWAMPolicyConfig, checkpoint: str, *, record: bool = False) -> None:
        super().__init__(episodes, config, checkpoint, record=record)  # type: ignore[arg-type]

    # -- what clients are told ------------------------------------------------------------------

    def _make_info(self) -> PolicyInfo:
        e, episodes = self.embodiment, self.episodes
        geometry = episodes.demonstrations
        commit_frames = {"first_chunk": FRAMES_PER_LATENT * (self.frames - 1), "later_chunks": FRAMES_PER_LATENT * self.frames}
        demonstration = {
            "key": DEMONSTRATION_KEY,
            "served": episodes.store is not None,
            "max_latent_frames": geometry.max_frames,
            "max_tokens": geometry.max_tokens,
            "video_guidance_scale": episodes.video_guidance_scale,
            "icl_guidance_scale": episodes.icl_guidance_scale,
            "guidance_max": MAX_GUIDANCE,
        }
        frame = {
            "embodiment": self.tag,
            "observation": self.schema.describe(),
            "frames_per_call": {"first": 1, "after_first_chunk": commit_frames["first_chunk"], "later": commit_frames["later_chunks"]},
            "actions": {
                "horizon": self.frames * self.per_frame,
                "dim": self.channels,
                "layout": "time-major (frames x actions per frame, channels); the RoboTwin wire: (channels, frames, actions per frame)",
                "execute_from": "the reply's session.execute_from: the first chunk's first frame of actions conditions the model and is not executed",
            },
            "needs_session_id": True,
            "continuations": False,
            "image_resolution": list(self.schema.resolutions[0]),
            "protocols": ["openpi", "lingbot_va"],
            # its presence tells the wire to read a reset's / a first call's demonstration keys (wire/fields.py)
            "demonstration": demonstration,
        }
        return PolicyInfo(
            frame,
            action_horizon=self.frames * self.per_frame,
            action_dim=self.channels,
            model=self.tag,
            checkpoint=self.checkpoint,
            details={
                "action_layout": {"channels": self.channels, "frames": self.frames, "per_frame": self.per_frame},
                "commit_frames": commit_frames,
                "layout": e.layout,
                "attn_window": episodes.transformer.config.attn_window,
                "seed": self.config.seed,
                "demonstration_root": None if episodes.store is None else str(episodes.store.root),
                "continuation": "not served: upstream keeps no K/V of a predicted action chunk for the next chunk to continue",
            },
            max_batch=MAX_BATCH,
            observation_schema=self.schema,
            native_protocol="lingbot_va",
            max_frames_per_call=max(commit_frames.values()),
            continuations=False,
        )

    # -- requests checked before any session state changes ---------------------------------------

    def check_observation(self, observation: RobotObservation) -> None:
        if observation.continuation is not None:
            raise UnsupportedObservation(
                "continuation: policy zero_wam does not continue chunks (upstream keeps no K/V of a predicted action chunk); leave it out"
            )
        call = observation.episode
        if call is not None and call.start is not None:
            self._check_start(call.start)
        if call is not None and call.kind == "reset":
            return  # no frames: the episode begins
        count = self._frame_count(observation)
        if call is not None and call.kind == "compute_kv_cache":
            commit_counts = {FRAMES_PER_LATENT * (self.frames - 1), FRAMES_PER_LATENT * self.frames}
            if count not in commit_counts:
                raise UnsupportedObservation(f"obs: {count} key frames; compute_kv_cache takes {sorted(commit_counts)} (4 per latent frame)")
        # an infer's guidance scales (upstream's client sends them with every infer) are not read: guidance is the episode's

    @staticmethod
    def _check_start(start: EpisodeStart) -> None:
        if start.video_guidance_scale is not None and not -MAX_GUIDANCE <= start.video_guidance_scale <= MAX_GUIDANCE:
            raise UnsupportedObservation(f"video_guidance_scale: {start.video_guidance_scale} outside [{-MAX_GUIDANCE:g}, {MAX_GUIDANCE:g}]")
        if start.icl_guidance_scale is not None and not 0.0 <= start.icl_guidance_scale <= MAX_GUIDANCE:
            raise UnsupportedObservation(f"icl_guidance_scale: {start.icl_guidance_scale} outside [0, {MAX_GUIDANCE:g}]")

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
            if call is not None and call.kind == "reset":
                results[i] = self._result(session, None, ChunkInfo(call="reset", execute_from=0))
                continue
            frames = self._frames(observation)
            if call is not None and call.kind == "compute_kv_cache":
                commits.append((i, CommitRequest(session.episode, frames)))
            elif _openpi(call) and session.last_actions is not None:  # OpenPI: these frames close the chunk out
                expected = FRAMES_PER_LATENT * (self.frames - (session.episode.chunk == 0))
                if len(frames) != expected:  # e.g. the session's first request again
                    results[i] = EpisodeError(
                        f"observation: {len(frames)} frame{'s' * (len(frames) != 1)} per camera; this session has a chunk out, "
                        f"which the {expected} key frames seen while executing it commit (4 per latent frame); a new episode "
                        f"is a new session_id or a reset"
                    )
                    continue
                commits.append((i, CommitRequest(session.episode, frames)))
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
            if _openpi(observation.episode) and session.episode.chunk == 0:
                frames = frames[-1:]  # an OpenPI episode starts from one observation (of a stack, the newest)
            requests.append(InferRequest(session.episode, frames[0] if len(frames) == 1 else frames))
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
                episode = session.episode
                kind = "commit+infer" if session.committed else "infer"
                results[i] = self._result(session, outcome, ChunkInfo(episode.served, 0, None, kind, self.per_frame if episode.chunk == 0 else 0))
        for i, (session, _) in enumerate(items):
            if results[i] is None:  # a commit only (upstream's compute_kv_cache)
                results[i] = self._result(session, None, ChunkInfo(call="compute_kv_cache", execute_from=0))
        if self.record:
            for (session, observation), result in zip(items, results):
                if isinstance(result, StepResult) and result.chunk.call != "reset":
                    result.recording = self._recording(session, observation, result)
        return results  # type: ignore[return-value]

    def _begin(self, session: ServedSession, observation: RobotObservation) -> None:
        """A session's first step begins its episode (prompt, guidance, demonstration pinned, generator seeded); a later
        one may repeat how it began, not change it."""
        call = observation.episode
        start = call.start if call is not None else None
        prompt = observation.prompt or ""
        if session.prompt is not None:
            if observation.prompt is not None and prompt != session.prompt:
                raise EpisodeError(f"prompt: {prompt!r} differs from this episode's {session.prompt!r}; reset the session for a new task")
            if call is not None and call.kind == "reset":
                raise EpisodeError("reset: this session's episode has begun; end it first (a new session_id or an OpenPI reset)")
            if start is not None:
                self._check_same_start(session, start)
            return
        started = time.perf_counter()
        pending, session.pending_text = session.pending_text, None
        embedding = pending[1] if pending is not None and pending[0] == prompt else None
        self.episodes.begin(session.episode, prompt, start, self.config.seed, prompt_embedding=embedding)
        session.prompt = prompt
        session.timing_ms["begin"] = (time.perf_counter() - started) * 1000.0

    def _check_same_start(self, session: ServedSession, start: EpisodeStart) -> None:
        began = session.episode.start
        asked = {
            "use_icl": start.use_icl,
            DEMONSTRATION_KEY: start.demonstration_id,
            "video_guidance_scale": start.video_guidance_scale,
            "icl_guidance_scale": start.icl_guidance_scale,
        }
        has = {
            "use_icl": began.use_icl,
            DEMONSTRATION_KEY: began.demonstration_id,
            "video_guidance_scale": began.video_guidance_scale,
            "icl_guidance_scale": began.icl_guidance_scale,
        }
        for key, value in asked.items():
            if value is not None and value != has[key]:
                raise EpisodeError(f"{key}: {value!r} differs from this episode's {has[key]!r}; an episode begins once (a new session_id or a reset)")

    def _result(self, session: ServedSession, actions: np.ndarray | None, chunk: ChunkInfo) -> StepResult:
        result = super()._result(session, actions, chunk)
        episode = session.episode
        if episode.plan is not None:
            result.info.update(guidance=episode.plan.mode.value, demonstration=episode.start.demonstration_id if episode.plan.demonstration else None)
        return result

    def warmup_observations(self) -> Iterator[RobotObservation]:
        """One episode over the OpenPI wire with text guidance (both branches run): the first frame, then the key frames
        of the first and of a later chunk."""
        start = EpisodeCall("chunk", start=EpisodeStart(use_icl=False, video_guidance_scale=5.0))
        for index, count in enumerate((1, FRAMES_PER_LATENT * (self.frames - 1), FRAMES_PER_LATENT * self.frames)):
            cameras = {name: np.zeros((count, h, w, 3), np.uint8) for name, (h, w) in zip(self.cameras, self.schema.resolutions)}
            yield RobotObservation(cameras=cameras, states={}, prompt="warm up", episode=start if index == 0 else None)


def embodiment_by_name(name: str):
    from ardiff_policies.lingbot_va.zero_wam_tiny import TINY_DEMONSTRATIONS, TINY_ZERO_WAM_EMBODIMENT

    return {"robotwin": (ZERO_WAM_ROBOTWIN, DemonstrationGeometry()), "tiny_robotwin": (TINY_ZERO_WAM_EMBODIMENT, TINY_DEMONSTRATIONS)}[name]


def load_empty_text(path: Path, text_dim: int) -> torch.Tensor:
    """Upstream's ``empty_text_emb_path``: a (512, text_dim) tensor (``weights_only``), as (1, 512, text_dim)."""
    try:
        tensor = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise StartRefused(f"policy.empty_text_embedding: cannot read {path} ({type(exc).__name__}: {exc})") from None
    if not torch.is_tensor(tensor) or tuple(tensor.shape) != (TEXT_LENGTH, text_dim) or not tensor.is_floating_point():
        shape = tuple(tensor.shape) if torch.is_tensor(tensor) else type(tensor).__name__
        raise StartRefused(f"policy.empty_text_embedding: {path} holds {shape}; expected a ({TEXT_LENGTH}, {text_dim}) float tensor")
    return tensor[None]


def build_zero_wam(config: ZeroWAMPolicyConfig, options: RuntimeOptions) -> ZeroWAMServing:
    for name, value in (("engine.compile", options.compile), ("engine.cuda_graphs", options.cuda_graphs)):
        if value:
            raise StartRefused(f"{name}: not supported by the zero_wam policy yet; unset it")
    if options.guidance.is_parallel:
        raise StartRefused("engine.cfg_parallel_size: zero_wam runs both CFG branches in one process; set it to 1")
    embodiment, geometry = embodiment_by_name(config.embodiment_name)
    geometry = DemonstrationGeometry(geometry.latent_size, config.demonstration_frames, geometry.rope_row_offset)
    dtype = getattr(torch, options.dtype)
    root = config.demonstration_root
    if root == BUILTIN_DEMONSTRATIONS:
        from ardiff_policies.lingbot_va.zero_wam_tiny import ensure_tiny_demonstrations

        root = ensure_tiny_demonstrations()
    keywords = {
        "demonstrations": geometry,
        "demonstration_root": root,
        "video_guidance_scale": config.video_guidance_scale,
        "icl_guidance_scale": config.icl_guidance_scale,
    }
    if config.checkpoint.startswith(SYNTHETIC_PREFIX):
        from ardiff_policies.lingbot_va.synthetic import synthetic_zero_wam_policy

        episodes = synthetic_zero_wam_policy(config.checkpoint, embodiment, device=options.device, dtype=dtype, **keywords)
        return ZeroWAMServing(episodes, config, config.checkpoint, record=options.record)
    if config.checkpoint == BUILTIN_TINY:
        from ardiff_policies.lingbot_va.zero_wam_tiny import ensure_tiny_zero_wam_checkpoint

        checkpoint = ensure_tiny_zero_wam_checkpoint()
    else:
        checkpoint = config.local_checkpoint()
    if config.empty_text_embedding is not None:
        from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig

        text_dim = ZeroWAMConfig.from_file(Path(checkpoint) / "transformer" / "config.json").base.text_dim
        path = config.model_copy(update={"checkpoint": str(checkpoint)}).empty_text_path()
        keywords["empty_text"] = load_empty_text(path, text_dim)
    try:
        episodes = ZeroWAMPolicy.load(checkpoint, embodiment, device=options.device, dtype=dtype, **keywords)
    except ValueError as exc:  # a window the server cannot hold, an empty text of another shape: named at start-up
        raise StartRefused(f"policy.checkpoint: {exc}") from None
    from ardiff_policies.lingbot_va.zero_wam_memory import describe_loaded

    logger.info("%s", describe_loaded(episodes, options.max_sessions))
    return ZeroWAMServing(episodes, config, str(checkpoint), record=options.record)
