"""Shared by the benchmarks: servers in subprocesses, DROID requests, and how much CPU other
processes used while we measured."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


class ForeignLoad:
    """CPU other processes burn while we measure (Linux /proc/stat). On a small shared machine a
    neighbour that takes a core stalls every parallel op at its thread barrier, which inflates
    many-small-op paths far more than others: a run with foreign load is not a clean comparison."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        busy = busy_seconds()
        if busy is None:
            return None
        own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
        return time.monotonic(), busy, own

    def cores(self) -> float | None:
        """Average number of cores other processes kept busy since construction."""
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        return max(0.0, (end[1] - self.start[1]) - (end[2] - self.start[2])) / (end[0] - self.start[0])


def busy_seconds() -> float | None:
    """CPU seconds every core has been busy since boot (/proc/stat: all but idle and iowait); None off Linux."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds (user + system) the live processes ``root`` and its descendants have used (/proc; 0 off Linux)."""
    parents, used = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parents[int(entry.name)] = int(fields[1])
        used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid, seconds in used.items():
        node = pid
        while node not in (0, 1, root) and node in parents:
            node = parents[node]
        if node == root:
            total += seconds
    return total


class CpuSplit:
    """Cores kept busy over an interval, split three ways: this process (a bench's clients), a server's process tree
    (``server_pid``: the front end and its workers), and everything else (other processes of the machine)."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float, float] | None:
        busy = busy_seconds()
        if busy is None:
            return None
        own = sum(getattr(resource.getrusage(resource.RUSAGE_SELF), f) for f in ("ru_utime", "ru_stime"))
        return time.monotonic(), busy, own, tree_cpu_seconds(self.server_pid)

    def cores(self) -> tuple[float, float, float] | None:
        """(this process, the server, the others) in cores since construction; None off Linux."""
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        wall = end[0] - self.start[0]
        own, server = (end[2] - self.start[2]) / wall, (end[3] - self.start[3]) / wall
        return own, server, max(0.0, (end[1] - self.start[1]) / wall - own - server)


def contended(foreign_cores: float | None, threads: int) -> bool:
    """True when neighbours left fewer free cores than we run threads (with some slack)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return foreign_cores is not None and foreign_cores > max(0, cores - threads) + 0.2


def contention_warning(foreign_cores: float) -> str:
    """What a bench prints when :func:`contended` says its numbers are distorted."""
    return (
        f"WARNING: other processes kept {foreign_cores:.1f} cores busy during the run; "
        "with fewer free cores than threads, parallel ops stall at thread barriers and these numbers are "
        "distorted (rerun on an idle machine, or with --threads 1)"
    )


class ServerSubprocess:
    """A server in a subprocess: started, awaited until it prints its port, stopped with SIGTERM."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.tail: deque[str] = deque(maxlen=50)
        self.port: int | None = None
        self._ready = threading.Event()
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # Drain its output continuously: a full pipe would block the server's logging mid-run.
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if self.port is None and line.startswith("listening on ws://"):
                self.port = int(line.split()[2].rsplit(":", 1)[1].rstrip(","))
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 120.0) -> ServerSubprocess:
        if not self._ready.wait(timeout) or self.port is None:
            self.stop()
            raise RuntimeError(f"{self.name} server did not start:\n" + "\n".join(self.tail))
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> ServerSubprocess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and every live descendant (Linux /proc;
    NaN elsewhere). A worker that exited meanwhile is not counted: sample while it runs."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    if pid not in used:
        return float("nan")
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent and child not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(used[p] for p in tree)


def droid_observations(calls: int, seed: int = 0, camera: tuple[int, int] = (180, 320), prompt: str = "pick up the cup and put it in the bowl"):
    """DROID-shaped observations for a policy or engine: 1 frame first, then 4-frame stacks of random pictures."""
    from ardiff_policies.observation import RobotObservation

    rng = np.random.default_rng(seed)
    out = []
    for call in range(calls):
        shape = (1 if call == 0 else 4, *camera, 3)
        cams = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(3)]
        joints = rng.uniform(-1, 1, 7).astype(np.float32)
        out.append(
            RobotObservation(
                exterior_left=cams[0],
                exterior_right=cams[1],
                wrist=cams[2],
                joint_position=joints,
                gripper_position=np.array([0.3], np.float32),
                prompt=prompt,
            )
        )
    return out


def droid_request(session_id: str, seed: int) -> dict:
    """A DROID observation as RoboArena sends it (one frame per camera)."""
    rng = np.random.default_rng(seed)
    image = lambda: rng.integers(0, 256, (180, 320, 3), dtype=np.uint8)  # noqa: E731
    return {
        "observation/exterior_image_0_left": image(),
        "observation/exterior_image_1_left": image(),
        "observation/wrist_image_left": image(),
        "observation/joint_position": rng.uniform(-1, 1, 7),
        "observation/gripper_position": rng.uniform(0, 1, 1),
        "prompt": "pick up the red cup and put it in the bowl",
        "session_id": session_id,
    }


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# ------------------------------------------------------------ robots against a served endpoint


def openpi_robot(port: int, index: int, warmup: int, calls: int, barrier: Any, gap_ms: float = 0.0) -> dict[str, Any]:
    """One robot (a pool process, the real openpi client, its own session): an episode of 1 frame
    then 4-frame stacks as DreamZero's client sends them, timed after ``warmup`` calls."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    rng = np.random.default_rng(index)
    client = WebsocketClientPolicy(host="127.0.0.1", port=port)
    session = f"bench-{index}-{time.monotonic_ns()}"

    def observation(frames: int) -> dict:
        shape = (180, 320, 3) if frames == 1 else (frames, 180, 320, 3)
        return {
            "observation/exterior_image_0_left": rng.integers(0, 256, shape, dtype=np.uint8),
            "observation/exterior_image_1_left": rng.integers(0, 256, shape, dtype=np.uint8),
            "observation/wrist_image_left": rng.integers(0, 256, shape, dtype=np.uint8),
            "observation/joint_position": rng.uniform(-1, 1, 7),
            "observation/gripper_position": rng.uniform(0, 1, 1),
            "prompt": "pick up the cup",
            "session_id": session,
        }

    # Made once: generating 2 MB of random frames per call would take the robots' CPU from the
    # server on a small machine (robots are other machines in real life).
    stacks = [observation(4) for _ in range(3)]
    replicas, batch_sizes = set(), []
    for i in range(warmup):
        replicas.add(client.infer(observation(1) if i == 0 else stacks[i % 3])["session"]["replica"])
    barrier.wait(timeout=600)
    latency, queue, window = [], [], [time.monotonic(), 0.0]
    for i in range(calls):
        start = time.perf_counter()
        reply = client.infer(stacks[i % 3])
        latency.append((time.perf_counter() - start) * 1000.0)
        queue.append(reply["server_timing"]["queue_ms"])
        session_info = reply["session"]
        replicas.add(session_info["replica"])
        batch_sizes.append(session_info.get("batch_size", 1))
        time.sleep(gap_ms / 1000.0)  # the robot executes its chunk
    window[1] = time.monotonic()
    client.infer({"endpoint": "reset", "session_id": session})
    client._ws.close()
    return {"latency_ms": latency, "queue_ms": queue, "window": window, "replicas": sorted(replicas), "batch_sizes": batch_sizes}


@dataclass
class RobotsResult:
    label: str  # the server variant
    robots: int
    calls: int
    calls_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    mean_batch: float  # sessions per engine step, as the replies report it
    spread: str  # which replica each robot used


def measure_robots(pool, manager, port: int, label: str, robots: int, warmup: int, calls: int, gap_ms: float = 0.0) -> RobotsResult:
    """``robots`` openpi robots at once (after their warm-up, started together on a barrier):
    calls per second all together, round-trip latency per call (p50 / p99)."""
    barrier = manager.Barrier(robots + 1)
    futures = [pool.submit(openpi_robot, port, i, warmup, calls, barrier, gap_ms) for i in range(robots)]
    barrier.wait(timeout=600)
    runs = [f.result(timeout=1800) for f in futures]
    latency = [x for r in runs for x in r["latency_ms"]]
    batches = [x for r in runs for x in r["batch_sizes"]]
    elapsed = max(r["window"][1] for r in runs) - min(r["window"][0] for r in runs)
    return RobotsResult(
        label,
        robots,
        len(latency),
        len(latency) / elapsed,
        float(np.median(latency)),
        percentile(latency, 99),
        float(np.mean(batches)) if batches else 1.0,
        " ".join("/".join(map(str, r["replicas"])) for r in runs),
    )


def robots_per_server(
    config: str, servers: Sequence[tuple[str, list[str]]], robot_counts: Sequence[int], warmup: int, calls: int
) -> tuple[list[RobotsResult], float | None, float]:
    """For each ``(label, overrides)`` in turn: ``ardiff-serve --config config --set <override> ...`` on a
    free port, then each count of openpi robots against it (:func:`measure_robots`, labelled ``label``).
    Returns the results, the cores other processes used meanwhile, and the seconds it all took."""
    load, started, results = ForeignLoad(), time.perf_counter(), []
    ctx = get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=max(robot_counts), mp_context=ctx) as pool:
        for label, overrides in servers:
            argv = [sys.executable, "-m", "ardiff_server", "--config", config, "--port", "0", "--log-level", "WARNING"]
            argv += [arg for override in overrides for arg in ("--set", override)]
            with ServerSubprocess(label, argv) as server:
                for robots in robot_counts:
                    result = measure_robots(pool, manager, server.port, label, robots, warmup, calls)
                    print(
                        f"  {label}, {robots} robot(s): {result.calls_per_s:.2f} calls/s, p50 {result.latency_p50_ms:.0f} ms, "
                        f"mean batch {result.mean_batch:.2f}",
                        file=sys.stderr,
                        flush=True,
                    )
                    results.append(result)
    return results, load.cores(), time.perf_counter() - started
