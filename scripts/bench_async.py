#!/usr/bin/env python
"""Asynchronous chunks on the trained tiny DreamZero: one table, one run.

A simulated robot (``ardiff_sim.tiny_task.SimulatedRobot``: it goes where its actions say, its cameras render its joints) runs
``AsyncChunkRunner`` at ``--hz`` against the policy in this process. Every reply takes exactly the injected
latency of the robot's simulated clock (``DelayedRequester``: a knob only a bench sets; the model's real CPU
time does not matter), so the schedule is deterministic; each reply says that latency as the server's estimate of
the next call (``server_timing.next_call_p90_ms``: a server whose every call takes exactly L). Rows: blocking /
async without continuation / ``inpaint`` / ``clean_prefix`` / ``guided`` x asking (``half``: at half the chunk;
``adaptive``: as late as the estimate allows, ``AsyncChunkRunner(asking=...)``) x latency. Columns: control steps
the robot stood still per chunk, calls per chunk's worth of actions executed, the seam
jump (median joint change across a splice), the median step inside a chunk, their ratio, the step the old chunk itself
took where it was left (a continuation that followed it exactly would show that as its seam), chunks per second, and
the splices whose new chunk restarted the KV window (``window_restart``: every 4th-5th call) with their seam / inner
step apart (the whole-episode column counts them too; issue #35's goal: <= 2x over a whole episode, restarts included).

    .venv/bin/python scripts/bench_async.py                   # trains the tiny task model on first use (1500 steps, cached)
    .venv/bin/python scripts/bench_async.py --latencies 0.3,0.9 --steps 240
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from ardiff_client.async_runner import ASKING, AsyncChunkRunner, DelayedRequester, SimulatedClock
from ardiff_kv import PagedKVCache
from ardiff_policies.dreamzero.model import DreamZeroModel
from ardiff_policies.dreamzero.policy import DreamZeroPolicy
from ardiff_server.wire.decode import decode_request
from ardiff_sim import tiny_task
from ardiff_sim.task_model import BENCH_STEPS, DEFAULT_STEPS, ensure_task_checkpoint, task_policy

# The bench's task model trains longer than the script's few-minute default: at 600 steps the chunks carry a per-row
# jitter about twice the expert's step, and a seam can be no smoother than the chunk it continues (docs/performance.md).
ROWS = (
    ("blocking", "blocking", None),
    ("async, no continuation", "async", None),
    ("inpaint", "continuation", "inpaint"),
    ("clean_prefix", "continuation", "clean_prefix"),
    ("guided", "continuation", "guided"),
)


def episode(
    policy: DreamZeroPolicy, cache: PagedKVCache, mode: str, asking: str, latency: float, hz: float, steps: int, seed: int, overlap: float
) -> dict:
    rng = np.random.default_rng(seed)
    robot = tiny_task.SimulatedRobot(tiny_task.random_state(rng))
    session_id = f"{mode}-{latency}-{seed}"
    session = policy.start_session(session_id, cache.open_session(session_id))

    restarts: list[bool] = []  # per reply, in order: its call restarted the KV window

    def infer(request: dict) -> dict:
        observation = decode_request(request).observation
        policy.check_observation(observation)
        result = policy.step(session, observation)
        restarts.append(bool(result.info.get("window_restart")))
        chunk = result.chunk
        top = {"chunk_id": chunk.chunk_id, "frozen": chunk.frozen, "continuation": chunk.continuation}
        return {"actions": result.actions, "server_timing": {"next_call_p90_ms": latency * 1000.0}, **{k: v for k, v in top.items() if v is not None}}

    clock = SimulatedClock()
    runner = AsyncChunkRunner(
        DelayedRequester(infer, clock, latency),
        control_hz=hz,
        prompt=tiny_task.PROMPT,
        mode=mode,
        asking=asking,
        overlap=overlap,
        session_id=session_id,
        joint_columns=list(range(7)),
        clock=clock,
        sleep=clock.sleep,
    )
    report = runner.run(robot.observe, robot.act, steps)
    policy.end_session(session)
    cache.end_session(session.kv)
    summary = report.summary()
    summary["frozen_mean"] = float(np.mean(report.frozen[1:])) if len(report.frozen) > 1 else 0.0
    # every reply the robot used after its first is one splice (a last reply still in flight is not used)
    spliced = restarts[1 : report.chunks]
    if len(spliced) != len(report.seam_jumps):
        raise RuntimeError(f"{len(report.seam_jumps)} splices for {len(spliced)} replies after the first")
    at_restarts = [seam for seam, restart in zip(report.seam_jumps, spliced) if restart]
    summary["restarts"] = len(at_restarts)
    summary["restart_seam_ratio"] = float(np.median(at_restarts) / summary["median_inner_step"]) if at_restarts else float("nan")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latencies", default="0.3,0.8", help="injected per-call latency in seconds, comma separated (default 0.3,0.8)")
    parser.add_argument("--hz", type=float, default=15.0, help="control rate (default 15: a 24-action chunk lasts 1.6 s)")
    parser.add_argument("--steps", type=int, default=180, help="control steps per episode (default 180)")
    parser.add_argument(
        "--overlap", type=float, default=0.5, help="async modes ask no later than when this fraction of a chunk is left (default 0.5, the runner's)"
    )
    parser.add_argument(
        "--rows", default="", help=f"rows to run, comma separated, of {[policy_mode or mode for _, mode, policy_mode in ROWS]} (default all)"
    )
    parser.add_argument("--asking", default="half,adaptive", help="asking modes of the async rows, comma separated (default half,adaptive)")
    parser.add_argument("--episodes", type=int, default=1, help="episodes per row (different start states)")
    parser.add_argument(
        "--train-steps",
        type=int,
        default=BENCH_STEPS,
        help=f"training steps of the task model (cached per value; default {BENCH_STEPS}, the script's own {DEFAULT_STEPS})",
    )
    parser.add_argument("--checkpoint", type=Path, help="a trained task checkpoint (default: train / use the cached one)")
    args = parser.parse_args()
    started = time.perf_counter()
    checkpoint = args.checkpoint or ensure_task_checkpoint(args.train_steps, log=lambda line: print(line, file=sys.stderr, flush=True))
    model = DreamZeroModel.load(checkpoint)
    policies = {mode: task_policy(model, checkpoint, mode) for mode in ("inpaint", "clean_prefix", "guided")}
    latencies = [float(v) for v in args.latencies.split(",")]
    asking_modes = [a for a in args.asking.split(",") if a]
    wanted = [r for r in args.rows.split(",") if r]
    rows = [row for row in ROWS if not wanted or (row[2] or row[1]) in wanted]
    if wanted and len(rows) != len(wanted):
        parser.error(f"--rows: expected some of {[policy_mode or mode for _, mode, policy_mode in ROWS]}, got {args.rows!r}")
    for name in asking_modes:
        if name not in ASKING:
            parser.error(f"--asking: expected some of {list(ASKING)}, got {name!r}")
    print(
        f"checkpoint {checkpoint}; {args.hz:g} Hz, 24-action chunks ({24 / args.hz:.2f} s), {args.steps} steps x {args.episodes} episode(s), overlap {args.overlap:g}\n"
    )
    print(
        "| mode | asking | latency (s) | idle steps / chunk | steady idle / chunk | calls / chunk | asked at (left) | seam jump | inner step | "
        "seam / inner | old step there | chunks/s | frozen | window restarts | seam / inner at restarts |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for latency in latencies:
        for (name, mode, policy_mode), asking in [(row, a) for row in rows for a in (["-"] if row[1] == "blocking" else asking_modes)]:
            policy, cache = policies[policy_mode or "inpaint"]
            runner_asking = "half" if asking == "-" else asking
            runs = [episode(policy, cache, mode, runner_asking, latency, args.hz, args.steps, seed, args.overlap) for seed in range(args.episodes)]
            keys = (
                "idle_steps_per_chunk",
                "calls_per_chunk",
                "asked_left_median",
                "steady_idle_per_chunk",
                "seam_jump",
                "median_inner_step",
                "seam_ratio",
                "old_step_at_seam",
                "chunks_per_s",
                "frozen_mean",
                "restarts",
                "restart_seam_ratio",
            )
            # an episode with no window restart has no seam there (NaN): the others' mean
            mean = {k: float(np.nanmean(values)) if np.isfinite(values := [r[k] for r in runs]).any() else float("nan") for k in keys}
            print(
                f"| {name} | {asking} | {latency:g} | {mean['idle_steps_per_chunk']:.1f} | {mean['steady_idle_per_chunk']:.1f} | "
                f"{mean['calls_per_chunk']:.2f} | {mean['asked_left_median']:.0f} | {mean['seam_jump']:.4f} | "
                f"{mean['median_inner_step']:.4f} | {mean['seam_ratio']:.2f} | {mean['old_step_at_seam']:.4f} | {mean['chunks_per_s']:.2f} | {mean['frozen_mean']:.1f} | "
                f"{mean['restarts']:.1f} | {mean['restart_seam_ratio']:.2f} |",
                flush=True,
            )
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
