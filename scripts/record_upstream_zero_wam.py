"""Record upstream Zero-WAM's own transformer and server on the tiny checkpoint: the parity anchor of Zero-WAM.

Upstream's code (``jianwenli96/Zero-WAM``: ``wan_va/modules/icl_model.py``, ``wan_va/modules/model.py``,
``wan_va/wan_va_server.py``, ``evaluation/robotwin/icl_reference.py``, with the ``wan_va`` files it shares with
``Robbyant/lingbot-va``; imported from the folder given on the command line, never copied here) runs the tiny Zero-WAM
(``ardiff_policies.lingbot_va.zero_wam_tiny``: ``WanICLTransformer3DModel`` built from the checkpoint's config.json,
every tensor loaded strictly) on the CPU, and the outputs go to ``tests/reference_data/upstream_zero_wam_tiny.
{safetensors,json}``, which ``tests/policies/test_zero_wam_parity.py`` reads:

* ``single.video`` / ``single.action``: one forward in each stream without a cache, the inputs built by the server's own
  ``_prepare_icl_stream`` / ``_pack_icl_cfg``: the video chunk packed along the sequence axis for text guidance (half 0
  the prompt, half 1 the negative prompt, the first latent frame at t = 0 in both, as the first chunk has it), the
  actions one half;
* ``episode.N``: every forward of a short episode through upstream's own cache (``clear_cache``, the demonstration
  pinned by ``_cache_icl_context`` from a ``.pth`` in upstream's format, then per chunk the video steps, the trailing
  t = 0 step that keeps the predicted chunk, the action steps, ``clear_prediction_cache(-1)``, the observed video and
  actions, the last with ``clean_window_cache``), in-context guidance (both halves the prompt, only half 0 sees the
  demonstration), inputs from seeded generators. A window of two chunks (the model's ``attn_window`` 4) slides once,
  and chunk 1 is predicted twice before its observation: the second prediction sees the first, as upstream's does;
* ``bf16.single.*`` / ``bf16.episode.N``: the same forwards with upstream's model in bfloat16 (see below);
* ``serving.ep<E>.actions.<chunk>`` (+ ``serving.ep<E>.first_latent``): two episodes of upstream's own ``VA_Server``
  (``infer``, ``use_icl_model``) driven with the messages its RoboTwin client (``evaluation/robotwin/
  eval_policy_client_openpi.py``) sends, in its order: ``{reset, prompt, use_icl, icl_demo_id, video_guidance_scale,
  icl_guidance_scale}``, then per chunk ``{obs: the first observation, prompt, video/action_guidance_scale}`` and
  ``{obs: key frames, compute_kv_cache, imagine: False, state: the actions}``; episode 0 in-context guidance
  (``icl_guidance_scale`` 5, ``video_guidance_scale`` -1: upstream's defaults, the empty text as target), episode 1
  text guidance (``icl_guidance_scale`` 1, ``video_guidance_scale`` 5) with its own demonstration still pinned. The
  demonstrations are written, from seeded generators, to a temporary root that ``ICL_LATENT_ROOT`` names (upstream's
  ``resolve_icl_request``); upstream's global generator is seeded right after each reset (upstream never seeds).

The JSON lists every call (and, for the serving episodes, every message), the seeds, the sha256 of every input, the
tiny embodiment and how the demonstrations are drawn, so the tests draw the same tensors and check they did.

**Precision.** Upstream's attention (``ICLAttentionBackend.apply``) casts q/k/v to bfloat16 whatever the model's
dtype, so upstream only runs as a bfloat16 model (in float32 its float32 ``to_out`` meets the bfloat16 attention output
and ``F.linear`` refuses the mix). A reference that checks the architecture at 1e-5 needs float32 arithmetic, so the
float32 recordings neutralise exactly that cast: inside ``icl_model.py`` (and only there) the module's ``torch`` global is
a forwarding proxy whose ``bfloat16`` is ``float32``, which makes the cast a no-op and leaves every other line of
upstream's code as it is. The ``bf16.*`` recordings run upstream as it is deployed: the model cast with
``.to(torch.bfloat16)`` as Zero-WAM's ``load_transformer`` does (``from_pretrained`` then ``model.to(device, dtype)``,
which casts the RoPE frequency buffers too; read in the ``adamtrnguyen/Zero-WAM`` fork's ``modules/utils.py``, the
server's call matching its signature), no proxy; the attention then runs in bfloat16 by its own cast. They are the
anchor of a bfloat16-tolerance check of this server's bfloat16 transformer, which does not round its RoPE frequencies.

Usage (the index of ``jianwenli96/Zero-WAM`` serves its files one by one; the files identical to LingBot-VA's are not
in it and come from a ``Robbyant/lingbot-va`` checkout)::

    mkdir -p /tmp/zero-wam-src
    git -C <mirror of Robbyant/lingbot-va> archive 6f092cb wan_va | tar -x -C /tmp/zero-wam-src   # the shared files
    # then, over them, Zero-WAM's own files at the commits below (from the index, never committed here):
    #   wan_va/wan_va_server.py                a2ca9d5d8f6a9a8b33ccad4b8afe8415b8013290
    #   evaluation/robotwin/icl_reference.py   a2ca9d5d8f6a9a8b33ccad4b8afe8415b8013290
    #   wan_va/modules/icl_model.py            04eef1f6e8d6b22edc970281f636d8cb4b61ca1d
    #   wan_va/modules/model.py                b6c3799f67b7cc904917eb2c0db4d6d5e737089b
    #   wan_va/utils/logging.py                228b82d48a2cae1c839e24618e4d4d84424f9100
    #   wan_va/distributed/fsdp.py             cb1f019e8769f7fe381ac7fd1947de2130b8d75b
    pip install --target /tmp/zero-wam-deps einops easydict   # upstream's imports this project lacks
    PYTHONPATH=<repo>:/tmp/zero-wam-deps .venv/bin/python scripts/record_upstream_zero_wam.py --upstream /tmp/zero-wam-src

Adapted to run upstream on a CPU, and nothing else: the float32 attention proxy above (bf16 recordings: none); the
server is built without its ``__init__`` (which wants CUDA, ``torch.distributed`` and a config module): the components
its ``__init__`` loads (VAE, text encoder, the transformer, the two schedulers) are set on it on the CPU, with the tiny
tokenizer through ``AutoTokenizer`` (as the LingBot-VA recorders: upstream's ``T5TokenizerFast`` wants SentencePiece);
``wan_va/modules/utils.py`` is LingBot-VA's (Zero-WAM's is not in the index), which lacks ``resolve_model_component``,
a name the server imports and only its ``__init__`` calls: a stand-in that raises is set on the module before the
server is imported; ``wan_va/configs`` and ``wan_va/distributed/util.py`` are LingBot-VA's, imported by the server and
read only by its ``run`` / ``__init__``. The single and episode forwards are prepared by a server object that holds only
what the input preparation reads (the transformer, the config, and for ``_cache_icl_context``'s channel check a VAE
stand-in with the latent channel count); the serving episodes run the full object.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import record_upstream_lingbot_va  # scripts/, this script's folder: inputs, frames, server parts, writer
import torch

NAME = "upstream_zero_wam_tiny"
UPSTREAM_FILES = {  # path -> the jianwenli96/Zero-WAM commit the recording read it at (the rest: lingbot-va 6f092cb)
    "wan_va/wan_va_server.py": "a2ca9d5d8f6a9a8b33ccad4b8afe8415b8013290",
    "evaluation/robotwin/icl_reference.py": "a2ca9d5d8f6a9a8b33ccad4b8afe8415b8013290",
    "wan_va/modules/icl_model.py": "04eef1f6e8d6b22edc970281f636d8cb4b61ca1d",
    "wan_va/modules/model.py": "b6c3799f67b7cc904917eb2c0db4d6d5e737089b",
    "wan_va/utils/logging.py": "228b82d48a2cae1c839e24618e4d4d84424f9100",
    "wan_va/distributed/fsdp.py": "cb1f019e8769f7fe381ac7fd1947de2130b8d75b",
}
LINGBOT_COMMIT = "6f092cb358a0fe3aacf9ed0346d4703d76c189b7"
SHARED_FILES = (  # Robbyant/lingbot-va at LINGBOT_COMMIT: what the server imports that the Zero-WAM index does not hold
    "wan_va/__init__.py",
    "wan_va/configs/__init__.py",
    "wan_va/distributed/util.py",
    "wan_va/modules/__init__.py",
    "wan_va/modules/utils.py",
    "wan_va/utils/__init__.py",
    "wan_va/utils/scheduler.py",
    "wan_va/utils/sever_utils.py",
    "wan_va/utils/utils.py",
)
ICL_ROPE_H = 24  # upstream's RoboTwin icl_rope_h (docs/zero-wam.md): the demonstration's rows sit 24 below the robot's

# single calls: a chunk of 2 latent frames of 4x6 (6 tokens a frame), 4 actions a frame, at chunk 3 (frame 6)
SINGLE = {"frames": 2, "height": 4, "width": 6, "actions_per_frame": 4, "chunk": 3, "t": 723.4, "seed": 100}
# the episode: the same chunk geometry, a demonstration of 3 latent frames of 4x6 (18 tokens) with a 5-token text of its
# own; the model's window (attn_window 4: two chunks); chunk 1 predicted twice before its observation
EPISODE = {
    "frames": 2,
    "height": 4,
    "width": 6,
    "actions_per_frame": 4,
    "video_steps": 2,
    "action_steps": 2,
    "video_shift": 5.0,
    "action_shift": 1.0,
    "demo": {"frames": 3, "height": 4, "width": 6, "text_tokens": 5, "seed": 900},
    "icl_guidance_scale": 5.0,
    "chunks": [{"infers": 1}, {"infers": 2}, {"infers": 1}, {"infers": 1}],
}
# The serving episodes. The embodiment: RoboTwin's three cameras side by side (Zero-WAM's server encodes the first
# observation camera by camera at full size and lays the latents side by side, so its RoboTwin embodiment is not
# LingBot-VA's T layout), 64x32 each -> a 4x6 latent frame, 2-frame chunks of 16 actions, RoboTwin's channels and
# quantiles (LingBot-VA's va_robotwin_cfg: Zero-WAM's is not in the index), 2 video and 2 action steps.
CAMERA_SIZE = (40, 48)  # what the 'simulator' renders; the server resizes to height x width
SEED = 0  # upstream's global generator after each reset
EPISODES = (
    {
        "prompt": "pick up the red cube and place it in the box",
        "demo_id": "stack_blocks/human.0",
        "demo": {"frames": 3, "height": 4, "width": 6, "layout": "1 c f h w", "text_tokens": 6, "seed": 910},
        "use_icl": True,
        "video_guidance_scale": -1.0,
        "icl_guidance_scale": 5.0,
        "action_guidance_scale": 1.0,
        "chunks": 4,
        "frame_seed": 20,
    },
    {
        "prompt": "stack the green block on the blue block",
        "demo_id": "place_cup/human_3",
        "demo": {"frames": 2, "height": 4, "width": 6, "layout": "f h w c", "text_tokens": 0, "seed": 920},
        "use_icl": True,
        "video_guidance_scale": 5.0,
        "icl_guidance_scale": 1.0,
        "action_guidance_scale": 1.0,
        "chunks": 4,
        "frame_seed": 30,
    },
)
FRAMES_PER_LATENT = 4  # the client keeps four key frames per latent frame (``action.shape[2] // 4`` actions apart)


def tiny_embodiment() -> Any:
    from ardiff_policies.lingbot_va.embodiments import ROBOTWIN

    return dataclasses.replace(ROBOTWIN, layout="none", height=64, width=32, attn_window=4, num_inference_steps=2, action_num_inference_steps=2)


# ------------------------------------------------------------------------------------------- upstream


def import_upstream(path: Path) -> types.SimpleNamespace:
    """Upstream's modules from ``path`` (its root: ``wan_va/`` and ``evaluation/`` below it), with the stand-in named
    in the module docstring."""
    sys.path.insert(0, str(path))
    import wan_va.modules.utils as modules_utils

    if not hasattr(modules_utils, "resolve_model_component"):

        def resolve_model_component(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("stand-in: resolve_model_component is only called by VA_Server.__init__, which is not run")

        modules_utils.resolve_model_component = resolve_model_component
    import wan_va.modules.icl_model as icl_model
    import wan_va.utils as utils
    import wan_va.wan_va_server as server

    return types.SimpleNamespace(server=server, icl=icl_model, utils=utils, modules_utils=modules_utils)


class _Float32Attention(types.ModuleType):
    """``torch`` as ``icl_model.py`` sees it in the float32 recordings: ``torch.bfloat16`` is float32 (module docstring)."""

    def __getattr__(self, name: str) -> Any:
        return torch.float32 if name == "bfloat16" else getattr(torch, name)


@contextmanager
def attention_dtype(up: types.SimpleNamespace, dtype: torch.dtype):
    real = up.icl.torch
    if dtype == torch.float32:
        up.icl.torch = _Float32Attention("torch")
    try:
        yield
    finally:
        up.icl.torch = real


def upstream_transformer(up: types.SimpleNamespace, checkpoint: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Upstream's class from the checkpoint's config.json, every tensor loaded strictly, cast as its loader casts."""
    from safetensors.torch import load_file

    from ardiff_policies.lingbot_va.checkpoint import read_config_json

    config = read_config_json(checkpoint / "transformer" / "config.json")
    model = up.icl.WanICLTransformer3DModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    model.load_state_dict(load_file(checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"), strict=True)
    return model.to(dtype=dtype).eval()


def bare_server(up: types.SimpleNamespace, transformer: torch.nn.Module, config: Any, dtype: torch.dtype) -> Any:
    """A VA_Server holding only what its input preparation (``_prepare_icl_stream``, ``_pack_icl_cfg``,
    ``_cache_icl_context``) reads: the transformer, the config, the VAE's channel count."""
    srv = object.__new__(up.server.VA_Server)
    srv.cache_name, srv.job_config, srv.dtype, srv.device = "pos", config, dtype, torch.device("cpu")
    srv.transformer = transformer
    srv.vae = types.SimpleNamespace(config=types.SimpleNamespace(latents_mean=[0.0] * transformer.config.in_channels))
    return srv


def schedule(up: types.SimpleNamespace, steps: int, shift: float) -> list[float]:
    """The server's timesteps: FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True).set_timesteps(steps)."""
    scheduler = up.utils.FlowMatchScheduler(shift=shift, sigma_min=0.0, extra_one_step=True)
    scheduler.set_timesteps(steps)
    return scheduler.timesteps.tolist()


def set_text(srv: Any, text: torch.Tensor, *, icl_cfg: bool, dtype: torch.dtype) -> None:
    """What ``_reset_icl`` leaves for the chunks: rows of ``text`` are the prompt and the negative prompt."""
    srv.prompt_embeds, srv.negative_prompt_embeds = text[:1].to(dtype), text[1:].to(dtype)
    srv.target_prompt_embeds = srv.prompt_embeds
    srv.use_icl_cfg, srv.target_text_cfg_active = icl_cfg, not icl_cfg


def video_output(up: types.SimpleNamespace, out: torch.Tensor, halves: int, size: tuple[int, int, int]) -> torch.Tensor:
    """The server's reading of a video forward: ``chunk(2, dim=1)`` into the halves, ``data_seq_to_patch`` each."""
    return torch.cat([up.utils.data_seq_to_patch((1, 2, 2), h, *size) for h in out.chunk(halves, dim=1)])


def action_output(out: torch.Tensor, frames: int) -> torch.Tensor:
    """``rearrange(out, "1 (f n) c -> 1 c f n 1")``."""
    return out.transpose(1, 2).unflatten(2, (frames, -1))[..., None]


def demonstration(spec: dict[str, Any], channels: int, text_dim: int) -> dict[str, Any]:
    """A demonstration ``.pth`` item in upstream's format (``latent``, optionally ``text_emb`` (T, text_dim)), drawn from
    ``spec["seed"]``: latent (1, C, F, H, W) seed, text seed + 1; layout "f h w c" stores it permuted (F, H, W, C)."""
    latent = record_upstream_lingbot_va.randn((1, channels, spec["frames"], spec["height"], spec["width"]), spec["seed"])
    item: dict[str, Any] = {"latent": latent}
    if spec.get("layout") == "f h w c":
        item = {"latent": latent[0].permute(1, 2, 3, 0).contiguous(), "latent_layout": "f h w c"}
    if spec.get("text_tokens"):
        item["text_emb"] = record_upstream_lingbot_va.randn((spec["text_tokens"], text_dim), spec["seed"] + 1)
    return item


def demo_record(item: dict[str, Any], path: Path) -> dict[str, str]:
    out = {"file": hashlib.sha256(path.read_bytes()).hexdigest(), "latent": record_upstream_lingbot_va.sha(item["latent"])}
    if "text_emb" in item:
        out["text_emb"] = record_upstream_lingbot_va.sha(item["text_emb"])
    return out


# ------------------------------------------------------------------------------------------- transformer calls


def single_forwards(up, model, srv, text, out: dict[str, torch.Tensor], prefix: str, inputs: dict[str, str]) -> None:
    s = SINGLE
    model.clear_cache("pos")
    set_text(srv, text, icl_cfg=False, dtype=srv.dtype)
    srv.chunk_idx = s["chunk"]
    srv.job_config.frame_chunk_size = s["frames"]
    x = record_upstream_lingbot_va.randn((1, model.config.in_channels, s["frames"], s["height"], s["width"]), s["seed"])
    inputs["single.video"] = record_upstream_lingbot_va.sha(x)
    d = srv._prepare_icl_stream(x.to(srv.dtype), s["t"], "video", up.icl.PREDICTION_CACHE_TYPE)
    d["latent_res_lst"]["timesteps"][:: s["frames"]] = 0  # the first latent frame clean in both halves
    y = model(d, update_cache=0, cache_name="pos", mode="forward_latent_only")
    out[f"{prefix}single.video"] = video_output(up, y, 2, (s["frames"], s["height"], s["width"]))
    a = record_upstream_lingbot_va.randn((1, model.config.action_dim, s["frames"], s["actions_per_frame"], 1), s["seed"] + 1)
    inputs["single.action"] = record_upstream_lingbot_va.sha(a)
    d = srv._prepare_icl_stream(a.to(srv.dtype), s["t"], "action", up.icl.PREDICTION_CACHE_TYPE)
    y = model(d, update_cache=0, cache_name="pos", mode="forward_action_only")
    out[f"{prefix}single.action"] = action_output(y, s["frames"])


def episode_calls(video_timesteps: list[float], action_timesteps: list[float]) -> list[dict[str, Any]]:
    """Every transformer forward of the episode, in upstream's order (``_reset_icl``, ``_infer_icl``,
    ``_compute_icl_kv_cache``): kind, chunk, update_cache, timesteps per frame of a half, halves, cache type, seed."""
    f = EPISODE["frames"]
    calls: list[dict[str, Any]] = [
        {"kind": "icl", "chunk": 0, "update": 1, "halves": 1, "cache_type": "icl", "timesteps": [0.0] * EPISODE["demo"]["frames"]}
    ]
    for chunk, plan in enumerate(EPISODE["chunks"]):
        for _ in range(plan["infers"]):
            steps = [*video_timesteps, 0.0]  # the trailing t = 0 step keeps the predicted chunk
            for i, t in enumerate(steps):
                per_frame = [t] * f
                if chunk == 0:
                    per_frame[0] = 0.0  # the first latent frame is the observation
                update = int(i == len(steps) - 1)
                calls.append({"kind": "video", "chunk": chunk, "update": update, "halves": 2, "cache_type": "prediction", "timesteps": per_frame})
            for t in action_timesteps:
                calls.append({"kind": "action", "chunk": chunk, "update": 0, "halves": 1, "cache_type": "prediction", "timesteps": [t] * f})
        calls.append(
            {"kind": "video", "chunk": chunk, "update": 1, "halves": 2, "cache_type": "observation", "timesteps": [0.0] * f, "clear_prediction": True}
        )
        calls.append(
            {"kind": "action", "chunk": chunk, "update": 1, "halves": 1, "cache_type": "observation", "timesteps": [0.0] * f, "clean_window": True}
        )
    for seed, call in enumerate(calls, start=1000):
        call["seed"] = seed
    return calls


def call_input(call: dict[str, Any], channels: int, action_dim: int) -> torch.Tensor:
    """A call's input, one half (the server repeats the video along the frames for the other)."""
    e = EPISODE
    if call["kind"] == "icl":
        d = e["demo"]
        return record_upstream_lingbot_va.randn((1, channels, d["frames"], d["height"], d["width"]), d["seed"])
    if call["kind"] == "video":
        return record_upstream_lingbot_va.randn((1, channels, e["frames"], e["height"], e["width"]), call["seed"])
    return record_upstream_lingbot_va.randn((1, action_dim, e["frames"], e["actions_per_frame"], 1), call["seed"])


def episode_forwards(up, model, srv, text, calls, demo_root: Path, out, prefix: str, inputs: dict[str, str]) -> None:
    e = EPISODE
    model.clear_cache("pos")
    set_text(srv, text, icl_cfg=True, dtype=srv.dtype)
    srv.icl_guidance_scale = e["icl_guidance_scale"]
    srv.job_config.frame_chunk_size = e["frames"]
    types_by_name = {"prediction": up.icl.PREDICTION_CACHE_TYPE, "observation": up.icl.OBSERVATION_CACHE_TYPE}
    size = (e["frames"], e["height"], e["width"])
    for n, call in enumerate(calls):
        x = call_input(call, model.config.in_channels, model.config.action_dim)
        inputs[f"episode.{n}"] = record_upstream_lingbot_va.sha(x)
        srv.chunk_idx = call["chunk"]
        if call["kind"] == "icl":  # _cache_icl_context, reading the .pth as upstream does, output kept by a hook
            seen: list[torch.Tensor] = []
            hook = model.register_forward_hook(lambda _m, _a, result, seen=seen: seen.append(result))
            try:
                srv._cache_icl_context("", str(demo_root / "episode_demo.pth"))
            finally:
                hook.remove()
            d = e["demo"]
            out[f"{prefix}episode.{n}"] = video_output(up, seen[0], 1, (d["frames"], d["height"], d["width"]))
            continue
        if call.get("clear_prediction"):
            model.clear_prediction_cache(-1, "pos")
        mode = "video" if call["kind"] == "video" else "action"
        d = srv._prepare_icl_stream(x.to(srv.dtype), call["timesteps"][-1], mode, types_by_name[call["cache_type"]])
        if mode == "video" and call["chunk"] == 0:
            d["latent_res_lst"]["timesteps"][:: e["frames"]] = 0
        y = model(
            d,
            update_cache=call["update"],
            cache_name="pos",
            mode=f"forward_{'latent' if mode == 'video' else 'action'}_only",
            clean_window_cache=bool(call.get("clean_window")),
        )
        out[f"{prefix}episode.{n}"] = video_output(up, y, call["halves"], size) if mode == "video" else action_output(y, e["frames"])


# ------------------------------------------------------------------------------------------- the server


def upstream_server(up, checkpoint: Path, e: Any, save_root: Path) -> Any:
    """upstream's VA_Server with its __init__'s components, on the CPU in float32 (see the module docstring)."""
    config = record_upstream_lingbot_va.job_config(e, save_root)
    config.update(icl_rope_h=ICL_ROPE_H, icl_guidance_scale=5.0, use_icl_model=True)
    srv = object.__new__(up.server.VA_Server)
    srv.cache_name, srv.job_config, srv.save_root = "pos", config, config.save_root
    srv.dtype, srv.device, srv.enable_offload = torch.float32, torch.device("cpu"), True
    srv.scheduler = up.utils.FlowMatchScheduler(shift=e.snr_shift, sigma_min=0.0, extra_one_step=True)
    srv.action_scheduler = up.utils.FlowMatchScheduler(shift=e.action_snr_shift, sigma_min=0.0, extra_one_step=True)
    srv.scheduler.set_timesteps(1000, training=True)
    srv.action_scheduler.set_timesteps(1000, training=True)
    record_upstream_lingbot_va.load_components(srv, checkpoint, up.modules_utils, e.layout)
    srv.empty_text_emb = None  # the tiny config names no empty_text_emb_path: the negative text is UMT5's ""
    srv.use_icl_model = True
    srv.transformer = upstream_transformer(up, checkpoint, torch.float32)
    return srv


def frames(cameras, episode: dict[str, Any], chunk: int, count: int) -> list[dict[str, Any]]:
    """The key frames the 'simulator' renders while a chunk executes (seeded by episode, chunk, frame)."""
    return [record_upstream_lingbot_va.observation(cameras, episode["frame_seed"] * 1000 + 100 * chunk + k, CAMERA_SIZE) for k in range(count)]


def frame_hashes(obs: list[dict[str, Any]]) -> list[str]:
    return [hashlib.sha256(b"".join(o[k].tobytes() for k in sorted(o))).hexdigest() for o in obs]


def serve(up, checkpoint: Path, demo_root: Path, save_root: Path, out: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The two serving episodes, the client's messages in its order; returns every message with its inputs' hashes."""
    e = tiny_embodiment()
    srv = upstream_server(up, checkpoint, e, save_root)
    log: list[dict[str, Any]] = []
    for n, episode in enumerate(EPISODES):
        reset = {
            "reset": True,
            "prompt": episode["prompt"],
            "save_visualization": True,
            "use_icl": episode["use_icl"],
            "icl_demo_id": episode["demo_id"],
            "video_guidance_scale": episode["video_guidance_scale"],
            "icl_guidance_scale": episode["icl_guidance_scale"],
        }
        srv.infer(reset)
        log.append({"episode": n, "message": "reset", **{k: v for k, v in reset.items() if k != "reset"}, "use_icl_cfg": srv.use_icl_cfg})
        torch.manual_seed(SEED)
        first = record_upstream_lingbot_va.observation(e.cameras, episode["frame_seed"], CAMERA_SIZE)
        for chunk in range(episode["chunks"]):
            message = {"obs": first, "prompt": episode["prompt"], "save_visualization": True}
            message |= {k: episode[k] for k in ("video_guidance_scale", "action_guidance_scale")}
            action = srv.infer(message)["action"]
            out[f"serving.ep{n}.actions.{chunk}"] = torch.from_numpy(action)
            if chunk == 0:
                out[f"serving.ep{n}.first_latent"] = srv.init_latent.float()
            log.append({"episode": n, "message": "infer", "chunk": chunk, "obs_sha256": frame_hashes([first]), "action_shape": list(action.shape)})
            assert action.shape[2] % FRAMES_PER_LATENT == 0  # the client's own check
            keys = frames(e.cameras, episode, chunk, FRAMES_PER_LATENT * (action.shape[1] - (chunk == 0)))
            srv.infer({"obs": keys, "compute_kv_cache": True, "imagine": False, "save_visualization": True, "state": action})
            log.append({"episode": n, "message": "compute_kv_cache", "chunk": chunk, "obs_sha256": frame_hashes(keys)})
    return log


def main() -> None:
    args = record_upstream_lingbot_va.arguments(__doc__, NAME, "upstream's tree, reassembled as the usage above says", commit=False)
    import diffusers

    from ardiff_policies.lingbot_va.zero_wam_tiny import TINY_ZERO_WAM, write_tiny_zero_wam_checkpoint
    from ardiff_policies.wan.tiny import tree_digest

    up = import_upstream(args.upstream.resolve())
    out: dict[str, torch.Tensor] = {}
    inputs: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        tmp = Path(tmp)
        checkpoint = write_tiny_zero_wam_checkpoint(tmp / "tiny_zero_wam")
        cfg = TINY_ZERO_WAM.base
        text = record_upstream_lingbot_va.text_embeddings(cfg.text_dim, seed=7)
        inputs["text"] = record_upstream_lingbot_va.sha(text)
        demo_root = tmp / "demonstrations"
        os.environ["ICL_LATENT_ROOT"] = str(demo_root)  # upstream's resolve_icl_request reads <root>/<id>.pth
        demos: dict[str, Any] = {}
        episode_demo = demonstration(EPISODE["demo"], cfg.in_channels, cfg.text_dim)
        demo_root.mkdir()
        torch.save(episode_demo, demo_root / "episode_demo.pth")
        demos["episode"] = demo_record(episode_demo, demo_root / "episode_demo.pth")
        for episode in EPISODES:
            path = demo_root / f"{episode['demo_id']}.pth"
            path.parent.mkdir(parents=True, exist_ok=True)
            item = demonstration(episode["demo"], cfg.in_channels, cfg.text_dim)
            torch.save(item, path)
            demos[episode["demo_id"]] = demo_record(item, path)

        video_timesteps = schedule(up, EPISODE["video_steps"], EPISODE["video_shift"])
        action_timesteps = schedule(up, EPISODE["action_steps"], EPISODE["action_shift"])
        calls = episode_calls(video_timesteps, action_timesteps)
        config = record_upstream_lingbot_va.job_config(tiny_embodiment(), tmp / "visualization")
        config.update(icl_rope_h=ICL_ROPE_H)
        for dtype, prefix in ((torch.float32, ""), (torch.bfloat16, "bf16.")):
            model = upstream_transformer(up, checkpoint, dtype)
            srv = bare_server(up, model, config, dtype)
            with attention_dtype(up, dtype):
                single_forwards(up, model, srv, text, out, prefix, inputs)
                episode_forwards(up, model, srv, text, calls, demo_root, out, prefix, inputs)
        with attention_dtype(up, torch.float32):
            log = serve(up, checkpoint, demo_root, tmp / "visualization", out)
        meta = {
            "note": (
                "Outputs of upstream Zero-WAM's WanICLTransformer3DModel (jianwenli96/Zero-WAM wan_va/modules/icl_model.py) "
                "through its own cache, and actions of its VA_Server over its RoboTwin client's call order, on the tiny "
                "checkpoint (policies.lingbot_va.zero_wam_tiny), on the CPU, recorded by scripts/record_upstream_zero_wam.py."
            ),
            "upstream": {
                "repository": "jianwenli96/Zero-WAM",
                "files": UPSTREAM_FILES,
                "shared_files": {"repository": "Robbyant/lingbot-va", "commit": LINGBOT_COMMIT, "paths": list(SHARED_FILES)},
                "sha256": {rel: hashlib.sha256((args.upstream / rel).read_bytes()).hexdigest() for rel in (*UPSTREAM_FILES, *SHARED_FILES)},
                "stand_ins": ["wan_va.modules.utils.resolve_model_component (raises; only VA_Server.__init__ calls it)"],
            },
            "precision": {
                "float32": "single.*, episode.*, serving.*: float32, icl_model.py's bfloat16 cast of q/k/v neutralised (module docstring)",
                "bfloat16": "bf16.single.*, bf16.episode.*: the model cast to bfloat16 as upstream loads it (RoPE frequency buffers too)",
            },
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "checkpoint_transformer_sha256": tree_digest(checkpoint / "transformer"),
            "checkpoint_sha256": tree_digest(checkpoint),
            "text_tokens": record_upstream_lingbot_va.TEXT_TOKENS,
            "prompt_tokens": list(record_upstream_lingbot_va.PROMPT_TOKENS),
            "icl_rope_h": ICL_ROPE_H,
            "attn_window": TINY_ZERO_WAM.attn_window,
            "single": SINGLE,
            "episode": {**EPISODE, "video_timesteps": video_timesteps, "action_timesteps": action_timesteps, "calls": calls},
            "input_sha256": inputs,
            "demonstrations": {
                "how": (
                    "latent = randn((1, 48, F, H, W), seed) (layout 'f h w c': stored as latent[0].permute(1, 2, 3, 0) "
                    "with latent_layout 'f h w c'); text_emb = randn((T, text_dim), seed + 1) when T > 0; "
                    "randn(shape, seed) = torch.randn(shape, generator=torch.Generator().manual_seed(seed)); "
                    "torch.save(dict) to <root>/<icl_demo_id>.pth"
                ),
                "sha256": demos,
            },
            "serving": {
                "embodiment": dataclasses.asdict(tiny_embodiment()),
                "server_config": {"icl_rope_h": ICL_ROPE_H, "use_icl_model": True, "empty_text_emb_path": None, "enable_text": True},
                "seed": SEED,
                "seeding": "torch.manual_seed(seed) right after each reset (the global generator; upstream never seeds)",
                "camera_size": list(CAMERA_SIZE),
                "frames": (
                    "the first observation: observation(cameras, episode['frame_seed']) sent with every infer; the key frames of "
                    "chunk c: observation(cameras, episode['frame_seed'] * 1000 + 100 * c + k) for k < 4 x (latent frames, "
                    "the first chunk's first one excepted); observation(cameras, s)[camera i] = camera_frame(s * 10 + i, "
                    "camera_size) (scripts/record_upstream_lingbot_va.py)"
                ),
                "episodes": list(EPISODES),
                "messages": log,
            },
        }
    record_upstream_lingbot_va.write_reference(args.out, NAME, out, meta)


if __name__ == "__main__":
    main()
