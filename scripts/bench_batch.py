#!/usr/bin/env python
"""Several robots on one replica: batched engine steps vs one robot per step.

    python scripts/bench_batch.py            # about 5 minutes on 2 cores
    python scripts/bench_batch.py --quick    # smoke run
    python scripts/bench_batch.py --json     # last stdout line: one JSON object
    python scripts/bench_batch.py --engines 1,8,8@50   # max_batch[@batch_wait_ms] per server

The embedded tiny DreamZero (configs/tiny.yaml: VAE, DiT, paged KV, both CFG branches) served by
``ardiff-serve`` on ONE replica, once per engine setting, side by side in one run: ``engine.max_batch: 1`` (every
robot's chunk is its own engine step, the robots queue) and ``engine.max_batch: N`` (the requests
waiting together run as one batched step: one VAE encode, one prefill forward, one forward per
denoise step for every session x CFG branch). Each robot is the real openpi client in its own
process with its own session, sending 4-frame stacks back to back; reported over all measured
calls: calls per second (all robots together), the round-trip latency a robot sees (p50 / p99),
and the mean batch size the replies report. Goal (issue 21): >= 1.8x calls/s at 4 robots with a
p50 no worse than unbatched at 4 robots. ``8@50`` is ``max_batch: 8`` with ``batch_wait_ms: 50``:
a partial batch waits up to 50 ms for the robots whose replies just went out.

A second table (``--engine-only``, on by default) takes the server, the sockets and the robot
processes out: the same policy in this process, N sessions stepped through whole windows (window
restarts included) one after another (``Policy.step``) vs as one batch (``Policy.step_batch``).
Its ratio is what batching saves in the engine itself; the first table adds what a 2-core machine
shared by the front end and N robot processes leaves of it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict

from benchlib import RobotsResult, robots_per_server


def table(results: list[RobotsResult]) -> str:
    head = f"{'robots':>6} {'engine':>9} {'calls':>5} {'calls/s':>8} {'vs b=1':>7} {'p50 ms':>8} {'p99 ms':>8} {'p50 vs b=1':>10} {'batch':>6}"
    lines = [head, "-" * len(head)]
    baseline = results[0].label if results else "1"
    base = {r.robots: r for r in results if r.label == baseline}
    order = {label: i for i, label in enumerate(dict.fromkeys(r.label for r in results))}
    for r in sorted(results, key=lambda r: (r.robots, order[r.label])):
        ref = base.get(r.robots)
        speed = r.calls_per_s / ref.calls_per_s if ref else float("nan")
        p50 = r.latency_p50_ms / ref.latency_p50_ms if ref else float("nan")
        lines.append(
            f"{r.robots:>6} {r.label:>9} {r.calls:>5} {r.calls_per_s:>8.2f} {speed:>6.2f}x {r.latency_p50_ms:>8.1f} "
            f"{r.latency_p99_ms:>8.1f} {p50:>9.2f}x {r.mean_batch:>6.2f}"
        )
    return "\n".join(lines)


def engine_only(config: str, robot_counts: list[int], calls: int, threads: int) -> str:
    """calls/s of N sessions stepped alone vs batched, in this process (see the module docstring)."""
    import numpy as np
    import torch

    from ardiff_kv import PagedKVCache
    from ardiff_policies.base import RuntimeOptions, build_policy
    from ardiff_policies.observation import RobotObservation
    from ardiff_server.config import load_config

    torch.set_num_threads(threads)
    app = load_config(config)
    policy = build_policy(app.policy_name, app.policy_options(), RuntimeOptions())
    spec, top = policy.kv_spec(), max(robot_counts)
    cache = PagedKVCache(
        spec, num_pages=2 * top * len(policy.branches) * spec.pages_per_branch + 1, max_sessions=2 * top, branches=policy.branches, max_batch=top
    )
    rng = np.random.default_rng(0)
    frames = {n: rng.integers(0, 256, (n, 180, 320, 3), dtype=np.uint8) for n in (1, 4)}

    def observation(call: int) -> RobotObservation:
        f = frames[1 if call == 0 else 4]
        return RobotObservation(
            exterior_left=f,
            exterior_right=f,
            wrist=f,
            joint_position=np.zeros(7, np.float32),
            gripper_position=np.zeros(1, np.float32),
            prompt="pick up the cup",
        )

    def run(robots: int, batched: bool) -> float:
        sessions = [policy.start_session(f"{batched}-{i}", cache.open_session(f"{batched}-{i}")) for i in range(robots)]
        policy.step_batch([(s, observation(0)) for s in sessions])  # the first call: not measured
        started = time.perf_counter()
        for call in range(1, calls + 1):
            items = [(s, observation(call)) for s in sessions]
            results = policy.step_batch(items) if batched else [policy.step(s, o) for s, o in items]
            assert not any(isinstance(r, BaseException) for r in results), results
        elapsed = time.perf_counter() - started
        for s in sessions:
            cache.end_session(s.kv)
        return robots * calls / elapsed

    lines = [f"{'robots':>6} {'alone calls/s':>13} {'batched calls/s':>15} {'batched vs alone':>16}", "-" * 53]
    for robots in robot_counts:
        alone, batched = run(robots, False), run(robots, True)
        lines.append(f"{robots:>6} {alone:>13.2f} {batched:>15.2f} {batched / alone:>15.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--robots", default="1,2,4,8")
    parser.add_argument("--engines", default="1,8,8@50", help="max_batch[@batch_wait_ms] per server, the first is the baseline (default 1,8,8@50)")
    parser.add_argument("--calls", type=int, default=10, help="measured calls per robot (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured calls per robot first (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine (default 1)")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-engine-only", dest="engine_only", action="store_false", help="skip the in-process table")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.warmup, args.robots = 3, 2, "1,4"
    robot_counts = [int(x) for x in args.robots.split(",")]
    servers = []
    for label in args.engines.split(","):
        max_batch, _, wait_ms = label.partition("@")
        servers.append(
            (
                label,
                [
                    f"engine.max_batch={max_batch}",
                    f"engine.batch_wait_ms={wait_ms or 0}",
                    f"engine.threads={args.threads}",
                    f"engine.max_sessions={max(8, max(robot_counts))}",
                ],
            )
        )
    results, foreign, elapsed = robots_per_server(args.config, servers, robot_counts, args.warmup, args.calls)
    print(
        f"\n{args.config} DreamZero, one replica, {args.threads} torch thread(s), {os.cpu_count()} CPU cores, "
        f"{elapsed:.0f} s; other processes used {foreign or 0:.2f} cores meanwhile\n"
    )
    print(table(results))
    if args.engine_only:
        print(f"\nengine only ({args.config}, this process, {args.threads} torch thread(s), {args.calls} calls per session after the first):\n")
        print(engine_only(args.config, robot_counts, args.calls, args.threads))
    if args.json:
        print(json.dumps({"cpu_cores": os.cpu_count(), "foreign_cores": foreign, "results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
