"""The image sizes a DreamZero checkpoint is served at, and the start-up checks that they fit it.

Each mismatch is a setting, not a bug: it is refused in one line naming what to change
(:class:`GeometryError` is a :class:`StartRefused`, so a worker prints no traceback).
"""

from __future__ import annotations

from collections.abc import Sequence

from ardiff_policies.dreamzero.config import BUILTIN_PREFIX, SYNTHETIC_PREFIX
from ardiff_policies.embodiment import Embodiment
from ardiff_policies.errors import StartRefused


class GeometryError(StartRefused, ValueError):
    """The checkpoint cannot serve this image geometry or embodiment."""


def check_canvas(canvas: tuple[int, int], *, what: str, spatial_compression: int, patch_size: Sequence[int], frame_seqlen: int) -> None:
    """The canvas the VAE sees gives the DiT whole patches, as many per latent frame as it was trained with."""
    h, w = canvas
    s = spatial_compression
    _, ph, pw = patch_size
    if h % (s * ph) or w % (s * pw):
        # The DiT's strided patch embedding would drop a latent row or column, and the sampler could not step the
        # smaller prediction against the full latent (upstream fails there too; its training crops instead).
        raise GeometryError(f"{what} gives a {h / s:g}x{w / s:g} latent; the DiT needs it divisible by its {ph}x{pw} patch")
    tokens = (h // s // ph) * (w // s // pw)
    if tokens != frame_seqlen:
        raise GeometryError(f"{what} gives {tokens} tokens per latent frame; the checkpoint's DiT expects frame_seqlen={frame_seqlen}")


def check_embodiment(e: Embodiment, *, max_action_dim: int, max_state_dim: int, view_size: Sequence[int] | None) -> None:
    """The embodiment fits the checkpoint's DiT and the run's image size (one line naming the mismatch)."""
    if e.action_dim > max_action_dim:
        raise GeometryError(f"embodiment {e.tag}: {e.action_dim} action dims, the DiT predicts {max_action_dim}")
    if e.state_dim > max_state_dim:
        raise GeometryError(f"embodiment {e.tag}: {e.state_dim} state dims, the DiT's state encoder takes {max_state_dim}")
    if e.trained_view_size is not None and view_size is not None and tuple(e.trained_view_size) != tuple(view_size):
        raise GeometryError(
            f"policy.view_size {list(view_size)} differs from the training run's per-view resize "
            f"{list(e.trained_view_size)} (experiment_cfg/conf.yaml VideoResize); --set policy.view_size={list(e.trained_view_size)}"
        )


def default_view_size(e: Embodiment, checkpoint: str, *, wan22: bool) -> tuple[int, int]:
    """Per-view size the checkpoint was trained at: the training run's own resize where its experiment_cfg/conf.yaml
    says (a post-trained run), else the family's (upstream's data config ``image_resolution_height/width``):
    DreamZero-DROID 176x320 (droid_relative + the wan21 training script), the 5B 160x320 (droid_relative_wan22)."""
    if e.trained_view_size is not None:
        return tuple(e.trained_view_size)
    if checkpoint.startswith(BUILTIN_PREFIX):
        from ardiff_policies.dreamzero.tiny import TINY_5B_VIEW_SIZE, TINY_VARIANTS, TINY_VIEW_SIZE

        return TINY_5B_VIEW_SIZE if TINY_VARIANTS[checkpoint.removeprefix(BUILTIN_PREFIX)].wan22 else TINY_VIEW_SIZE
    if checkpoint.startswith(SYNTHETIC_PREFIX):
        from ardiff_policies.dreamzero.synthetic import parse_spec

        return parse_spec(checkpoint).view_size
    return (160, 320) if wan22 else (176, 320)


def family_image_resolution(e: Embodiment, target_video_size: tuple[int, int] | None, *, wan22: bool) -> tuple[int, int]:
    """The camera size upstream's server for this family advertises: the 14B's (socket_test_optimized_AR.py) a fixed
    180x320; the 5B's (eval_utils/serve_dreamzero_wan22.py) the size its eval transform expects, which sim_policy.py
    sets to the checkpoint's ``target_video_height/width`` (overwriting metadata.json's camera resolutions), else
    metadata.json's first camera (width x height), else 160x320. (A 5B config.json without both target keys gets
    upstream's 176x320 fallback, which this server refuses: its latent has an odd row.)"""
    if not wan22:
        return (180, 320)
    if target_video_size is not None:
        return tuple(target_video_size)
    first = e.camera_resolutions[0] if e.camera_resolutions else None
    return tuple(first) if first is not None else (160, 320)
