#!/usr/bin/env python
"""End-to-end DreamZero policy latency per call, by phase, and the DiT's achieved FLOP/s.

Two configurations, each built in-process exactly as the server builds it (``DreamZeroPolicy``,
a ``ardiff_kv.PagedKVCache`` from ``policy.kv_spec()``, ``policy.start_session``) and driven through
one full attention window and a restart (first call 1 frame, then 4-frame stacks):

* ``tiny``  -- ``configs/tiny.yaml``'s embedded checkpoint (60 tokens per latent frame);
* ``droid`` -- the REAL DreamZero-DROID token geometry (176x320 views -> 352x640 canvas ->
  44x80 latents -> 880 tokens per latent frame, 9-frame window, 24 actions) at small width
  (DiT ``--droid-dim`` x ``--droid-layers``, the tiny UMT5 / CLIP / VAE), written as a
  random-weight checkpoint in the released layout into a temp dir.

Per phase (``StepResult.timing_ms``: text, vision, VAE, prefill, denoise, decode) the mean ms
is reported separately for window-start calls (they run CLIP, the image-conditioning VAE
encode and the cross-attention K/V projection) and steady calls; the first call is a warm-up
and is excluded.

FLOPs: the DiT's FLOPs per call are counted analytically from its config (patch embedding,
per-token time embedding, projections, self-attention over the visible window + the action
register, cross-attention over the cached text + image tokens, FFN, head, action/state MLPs),
for the prefill forward and every denoise forward the DiT actually ran, on every CFG branch.
Achieved FLOP/s = those FLOPs / (prefill + denoise ms), compared with this machine's measured
``torch.mm`` rate (2048^2, same dtype and thread count) -> fraction of peak. The formula is
cross-checked against ``torch.utils.flop_counter.FlopCounterMode`` on one denoise forward
(driven through upstream's concat-and-slice cache: the paged custom op hides its inner ops
from dispatch modes, and FlopCounterMode has no formula for CPU's flash SDPA op, so one is
supplied and the count without it is reported too).

    python scripts/bench_chunk.py                # both configs (a few minutes)
    python scripts/bench_chunk.py --quick --json # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from benchlib import ForeignLoad, contended, contention_warning, droid_observations
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from ardiff_kv import CrossKV, DenseKVCache
from ardiff_policies.dreamzero.dit import CausalWanModel, DiTConfig
from ardiff_policies.dreamzero.tiny import (
    TINY_DIT,
    TINY_IMAGE_ENCODER,
    TINY_VAE,
    TINY_VIEW_SIZE,
    ensure_tiny_checkpoint,
    write_checkpoint,
)
from ardiff_policies.observation import RobotObservation
from ardiff_policies.wan.tiny import TINY_TEXT_ENCODER
from ardiff_server.config import validate_config
from ardiff_server.engine.builder import build_engine

PHASES = ("frames", "text", "vision", "vae", "prefill", "denoise", "decode")
DROID_VIEW_SIZE = (176, 320)  # -> 352x640 canvas -> 44x80 latents -> 22x40 patches = 880 tokens
CAMERA = (180, 320)  # what DROID clients send (image_resolution)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- checkpoints


def droid_geometry_dit(dim: int, layers: int, heads: int) -> DiTConfig:
    """DROID token geometry, small width; everything else is the tiny model's (same encoders)."""
    return DiTConfig(
        frame_seqlen=880,
        dim=dim,
        ffn_dim=max(64, round(dim * 13824 / 5120 / 64) * 64),  # DROID's ffn/dim ratio
        text_dim=TINY_DIT.text_dim,
        num_heads=heads,
        num_layers=layers,
        hidden_size=TINY_DIT.hidden_size,
        clip_dim=TINY_DIT.clip_dim,
        max_chunk_size=4,
        num_frame_per_block=2,
    )


def write_droid_checkpoint(out: Path, dit_cfg: DiTConfig) -> Path:
    return write_checkpoint(out, dit_cfg, TINY_TEXT_ENCODER, TINY_IMAGE_ENCODER, TINY_VAE)


# ------------------------------------------------------------------------------- FLOPs


def dit_forward_flops(cfg: DiTConfig, *, new_frames: int, visible_frames: int, with_actions: bool) -> int:
    """FLOPs (2 per multiply-add) of one DiT forward, batch 1, cross-attention K/V cached.

    Counts every matmul-like op (what FlopCounterMode counts); norms, RoPE, modulation and the
    softmax are elementwise and left out.
    """
    d, f = cfg.dim, cfg.ffn_dim
    n_video = new_frames * cfg.frame_seqlen
    n_extra = cfg.action_register_length if with_actions else 0
    n = n_video + n_extra
    n_keys = visible_frames * cfg.frame_seqlen + n_extra
    n_context = cfg.text_len + (cfg.num_image_tokens if cfg.has_image_context else 0)
    patch = cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]

    flops = 2 * n_video * cfg.in_dim * patch * d  # patch embedding (a strided conv = a matmul)
    flops += 2 * n * (cfg.freq_dim * d + d * d) + 2 * n * d * 6 * d  # per-token time embedding + projection
    per_block = (
        4 * 2 * n * d * d  # self-attention q, k, v, o
        + 4 * n * n_keys * d  # self-attention QK^T and AV over the visible window + register
        + 2 * 2 * n * d * d  # cross-attention q, o (its K/V are cached)
        + 4 * n * n_context * d  # cross-attention over text (+ image) tokens
        + 2 * 2 * n * d * f  # FFN
    )
    flops += cfg.num_layers * per_block
    flops += 2 * n_video * d * patch * cfg.out_dim  # head
    if with_actions:
        n_act, n_state, h = cfg.num_action_per_block, cfg.num_state_per_block, cfg.hidden_size
        flops += 2 * n_act * (cfg.action_dim * d + 2 * d * d + d * d)  # action encoder W1, W2, W3
        flops += 2 * n_state * (cfg.max_state_dim * h + h * d)  # state encoder
        flops += 2 * n_act * (d * h + h * cfg.action_dim)  # action decoder
    return flops


def call_flops(cfg: DiTConfig, *, window_start: bool, start_frame_after: int, denoise_forwards: int, branches: int) -> int:
    """DiT FLOPs of one policy call: the prefill and the denoise forwards that ran, per branch.

    ``start_frame_after`` is the policy's ``current_start_frame`` after the call: the denoise
    forwards see that many frames; the prefill saw two fewer (one frame at a window start).
    """
    nfpb = cfg.num_frame_per_block
    prefill_frames = 1 if window_start else nfpb
    prefill = dit_forward_flops(cfg, new_frames=prefill_frames, visible_frames=start_frame_after - nfpb, with_actions=False)
    denoise = dit_forward_flops(cfg, new_frames=nfpb, visible_frames=start_frame_after, with_actions=True)
    return branches * (prefill + denoise_forwards * denoise)


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter_check(dit: CausalWanModel, dtype: torch.dtype) -> dict[str, dict[str, int]]:
    """FlopCounterMode vs the formula on a full-window (9-frame) denoise forward and prefill."""
    cfg = dit.config
    torch.manual_seed(0)
    lh, lw = _latent_grid(cfg)
    nfpb = cfg.num_frame_per_block
    cached = cfg.local_attn_size - nfpb
    dense = DenseKVCache(cfg.num_layers, cfg.local_attn_size * cfg.frame_seqlen)
    kv_shape = (1, cached * cfg.frame_seqlen, cfg.num_heads, cfg.head_dim)
    dense.keys = [torch.randn(kv_shape, dtype=dtype) for _ in range(cfg.num_layers)]
    dense.values = [torch.randn(kv_shape, dtype=dtype) for _ in range(cfg.num_layers)]
    context = torch.randn(1, cfg.text_len, cfg.text_dim, dtype=dtype)
    clip = torch.randn(1, cfg.num_image_tokens, cfg.clip_dim, dtype=dtype)
    cross = [
        CrossKV(text[0], text[1], image[0] if image else None, image[1] if image else None)
        for text, image in dit.project_cross_kv(context=context, clip_feature=clip)
    ]
    common = dict(
        x=torch.randn(1, cfg.out_dim, nfpb, lh, lw, dtype=dtype),
        current_start_frame=cached,
        y=torch.randn(1, cfg.in_dim - cfg.out_dim, nfpb, lh, lw, dtype=dtype),
        cross_kv=cross,
    )
    forwards = {
        "denoise": dict(
            timestep=torch.full((1, nfpb), 500),
            self_kv=dense.layers(update=False),
            action=torch.randn(1, cfg.num_action_per_block, cfg.action_dim, dtype=dtype),
            timestep_action=torch.full((1, cfg.num_action_per_block), 500),
            state=torch.randn(1, cfg.num_state_per_block, cfg.max_state_dim, dtype=dtype),
        ),
        # A prefill that commits: the cache grows to 9 frames and stays there (the window), so
        # running it twice sees the same window.
        "prefill": dict(timestep=torch.zeros(1, nfpb, dtype=torch.long), self_kv=dense.layers(update=True)),
    }
    cpu_sdpa = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}
    out: dict[str, dict[str, int]] = {}
    for kind, inputs in forwards.items():
        counts = {}
        for name, mapping in (("flop_counter_raw", {}), ("flop_counter", cpu_sdpa)):
            with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
                dit(**common, **inputs)
            counts[name] = counter.get_total_flops()
        counts["analytic"] = dit_forward_flops(cfg, new_frames=nfpb, visible_frames=cfg.local_attn_size, with_actions=kind == "denoise")
        out[kind] = counts
    return out


def _latent_grid(cfg: DiTConfig) -> tuple[int, int]:
    """A latent (h, w) giving frame_seqlen tokens after the 2x2 patching (shape is all FLOPs see)."""
    _, ph, pw = cfg.patch_size
    tokens = cfg.frame_seqlen
    h = max(d for d in range(1, int(tokens**0.5) + 1) if tokens % d == 0)
    return h * ph, tokens // h * pw


def matmul_rate(dtype: torch.dtype, size: int = 2048, seconds: float = 1.5) -> float:
    """FLOP/s of torch.mm on a large square in this dtype and thread count (best of a few)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


# ------------------------------------------------------------------------------- rollout


def observations(n: int, seed: int = 0) -> list[RobotObservation]:
    """DROID-shaped observations: 1 frame first, then 4-frame stacks, one prompt."""
    return droid_observations(n, seed, CAMERA)


@dataclass
class CallRecord:
    window_start: bool
    timing_ms: dict[str, float]
    wall_ms: float
    dit_forwards: int  # denoise steps that ran the DiT (per branch)
    start_frame_after: int


@dataclass
class ConfigResult:
    name: str
    description: str
    dit_cfg: DiTConfig
    branches: int
    records: list[CallRecord] = field(default_factory=list)  # measured calls (warm-up excluded)
    flop_check: dict[str, int] = field(default_factory=dict)


def run_config(name: str, description: str, checkpoint: Path, view_size: tuple[int, int], calls: int, dtype: str, step_cache: str) -> ConfigResult:
    # The serving path: the engine build_engine() makes for a one-session config (the KV pool is
    # raised to the one-session floor), driven request by request as the worker drives it.
    config = validate_config(
        {
            "engine": {"dtype": dtype, "max_sessions": 1, "kv_budget_gib": 1e-6, "warmup": False},
            "policy": {
                "name": "dreamzero",
                "checkpoint": str(checkpoint),
                "view_size": list(view_size),
                "image_resolution": list(CAMERA),
                "dit_step_cache": step_cache,
            },
        },
        source=f"bench_chunk:{name}",
    )
    engine = build_engine(config)
    policy = engine.policy
    result = ConfigResult(name, description, policy.dit_config, len(policy.branches))
    for index, obs in enumerate(observations(calls)):
        start = time.perf_counter()
        step = engine.infer("bench", obs).result
        wall = (time.perf_counter() - start) * 1000.0
        info = step.info
        window_start = index == 0 or info["window_restart"] or info["prompt_change"]
        log(f"[{name}] call {index + 1}/{calls}: {wall:.0f} ms ({'window start' if window_start else 'steady'}, {info['dit_forwards']} DiT steps)")
        if index > 0:  # the first call is a warm-up (first-time allocations, prompt encodes)
            result.records.append(CallRecord(window_start, dict(step.timing_ms), wall, info["dit_forwards"], info["current_start_frame"]))
    engine.end("bench", "done")
    log(f"[{name}] FLOP count cross-check (FlopCounterMode)")
    result.flop_check = flop_counter_check(policy.dit, policy.dtype)
    return result


# ------------------------------------------------------------------------------ report


def summarize(result: ConfigResult, peak_flops: float) -> dict[str, Any]:
    groups = {"window_start": [r for r in result.records if r.window_start], "steady": [r for r in result.records if not r.window_start]}
    out: dict[str, Any] = {"description": result.description, "branches": result.branches, "flop_check": result.flop_check}
    for group, records in groups.items():
        if not records:
            continue
        phases = {p: statistics.fmean(r.timing_ms.get(p, 0.0) for r in records) for p in PHASES}
        flops = [
            call_flops(
                result.dit_cfg,
                window_start=r.window_start,
                start_frame_after=r.start_frame_after,
                denoise_forwards=r.dit_forwards,
                branches=result.branches,
            )
            for r in records
        ]
        dit_ms = [r.timing_ms["prefill"] + r.timing_ms["denoise"] for r in records]
        achieved = sum(flops) / (sum(dit_ms) / 1000.0)  # the DiT phases include the (cheap) scheduler steps
        out[group] = {
            "calls": len(records),
            "phase_ms": phases,
            "total_ms": sum(phases.values()),
            "wall_ms": statistics.fmean(r.wall_ms for r in records),
            "dit_forwards_per_call": statistics.fmean(result.branches * (1 + r.dit_forwards) for r in records),
            "dit_gflop_per_call": statistics.fmean(flops) / 1e9,
            "dit_gflops": achieved / 1e9,
            "fraction_of_peak": achieved / peak_flops,
        }
    measured = result.records
    out["ms_per_call"] = statistics.fmean(r.wall_ms for r in measured)
    return out


def print_config(summary: dict[str, Any], peak_flops: float) -> None:
    cols = [g for g in ("window_start", "steady") if g in summary]
    print(f"\n{summary['description']}")
    header = f"{'':<26}" + "".join(f"{c.replace('_', ' '):>15}" for c in cols)
    print(header)
    print("-" * len(header))
    for phase in PHASES:
        label = f"{phase} ms"
        print(f"{label:<26}" + "".join(f"{summary[c]['phase_ms'][phase]:>15.1f}" for c in cols))
    rows = [
        ("total ms (phases)", "total_ms", "{:.1f}"),
        ("wall ms (policy.step)", "wall_ms", "{:.1f}"),
        ("DiT forwards / call", "dit_forwards_per_call", "{:.0f}"),
        ("DiT GFLOP / call", "dit_gflop_per_call", "{:.2f}"),
        ("DiT GFLOP/s", "dit_gflops", "{:.1f}"),
        ("fraction of mm peak", "fraction_of_peak", "{:.1%}"),
    ]
    for label, key, fmt in rows:
        print(f"{label:<26}" + "".join(f"{fmt.format(summary[c][key]):>15}" for c in cols))
    print("calls measured: " + ", ".join(f"{summary[c]['calls']} {c.replace('_', ' ')}" for c in cols) + f"; mm peak {peak_flops / 1e9:.1f} GFLOP/s")
    for kind, check in summary["flop_check"].items():
        print(
            f"FLOPs of one {kind} forward (full window, per branch): analytic {check['analytic'] / 1e9:.4f} G, "
            f"FlopCounterMode {check['flop_counter'] / 1e9:.4f} G ({check['flop_counter'] / check['analytic']:.4f}x; "
            f"{check['flop_counter_raw'] / 1e9:.4f} G without a formula for CPU's flash SDPA op)"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny,droid", help="comma-separated: tiny, droid")
    parser.add_argument("--tiny-calls", type=int, default=13, help="policy calls on the tiny model (first is warm-up)")
    parser.add_argument("--droid-calls", type=int, default=6, help="policy calls at DROID geometry (>= 6: window + restart)")
    parser.add_argument("--droid-dim", type=int, default=128, help="DiT width at DROID geometry")
    parser.add_argument("--droid-layers", type=int, default=2)
    parser.add_argument("--droid-heads", type=int, default=1, help="heads (DROID's head_dim is 128)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--dit-step-cache", default="fixed", choices=("off", "fixed", "dynamic"), help="DiT step cache (fixed: upstream's default 8 of 16 steps)"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="smoke run: the tiny model only, one window + restart")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = parser.parse_args(argv)
    if args.quick:  # one DROID-resolution call alone (VAE at 352x640) takes longer than a smoke run may
        args.configs, args.tiny_calls = "tiny", 6
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    load = ForeignLoad()
    log(f"measuring torch.mm {args.dtype} rate")
    peak = matmul_rate(dtype)
    report: dict[str, Any] = {
        "bench": "chunk",
        "torch": torch.__version__,
        "threads": args.threads,
        "dtype": args.dtype,
        "dit_step_cache": args.dit_step_cache,
        "mm_gflops": peak / 1e9,
        "configs": {},
    }
    print(
        f"bench_chunk: DreamZero policy per call by phase, {args.dtype}, {args.threads} threads, "
        f"DiT step cache {args.dit_step_cache}, torch.mm 2048^2 peak {peak / 1e9:.1f} GFLOP/s"
    )
    with tempfile.TemporaryDirectory(prefix="bench-chunk-") as tmp:
        for name in configs:
            if name == "tiny":
                cfg, checkpoint, view, calls = TINY_DIT, ensure_tiny_checkpoint(), TINY_VIEW_SIZE, args.tiny_calls
            elif name == "droid":
                cfg = droid_geometry_dit(args.droid_dim, args.droid_layers, args.droid_heads)
                log(f"[droid] writing a DROID-geometry checkpoint (dim {cfg.dim}, {cfg.num_layers} layers)")
                checkpoint, view, calls = write_droid_checkpoint(Path(tmp) / "droid", cfg), DROID_VIEW_SIZE, args.droid_calls
            else:
                raise SystemExit(f"unknown config {name!r} (tiny, droid)")
            description = (
                f"{name}: {view[0]}x{view[1]} views -> {cfg.frame_seqlen} tokens/latent frame, {cfg.local_attn_size}-frame "
                f"window; DiT dim {cfg.dim} x {cfg.num_layers} layers, {cfg.num_heads} heads x {cfg.head_dim}, ffn {cfg.ffn_dim}"
            )
            result = run_config(name, description, checkpoint, view, calls, args.dtype, args.dit_step_cache)
            summary = summarize(result, peak)
            print_config(summary, peak)
            report["configs"][name] = summary
            report[f"{name}_ms_per_call"] = summary["ms_per_call"]
            for group in ("window_start", "steady"):
                if group in summary:
                    report[f"{name}_{group}_ms"] = summary[group]["wall_ms"]
                    report[f"{name}_{group}_fraction_of_peak"] = summary[group]["fraction_of_peak"]
    report["foreign_load_cores"] = load.cores()
    report["contended"] = contended(report["foreign_load_cores"], args.threads)
    if report["contended"]:
        print("\n" + contention_warning(report["foreign_load_cores"]))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
