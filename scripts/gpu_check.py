#!/usr/bin/env python
"""One prepared run of every GPU-only path, against the CPU/sdpa reference, with timings.

For a session that has a GPU: ``python scripts/gpu_check.py [--json]`` (a few minutes).

1. the GPU-marked tests (paged attention on CUDA, flash vs sdpa at page size 880);
2. the tiny DreamZero on CUDA three ways - sdpa eager, flash eager, flash + CUDA graphs -
   compared with the CPU float32 actions, with per-call latency;
3. paged (flash) vs concat-and-slice self-attention at DROID geometry in bf16.

NCCL CFG-parallel needs two GPUs (``--set engine.cfg_parallel_size=2`` with
``configs/dreamzero_droid_cfg2.yaml``); with one GPU it is skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
import torch


def run_gpu_tests() -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"], capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    print(f"[gpu tests] exit {proc.returncode}: {tail}", file=sys.stderr)
    return {"gpu_tests_exit": proc.returncode, "gpu_tests_summary": tail}


def tiny_dreamzero(device: str, backend: str, graphs: bool, calls: int = 6) -> tuple[list[np.ndarray], list[float]]:
    from kv import PagedKVCache
    from policies.base import RuntimeOptions
    from policies.dreamzero.policy import DreamZeroConfig, DreamZeroPolicy
    from policies.observation import RobotObservation

    policy = DreamZeroPolicy(DreamZeroConfig(view_size=(48, 80)), RuntimeOptions(device=device, cuda_graphs=graphs))
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1, device=device, attention_backend=backend)
    session = policy.start_session("check", cache.open_session("check"))
    rng = np.random.default_rng(0)
    actions, latency = [], []
    for call in range(calls):
        t = 1 if call == 0 else 4
        cam = rng.integers(0, 256, (t, 180, 320, 3), dtype=np.uint8)
        obs = RobotObservation(exterior_left=cam, exterior_right=cam, wrist=cam, joint_position=np.zeros(7, np.float32),
                               gripper_position=np.zeros(1, np.float32), prompt="pick up the cup")  # fmt: skip
        start = time.perf_counter()
        actions.append(policy.step(session, obs).actions)
        latency.append((time.perf_counter() - start) * 1000)
    return actions, latency


def compare_dreamzero() -> dict:
    reference, cpu_ms = tiny_dreamzero("cpu", "sdpa", graphs=False)
    out = {"cpu_ms_per_call": float(np.median(cpu_ms[1:]))}
    for name, backend, graphs in (("cuda_sdpa", "sdpa", False), ("cuda_flash", "flash", False), ("cuda_flash_graphs", "auto", True)):
        try:
            actions, ms = tiny_dreamzero("cuda", backend, graphs)
        except Exception as exc:  # report, keep going
            out[name] = f"failed: {type(exc).__name__}: {exc}"
            continue
        err = max(float(np.abs(a - r).max()) for a, r in zip(actions, reference))
        out[name] = {"max_abs_vs_cpu": err, "ms_per_call": float(np.median(ms[1:]))}
        print(f"[dreamzero tiny] {name}: max |a - a_cpu| = {err:.2e}, {np.median(ms[1:]):.1f} ms/call", file=sys.stderr)
    return out


def paged_vs_concat_bf16() -> dict:
    proc = subprocess.run([sys.executable, "scripts/bench_kv.py", "--json", "--quick"], capture_output=True, text=True)
    try:
        return {"bench_kv": json.loads(proc.stdout.strip().splitlines()[-1])}
    except Exception:
        return {"bench_kv": f"failed: {proc.stderr[-500:]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (the CPU suite covers the reference paths)")
        return
    results = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}
    results |= run_gpu_tests()
    results |= compare_dreamzero()
    results |= paged_vs_concat_bf16()
    if results["gpus"] < 2:
        results["nccl_cfg_parallel"] = "skipped: needs two GPUs"
    print(json.dumps(results) if args.json else json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
