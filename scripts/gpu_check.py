#!/usr/bin/env python
"""DreamZero-DROID at full size on one GPU, measured in one prepared run (no vLLM, no checkpoint).

A synthetic DreamZero-DROID (``policy.checkpoint: synthetic:droid``: the released architecture,
40 DiT layers at dim 5120, 880 tokens per latent frame, UMT5-XXL, CLIP ViT-H/14, the Wan2.1 VAE;
random bf16 weights made directly on the GPU) is driven through the real policy, paged KV cache
and session engine (``build_engine`` from a validated config, as the worker builds it):

* per variant: build the engine, warm it up (``engine.warmup()``: one window and a restart, so
  every compile/capture happens there), then one measured session: a full window (a 1-frame
  window start, 4 calls of 4 frames) and a window restart = 6 calls. Each call is a prefill plus
  16 UniPC steps with upstream's fixed DiT step mask (8 DiT forwards), CFG with both branches on
  this one GPU;
* variants: ``sdpa`` (eager, the reference), ``flex`` (FlexAttention reading the pages in place),
  ``flex+graphs`` (engine.cuda_graphs: the denoise forward replayed from CUDA graphs; flex has no
  host syncs so it can be captured), ``flex+compile`` (engine.compile: each DiT block
  torch.compile-d, fullgraph); more can be named (``sdpa+compile``, ``flex+compile+graphs``);
* reported: per phase (text, vision, VAE, prefill, denoise, decode) for window-start and steady
  calls, per-chunk median and p99, DiT TFLOP/s and the fraction of the bf16 peak, peak GPU memory,
  KV pages per session, and each variant's actions against the sdpa eager run's;
* anchors printed beside the figures: vLLM-Omni 1095 ms/chunk on one H200 (611 ms CFG-parallel
  on two), 62.2 GiB/GPU; the compute bound (the DiT FLOPs of a chunk at the peak rate);
* with a ``+graphs`` variant: a new session's graph capture while serving with the encoder
  thread busy (``graph_capture_check.py``): the captures succeed, graphs stay on, and the new
  session's actions equal an earlier session's (``capture_under_encoder`` in the report);
* then several robots on the GPU: 1, 2 and 4 sessions per batched engine step (``--batches``):
  ms per step and chunks per second per GPU.

Without a GPU (CI) the same code path runs at reduced size (``synthetic:tiny,layers=2``: every
encoder at full depth and toy width, 2 DiT layers, 60 tokens per latent frame), float32, with
the CUDA-graph variants skipped and torch.compile's ``eager`` backend (dynamo tracing with
fullgraph, no code generation), and prints the same tables.

    python scripts/gpu_check.py --json                      # CPU: reduced size (about a minute)
    python3 scripts/gpu_check.py --full-size --json --budget-s 480 --out "$OUT"   # the device run (tree not installed: fine)
    python scripts/gpu_check.py --family 5b ...             # the same for the Wan2.2-5B DreamZero (synthetic:droid_5b)
    python scripts/gpu_check.py --family lingbot_va ...     # LingBot-VA (synthetic:released; reduced: synthetic:tiny): an
                                                            # episode per session, batches of sessions, peak vs its memory plan
    python scripts/gpu_check.py --family zero_wam ...       # Zero-WAM the same way, each episode beginning with a demonstration
                                                            # at the bound (32 latent frames of 20x30) pinned, in-context guidance

On a bare device image the packages the import chain needs beyond torch/transformers/triton are
installed from ``.device_wheels/`` (``scripts/fetch_device_wheels.sh`` downloads them; carry
that folder). docs/performance.md has the exact device command.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
START = time.monotonic()

WHEEL_DIR = ROOT / ".device_wheels"
# What the torch-side import chain (policies, kv, ardiff_server.engine.core, ardiff_server.config)
# needs beyond what the device image has (torch, transformers, tokenizers, safetensors, numpy,
# regex, pyyaml, huggingface-hub, pillow, requests): see scripts/fetch_device_wheels.sh.
NEEDED_MODULES = ("diffusers", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "ftfy", "wcwidth")

# Anchors (docs/spec.md §9, the issue): what users compare against.
VLLM_OMNI_MS_ONE_GPU = 1095.0
VLLM_OMNI_MS_CFG_PARALLEL = 611.0
VLLM_OMNI_GIB_PER_GPU = 62.2
H200_BF16_DENSE_TFLOPS = 989.0  # datasheet dense bf16 (H100/H200 SXM)

FULL_CHECKPOINT = "synthetic:droid"
REDUCED_CHECKPOINT = "synthetic:tiny,layers=2"
# --family 5b: upstream's Wan2.2-TI2V-5B DreamZero (30 layers at dim 3072, 50 tokens per latent frame, the Wan2.2 VAE)
FAMILY_CHECKPOINTS = {
    "14b": (FULL_CHECKPOINT, REDUCED_CHECKPOINT),
    "5b": ("synthetic:droid_5b", "synthetic:tiny_5b,layers=2"),
    "lingbot_va": ("synthetic:released", "synthetic:tiny"),  # policies/lingbot_va/synthetic.py
    "zero_wam": ("synthetic:released", "synthetic:tiny"),  # the same presets with Zero-WAM's transformer (synthetic_zero_wam_policy)
}
PHASES = ("frames", "text", "vision", "vae", "prefill", "denoise", "decode")
CAMERA = (180, 320)
PROMPT = "pick up the cup and put it in the bowl"
# Largest |a - a_sdpa| tolerated, in normalized action units (the model's [-1, 1] output scale).
# float32: kernels differ only in summation order. bf16: different attention kernels round
# differently and 40 layers x 8 DiT steps of random weights amplify it; a prior, not calibrated.
TOLERANCE = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 5e-2}


def log(message: str) -> None:
    print(f"[gpu_check {time.monotonic() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def elapsed() -> float:
    return time.monotonic() - START


# ----------------------------------------------------------------------------- wheels


def ensure_wheels(folder: Path) -> list[str]:
    """Install the carried wheels (pure Python or cp312 manylinux) into a temp site dir when a
    module the import chain needs is missing. Returns the wheel names installed."""
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return []
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"gpu_check: modules {missing} are missing and {folder} holds no wheels: run "
            f"scripts/fetch_device_wheels.sh where pip works and carry {folder.name}/ with the run"
        )
    target = Path(tempfile.gettempdir()) / "ardiff-device-site"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(target),
        *map(str, wheels),
    ]
    subprocess.run(cmd, check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    importlib.invalidate_caches()
    log(f"installed {len(wheels)} carried wheels for {missing} into {target}")
    return [w.name for w in wheels]


def ensure_project() -> None:
    """A bare device image runs this tree uninstalled: kv/ and policies/ install as ardiff_kv / ardiff_policies
    (pyproject's package-dir), so name them so through symlinks in a temp dir on the path (no build needed)."""
    if importlib.util.find_spec("ardiff_kv") is not None:
        return
    names = Path(tempfile.gettempdir()) / "ardiff-device-names"
    names.mkdir(exist_ok=True)
    for installed, folder in (("ardiff_kv", "kv"), ("ardiff_policies", "policies")):
        link = names / installed
        if not link.exists():
            link.symlink_to(ROOT / folder, target_is_directory=True)
    sys.path.insert(0, str(names))
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(names), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    importlib.invalidate_caches()
    log(f"this tree is not installed: ardiff_kv / ardiff_policies from {names}")


# ----------------------------------------------------------------------------- helpers


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def gib(n: float) -> float:
    return n / 2**30


class Variant:
    def __init__(self, name: str) -> None:
        parts = name.split("+")
        self.name = name
        self.backend = parts[0]
        self.compile = "compile" in parts[1:]
        self.graphs = "graphs" in parts[1:]
        unknown = [p for p in parts[1:] if p not in ("compile", "graphs")]
        if self.backend not in ("sdpa", "flex", "flash", "auto") or unknown:
            raise SystemExit(f"gpu_check: bad variant {name!r} (backend sdpa|flex|flash|auto, then +compile, +graphs)")


# ------------------------------------------------------------------------------ the run


def observations(calls: int, seed: int = 0):
    """DROID-shaped observations: 1 frame first, then 4-frame stacks; the same for every variant."""
    from benchlib import droid_observations

    return droid_observations(calls, seed, CAMERA, PROMPT)


def kv_spec_for(checkpoint: str, dtype: str):
    """The KV spec the policy will ask for (policy.kv_spec from the synthetic DiT config)."""
    import torch

    from ardiff_policies.dreamzero.policy import DreamZeroPolicy
    from ardiff_policies.dreamzero.synthetic import parse_spec

    spec = parse_spec(checkpoint)
    stub = type("Stub", (), {"dit_config": spec.dit, "dtype": getattr(torch, dtype)})()
    return DreamZeroPolicy.kv_spec(stub), spec


def kv_budget_gib(kv_spec, max_sessions: int, branches: int = 2, max_batch: int = 1) -> float:
    """Exactly what ``max_sessions`` sessions reserve: pages, scratch (per batch slot) and cross-attention slots."""
    scratch = max_batch * branches * kv_spec.scratch_pages_per_branch
    fixed = max_sessions * branches * kv_spec.cross_slot_bytes + scratch * kv_spec.page_bytes
    pages = max_sessions * kv_spec.reservation(branches)
    return (fixed + pages * kv_spec.page_bytes + kv_spec.page_bytes // 2) / 2**30


def build_variant_engine(args, variant: Variant, budget_gib: float, max_sessions: int | None = None, max_batch: int = 1):
    """The engine for a variant, through the server's own config validation and build_engine."""
    from ardiff_server.config import validate_config

    def raw(backend: str) -> dict[str, Any]:
        return {
            "engine": {
                "device": args.device,
                "dtype": args.dtype,
                "max_sessions": max_sessions or args.max_sessions,
                "kv_budget_gib": budget_gib,
                "max_batch": max_batch,
                "attention_backend": backend,
                "compile": variant.compile,
                "compile_backend": args.compile_backend,
                "cuda_graphs": variant.graphs,
                "warmup": False,
            },
            "policy": {
                "name": "dreamzero",
                "checkpoint": args.checkpoint,
                "view_size": list(args.view_size),
                "image_resolution": list(CAMERA),
                "dit_step_cache": "fixed",
            },
        }

    from ardiff_server.engine.builder import build_engine

    return build_engine(validate_config(raw(variant.backend), source="gpu_check"))


def release_engine(engine) -> None:
    import torch

    try:
        engine.end_all("gpu_check")
    finally:
        policy = engine.policy
        for block in policy.dit.blocks:  # the synthetic model is shared: undo engine.compile
            if getattr(block, "_compiled_call_impl", None) is not None:
                block._compiled_call_impl = None
        if getattr(policy, "graphs", None) is not None:
            policy.graphs = None
        engine.policy = engine.cache = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_variant(args, variant: Variant, obs: list, deadline: float | None) -> dict[str, Any]:
    import numpy as np
    import torch

    cuda = args.device.startswith("cuda")
    result: dict[str, Any] = {"backend": variant.backend, "compile": variant.compile, "cuda_graphs": variant.graphs}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.monotonic()
    kv_spec, _ = kv_spec_for(args.checkpoint, args.dtype)
    engine = build_variant_engine(args, variant, kv_budget_gib(kv_spec, args.max_sessions))
    result["build_s"] = time.monotonic() - start
    log(f"[{variant.name}] engine built in {result['build_s']:.1f} s (KV pool {gib(engine.cache.storage.nbytes):.2f} GiB)")
    try:
        t = time.monotonic()
        warm = engine.warmup()
        # A CUDA graph is keyed by the session's cross-attention slot: a second warm-up session
        # gets the other slot assignment, so the measured session finds its graphs captured.
        if variant.graphs:
            warm2 = engine.warmup()
            warm = {**{f"a_{k}": v for k, v in warm.items()}, **{f"b_{k}": v for k, v in warm2.items()}}
        result["warmup_s"] = time.monotonic() - t
        result["warmup_calls_ms"] = warm
        log(f"[{variant.name}] warm-up {result['warmup_s']:.1f} s: {warm}")
        graphs = getattr(engine.policy, "graphs", None)
        captured_before = len(graphs.graphs) if graphs is not None else 0
        if cuda:
            torch.cuda.synchronize()
            result["peak_alloc_gib_warmup"] = gib(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

        calls: list[dict[str, Any]] = []
        actions: list[np.ndarray] = []
        session_id = f"gpu-check-{variant.name}"
        for index, observation in enumerate(obs):
            if deadline is not None and calls and time.monotonic() + 1.5 * calls[-1]["wall_ms"] / 1000 > deadline:
                result["partial"] = f"stopped after {len(calls)} of {len(obs)} calls: time budget"
                log(f"[{variant.name}] {result['partial']}")
                break
            t = time.perf_counter()
            outcome = engine.infer(session_id, observation)
            wall = (time.perf_counter() - t) * 1000.0
            step = outcome.result
            info = step.info
            kv = engine.sessions[session_id].kv
            record = {
                "wall_ms": wall,
                "phase_ms": {p: float(step.timing_ms.get(p, 0.0)) for p in PHASES},
                "dit_forwards": int(info["dit_forwards"]),
                "window_start": index == 0 or bool(info.get("window_restart")) or bool(info.get("prompt_change")),
                "start_frame_after": int(info["current_start_frame"]),
                "pages_held": kv.pages_held if kv is not None else 0,
            }
            calls.append(record)
            actions.append(np.asarray(step.actions, dtype=np.float64))
            log(
                f"[{variant.name}] call {index + 1}/{len(obs)}: {wall:.0f} ms "
                f"({'window start' if record['window_start'] else 'steady'}, {record['dit_forwards']} DiT steps, "
                f"{record['pages_held']} pages held)"
            )
        if cuda:
            torch.cuda.synchronize()
            result["peak_alloc_gib"] = gib(torch.cuda.max_memory_allocated())
            result["peak_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
        result["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
        if graphs is not None:
            result["graphs_captured"] = len(graphs.graphs)
            result["graphs_captured_while_measuring"] = len(graphs.graphs) - captured_before
            result["graph_capture_failed"] = bool(graphs.failed)
        cache = engine.cache
        stats = cache.stats()
        result["kv"] = {
            "pool_pages": stats["pages_total"],
            "pool_gib": gib(cache.storage.nbytes),
            "reserved_pages_per_session": cache.reservation_per_session,
            "max_pages_held": max((c["pages_held"] for c in calls), default=0),
            "scratch_pages": cache.storage.max_batch * len(cache.branches) * cache.spec.scratch_pages_per_branch,
            "page_mib": cache.spec.page_bytes / 2**20,
            "page_tokens": cache.spec.page_size,
            "cross_slot_mib": cache.spec.cross_slot_bytes / 2**20,
            "session_capacity": stats["session_capacity"],
        }
        result["calls"] = calls
        result["actions"] = [a.tolist() for a in actions]
        result["actions_finite"] = bool(all(np.isfinite(a).all() for a in actions))
        stats_obj = engine.policy.action_stats
        result["_action_scale"] = ((np.asarray(stats_obj.q99) - np.asarray(stats_obj.q01)) / 2.0).tolist()
        result["status"] = "ok"
    finally:
        release_engine(engine)
    result["total_s"] = time.monotonic() - start
    return result


def run_batches(args, variant: Variant, sizes: list[int], calls: int, deadline: float | None) -> dict[str, Any]:
    """Several robots on one GPU: ``b`` sessions served as one batched step per call
    (``engine.run``, as the worker's scheduler batches with ``engine.max_batch``), for each ``b`` in ``sizes``.
    Reported per batch size: ms per step (window start and steady) and chunks per second."""
    import torch

    from ardiff_server.engine.messages import ErrorReply, Infer

    cuda = args.device.startswith("cuda")
    top = max(sizes)
    kv_spec, _ = kv_spec_for(args.checkpoint, args.dtype)
    engine = build_variant_engine(args, variant, kv_budget_gib(kv_spec, top, max_batch=top), max_sessions=top, max_batch=top)
    rows: list[dict[str, Any]] = []
    try:
        for size in sizes:
            if deadline is not None and rows and time.monotonic() + 2.5 * rows[-1]["total_s"] * size / rows[-1]["batch"] > deadline:
                rows.append({"batch": size, "status": "skipped: time budget"})
                break
            robots = [observations(calls, seed=100 + i) for i in range(size)]
            sessions = [f"batch{size}-{i}" for i in range(size)]
            walls: list[float] = []
            started = time.monotonic()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                for call in range(calls):
                    requests = [Infer(i, sid, robots[i][call]) for i, sid in enumerate(sessions)]
                    t = time.perf_counter()
                    replies = engine.run(requests)
                    walls.append((time.perf_counter() - t) * 1000.0)
                    errors = [r.message for r in replies if isinstance(r, ErrorReply)]
                    if errors or any(r.batch_size != size for r in replies):
                        raise RuntimeError(f"batch of {size}: {errors[:1] or 'not one batch'}")
                    log(f"[batch {size}] call {call + 1}/{calls}: {walls[-1]:.0f} ms for {size} chunks")
            except torch.cuda.OutOfMemoryError as exc:
                rows.append({"batch": size, "status": f"out of memory: {str(exc)[:200]}"})
                break
            finally:
                for sid in sessions:
                    engine.end(sid, "gpu_check")
            steady = walls[1:] or walls
            row = {
                "batch": size,
                "status": "ok",
                "calls": calls,
                "window_start_ms": walls[0],
                "steady_ms_median": statistics.median(steady),
                "chunks_per_s": size / (statistics.median(steady) / 1000.0),
                "total_s": time.monotonic() - started,
            }
            if cuda:
                row["peak_alloc_gib"] = gib(torch.cuda.max_memory_allocated())
            rows.append(row)
    finally:
        release_engine(engine)
    base = next((r for r in rows if r["batch"] == 1 and r["status"] == "ok"), None)
    for row in rows:
        if base is not None and row["status"] == "ok":
            row["speedup_vs_batch_1"] = row["chunks_per_s"] / base["chunks_per_s"]
    return {"variant": variant.name, "rows": rows}


def run_capture_check(args, tolerance: float) -> dict[str, Any]:
    """A new session's CUDA-graph capture while the encoder thread works (graph_capture_check.py), on a flex+graphs
    engine with room for two sessions (two cross-attention slots)."""
    from graph_capture_check import capture_under_encoder

    from ardiff_policies.dreamzero.cuda_graphs import CAPTURE_ERROR_MODE

    kv_spec, _ = kv_spec_for(args.checkpoint, args.dtype)
    started = time.monotonic()
    engine = build_variant_engine(args, Variant("flex+graphs"), kv_budget_gib(kv_spec, 2), max_sessions=2)
    try:  # no warm-up: it would capture the slot the new session may get (the first session's calls warm up)
        result = capture_under_encoder(engine, observations(2, seed=7), tolerance=tolerance)
    finally:
        release_engine(engine)
    return {**result, "capture_error_mode": CAPTURE_ERROR_MODE, "total_s": time.monotonic() - started}


def print_batches(batches: dict[str, Any]) -> None:
    print(f"\nseveral robots per GPU ({batches['variant']}): b sessions per engine step (engine.max_batch)")
    print(f"{'batch':>6}{'start ms':>10}{'steady ms':>11}{'chunks/s':>10}{'vs b=1':>8}{'GiB':>7}")
    for row in batches["rows"]:
        if row["status"] != "ok":
            print(f"{row['batch']:>6}  {row['status']}")
            continue
        print(
            f"{row['batch']:>6}{row['window_start_ms']:>10.1f}{row['steady_ms_median']:>11.1f}{row['chunks_per_s']:>10.2f}"
            f"{row.get('speedup_vs_batch_1', float('nan')):>7.2f}x{row.get('peak_alloc_gib', float('nan')):>7.1f}"
        )


# ------------------------------------------------------------------------------ report


def summarize(result: dict[str, Any], dit_cfg, branches: int, peak_flops: float) -> None:
    """Adds medians, p99, per-phase means and FLOP rates to a variant's result."""
    from bench_chunk import call_flops

    calls = result.get("calls") or []
    if not calls:
        return
    walls = [c["wall_ms"] for c in calls]
    result["ms_per_chunk_median"] = statistics.median(walls)
    result["ms_per_chunk_p99"] = percentile(walls, 99)
    groups = {"window_start": [c for c in calls if c["window_start"]], "steady": [c for c in calls if not c["window_start"]]}
    result["phase_ms"] = {}
    for group, members in groups.items():
        if not members:
            continue
        result[f"{group}_ms_median"] = statistics.median(c["wall_ms"] for c in members)
        result["phase_ms"][group] = {p: statistics.fmean(c["phase_ms"][p] for c in members) for p in PHASES}
    flops = [
        call_flops(
            dit_cfg, window_start=c["window_start"], start_frame_after=c["start_frame_after"], denoise_forwards=c["dit_forwards"], branches=branches
        )
        for c in calls
    ]
    dit_ms = [c["phase_ms"]["prefill"] + c["phase_ms"]["denoise"] for c in calls]
    result["dit_tflop_per_chunk"] = statistics.fmean(flops) / 1e12
    result["dit_tflops"] = sum(flops) / (sum(dit_ms) / 1e3) / 1e12 if sum(dit_ms) > 0 else 0.0
    result["dit_fraction_of_peak"] = result["dit_tflops"] * 1e12 / peak_flops
    result["chunk_fraction_of_peak"] = sum(flops) / (sum(walls) / 1e3) / peak_flops


def compare(result: dict[str, Any], reference: dict[str, Any], tolerance: float) -> None:
    import numpy as np

    mine, ref = result.get("actions") or [], reference.get("actions") or []
    n = min(len(mine), len(ref))
    if not n:
        return
    scale = np.asarray(reference["_action_scale"])
    diffs = [np.abs(np.asarray(a) - np.asarray(b)) for a, b in zip(mine[:n], ref[:n])]
    max_abs = max(float(d.max()) for d in diffs)
    max_norm = max(float((d / scale).max()) for d in diffs)
    result["vs_reference"] = {
        "reference": reference["name"],
        "calls": n,
        "max_abs": max_abs,
        "max_normalized": max_norm,
        "tolerance_normalized": tolerance,
        "ok": bool(max_norm <= tolerance and result["actions_finite"]),
    }


def print_variant(result: dict[str, Any]) -> None:
    name = result["name"]
    if result.get("status") != "ok":
        print(f"\n{name}: {result.get('status')}", flush=True)
        return
    cols = [g for g in ("window_start", "steady") if g in result.get("phase_ms", {})]
    extra = []
    if result["compile"]:
        extra.append("engine.compile")
    if result["cuda_graphs"]:
        extra.append(
            f"CUDA graphs: {result.get('graphs_captured', 0)} captured"
            + (", capture FAILED (ran eagerly)" if result.get("graph_capture_failed") else "")
        )
    print(
        f"\n{name}: attention {result['backend']}"
        + (f"; {'; '.join(extra)}" if extra else "")
        + f"; build {result['build_s']:.1f} s, warm-up {result['warmup_s']:.1f} s",
        flush=True,
    )
    header = f"{'phase (mean ms)':<22}" + "".join(f"{c.replace('_', ' '):>14}" for c in cols)
    print(header)
    for phase in PHASES:
        print(f"{phase:<22}" + "".join(f"{result['phase_ms'][c][phase]:>14.1f}" for c in cols))
    print(f"{'chunk median ms':<22}" + "".join(f"{result[c + '_ms_median']:>14.1f}" for c in cols))
    kv = result["kv"]
    print(
        f"per chunk: median {result['ms_per_chunk_median']:.1f} ms, p99 {result['ms_per_chunk_p99']:.1f} ms over "
        f"{len(result['calls'])} calls; DiT {result['dit_tflop_per_chunk']:.4g} TFLOP/chunk at {result['dit_tflops']:.3g} "
        f"TFLOP/s = {result['dit_fraction_of_peak']:.1%} of peak (whole chunk {result['chunk_fraction_of_peak']:.1%})"
    )
    memory = (
        f"peak {result['peak_alloc_gib']:.1f} GiB allocated, {result['peak_reserved_gib']:.1f} GiB reserved"
        if "peak_alloc_gib" in result
        else f"max RSS {result['max_rss_gib']:.1f} GiB"
    )
    print(
        f"memory: {memory}; KV pool {kv['pool_gib']:.3g} GiB = {kv['pool_pages']} pages x {kv['page_mib']:.1f} MiB "
        f"({kv['page_tokens']} tokens) + {kv['scratch_pages']} scratch + cross slots; a session reserves "
        f"{kv['reserved_pages_per_session']} pages, held at most {kv['max_pages_held']}"
    )
    if "vs_reference" in result:
        v = result["vs_reference"]
        print(
            f"actions vs {v['reference']}: max |da| {v['max_abs']:.2e} (normalized {v['max_normalized']:.2e}, "
            f"tolerance {v['tolerance_normalized']:.0e}) -> {'ok' if v['ok'] else 'DIFFERS'}; finite: {result['actions_finite']}"
        )
    if result.get("partial"):
        print(f"PARTIAL: {result['partial']}")


def print_summary(report: dict[str, Any]) -> None:
    print("\nsummary" + f" ({report['device']}, {report['dtype']}, {report['model']})")
    header = f"{'variant':<22}{'p50 ms':>9}{'p99 ms':>9}{'steady':>9}{'start':>9}{'TFLOP/s':>9}{'of peak':>9}{'GiB':>7}{'warm s':>8}  vs sdpa"
    print(header)
    print("-" * len(header))
    for name, r in report["variants"].items():
        if r.get("status") != "ok":
            print(f"{name:<22}{r.get('status', '?')}")
            continue
        v = r.get("vs_reference")
        check = "reference" if v is None else f"{v['max_normalized']:.1e} {'ok' if v['ok'] else 'DIFFERS'}"
        memory = r.get("peak_reserved_gib", r.get("max_rss_gib", float("nan")))
        print(
            f"{name:<22}{r['ms_per_chunk_median']:>9.1f}{r['ms_per_chunk_p99']:>9.1f}{r.get('steady_ms_median', float('nan')):>9.1f}"
            f"{r.get('window_start_ms_median', float('nan')):>9.1f}{r['dit_tflops']:>9.3g}{r['dit_fraction_of_peak']:>9.1%}"
            f"{memory:>7.1f}{r['warmup_s']:>8.1f}  {check}"
        )
    for name, reason in report["skipped"].items():
        print(f"{name:<22}skipped: {reason}")
    f = report["flops"]
    print(f"\nGiB: peak reserved (CUDA) or max RSS (CPU). of peak: DiT FLOP/s over {f['peak_tflops']:.4g} TFLOP/s ({f['peak_source']}).")
    print(
        f"compute bound: a steady chunk at a full window is {f['steady_chunk_tflop']:.4g} TFLOP of DiT "
        f"(8 of 16 steps x {report['branches']} branches + prefill) -> {f['compute_bound_ms']:.4g} ms at peak"
    )
    a = report["anchors"]
    print(
        f"anchors: vLLM-Omni {a['vllm_omni_ms_one_h200']:.0f} ms/chunk on one H200 ({a['vllm_omni_ms_cfg_parallel_two_h200']:.0f} ms "
        f"CFG-parallel on two), {a['vllm_omni_gib_per_gpu']} GiB/GPU; the issue's bound: ~1.1 PFLOP/chunk -> ~1.1 s at 989 TFLOP/s"
    )
    if report.get("contended"):
        print(
            f"WARNING: other processes kept {report['foreign_load_cores']:.1f} cores busy during the run: CPU timings "
            "are distorted (rerun on an idle machine)"
        )
    w = report["weights_gib"]
    print(
        "weights: " + ", ".join(f"{k} {v:.3g} GiB" for k, v in w.items()) + f" (total {sum(w.values()):.3g} GiB, "
        f"{report['params_b']:.4g} B parameters); materialized in {report['materialize_s']:.1f} s"
    )


# ------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full-size", action="store_true", help="the released DreamZero-DROID geometry (default on CUDA)")
    parser.add_argument("--reduced", action="store_true", help=f"the reduced model ({REDUCED_CHECKPOINT}; default without CUDA)")
    parser.add_argument(
        "--family",
        choices=sorted(FAMILY_CHECKPOINTS),
        default="14b",
        help="14b: DreamZero-DROID (synthetic:droid); 5b: the Wan2.2-5B DreamZero (synthetic:droid_5b); lingbot_va: LingBot-VA "
        "(synthetic:released); zero_wam: Zero-WAM (synthetic:released, its action expert, a demonstration pinned)",
    )
    parser.add_argument(
        "--embodiment",
        choices=("robotwin", "franka", "libero", "demo", "tiny_robotwin", "tiny_libero"),
        help="--family lingbot_va / zero_wam: upstream's embodiment config (zero_wam: robotwin, tiny_robotwin)",
    )
    parser.add_argument("--checkpoint", help="a synthetic:<preset>[,key=value...] spec (overrides --full-size/--reduced/--family)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument(
        "--variants", help="comma-separated; default sdpa,flex,flex+graphs,flex+compile,flex+compile+graphs on CUDA, sdpa,flex,flex+compile on CPU"
    )
    parser.add_argument("--calls", type=int, default=6, help="measured calls per variant (6 = a full window + a restart)")
    parser.add_argument("--batches", default="1,2,4", help="robots per engine step to measure after the variants (empty: skip)")
    parser.add_argument("--batch-calls", type=int, default=4, help="calls per robot in the batch measurement (a window start + steady)")
    parser.add_argument("--batch-variant", default="flex", help="the variant the batch measurement runs (default flex)")
    parser.add_argument("--max-sessions", type=int, default=1, help="KV pool sized for exactly this many sessions")
    parser.add_argument("--compile-backend", help="torch.compile backend (default inductor on CUDA, eager on CPU)")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help=f"peak for 'of peak' (default: {H200_BF16_DENSE_TFLOPS:g} on CUDA (H200 bf16 dense), the measured matmul rate on CPU)",
    )
    parser.add_argument("--budget-s", type=float, default=0.0, help="skip remaining variants when this much wall time is used (0: none)")
    parser.add_argument(
        "--compile-estimate-s",
        type=float,
        help="budget guard: time the first torch.compile of the DiT blocks may take (default 240 on CUDA, 30 on CPU)",
    )
    parser.add_argument("--tolerance", type=float, help="max |a - a_sdpa| in normalized action units (default by dtype)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (CPU)")
    parser.add_argument("--pytest", action="store_true", help="also run the GPU-marked kernel tests at the end (budget permitting)")
    parser.add_argument("--wheels", type=Path, default=WHEEL_DIR, help="carried wheels for a bare image (default .device_wheels)")
    parser.add_argument("--out", type=Path, help="directory for gpu_check.json (default $OUT when set)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    global START
    START = time.monotonic()
    args = parse_args(argv)
    installed = ensure_wheels(args.wheels)
    ensure_project()
    import torch

    cuda_available = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda_available else "cpu")
    if args.device == "cuda":
        args.device = "cuda:0"  # build_engine calls torch.cuda.set_device, which needs an index
    cuda = args.device.startswith("cuda")
    if cuda and not cuda_available:
        raise SystemExit("gpu_check: --device cuda but no CUDA device is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    full = args.full_size or (cuda and not args.reduced)
    args.checkpoint = args.checkpoint or FAMILY_CHECKPOINTS[args.family][0 if full else 1]
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.family in ("lingbot_va", "zero_wam"):
        return lingbot_va_check(args, cuda, full)
    args.compile_backend = args.compile_backend or ("inductor" if cuda else "eager")
    if args.compile_estimate_s is None:
        args.compile_estimate_s = 240.0 if cuda else 30.0
    default_variants = "sdpa,flex,flex+graphs,flex+compile,flex+compile+graphs" if cuda else "sdpa,flex,flex+compile,flex+graphs"
    variants = [Variant(v.strip()) for v in (args.variants or default_variants).split(",") if v.strip()]
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[args.dtype]
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    deadline = START + args.budget_s if args.budget_s > 0 else None

    from bench_chunk import call_flops, matmul_rate
    from benchlib import ForeignLoad, contended

    from ardiff_policies.dreamzero.synthetic import parameter_bytes, release_cached_model, synthetic_model

    _, spec = kv_spec_for(args.checkpoint, args.dtype)
    args.view_size = spec.view_size
    dtype = getattr(torch, args.dtype)
    report: dict[str, Any] = {
        "check": "gpu_check",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "size": "full" if full else "reduced",
        "checkpoint": args.checkpoint,
        "model": spec.describe(),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "compile_backend": args.compile_backend,
        "wheels_installed": installed,
        "branches": 2,
        "anchors": {
            "vllm_omni_ms_one_h200": VLLM_OMNI_MS_ONE_GPU,
            "vllm_omni_ms_cfg_parallel_two_h200": VLLM_OMNI_MS_CFG_PARALLEL,
            "vllm_omni_gib_per_gpu": VLLM_OMNI_GIB_PER_GPU,
        },
        "variants": {},
        "skipped": {},
    }
    print(f"gpu_check: {report['device']}, torch {torch.__version__}, {args.dtype}, {args.checkpoint}: {spec.describe()}", flush=True)

    # peak rate for "fraction of peak"
    if cuda:
        measured = cuda_mm_rate(dtype)
        peak = (args.peak_tflops or H200_BF16_DENSE_TFLOPS) * 1e12
        report["flops"] = {
            "peak_tflops": peak / 1e12,
            "peak_source": "--peak-tflops" if args.peak_tflops else "H200 bf16 dense datasheet",
            "mm_tflops_measured": measured / 1e12,
        }
        log(f"torch.mm 8192^3 {args.dtype}: {measured / 1e12:.0f} TFLOP/s measured")
    else:
        measured = matmul_rate(dtype)
        peak = args.peak_tflops * 1e12 if args.peak_tflops else measured
        report["flops"] = {
            "peak_tflops": peak / 1e12,
            "peak_source": "--peak-tflops" if args.peak_tflops else "measured torch.mm 2048^2",
            "mm_tflops_measured": measured / 1e12,
        }
    steady = call_flops(spec.dit, window_start=False, start_frame_after=spec.dit.local_attn_size, denoise_forwards=8, branches=2)
    report["flops"] |= {"steady_chunk_tflop": steady / 1e12, "compute_bound_ms": steady / peak * 1e3}

    # materialize the synthetic model once; every variant's policy shares it
    t = time.monotonic()
    model = synthetic_model(args.checkpoint, dtype=dtype, device=args.device)
    report["materialize_s"] = time.monotonic() - t
    weights = parameter_bytes(model)
    report["weights_gib"] = {k: gib(v) for k, v in weights.items()}
    report["params_b"] = sum(sum(p.numel() for p in m.parameters()) for m in (model.dit, model.text_encoder, model.image_encoder, model.vae)) / 1e9
    del model
    log(f"synthetic model: {report['params_b']:.2f} B parameters, {gib(sum(weights.values())):.2f} GiB in {report['materialize_s']:.1f} s")
    # The server's memory plan for this engine, to hold against the measured peaks (calibrates its estimates).
    from ardiff_policies.dreamzero import memory

    budget = kv_budget_gib(kv_spec_for(args.checkpoint, args.dtype)[0], args.max_sessions)
    settings = memory.PlanSettings(args.device, dtype, max_sessions=args.max_sessions, kv_budget_gib=budget)
    plan = memory.plan_memory(memory.synthetic_geometry(args.checkpoint), settings).device(args.device)
    report["memory_plan_gib"] = {
        "weights": gib(sum(plan.weights.values())),
        "kv": gib(plan.kv.pool_bytes),
        "activations": gib(plan.activations),
        "reserve": gib(plan.reserve),
        "total": gib(plan.total),
    }
    log(f"memory plan: {report['memory_plan_gib']}")

    obs = observations(args.calls)
    load = ForeignLoad()
    reference = None
    durations: list[float] = []  # of the variants without torch.compile
    compiled_once = False
    for variant in variants:
        if variant.graphs and not cuda:
            report["skipped"][variant.name] = "CUDA graphs need a CUDA device"
            continue
        if deadline is not None and durations:
            # a variant costs about what the eager ones did (graphs: a second warm-up), plus the
            # first torch.compile of the blocks (later compile variants reuse dynamo's cache)
            estimate = max(durations[:2]) * (1.0 + 0.5 * variant.graphs)
            estimate += args.compile_estimate_s if variant.compile and not compiled_once else 0.0
            if time.monotonic() + estimate > deadline:
                report["skipped"][variant.name] = f"time budget: {deadline - time.monotonic():.0f} s left, needs ~{estimate:.0f} s"
                log(f"[{variant.name}] skipped: {report['skipped'][variant.name]}")
                continue
        log(f"[{variant.name}] starting")
        try:
            result = run_variant(args, variant, obs, deadline)
        except Exception as exc:  # report it and go on with the next variant
            import traceback

            result = {"status": f"failed: {type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}
            log(f"[{variant.name}] FAILED: {type(exc).__name__}: {exc}")
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        result["name"] = variant.name
        compiled_once |= variant.compile
        if result.get("status") == "ok":
            if not variant.compile:
                durations.append(result["total_s"])
            summarize(result, spec.dit, 2, peak)
            if reference is None:
                reference = result
            else:
                compare(result, reference, tolerance)
        report["variants"][variant.name] = result
        print_variant(result)
        _write(out_dir, report)

    if cuda and any(v.graphs for v in variants):  # the graphs' capture while serving, the encoder thread busy
        estimate = durations[0] if durations else 120.0
        if deadline is not None and time.monotonic() + estimate > deadline:
            report["skipped"]["capture_under_encoder"] = f"time budget: {deadline - time.monotonic():.0f} s left, needs ~{estimate:.0f} s"
        else:
            log("[capture under encoder] starting (flex+graphs, two sessions)")
            try:
                report["capture_under_encoder"] = run_capture_check(args, tolerance)
            except Exception as exc:  # report it and go on
                report["capture_under_encoder"] = {"status": f"failed: {type(exc).__name__}: {exc}"[:2000], "ok": False}
            check = report["capture_under_encoder"]
            print(
                f"\nCUDA-graph capture while the encoder thread works (capture_error_mode={check.get('capture_error_mode', '?')}): "
                f"{check['status']}; {check.get('graphs_captured_during', 0)} captured, encoder ran "
                f"{check.get('encoder_runs_during', 0)}x meanwhile",
                flush=True,
            )
        _write(out_dir, report)

    sizes = [int(b) for b in args.batches.split(",") if b.strip()]
    if sizes:
        if deadline is not None and time.monotonic() + 60 > deadline:
            report["skipped"]["batches"] = f"time budget: {deadline - time.monotonic():.0f} s left"
        else:
            log(f"[batches {sizes}] starting ({args.batch_variant})")
            try:
                report["batches"] = run_batches(args, Variant(args.batch_variant), sizes, args.batch_calls, deadline)
                print_batches(report["batches"])
            except Exception as exc:  # report it and finish the run
                report["batches"] = {"status": f"failed: {type(exc).__name__}: {exc}"[:2000]}
                log(f"[batches] FAILED: {type(exc).__name__}: {exc}")
            _write(out_dir, report)

    if args.pytest and cuda:
        remaining = (deadline - time.monotonic()) if deadline else 300.0
        if remaining > 60:
            report["pytest"] = run_gpu_tests(timeout=remaining - 10)
        else:
            report["skipped"]["pytest"] = f"time budget: {remaining:.0f} s left"
    report["elapsed_s"] = elapsed()
    report["foreign_load_cores"] = load.cores()
    report["contended"] = contended(report["foreign_load_cores"], torch.get_num_threads())
    release_cached_model()
    print_summary(report)
    _write(out_dir, report)
    if args.json:
        print(json.dumps(_public(report)))
    return report


def lingbot_va_check(args, cuda: bool, full: bool) -> dict[str, Any]:
    """LingBot-VA (or Zero-WAM, ``--family zero_wam``) through the engine: per session an OpenPI-wire episode of
    ``--calls`` chunks (the first frame, then each chunk's key frames committing it and predicting the next; Zero-WAM's
    first call names a demonstration at the bound, pinned with in-context guidance), then ``--batches`` sessions per
    engine step; ms per chunk, chunks/s, peak GPU memory beside the memory plan's figures."""
    import numpy as np
    import torch

    from ardiff_policies.lingbot_va.synthetic import parse_spec
    from ardiff_policies.observation import RobotObservation
    from ardiff_server.config import validate_config
    from ardiff_server.engine.builder import build_engine
    from ardiff_server.engine.messages import ErrorReply, Infer

    family = args.family
    name = args.embodiment or ("robotwin" if full or "released" in args.checkpoint else "tiny_robotwin")
    sizes = [int(b) for b in args.batches.split(",") if b.strip()] or [1]
    sessions = max(max(sizes), args.max_sessions)
    dtype = getattr(torch, args.dtype)
    spec = parse_spec(args.checkpoint)
    if family == "zero_wam":
        kv, plan, policy_section, first_call = zero_wam_setup(args, name, spec, dtype, sessions, max(sizes))
        budget = kv
    else:
        from ardiff_policies.lingbot_va.episode import kv_spec
        from ardiff_policies.lingbot_va.memory import plan as memory_plan
        from ardiff_policies.lingbot_va.policy import embodiment_by_name

        embodiment = embodiment_by_name(name)
        budget = kv_budget_gib(kv_spec(embodiment, spec.transformer, dtype), sessions, max_batch=max(sizes))
        # the memory plan models the released networks (UMT5-XXL, the Wan2.2 VAE): held against the peak at full size only
        plan = memory_plan(name, embodiment, dtype=dtype, max_batch=max(sizes), cfg=spec.transformer) if spec.preset == "released" else None
        policy_section, first_call = {"name": "lingbot_va", "checkpoint": args.checkpoint, "embodiment": name}, None
    raw = {
        "engine": {
            "device": args.device,
            "dtype": args.dtype,
            "max_sessions": sessions,
            "max_batch": max(sizes),
            "kv_budget_gib": budget,
            "warmup": False,
        },
        "policy": policy_section,
    }
    report: dict[str, Any] = {
        "check": "gpu_check",
        "family": family,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "size": "full" if full else "reduced",
        "checkpoint": args.checkpoint,
        "embodiment": name,
        "dtype": args.dtype,
        "kv_budget_gib": budget,
    }
    if plan is not None:
        report["memory_plan_gib"] = {
            "weights": gib(sum(plan.weights.values())),
            "kv_session": gib(plan.kv_session),
            "text_session": gib(plan.text_session),
            "kv_reserved": gib(plan.kv_reserved),
            "activations": gib(plan.activations),
            "reserve": gib(plan.reserve),
            "one_session": gib(plan.total()),
        }
    t = time.monotonic()
    engine = build_engine(validate_config(raw, source="gpu_check"))
    report["build_s"] = time.monotonic() - t
    policy = engine.policy
    log(f"{family} {args.checkpoint} ({name}) built in {report['build_s']:.1f} s; memory plan {report.get('memory_plan_gib')}")
    counts = (1, 4 * (policy.frames - 1), *[4 * policy.frames] * max(0, args.calls - 2))[: args.calls]
    rng = np.random.default_rng(0)
    ids = iter(range(1, 1_000_000))

    def chunk_observation(frames: int) -> RobotObservation:
        cams = {c: rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8) for c, (h, w) in zip(policy.cameras, policy.schema.resolutions)}
        return RobotObservation(cams, {}, PROMPT, episode=first_call if frames == 1 else None)

    def step(members: list[str], frames: int) -> float:
        started = time.perf_counter()
        replies = engine.run([Infer(next(ids), sid, chunk_observation(frames)) for sid in members])
        if cuda:
            torch.cuda.synchronize()
        for reply in replies:
            if isinstance(reply, ErrorReply):
                raise RuntimeError(reply.message)
            if not np.isfinite(reply.actions).all():
                raise RuntimeError("non-finite actions")
            if "guidance" in reply.info:  # zero_wam: how its episodes ran (in-context with the demonstration pinned)
                report["guidance"] = sorted({*report.get("guidance", ()), reply.info["guidance"]})
        return (time.perf_counter() - started) * 1000.0

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    episode = [step(["episode"], frames) for frames in counts]
    engine.end("episode", "gpu_check")
    steady = episode[2:] or episode[1:]
    report["episode"] = {
        "calls_ms": [round(ms, 1) for ms in episode],
        "first_ms": episode[0],
        "steady_median_ms": statistics.median(steady) if steady else None,
        "steady_p99_ms": percentile(steady, 99) if steady else None,
    }
    log(f"episode: {report['episode']}")
    report["batches"] = {}
    for size in sizes:
        members = [f"batch{size}-{k}" for k in range(size)]
        times = [step(members, frames) for frames in counts]
        for sid in members:
            engine.end(sid, "gpu_check")
        steady = times[2:] or times
        report["batches"][size] = {"steady_ms_per_step": statistics.median(steady), "chunks_per_s": size * 1000.0 / statistics.median(steady)}
        log(f"batch {size}: {report['batches'][size]}")
    if cuda:
        report["peak_gib"] = gib(torch.cuda.max_memory_allocated())
    if plan is not None:
        report["plan_at_peak_gib"] = gib(plan.fixed + max(sizes) * plan.per_session)
    report["elapsed_s"] = elapsed()
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    _write(out_dir, report)
    if args.json:
        print(json.dumps(report))
    return report


def zero_wam_setup(args, name: str, spec, dtype, sessions: int, max_batch: int):
    """``--family zero_wam``: its KV budget (what ``sessions`` reserve, scratch and undo headroom), its memory plan (the
    released networks only), its policy section with a demonstration root holding one demonstration at the bound (a
    seeded random latent: the reset's forward at full length), and the first call naming it (in-context guidance)."""
    import torch

    from ardiff_kv import PagedKVCache
    from ardiff_policies.episode import EpisodeCall, EpisodeStart
    from ardiff_policies.lingbot_va import zero_wam_memory
    from ardiff_policies.lingbot_va.synthetic import zero_wam_config
    from ardiff_policies.lingbot_va.zero_wam_episode import kv_spec
    from ardiff_policies.lingbot_va.zero_wam_policy import embodiment_by_name

    embodiment, demonstrations = embodiment_by_name(name)
    cfg = zero_wam_config(spec)
    served = kv_spec(embodiment, cfg, demonstrations, dtype)
    budget = PagedKVCache.bytes_for_sessions(served, max_sessions=sessions, num_branches=2, max_batch=max_batch) / 2**30
    geometry = zero_wam_memory.ZeroWAMGeometry(name, embodiment, demonstrations)
    plan = zero_wam_memory.plan(geometry, cfg=cfg, dtype=dtype, max_batch=max_batch) if spec.preset == "released" else None
    root = Path(tempfile.mkdtemp(prefix="gpu-check-demonstrations-"))
    h, w = demonstrations.latent_size
    latent = torch.randn(1, 48, demonstrations.max_frames, h, w, generator=torch.Generator().manual_seed(0))
    torch.save({"latent": latent, "text_emb": torch.randn(64, cfg.base.text_dim, generator=torch.Generator().manual_seed(1))}, root / "bound.pth")
    section = {"name": "zero_wam", "checkpoint": args.checkpoint, "embodiment": name, "demonstration_root": str(root)}
    return budget, plan, section, EpisodeCall("chunk", start=EpisodeStart(demonstration_id="bound", icl_guidance_scale=5.0))


def cuda_mm_rate(dtype, n: int = 8192, reps: int = 10) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    rate = 2 * n**3 * reps / (start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return rate


def run_gpu_tests(timeout: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "tests/kv/test_paged_attention.py",
        "tests/kv/test_flex_attention.py",
        "tests/kv/test_batched_forward.py",
    ]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"exit": None, "summary": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else proc.stderr[-500:]
    print(f"\n[gpu tests] exit {proc.returncode}: {summary}", flush=True)
    if proc.returncode:
        print(proc.stdout[-3000:], flush=True)
    return {"exit": proc.returncode, "summary": summary}


def _public(report: dict[str, Any]) -> dict[str, Any]:
    """The report without bulky per-call arrays (they stay in gpu_check.json)."""
    out = dict(report)
    out["variants"] = {
        name: {k: v for k, v in r.items() if k not in ("actions", "calls", "traceback", "_action_scale", "warmup_calls_ms")}
        for name, r in report["variants"].items()
    }
    return out


def _write(out_dir: Path | None, report: dict[str, Any]) -> None:
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps({**report, "elapsed_s": elapsed()}, indent=1))


if __name__ == "__main__":
    main()
