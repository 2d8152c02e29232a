#!/usr/bin/env python
"""Server overhead and throughput: ardiff-server vs openpi's reference server design.

    python scripts/bench_server.py                  # full run (about 2 minutes on 2 cores)
    python scripts/bench_server.py --quick          # smoke run, < 60 s
    python scripts/bench_server.py --json           # last stdout line: one JSON object

Both servers run the same trivial policy - zeros (24, 8) actions after an optional simulated
compute of ``--compute-ms`` (a sleep, which blocks its thread like real compute would):

* **ours**: ``python -m ardiff_server --config noop --set policy.compute_ms=X`` (the event loop
  decodes and validates; the policy runs in the spawned worker process, behind a pipe);
* **reference**: a minimal copy, inside this script, of openpi's
  ``src/openpi/serving/websocket_policy_server.py``: metadata on connect, then recv ->
  ``msgpack_numpy.unpackb`` -> ``policy.infer(obs)`` directly on the event loop -> pack -> send,
  with ``server_timing = {infer_ms, prev_total_ms}``;
* **front-only** (compute 0 only; ``--no-front-only`` skips it): our ``PolicyServer`` with an
  engine that answers on its event loop, so ``ours`` minus ``front-only`` is the process hop.

Each of 1, 4, 16 clients is the real synchronous openpi ``WebsocketClientPolicy`` in its own
**process** (a ``ProcessPoolExecutor``, spawned once and reused). Processes rather than threads:
the client is blocking, and 16 clients plus websockets' per-connection reader threads in one
interpreter would share one GIL, so one client's packing/masking of its 0.5 MB request would
delay another's receive timestamp - client-side contention that is not the server's overhead.
(Robots are separate machines; separate processes are the closer model. On a small machine the
clients still share the CPU cores with both server processes; the table says how many cores.)

Every request is a realistic DROID observation: three 180x320x3 uint8 cameras (one frame),
joint and gripper state, a prompt and a per-client ``session_id``. Reported per server and
client count, over all measured requests of all clients:

* overhead = client-observed round trip minus the policy's compute as the reply reports it
  (``server_timing.infer_ms``: the policy step for both servers) - median and p99. With several
  clients it includes waiting behind other clients' requests (both servers run one policy step
  at a time), i.e. what a robot actually sees;
* requests/s over the measurement window (all clients start together after their warm-up);
* /healthz p99 latency, probed every 25 ms during the measurement: this is what moving compute
  off the event loop buys (keepalive pings are answered by the same loop);
* CPU the server's processes used per request (Linux ``/proc``), health probes included.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import ServerSubprocess, droid_request, percentile, process_tree_cpu_s

ACTION_SHAPE = (24, 8)
METADATA = {
    "image_resolution": [180, 320],
    "needs_wrist_camera": True,
    "n_external_cameras": 2,
    "needs_stereo_camera": False,
    "needs_session_id": True,
    "action_space": "joint_position",
    "action_shape": list(ACTION_SHAPE),
    "model": "noop-reference",
}


# =========================================================================== reference server


class TrivialPolicy:
    """The same policy as ``policies/noop``: optional simulated compute, then zeros."""

    def __init__(self, compute_ms: float) -> None:
        self.compute_ms = compute_ms

    def infer(self, obs: dict) -> dict:
        start = time.perf_counter()
        if self.compute_ms:
            time.sleep(self.compute_ms / 1000.0)
        actions = np.zeros(ACTION_SHAPE, dtype=np.float32)
        return {"actions": actions, "policy_timing": {"infer_ms": (time.perf_counter() - start) * 1000.0}}


async def _serve_reference(port: int, compute_ms: float) -> None:
    """openpi's WebsocketPolicyServer, reduced to what matters for latency (same control flow)."""
    import websockets
    from openpi_client import msgpack_numpy
    from websockets.asyncio.server import Request, Response, ServerConnection, serve

    policy = TrivialPolicy(compute_ms)

    async def handler(websocket: ServerConnection) -> None:
        packer = msgpack_numpy.Packer()
        await websocket.send(packer.pack(METADATA))
        prev_total_time: float | None = None
        while True:
            try:
                start_time = time.monotonic()
                obs = msgpack_numpy.unpackb(await websocket.recv())
                infer_time = time.monotonic()
                action = policy.infer(obs)  # on the event loop, as openpi does
                infer_time = time.monotonic() - infer_time
                action["server_timing"] = {"infer_ms": infer_time * 1000}
                if prev_total_time is not None:
                    action["server_timing"]["prev_total_ms"] = prev_total_time * 1000
                await websocket.send(packer.pack(action))
                prev_total_time = time.monotonic() - start_time
            except websockets.ConnectionClosed:
                break

    def health_check(connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        return None

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serve(handler, "127.0.0.1", port, compression=None, max_size=None, process_request=health_check) as server:
        bound = server.sockets[0].getsockname()[1]
        print(f"listening on ws://127.0.0.1:{bound}", flush=True)
        await stop.wait()


class _AnswerAtOnce:
    """An engine client that answers on the event loop: our front end without the process hop."""

    def __init__(self, compute_ms: float) -> None:
        from ardiff_policies.info import PolicyInfo, droid_server_config

        self.policy = TrivialPolicy(compute_ms)
        self.info = PolicyInfo(droid_server_config(), ACTION_SHAPE[0], ACTION_SHAPE[1], model="noop")
        self.state = "ready"

    async def start(self) -> None: ...

    async def infer(self, session_id: str, observation: Any) -> Any:
        from ardiff_server.engine.messages import InferReply

        reply = self.policy.infer({})
        infer_ms = reply["policy_timing"]["infer_ms"]
        return InferReply(0, session_id, reply["actions"], {"compute": infer_ms}, {}, False, 1, infer_ms)

    async def release(self, *args: Any) -> None: ...

    async def detach(self, *args: Any) -> None: ...

    async def stop(self, *args: Any) -> None: ...

    def kill_now(self) -> None: ...

    def replicas(self) -> list:
        return []


async def _serve_front_only(port: int, compute_ms: float) -> None:
    """``ardiff_server.frontend.server.PolicyServer`` (decode, validation, sessions, metrics, logging) with
    an engine that answers on the event loop: what our front end costs without the worker."""
    import logging

    from ardiff_server.config import load_config
    from ardiff_server.frontend.server import PolicyServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # as ardiff-serve does
    server = PolicyServer(load_config("noop", [f"server.port={port}"]), client=_AnswerAtOnce(compute_ms))
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"listening on ws://127.0.0.1:{server.port}", flush=True)
    await stop.wait()


# =========================================================================== server processes


def start_server(kind: str, compute_ms: float) -> ServerSubprocess:
    if kind == "ours":
        argv = [sys.executable, "-m", "ardiff_server", "--config", "noop", "--port", "0", "--set", f"policy.compute_ms={compute_ms}"]
    else:
        flag = "--serve-reference" if kind == "reference" else "--serve-front-only"
        argv = [sys.executable, str(Path(__file__).resolve()), flag, "--compute-ms", str(compute_ms)]
    return ServerSubprocess(kind, argv)


# =========================================================================== clients


def run_client(port: int, index: int, warmup: int, requests: int, barrier: Any) -> dict[str, list[float]]:
    """One robot (runs in a pool process): warm up, wait for the others, then time requests."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    client = WebsocketClientPolicy(host="127.0.0.1", port=port)
    obs = droid_request(f"bench-{index}-{time.monotonic_ns()}", seed=index)
    for _ in range(warmup):
        client.infer(obs)
    barrier.wait(timeout=300)
    total_ms: list[float] = []
    infer_ms: list[float] = []
    window = [time.monotonic(), 0.0]  # CLOCK_MONOTONIC: comparable across processes on Linux
    for _ in range(requests):
        start = time.perf_counter()
        reply = client.infer(obs)
        total_ms.append((time.perf_counter() - start) * 1000.0)
        infer_ms.append(float(reply["server_timing"]["infer_ms"]))
    window[1] = time.monotonic()
    client._ws.close()  # the openpi client has no close(); be a polite robot
    return {"total_ms": total_ms, "infer_ms": infer_ms, "window": window}


def probe_healthz(port: int, stop: threading.Event, out: list[float], interval_s: float = 0.025) -> None:
    while not stop.wait(interval_s):
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", "/healthz")
            conn.getresponse().read()
        finally:
            conn.close()
        out.append((time.perf_counter() - start) * 1000.0)


@dataclass
class Result:
    server: str
    compute_ms: float
    clients: int
    requests: int
    overhead_p50_ms: float
    overhead_p99_ms: float
    latency_p50_ms: float
    requests_per_s: float
    healthz_p99_ms: float
    server_cpu_ms: float  # CPU the server's processes (front end + workers) used per request


def measure(pool: ProcessPoolExecutor, manager: Any, server: ServerSubprocess, compute_ms: float, clients: int, warmup: int, requests: int) -> Result:
    kind, port = server.name, server.port
    barrier = manager.Barrier(clients + 1)  # + this process, which starts the /healthz probe
    futures: list[Future] = [pool.submit(run_client, port, i, warmup, requests, barrier) for i in range(clients)]
    try:
        barrier.wait(timeout=300)
    except Exception:
        errors = [f.exception(timeout=5) for f in futures if f.done()]
        raise RuntimeError(f"{kind}: clients failed before the measurement: {errors}") from None
    stop, health = threading.Event(), []
    prober = threading.Thread(target=probe_healthz, args=(port, stop, health), daemon=True)
    cpu_before = process_tree_cpu_s(server.proc.pid)
    prober.start()
    runs = [f.result(timeout=1800) for f in futures]
    cpu_used = process_tree_cpu_s(server.proc.pid) - cpu_before
    stop.set()
    prober.join()
    total = [t for r in runs for t in r["total_ms"]]
    overhead = [t - i for r in runs for t, i in zip(r["total_ms"], r["infer_ms"], strict=True)]
    elapsed = max(r["window"][1] for r in runs) - min(r["window"][0] for r in runs)
    return Result(
        server=kind,
        compute_ms=compute_ms,
        clients=clients,
        requests=len(total),
        overhead_p50_ms=statistics.median(overhead),
        overhead_p99_ms=percentile(overhead, 99),
        latency_p50_ms=statistics.median(total),
        requests_per_s=len(total) / elapsed,
        healthz_p99_ms=percentile(health, 99),
        server_cpu_ms=cpu_used * 1000.0 / len(total),
    )


# =========================================================================== report


def ratios(results: list[Result]) -> list[dict[str, float]]:
    """ours / reference for each (compute_ms, clients): < 1 is better for times, > 1 for req/s."""
    by_key = {(r.server, r.compute_ms, r.clients): r for r in results}
    out = []
    for r in results:
        ref = by_key.get(("reference", r.compute_ms, r.clients))
        if r.server != "ours" or ref is None:
            continue
        out.append(
            {
                "compute_ms": r.compute_ms,
                "clients": r.clients,
                "overhead_p50": r.overhead_p50_ms / ref.overhead_p50_ms,
                "overhead_p99": r.overhead_p99_ms / ref.overhead_p99_ms,
                "requests_per_s": r.requests_per_s / ref.requests_per_s,
                "healthz_p99": r.healthz_p99_ms / ref.healthz_p99_ms,
                "server_cpu": r.server_cpu_ms / ref.server_cpu_ms,
            }
        )
    return out


def table(results: list[Result]) -> str:
    columns = [
        ("compute", 7),
        ("clients", 7),
        ("server", 9),
        ("reqs", 5),
        ("ovh p50", 8),
        ("ovh p99", 8),
        ("lat p50", 8),
        ("req/s", 7),
        ("hz p99", 7),
        ("cpu/req", 7),
    ]
    head = " ".join(f"{name:>{width}}" for name, width in columns)
    lines = [head, "-" * len(head)]
    by_key = {(r.server, r.compute_ms, r.clients): r for r in results}
    for ratio in ratios(results):
        key = (ratio["compute_ms"], ratio["clients"])
        for kind in ("ours", "reference", "front-only"):
            r = by_key.get((kind, *key))
            if r is None:
                continue
            lines.append(
                f"{r.compute_ms:>5.0f}ms {r.clients:>7} {kind:>9} {r.requests:>5} {r.overhead_p50_ms:>8.2f} "
                f"{r.overhead_p99_ms:>8.2f} {r.latency_p50_ms:>8.2f} {r.requests_per_s:>7.1f} {r.healthz_p99_ms:>7.1f} {r.server_cpu_ms:>7.2f}"
            )
        lines.append(
            f"{'':>7} {'':>7} {'ours/ref':>9} {'':>5} {ratio['overhead_p50']:>7.2f}x {ratio['overhead_p99']:>7.2f}x "
            f"{'':>8} {ratio['requests_per_s']:>6.2f}x {ratio['healthz_p99']:>6.2f}x {ratio['server_cpu']:>6.2f}x"
        )
        front, ref = by_key.get(("front-only", *key)), by_key[("reference", *key)]
        if front is not None:
            lines.append(
                f"{'':>7} {'':>7} {'front/ref':>9} {'':>5} {front.overhead_p50_ms / ref.overhead_p50_ms:>7.2f}x "
                f"{front.overhead_p99_ms / ref.overhead_p99_ms:>7.2f}x {'':>8} {front.requests_per_s / ref.requests_per_s:>6.2f}x "
                f"{front.healthz_p99_ms / ref.healthz_p99_ms:>6.2f}x {front.server_cpu_ms / ref.server_cpu_ms:>6.2f}x"
            )
    lines.append(
        "times in ms; ovh = client round trip - reported policy compute (incl. waiting behind other clients); hz = GET /healthz;\n"
        "cpu/req = CPU the server's processes (front end + worker) used per request, /healthz probes included (~1.8 ms each\n"
        "in either server; the reference serves fewer of them while compute blocks its loop, so compare cpu/req at 0 ms);\n"
        "front-only = our front end (decode, validation, sessions, metrics, logs) with an engine answering on its event loop:\n"
        "ours minus front-only is the cost of the process hop to the worker"
    )
    return "\n".join(lines)


# =========================================================================== main


# =========================================================================== flood


def flood_frame(items: int = 260_000) -> bytes:
    """~780 KB of tiny msgpack objects (2-character strings, in lists under the 65536-entry list
    bound): cheap to send, costly to scan and build item by item."""
    import msgpack

    per_list = 65_000
    return msgpack.packb({f"junk{i}": ["ab"] * per_list for i in range(items // per_list)})


def attacker(port: int, stop: Any) -> int:
    """Sends pathological frames back to back (reading each error reply) until ``stop`` is set."""
    from websockets.sync.client import connect

    frame, sent = flood_frame(), 0
    with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        ws.recv()
        while not stop.is_set():
            ws.send(frame)
            ws.recv()
            sent += 1
    return sent


def flood(pool: ProcessPoolExecutor, manager: Any, attackers: int, warmup: int, requests: int) -> list[dict[str, Any]]:
    """A robot's latency alone and with ``attackers`` flooding, at the old item bound (262144,
    every frame scanned in full on the event loop) and the new default (1024: refused at once)."""
    rows = []
    for items in (262144, 1024):
        argv = [
            sys.executable,
            "-m",
            "ardiff_server",
            "--config",
            "noop",
            "--port",
            "0",
            "--log-level",
            "WARNING",
            "--set",
            f"server.max_frame_items={items}",
        ]
        with ServerSubprocess(f"max_frame_items={items}", argv) as server:
            for n in (0, attackers):
                stop = manager.Event()
                floods = [pool.submit(attacker, server.port, stop) for _ in range(n)]
                time.sleep(1.0 if n else 0.0)  # the flood is on
                barrier = manager.Barrier(2)
                robot = pool.submit(run_client, server.port, 0, warmup, requests, barrier)
                barrier.wait(timeout=300)
                run = robot.result(timeout=600)
                stop.set()
                frames = sum(f.result(timeout=60) for f in floods)
                rows.append(
                    {
                        "max_frame_items": items,
                        "attackers": n,
                        "flood_frames": frames,
                        "robot_p50_ms": statistics.median(run["total_ms"]),
                        "robot_p99_ms": percentile(run["total_ms"], 99),
                    }
                )
                print(f"  max_frame_items={items} attackers={n}: robot p50 {rows[-1]['robot_p50_ms']:.2f} ms", file=sys.stderr, flush=True)
    return rows


def flood_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'max_frame_items':>15} {'attackers':>9} {'flood frames':>12} {'robot p50':>10} {'robot p99':>10}"]
    for r in rows:
        lines.append(f"{r['max_frame_items']:>15} {r['attackers']:>9} {r['flood_frames']:>12} {r['robot_p50_ms']:>10.2f} {r['robot_p99_ms']:>10.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,4,16", help="comma-separated concurrent client counts (default 1,4,16)")
    parser.add_argument("--compute-ms", default="0,50", help="comma-separated simulated policy compute times (default 0,50)")
    parser.add_argument("--requests", type=int, default=300, help="measured requests per client without compute (default 300)")
    parser.add_argument(
        "--requests-with-compute",
        type=int,
        default=25,
        help="measured requests per client when compute-ms > 0 (default 25: 16 clients x 25 x 50 ms = 20 s)",
    )
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured requests per client first (default 10)")
    parser.add_argument(
        "--flood", type=int, metavar="N", default=0, help="instead: one robot's latency while N clients flood ~780 KB frames of 260k msgpack items"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: few requests (< 60 s)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object on the last stdout line")
    parser.add_argument(
        "--no-front-only", action="store_true", help="skip the 'front-only' rows (our front end with an engine answering on its event loop)"
    )
    parser.add_argument("--serve-reference", action="store_true", help=argparse.SUPPRESS)  # internal: the reference server
    parser.add_argument("--serve-front-only", action="store_true", help=argparse.SUPPRESS)  # internal: front end, no worker
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.requests_with_compute, args.warmup = 30, 4, 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_reference:
        asyncio.run(_serve_reference(args.port, float(args.compute_ms)))
        return 0
    if args.serve_front_only:
        asyncio.run(_serve_front_only(args.port, float(args.compute_ms)))
        return 0
    if args.flood:
        ctx = get_context("spawn")
        with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=args.flood + 1, mp_context=ctx) as pool:
            rows = flood(pool, manager, args.flood, args.warmup, args.requests)
        print(f"\none robot (noop policy, DROID requests) while {args.flood} clients flood pathological frames, {os.cpu_count()} CPU cores\n")
        print(flood_table(rows))
        if args.json:
            print(json.dumps({"flood": rows}))
        return 0
    client_counts = [int(c) for c in args.clients.split(",")]
    compute_values = [float(c) for c in args.compute_ms.split(",")]
    results: list[Result] = []
    started = time.perf_counter()
    ctx = get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=max(client_counts), mp_context=ctx) as pool:
        for compute_ms in compute_values:
            requests = args.requests if compute_ms == 0 else args.requests_with_compute
            kinds = ("ours", "reference", "front-only") if compute_ms == 0 and not args.no_front_only else ("ours", "reference")
            for kind in kinds:
                with start_server(kind, compute_ms) as server:
                    assert server.port is not None
                    for clients in client_counts:
                        result = measure(pool, manager, server, compute_ms, clients, args.warmup, requests)
                        progress = f"overhead p50 {result.overhead_p50_ms:.2f} ms, {result.requests_per_s:.0f} req/s"
                        print(f"  {kind:>9}  compute {compute_ms:.0f} ms  {clients:>2} clients: {progress}", file=sys.stderr, flush=True)
                        results.append(result)
    print(
        f"\nardiff-server vs openpi reference server, {os.cpu_count()} CPU cores, "
        f"DROID requests (3 x 180x320x3 uint8), {time.perf_counter() - started:.0f} s\n"
    )
    print(table(results))
    if args.json:
        print(json.dumps({"cpu_cores": os.cpu_count(), "results": [asdict(r) for r in results], "ratios": ratios(results)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
