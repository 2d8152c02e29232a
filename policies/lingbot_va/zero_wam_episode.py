"""Zero-WAM's episode logic: ``reset`` / ``infer`` / ``compute_kv_cache`` over a session's paged KV, with upstream's
semantics (jianwenli96/Zero-WAM ``wan_va/wan_va_server.py``: ``_reset_icl``, ``_cache_icl_context``, ``_infer_icl``,
``_compute_icl_kv_cache``; docs/zero-wam.md).

Upstream packs classifier-free guidance along the sequence axis (one batch row; the conditional and unconditional
halves told apart by sequence ids); here each half is a CFG branch of the paged cache, which is the same attention
(a query sees only its own half's keys). Per episode (:func:`~ardiff_policies.lingbot_va.zero_wam_guidance.plan_guidance`):
in-context guidance (both halves the target text, only the conditional one sees the demonstration), text guidance
(the unconditional half the empty text) or one half. The conditional branch holds the pinned demonstration, the
observed video and the action history; the unconditional one the observed video only (``KVSpec.pinned_branches``,
``uncond_window_pages``). The window is upstream's, in frame ids (``KVSpec.frame_window``): chunk ``c``'s video at frame
``2c``, its actions at ``2c + 1``, the demonstration at 0 outside the window.

* ``reset`` (:meth:`ZeroWAMEpisodes.begin`): the prompt through UMT5; the target text is the empty one when
  ``video_guidance_scale < 0`` (the stored empty embedding where the deployment names one, as upstream's
  ``empty_text_emb_path``); the window and the VAE stream start empty; the generator is seeded; with a demonstration,
  one forward of its latents at t = 0 (its own text, else the prompt's; RoPE rows offset by ``icl_rope_h``) writes it
  as pinned in-context pages of the conditional branch;
* ``infer``: on the first chunk the observation is encoded (the stream restarted, the cameras side by side) and
  becomes latent frame 0 (timestep 0 in every half, re-imposed after every step); noise: the video, the actions, then
  one more draw of the actions' shape that is discarded (upstream's ``randn_like(actions)``); the video loop (FlowMatch
  Euler, then a trailing t = 0 forward that keeps the predicted chunk as prediction entries in every half it runs);
  then the action loop over the conditional branch only, without the pinned block, writing nothing (no trailing
  forward, no guidance); the chunk's normalized actions are kept as the action history (the first chunk's frame 0
  zeroed). A second infer before the commit stacks its prediction on the first's, as upstream's cache does; a third
  is refused by name;
* ``compute_kv_cache``: the predictions are dropped, the frames the robot saw are encoded (continuing the stream; the
  first chunk's observation before them) and written at t = 0 as observations in every half, the kept action history
  in the conditional branch (not the client's ``state``: upstream never reads it), then the window is trimmed.

Noise comes from a per-session generator seeded at reset (upstream's server draws from its global generator, never
seeded), in the model's dtype on the CPU, in upstream's order and shapes: seeded alike, an episode's draws equal
upstream's on a CPU (:meth:`ZeroWAMEpisodes.begin`).

Several robots' calls run batched (:meth:`ZeroWAMEpisodes.infer_batch`, :meth:`ZeroWAMEpisodes.compute_kv_cache_batch`;
each with its own guidance: the batch's rows are every session's halves). A refused request gets its
:class:`EpisodeError` before its session changes; a batched call that raises is undone for every member (KV
snapshot, VAE stream, generator, counters) and retried member by member (:func:`ardiff_policies.batch_retry.run_batched`),
and a lone call that raises is undone too where the pool has the room (:meth:`ZeroWAMEpisodes._transaction`): a failed
call leaves its session as it was.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan

from ardiff_kv import Branch, EntryKind, KVSpec, SessionKV, prepare_batch
from ardiff_policies.batch_retry import run_batched, single
from ardiff_policies.episode import EpisodeStart
from ardiff_policies.lingbot_va.embodiments import Embodiment
from ardiff_policies.lingbot_va.episode_io import LATENT_CHANNELS, TEXT_LENGTH, EpisodeError, EpisodeIO, Kept, StreamState, load_encoders, next_sigma
from ardiff_policies.lingbot_va.model import TextKV, video_grid
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig
from ardiff_policies.lingbot_va.zero_wam_demonstration import Demonstration, DemonstrationGeometry, DemonstrationStore
from ardiff_policies.lingbot_va.zero_wam_guidance import GuidanceMode, GuidancePlan, plan_guidance
from ardiff_policies.lingbot_va.zero_wam_model import ZeroWAMTransformer, expert_action_grid, load_zero_wam_transformer
from ardiff_policies.wan.samplers import flow_match_sigmas
from ardiff_policies.wan.text import TextEncoder
from ardiff_policies.wan.vae import StreamingEncoder

logger = logging.getLogger(__name__)

MAX_PREDICTIONS = 2  # infers of one chunk before its commit: upstream stacks them; the reservation holds two
T = TypeVar("T")


def kv_spec(embodiment: Embodiment, cfg: ZeroWAMConfig, demonstrations: DemonstrationGeometry, dtype: torch.dtype) -> KVSpec:
    """Pages of gcd(video tokens per chunk, action tokens per chunk, a demonstration frame's tokens), so that every chunk
    and every demonstration of the geometry's frame size, of any frame count, is whole pages; upstream's window in frame
    ids (the model's ``attn_window``): after a trim the conditional branch holds W // 2 chunks' video and (W + 1) // 2
    chunks' actions, the unconditional one the video only; the demonstration pinned in the conditional branch, at most
    ``demonstrations.max_tokens``."""
    video, action = embodiment.video_tokens_per_chunk, embodiment.action_tokens_per_chunk
    page = math.gcd(video, action, demonstrations.tokens_per_frame)
    v, a = video // page, action // page
    window = cfg.attn_window
    if window < 2:
        raise ValueError(f"zero-wam: attn_window {window}: serving needs a window of at least 2 frame ids (-1, unbounded, holds every chunk)")
    base = cfg.base
    return KVSpec(
        num_layers=base.num_layers,
        num_heads=base.num_attention_heads,
        head_dim=base.attention_head_dim,
        page_size=page,
        window_pages=(window // 2) * v + ((window + 1) // 2) * a,
        uncond_window_pages=(window // 2) * v,
        max_new_pages=max(v, a),
        chunk_pages=v + a,
        frame_window=window,
        # a commit that may be undone keeps the predictions it drops (up to MAX_PREDICTIONS chunks' video) beside its
        # new observation: what that holds beyond the branch's reservation
        undo_pages=max(0, MAX_PREDICTIONS * v + 1 - max(v, a)),
        max_pinned_pages=-(-demonstrations.max_tokens // page),
        pinned_branches=(Branch.COND,),
        dtype=dtype,
    )


@dataclass
class ZeroWAMSession:
    session_id: str
    kv: SessionKV
    streams: tuple[StreamingEncoder, ...]  # one: the cameras side by side
    chunk_frames: int  # latent frames per chunk (the embodiment's)
    generator: torch.Generator = field(default_factory=torch.Generator)
    plan: GuidancePlan | None = None  # the episode's guidance (None: not begun)
    start: EpisodeStart | None = None  # how it began (its demonstration id, scales as resolved)
    text_kv: list[TextKV] | None = None  # per layer, one row per half: [target, target or empty]
    chunk: int = 0  # upstream's chunk_idx: chunks committed
    init_latent: torch.Tensor | None = None  # the first chunk's encoded observation, until its commit
    action_history: torch.Tensor | None = None  # the last infer's normalized actions (upstream last_predicted_actions)
    predictions: int = 0  # infers since the last commit (their prediction entries are in the KV)
    served: int = 0  # chunks served this episode: the last one's chunk_id
    predicted_latents: torch.Tensor | None = None  # the last infer's denoised video, when the policy keeps it (recordings)
    predicted_actions: torch.Tensor | None = None  # and its normalized actions (1, 30, F, N, 1)

    @property
    def frame_start(self) -> int:
        """The first latent frame of the chunk being predicted (its RoPE time)."""
        return self.chunk * self.chunk_frames

    @property
    def halves(self) -> tuple[Branch, ...]:
        return (Branch.COND, Branch.UNCOND) if self.plan is not None and self.plan.halves == 2 else (Branch.COND,)


@dataclass(frozen=True)
class InferRequest:
    session: ZeroWAMSession
    observation: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]]  # read on the episode's first chunk


@dataclass(frozen=True)
class CommitRequest:
    session: ZeroWAMSession
    frames: Sequence[Mapping[str, np.ndarray]]  # the key frames the robot saw while executing the chunk


@dataclass
class _Saved:
    """A session as it was before a call, to put back if the call fails."""

    session: ZeroWAMSession
    streams: StreamState
    values: tuple

    _FIELDS = ("chunk", "init_latent", "action_history", "predictions", "served", "predicted_latents", "predicted_actions")

    @classmethod
    def take(cls, session: ZeroWAMSession) -> _Saved:
        session.kv.snapshot()
        return cls(session, StreamState.of(session), tuple(getattr(session, name) for name in cls._FIELDS))

    def restore(self) -> None:
        self.session.kv.rollback()
        self.streams.restore(self.session)
        for name, value in zip(self._FIELDS, self.values):
            setattr(self.session, name, value)

    def release(self) -> None:
        self.session.kv.release()


@dataclass(frozen=True)
class _Row:
    """One sequence of a batched forward: a session's half."""

    slot: int  # the session's place in the batch (its scratch region)
    session: ZeroWAMSession
    branch: Branch


class ZeroWAMEpisodes(EpisodeIO):
    def __init__(
        self,
        transformer: ZeroWAMTransformer,
        vae: AutoencoderKLWan,
        text_encoder: TextEncoder,
        tokenizer,
        embodiment: Embodiment,
        *,
        demonstrations: DemonstrationGeometry | None = None,
        demonstration_root: str | Path | None = None,
        video_guidance_scale: float = -1.0,
        icl_guidance_scale: float = 5.0,
        empty_text: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        cfg = transformer.config
        if cfg.base.action_dim != embodiment.action_dim:
            raise ValueError(f"the transformer has {cfg.base.action_dim} action channels, the embodiment {embodiment.action_dim}")
        if embodiment.layout != "none":
            raise ValueError("zero-wam: the cameras are served side by side (upstream encodes the first observation so); layout must be none")
        super().__init__(vae, text_encoder, tokenizer, embodiment, device=device, dtype=dtype)
        self.transformer = transformer
        self.demonstrations = demonstrations = demonstrations or DemonstrationGeometry()
        # the deployment's defaults for a reset that does not say (upstream's launch: TARGET_TEXT_CFG -1, ICL_CFG 5)
        self.video_guidance_scale, self.icl_guidance_scale = float(video_guidance_scale), float(icl_guidance_scale)
        self.store = (
            None
            if demonstration_root is None
            else DemonstrationStore(Path(demonstration_root), LATENT_CHANNELS, cfg.base.text_dim, demonstrations.max_tokens, TEXT_LENGTH)
        )
        self._spec = kv_spec(embodiment, cfg, demonstrations, dtype)
        if empty_text is None:
            with torch.no_grad():
                empty_text = self.encode_text([""])
        elif tuple(empty_text.shape) != (1, TEXT_LENGTH, cfg.base.text_dim):
            raise ValueError(f"zero-wam: the empty text embedding is {tuple(empty_text.shape)}, expected (1, {TEXT_LENGTH}, {cfg.base.text_dim})")
        self.empty_text = empty_text.to(self.device, self.dtype)  # upstream's negative_prompt_embeds

    @classmethod
    def load(cls, checkpoint: str | Path, embodiment: Embodiment, *, device="cpu", dtype=torch.float32, **options: Any) -> ZeroWAMEpisodes:
        """A released checkpoint directory (``transformer/``: ``WanICLTransformer3DModel``; ``vae/``, ``text_encoder/``,
        ``tokenizer/``); ``options``: the constructor's keywords."""
        root = Path(checkpoint)
        transformer = load_zero_wam_transformer(root / "transformer", dtype=dtype, device=device)
        vae, text, tokenizer = load_encoders(root, device=device, dtype=dtype)
        return cls(transformer, vae, text, tokenizer, embodiment, device=device, dtype=dtype, **options)

    def kv_spec(self) -> KVSpec:
        return self._spec

    @property
    def branches(self) -> tuple[Branch, ...]:
        """Both CFG branches, always: guidance is decided per episode, and a session without it never touches the
        unconditional one (its pages are allocated lazily)."""
        return (Branch.COND, Branch.UNCOND)

    # -- sessions ----------------------------------------------------------------------------

    def start_session(self, session_id: str, kv: SessionKV) -> ZeroWAMSession:
        return ZeroWAMSession(session_id, kv, (StreamingEncoder(self.vae),), self.embodiment.frame_chunk_size)

    @torch.no_grad()
    def encode_prompt(self, prompt: str) -> torch.Tensor:
        """The prompt's UMT5 embeddings (1, 512, text_dim) (touches no session: the engine's encoder thread may run it)."""
        return self.encode_text([prompt])

    def resolve(self, start: EpisodeStart | None) -> EpisodeStart:
        """A request's episode start with the deployment's defaults filled in; ``use_icl`` not said: whether it names a
        demonstration (upstream's RoboTwin client always says it; an OpenPI session's first call may not)."""
        start = start or EpisodeStart()
        return EpisodeStart(
            start.demonstration_id is not None if start.use_icl is None else start.use_icl,
            start.demonstration_id,
            self.video_guidance_scale if start.video_guidance_scale is None else start.video_guidance_scale,
            self.icl_guidance_scale if start.icl_guidance_scale is None else start.icl_guidance_scale,
        )

    def check_begin(self, prompt: object, start: EpisodeStart | None) -> tuple[GuidancePlan, EpisodeStart, Demonstration | None]:
        """The episode a reset asks for, or EpisodeError naming the key (nothing has changed): its guidance, its start
        as resolved, its demonstration loaded and checked."""
        if not isinstance(prompt, str) or not prompt.strip():
            # upstream: "Robotwin ICL inference requires a prompt" (even where the target text is the empty one)
            raise EpisodeError(f"prompt: Zero-WAM's episode needs the task's prompt (a non-empty string), got {prompt!r}")
        start = self.resolve(start)
        plan = plan_guidance(use_icl=start.use_icl, video_guidance_scale=start.video_guidance_scale, icl_guidance_scale=start.icl_guidance_scale)
        if not plan.demonstration:
            return plan, start, None
        if start.demonstration_id is None:
            raise EpisodeError("icl_demo_id: missing; use_icl is true (name the demonstration, or send use_icl: false)")
        if self.store is None:
            raise EpisodeError("icl_demo_id: this server has no demonstration root (policy.demonstration_root); send use_icl: false")
        demo = self.store.load(start.demonstration_id)
        tokens, page = demo.tokens(), self._spec.page_size
        if tokens % page:
            raise EpisodeError(
                f"icl_demo_id {start.demonstration_id!r}: {tokens} tokens, not a whole number of the cache's {page}-token pages "
                f"(latent frames x height / 2 x width / 2)"
            )
        return plan, start, demo

    @torch.no_grad()
    def begin(
        self, session: ZeroWAMSession, prompt: str, start: EpisodeStart | None, seed: int, prompt_embedding: torch.Tensor | None = None
    ) -> None:
        """A new episode (upstream ``_reset_icl``): its guidance, texts and demonstration; the window, the VAE stream
        and the generator (seeded) start anew. ``prompt_embedding``: :meth:`encode_prompt`'s, made beforehand. A bad
        request raises EpisodeError with the session unchanged; a failed forward leaves it not begun."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise EpisodeError(f"seed: expected a non-negative integer, got {seed!r}")
        plan, start, demo = self.check_begin(prompt, start)
        embedding = prompt_embedding if prompt_embedding is not None else self.encode_prompt(prompt)
        target = self.empty_text if plan.target_text_empty else embedding
        texts = [target] if plan.mode is GuidanceMode.NONE else [target, target if plan.mode is GuidanceMode.IN_CONTEXT else self.empty_text]
        text_kv = self.transformer.project_text(torch.cat(texts))
        session.kv.restart_window()
        for stream in session.streams:
            stream.clear()
        session.generator = torch.Generator().manual_seed(seed)
        session.plan, session.start, session.text_kv = plan, start, text_kv
        session.chunk = session.predictions = session.served = 0
        session.init_latent = session.action_history = session.predicted_latents = session.predicted_actions = None
        if demo is None:
            return
        try:
            self._pin(session, demo, embedding)
        except BaseException:
            session.kv.restart_window()
            session.plan = session.start = session.text_kv = None
            raise

    def _pin(self, session: ZeroWAMSession, demo: Demonstration, prompt_embedding: torch.Tensor) -> None:
        """The demonstration's one forward at t = 0 (upstream ``_cache_icl_context``): its latents at their own time
        coordinates with the RoPE rows offset, all at frame id 0 (bidirectional), its own text or the prompt's, kept
        as pinned in-context pages of the conditional branch."""
        latent = demo.latent.to(self.device, self.dtype)
        _, _, frames, h, w = latent.shape
        grid = video_grid(frames, h // 2, w // 2, 0)
        grid[1] += self.demonstrations.rope_row_offset
        text = demo.text_embedding.to(self.device, self.dtype) if demo.text_embedding is not None else prompt_embedding
        ctx = session.kv.begin_forward(Branch.COND, num_video_tokens=grid.shape[1], commit=True, entry=EntryKind.IN_CONTEXT)
        try:
            self.transformer(
                latent,
                torch.zeros(1, frames, device=self.device),
                grid.unsqueeze(0).to(self.device),
                self.transformer.project_text(text),
                action_mode=False,
                self_kv=ctx.prepare(self.device),
            )
        except BaseException:
            session.kv.abort(Branch.COND)
            raise
        session.kv.complete(Branch.COND)

    # -- the transformer over the sessions' pages --------------------------------------------------

    def _forward(
        self,
        rows: Sequence[_Row],
        x: torch.Tensor,
        timesteps: torch.Tensor,
        grids: torch.Tensor,
        text_kv: list[TextKV],
        *,
        action_mode: bool,
        entry: EntryKind | None,
        frames: Sequence[int],
    ) -> torch.Tensor:
        """One forward of several sessions' halves (``rows``; ``x``, ``timesteps``, ``grids``, ``text_kv``: a row each).
        ``entry``: the entries it keeps (None: scratch, a denoising step); ``frames``: each row's frame id. Action
        forwards never see the pinned block."""
        contexts = [
            row.session.kv.begin_forward(
                row.branch,
                num_video_tokens=grids.shape[2],
                commit=entry is not None,
                entry=entry or EntryKind.OBSERVATION,
                scratch_slot=row.slot,
                attend_pinned=not action_mode,
                frame=frame,
            )
            for row, frame in zip(rows, frames)
        ]
        try:
            out = self.transformer(x, timesteps, grids, text_kv, action_mode=action_mode, self_kv=prepare_batch(contexts, self.device))
        except BaseException:
            for row in rows:
                row.session.kv.abort(row.branch)
            raise
        for row in rows:
            row.session.kv.complete(row.branch)
        return out

    @staticmethod
    def _rows(sessions: Sequence[ZeroWAMSession], *, halves: bool) -> list[_Row]:
        """Every session's halves (``halves``) or its conditional branch only, in session order."""
        return [_Row(slot, s, b) for slot, s in enumerate(sessions) for b in (s.halves if halves else (Branch.COND,))]

    @staticmethod
    def _text_kv(rows: Sequence[_Row]) -> list[TextKV]:
        """Every layer's cross-attention K/V of the rows (made once per call, not per step)."""
        layers = []
        for layer in range(len(rows[0].session.text_kv)):
            keys = [row.session.text_kv[layer][0][int(row.branch) : int(row.branch) + 1] for row in rows]
            values = [row.session.text_kv[layer][1][int(row.branch) : int(row.branch) + 1] for row in rows]
            layers.append((torch.cat(keys), torch.cat(values)))
        return layers

    @staticmethod
    def _guide(pred: torch.Tensor, sessions: Sequence[ZeroWAMSession]) -> torch.Tensor:
        """Each session's video velocity from its rows: ``uncond + scale (cond - uncond)`` with two halves (upstream's
        ``noise.chunk(2)`` over the sequence axis), its one row otherwise."""
        out, row = [], 0
        for s in sessions:
            if len(s.halves) == 2:
                cond, uncond = pred[row : row + 1], pred[row + 1 : row + 2]
                out.append(uncond + s.plan.scale * (cond - uncond))
            else:
                out.append(pred[row : row + 1])
            row += len(s.halves)
        return torch.cat(out)

    @staticmethod
    def _by_row(values: torch.Tensor, rows: Sequence[_Row], sessions: Sequence[ZeroWAMSession]) -> torch.Tensor:
        """A tensor of one entry per session -> one per row (a session's halves repeat it)."""
        index = {id(s): i for i, s in enumerate(sessions)}
        return values[[index[id(row.session)] for row in rows]]

    # -- the two calls ---------------------------------------------------------------------------

    def infer(self, session: ZeroWAMSession, observation: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
        """One chunk: actions (len(used channels), frame_chunk_size, action_per_frame) float32."""
        return single(self.infer_batch([InferRequest(session, observation)]))

    @torch.no_grad()
    def infer_batch(self, requests: Sequence[InferRequest]) -> list[np.ndarray | Exception]:
        """One chunk for each of several distinct sessions, in one forward per denoising step. A refused request gets
        its EpisodeError in its place, before anything of its session changed; see the module's docstring for a
        failed batch."""
        if len({id(r.session) for r in requests}) != len(requests):
            raise ValueError("a batch takes each session once")
        results: list[np.ndarray | Exception | None] = [None] * len(requests)
        accepted: list[tuple[int, ZeroWAMSession, list]] = []
        for i, request in enumerate(requests):
            try:
                accepted.append((i, request.session, self._check_infer(request)))
            except Exception as exc:  # an EpisodeError: refused, its session unchanged
                results[i] = exc
        for (i, _, _), outcome in zip(accepted, self._run(accepted, self._infer)):
            results[i] = outcome
        return results

    def _check_infer(self, request: InferRequest) -> list:
        """The first chunk's one observation (empty for later chunks), or EpisodeError naming the key."""
        session = request.session
        if session.plan is None:
            raise EpisodeError("infer before reset: send {reset: True, prompt, use_icl, icl_demo_id} first")
        if session.predictions >= MAX_PREDICTIONS:
            raise EpisodeError(
                f"infer: chunk {session.chunk} was predicted {session.predictions} times without its compute_kv_cache; "
                "send compute_kv_cache with the frames the robot saw (or reset)"
            )
        if session.chunk:
            return []
        observation = request.observation
        frames = [observation] if isinstance(observation, Mapping) else list(observation)
        if len(frames) != 1:
            raise EpisodeError(f"obs: the first infer of an episode takes one observation, got {len(frames)}")
        self.check_frames(frames, "obs")
        return frames

    def _encode_first(self, session: ZeroWAMSession, frames: list) -> torch.Tensor:
        """The episode's first observation (upstream ``_encode_initial_obs``): the stream restarted, each camera mapped
        to [-1, 1] then resized, the cameras through the VAE as a batch and side by side: (1, 48, 1, h, w)."""
        e = self.embodiment
        videos = []
        for stack in self.camera_stacks(frames, "obs"):
            image = torch.from_numpy(np.ascontiguousarray(stack[0])).float().to(self.device) / 255.0 * 2.0 - 1.0
            image = F.interpolate(image.permute(2, 0, 1).unsqueeze(0), size=(e.height, e.width), mode="bilinear", align_corners=False)
            videos.append(image.unsqueeze(2))
        stream = session.streams[0]
        stream.clear()
        return self.side_by_side(self.normalize_latents(stream.encode(torch.cat(videos).to(self.dtype))))

    def _infer(self, accepted: list[tuple[int, ZeroWAMSession, list]]) -> list[np.ndarray]:
        """The chunk of every accepted request, in one forward per denoising step."""
        e = self.embodiment
        sessions = [s for _, s, _ in accepted]
        f, n = e.frame_chunk_size, e.action_per_frame
        h, w = e.latent_size
        for _, session, frames in accepted:
            if frames:
                session.init_latent = self._encode_first(session, frames)
        # noise: video, actions, and the draw upstream discards (randn_like(actions)), each session's own generator
        latents, actions = [], []
        for s in sessions:
            latents.append(self.draw(s.generator, 1, LATENT_CHANNELS, f, h, w))
            actions.append(self.draw(s.generator, 1, e.action_dim, f, n, 1))
            self.draw(s.generator, 1, e.action_dim, f, n, 1)
        latents = torch.cat(latents).to(self.device)
        actions = torch.cat(actions).to(self.device)
        first = [i for i, s in enumerate(sessions) if s.chunk == 0]
        conditioning = {i: sessions[i].init_latent[:, :, :1].to(self.dtype) for i in first}

        rows = self._rows(sessions, halves=True)
        text_kv = self._text_kv(rows)
        grids = torch.stack([video_grid(f, h // 2, w // 2, f * s.chunk) for s in sessions]).to(self.device)
        grids, frame_ids = self._by_row(grids, rows, sessions), [2 * row.session.chunk for row in rows]
        sigmas = flow_match_sigmas(e.num_inference_steps, e.snr_shift)
        for step in range(len(sigmas) + 1):  # the trailing t = 0 forward keeps the chunk's K/V
            last = step == len(sigmas)
            x = latents.clone()
            timesteps = torch.full((len(sessions), f), 0.0 if last else float(sigmas[step] * 1000), device=self.device)
            for i in first:  # the observed first frame, clean in every half
                x[i : i + 1, :, :1] = conditioning[i]
                timesteps[i, 0] = 0.0
            pred = self._forward(
                rows,
                self._by_row(x, rows, sessions),
                self._by_row(timesteps, rows, sessions),
                grids,
                text_kv,
                action_mode=False,
                entry=EntryKind.PREDICTION if last else None,
                frames=frame_ids,
            )
            if not last:
                latents = latents + self._guide(pred, sessions) * (next_sigma(sigmas, step) - sigmas[step])
                for i in first:
                    latents[i : i + 1, :, :1] = conditioning[i]

        unused = ~self.action_mask.to(self.device)
        rows = self._rows(sessions, halves=False)
        text_kv = self._text_kv(rows)
        grids = torch.stack([expert_action_grid(f, n, f * s.chunk) for s in sessions]).to(self.device)
        frame_ids = [2 * s.chunk + 1 for s in sessions]
        sigmas = flow_match_sigmas(e.action_num_inference_steps, e.action_snr_shift)
        for step in range(len(sigmas)):  # no trailing forward: the action loop keeps nothing
            x = actions.clone()
            x[:, unused] = 0
            timesteps = torch.full((len(sessions), f), float(sigmas[step] * 1000), device=self.device)
            pred = self._forward(rows, x, timesteps, grids, text_kv, action_mode=True, entry=None, frames=frame_ids)
            actions = actions + pred * (next_sigma(sigmas, step) - sigmas[step])
        actions[:, unused] = 0
        out = []
        for row, session in enumerate(sessions):
            history = actions[row : row + 1].clone()
            if session.chunk == 0:
                history[:, :, 0] = 0  # the first chunk's conditioning frame, as upstream's history holds it
            session.action_history = history
            session.predictions += 1
            session.served += 1
            if self.keep_predictions:
                session.predicted_latents = latents[row : row + 1].detach().clone()
                session.predicted_actions = actions[row : row + 1].detach().clone()
            out.append(self.denormalize_actions(actions[row : row + 1]))
        return out

    def compute_kv_cache(self, session: ZeroWAMSession, frames: Sequence[Mapping[str, np.ndarray]]) -> None:
        """What the robot saw: the predictions are dropped, these frames and the chunk's action history written."""
        single(self.compute_kv_cache_batch([CommitRequest(session, frames)]))

    @torch.no_grad()
    def compute_kv_cache_batch(self, requests: Sequence[CommitRequest]) -> list[Exception | None]:
        """:meth:`compute_kv_cache` for several distinct sessions, in one video and one action forward. A refused
        request gets its EpisodeError in place (its session unchanged); a member that failed alone its exception."""
        if len({id(r.session) for r in requests}) != len(requests):
            raise ValueError("a batch takes each session once")
        results: list[Exception | None] = [None] * len(requests)
        accepted: list[tuple[int, ZeroWAMSession, list]] = []
        for i, request in enumerate(requests):
            try:
                accepted.append((i, request.session, self._check_commit(request)))
            except Exception as exc:
                results[i] = exc
        for (i, _, _), outcome in zip(accepted, self._run(accepted, self._commit)):
            results[i] = outcome
        return results

    def _check_commit(self, request: CommitRequest) -> list:
        session, e = request.session, self.embodiment
        if session.plan is None:
            raise EpisodeError("compute_kv_cache before reset: send {reset: True, prompt, use_icl, icl_demo_id} first")
        if session.action_history is None:
            raise EpisodeError("compute_kv_cache before the episode's first infer")
        frames = [request.frames] if isinstance(request.frames, Mapping) else list(request.frames)
        # 4 frames per latent frame; the first chunk's frame 0 is the observation its infer encoded
        expected = 4 * (e.frame_chunk_size - (session.chunk == 0))
        if len(frames) != expected:
            raise EpisodeError(f"obs: {len(frames)} key frames; this chunk takes {expected} (4 per latent frame)")
        self.check_frames(frames, "obs")
        return frames

    def _commit(self, accepted: list[tuple[int, ZeroWAMSession, list]]) -> list[None]:
        """Every accepted commit in one video and one action forward (upstream ``_compute_icl_kv_cache``)."""
        e = self.embodiment
        sessions = [s for _, s, _ in accepted]
        f = e.frame_chunk_size
        h, w = e.latent_size
        latents = []
        for _, session, frames in accepted:
            session.kv.drop_predictions()  # clear_prediction_cache(-1): the observation replaces the prediction
            latent = self.encode_frames(session, frames, "obs")
            if session.chunk == 0:
                latent = torch.cat([session.init_latent, latent], dim=2)
            latents.append(latent.to(self.dtype))
        rows = self._rows(sessions, halves=True)
        grids = torch.stack([video_grid(f, h // 2, w // 2, f * s.chunk) for s in sessions]).to(self.device)
        self._forward(
            rows,
            self._by_row(torch.cat(latents), rows, sessions),
            torch.zeros(len(rows), f, device=self.device),
            self._by_row(grids, rows, sessions),
            self._text_kv(rows),
            action_mode=False,
            entry=EntryKind.OBSERVATION,
            frames=[2 * row.session.chunk for row in rows],
        )
        rows = self._rows(sessions, halves=False)  # the action history: the conditional half only
        grids = torch.stack([expert_action_grid(f, e.action_per_frame, f * s.chunk) for s in sessions]).to(self.device)
        self._forward(
            rows,
            torch.cat([s.action_history for s in sessions]).to(self.device, self.dtype),
            torch.zeros(len(rows), f, device=self.device),
            grids,
            self._text_kv(rows),
            action_mode=True,
            entry=EntryKind.OBSERVATION,
            frames=[2 * s.chunk + 1 for s in sessions],
        )
        for session in sessions:
            session.kv.trim_window(next_frame=2 * session.chunk + 2)  # clean_window_cache
            session.chunk += 1
            session.predictions = 0
            session.init_latent = None  # committed with the first chunk
        return [None] * len(sessions)

    # -- a failed call, member by member (ardiff_policies.batch_retry) ------------------------------

    def _run(self, accepted: list[tuple[int, ZeroWAMSession, list]], call: Callable[[list], list[T]]) -> list[T | Exception]:
        """``call`` over the accepted requests batched, each member retried alone if the batch fails; a lone call that
        fails, a retried member's too, is put back (:meth:`_transaction`)."""
        if len(accepted) == 1:
            return [self._transaction(accepted, call)]

        def attempt(items: list) -> list[T]:
            if len(items) > 1:
                return call(items)
            result = self._transaction(items, call)
            if isinstance(result, Exception):
                raise result
            return [result]

        return run_batched(accepted, attempt, undo=lambda items: self._keep([s for _, s, _ in items]), name=call.__name__.strip("_"))

    def _transaction(self, accepted: list[tuple[int, ZeroWAMSession, list]], call: Callable[[list], list[T]]) -> T | Exception:
        """One session's call; if it raises, the session as it was before (where the pool has the pages the undo
        keeps; otherwise the engine ends the session, as after any failed step). Returns its result or its error."""
        session = accepted[0][1]
        room = session.kv.pool.num_free >= self._undo_pages_per_session
        kept = Kept.take([session], _Saved.take) if room else None
        try:
            result = call(accepted)[0]
        except Exception as exc:
            if kept is not None:
                kept.restore()
            return exc
        if kept is not None:
            kept.release()
        return result

    def _keep(self, sessions: list[ZeroWAMSession]) -> Kept | None:
        """The sessions as they are, to put back if the call fails; None if the pool has no room to keep them."""
        return Kept.take(sessions, _Saved.take) if self._undo_fits(sessions, len(sessions)) else None
