#!/usr/bin/env python
"""Several robots on one replica: batched engine steps vs one robot per step.

    python scripts/bench_batch.py            # about 5 minutes on 2 cores
    python scripts/bench_batch.py --quick    # smoke run
    python scripts/bench_batch.py --json     # last stdout line: one JSON object

The embedded tiny DreamZero (configs/tiny.yaml: VAE, DiT, paged KV, both CFG branches) served by
``ardiff-serve`` on ONE replica, twice, side by side in one run: ``engine.max_batch: 1`` (every
robot's chunk is its own engine step, the robots queue) and ``engine.max_batch: N`` (the requests
waiting together run as one batched step: one VAE encode, one prefill forward, one forward per
denoise step for every session x CFG branch). Each robot is the real openpi client in its own
process with its own session, sending 4-frame stacks back to back; reported over all measured
calls: calls per second (all robots together), the round-trip latency a robot sees (p50 / p99),
and the mean batch size the replies report. Goal (issue 21): >= 1.8x calls/s at 4 robots with a
p50 no worse than unbatched at 4 robots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context

from benchlib import ForeignLoad, RobotsResult, ServerSubprocess, measure_robots


def table(results: list[RobotsResult]) -> str:
    head = f"{'robots':>6} {'max_batch':>9} {'calls':>5} {'calls/s':>8} {'vs b=1':>7} {'p50 ms':>8} {'p99 ms':>8} {'p50 vs b=1':>10} {'batch':>6}"
    lines = [head, "-" * len(head)]
    base = {r.robots: r for r in results if r.label == "1"}
    for r in sorted(results, key=lambda r: (r.robots, int(r.label))):
        ref = base.get(r.robots)
        speed = r.calls_per_s / ref.calls_per_s if ref else float("nan")
        p50 = r.latency_p50_ms / ref.latency_p50_ms if ref else float("nan")
        lines.append(
            f"{r.robots:>6} {r.label:>9} {r.calls:>5} {r.calls_per_s:>8.2f} {speed:>6.2f}x {r.latency_p50_ms:>8.1f} "
            f"{r.latency_p99_ms:>8.1f} {p50:>9.2f}x {r.mean_batch:>6.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--robots", default="1,2,4,8")
    parser.add_argument("--max-batch", default="1,8", help="engine.max_batch values to compare (default 1,8)")
    parser.add_argument("--calls", type=int, default=10, help="measured calls per robot (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured calls per robot first (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine (default 1)")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.warmup, args.robots = 3, 2, "1,4"
    robot_counts = [int(x) for x in args.robots.split(",")]
    results: list[RobotsResult] = []
    load = ForeignLoad()
    started = time.perf_counter()
    ctx = get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=max(robot_counts), mp_context=ctx) as pool:
        for max_batch in [int(x) for x in args.max_batch.split(",")]:
            argv = [sys.executable, "-m", "ardiff_server", "--config", args.config, "--port", "0", "--log-level", "WARNING",
                    "--set", f"engine.max_batch={max_batch}", "--set", f"engine.threads={args.threads}",
                    "--set", f"engine.max_sessions={max(8, max(robot_counts))}"]  # fmt: skip
            with ServerSubprocess(f"max_batch={max_batch}", argv) as server:
                for robots in robot_counts:
                    result = measure_robots(pool, manager, server.port, str(max_batch), robots, args.warmup, args.calls)
                    print(f"  max_batch {max_batch}, {robots} robot(s): {result.calls_per_s:.2f} calls/s, "
                          f"p50 {result.latency_p50_ms:.0f} ms, mean batch {result.mean_batch:.2f}", file=sys.stderr, flush=True)  # fmt: skip
                    results.append(result)
    foreign = load.cores()
    print(f"\n{args.config} DreamZero, one replica, {args.threads} torch thread(s), {os.cpu_count()} CPU cores, "
          f"{time.perf_counter() - started:.0f} s; other processes used {foreign or 0:.2f} cores meanwhile\n")  # fmt: skip
    print(table(results))
    if args.json:
        print(json.dumps({"cpu_cores": os.cpu_count(), "foreign_cores": foreign, "results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
