"""LingBot-VA's episode logic: ``reset`` / ``infer`` / ``compute_kv_cache`` over a session's paged KV.

Upstream's server (``wan_va/wan_va_server.py``: ``_reset``, ``_infer``, ``_compute_kv_cache``) holds one robot in
module state; here every session is a :class:`LingBotVASession` (its KV pages, its VAE streams' feature caches, its
prompt's cross-attention K/V, its noise generator, its frame position), and the arithmetic is upstream's:

* ``reset``: the prompt and the negative prompt ``""`` through UMT5 (padded to 512, padding zeroed), projected once
  into every layer's cross-attention K/V; the KV window and the VAE streams start empty; the session's generator
  is seeded (upstream draws from the unseeded global generator: not reproducible);
* ``infer``: on the first chunk the observation is encoded and becomes latent frame 0 (timestep 0); then video
  noise, then action noise are drawn (a repeated first-chunk infer, before its commit, starts again from where the
  first did: :class:`StreamState`); the video loop (FlowMatch Euler, its timesteps padded with a trailing 0 whose
  forward only writes the predicted chunk's K/V, as prediction entries), then the action loop the same way; CFG
  over [prompt, negative] whenever either guidance scale is above 1;
* ``compute_kv_cache``: the prediction entries are dropped, the frames the robot saw and the actions it executed are
  written as observation entries (t = 0), and the frame position advances.

A continuation (this server's real-time chunking, :mod:`ardiff_policies.continuation`; not upstream's): an ``infer``
asked while the last chunk executes, ``executed`` e and ``delay`` d actions into it. The new chunk is the model's next
chunk, one chunk past the last one's frames; the last chunk's frames that are not committed yet are stood in for by
its own prediction entries (its trailing t = 0 forwards; written again from its kept latents and actions if a commit
dropped them), which the real frames replace when ``compute_kv_cache`` commits them. Its actions are inpainted
(:mod:`ardiff_policies.action_inpaint`) towards the last chunk's rows ``[e, H)``, RTC's soft mask from 1 on the first d
rows: the first d are the last chunk's ``[e, e + d)`` exactly. Without a continuation nothing of this runs.

Where this deliberately differs from upstream (docs/lingbot-va.md): the guidance scales a request carries are used
(bounded), upstream ignores them; so are the denoising steps it asks for (``num_inference_steps`` for the video loop,
``action_num_inference_steps`` for the action loop, upstream's config keys; absent: the embodiment's, upstream's
schedule exactly); noise comes from a per-session generator seeded at reset.

Several robots' calls run batched (``infer_batch`` / ``compute_kv_cache_batch``). If a batched call raises (a CUDA
error, one member's bad data, a bug), every member is put back as it was before the call (its KV pages and lengths:
:meth:`SessionKV.snapshot`; its VAE streams' feature caches; its generator; its frame position) and retried alone
(:func:`ardiff_policies.batch_retry.run_batched`, with :meth:`LingBotVAEpisodes._keep` as its undo): only a member that
fails alone fails, the others get what they would have got alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLWan

from ardiff_kv import Branch, EntryKind, KVSpec, SessionKV, prepare_batch
from ardiff_policies import action_inpaint
from ardiff_policies.batch_retry import run_batched, single
from ardiff_policies.continuation import APPLIED, Continuation, decide_for, soft_mask
from ardiff_policies.inference_steps import MAX_INFERENCE_STEPS
from ardiff_policies.lingbot_va.embodiments import Embodiment
from ardiff_policies.lingbot_va.episode_io import LATENT_CHANNELS, MAX_GUIDANCE, EpisodeError, EpisodeIO, Kept, StreamState, load_encoders, next_sigma
from ardiff_policies.lingbot_va.model import LingBotVATransformer, TextKV, action_grid, load_transformer, video_grid
from ardiff_policies.wan.samplers import flow_match_sigmas
from ardiff_policies.wan.text import TextEncoder
from ardiff_policies.wan.vae import StreamingEncoder

logger = logging.getLogger(__name__)

# upstream's update_cache -> the entries a forward writes (0: scratch, none kept)
_ENTRIES = {0: EntryKind.OBSERVATION, 1: EntryKind.PREDICTION, 2: EntryKind.OBSERVATION}


def kv_spec(embodiment: Embodiment, model_cfg, dtype: torch.dtype) -> KVSpec:
    """Pages of gcd(video, action tokens per chunk): every write is whole pages; the window is upstream's
    ``(attn_window // 2) x (video + action tokens per chunk)``."""
    video, action = embodiment.video_tokens_per_chunk, embodiment.action_tokens_per_chunk
    page = math.gcd(video, action)
    return KVSpec(
        num_layers=model_cfg.num_layers,
        num_heads=model_cfg.num_attention_heads,
        head_dim=model_cfg.attention_head_dim,
        page_size=page,
        window_pages=(embodiment.attn_window // 2) * (video + action) // page,
        max_new_pages=max(video, action) // page,
        evict_to_fit=True,
        undo_pages=(video + action) // page,
        dtype=dtype,
    )


@dataclass(frozen=True)
class InferRequest:
    session: LingBotVASession
    observation: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]]
    video_guidance_scale: float | None = None
    action_guidance_scale: float | None = None
    continuation: Continuation | None = None  # what the robot did with the last chunk (real-time chunking)
    # this call's denoising steps (ardiff_policies.inference_steps; None: the embodiment's): the video and the action loop
    num_inference_steps: int | None = None
    action_num_inference_steps: int | None = None


@dataclass(frozen=True)
class ServedChunk:
    """A session's last chunk: what a continuation continues, and what its reply says."""

    chunk_id: int
    position: int  # its first latent frame
    latents: torch.Tensor  # (1, 48, F, h, w) its denoised video: the stand-in for its frames until they are committed
    model_actions: torch.Tensor  # (1, 30, F, N, 1) its normalized actions
    actions: np.ndarray  # (channels, F, N) float32: as the robot got them
    frozen: int  # leading actions equal to the chunk it continued
    continuation: str | None  # a requested continuation: APPLIED, or why it was served fresh
    in_kv: bool = True  # its prediction entries are in the session's KV (a commit drops them)
    video_steps: int = 0  # the denoising steps it ran: the video loop's and the action loop's
    action_steps: int = 0
    forwards: int = 0  # transformer forwards its infer ran for it (both loops' trailing K/V forwards and a stand-in included)


@dataclass(frozen=True)
class _Pin:
    """How a continued infer pins its actions to the last chunk's (rows time-major: frame x per frame)."""

    last: ServedChunk
    executed: int
    frozen: int
    target: torch.Tensor  # (1, 30, F, N, 1): the last chunk's rows [e, H) at [0, H - e), zeros after
    weights: torch.Tensor  # (1, 1, F, N, 1): RTC's soft mask
    mask: torch.Tensor  # (1, 1, F, N, 1) bool: the frozen rows
    stand_in: bool  # the last chunk is not committed and a commit dropped its prediction entries: write them again

    @property
    def position(self) -> int:
        return self.last.position + self.last.latents.shape[2]


@dataclass(frozen=True)
class _Checked:
    """An accepted infer: its guidance scales, its denoising steps and its continuation."""

    video_guidance: float
    action_guidance: float
    video_steps: int
    action_steps: int
    continuation: str | None = None
    pin: _Pin | None = None

    @property
    def schedule(self) -> tuple[int, int]:
        """The step counts its loops run: members of one batched call share them (one forward per step)."""
        return self.video_steps, self.action_steps


@dataclass(frozen=True)
class CommitRequest:
    session: LingBotVASession
    frames: Sequence[Mapping[str, np.ndarray]]  # the key frames the robot saw while executing the chunk
    state: np.ndarray  # the chunk's actions as the client received (and executed) them


@dataclass
class LingBotVASession:
    session_id: str
    kv: SessionKV
    streams: tuple[StreamingEncoder, ...]
    generator: torch.Generator = field(default_factory=torch.Generator)
    text_kv: list[TextKV] | None = None  # per layer, batch [prompt, negative]
    frame_start: int = 0
    first_latent: torch.Tensor | None = None  # the first chunk's encoded observation, until its commit
    first_start: StreamState | None = None  # the generator and VAE streams as the first infer found them, until its commit
    predicted_latents: torch.Tensor | None = None  # the last infer's denoised video, when the policy keeps it
    predicted_actions: torch.Tensor | None = None  # and its normalized actions (1, 30, F, N, 1)
    chunks: int = 0  # chunks served this episode: the last one's chunk_id
    last: ServedChunk | None = None  # the last chunk (reset: none)


@dataclass
class _Saved:
    """A session as it was before a batched call, to put back if the call fails (then retried alone)."""

    session: LingBotVASession
    streams: StreamState
    frame_start: int
    first_latent: torch.Tensor | None
    first_start: StreamState | None
    chunks: int
    last: ServedChunk | None

    @classmethod
    def take(cls, session: LingBotVASession) -> _Saved:
        session.kv.snapshot()
        s = session
        return cls(s, StreamState.of(s), s.frame_start, s.first_latent, s.first_start, s.chunks, s.last)

    def restore(self) -> None:
        s = self.session
        s.kv.rollback()
        self.streams.restore(s)
        s.frame_start, s.first_latent, s.first_start = self.frame_start, self.first_latent, self.first_start
        s.chunks, s.last = self.chunks, self.last

    def release(self) -> None:
        self.session.kv.release()


class LingBotVAEpisodes(EpisodeIO):
    def __init__(
        self,
        transformer: LingBotVATransformer,
        vae: AutoencoderKLWan,
        text_encoder: TextEncoder,
        tokenizer,
        embodiment: Embodiment,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if transformer.config.action_dim != embodiment.action_dim:
            raise ValueError(f"the transformer has {transformer.config.action_dim} action channels, the embodiment {embodiment.action_dim}")
        super().__init__(vae, text_encoder, tokenizer, embodiment, device=device, dtype=dtype)
        self.transformer = transformer

    @classmethod
    def load(cls, checkpoint: str | Path, embodiment: Embodiment, *, device="cpu", dtype=torch.float32) -> LingBotVAEpisodes:
        """A released checkpoint directory (``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``)."""
        root = Path(checkpoint)
        transformer = load_transformer(root / "transformer", dtype=dtype, device=device)
        vae, text, tokenizer = load_encoders(root, device=device, dtype=dtype)
        return cls(transformer, vae, text, tokenizer, embodiment, device=device, dtype=dtype)

    def kv_spec(self) -> KVSpec:
        return kv_spec(self.embodiment, self.transformer.config, self.dtype)

    @property
    def branches(self) -> tuple[Branch, ...]:
        """CFG [prompt, negative] when either configured scale is above 1 (upstream's ``use_cfg``), fixed per
        policy: both branches' K/V are written by every forward, so a request can change the scales, not the batch."""
        e = self.embodiment
        return (Branch.COND, Branch.UNCOND) if (e.guidance_scale > 1 or e.action_guidance_scale > 1) else (Branch.COND,)

    # -- sessions ----------------------------------------------------------------------------

    def start_session(self, session_id: str, kv: SessionKV) -> LingBotVASession:
        streams = 2 if self.embodiment.layout == "robotwin_tshape" else 1
        return LingBotVASession(session_id, kv, tuple(StreamingEncoder(self.vae) for _ in range(streams)))

    @torch.no_grad()
    def reset(self, session: LingBotVASession, prompt: str, seed: int, text_kv: list[TextKV] | None = None) -> None:
        """A new episode: the prompt's K/V, an empty window and VAE streams, the generator seeded. ``text_kv``: the
        prompt's K/V made beforehand (:meth:`encode_prompt`, e.g. on the engine's encoder thread)."""
        if not isinstance(prompt, str):
            raise EpisodeError(f"prompt: expected a string, got {type(prompt).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise EpisodeError(f"seed: expected a non-negative integer, got {seed!r}")
        session.kv.restart_window()
        for stream in session.streams:
            stream.clear()
        session.generator = torch.Generator().manual_seed(seed)
        session.frame_start, session.first_latent, session.first_start = 0, None, None
        session.chunks, session.last = 0, None
        session.text_kv = text_kv if text_kv is not None else self.encode_prompt(prompt)

    @torch.no_grad()
    def encode_prompt(self, prompt: str) -> list[TextKV]:
        """Every layer's cross-attention K/V of [prompt, negative ""] (touches no session)."""
        return self.transformer.project_text(self.encode_text([prompt, ""]))

    # -- the transformer over the session's pages --------------------------------------------

    def _forward(self, sessions, x, timesteps, grids, *, action_mode: bool, update: int, text_kv) -> torch.Tensor:
        """One forward of every session's CFG batch, rows [s0 prompt, s0 negative, s1 prompt, ...]; ``x`` (B, ...),
        ``timesteps`` (B, F) and ``grids`` (B, 3, L) per session. ``update``: 0 scratch, 1 prediction, 2 observation
        entries (upstream's update_cache)."""
        branches = self.branches
        n = len(branches)
        contexts = [
            s.kv.begin_forward(b, num_video_tokens=grids.shape[2], commit=update > 0, entry=_ENTRIES[update], scratch_slot=slot)
            for slot, s in enumerate(sessions)
            for b in branches
        ]
        try:
            out = self.transformer(
                x.repeat_interleave(n, dim=0),
                timesteps.repeat_interleave(n, dim=0),
                grids.repeat_interleave(n, dim=0),
                text_kv,
                action_mode=action_mode,
                self_kv=prepare_batch(contexts, self.device),
            )
        except BaseException:
            for s in sessions:
                for b in branches:
                    s.kv.abort(b)
            raise
        for s in sessions:
            for b in branches:
                s.kv.complete(b)
        return out

    def _text_kv(self, sessions: Sequence[LingBotVASession]) -> list[TextKV]:
        """Every layer's cross-attention K/V of the batch's rows (made once per call, not per step)."""
        n = len(self.branches)
        if len(sessions) == 1:
            return [(k[:n], v[:n]) for k, v in sessions[0].text_kv]
        layers = zip(*(s.text_kv for s in sessions))
        return [(torch.cat([k[:n] for k, _ in kvs]), torch.cat([v[:n] for _, v in kvs])) for kvs in layers]

    def _guide(self, pred: torch.Tensor, scales: Sequence[float]) -> torch.Tensor:
        """CFG per session: rows [prompt, negative] of each -> one row (``uncond + g (cond - uncond)``, upstream's)."""
        if len(self.branches) == 1:
            return pred
        rows = []
        for i, scale in enumerate(scales):
            cond, uncond = pred[2 * i : 2 * i + 1], pred[2 * i + 1 : 2 * i + 2]
            rows.append(uncond + scale * (cond - uncond) if scale > 1 else cond)
        return torch.cat(rows)

    # -- the three requests --------------------------------------------------------------------

    def infer(
        self,
        session: LingBotVASession,
        observation: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]],
        *,
        video_guidance_scale: float | None = None,
        action_guidance_scale: float | None = None,
        continuation: Continuation | None = None,
        num_inference_steps: int | None = None,
        action_num_inference_steps: int | None = None,
    ) -> np.ndarray:
        """One chunk: actions (len(used channels), frame_chunk_size, action_per_frame) float32 (``session.last`` says
        its chunk_id, how much of it is frozen and the steps it ran)."""
        request = InferRequest(
            session, observation, video_guidance_scale, action_guidance_scale, continuation, num_inference_steps, action_num_inference_steps
        )
        return single(self.infer_batch([request]))

    @torch.no_grad()
    def infer_batch(self, requests: Sequence[InferRequest]) -> list[np.ndarray | Exception]:
        """One chunk for each of several distinct sessions, in one forward per denoising step (each session over its
        own pages, with its own noise, guidance and frame position). Sessions that asked for other numbers of
        denoising steps run as one batched call per step count, one after the other (a forward serves one step of one
        schedule). A request that is refused gets its :class:`EpisodeError` in its place, before anything of its
        session changed; the others run. If a batched call fails, each of its members is retried alone (see the
        module's docstring): one that fails alone gets its exception."""
        if len({id(r.session) for r in requests}) != len(requests):
            raise ValueError("a batch takes each session once")
        results: list[np.ndarray | Exception | None] = [None] * len(requests)
        accepted: list[tuple[int, InferRequest, _Checked]] = []
        for i, request in enumerate(requests):
            try:
                accepted.append((i, request, self._check_infer(request)))
            except Exception as exc:  # an EpisodeError: refused, its session unchanged; anything else fails it alone
                results[i] = exc

        def undo(items: list[tuple[int, InferRequest, _Checked]]) -> Kept | None:
            stand_ins = sum(c.pin is not None and c.pin.stand_in for _, _, c in items)  # a stand-in writes a chunk more
            return self._keep([r.session for _, r, _ in items], chunks=len(items) + stand_ins)

        for schedule in sorted({c.schedule for _, _, c in accepted}):  # one batched call per step count
            group = [item for item in accepted if item[2].schedule == schedule]
            for (i, _, _), outcome in zip(group, run_batched(group, self._infer, undo=undo)):
                results[i] = outcome
        return results

    def _infer(self, accepted: list[tuple[int, InferRequest, _Checked]]) -> list[np.ndarray]:
        """The chunk of every accepted request (all on one step count), in one forward per denoising step."""
        e = self.embodiment
        ((video_steps, action_steps),) = {c.schedule for _, _, c in accepted}
        sessions = [r.session for _, r, _ in accepted]
        video_scales = [c.video_guidance for _, _, c in accepted]
        action_scales = [c.action_guidance for _, _, c in accepted]
        pins = [c.pin for _, _, c in accepted]
        positions = [s.frame_start if pin is None else pin.position for s, pin in zip(sessions, pins)]
        first = [position == 0 for position in positions]
        for session, pin in zip(sessions, pins):
            if pin is None and session.last is not None and session.last.position > session.frame_start:
                session.kv.drop_predictions()  # a continued chunk's entries, ahead of where this chunk goes
            elif pin is not None and pin.stand_in:
                self._stand_in(session, pin.last)  # the executing chunk's frames, not committed yet
        for (_, request, _), is_first in zip(accepted, first):
            if is_first:
                self._begin_first_chunk(request.session)
                frames = [request.observation] if isinstance(request.observation, Mapping) else list(request.observation)
                request.session.first_latent = self.encode_frames(request.session, frames, "obs")
        f, n = e.frame_chunk_size, e.action_per_frame
        h, w = e.latent_size
        # noise: video, then actions, from each session's generator (upstream: the global one, same order and shapes)
        latents, actions = [], []
        for s in sessions:
            latents.append(torch.randn(1, LATENT_CHANNELS, f, h, w, generator=s.generator, dtype=self.dtype))
            actions.append(torch.randn(1, e.action_dim, f, n, 1, generator=s.generator, dtype=self.dtype))
        latents = torch.cat(latents).to(self.device)
        actions = torch.cat(actions).to(self.device)
        first_rows = [i for i, is_first in enumerate(first) if is_first]
        text_kv = self._text_kv(sessions)

        # the conditioning of a session's first chunk: latent frame 0 is its observation, action frame 0 zeros, both
        # at timestep 0 (re-imposed after every step, as upstream)
        latent_cond = {i: sessions[i].first_latent[:, :, 0:1].to(self.dtype) for i in first_rows}
        grids = torch.stack([video_grid(f, h // 2, w // 2, p) for p in positions]).to(self.device)
        sigmas = flow_match_sigmas(video_steps, e.snr_shift)
        for step in range(len(sigmas) + 1):  # the trailing t = 0 forward keeps the chunk's K/V
            last = step == len(sigmas)
            timesteps = torch.full((len(sessions), f), 0.0 if last else float(sigmas[step] * 1000), device=self.device)
            for i in first_rows:
                latents[i : i + 1, :, 0:1] = latent_cond[i]
                timesteps[i, 0] = 0.0
            pred = self._forward(sessions, latents, timesteps, grids, action_mode=False, update=1 if last else 0, text_kv=text_kv)
            if not last:
                latents = latents + self._guide(pred, video_scales) * (next_sigma(sigmas, step) - sigmas[step])
            for i in first_rows:
                latents[i : i + 1, :, 0:1] = latent_cond[i]

        unused = ~self.action_mask.to(self.device)
        grids = torch.stack([action_grid(f, n, p) for p in positions]).to(self.device)
        sigmas = flow_match_sigmas(action_steps, e.action_snr_shift)
        pinned = [(i, pin) for i, pin in enumerate(pins) if pin is not None]
        noise = {i: actions[i : i + 1].clone() for i, _ in pinned}  # the continued rows are noised with the call's own
        for step in range(len(sigmas) + 1):
            last = step == len(sigmas)
            timesteps = torch.full((len(sessions), f), 0.0 if last else float(sigmas[step] * 1000), device=self.device)
            for i in first_rows:
                actions[i, :, 0:1] = 0.0
                timesteps[i, 0] = 0.0
            for i, pin in pinned:  # before the forward: the trailing one keeps the pinned chunk's K/V
                target, weights = pin.target.to(actions), pin.weights.to(actions)
                if last:
                    actions[i : i + 1] = action_inpaint.pin(actions[i : i + 1], target, weights, pin.mask.to(self.device))
                else:
                    actions[i : i + 1] = action_inpaint.toward(actions[i : i + 1], target, weights, noise[i], float(sigmas[step]))
            actions[:, unused] *= 0
            pred = self._forward(sessions, actions, timesteps, grids, action_mode=True, update=1 if last else 0, text_kv=text_kv)
            if not last:
                actions = actions + self._guide(pred, action_scales) * (next_sigma(sigmas, step) - sigmas[step])
            for i in first_rows:
                actions[i, :, 0:1] = 0.0
        actions[:, unused] *= 0
        if self.keep_predictions:
            for row, session in enumerate(sessions):
                session.predicted_latents = latents[row : row + 1].detach()
                session.predicted_actions = actions[row : row + 1].detach()
        out = []
        for row, (session, position, (_, _, checked)) in enumerate(zip(sessions, positions, accepted)):
            chunk = self.denormalize_actions(actions[row : row + 1])
            pin = checked.pin
            if pin is not None:  # exactly what the robot executes, not its round trip through model space
                flat, old = chunk.reshape(chunk.shape[0], -1), pin.last.actions.reshape(chunk.shape[0], -1)
                flat[:, : pin.frozen] = old[:, pin.executed : pin.executed + pin.frozen]
            session.chunks += 1
            stand_in = 2 if pin is not None and pin.stand_in else 0  # its video and action prediction entries again
            session.last = ServedChunk(
                session.chunks,
                position,
                latents[row : row + 1].detach().clone(),
                actions[row : row + 1].detach().clone(),
                chunk.copy(),
                0 if pin is None else pin.frozen,
                checked.continuation,
                video_steps=video_steps,
                action_steps=action_steps,
                forwards=(video_steps + 1) + (action_steps + 1) + stand_in,  # each loop's steps and its trailing t = 0 forward
            )
            out.append(chunk)
        return out

    def _stand_in(self, session: LingBotVASession, chunk: ServedChunk) -> None:
        """The chunk's prediction entries again, from its kept latents and actions (a commit dropped them): the same
        trailing t = 0 forwards its infer ran, now over the frames committed since."""
        e = self.embodiment
        f, n = e.frame_chunk_size, e.action_per_frame
        h, w = e.latent_size
        zeros = torch.zeros(1, f, device=self.device)
        text_kv = self._text_kv([session])
        grid = video_grid(f, h // 2, w // 2, chunk.position).unsqueeze(0).to(self.device)
        self._forward([session], chunk.latents.to(self.device, self.dtype), zeros, grid, action_mode=False, update=1, text_kv=text_kv)
        grid = action_grid(f, n, chunk.position).unsqueeze(0).to(self.device)
        self._forward([session], chunk.model_actions.to(self.device, self.dtype), zeros, grid, action_mode=True, update=1, text_kv=text_kv)

    @staticmethod
    def _begin_first_chunk(session: LingBotVASession) -> None:
        """An infer of the episode's first chunk: the first one keeps the generator and VAE streams it starts from; a
        repeat (no commit since) starts from them again, its predecessor's predicted pages dropped."""
        if session.first_latent is None:
            session.first_start = StreamState.of(session)
            return
        session.first_start.restore(session)
        session.kv.drop_predictions()

    # -- a failed batch, member by member (ardiff_policies.batch_retry) ---------------------

    def _keep(self, sessions: list[LingBotVASession], chunks: int | None = None) -> Kept | None:
        """The batch's sessions as they are, for :func:`~ardiff_policies.batch_retry.run_batched` to put back if the
        batched call fails (then each member is retried alone); None if the pool has no room to keep them. ``chunks``:
        the video and action chunks the call writes per branch (default one per session)."""
        return Kept.take(sessions, _Saved.take) if self._undo_fits(sessions, len(sessions) if chunks is None else chunks) else None

    def _check_infer(self, request: InferRequest) -> _Checked:
        """The request's guidance scales and continuation, or EpisodeError naming the key (nothing of the session has
        changed)."""
        session, e = request.session, self.embodiment
        if session.text_kv is None:
            raise EpisodeError("infer before reset: send {reset: True, prompt} first")
        video_g = _guidance("video_guidance_scale", request.video_guidance_scale, e.guidance_scale)
        action_g = _guidance("action_guidance_scale", request.action_guidance_scale, e.action_guidance_scale)
        for key, value in (("video_guidance_scale", video_g), ("action_guidance_scale", action_g)):
            if value > 1 and len(self.branches) == 1:
                # the negative prompt's K/V were never written: the configured scales are both 1
                raise EpisodeError(f"{key}: {value} needs the unconditional branch, which this policy does not run")
        video_steps = _steps("num_inference_steps", request.num_inference_steps, e.num_inference_steps)
        action_steps = _steps("action_num_inference_steps", request.action_num_inference_steps, e.action_num_inference_steps)
        reason, pin = self._check_continuation(request)
        if session.frame_start == 0 and pin is None:
            observation = request.observation
            frames = [observation] if isinstance(observation, Mapping) else list(observation)
            if len(frames) != 1:
                raise EpisodeError(f"obs: the first infer of an episode takes one observation, got {len(frames)}")
            self.check_frames(frames, "obs")
        return _Checked(video_g, action_g, video_steps, action_steps, reason, pin)

    def _check_continuation(self, request: InferRequest) -> tuple[str | None, _Pin | None]:
        """Whether the request continues its session's last chunk (:func:`ardiff_policies.continuation.decide_for`), and
        the pin if it does; EpisodeError when the numbers do not fit or the chunk before the last is not committed."""
        asked, session, e = request.continuation, request.session, self.embodiment
        if asked is None:
            return None, None
        f, n = e.frame_chunk_size, e.action_per_frame
        horizon = f * n
        try:
            asked.check(horizon)
        except ValueError as exc:
            raise EpisodeError(str(exc)) from None
        last = session.last
        reason = decide_for(asked, None if last is None else last.chunk_id, {})
        if reason != APPLIED:
            return reason, None
        if last.position not in (session.frame_start - f, session.frame_start):
            raise EpisodeError(
                f"continuation: chunk {last.chunk_id} starts at latent frame {last.position} and {session.frame_start} are "
                f"committed; compute_kv_cache the chunk it continued first (one chunk may run ahead of the commits)"
            )
        executed, frozen = asked.executed, asked.delay
        target = torch.zeros(1, e.action_dim, horizon, dtype=torch.float32)
        target[:, :, : horizon - executed] = last.model_actions.float().cpu().reshape(1, e.action_dim, horizon)[:, :, executed:]
        weights = torch.from_numpy(soft_mask(horizon, frozen, horizon - executed)).float()
        mask = torch.zeros(horizon, dtype=torch.bool)
        mask[:frozen] = True
        shape = (1, 1, f, n, 1)
        stand_in = last.position == session.frame_start and not last.in_kv
        pin = _Pin(last, executed, frozen, target.reshape(1, e.action_dim, f, n, 1), weights.reshape(shape), mask.reshape(shape), stand_in)
        return reason, pin

    def compute_kv_cache(self, session: LingBotVASession, frames: Sequence[Mapping[str, np.ndarray]], state: np.ndarray) -> None:
        """What the robot saw and did: the prediction's pages are dropped, these written as committed."""
        single(self.compute_kv_cache_batch([CommitRequest(session, frames, state)]))

    @torch.no_grad()
    def compute_kv_cache_batch(self, requests: Sequence[CommitRequest]) -> list[Exception | None]:
        """:meth:`compute_kv_cache` for several distinct sessions: their frames through their own VAE streams, then one
        video and one action forward for all. A refused request gets its EpisodeError in place (its session
        unchanged); a member that failed alone its exception (after a failed batch, each is retried alone); the
        others' entries are None."""
        if len({id(r.session) for r in requests}) != len(requests):
            raise ValueError("a batch takes each session once")
        results: list[Exception | None] = [None] * len(requests)
        accepted: list[tuple[LingBotVASession, list, torch.Tensor]] = []
        for i, request in enumerate(requests):
            try:
                accepted.append(self._check_commit(request))
            except Exception as exc:  # an EpisodeError: refused, its session unchanged; anything else fails it alone
                results[i] = exc
        outcomes = iter(run_batched(accepted, self._commit, undo=lambda items: self._keep([session for session, _, _ in items])))
        return [next(outcomes) if result is None else result for result in results]

    def _commit(self, accepted: list[tuple[LingBotVASession, list, torch.Tensor]]) -> list[None]:
        """Every accepted commit in one video and one action forward."""
        e = self.embodiment
        sessions, latents, actions = [], [], []
        for session, frames, action_in in accepted:
            latent = self.encode_frames(session, frames, "obs") if frames else None
            if session.frame_start == 0:
                latent = session.first_latent if latent is None else torch.cat([session.first_latent, latent], dim=2)
            session.kv.drop_predictions()  # upstream's clear_pred_cache: the observation replaces the prediction
            if session.last is not None and session.last.in_kv:
                session.last = replace(session.last, in_kv=False)
            sessions.append(session)
            latents.append(latent.to(self.dtype))
            actions.append(action_in)
        f = e.frame_chunk_size
        h, w = e.latent_size
        zeros = torch.zeros(len(sessions), f, device=self.device)
        text_kv = self._text_kv(sessions)
        grids = torch.stack([video_grid(f, h // 2, w // 2, s.frame_start) for s in sessions]).to(self.device)
        self._forward(sessions, torch.cat(latents), zeros, grids, action_mode=False, update=2, text_kv=text_kv)
        action_in = torch.cat(actions).to(self.device, self.dtype)
        action_in[:, ~self.action_mask.to(self.device)] *= 0
        grids = torch.stack([action_grid(f, e.action_per_frame, s.frame_start) for s in sessions]).to(self.device)
        self._forward(sessions, action_in, zeros, grids, action_mode=True, update=2, text_kv=text_kv)
        for session in sessions:
            session.frame_start += f
            session.first_latent = session.first_start = None  # committed with the first chunk: later chunks never read them
        return [None] * len(sessions)

    def _check_commit(self, request: CommitRequest) -> tuple[LingBotVASession, list, torch.Tensor]:
        """The request's frames and normalized actions, or EpisodeError naming the key (nothing has changed)."""
        session, e = request.session, self.embodiment
        if session.text_kv is None:
            raise EpisodeError("compute_kv_cache before reset: send {reset: True, prompt} first")
        if session.frame_start == 0 and session.first_latent is None:
            raise EpisodeError("compute_kv_cache before the episode's first infer")
        action_in = self.normalize_actions(request.state)
        frames = [request.frames] if isinstance(request.frames, Mapping) else list(request.frames)
        # 4 frames per latent frame; the first chunk's frame 0 is the observation its infer encoded
        expected = 4 * (e.frame_chunk_size - (session.frame_start == 0))
        if len(frames) != expected:
            raise EpisodeError(f"obs: {len(frames)} key frames; this chunk takes {expected} (4 per latent frame)")
        self.check_frames(frames, "obs")
        return session, frames, action_in


def _steps(key: str, value: int | None, default: int) -> int:
    """A call's denoising steps: the request's (an integer in [1, MAX_INFERENCE_STEPS]; a deployment's narrower bounds
    are the serving policy's to check), else the embodiment's."""
    if value is None:
        return default
    if type(value) is not int or not 1 <= value <= MAX_INFERENCE_STEPS:
        raise EpisodeError(f"{key}: expected an integer in [1, {MAX_INFERENCE_STEPS}], got {value!r}")
    return value


def _guidance(key: str, value: float | None, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EpisodeError(f"{key}: expected a number, got {value!r}")
    if not 1.0 <= value <= MAX_GUIDANCE:
        raise EpisodeError(f"{key}: {value} outside [1, {MAX_GUIDANCE}]")
    return float(value)
