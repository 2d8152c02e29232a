#!/usr/bin/env python
"""Throughput with engine replicas: robots/s and latency for 1, 2, 4 robots on 1 vs 2 replicas.

    python scripts/bench_replicas.py            # about 3 minutes on 2 cores
    python scripts/bench_replicas.py --quick    # smoke run
    python scripts/bench_replicas.py --json     # last stdout line: one JSON object

The embedded tiny DreamZero (configs/tiny.yaml, real compute: VAE, DiT, paged KV, both CFG
branches) served by ``ardiff-serve`` with ``engine.replicas`` 1 and 2, one torch thread per
replica. Each robot is the real openpi client in its own process, with its own session: the
first call of an episode sends one frame per camera, later calls 4-frame stacks, as DreamZero's
client does. All robots start together after a warm-up; reported over all measured calls:
calls per second (all robots together) and the round-trip latency a robot sees (p50 / p99).
With one replica the robots queue for one engine; with two, sessions are spread over both and
run in parallel, so at 2+ robots throughput should approach 2x on a machine with 2 free cores.

``--recording`` instead compares one robot's latency with ``--record DIR`` off and on (one
replica, ``--gap-ms`` between calls: a robot executing its chunk; 0 is the hardest case, every
request arriving while the previous chunk's decode runs): the recorder decodes and writes on its
own thread, so the round trip and ``server_timing.queue_ms`` should not grow; the calls the
recording holds (``timings.json``, warm-up calls included) and of those the ones whose prediction
was decoded (the rest were written without it at shutdown) are counted too.

    python scripts/bench_replicas.py --recording --gap-ms 0 --calls 24
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchlib import RobotsResult, ServerSubprocess, openpi_robot, percentile, robots_per_server


def table(results: list[RobotsResult]) -> str:
    head = f"{'robots':>6} {'replicas':>8} {'calls':>5} {'calls/s':>8} {'vs 1 rep':>8} {'p50 ms':>8} {'p99 ms':>8}  replica per robot"
    lines = [head, "-" * len(head)]
    base = {r.robots: r.calls_per_s for r in results if r.label == "1"}
    for r in sorted(results, key=lambda r: (r.robots, int(r.label))):
        ratio = r.calls_per_s / base[r.robots] if r.robots in base else float("nan")
        lines.append(
            f"{r.robots:>6} {r.label:>8} {r.calls:>5} {r.calls_per_s:>8.2f} {ratio:>7.2f}x "
            f"{r.latency_p50_ms:>8.1f} {r.latency_p99_ms:>8.1f}  {r.spread}"
        )
    return "\n".join(lines)


def recording(pool, manager, args) -> list[dict[str, Any]]:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="ardiff-bench-record-") as folder:
        for record in (False, True):
            argv = [
                sys.executable,
                "-m",
                "ardiff_server",
                "--config",
                args.config,
                "--port",
                "0",
                "--log-level",
                "WARNING",
                "--set",
                "engine.threads=1",
            ] + (["--record", folder] if record else [])
            with ServerSubprocess(f"record={record}", argv) as server:
                barrier = manager.Barrier(2)
                future = pool.submit(openpi_robot, server.port, 0, args.warmup, args.calls, barrier, args.gap_ms)
                barrier.wait(timeout=600)
                run = future.result(timeout=1800)
            latency = run["latency_ms"]
            rows.append(
                {
                    "recording": record,
                    "calls": len(latency),
                    "p50_ms": statistics.median(latency),
                    "p99_ms": percentile(latency, 99),
                    "queue_p50_ms": statistics.median(run["queue_ms"]),
                }
            )
            print(f"  recording {'on' if record else 'off'}: p50 {rows[-1]['p50_ms']:.0f} ms", file=sys.stderr, flush=True)
        written = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
        calls = [c for f in Path(folder).glob("*/timings.json") for c in json.loads(f.read_text())["calls"]]
    for row in rows:
        row["bytes_written"] = written if row["recording"] else 0
        row["recorded_calls"] = len(calls) if row["recording"] else 0  # warm-up calls included
        row["decoded_calls"] = sum(c.get("prediction_decoded", True) for c in calls) if row["recording"] else 0
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--robots", default="1,2,4")
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--calls", type=int, default=12, help="measured calls per robot (default 12)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured calls per robot first (default 3)")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--recording", action="store_true", help="instead: reply latency with --record off vs on")
    parser.add_argument("--gap-ms", type=float, default=500.0, help="--recording: pause between a robot's calls (default 500)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.warmup = 3, 2
    if args.recording:
        ctx = get_context("spawn")
        with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            rows = recording(pool, manager, args)
        print(f"\n{args.config} DreamZero, 1 replica, 1 robot, {args.gap_ms:.0f} ms between calls; round trip and server_timing.queue_ms\n")
        print(f"{'recording':>9} {'calls':>5} {'p50 ms':>8} {'p99 ms':>8} {'queue p50':>9} {'recorded':>8} {'decoded':>7} {'MiB written':>12}")
        for r in rows:
            print(
                f"{'on' if r['recording'] else 'off':>9} {r['calls']:>5} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['queue_p50_ms']:>9.1f} "
                f"{r['recorded_calls']:>8} {r['decoded_calls']:>7} {r['bytes_written'] / 2**20:>12.1f}"
            )
        off, on = (next(r for r in rows if r["recording"] is flag) for flag in (False, True))
        print(f"\np50 with recording / without: {on['p50_ms'] / off['p50_ms']:.2f}x")
        if args.json:
            print(json.dumps({"recording": rows}))
        return 0
    robot_counts = [int(x) for x in args.robots.split(",")]
    replica_counts = [int(x) for x in args.replicas.split(",")]
    servers = [
        (str(replicas), [f"engine.replicas={replicas}", "engine.threads=1", "engine.max_sessions=8", "engine.max_batch=1"])
        for replicas in replica_counts
    ]
    results, foreign, elapsed = robots_per_server(args.config, servers, robot_counts, args.warmup, args.calls)
    print(
        f"\n{args.config} DreamZero, 1 torch thread per replica, {os.cpu_count()} CPU cores, "
        f"{elapsed:.0f} s; other processes used {foreign or 0:.2f} cores meanwhile\n"
    )
    print(table(results))
    if args.json:
        print(json.dumps({"cpu_cores": os.cpu_count(), "foreign_cores": foreign, "results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
