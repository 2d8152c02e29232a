"""Record upstream LingBot-VA's own transformer outputs on the tiny checkpoint: the parity anchor of the LingBot-VA tests.

Upstream's code (Robbyant/lingbot-va ``wan_va/modules/model.py`` and ``wan_va/utils/{utils,scheduler}.py``, imported
from the path given on the command line, never copied here) runs the tiny transformer (``ardiff_policies.lingbot_va.tiny``)
on the CPU in float32, and the outputs go to ``tests/reference_data/upstream_lingbot_va_tiny.{safetensors,json}``,
which ``tests/policies/test_lingbot_va_model.py`` and ``tests/kv/test_provisional.py`` read:

* ``single.video`` / ``single.action``: one forward in each mode without a cache (CFG batch of two: the prompt and
  the negative prompt), the first chunk's conditioning frame at timestep 0 in the video call;
* ``episode.N``: every forward of a short episode through upstream's own KV cache (``create_empty_cache``,
  ``update_cache`` 0 / 1 / 2, ``clear_pred_cache``), driven the way ``wan_va_server.py`` drives it: per chunk the
  video denoising steps plus the trailing t = 0 step that keeps the predicted K/V, the same for the actions, then
  ``compute_kv_cache``'s clear and two committed writes. A window of two chunks slides twice, and chunk 1 is
  predicted twice before its commit (a client that calls ``infer`` again), so predicted entries pile up, outlive
  an eviction of committed ones, and are dropped together. Timesteps are upstream's schedulers' (shift 5 video,
  shift 1 action, padded with the trailing 0).

* ``policy.*``: a whole episode of upstream's own server (``VA_Server._reset`` / ``_infer`` / ``_compute_kv_cache``
  through ``VA_Server.infer``, the messages the RoboTwin client sends) on the tiny checkpoint with the tiny RoboTwin
  embodiment (``ardiff_policies.lingbot_va.tiny.TINY_EMBODIMENT``): reset, then four chunks of infer + compute_kv_cache
  (the window slides twice), its global generator seeded right after the reset; the actions of every chunk and the
  first chunk's encoded observation.

Inputs are drawn from seeded CPU generators (``torch.randn(shape, generator=Generator().manual_seed(seed))``); the
JSON lists every call (mode, update_cache, frame start, timesteps, seeds) and the sha256 of each input, so the tests
draw the same tensors and check they did.

Usage::

    mkdir -p /tmp/lingbot-va-src
    git -C <mirror of Robbyant/lingbot-va> archive HEAD wan_va | tar -x -C /tmp/lingbot-va-src  # the code only
    pip install --target /tmp/lingbot-deps einops easydict   # upstream's imports this project lacks
    PYTHONPATH=<repo>:/tmp/lingbot-deps .venv/bin/python scripts/record_upstream_lingbot_va.py \\
        --upstream /tmp/lingbot-va-src --commit <sha>

Adapted to run upstream on a CPU, and nothing else: ``flash_attn`` (imported at module load, unused with
``attn_mode="torch"``) is a stand-in module whose function raises if called. The server object is built without its
``__init__`` (which wants CUDA and ``torch.distributed``): the same components its ``__init__`` loads from the
checkpoint (``load_vae`` twice, ``load_text_encoder``, ``load_transformer``, in float32 on the CPU) are set on it,
with the tiny checkpoint's tokenizer through ``AutoTokenizer`` (upstream's ``T5TokenizerFast`` expects a
SentencePiece vocabulary; the tiny one is word-level). ``torch.amp.autocast('cuda')`` is a no-op on the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import tempfile
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "tests" / "reference_data"
NAME = "upstream_lingbot_va_tiny"

TEXT_TOKENS = 12  # prompt positions (upstream pads to 512; the transformer does not care how many)
PROMPT_TOKENS = (7, 1)  # real tokens of the prompt and of the negative prompt ""; the rest are zeros, as upstream's
# single calls: latents (48, 2, 4, 8) -> 2 x 2 x 4 = 16 tokens; 4 actions per frame
SINGLE = {"frames": 2, "height": 4, "width": 8, "actions_per_frame": 4, "start": 6, "t": 723.4, "seed": 100}
# the episode: 4 x 4 latents (4 tokens per frame, 8 per chunk), 2 actions per frame (4 per chunk): gcd 4 -> pages of
# 4 tokens, a video group is 2 pages, an action group 1; attn_window 4 -> the cache holds 2 chunks (24 tokens)
EPISODE = {
    "frames": 2,
    "height": 4,
    "width": 4,
    "actions_per_frame": 2,
    "attn_window": 4,
    "video_steps": 2,
    "action_steps": 2,
    "video_shift": 5.0,
    "action_shift": 1.0,
    "chunks": [{"infers": 1}, {"infers": 2}, {"infers": 1}, {"infers": 1}],
}


def randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def text_embeddings(dim: int, seed: int) -> torch.Tensor:
    """(2, TEXT_TOKENS, dim): prompt and negative prompt, zeros past their lengths (upstream's padding)."""
    text = randn((2, TEXT_TOKENS, dim), seed)
    for row, length in enumerate(PROMPT_TOKENS):
        text[row, length:] = 0
    return text


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def episode_calls(video_timesteps: list[float], action_timesteps: list[float]) -> list[dict[str, Any]]:
    """Every transformer forward of the episode, in upstream's order (``wan_va_server.py``)."""
    calls: list[dict[str, Any]] = []
    frames = EPISODE["frames"]
    for chunk, plan in enumerate(EPISODE["chunks"]):
        start = chunk * frames  # frame_st_id advances by the latent frames each compute_kv_cache writes
        for _ in range(plan["infers"]):
            for mode, timesteps in (("video", video_timesteps), ("action", action_timesteps)):
                for i, t in enumerate(timesteps):
                    per_frame = [t] * frames
                    if start == 0:
                        per_frame[0] = 0.0  # the conditioning frame (first chunk)
                    update = 1 if i == len(timesteps) - 1 else 0  # the trailing t = 0 step keeps the predicted K/V
                    calls.append({"mode": mode, "update": update, "start": start, "timesteps": per_frame})
        calls.append({"clear_pred": True})
        for mode in ("video", "action"):
            calls.append({"mode": mode, "update": 2, "start": start, "timesteps": [0.0] * frames})
    seed = 1000
    for call in calls:
        if "mode" in call:
            call["seed"] = seed
            seed += 1
    return calls


def call_input(call: dict[str, Any], geometry: dict[str, Any], action_dim: int, channels: int) -> torch.Tensor:
    """The call's noisy input, batch 1 (the server repeats it for the CFG batch)."""
    f = geometry["frames"]
    if call["mode"] == "video":
        return randn((1, channels, f, geometry["height"], geometry["width"]), call["seed"])
    return randn((1, action_dim, f, geometry["actions_per_frame"], 1), call["seed"])


# ------------------------------------------------------------------------------------------- upstream


def import_upstream(path: Path) -> types.SimpleNamespace:
    stand_in = types.ModuleType("flash_attn_interface")

    def flash_attn_func(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("flash_attn stand-in: the recording runs attn_mode='torch'")

    stand_in.flash_attn_func = flash_attn_func
    sys.modules.setdefault("flash_attn_interface", stand_in)

    def load(name: str, file: Path) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    wan_va = path / "wan_va"
    return types.SimpleNamespace(
        model=load("lingbot_upstream_model", wan_va / "modules" / "model.py"),
        utils=load("lingbot_upstream_utils", wan_va / "utils" / "utils.py"),
        scheduler=load("lingbot_upstream_scheduler", wan_va / "utils" / "scheduler.py"),
    )


def upstream_transformer(up: types.SimpleNamespace, checkpoint: Path) -> torch.nn.Module:
    """Upstream's class from the checkpoint's config.json, every tensor loaded strictly."""
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "transformer" / "config.json").read_text())
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    model = up.model.WanTransformer3DModel(**kwargs)
    model.load_state_dict(load_file(checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"), strict=True)
    return model.float().eval()


def schedule(up: types.SimpleNamespace, steps: int, shift: float) -> list[float]:
    """The server's timesteps: FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True), padded with a 0."""
    scheduler = up.scheduler.FlowMatchScheduler(shift=shift, sigma_min=0.0, extra_one_step=True)
    scheduler.set_timesteps(steps)
    return torch.nn.functional.pad(scheduler.timesteps, (0, 1), mode="constant", value=0).tolist()


def upstream_input(up, x: torch.Tensor, mode: str, timesteps: list[float], start: int, text: torch.Tensor, patch) -> dict:
    """``_prepare_latent_input`` + ``_repeat_input_for_cfg``: batch 2, per-frame timesteps, upstream's grid ids."""
    if mode == "video":
        grid = up.utils.get_mesh_id(x.shape[-3] // patch[0], x.shape[-2] // patch[1], x.shape[-1] // patch[2], 0, 1, start)
    else:
        grid = up.utils.get_mesh_id(x.shape[-3], x.shape[-2], x.shape[-1], 1, 1, start, action=True)
    return {
        "noisy_latents": x.repeat(2, 1, 1, 1, 1),
        "text_emb": text,
        "grid_id": grid[None].repeat(2, 1, 1),
        "timesteps": torch.tensor(timesteps, dtype=torch.float32)[None].repeat(2, 1),
    }


def upstream_output(up, model, out: torch.Tensor, mode: str, x: torch.Tensor, patch) -> torch.Tensor:
    """The server's reshaping of the transformer's output: ``data_seq_to_patch`` / ``b (f n) c -> b c f n 1``."""
    f, h, w = x.shape[2:]
    if mode == "video":
        return up.utils.data_seq_to_patch(patch, out, f, h, w, batch_size=2)
    return out.transpose(1, 2).reshape(2, out.shape[-1], f, h, w)


POLICY = {"prompt": "grab the white mug and place it on the table", "seed": 1234, "chunks": 4, "camera_size": [48, 72]}


def camera_frame(seed: int, size: tuple[int, int]) -> Any:
    """A smooth random (H, W, 3) uint8 image: bilinear upsampling of coarse noise (image-like signal for the VAE)."""
    coarse = randn((1, 3, size[0] // 8, size[1] // 8), seed) * 80 + 128
    fine = torch.nn.functional.interpolate(coarse, size=size, mode="bilinear", align_corners=False)
    return fine.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0).numpy()


def observation(cameras: Sequence[str], seed: int, size: Sequence[int] | None = None) -> dict[str, Any]:
    """One formatted observation, as the RoboTwin client's ``format_obs`` builds it (images only are read): camera i is
    ``camera_frame(seed * 10 + i, size)`` (default: the policy episode's camera size)."""
    size = tuple(size or POLICY["camera_size"])
    return {camera: camera_frame(seed * 10 + i, size) for i, camera in enumerate(cameras)}


def key_frames(cameras: Sequence[str], chunk: int, count: int) -> list[dict[str, Any]]:
    return [observation(cameras, 1000 * (chunk + 1) + k) for k in range(count)]


def job_config(e: Any, save_root: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The keys of upstream's ``va_*_cfg.py`` its server reads, from an embodiment (an EasyDict, as upstream's configs)."""
    from easydict import EasyDict

    used = list(e.used_action_channel_ids)
    inverse = [len(used)] * e.action_dim
    for i, j in enumerate(used):
        inverse[j] = i
    return EasyDict(
        env_type=e.layout,
        height=e.height,
        width=e.width,
        frame_chunk_size=e.frame_chunk_size,
        action_per_frame=e.action_per_frame,
        attn_window=e.attn_window,
        action_dim=e.action_dim,
        obs_cam_keys=list(e.cameras),
        guidance_scale=e.guidance_scale,
        action_guidance_scale=e.action_guidance_scale,
        num_inference_steps=e.num_inference_steps,
        video_exec_step=-1,
        action_num_inference_steps=e.action_num_inference_steps,
        snr_shift=e.snr_shift,
        action_snr_shift=e.action_snr_shift,
        used_action_channel_ids=used,
        inverse_used_action_channel_ids=inverse,
        action_norm_method="quantiles",
        norm_stat={"q01": list(e.q01), "q99": list(e.q99)},
        patch_size=(1, 2, 2),
        param_dtype=dtype,
        save_root=str(save_root),
    )


def load_components(srv: Any, checkpoint: Path, modules_utils: Any, layout: str, dtype: torch.dtype = torch.float32) -> None:
    """What upstream's ``VA_Server.__init__`` loads besides the transformer and the schedulers, on the CPU in ``dtype``
    (``modules_utils``: upstream's ``wan_va/modules/utils.py``): the VAE twice for the T layout, its streaming
    wrappers, the text encoder, and the tiny tokenizer through ``AutoTokenizer`` (see the module docstring)."""
    from transformers import AutoTokenizer

    srv.vae = modules_utils.load_vae(str(checkpoint / "vae"), torch_dtype=dtype, torch_device="cpu")
    srv.streaming_vae = modules_utils.WanVAEStreamingWrapper(srv.vae)
    srv.tokenizer = AutoTokenizer.from_pretrained(checkpoint / "tokenizer")
    srv.text_encoder = modules_utils.load_text_encoder(str(checkpoint / "text_encoder"), torch_dtype=dtype, torch_device="cpu")
    srv.env_type = layout
    srv.streaming_vae_half = None
    if layout == "robotwin_tshape":
        vae_half = modules_utils.load_vae(str(checkpoint / "vae"), torch_dtype=dtype, torch_device="cpu")
        srv.streaming_vae_half = modules_utils.WanVAEStreamingWrapper(vae_half)


def upstream_server(path: Path, checkpoint: Path, embodiment: Any, save_root: Path) -> Any:
    """upstream's VA_Server with its __init__'s components, on the CPU in float32 (see the module docstring)."""
    sys.path.insert(0, str(path / "wan_va"))
    import wan_va_server
    from modules import utils as modules_utils
    from utils import FlowMatchScheduler

    e = embodiment
    config = job_config(e, save_root)
    srv = object.__new__(wan_va_server.VA_Server)
    srv.cache_name, srv.job_config, srv.save_root = "pos", config, config.save_root
    srv.dtype, srv.device = torch.float32, torch.device("cpu")
    srv.scheduler = FlowMatchScheduler(shift=e.snr_shift, sigma_min=0.0, extra_one_step=True)
    srv.action_scheduler = FlowMatchScheduler(shift=e.action_snr_shift, sigma_min=0.0, extra_one_step=True)  # upstream's name
    srv.scheduler.set_timesteps(1000, training=True)
    srv.action_scheduler.set_timesteps(1000, training=True)
    load_components(srv, checkpoint, modules_utils, e.layout)
    srv.transformer = modules_utils.load_transformer(str(checkpoint / "transformer"), torch_dtype=torch.float32, torch_device="cpu").eval()
    return srv


def record_policy(path: Path, checkpoint: Path, save_root: Path, out: dict[str, torch.Tensor]) -> dict[str, Any]:
    """An episode through upstream's server, the way the RoboTwin client drives it."""
    from ardiff_policies.lingbot_va.tiny import TINY_EMBODIMENT as e

    srv = upstream_server(path, checkpoint, e, save_root)
    srv.infer({"reset": True, "prompt": POLICY["prompt"]})
    torch.manual_seed(POLICY["seed"])  # upstream never seeds: the episode's generator state, set once after reset
    frames_per_latent = 4
    for chunk in range(POLICY["chunks"]):
        first = observation(e.cameras, chunk)
        reply = srv.infer({"obs": first, "prompt": POLICY["prompt"], "video_guidance_scale": 5.0, "action_guidance_scale": 5.0})
        action = reply["action"]
        out[f"policy.actions.{chunk}"] = torch.from_numpy(action)
        if chunk == 0:
            out["policy.first_latent"] = srv.init_latent.float()
        count = frames_per_latent * (e.frame_chunk_size - (chunk == 0))
        srv.infer({"obs": key_frames(e.cameras, chunk, count), "compute_kv_cache": True, "imagine": False, "state": action})
    return POLICY


def main() -> None:
    args = arguments(__doc__, NAME, "a checkout (or git archive) of Robbyant/lingbot-va")
    import diffusers

    from ardiff_policies.lingbot_va.tiny import write_tiny_checkpoint
    from ardiff_policies.wan.tiny import tree_digest

    up = import_upstream(args.upstream.resolve())
    out: dict[str, torch.Tensor] = {}
    inputs: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        checkpoint = write_tiny_checkpoint(Path(tmp) / "tiny_lingbot_va")
        model = upstream_transformer(up, checkpoint)
        cfg = model.config
        patch = tuple(cfg.patch_size)
        text = text_embeddings(cfg.text_dim, seed=7)
        inputs["text"] = sha(text)

        # -- one forward per mode, no cache
        model.clear_cache("pos")  # attn_caches['pos'] = None: attention over the call's own tokens
        single = SINGLE
        for mode in ("video", "action"):
            call = {"mode": mode, "seed": single["seed"] + (mode == "action")}
            x = call_input(call, single, cfg.action_dim, cfg.in_channels)
            timesteps = [single["t"]] * single["frames"]
            if mode == "video":
                timesteps[0] = 0.0
            y = model(upstream_input(up, x, mode, timesteps, single["start"], text, patch), update_cache=0, action_mode=mode == "action")
            out[f"single.{mode}"] = upstream_output(up, model, y, mode, x, patch)
            inputs[f"single.{mode}"] = sha(x)

        # -- an episode through upstream's cache
        ep = EPISODE
        video_timesteps = schedule(up, ep["video_steps"], ep["video_shift"])
        action_timesteps = schedule(up, ep["action_steps"], ep["action_shift"])
        calls = episode_calls(video_timesteps, action_timesteps)
        tokens_per_chunk = ep["frames"] * (ep["height"] // patch[1]) * (ep["width"] // patch[2])
        actions_per_chunk = ep["frames"] * ep["actions_per_frame"]
        model.create_empty_cache("pos", ep["attn_window"], tokens_per_chunk, actions_per_chunk, device="cpu", dtype=torch.float32, batch_size=2)
        for n, call in enumerate(calls):
            if call.get("clear_pred"):
                model.clear_pred_cache("pos")
                continue
            x = call_input(call, ep, cfg.action_dim, cfg.in_channels)
            y = model(
                upstream_input(up, x, call["mode"], call["timesteps"], call["start"], text, patch),
                update_cache=call["update"],
                cache_name="pos",
                action_mode=call["mode"] == "action",
            )
            out[f"episode.{n}"] = upstream_output(up, model, y, call["mode"], x, patch)
            inputs[f"episode.{n}"] = sha(x)
        policy = record_policy(args.upstream.resolve(), checkpoint, Path(tmp) / "visualization", out)
        meta = {
            "note": (
                "Outputs of upstream LingBot-VA's WanTransformer3DModel (Robbyant/lingbot-va wan_va/modules/model.py) "
                "on the tiny checkpoint (ardiff_policies.lingbot_va.tiny), float32 on the CPU, through its own KV cache, "
                "recorded by scripts/record_upstream_lingbot_va.py."
            ),
            "upstream_commit": args.commit,
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "checkpoint_transformer_sha256": tree_digest(checkpoint / "transformer"),
            "text_tokens": TEXT_TOKENS,
            "prompt_tokens": list(PROMPT_TOKENS),
            "single": SINGLE,
            "episode": {**EPISODE, "video_timesteps": video_timesteps, "action_timesteps": action_timesteps, "calls": calls},
            "input_sha256": inputs,
            "policy": policy,
        }
    write_reference(args.out, NAME, out, meta)


def arguments(doc: str, name: str, upstream: str, commit: bool = True) -> argparse.Namespace:
    """A recorder's command line: ``--upstream`` (``upstream`` says what it is), ``--commit`` (when the checkout is at
    one commit), ``--out`` (default: tests/reference_data)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--upstream", type=Path, required=True, help=upstream)
    if commit:
        parser.add_argument("--commit", default="unknown", help="upstream commit the checkout is at (written to the JSON)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"folder for {name}.safetensors / .json (default: %(default)s)")
    return parser.parse_args()


def write_reference(out_dir: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """``<name>.safetensors`` (float32) and ``<name>.json`` under ``out_dir``: what the parity tests read."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().float() for k, v in tensors.items()}, out_dir / f"{name}.safetensors", metadata={"format": "pt"})
    (out_dir / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    size = (out_dir / f"{name}.safetensors").stat().st_size
    print(f"wrote {out_dir / name}.safetensors ({size / 1e3:.0f} kB, {len(tensors)} tensors) and .json")


if __name__ == "__main__":
    main()
