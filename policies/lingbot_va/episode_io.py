"""What the LingBot-VA family's episodes share, whatever their transformer: LingBot-VA's (``episode.py``) and
Zero-WAM's (``zero_wam_episode.py``, upstream's ICL variant of the same server).

Both upstream servers (``wan_va/wan_va_server.py`` in Robbyant/lingbot-va and jianwenli96/Zero-WAM) encode the same
way, so :class:`EpisodeIO` holds it once:

* text: a prompt cleaned, tokenized to 512 positions and through UMT5 with its padding zeroed (:meth:`EpisodeIO.encode_text`);
* frames: key frames resized, mapped to [-1, 1] and through a session's streaming VAE encoders, their posterior mean
  normalized with the VAE's statistics (:meth:`EpisodeIO.encode_frames`, upstream ``_encode_obs``);
* actions: the model's normalized 30 channels <-> the embodiment's used channels in q01 / q99 units;
* noise: drawn from a session's own generator in the model's dtype on the CPU (upstream draws from its global
  generator in the same order and shapes: seeded the same, the same numbers on a CPU);
* a failed batch's undo: a session's generator and VAE streams as they were (:class:`StreamState`), and whether the
  pool has the pages a batched call may hold beyond its members' windows until it is undone or kept.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan

from ardiff_policies.lingbot_va.embodiments import Embodiment
from ardiff_policies.observation import UnsupportedObservation
from ardiff_policies.wan.prompt import clean_prompt
from ardiff_policies.wan.text import TextEncoder

logger = logging.getLogger(__name__)

TEXT_LENGTH = 512  # upstream's max_sequence_length: the cross-attention sees all 512 positions
LATENT_CHANNELS = 48
MAX_GUIDANCE = 20.0  # a request's guidance scale outside [1, MAX_GUIDANCE] (Zero-WAM's reset: [-MAX, MAX]) is refused by name


class EpisodeError(UnsupportedObservation):
    """A request this session cannot take (the message names the key); the session is left as it was, so the
    engine answers it as a bad request and keeps the session."""


def next_sigma(sigmas: torch.Tensor, i: int) -> torch.Tensor:
    """The flow-matching Euler step's target sigma after step ``i`` (0 after the last)."""
    return sigmas[i + 1] if i + 1 < len(sigmas) else torch.tensor(0.0)


def load_encoders(root: Path, *, device, dtype: torch.dtype) -> tuple[AutoencoderKLWan, TextEncoder, Any]:
    """A released checkpoint's ``vae/``, ``text_encoder/`` and ``tokenizer/`` (diffusers' and transformers' layouts)."""
    from transformers import AutoTokenizer, UMT5EncoderModel
    from transformers.utils import logging as transformers_logging

    # low_cpu_mem_usage said explicitly: diffusers' default asks for accelerate and logs a paragraph without it
    low_memory = importlib.util.find_spec("accelerate") is not None
    vae = AutoencoderKLWan.from_pretrained(root / "vae", torch_dtype=dtype, low_cpu_mem_usage=low_memory).to(device).eval()
    # transformers' default attention, as upstream's load_text_encoder (DreamZero's TextEncoder.from_config forces
    # eager to match DreamZero's own T5 in bf16; LingBot-VA uses transformers' UMT5 itself). Its tqdm bar is
    # hidden: its carriage returns garble a log file
    bar = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        umt5 = UMT5EncoderModel.from_pretrained(root / "text_encoder", torch_dtype=dtype)
    finally:
        if bar:
            transformers_logging.enable_progress_bar()
    text = TextEncoder(umt5).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    return vae, text, tokenizer


@dataclass(frozen=True)
class StreamState:
    """A session's noise generator and its VAE streams' feature caches (``session.generator``, ``session.streams``),
    to start a call again from: a failed batch puts every member back so (then retried alone), and LingBot-VA's
    repeated first infer starts again from where the first did."""

    generator: torch.Tensor
    feat_caches: tuple[list, ...]

    @classmethod
    def of(cls, session: Any) -> StreamState:
        # diffusers' causal convs replace their cache entries, never write into them: a copy of the lists suffices
        return cls(session.generator.get_state(), tuple(list(stream.feat_cache) for stream in session.streams))

    def restore(self, session: Any) -> None:
        session.generator.set_state(self.generator)
        for stream, cache in zip(session.streams, self.feat_caches):
            stream.feat_cache = list(cache)


@dataclass
class Kept:
    """Every member of a call as it was before it (:class:`ardiff_policies.batch_retry.Undo`): each session's saved
    state (``save(session)``: an object with ``restore()`` and ``release()``, the family's own)."""

    saved: list

    @classmethod
    def take(cls, sessions: Sequence[Any], save: Callable[[Any], Any]) -> Kept:
        saved: list = []
        try:
            for session in sessions:
                saved.append(save(session))
        except BaseException:
            for entry in saved:
                entry.restore()
            raise
        return cls(saved)

    def restore(self) -> None:
        for entry in self.saved:
            entry.restore()

    def release(self) -> None:
        for entry in self.saved:
            entry.release()


class EpisodeIO:
    """An episode's encoders and its action and latent statistics (the embodiment's), for a transformer's policy to
    extend. Subclasses define ``branches`` and ``kv_spec()`` (the batch undo's pages)."""

    def __init__(
        self,
        vae: AutoencoderKLWan,
        text_encoder: TextEncoder,
        tokenizer,
        embodiment: Embodiment,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.embodiment = embodiment
        self.device = torch.device(device)
        self.dtype = dtype
        self.keep_predictions = False  # keep each infer's denoised video on its session (recordings)
        self._warned_headroom = False
        e = embodiment
        self.action_mask = torch.zeros(e.action_dim, dtype=torch.bool)
        self.action_mask[list(e.used_action_channel_ids)] = True
        inverse = [len(e.used_action_channel_ids)] * e.action_dim  # unused channels read the zero row
        for i, channel in enumerate(e.used_action_channel_ids):
            inverse[channel] = i
        self.inverse_channels = inverse
        self.q01 = torch.tensor(e.q01, dtype=torch.float32).reshape(-1, 1, 1)
        self.q99 = torch.tensor(e.q99, dtype=torch.float32).reshape(-1, 1, 1)
        vae_cfg = vae.config
        self.latents_mean = torch.tensor(vae_cfg.latents_mean, dtype=torch.float32)
        self.latents_std = torch.tensor(vae_cfg.latents_std, dtype=torch.float32)

    # -- text ------------------------------------------------------------------------------------

    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """UMT5 embeddings (B, 512, text_dim) of cleaned prompts, zero past each prompt's tokens (upstream's)."""
        tokens = self.tokenizer(
            [clean_prompt(p) for p in prompts],
            padding="max_length",
            max_length=TEXT_LENGTH,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return self.text_encoder(tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)).to(self.dtype)

    # -- observations ------------------------------------------------------------------------

    def camera_stacks(self, frames: Sequence[Mapping[str, np.ndarray]], key: str) -> list[np.ndarray]:
        """Each camera's frames as (T, H, W, 3), or EpisodeError naming the key and the camera."""
        stacks = []
        for camera in self.embodiment.cameras:
            try:
                stack = np.stack([np.asarray(frame[camera]) for frame in frames])
            except (KeyError, TypeError, IndexError):
                raise EpisodeError(f"{key}: camera {camera!r} missing") from None
            except ValueError as exc:
                raise EpisodeError(f"{key}: frames of {camera!r} differ in shape ({exc})") from None
            if stack.ndim != 4 or stack.shape[-1] != 3 or min(stack.shape[1:3]) < 1:
                raise EpisodeError(f"{key}: {camera!r} must be (H, W, 3) images, got {stack.shape[1:]}")
            if not (np.issubdtype(stack.dtype, np.integer) or np.issubdtype(stack.dtype, np.floating)):
                raise EpisodeError(f"{key}: {camera!r} has dtype {stack.dtype}; expected uint8 pixels")
            stacks.append(stack)
        return stacks

    def check_frames(self, frames: Sequence[Mapping[str, np.ndarray]], key: str) -> None:
        self.camera_stacks(frames, key)

    def encode_frames(self, session: Any, frames: Sequence[Mapping[str, np.ndarray]], key: str) -> torch.Tensor:
        """Key frames (dicts camera -> (H, W, 3) uint8) -> normalized latents (1, 48, F, h, w), continuing the
        session's VAE streams (upstream ``_encode_obs``)."""
        e = self.embodiment
        videos = []
        for i, stack in enumerate(self.camera_stacks(frames, key)):
            size = (e.height // 2, e.width // 2) if e.layout == "robotwin_tshape" and i > 0 else (e.height, e.width)
            video = torch.from_numpy(stack).float().permute(3, 0, 1, 2)  # (3, T, H, W)
            videos.append(F.interpolate(video, size=size, mode="bilinear", align_corners=False).unsqueeze(0))
        if e.layout == "robotwin_tshape":
            high = self.to_model(videos[0])
            wrists = self.to_model(torch.cat(videos[1:], dim=0))
            high_enc = session.streams[0].encode(high)
            wrist_enc = session.streams[1].encode(wrists)
            encoded = torch.cat([torch.cat(wrist_enc.split(1, dim=0), dim=-1), high_enc], dim=-2)
            return self.normalize_latents(encoded)
        return self.side_by_side(self.normalize_latents(session.streams[0].encode(self.to_model(torch.cat(videos, dim=0)))))

    def to_model(self, video: torch.Tensor) -> torch.Tensor:
        return (video / 255.0 * 2.0 - 1.0).to(self.device).to(self.dtype)

    def normalize_latents(self, encoded: torch.Tensor) -> torch.Tensor:
        """The VAE encoder's output (B, 2 x 48, F, h, w) -> its posterior mean, normalized ``(mu - mean) / std`` in
        float32 and back to its dtype (upstream ``normalize_latents``)."""
        mu = encoded.chunk(2, dim=1)[0]
        shape = (1, -1, 1, 1, 1)
        mean = self.latents_mean.to(mu.device).view(shape)
        inv_std = (1.0 / self.latents_std).to(mu.device).view(shape)
        return ((mu.float() - mean) * inv_std).to(mu)

    @staticmethod
    def side_by_side(latents: torch.Tensor) -> torch.Tensor:
        """Cameras encoded as a batch (B, C, F, h, w) -> one latent frame with them side by side (1, C, F, h, B w)."""
        return torch.cat(latents.split(1, dim=0), dim=-1)

    # -- actions ---------------------------------------------------------------------------------

    def normalize_actions(self, state: np.ndarray) -> torch.Tensor:
        """The executed actions as the client echoes them, (used channels, F, N) -> (1, 30, F, N, 1) normalized."""
        e = self.embodiment
        expected = (len(e.used_action_channel_ids), e.frame_chunk_size, e.action_per_frame)
        array = np.asarray(state)
        if array.shape != expected or not np.issubdtype(array.dtype, np.number):
            raise EpisodeError(f"state: expected the chunk's actions {expected}, got {array.shape} {array.dtype}")
        if not np.isfinite(array).all():
            raise EpisodeError("state: contains NaN or infinity")
        padded = F.pad(torch.from_numpy(array.astype(np.float32)), [0, 0, 0, 0, 0, 1])[self.inverse_channels]
        normalized = (padded - self.q01) / (self.q99 - self.q01 + 1e-6) * 2.0 - 1.0
        return normalized.unsqueeze(0).unsqueeze(-1)

    def denormalize_actions(self, actions: torch.Tensor) -> np.ndarray:
        """The model's (1, 30, F, N, 1) -> (used channels, F, N) float32 in the embodiment's units (upstream
        ``postprocess_action``)."""
        a = actions.cpu()[0, ..., 0]
        a = (a + 1) / 2 * (self.q99 - self.q01 + 1e-6) + self.q01
        return a.float().numpy()[list(self.embodiment.used_action_channel_ids)]

    # -- noise -----------------------------------------------------------------------------------

    def draw(self, generator: torch.Generator, *shape: int) -> torch.Tensor:
        """Standard normal noise from a session's generator, in the model's dtype on the CPU (upstream's
        ``torch.randn(..., dtype=self.dtype)`` on its global generator); the caller moves it to the device."""
        return torch.randn(shape, generator=generator, dtype=self.dtype)

    # -- a failed batch, member by member (ardiff_policies.batch_retry) ---------------------

    @functools.cached_property
    def _undo_pages_per_session(self) -> int:
        return len(self.branches) * self.kv_spec().undo_pages

    def _undo_fits(self, sessions: Sequence[Any], chunks: int) -> bool:
        """While a batched call may still be undone, each member keeps the pages it evicts or drops out of the pool:
        the pool needs the pages the call writes (a video and an action chunk per branch and member, one more for a
        continuation's stand-in) free."""
        per_chunk = self._undo_pages_per_session
        pool = sessions[0].kv.pool
        if pool.num_free >= per_chunk * chunks:
            return True
        if not self._warned_headroom:
            self._warned_headroom = True
            logger.warning(
                "the KV pool has %d free pages, a batch of %d needs %d spare to be undone member by member if it fails; "
                "such batches run one session at a time (the pool keeps that room free when sized from a budget: "
                "PagedKVCache.undo_headroom)",
                pool.num_free,
                len(sessions),
                per_chunk * chunks,
            )
        return False
