"""Record upstream DreamZero's own outputs on the tiny Wan2.2-5B checkpoint: the parity anchor of the 5B tests.

Upstream's code (dreamzero0/dreamzero, imported from the path given on the command line, never copied here) runs
the tiny 5B (``builtin:tiny_5b``, written by ``ardiff_policies.dreamzero.tiny``) on the CPU in float32 and the outputs go to
``tests/reference_data/upstream_5b_tiny.{safetensors,json}``, which ``tests/policies/test_wan22.py`` reads:

* DiT: three ``CausalWanModel`` calls through its KV-cache path (prefill of the first frame, prefill of two frames,
  a denoise step with the action register), CFG-free (one cache);
* VAE: ``WanVideoVAE38.encode`` of a 5-frame video and ``.decode`` of its latents;
* policy: two calls of ``WANPolicyHead.lazy_joint_video_action`` (the window start with one frame, then four
  frames), both CFG branches, upstream's default step mask, on stitched DROID canvases, with upstream's
  ``WANPolicyHead.__init__`` loading every component from files and the whole checkpoint then loaded into it as
  upstream's ``VLA`` does (strict: every tensor name and shape of the tiny 5B is upstream's).

Usage (an environment with upstream's dependencies and this project importable)::

    git -C <mirror of dreamzero0/dreamzero> archive HEAD | tar -x -C /tmp/dreamzero-src
    python3 -m venv /tmp/upstream-venv
    /tmp/upstream-venv/bin/pip install torch==2.13.0 diffusers transformers safetensors einops hydra-core peft \
        accelerate ftfy regex tokenizers   # + this project's own dependencies (pip install -e <repo>)
    PYTHONPATH=<repo> /tmp/upstream-venv/bin/python scripts/record_upstream_5b.py --upstream /tmp/dreamzero-src

What is adapted to run upstream's inference on a CPU, in float32, at toy size (and why), nothing else:

* ``device="cuda"`` (hard-coded in ``WanVideoVAE38``'s statistics, the scheduler's sigmas, the action head's noise
  and zeros) is mapped to the CPU; ``torch.cuda.Event`` / ``synchronize`` (its timers) do nothing.
* ``torch.bfloat16`` (hard-coded casts of videos, state, prompt embeddings, noise and its autocast) is float32 while
  upstream runs: the reference is float32 end to end. Noise comes from a CPU generator seeded with upstream's seed.
* ``torch.compile`` (the scheduler's update steps, Wan helpers) is the identity: eager code, same operations.
* Attention: upstream's ``torch`` backend (``ATTENTION_BACKEND=torch``: SDPA, its GPU default FlashAttention needs
  CUDA), with ``AttentionModule``'s ``dtype`` (the dtype it casts q/k/v to, bf16 by default) float32; the cross-
  attention's ``flash_attention`` (asserts a CUDA tensor) is upstream's own SDPA fallback for GPUs without
  FlashAttention (``attention._sdpa_attention_fallback``), in float32.
* Upstream builds its encoders at full size; the tiny ones are built with upstream's own constructors at the tiny
  checkpoint's widths (``WanTextEncoder(dim=..)``, ``clip_xlm_roberta_vit_h_14(vision_dim=..)``,
  ``VideoVAE38_(dim=.., dec_dim=..)``); the DiT's CLIP projection ``MLPProj(1280, dim)`` takes the tiny CLIP width.
* torchvision: PyPI's wheel is built for CUDA and does not load against a CPU torch; upstream uses only
  ``Normalize`` from it on these paths, provided here as torchvision's tensor formula (``(x - mean) / std`` with
  mean/std in the input's dtype) when torchvision cannot be imported.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import hashlib
import importlib.machinery
import inspect
import json
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "tests" / "reference_data"
NAME = "upstream_5b_tiny"

# The policy calls: DROID canvases (wrist on top, exteriors below) as upstream's DreamTransform stitches them, drawn
# from these seeds (the test draws the same), and the robot state.
POLICY_CALLS = [
    {"frames": 1, "seed": 11, "joint_position": [0.1, -0.4, 0.2, -2.1, 0.05, 1.9, 0.6], "gripper_position": [0.2]},
    {"frames": 4, "seed": 12, "joint_position": [0.12, -0.38, 0.18, -2.05, 0.07, 1.95, 0.58], "gripper_position": [0.3]},
]
PROMPT = "pick up the red cup"


def canvas_frames(seed: int, frames: int, canvas: tuple[int, int]) -> np.ndarray:
    """Smooth random (T, H, W, 3) uint8 canvases: bilinear upsampling of coarse noise, so the VAE and the resize see
    image-like signal rather than per-pixel noise."""
    rng = np.random.default_rng(seed)
    coarse = torch.from_numpy(rng.uniform(0, 255, (frames, 3, canvas[0] // 8, canvas[1] // 8)).astype(np.float32))
    fine = torch.nn.functional.interpolate(coarse, size=canvas, mode="bilinear", align_corners=False)
    return fine.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def digest(directory: Path) -> str:
    """sha256 over the checkpoint's weight shards and config (what the tests compare against their own tiny 5B)."""
    h = hashlib.sha256()
    for path in [*sorted(directory.glob("*.safetensors")), directory / "config.json"]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ environment


def _torchvision_stand_in() -> None:
    """torchvision's ``Normalize`` (tensor path) when its wheel cannot load here; see the module docstring."""
    try:
        import torchvision  # noqa: F401

        return
    except Exception:  # noqa: BLE001 - a CUDA-built wheel fails in several ways
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    # Let diffusers / transformers / peft probe their optional dependencies first (they cache "no torchvision").
    import diffusers.models.autoencoders.autoencoder_kl_wan  # noqa: F401
    import peft.tuners  # noqa: F401
    import transformers.feature_extraction_utils  # noqa: F401

    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
        return mod

    tv, transforms, v2 = module("torchvision"), module("torchvision.transforms"), module("torchvision.transforms.v2")
    tv.transforms, transforms.v2 = transforms, v2

    class Normalize:
        def __init__(self, mean, std, inplace: bool = False) -> None:
            self.mean, self.std, self.inplace = mean, std, inplace

        def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
            mean = torch.as_tensor(self.mean, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
            std = torch.as_tensor(self.std, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
            return (tensor if self.inplace else tensor.clone()).sub_(mean).div_(std)

    class Compose:
        def __init__(self, transforms: list) -> None:
            self.transforms = transforms

    class Unused:  # built by upstream's CLIP factory, never called on the inference path
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    transforms.Normalize = v2.Normalize = Normalize
    transforms.Compose, transforms.Resize, transforms.ToTensor = Compose, Unused, Unused
    transforms.InterpolationMode = enum.Enum("InterpolationMode", {"BICUBIC": "bicubic"})


def _cpu(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _NoEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


@contextlib.contextmanager
def upstream_on_cpu():
    """``cuda`` -> the CPU and no CUDA timers (see the module docstring), while upstream's modules are built and run."""
    saved = {
        "tensor": torch.tensor,
        "zeros": torch.zeros,
        "ones": torch.ones,
        "randn": torch.randn,
        "Generator": torch.Generator,
        "to": torch.Tensor.to,
        "Event": torch.cuda.Event,
        "synchronize": torch.cuda.synchronize,
    }

    def with_cpu(fn):
        def wrapped(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return fn(*args, **kwargs)

        return wrapped

    def to(self, *args, **kwargs):
        args = tuple(_cpu(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return saved["to"](self, *args, **kwargs)

    def generator(device: Any = "cpu") -> torch.Generator:
        return saved["Generator"](_cpu(device))

    try:
        torch.tensor, torch.zeros, torch.ones, torch.randn = (with_cpu(saved[n]) for n in ("tensor", "zeros", "ones", "randn"))
        torch.Generator, torch.Tensor.to = generator, to
        torch.cuda.Event, torch.cuda.synchronize = _NoEvent, lambda *a, **k: None
        yield
    finally:
        torch.tensor, torch.zeros, torch.ones, torch.randn = saved["tensor"], saved["zeros"], saved["ones"], saved["randn"]
        torch.Generator, torch.Tensor.to = saved["Generator"], saved["to"]
        torch.cuda.Event, torch.cuda.synchronize = saved["Event"], saved["synchronize"]


@contextlib.contextmanager
def bfloat16_as_float32():
    """Upstream's hard-coded bf16 casts become float32 casts (only around its forward calls: torch's own loaders
    read ``torch.bfloat16`` too)."""
    saved = torch.bfloat16
    torch.bfloat16 = torch.float32
    try:
        yield
    finally:
        torch.bfloat16 = saved


def import_upstream(path: Path) -> types.SimpleNamespace:
    os.environ["ATTENTION_BACKEND"] = "torch"
    _torchvision_stand_in()
    compile_ = torch.compile
    torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda fn: fn)  # eager upstream
    sys.path.insert(0, str(path))
    try:
        from groot.vla.model.dreamzero.action_head import wan_flow_matching_action_tf
        from groot.vla.model.dreamzero.modules import (
            wan2_1_submodule,
            wan_video_dit_action_casual_chunk,
            wan_video_image_encoder,
            wan_video_text_encoder,
            wan_video_vae,
        )
    finally:
        torch.compile = compile_
    from groot.vla.model.dreamzero.modules import wan2_1_attention

    defaults = list(wan2_1_attention.AttentionModule.__init__.__defaults__)
    defaults[next(i for i, d in enumerate(defaults) if d is torch.bfloat16)] = torch.float32  # the `dtype` argument
    wan2_1_attention.AttentionModule.__init__.__defaults__ = tuple(defaults)
    from groot.vla.model.dreamzero.modules import attention

    def sdpa_in_float32(q, k, v, q_lens=None, k_lens=None, **_: Any) -> torch.Tensor:
        return attention._sdpa_attention_fallback(q, k, v, q_lens=q_lens, k_lens=k_lens, dtype=torch.float32)

    wan2_1_submodule.flash_attention = sdpa_in_float32
    # by role: the modules this script drives (``_UP.dit.CausalWanModel``, ...)
    return types.SimpleNamespace(
        head=wan_flow_matching_action_tf,
        submodule=wan2_1_submodule,
        dit=wan_video_dit_action_casual_chunk,
        image_encoder=wan_video_image_encoder,
        text_encoder=wan_video_text_encoder,
        vae=wan_video_vae,
    )


# ------------------------------------------------------------------------------------------ tiny modules

_UP: types.SimpleNamespace | None = None
_TINY: dict[str, Any] = {}


def tiny_dit(**cfg: Any) -> torch.nn.Module:
    """Upstream ``CausalWanModel`` from the checkpoint's diffusion_model_cfg, its CLIP projection at the tiny width."""
    accepted = set(inspect.signature(_UP.dit.CausalWanModel.__init__).parameters)
    model = _UP.dit.CausalWanModel(**{k: v for k, v in cfg.items() if k in accepted and k not in ("_target_", "_convert_")})
    model.img_emb = _UP.submodule.MLPProj(cfg["clip_dim"], cfg["dim"])
    return model


def tiny_text_encoder(text_encoder_pretrained_path: str, **_: Any) -> torch.nn.Module:
    t = _TINY["text"]
    return _UP.text_encoder.WanTextEncoder(
        vocab=t["vocab_size"],
        dim=t["d_model"],
        dim_attn=t["num_heads"] * t["d_kv"],
        dim_ffn=t["d_ff"],
        num_heads=t["num_heads"],
        num_layers=t["num_layers"],
        num_buckets=32,
        shared_pos=False,
        text_encoder_pretrained_path=text_encoder_pretrained_path,
    )


def tiny_image_encoder(image_encoder_pretrained_path: str, **_: Any) -> torch.nn.Module:
    """``WanImageEncoder`` with upstream's CLIP factory at the tiny widths (its constructor builds ViT-H/14 only)."""
    c = _TINY["image"]
    encoder = _UP.image_encoder.WanImageEncoder.__new__(_UP.image_encoder.WanImageEncoder)
    torch.nn.Module.__init__(encoder)
    encoder.model, encoder.transforms = _UP.image_encoder.clip_xlm_roberta_vit_h_14(
        pretrained=False,
        return_transforms=True,
        return_tokenizer=False,
        dtype=torch.float32,
        device="cpu",
        embed_dim=c["projection_dim"],
        vision_dim=c["hidden_size"],
        vision_mlp_ratio=c["intermediate_size"] // c["hidden_size"],
        vision_heads=c["num_attention_heads"],
        vision_layers=c["num_hidden_layers"],
    )
    encoder.image_encoder_pretrained_path = image_encoder_pretrained_path
    return encoder


def tiny_vae(vae_pretrained_path: str, z_dim: int = 48, dim: int = 160, **_: Any) -> torch.nn.Module:
    """``WanVideoVAE38(z_dim, dim)`` with its inner ``VideoVAE38_`` at the tiny decoder width and depth (upstream
    builds ``VideoVAE38_(z_dim, dim)`` with ``dec_dim=256, num_res_blocks=2``)."""
    v = _TINY["vae"]
    original = _UP.vae.VideoVAE38_
    _UP.vae.VideoVAE38_ = lambda z_dim, dim: original(dim=dim, z_dim=z_dim, dec_dim=v["decoder_base_dim"], num_res_blocks=v["num_res_blocks"])
    try:
        return _UP.vae.WanVideoVAE38(z_dim=z_dim, dim=dim, vae_pretrained_path=vae_pretrained_path)
    finally:
        _UP.vae.VideoVAE38_ = original


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def build_head(checkpoint: Path, tensors: dict[str, torch.Tensor], files: Path) -> torch.nn.Module:
    """Upstream's ``WANPolicyHead.__init__`` on the tiny checkpoint's config.json, each component loading its
    weight file as upstream does; then the whole checkpoint loaded strictly, as upstream's ``VLA`` loads it."""
    config = json.loads((checkpoint / "config.json").read_text())["action_head_cfg"]["config"]
    me = f"{Path(__file__).stem}"
    sys.modules.setdefault(me, sys.modules[__name__])
    paths = {name: files / f"{name}.pth" for name in ("text", "image", "vae")}
    torch.save(_strip(tensors, "action_head.text_encoder."), paths["text"])
    torch.save(_strip(tensors, "action_head.image_encoder.model."), paths["image"])
    torch.save(_strip(tensors, "action_head.vae.model."), paths["vae"])
    _TINY.update(
        text=config["text_encoder_cfg"]["architecture"], image=config["image_encoder_cfg"]["architecture"], vae=config["vae_cfg"]["architecture"]
    )
    config = {
        **config,
        "diffusion_model_cfg": {**config["diffusion_model_cfg"], "_target_": f"{me}.tiny_dit"},
        "text_encoder_cfg": {"_target_": f"{me}.tiny_text_encoder", "text_encoder_pretrained_path": str(paths["text"])},
        "image_encoder_cfg": {"_target_": f"{me}.tiny_image_encoder", "image_encoder_pretrained_path": str(paths["image"])},
        "vae_cfg": {
            **{k: v for k, v in config["vae_cfg"].items() if k in ("z_dim", "dim")},
            "_target_": f"{me}.tiny_vae",
            "vae_pretrained_path": str(paths["vae"]),
        },
        "skip_component_loading": True,  # the DiT comes with the whole checkpoint below, as in upstream's VLA
    }
    head = _UP.head.WANPolicyHead(_UP.head.WANPolicyHeadConfig(**config))
    head.load_state_dict(_strip(tensors, "action_head."), strict=True)
    head.trt_engine = None  # post_initialize sets it (with the CUDA/bf16 moves and compiles not wanted here)
    head._device = "cpu"
    return head.eval()


# ------------------------------------------------------------------------------------------ recordings


def record_dit(head: torch.nn.Module, out: dict[str, torch.Tensor]) -> list[dict]:
    """Three calls through upstream's KV-cache path, one cache (no CFG): prefill 1 frame, prefill 2, denoise 2 + actions."""
    model = cfg = head.model
    g = torch.Generator().manual_seed(5)
    h, w = 6, 12
    context = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g)
    clip = torch.randn(1, 257, model.img_emb.proj[0].normalized_shape[0], generator=g)
    out["dit.context"], out["dit.clip_feature"] = context, clip
    heads, head_dim = model.num_heads, model.dim // model.num_heads
    kv_cache = [torch.zeros(2, 1, 0, heads, head_dim) for _ in range(model.num_layers)]
    calls = [
        {"start": 0, "frames": 1, "action": False, "update": True, "t": 0},
        {"start": 1, "frames": 2, "action": False, "update": True, "t": 0},
        {"start": 3, "frames": 2, "action": True, "update": False, "t": 721},
    ]
    for i, call in enumerate(calls):
        x = torch.randn(1, cfg.out_dim, call["frames"], h, w, generator=g)
        timestep = torch.full((1, call["frames"]), call["t"], dtype=torch.long)
        extra: dict[str, torch.Tensor] = {}
        if call["action"]:
            extra = {
                "action": torch.randn(1, cfg.num_action_per_block, cfg.action_dim, generator=g),
                "timestep_action": torch.full((1, cfg.num_action_per_block), 503, dtype=torch.long),
                "state": torch.randn(1, cfg.num_state_per_block, cfg.max_state_dim, generator=g),
            }
        with torch.no_grad():
            video, action, updated = model(
                x,
                timestep,
                context=context,
                seq_len=call["frames"] * (h // 2) * (w // 2),
                kv_cache=kv_cache,
                crossattn_cache=None,
                current_start_frame=call["start"],
                y=None,
                clip_feature=clip,
                **extra,
            )
        if call["update"]:
            kv_cache = [c.clone() for c in updated]
        out |= {f"dit.{i}.x": x, f"dit.{i}.timestep": timestep, f"dit.{i}.video_pred": video}
        out |= {f"dit.{i}.{k}": v for k, v in extra.items()}
        if action is not None:
            out[f"dit.{i}.action_pred"] = action
    return calls


def record_vae(head: torch.nn.Module, out: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(6)
    coarse = torch.rand(1, 3, 5, 8, 16, generator=g) * 2 - 1
    video = torch.nn.functional.interpolate(coarse, size=(5, 32, 64), mode="trilinear", align_corners=False)
    with torch.no_grad():
        latents = head.vae.encode(video)
        decoded = head.vae.decode(latents)
    out |= {"vae.video": video, "vae.latents": latents, "vae.decoded": decoded}


def record_policy(head: torch.nn.Module, checkpoint: Path, out: dict[str, torch.Tensor]) -> dict:
    from transformers import AutoTokenizer
    from transformers.feature_extraction_utils import BatchFeature

    from ardiff_policies.dreamzero.config import DEFAULT_NEGATIVE_PROMPT
    from ardiff_policies.dreamzero.tiny import TINY_5B_VIEW_SIZE
    from ardiff_policies.dreamzero.transforms import NormStats, droid_prompt, normalize_state
    from ardiff_policies.wan.prompt import clean_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint / "tokenizer"), local_files_only=True)

    def tokens(text: str) -> tuple[torch.Tensor, torch.Tensor]:
        t = tokenizer(text, max_length=512, padding="max_length", truncation=True, return_tensors="pt", add_special_tokens=True)
        return t["input_ids"], t["attention_mask"]

    metadata = json.loads((checkpoint / "experiment_cfg" / "metadata.json").read_text())
    stats = NormStats.from_metadata(metadata, "oxe_droid", "state")
    text, text_mask = tokens(droid_prompt(PROMPT))
    negative, negative_mask = tokens(clean_prompt(DEFAULT_NEGATIVE_PROMPT))
    canvas = (2 * TINY_5B_VIEW_SIZE[0], 2 * TINY_5B_VIEW_SIZE[1])
    for i, call in enumerate(POLICY_CALLS):
        frames = canvas_frames(call["seed"], call["frames"], canvas)
        raw_state = np.array(call["joint_position"] + call["gripper_position"], dtype=np.float64)
        state = torch.from_numpy(normalize_state(raw_state, stats, 64)).float().view(1, 1, -1)
        batch = BatchFeature(
            data={
                "images": torch.from_numpy(frames[None]),
                "state": state,
                "embodiment_id": torch.tensor([0]),
                "text": text,
                "text_attention_mask": text_mask,
                "text_negative": negative,
                "text_attention_mask_negative": negative_mask,
            }
        )
        with torch.no_grad():
            result = head.lazy_joint_video_action(None, batch)
        call["canvas_sha256"] = hashlib.sha256(frames.tobytes()).hexdigest()
        out |= {f"policy.{i}.action_pred": result["action_pred"], f"policy.{i}.video_pred": result["video_pred"]}
        if i == 0:  # the window's conditioning
            out |= {"policy.clip_feature": head.clip_feas, "policy.first_latent": head.ys[:, 4:, :1]}
    out |= {"policy.text_ids": text.to(torch.int32), "policy.negative_ids": negative.to(torch.int32)}
    return {"prompt": PROMPT, "calls": POLICY_CALLS, "canvas": list(canvas)}


def main() -> None:
    global _UP
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", type=Path, required=True, help="a checkout (or git archive) of dreamzero0/dreamzero")
    parser.add_argument("--commit", default="unknown", help="upstream commit the checkout is at (written to the JSON)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"folder for {NAME}.safetensors / .json (default: %(default)s)")
    args = parser.parse_args()
    from safetensors.torch import load_file, save_file

    from ardiff_policies.dreamzero.tiny import write_tiny_checkpoint

    torch.manual_seed(0)
    _UP = import_upstream(args.upstream.resolve())
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp) / "tiny_5b", variant="tiny_5b")
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(checkpoint.glob("*.safetensors")):
            tensors |= load_file(shard)
        out: dict[str, torch.Tensor] = {}
        with upstream_on_cpu():
            head = build_head(checkpoint, tensors, Path(tmp))
            with bfloat16_as_float32():
                dit_calls = record_dit(head, out)
                record_vae(head, out)
                policy = record_policy(head, checkpoint, out)
        meta = {
            "note": (
                "Outputs of upstream DreamZero (dreamzero0/dreamzero: CausalWanModel, WanVideoVAE38, "
                "WANPolicyHead.lazy_joint_video_action) on the tiny Wan2.2-5B checkpoint (builtin:tiny_5b), float32 on "
                "the CPU, recorded by scripts/record_upstream_5b.py (its docstring lists what was adapted to run there)."
            ),
            "upstream_commit": args.commit,
            "torch": torch.__version__,
            "checkpoint_sha256": digest(checkpoint),
            "dit_calls": dit_calls,
            "policy": policy,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().float() if v.is_floating_point() else v.contiguous() for k, v in out.items()},
        args.out / f"{NAME}.safetensors",
        metadata={"format": "pt"},
    )
    (args.out / f"{NAME}.json").write_text(json.dumps(meta, indent=1) + "\n")
    size = (args.out / f"{NAME}.safetensors").stat().st_size
    print(f"wrote {args.out / NAME}.safetensors ({size / 1e3:.0f} kB, {len(out)} tensors) and .json")


if __name__ == "__main__":
    main()
