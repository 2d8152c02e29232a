"""Record upstream LingBot-VA's own server over its LIBERO client's call order on the tiny checkpoint: the parity
anchor of LingBot-VA's LIBERO embodiment.

Upstream's ``VA_Server`` (``Robbyant/lingbot-va`` ``wan_va/wan_va_server.py`` at the commit given, imported from the
path given on the command line, never copied here) is built on the CPU in float32 exactly as
``scripts/record_upstream_lingbot_va.py`` builds it (:func:`record_upstream_lingbot_va.upstream_server`), with the
tiny LIBERO embodiment (``ardiff_policies.lingbot_va.tiny.TINY_LIBERO_EMBODIMENT``: upstream's ``va_libero_cfg.py``
values at 64x64, 2 + 2 steps, a window of two chunks), and driven with the messages upstream's LIBERO client
(``evaluation/libero/client.py``) sends, in its order, on one connection:

* ``{reset: True, prompt}``; then per chunk ``{obs: <the episode's first observation>, prompt}`` (the client sends
  the first observation with every infer), executes the reply's (7, 4, 4) actions one by one (the first chunk's first
  latent frame skipped), keeps a key frame after every action (``action_per_frame = 4 // 4``: 12 after the first
  chunk, 16 after later ones) and sends ``{obs: key frames, compute_kv_cache: True, imagine: False, state: action}``;
* episode 1: four chunks (the window slides twice), then a fifth infer whose execution ends the episode (the
  client's ``done``: no compute_kv_cache); episode 2: ``reset`` with another prompt, three chunks.

Upstream's global generator is seeded with ``seed`` right after each reset (upstream never seeds): the server here
seeds each session's generator with ``policy.seed`` at reset, so ``tiny_lingbot_va_libero`` (seed 0) served over a
socket gives these actions. Frames are 128x128 (what the client renders), smooth seeded noise. Written:
``tests/reference_data/upstream_lingbot_va_libero_tiny.{safetensors,json}`` (``ep<E>.actions.<chunk>``,
``ep<E>.first_latent``).

Usage (upstream's LIBERO code is in its history from c479967 on; 58c2ae5 is the newest official commit read)::

    mkdir -p /tmp/lingbot-va-src && git -C <mirror with the official history> archive 58c2ae5 wan_va | tar -x -C /tmp/lingbot-va-src
    pip install --target /tmp/lingbot-deps einops easydict
    PYTHONPATH=<repo>:/tmp/lingbot-deps .venv/bin/python scripts/record_upstream_lingbot_va_libero.py \\
        --upstream /tmp/lingbot-va-src --commit 58c2ae5bac46bd8114065bea9d7d256eb67c16c3
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import record_upstream_lingbot_va  # scripts/, this script's folder: its upstream server builder, frames, writer
import torch

NAME = "upstream_lingbot_va_libero_tiny"
CAMERA_SIZE = (128, 128)  # the client's env_args camera_heights / camera_widths
FRAMES_PER_LATENT = 4
EPISODES = (
    {"prompt": "put both the alphabet soup and the tomato sauce in the basket", "chunks": 4, "unfinished": True, "frames": 10},
    {"prompt": "pick up the red cube and place it in the box", "chunks": 3, "unfinished": False, "frames": 20},
)
SEED = 0  # tiny_lingbot_va_libero's policy.seed


def libero_frame(cameras: tuple[str, ...], seed: int) -> dict[str, Any]:
    """One observation as the client's ``_extract_obs`` builds it: each camera (128, 128, 3) uint8."""
    return record_upstream_lingbot_va.observation(cameras, seed, CAMERA_SIZE)


def episode_frames(cameras: tuple[str, ...], episode: dict[str, Any], chunk: int, count: int) -> list[dict[str, Any]]:
    """The key frames the 'simulator' renders while the chunk executes (seeded by episode and chunk)."""
    return [libero_frame(cameras, episode["frames"] * 1000 + 100 * chunk + k) for k in range(count)]


def key_frame_count(chunk: int, action_shape: tuple[int, ...]) -> int:
    """The client's loop: a key frame every ``action.shape[2] // 4`` actions, frames 1.. of the first chunk."""
    per_frame = action_shape[2] // FRAMES_PER_LATENT
    frames = action_shape[1] - (chunk == 0)
    return frames * (action_shape[2] // per_frame)


def record(path: Path, checkpoint: Path, save_root: Path, out: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    from ardiff_policies.lingbot_va.tiny import TINY_LIBERO_EMBODIMENT as e

    record_upstream_lingbot_va.import_upstream(path)  # its flash_attn stand-in (imported at module load, unused with attn_mode="torch")
    srv = record_upstream_lingbot_va.upstream_server(path, checkpoint, e, save_root)
    calls: list[dict[str, Any]] = []
    for n, episode in enumerate(EPISODES):
        srv.infer({"reset": True, "prompt": episode["prompt"]})
        calls.append({"reset": episode["prompt"]})
        torch.manual_seed(SEED)
        first = libero_frame(e.cameras, episode["frames"])
        for chunk in range(episode["chunks"] + episode["unfinished"]):
            action = srv.infer({"obs": first, "prompt": episode["prompt"]})["action"]
            out[f"ep{n}.actions.{chunk}"] = torch.from_numpy(action)
            if chunk == 0:
                out[f"ep{n}.first_latent"] = srv.init_latent.float()
            calls.append({"infer": chunk, "action_shape": list(action.shape)})
            if chunk == episode["chunks"]:  # the simulator reports done while this chunk executes: no commit
                break
            frames = episode_frames(e.cameras, episode, chunk, key_frame_count(chunk, action.shape))
            srv.infer({"obs": frames, "compute_kv_cache": True, "imagine": False, "state": action})
            calls.append({"compute_kv_cache": chunk, "key_frames": len(frames)})
    return calls


def main() -> None:
    args = record_upstream_lingbot_va.arguments(__doc__, NAME, "a checkout (or git archive) of Robbyant/lingbot-va with LIBERO (c479967 on)")
    import dataclasses

    import diffusers

    from ardiff_policies.lingbot_va.tiny import TINY_LIBERO_EMBODIMENT, write_tiny_checkpoint
    from ardiff_policies.lingbot_va.upstream_configs import LIBERO_CFG
    from ardiff_policies.wan.tiny import tree_digest

    out: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        checkpoint = write_tiny_checkpoint(Path(tmp) / "tiny_lingbot_va")
        calls = record(args.upstream.resolve(), checkpoint, Path(tmp) / "visualization", out)
        meta = {
            "note": (
                "Actions of upstream LingBot-VA's VA_Server (Robbyant/lingbot-va wan_va/wan_va_server.py) over its LIBERO "
                "client's call order (evaluation/libero/client.py) on the tiny checkpoint with the tiny LIBERO embodiment, "
                "float32 on the CPU, recorded by scripts/record_upstream_lingbot_va_libero.py."
            ),
            "upstream_commit": args.commit,
            "embodiment_source": LIBERO_CFG.source,
            "embodiment": dataclasses.asdict(TINY_LIBERO_EMBODIMENT),
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "checkpoint_transformer_sha256": tree_digest(checkpoint / "transformer"),
            "seed": SEED,
            "camera_size": list(CAMERA_SIZE),
            "episodes": list(EPISODES),
            "calls": calls,
        }
    record_upstream_lingbot_va.write_reference(args.out, NAME, out, meta)


if __name__ == "__main__":
    main()
