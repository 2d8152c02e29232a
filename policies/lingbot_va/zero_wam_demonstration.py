"""Zero-WAM's demonstrations: pre-encoded latents read by id from a configured root, checked and bounded.

Upstream's client names a demonstration at reset (``use_icl``, ``icl_demo_id``: a relative POSIX path without
extension, ``evaluation/robotwin/icl_reference.py``); its server reads ``<latent root>/<id>.pth``, a ``torch.save``
dict holding ``latent`` and optionally ``text_emb`` (the demonstration's own text; without it the target prompt is
used), in one of four layouts (``wan_va_server.py`` ``_reshape_icl_latent``): (1, C, F, H, W); (C, F, H, W);
(F, H, W, C) with ``latent_layout`` "f h w c"; (F x H x W, C) with ``latent_num_frames`` / ``latent_height`` /
``latent_width``. :class:`DemonstrationStore` reads the same files and layouts.

Where upstream falls back to ``<video root>/<id>.mp4`` (decoded, resampled to 12 fps, VAE-encoded at every reset),
this server refuses by name: a demonstration of unbounded length decoded and encoded inside a reset would stall
every session batched with it, and the latents upstream trains on are the pre-encoded ones (the fallback also loses
the demonstration's own text). Encode offline, once, into the latent root.

Every failure is a :class:`DemonstrationError` (a bad request with one line naming the id and what is wrong); the
file is size-checked before it is read, and read with ``weights_only`` (tensors and plain containers only, never
arbitrary pickled objects).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from ardiff_policies.lingbot_va.episode_io import EpisodeError

_FLAT_KEYS = ("latent_num_frames", "latent_height", "latent_width")


@dataclass(frozen=True)
class DemonstrationGeometry:
    """What sizes a served demonstration: its latent frame (upstream resizes a human video to ``icl_height`` x
    ``icl_width``, 320x480 on RoboTwin: latents 20x30, 150 tokens a frame), the most latent frames a session pins (a
    serving bound, :class:`DemonstrationStore`'s; upstream has none) and the row offset of its RoPE positions."""

    latent_size: tuple[int, int] = (20, 30)
    max_frames: int = 32
    rope_row_offset: int = 24  # upstream's icl_rope_h: the demonstration sits below the robot's rows in RoPE space

    @property
    def tokens_per_frame(self) -> int:
        return (self.latent_size[0] // 2) * (self.latent_size[1] // 2)

    @property
    def max_tokens(self) -> int:
        return self.max_frames * self.tokens_per_frame


class DemonstrationError(EpisodeError):
    """A demonstration that is missing, malformed or too large: a bad request; the session is left as it was."""


@dataclass(frozen=True)
class Demonstration:
    demo_id: str
    latent: torch.Tensor  # (1, C, F, H, W) float32, normalized as the VAE's latents are
    text_embedding: torch.Tensor | None  # (1, T, text_dim) float32: its own text, or None (the target prompt's)

    @property
    def latent_frames(self) -> int:
        return self.latent.shape[2]

    def tokens(self, patch_size: tuple[int, int, int] = (1, 2, 2)) -> int:
        """Transformer tokens of its in-context block (what it pins in the cache, per layer)."""
        _, _, f, h, w = self.latent.shape
        return (f // patch_size[0]) * (h // patch_size[1]) * (w // patch_size[2])


def demonstration_path(root: Path, demo_id: object) -> Path:
    """``root / <id>.pth`` for an id that is a non-empty relative POSIX path inside the root (upstream's rule)."""
    if not isinstance(demo_id, str) or not demo_id or "\\" in demo_id or "\x00" in demo_id:
        raise DemonstrationError(f"icl_demo_id: expected a non-empty relative POSIX path, got {demo_id!r}")
    path = PurePosixPath(demo_id)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise DemonstrationError(f"icl_demo_id {demo_id!r}: must be relative, without '..'")
    return root / (str(path) + ".pth")  # ids omit the extension: a dot in a name stays


@dataclass(frozen=True)
class DemonstrationStore:
    """Demonstrations under ``root`` (the server's ``policy.demonstration_root``)."""

    root: Path
    latent_channels: int  # the VAE's (48)
    text_dim: int  # the transformer's text_dim (UMT5: 4096)
    max_tokens: int  # the in-context block's bound: what a session may pin (KVSpec.max_pinned_pages x page size)
    max_text_tokens: int = 512
    max_file_bytes: int = 1 << 30

    def load(self, demo_id: object) -> Demonstration:
        path = demonstration_path(self.root, demo_id)
        try:
            size = path.stat().st_size
        except OSError:
            sibling = path.with_suffix(".mp4")
            if sibling.is_file():
                raise DemonstrationError(
                    f"icl_demo_id {demo_id!r}: only {sibling.name} exists; this server reads pre-encoded latents "
                    f"({path.name}), never decodes a video inside a reset (docs/zero-wam.md)"
                ) from None
            raise DemonstrationError(f"icl_demo_id {demo_id!r}: no {path.name} under the demonstration root") from None
        if size > self.max_file_bytes:
            raise DemonstrationError(f"icl_demo_id {demo_id!r}: {path.name} is {size} bytes, more than {self.max_file_bytes}")
        try:
            item = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a corrupt file, a pickle of anything but tensors and containers
            raise DemonstrationError(f"icl_demo_id {demo_id!r}: cannot read {path.name} ({type(exc).__name__}: {_first_line(exc)})") from None
        return self.parse(str(demo_id), item)

    def parse(self, demo_id: str, item: Any) -> Demonstration:
        """A loaded ``.pth`` item -> a checked :class:`Demonstration`, or DemonstrationError."""
        where = f"icl_demo_id {demo_id!r}"
        if not isinstance(item, dict) or "latent" not in item:
            raise DemonstrationError(f"{where}: expected a dict with 'latent'")
        latent = _latent_layout(where, item["latent"], item)
        _, c, f, h, w = latent.shape
        if c != self.latent_channels:
            raise DemonstrationError(f"{where}: latent has {c} channels; the VAE has {self.latent_channels}")
        if min(f, h, w) < 1 or h % 2 or w % 2:
            raise DemonstrationError(f"{where}: latent frames x height x width {f}x{h}x{w}: height and width must be even (2x2 patches)")
        tokens = f * (h // 2) * (w // 2)
        if tokens > self.max_tokens:
            raise DemonstrationError(f"{where}: {tokens} tokens ({f} latent frames of {h}x{w}), more than the {self.max_tokens} a session may pin")
        if not torch.isfinite(latent).all():
            raise DemonstrationError(f"{where}: latent contains NaN or infinity")
        text = item.get("text_emb")
        if text is not None:
            text = _text(where, text, self.text_dim, self.max_text_tokens)
        return Demonstration(demo_id, latent.float().contiguous(), text)


def _latent_layout(where: str, latent: Any, item: dict) -> torch.Tensor:
    """Upstream's four layouts -> (1, C, F, H, W)."""
    if not torch.is_tensor(latent) or not latent.is_floating_point():
        raise DemonstrationError(f"{where}: latent must be a floating-point tensor, got {type(latent).__name__}")
    layout = str(item.get("latent_layout", "")).lower().replace("_", " ")
    if latent.ndim == 5:
        if latent.shape[0] != 1:
            raise DemonstrationError(f"{where}: latent batch must be 1, got {tuple(latent.shape)}")
        return latent
    if latent.ndim == 4:
        return latent.permute(3, 0, 1, 2)[None] if layout in ("f h w c", "f h w d") else latent[None]
    if latent.ndim == 2:
        try:
            f, h, w = (int(item[key]) for key in _FLAT_KEYS)
        except (KeyError, TypeError, ValueError):
            raise DemonstrationError(f"{where}: a flattened (tokens, C) latent needs integer {', '.join(_FLAT_KEYS)}") from None
        if min(f, h, w) < 1 or latent.shape[0] != f * h * w:
            raise DemonstrationError(f"{where}: flattened latent {tuple(latent.shape)} does not match {f}x{h}x{w}")
        return latent.view(f, h, w, -1).permute(3, 0, 1, 2)[None]
    raise DemonstrationError(f"{where}: latent shape {tuple(latent.shape)} is none of (1, C, F, H, W), (C, F, H, W), (F, H, W, C), (F*H*W, C)")


def _text(where: str, text: Any, text_dim: int, max_tokens: int) -> torch.Tensor:
    if not torch.is_tensor(text) or not text.is_floating_point():
        raise DemonstrationError(f"{where}: text_emb must be a floating-point tensor")
    if text.ndim == 2:
        text = text[None]
    if text.ndim != 3 or text.shape[0] != 1 or text.shape[2] != text_dim or not 1 <= text.shape[1] <= max_tokens:
        raise DemonstrationError(f"{where}: text_emb {tuple(text.shape)}: expected (T, {text_dim}) with T <= {max_tokens}")
    if not torch.isfinite(text).all():
        raise DemonstrationError(f"{where}: text_emb contains NaN or infinity")
    return text.float().contiguous()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""
