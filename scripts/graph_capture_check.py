"""gpu_check's check of CUDA-graph capture while the encoder thread works (``engine.cuda_graphs``).

A denoise graph is keyed on the session's cross-attention slot (policies/dreamzero/cuda_graphs.py),
so a session that arrives while others are served captures its graphs then, while the engine's
encoder thread may be running CUDA work on its own stream (``InputEncoder.prepare``: CLIP, the VAE,
the text encoder, then a stream synchronize). Under CUDA's default ``global`` capture mode such a
call from another thread can invalidate the capture, and graphs then stay off for good.

The check, on a fresh engine with CUDA graphs and room for two sessions (not warmed up, so no slot
has graphs yet): one session holds a slot and is served its calls (capturing that slot's graphs and
warming up); then, while a thread runs the encoder's ``prepare`` in a loop, a new session (the other
slot) is served the same observations, capturing its graphs.
It passes when those captures happened and succeeded (graphs still on), the encoder ran during
them, and the new session's actions equal the first session's (in normalized action units).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


def capture_under_encoder(engine, observations: list, *, tolerance: float) -> dict[str, Any]:
    """Run the check on ``engine`` (its policy's ``graphs`` set) with a session's first ``observations``."""
    from ardiff_policies.dreamzero.embodiments import embodiment_prompt

    policy = engine.policy
    graphs = policy.graphs
    if graphs is None:
        return {"status": "failed: the policy has no CUDA graphs (engine.cuda_graphs off)", "ok": False}
    held = [np.asarray(engine.infer("capture-held", o).result.actions, np.float64) for o in observations]
    captured_before = len(graphs.graphs)

    stop, running = threading.Event(), threading.Event()
    runs, errors = [0], []
    prompt = embodiment_prompt(policy.embodiment, observations[0].prompt)

    def encoder() -> None:  # what the engine's encoder thread runs for a window start, over and over
        try:
            while not stop.is_set():
                policy.inputs.prepare(observations[0], prompt, text=True, negative=False, window_start=True)
                runs[0] += 1
                running.set()
        except BaseException as exc:  # reported below
            errors.append(f"{type(exc).__name__}: {exc}")
            running.set()

    thread = threading.Thread(target=encoder, name="capture-check-encoder", daemon=True)
    thread.start()
    try:
        running.wait(timeout=120)
        runs_before = runs[0]
        new = [np.asarray(engine.infer("capture-new", o).result.actions, np.float64) for o in observations]
        runs_during = runs[0] - runs_before
    finally:
        stop.set()
        thread.join(timeout=120)
        for session_id in ("capture-held", "capture-new"):
            engine.end(session_id, "gpu_check")
    stats = policy.action_stats
    scale = (np.asarray(stats.q99, np.float64) - np.asarray(stats.q01, np.float64)) / 2.0
    scale = np.where(scale > 0, scale, 1.0)
    differences = [np.abs(a - b)[:, : scale.size] / scale for a, b in zip(held, new)]
    result = {
        "graphs_captured_during": len(graphs.graphs) - captured_before,
        "capture_failed": bool(graphs.failed),
        "encoder_runs_during": runs_during,
        "encoder_errors": errors,
        "max_abs_normalized_vs_held": float(max(d.max() for d in differences)),
        "tolerance_normalized": tolerance,
        "actions_finite": bool(all(np.isfinite(a).all() for a in new)),
    }
    problems = [
        *(["a capture failed: graphs are off"] if result["capture_failed"] else []),
        *(["the new session captured no graph"] if result["graphs_captured_during"] == 0 else []),
        *(["the encoder did not run during the captures"] if runs_during == 0 else []),
        *([f"the encoder thread failed: {errors[0]}"] if errors else []),
        *(["actions differ from the first session's"] if result["max_abs_normalized_vs_held"] > tolerance else []),
        *(["actions not finite"] if not result["actions_finite"] else []),
    ]
    result["ok"] = not problems
    result["status"] = "ok" if not problems else "failed: " + "; ".join(problems)
    return result
