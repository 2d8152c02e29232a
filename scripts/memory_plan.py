#!/usr/bin/env python
"""GiB per GPU for DreamZero's two families, by placement, and for LingBot-VA, against common cards (docs/performance.md).

Everything comes from ``policies/dreamzero/memory.py`` (its shared arithmetic: ``policies/wan/memory.py``), the plan the server prints and checks at
start-up: weights from the networks built on the meta device (exact parameter counts), the KV
pool from ``ardiff_kv.PagedKVCache.pages_for_budget``, the activation estimate and the CUDA reserve (a
prior, not measured: its column says so).

Geometries:

* **14B**: ``synthetic:droid``, GEAR-Dreams/DreamZero-DROID's released geometry (Wan2.1-I2V-14B DiT,
  UMT5-XXL, CLIP ViT-H/14, Wan2.1 VAE; 352x640 canvas, 880 tokens per latent frame).
* **5B**: upstream's ``wan_flow_matching_action_tf_wan22.yaml`` (Wan2.2-TI2V-5B: dim 3072, 30
  layers, 24 heads, FFN 14336, 48 latent channels, frame_seqlen 50 at a 160x320 canvas) with
  the same encoders and the Wan2.2 VAE (``WanVideoVAE38``: base 160, decoder 256, z 48, 2x2
  patchify, 16x spatial). Upstream builds ``model_type: ti2v`` exactly as ``i2v`` (the I2V
  cross-attention with its image K/V and the CLIP projection ``img_emb``), and without the
  first-frame concat its patch embedding takes the 48 noisy channels alone: so this DiT is
  counted as our ``i2v`` CausalWanModel with in_dim = out_dim = 48. The VAE is diffusers'
  ``AutoencoderKLWan`` with its Wan2.2 options, on the meta device.

Each configuration holds one session (``engine.max_sessions: 1``: the pool at its floor); the
"+session" column is what each further session adds (its pages and cross-attention slots). A
card's free memory is its size less 0.5 GiB for the CUDA context.

LingBot-VA (``policies/lingbot_va/memory.py``): the released 5B transformer, UMT5-XXL and the Wan2.2 VAE on one GPU,
bf16, both CFG branches, per upstream embodiment config; "+session" is a session's KV window plus its prompt K/V.

Zero-WAM (``policies/lingbot_va/zero_wam_memory.py``): its served transformer (9.4 B of the released 10.8 B), UMT5-XXL
and the Wan2.2 VAE, bf16; a session's reservation from the KV spec the server serves with (the demonstration bound
pinned in the conditional branch, both branches' windows of 32 chunks, the unconditional one video only, a chunk's
write on top), the pool's scratch, at the default demonstration bound (32 latent frames) and a shorter one (16).

    python scripts/memory_plan.py            # the markdown tables
    python scripts/memory_plan.py --json
    python scripts/memory_plan.py --measure-vae   # re-measure the VAE activation constant on this CPU (minutes)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from ardiff_policies.dreamzero import memory
from ardiff_policies.dreamzero.dit import DiTConfig
from ardiff_policies.wan.memory import RESIDUAL_VAE_LIVE_TENSORS, VAE_CHUNK_FRAMES, VAE_LIVE_TENSORS, GiB
from ardiff_policies.wan.vae import WAN22_VAE_CONFIG

CARDS_GIB = (24, 48, 80, 141)
CONTEXT_GIB = 0.5  # the CUDA context, before anything is allocated

# Upstream's Wan2.2-TI2V-5B DreamZero (groot/vla/configs/model/dreamzero/action_head/wan_flow_matching_action_tf_wan22.yaml).
DIT_5B = DiTConfig(model_type="i2v", in_dim=48, out_dim=48, dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, frame_seqlen=50)
# WanVideoVAE38 (groot/vla/model/dreamzero/modules/wan_video_vae.py: VideoVAE38_ dim 160, dec_dim 256, z_dim 48) is
# wan.vae.WAN22_VAE_CONFIG in diffusers' terms; the canvas it encodes:
CANVAS_5B = (160, 320)  # target_video_height / width


def geometry_14b() -> memory.ModelGeometry:
    return memory.synthetic_geometry("synthetic:droid")


def geometry_5b() -> memory.ModelGeometry:
    from diffusers import AutoencoderKLWan

    from ardiff_policies.dreamzero.dit import CausalWanModel
    from ardiff_policies.dreamzero.encoders import ImageEncoder
    from ardiff_policies.wan.text import TextEncoder

    with torch.device("meta"):
        modules = (CausalWanModel(DIT_5B), TextEncoder.from_config(), ImageEncoder.from_config(), AutoencoderKLWan.from_config(WAN22_VAE_CONFIG))
    return memory.geometry_from_modules("DreamZero Wan2.2-5B", *modules, canvas=CANVAS_5B)


@dataclass(frozen=True)
class Row:
    model: str
    gpus: int  # 1: both CFG branches on one GPU; 2: CFG-parallel
    text: str  # where UMT5 runs
    image: str  # where CLIP runs
    weights: float  # GiB on each GPU
    kv: float  # the pool for one session
    activations: float
    reserve: float
    total: float  # GiB per GPU, one session
    per_session: float  # GiB each further session adds
    sessions: dict[int, int]  # card GiB -> sessions that fit (0: does not fit)


def rows() -> list[Row]:
    out = []
    for name, geometry in (("14B", geometry_14b()), ("5B", geometry_5b())):
        for gpus in (1, 2):
            for text, image in (("engine", "engine"), ("cpu", "engine"), ("cpu", "cpu")):
                settings = memory.PlanSettings(
                    engine_device="cuda:0",
                    dtype=torch.bfloat16,
                    text_encoder_device=text,
                    image_encoder_device=image,
                    branches=2 // gpus,
                    cfg_parallel_size=gpus,
                    max_sessions=1,
                )
                gpu = memory.plan_memory(geometry, settings).device("cuda:0")
                total, per_session = gpu.total, gpu.kv.session_bytes
                fits = {}
                for card in CARDS_GIB:
                    free = (card - CONTEXT_GIB) * GiB
                    fits[card] = 0 if total > free else 1 + int((free - total) // per_session)
                out.append(
                    Row(
                        name,
                        gpus,
                        "GPU" if text == "engine" else "CPU",
                        "GPU" if image == "engine" else "CPU",
                        sum(gpu.weights.values()) / GiB,
                        gpu.kv.pool_bytes / GiB,
                        gpu.activations / GiB,
                        gpu.reserve / GiB,
                        total / GiB,
                        per_session / GiB,
                        fits,
                    )
                )
    return out


def markdown(table: list[Row]) -> str:
    cards = " | ".join(f"{c} GiB" for c in CARDS_GIB)
    lines = [
        f"| model | GPUs (CFG) | UMT5 | CLIP | weights | KV, 1 session | activations | reserve (unmeasured) | **GiB per GPU** | +session | {cards} |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(CARDS_GIB),
    ]
    for r in table:
        cfg = "1 (both branches)" if r.gpus == 1 else "2 (CFG-parallel)"
        fits = " | ".join(("-" if n == 0 else f"{n if n < 100 else '99+'}") for n in r.sessions.values())
        lines.append(
            f"| {r.model} | {cfg} | {r.text} | {r.image} | {r.weights:.1f} | {r.kv:.1f} | {r.activations:.1f} | {r.reserve:.1f} "
            f"| **{r.total:.1f}** | {r.per_session:.2f} | {fits} |"
        )
    return "\n".join(lines)


def lingbot_va_table() -> tuple[str, list[dict]]:
    from ardiff_policies.lingbot_va.embodiments import FRANKA, ROBOTWIN
    from ardiff_policies.lingbot_va.memory import plan
    from ardiff_policies.lingbot_va.upstream_configs import LIBERO

    cards = " | ".join(f"{c} GiB" for c in CARDS_GIB)
    lines = [
        f"| LingBot-VA | weights | KV, 1 session | prompt K/V | KV scratch | activations | reserve | **GiB per GPU** | +session | {cards} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(CARDS_GIB),
    ]
    out = []
    for name, embodiment in (("RoboTwin (posttrain-robotwin)", ROBOTWIN), ("Franka (base)", FRANKA), ("LIBERO (posttrain-libero-long)", LIBERO)):
        p = plan(name, embodiment)
        fits = {card: p.sessions_on(int((card - CONTEXT_GIB) * GiB)) for card in CARDS_GIB}
        lines.append(
            f"| {name} | {sum(p.weights.values()) / GiB:.1f} | {p.kv_session / GiB:.1f} | {p.text_session / GiB:.2f} | {p.kv_reserved / GiB:.2f} | {p.activations / GiB:.1f} "
            f"| {p.reserve / GiB:.1f} | **{p.total() / GiB:.1f}** | {p.per_session / GiB:.2f} | "
            + " | ".join(str(n) if n else "-" for n in fits.values())
            + " |"
        )
        out.append(
            {
                "model": name,
                "weights": {k: v / GiB for k, v in p.weights.items()},
                "kv_session": p.kv_session / GiB,
                "text_session": p.text_session / GiB,
                "kv_reserved": p.kv_reserved / GiB,
                "activations": p.activations / GiB,
                "total": p.total() / GiB,
                "sessions": fits,
            }
        )
    return "\n".join(lines), out


def zero_wam_table() -> tuple[str, list[dict]]:
    from ardiff_policies.lingbot_va import zero_wam_memory

    cards = " | ".join(f"{c} GiB" for c in CARDS_GIB)
    lines = [
        f"| Zero-WAM (10.8 B file, 9.4 B served) | weights | KV, 1 session | prompt K/V | KV scratch | activations | reserve | **GiB per GPU** | +session | {cards} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(CARDS_GIB),
    ]
    out = []
    for geometry in (zero_wam_memory.ROBOTWIN, zero_wam_memory.ROBOTWIN_SHORT):
        p = zero_wam_memory.plan(geometry)
        fits = {card: p.sessions_on(int((card - CONTEXT_GIB) * GiB)) for card in CARDS_GIB}
        lines.append(
            f"| {p.name} | {sum(p.weights.values()) / GiB:.1f} | {p.kv_session / GiB:.2f} | {p.text_session / GiB:.2f} | {p.kv_reserved / GiB:.2f} "
            f"| {p.activations / GiB:.1f} | {p.reserve / GiB:.1f} | **{p.total() / GiB:.1f}** | {p.per_session / GiB:.2f} | "
            + " | ".join(str(n) if n else "-" for n in fits.values())
            + " |"
        )
        out.append(
            {
                "model": p.name,
                "weights": {k: v / GiB for k, v in p.weights.items()},
                "kv_session": p.kv_session / GiB,
                "text_session": p.text_session / GiB,
                "kv_reserved": p.kv_reserved / GiB,
                "activations": p.activations / GiB,
                "total": p.total() / GiB,
                "sessions": fits,
            }
        )
    return "\n".join(lines), out


def parameters() -> dict[str, dict[str, int]]:
    return {name: {c: s.floating for c, s in g.sizes.items()} for name, g in (("14B", geometry_14b()), ("5B", geometry_5b()))}


# ------------------------------------------------------------------------------ VAE calibration


def peak_tensor_bytes(run) -> int:
    """The most bytes of CPU tensors alive at once while ``run()`` executes: the running sum of the
    profiler's allocation events (what ``torch.cuda.max_memory_allocated`` is on a GPU; no allocator
    caching or fragmentation)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def vae_peak(height: int, width: int, config: dict, frames: int = 9) -> tuple[int, int]:
    """(peak bytes of a float32 encode of ``frames`` frames, the plan's unit: first-level channels x 6 frames x H x W x 4 bytes)."""
    from diffusers import AutoencoderKLWan

    with torch.no_grad():
        vae = AutoencoderKLWan.from_config(config).eval()
        video = torch.randn(1, 3, frames, height, width)
        vae.encode(video[:, :, :5])  # first-call allocations out of the way
        peak = peak_tensor_bytes(lambda: vae.encode(video))
    patch = config.get("patch_size") or 1
    return peak, config["base_dim"] * VAE_CHUNK_FRAMES * (height // patch) * (width // patch) * 4


VAE_CASES = (
    ("Wan2.1", 88, 160, {"base_dim": 96}),
    ("Wan2.1", 176, 320, {"base_dim": 96}),
    ("Wan2.1", 352, 640, {"base_dim": 96}),
    ("Wan2.2", 160, 320, WAN22_VAE_CONFIG),
)


def measure_vae() -> list[dict]:
    """The VAE activation constants (``wan.memory.VAE_LIVE_TENSORS``, ``RESIDUAL_VAE_LIVE_TENSORS``) measured: peak / unit per case."""
    out = []
    for name, h, w, config in VAE_CASES:
        peak, unit = vae_peak(h, w, config)
        out.append(
            {"vae": name, "input": f"{h}x{w}", "peak_mib": round(peak / 2**20), "unit_mib": round(unit / 2**20, 1), "ratio": round(peak / unit, 2)}
        )
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure-vae", action="store_true", help="measure the VAE's peak on this CPU (a few minutes)")
    args = parser.parse_args()
    if args.measure_vae:
        torch.set_num_threads(2)
        measure_vae()
        print(f"VAE_LIVE_TENSORS = {VAE_LIVE_TENSORS}, RESIDUAL_VAE_LIVE_TENSORS = {RESIDUAL_VAE_LIVE_TENSORS} (policies/wan/memory.py)")
        return
    table = rows()
    counts = parameters()
    for name, parts in counts.items():
        print(f"{name}: " + ", ".join(f"{memory.LABELS[c]} {n:,}" for c, n in parts.items()) + f"; {sum(parts.values()):,} in all")
    print()
    print(markdown(table))
    lingbot, lingbot_rows = lingbot_va_table()
    print()
    print(lingbot)
    zero_wam, zero_wam_rows = zero_wam_table()
    print()
    print(zero_wam)
    if args.json:
        print(json.dumps({"parameters": counts, "rows": [r.__dict__ for r in table], "lingbot_va": lingbot_rows, "zero_wam": zero_wam_rows}))


if __name__ == "__main__":
    main()
