"""LingBot-VA's embodiments (torch-free): the keys of upstream's ``va_*_cfg.py`` an episode reads.

The embodiment (cameras and their layout, chunking, action channel map, quantile statistics, steps, shifts, guidance)
is not in a LingBot-VA checkpoint: upstream keeps it in Python configs. :class:`Embodiment` holds those keys;
:data:`ROBOTWIN` and :data:`FRANKA` are upstream's two first shipped configs (its later ones, recorded as data:
``upstream_configs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Embodiment:
    """The keys of upstream's ``va_*_cfg.py`` the episode reads (LingBot-VA checkpoints do not carry them)."""

    layout: str  # "robotwin_tshape" (high camera + two half-size wrists through a second VAE stream) or "none"
    cameras: tuple[str, ...]
    height: int
    width: int
    frame_chunk_size: int
    action_per_frame: int
    attn_window: int
    used_action_channel_ids: tuple[int, ...]
    q01: tuple[float, ...]
    q99: tuple[float, ...]
    action_dim: int = 30
    guidance_scale: float = 5.0
    action_guidance_scale: float = 1.0
    num_inference_steps: int = 25
    action_num_inference_steps: int = 50
    snr_shift: float = 5.0
    action_snr_shift: float = 1.0

    def __post_init__(self) -> None:
        if self.layout not in ("robotwin_tshape", "none"):
            raise ValueError(f"embodiment layout {self.layout!r}: expected robotwin_tshape or none")
        if self.layout == "robotwin_tshape" and len(self.cameras) != 3:
            raise ValueError("the robotwin_tshape layout takes three cameras: high, left wrist, right wrist")
        if len(self.q01) != self.action_dim or len(self.q99) != self.action_dim:
            raise ValueError(f"q01 / q99 need {self.action_dim} values each")
        if sorted(set(self.used_action_channel_ids)) != sorted(self.used_action_channel_ids) or not all(
            0 <= c < self.action_dim for c in self.used_action_channel_ids
        ):
            raise ValueError(f"used_action_channel_ids must be distinct channels in [0, {self.action_dim})")
        # whole 2x2 patches of latents: T layout rows (h / 16) * 3 / 2 even, wrists at half size
        rows, cols = (64, 32) if self.layout == "robotwin_tshape" else (32, 32)
        if self.height % rows or self.width % cols:
            raise ValueError(f"the {self.layout} layout needs height a multiple of {rows} and width of {cols}")
        if self.guidance_scale <= 1 and self.action_guidance_scale > 1:
            # upstream encodes the negative prompt only for video guidance > 1 and then fails on the action CFG
            raise ValueError("action_guidance_scale > 1 needs guidance_scale > 1 (upstream's negative prompt)")

    @property
    def latent_size(self) -> tuple[int, int]:
        """The latent frame: T layout (wrists side by side above the high camera) or cameras side by side."""
        if self.layout == "robotwin_tshape":
            return (self.height // 16) * 3 // 2, self.width // 16
        return self.height // 16, self.width // 16 * len(self.cameras)

    @property
    def video_tokens_per_chunk(self) -> int:
        h, w = self.latent_size
        return self.frame_chunk_size * (h // 2) * (w // 2)

    @property
    def action_tokens_per_chunk(self) -> int:
        return self.frame_chunk_size * self.action_per_frame


def _channels() -> tuple[int, ...]:
    # left arm 0-6, left gripper 28, right arm 7-13, right gripper 29 (va_robotwin_cfg.py / va_franka_cfg.py)
    return (*range(0, 7), 28, *range(7, 14), 29)


# Upstream's two shipped embodiments (wan_va/configs/va_robotwin_cfg.py, va_franka_cfg.py at 6f092cb).
ROBOTWIN = Embodiment(
    layout="robotwin_tshape",
    cameras=("observation.images.cam_high", "observation.images.cam_left_wrist", "observation.images.cam_right_wrist"),
    height=256,
    width=320,
    frame_chunk_size=2,
    action_per_frame=16,
    attn_window=72,
    used_action_channel_ids=_channels(),
    q01=(
        -0.06172713458538055,
        -3.6716461181640625e-05,
        -0.08783501386642456,
        -1,
        -1,
        -1,
        -1,
        -0.3547105032205582,
        -1.3113021850585938e-06,
        -0.11975435614585876,
        -1,
        -1,
        -1,
        -1,
        *[0.0] * 16,
    ),
    q99=(
        0.3462600058317184,
        0.39966784834861746,
        0.14745532035827624,
        1,
        1,
        1,
        1,
        0.034201726913452024,
        0.39142737388610793,
        0.1792279863357542,
        1,
        1,
        1,
        1,
        *[0.0] * 14,
        1.0,
        1.0,
    ),
    guidance_scale=5.0,
    action_guidance_scale=1.0,
    num_inference_steps=25,
    action_num_inference_steps=50,
    snr_shift=5.0,
    action_snr_shift=1.0,
)
FRANKA = Embodiment(
    layout="none",
    cameras=("observation.images.cam_high", "observation.images.cam_left_wrist", "observation.images.cam_right_wrist"),
    height=224,
    width=320,
    frame_chunk_size=4,
    action_per_frame=20,
    attn_window=30,
    used_action_channel_ids=_channels(),
    q01=(
        0.3051295876502991,
        -0.22647984325885773,
        0.19957000017166138,
        -0.022680532187223434,
        -0.05553057789802551,
        -0.2693849802017212,
        -0.29341773986816405,
        0.2935442328453064,
        -0.4431332051753998,
        0.21256473660469055,
        -0.7962440848350525,
        -0.40816226601600647,
        -0.28359392285346985,
        -0.44507765769958496,
        *[0.0] * 16,
    ),
    q99=(
        0.7572150230407715,
        0.47736290097236633,
        0.6428080797195435,
        0.9835678935050964,
        0.9927203059196472,
        0.28041139245033264,
        0.47529348731040877,
        0.7564866304397571,
        0.04082797020673729,
        0.5355993628501885,
        0.9976375699043274,
        0.8973174452781656,
        0.6016915678977965,
        0.5027598619461056,
        *[0.0] * 14,
        1.0,
        1.0,
    ),
    guidance_scale=5.0,
    action_guidance_scale=1.0,
    num_inference_steps=5,
    action_num_inference_steps=10,
    snr_shift=5.0,
    action_snr_shift=1.0,
)


# Zero-WAM's RoboTwin (jianwenli96/Zero-WAM ``va_robotwin_cfg.py``, whose file the index read here lacks: its values as
# docs/icl_inference.md §3 and tests/test_icl_server.py give them): three cameras side by side at 224x288 (its first
# observation is always encoded side by side, so the T layout is not served), 2-frame chunks of 16 actions, 50 video
# and 50 action steps at shifts 5 and 1, the action statistics upstream's test pins for the first 14 channels (the
# grippers' 28 / 29: LingBot-VA's RoboTwin ones, [0, 1]). The window is the transformer's ``attn_window`` (upstream's
# server never overrides it; ``attn_window`` here is that default) and guidance is decided per episode
# (``zero_wam_guidance.py``): ``guidance_scale`` / ``action_guidance_scale`` are not read.
ZERO_WAM_ROBOTWIN = Embodiment(
    layout="none",
    cameras=ROBOTWIN.cameras,
    height=224,
    width=288,
    frame_chunk_size=2,
    action_per_frame=16,
    attn_window=64,
    used_action_channel_ids=_channels(),
    q01=(
        -0.054687286317348476,
        -9.834766387939453e-07,
        -0.0746749371290207,
        -1,
        -1,
        -1,
        -1,
        -0.3589721029996872,
        -1.1026859283447266e-06,
        -0.11628214418888091,
        -1,
        -1,
        -1,
        -1,
        *[0.0] * 16,
    ),
    q99=(
        0.35284559458494186,
        0.3960446125268936,
        0.1493294847011566,
        1,
        1,
        1,
        1,
        0.02997654676437378,
        0.38793458312749857,
        0.18672722578048706,
        1,
        1,
        1,
        1,
        *[0.0] * 14,
        1.0,
        1.0,
    ),
    guidance_scale=1.0,
    action_guidance_scale=1.0,
    num_inference_steps=50,
    action_num_inference_steps=50,
    snr_shift=5.0,
    action_snr_shift=1.0,
)
