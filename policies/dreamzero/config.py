"""Settings of the DreamZero policy (torch-free: the front end validates them without loading a model)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import pydantic

from ardiff_policies import hub
from ardiff_policies.inference_steps import MAX_INFERENCE_STEPS, StepBounds, bounds_setting, step_bounds
from ardiff_policies.safety import SafetyConfig

# Upstream's default (NUM_DIT_STEPS=8): which of the 16 denoise steps run the DiT.
UPSTREAM_STEP_MASK = [True, True, True, False, False, False, True, False, False, False, True, False, False, True, True, True]

DEFAULT_NEGATIVE_PROMPT = (
    "Vibrant colors, overexposed, static, blurry details, text, subtitles, style, artwork, painting, "
    "image, still, grayscale, dull, worst quality, low quality, JPEG artifacts, ugly, mutilated, extra "
    "fingers, bad hands, bad face, deformed, disfigured, mutated limbs, fused fingers, stagnant image, "
    "cluttered background, three legs, many people in the background, walking backwards."
)


BUILTIN_PREFIX = "builtin:"
BUILTIN_TINY = "builtin:tiny"  # DROID
BUILTIN_TINY_5B = "builtin:tiny_5b"  # DROID on the Wan2.2-5B architecture (tiny.py)
BUILTIN_TINY_AGIBOT = "builtin:tiny_agibot"
BUILTIN_TINY_YAM = "builtin:tiny_yam"
BUILTIN_CHECKPOINTS = (BUILTIN_TINY, BUILTIN_TINY_5B, BUILTIN_TINY_AGIBOT, BUILTIN_TINY_YAM)
SYNTHETIC_PREFIX = "synthetic:"  # random weights in a released geometry, made on the device (synthetic.py)

# What the server reads from a checkpoint (checkpoint.py), and so all it fetches of a hub repo.
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*.safetensors",
    "experiment_cfg/metadata.json",
    "experiment_cfg/conf.yaml",
    "vae/config.json",
)
CHECKPOINT_TOKENIZER_FILES = ("tokenizer/*",)  # only when policy.tokenizer is not given
# A tokenizer repo (google/umt5-xxl) without its model weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "spiece.model", "config.json")
CHECKPOINT_EXAMPLE = "/path/to/DreamZero-DROID"
TOKENIZER_EXAMPLE = "/path/to/umt5-xxl"
# Where a once-per-prompt / once-per-window encoder runs: the engine's device (the DiT's), or another.
_COMPONENT_DEVICE = re.compile(r"^(engine|cpu|cuda(:\d+)?)$")


class DreamZeroConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: Literal["dreamzero"] = "dreamzero"  # DreamZero: the AR video-diffusion policy
    checkpoint: str = pydantic.Field(
        BUILTIN_TINY,
        description="checkpoint directory or Hugging Face id (org/name[@revision], e.g. GEAR-Dreams/DreamZero-DROID; 14B or 5B, told apart by its config.json), builtin:tiny / tiny_5b / tiny_agibot / tiny_yam or synthetic:<preset>",
    )
    tokenizer: str | None = pydantic.Field(
        None, description="tokenizer directory or Hugging Face id, e.g. google/umt5-xxl (default: <checkpoint>/tokenizer)"
    )
    # UMT5-XXL (5.7 B parameters) runs once per prompt (its embeddings are cached per session) and
    # CLIP once per window: on "cpu" they free GPU memory for the DiT and the KV cache.
    text_encoder_device: str = pydantic.Field("engine", description="engine (the DiT's device), cpu, cuda or cuda:N")
    image_encoder_device: str = pydantic.Field("engine", description="engine (the DiT's device), cpu, cuda or cuda:N")
    view_size: tuple[pydantic.PositiveInt, pydantic.PositiveInt] | None = pydantic.Field(
        None,
        description="per-view (height, width) fed to the model (default: the training run's resize, else the family's: 14B 176x320, 5B 160x320)",
    )
    image_resolution: tuple[pydantic.PositiveInt, pydantic.PositiveInt] | None = pydantic.Field(
        None,
        description="camera size advertised to clients (default: 14B 180x320; 5B its target_video_height/width, 160x320, "
        "to which it first resizes every received frame, as upstream's 5B server)",
    )
    num_inference_steps: int = pydantic.Field(16, ge=1, le=MAX_INFERENCE_STEPS)  # denoise steps per call (upstream: 16)
    request_inference_steps: tuple[pydantic.PositiveInt, pydantic.PositiveInt] | None = pydantic.Field(
        None,
        description="[min, max] denoising steps a request's num_inference_steps may choose (default [1, num_inference_steps]: "
        "fewer than configured, never more; at most 1000, the noise levels the DiT was trained on)",
    )
    sigma_shift: float = pydantic.Field(5.0, gt=0)  # flow-matching schedule shift (upstream: 5.0)
    cfg_scale: float = pydantic.Field(5.0, ge=1.0)  # classifier-free guidance on the video (1: no negative branch; upstream: 5.0)
    seed: int = 1140  # the sampler's noise seed (upstream's)
    dit_step_cache: Literal["off", "fixed", "dynamic"] = (
        "fixed"  # reuse the last velocity on some steps: off, fixed (dit_step_mask), dynamic (cosine 0.95/0.93 -> skip 4/2)
    )
    dit_step_mask: list[bool] = pydantic.Field(
        default_factory=lambda: list(UPSTREAM_STEP_MASK)
    )  # with dit_step_cache fixed: which steps run the DiT (upstream's 8 of 16)
    embodiment: str | None = pydantic.Field(
        None, description="embodiment tag in the checkpoint's metadata.json (default: its only one; oxe_droid among several)"
    )
    prompt_template: str | None = pydantic.Field(
        None, description="'... {task} ...' for a tag upstream's collate has no template for (default: upstream's)"
    )
    negative_prompt: str = DEFAULT_NEGATIVE_PROMPT  # the unconditional CFG branch's text (upstream's Wan negative prompt)
    # Requests with a ``continuation`` (policies/continuation.py): how the new chunk continues the last one.
    continuation: Literal["inpaint", "clean_prefix", "guided"] = pydantic.Field(
        "inpaint",
        description="inpaint (any checkpoint: frozen actions re-noised to each step's level, RTC soft mask), clean_prefix (checkpoints "
        "trained with per-token action noise: frozen tokens at timestep 0), guided (RTC's guidance: a backward through the DiT per "
        "denoising step; CPU path only, refused at start-up elsewhere)",
    )
    continuation_execution_horizon: int | None = pydantic.Field(
        None,
        ge=0,
        description="RTC's s: the soft mask reaches 0 at horizon - s (default: each request's executed count, the whole overlap); "
        "inpaint and guided only (refused with clean_prefix, which has no soft mask)",
    )

    safety: SafetyConfig = pydantic.Field(
        default_factory=SafetyConfig, description="the safety gate on the served embodiment's action keys (ardiff_policies.safety)"
    )

    @pydantic.field_validator("text_encoder_device", "image_encoder_device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _COMPONENT_DEVICE.match(value):
            raise ValueError("expected engine, cpu, cuda or cuda:<index>")
        return value

    @pydantic.model_validator(mode="after")
    def _check_execution_horizon(self) -> DreamZeroConfig:
        if self.continuation == "clean_prefix" and self.continuation_execution_horizon is not None:
            raise ValueError(
                f"continuation_execution_horizon: {self.continuation_execution_horizon} sets RTC's soft mask, which continuation "
                f"clean_prefix does not use (it pins the frozen actions only); unset it, or use continuation inpaint or guided"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _check_request_steps(self) -> DreamZeroConfig:
        bounds_setting("request_inference_steps", self.request_inference_steps)
        return self

    @property
    def inference_steps_bounds(self) -> StepBounds:
        """The steps a request may ask for (``request_inference_steps``, default 1 to the configured count)."""
        return step_bounds(self.request_inference_steps, self.num_inference_steps, "request_inference_steps")

    @pydantic.model_validator(mode="after")
    def _check_mask(self) -> DreamZeroConfig:
        if self.dit_step_cache == "fixed":
            if len(self.dit_step_mask) != self.num_inference_steps:
                raise ValueError(f"dit_step_mask has {len(self.dit_step_mask)} entries for {self.num_inference_steps} inference steps")
            if not self.dit_step_mask[0]:
                raise ValueError("dit_step_mask must run the DiT on the first step")
        return self

    def preflight(self) -> DreamZeroConfig:
        """Before any worker is spawned: Hugging Face ids become local snapshot directories (fetched
        into the hub cache when missing), then the checkpoint and tokenizer directories are checked.
        Returns the config the workers get: local paths only, so they never touch the network.
        Raises ValueError with one line naming the problem and the fix."""
        if self.checkpoint.startswith((BUILTIN_PREFIX, SYNTHETIC_PREFIX)):
            if self.checkpoint.startswith(BUILTIN_PREFIX) and self.checkpoint not in BUILTIN_CHECKPOINTS:
                raise ValueError(f"policy.checkpoint: unknown {self.checkpoint!r}; built in: {', '.join(BUILTIN_CHECKPOINTS)}")
            # a tokenizer given beside a generated checkpoint: fetched here too, never passed on as an id
            return self.model_copy(update={"tokenizer": str(self._tokenizer_dir(None))}) if self.tokenizer else self
        checkpoint, tokenizer = self.local_files()
        self.embodiment_of(checkpoint)
        return self.model_copy(update={"checkpoint": str(checkpoint), "tokenizer": str(tokenizer)})

    def files(self) -> tuple[Path, Path | None]:
        """The checkpoint and tokenizer directories a worker loads: a built-in tiny checkpoint is
        generated on first use; hub ids were made local by :meth:`preflight`, and an engine started
        without it (Ray replicas, in-process tests) fetches them here."""
        if self.checkpoint.startswith(BUILTIN_PREFIX):  # builtin:tiny, builtin:tiny_agibot, ...
            from ardiff_policies.dreamzero.tiny import ensure_tiny_checkpoint

            checkpoint = ensure_tiny_checkpoint(variant=self.checkpoint.removeprefix(BUILTIN_PREFIX))
            # a tokenizer given beside it resolves as in preflight (a Hub id is fetched, never read as a relative path):
            # Ray replicas get the config unresolved
            return checkpoint, self._tokenizer_dir(None) if self.tokenizer else None
        return self.local_files()

    def local_files(self) -> tuple[Path, Path]:
        """The checkpoint and tokenizer directories, hub ids fetched (see ``policies/hub.py``)."""
        patterns = CHECKPOINT_FILES + (() if self.tokenizer else CHECKPOINT_TOKENIZER_FILES)
        checkpoint = hub.resolve(self.checkpoint, key="policy.checkpoint", example=CHECKPOINT_EXAMPLE, allow_patterns=patterns)
        source = "" if checkpoint.as_posix() == Path(self.checkpoint).expanduser().as_posix() else f" ({self.checkpoint})"
        if not (checkpoint / "config.json").is_file():
            what = "has no config.json" if checkpoint.is_dir() else "is not a directory"
            raise ValueError(
                f"policy.checkpoint: {checkpoint}{source} {what}; point it at a DreamZero checkpoint: a local directory "
                f"(--set policy.checkpoint={CHECKPOINT_EXAMPLE}) or its Hugging Face id (GEAR-Dreams/DreamZero-DROID)"
            )
        return checkpoint, self._tokenizer_dir(checkpoint)

    def _tokenizer_dir(self, checkpoint: Path | None) -> Path:
        """``policy.tokenizer`` as a local directory (a hub id fetched), else the checkpoint's own."""
        if self.tokenizer:
            tokenizer = hub.resolve(self.tokenizer, key="policy.tokenizer", example=TOKENIZER_EXAMPLE, allow_patterns=TOKENIZER_FILES)
        else:
            tokenizer = checkpoint / "tokenizer"
        if not tokenizer.is_dir():
            raise ValueError(
                f"policy.tokenizer: {tokenizer} does not exist; give a google/umt5-xxl tokenizer: a local directory "
                f"(--set policy.tokenizer={TOKENIZER_EXAMPLE}) or its Hugging Face id (--set policy.tokenizer=google/umt5-xxl)"
            )
        return tokenizer

    def embodiment_of(self, checkpoint: Path):
        """The embodiment this config serves from a checkpoint directory (torch-free: metadata.json and
        experiment_cfg/conf.yaml). Raises ValueError naming what the checkpoint lacks."""
        import json

        from ardiff_policies.dreamzero.embodiments import read_experiment_config, resolve

        path = checkpoint / "experiment_cfg" / "metadata.json"
        try:
            metadata = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"policy.checkpoint: cannot read {path} ({exc}); the training run writes it under experiment_cfg/") from None
        return resolve(metadata, read_experiment_config(checkpoint), tag=self.embodiment, prompt_template=self.prompt_template)
