"""Zero-WAM behind the engine's :class:`~ardiff_policies.base.Policy` interface: a variant of LingBot-VA's
(:class:`~ardiff_policies.lingbot_va.policy.LingBotVAPolicy`, whose sessions, recordings and replies it keeps) over
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
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ardiff_policies.base import RuntimeOptions, StartRefused, StepResult
from ardiff_policies.chunk import ChunkInfo
from ardiff_policies.episode import EpisodeCall, EpisodeStart
from ardiff_policies.inference_steps import StepBounds
from ardiff_policies.info import PolicyInfo
from ardiff_policies.lingbot_va.config import BUILTIN_TINY, SYNTHETIC_PREFIX
from ardiff_policies.lingbot_va.embodiments import ZERO_WAM_ROBOTWIN
from ardiff_policies.lingbot_va.episode_io import TEXT_LENGTH
from ardiff_policies.lingbot_va.policy import FRAMES_PER_LATENT, LingBotVAPolicy, ServedSession
from ardiff_policies.lingbot_va.zero_wam_config import BUILTIN_DEMONSTRATIONS, MAX_GUIDANCE, ZeroWAMPolicyConfig
from ardiff_policies.lingbot_va.zero_wam_demonstration import DemonstrationGeometry
from ardiff_policies.lingbot_va.zero_wam_episode import CommitRequest, EpisodeError, InferRequest, ZeroWAMEpisodes
from ardiff_policies.observation import RobotObservation, UnsupportedObservation

logger = logging.getLogger(__name__)

DEMONSTRATION_KEY = "icl_demo_id"  # upstream's reset key, and the OpenPI request's on a session's first call


class ZeroWAMPolicy(LingBotVAPolicy):
    family = "zero_wam"

    def __init__(self, episodes: ZeroWAMEpisodes, config: ZeroWAMPolicyConfig, checkpoint: str, *, record: bool = False) -> None:
        super().__init__(episodes, config, checkpoint, record=record)  # type: ignore[arg-type]

    # -- what clients are told ------------------------------------------------------------------

    def _make_info(self) -> PolicyInfo:
        episodes = self.episodes
        geometry = episodes.demonstrations
        demonstration = {
            "key": DEMONSTRATION_KEY,
            "served": episodes.store is not None,
            "max_latent_frames": geometry.max_frames,
            "max_tokens": geometry.max_tokens,
            "video_guidance_scale": episodes.video_guidance_scale,
            "icl_guidance_scale": episodes.icl_guidance_scale,
            "guidance_max": MAX_GUIDANCE,
        }
        # "demonstration": its presence tells the wire to read a reset's / a first call's demonstration keys (wire/fields.py)
        frame = {**self._frame(), "continuations": False, "demonstration": demonstration}
        details = {
            "attn_window": episodes.transformer.config.attn_window,
            "demonstration_root": None if episodes.store is None else str(episodes.store.root),
            "continuation": "not served: upstream keeps no K/V of a predicted action chunk for the next chunk to continue",
        }
        return self._policy_info(frame, details, continuations=False)

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

    def _without_chunk(self, session: ServedSession, call: EpisodeCall | None) -> StepResult | None:
        """Upstream's reset: the episode has begun (``_begin``), no chunk."""
        return self._result(session, None, ChunkInfo(call="reset", execute_from=0)) if call is not None and call.kind == "reset" else None

    def _first_chunk(self, session: ServedSession) -> bool:
        return session.episode.chunk == 0

    def _commit_request(self, session: ServedSession, frames: list[dict[str, np.ndarray]], actions: np.ndarray | None) -> CommitRequest:
        return CommitRequest(session.episode, frames)  # the history is the model's own actions: what the robot did is not read

    def _infer_request(self, session: ServedSession, observation: RobotObservation, frames) -> InferRequest:
        return InferRequest(session.episode, frames)

    def _chunk_info(self, session: ServedSession, kind: str) -> ChunkInfo:
        episode = session.episode
        return ChunkInfo(episode.served, 0, None, kind, self.per_frame if episode.chunk == 0 else 0)

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

    def _step_bounds(self) -> dict[str, StepBounds]:
        """None: its episode logic runs the embodiment's steps only, so a request's are refused by name (PolicyInfo)."""
        return {}

    def _ran(self, session: ServedSession) -> dict:
        return {}

    def _result(self, session: ServedSession, actions: np.ndarray | None, chunk: ChunkInfo, ran: dict | None = None) -> StepResult:
        result = super()._result(session, actions, chunk, ran)
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


def build_zero_wam(config: ZeroWAMPolicyConfig, options: RuntimeOptions) -> ZeroWAMPolicy:
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
        return ZeroWAMPolicy(episodes, config, config.checkpoint, record=options.record)
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
        episodes = ZeroWAMEpisodes.load(checkpoint, embodiment, device=options.device, dtype=dtype, **keywords)
    except ValueError as exc:  # a window the server cannot hold, an empty text of another shape: named at start-up
        raise StartRefused(f"policy.checkpoint: {exc}") from None
    from ardiff_policies.lingbot_va.zero_wam_memory import describe_loaded

    logger.info("%s", describe_loaded(episodes, options.max_sessions))
    return ZeroWAMPolicy(episodes, config, str(checkpoint), record=options.record)
