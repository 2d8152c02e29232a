"""A DreamZero call's own inputs: stitched frames, text embeddings, CLIP tokens, VAE latents.

What each session needs before the DiT runs, one session at a time: the call's camera views
cropped, resized and stitched into one canvas (the embodiment's layout); the prompt's UMT5
embeddings (the negative prompt's once per process); at a window start the newest frame's CLIP
tokens and VAE image conditioning; later, the observed frames' VAE latents. A window start's
encodes may run ahead on the engine's encoder thread (:meth:`InputEncoder.prepare`, called
through :meth:`DreamZeroPolicy.prepare`), so a new robot's first call never runs them inside
other robots' batched step; the step uses what was made only for that very call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ardiff_kv import Branch
from ardiff_policies.dreamzero.batch import PhaseTimer
from ardiff_policies.dreamzero.session import FRAMES_PER_CALL, DreamZeroSession, Prepared
from ardiff_policies.dreamzero.transforms import crop_and_resize, pixels_to_model_range, resize_like_opencv, resize_video, stitch_canvas
from ardiff_policies.embodiment import Embodiment
from ardiff_policies.observation import RobotObservation
from ardiff_policies.wan.prompt import clean_prompt

if TYPE_CHECKING:
    from ardiff_policies.dreamzero.model import DreamZeroModel


class InputEncoder:
    """Turns one session's observation and prompt into what the DiT reads (the model's VAE, CLIP and UMT5)."""

    def __init__(
        self,
        model: DreamZeroModel,
        embodiment: Embodiment,
        *,
        view_size: tuple[int, int],
        camera_sizes: Sequence[tuple[int, int]],
        negative_prompt: str,
        device: torch.device,
        dtype: torch.dtype,
        text_device: torch.device,
        image_device: torch.device,
    ) -> None:
        self.model = model
        self.embodiment = embodiment
        self.view_size = view_size
        self.camera_sizes = list(camera_sizes)
        self.negative_prompt = negative_prompt
        self.device, self.dtype = device, dtype
        self.text_device, self.image_device = text_device, image_device
        self.text_len = model.dit.config.text_len
        self.num_frame_per_block = model.dit.config.num_frame_per_block
        self.concat_first_frame_latent = model.dit.config.concat_first_frame_latent
        self.num_frames = model.action_head_config.num_frames
        self.target_video_size = model.action_head_config.target_video_size
        self._negative_embeds: torch.Tensor | None = None  # a model constant: encoded once per process
        self._side_stream = None  # the encoder thread's CUDA stream (prepare)

    # -- frames ------------------------------------------------------------------------------

    def canvas(self, observation: RobotObservation) -> np.ndarray:
        """The call's stitched frames. Only the newest FRAMES_PER_CALL are kept (a client may send up to 64): older ones are
        dropped before any pixel work."""
        size, e = self.view_size, self.embodiment
        frames = [observation.cameras.get(name) for name in e.cameras]
        frames = [None if v is None else v[-FRAMES_PER_CALL:] for v in frames]
        if self.model.vae.is_wan22:
            # Upstream's 5B server first brings every received frame to the advertised size with OpenCV's bilinear
            # resize (serve_dreamzero_wan22.py _resize_frames_to_resolution), then runs the transform on it.
            frames = [None if v is None else resize_like_opencv(v, s) for v, s in zip(frames, self.camera_sizes, strict=True)]
        views = [None if v is None else crop_and_resize(v, size, e.crop_scale) for v in frames]
        return stitch_canvas(e.layout, views, view_size=size)

    def video_tensor(self, session: DreamZeroSession) -> torch.Tensor:
        """The session's buffered canvases this call reads (1 on its first call, else FRAMES_PER_CALL, padded by
        repeating the oldest), as :meth:`model_video`."""
        frames = list(session.frames)
        wanted = 1 if session.calls == 1 else FRAMES_PER_CALL
        frames = frames[-wanted:]
        frames = [frames[0]] * (wanted - len(frames)) + frames
        return self.model_video(frames)

    def model_video(self, frames: list[np.ndarray]) -> torch.Tensor:
        """Stitched uint8 frames -> (1, 3, T, H, W) in [-1, 1] on the engine's device, at the checkpoint's target size.
        Frame by frame: a frame comes out the same whichever frames it is stacked with."""
        video = torch.from_numpy(np.stack(frames)).to(self.device)
        video = pixels_to_model_range(video.permute(3, 0, 1, 2).unsqueeze(0), self.dtype)
        target = self.target_video_size
        if target is not None and tuple(video.shape[-2:]) != target:
            video = resize_video(video, target)
        return video

    # -- text --------------------------------------------------------------------------------

    def tokenize(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask) padded to the DiT's text length, on the text encoder's device."""
        tokens = self.model.tokenizer(
            text,
            max_length=self.text_len,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
            add_special_tokens=True,
        )
        return tokens["input_ids"].to(self.text_device), tokens["attention_mask"].to(self.text_device)

    def encode_text(self, text: str) -> torch.Tensor:
        """Text embeddings on the engine's device, whichever device the text encoder runs on."""
        return self.model.text_encoder(*self.tokenize(text)).to(self.device, self.dtype)

    def prompt_embeds(self, session: DreamZeroSession, branches: Sequence[Branch]) -> dict[Branch, torch.Tensor]:
        """Text embeddings of the branches this process runs (the prompt's are cached per session)."""
        embeds = {}
        if Branch.COND in branches:
            if session.prompt_embeds is None:
                session.prompt_embeds = self.encode_text(session.prompt)
            embeds[Branch.COND] = session.prompt_embeds
        if Branch.UNCOND in branches:
            embeds[Branch.UNCOND] = self.negative_embeds()
        return embeds

    def negative_embeds(self) -> torch.Tensor:
        if self._negative_embeds is None:
            # Upstream's tokenizer cleans the negative prompt too (no template, no lower-casing).
            self._negative_embeds = self.encode_text(clean_prompt(self.negative_prompt))
        return self._negative_embeds

    @property
    def has_negative_embeds(self) -> bool:
        return self._negative_embeds is not None

    # -- images ------------------------------------------------------------------------------

    def clip_feature(self, newest: torch.Tensor) -> torch.Tensor:
        """CLIP tokens of a window's first frame ((1, 3, 1, H, W) in [-1, 1]), on the engine's device."""
        return self.model.image_encoder(newest[:, :, 0].to(self.image_device)).to(self.device, self.dtype)

    def image_conditioning(self, image: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(``ys``, the first frame's latent). ``ys``: VAE latents of [image, zeros x (num_frames - 1)] with a mask on
        latent 0 (14B). A DiT that does not concatenate ``ys`` (5B) needs only latent 0, which the causal VAE computes
        from frame 0 alone: only that frame is encoded."""
        b, c, _, h, w = image.shape
        concat = self.concat_first_frame_latent
        frames = [image]
        if concat:
            frames.append(torch.zeros(b, c, self.num_frames - 1, h, w, dtype=image.dtype, device=image.device))
        # Upstream runs this encode under CUDA bf16 autocast (WANPolicyHead.encode_image) and the per-call re-encode
        # without it. A bf16 model on a GPU does the same here: the VAE's RMS norms (upstream's formula, see
        # wan.vae.UpstreamRMSNorm) then yield float32 up to the next convolution. CPU autocast keeps norms in bf16
        # unlike CUDA's, so elsewhere this encode runs plainly in the model dtype, like upstream's re-encode.
        autocast = self.device.type == "cuda" and self.dtype == torch.bfloat16
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            latents = self.model.vae.encode(torch.cat(frames, dim=2))
        latents = latents.to(self.dtype)
        if not concat:
            return None, latents[:, :, :1]
        mask = torch.zeros_like(latents[:, :4])
        mask[:, :, 0] = 1
        return torch.cat([mask, latents], dim=1), latents[:, :, :1]

    def observation_latents(self, video: torch.Tensor) -> torch.Tensor:
        """Upstream's re-encode of newly observed frames: repeat each frame x2, prepend the first, keep the last latents."""
        nfpb = self.num_frame_per_block
        t = video.shape[2]
        if (t - 1) // 4 != nfpb:
            if t // 4 != nfpb:
                video = torch.repeat_interleave(video, nfpb // (t // 4), dim=2)
            video = torch.cat([video[:, :, :1], video], dim=2)
        return self.model.vae.encode(video)[:, :, -nfpb:]

    # -- ahead of the batch ------------------------------------------------------------------

    @torch.no_grad()
    def prepare(self, observation: RobotObservation, prompt: str, *, text: bool, negative: bool, window_start: bool) -> Prepared:
        """A call's encodes (its canvas; the prompt's text if ``text``; the negative prompt's if ``negative``; at a
        ``window_start`` CLIP and the image conditioning), on the encoder thread's own CUDA stream."""
        with self._encoder_stream():
            timer = PhaseTimer(self.device)
            canvas = self.canvas(observation)
            newest = self.model_video([canvas[-1]])
            timer.mark("frames")
            prompt_embeds = self.encode_text(prompt) if text else None
            if negative:
                self.negative_embeds()
            timer.mark("text")
            image = None
            if window_start:
                clip_feature = self.clip_feature(newest)
                timer.mark("vision")
                image = (clip_feature, *self.image_conditioning(newest))
                timer.mark("vae")
        return Prepared(observation, prompt, canvas, prompt_embeds, image, timer.ms)

    def _encoder_stream(self):
        """The encoder thread's own CUDA stream (it overlaps the batched step's), synchronized when the job ends."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return _synchronized(self._side_stream)


@contextlib.contextmanager
def _synchronized(stream):
    """Run on ``stream``; wait for it before leaving, so what ran there is ready on every stream."""
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
