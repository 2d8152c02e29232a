#!/usr/bin/env python
"""A fleet on one server: how many robots it serves with none standing still. One table, one run.

N robots, each a simulated robot of ardiff_sim.tiny_task driven by its own ``AsyncChunkRunner`` (continuation
mode) on its own thread and connection, on the wall clock, against a real ``ardiff-serve`` subprocess serving the
trained tiny task model (ardiff_sim.task_model, cached as scripts/bench_async.py caches it). So that a CPU
reproduces a GPU's schedule, the server runs a bench config (``bench: true``) whose every batched step lasts at least
a modelled time t(b) (``engine.modelled_step_time``: ``14b`` b x 0.61 s, ``5b`` 0.15 s x (1 + 0.1 (b - 1));
``ardiff_server/engine/modelled_step.py``); the ``cpu`` profile is the tiny model's own time. Robots start
staggered over one chunk, as a fleet does. The server runs one torch thread (``engine.threads=1``): on a small
shared machine a second thread stalls at every op's barrier whenever the robots or a neighbour hold the other core
(steps of 2-10 s where one thread takes 0.3 s), and the robots get the other core.

Rows: profile x scheduler (``engine.schedule``: ``arrival`` order or earliest ``deadline``) x asking (``half``: ask
when half the chunk is left, the runner's ``overlap`` 0.5; ``adaptive``: ask as late as the server's latency estimate
allows) x robots. Columns: steady idle steps per robot per chunk (after each robot's first chunk), deadline misses
(the replies' ``server_timing.deadline_slack_ms`` below 0: the step started after the robot ran dry), seam / inner step, chunks/s per robot, round-trip
latency p50 / p99, the mean batch, the share of steps whose real time overran the modelled one (a row with
overruns is not the profile's schedule) and the real step's median, the median of the calls' own work on the
engine's encoder thread (``encode_ms``: a first call's text, a window start's CLIP and image conditioning; outside the
step, so never modelled and never an overrun: on this CPU about 0.5 s every 4th call, which a robot with less slack
stands still for), and the cores the robots (this process), the server (its process tree) and everything else kept
busy meanwhile. Then each configuration's capacity (the most
robots, counting up from 1, with 0 steady idle steps and seams <= 2x the inner step) beside the profile's limit
(docs/design-notes.md, "How many robots one server serves"). A configuration the code does not have yet is printed
as not available, never run as another.

Capacity at fewer denoising steps (``--denoise 16,8,4``): under a modelled profile, deadline order with adaptive
asking again with every request asking ``num_inference_steps`` n (the per-request option; each reply must say n, or
the row fails), its step lasting t(b) x share(n) (``modelled_step.py``: the DiT's share of the 14B's chunk scaled by
its DiT forwards at n steps), at 1 robot and up until a row does not serve (at most the limit at n plus one); the
limit at n beside it.

    .venv/bin/python scripts/bench_fleet.py --quick          # 14b, N = 1..3 (8 and 4 steps: to capacity), the CPU at N = 1..4: <= 10 min
    .venv/bin/python scripts/bench_fleet.py                  # 14b and 5b at N = 1..4 (and at 8 and 4 steps), the CPU at N = 1..4
    .venv/bin/python scripts/bench_fleet.py --profiles 5b --robots 1,2,4,8 --steps 240
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from benchlib import CpuSplit, ForeignLoad, ServerSubprocess  # scripts/, this script's own folder

from ardiff_client.async_runner import AsyncChunkRunner
from ardiff_client.websocket_client import WebsocketPolicy
from ardiff_server.engine.modelled_step import PROFILES, REFERENCE_STEPS, StepTimeProfile, step_time_profile
from ardiff_sim import tiny_task
from ardiff_sim.task_model import BENCH_STEPS, ensure_task_checkpoint

HORIZON = tiny_task.HORIZON  # actions per chunk
SEAM_LIMIT = 2.0  # capacity: seams at most this many inner steps
SCHEDULES = ("arrival", "deadline")
# The runner-side switch: each asking mode is AsyncChunkRunner keyword arguments (ardiff_client.async_runner).
ASKING: dict[str, dict[str, Any]] = {
    "half": {"asking": "half", "overlap": 0.5},
    "adaptive": {"asking": "adaptive"},
}
CPU = "cpu"  # the profile without a modelled time
DEADLINE_SLACK = "deadline_slack_ms"  # server_timing's per-call slack (negative: missed), for a request with a deadline
CAPACITY_LINE = "capacity: arrival={arrival} deadline={deadline} limit={limit}"
STEPS_KEY = "num_inference_steps"  # a request's denoising steps, and its reply's session map's report of them
DENOISE_CONFIG = ("deadline", "adaptive")  # the configuration measured at fewer denoising steps


# ------------------------------------------------------------------------------------ the limit


def fleet_limit(step_s, *, horizon: int = HORIZON, hz: float, max_batch: int, most: int = 1024) -> int:
    """The most robots a server whose step of b sessions takes ``step_s(b)`` seconds could serve with none idle.

    A robot executes a chunk of ``horizon`` actions at ``hz``. Its request waits at least its own step, t(b), and it
    executes d = ceil(hz t(b)) actions meanwhile (the frozen prefix: the new chunk's first d rows are the old one's).
    One request in flight per robot; N robots served in k batches per round, of sizes as equal as can be (b_1..b_k,
    each <= max_batch), keep the server busy P = t(b_1) + ... + t(b_k) per round, so each chunk must last that long
    past its delay: it is used for s = hz P actions (RTC's execution horizon; s >= d since a round holds the robot's
    own step). A chunk holds both: d + s <= horizon, with d of the largest batch. The limit is the largest N for which
    some k meets it (0: not even one robot).
    """
    best = 0
    for robots in range(1, most + 1):
        # t only grows with b: one robot fewer never lengthens a round nor its largest batch, so once N fits no k, no larger N does
        if not any(_fits(step_s, robots, k, horizon, hz) for k in range(math.ceil(robots / max_batch), robots + 1)):
            break
        best = robots
    return best


def round_batches(robots: int, batches: int) -> list[int]:
    """``robots`` in ``batches`` batches as equal as can be (largest first)."""
    size, extra = divmod(robots, batches)
    return [size + 1] * extra + [size] * (batches - extra)


def _fits(step_s, robots: int, batches: int, horizon: int, hz: float) -> bool:
    sizes = round_batches(robots, batches)
    delay = math.ceil(hz * step_s(sizes[0]) - 1e-9)
    return delay + hz * sum(step_s(b) for b in sizes) <= horizon + 1e-9


def limit_formula(profile: StepTimeProfile, hz: float, max_batch: int, steps: int = REFERENCE_STEPS) -> str:
    return (
        f"largest N served in some k >= N/{max_batch} batches a round, sizes b_1 >= .. >= b_k as equal as can be: "
        f"ceil(f t(b_1)) + f (t(b_1) + .. + t(b_k)) <= H  (H = {HORIZON}, f = {hz:g} Hz, {profile.formula(steps)})"
    )


# ------------------------------------------------------------------------------------ one robot


@dataclass
class RobotRun:
    summary: dict[str, Any] = field(default_factory=dict)
    idle_steps: int = 0  # every tick it stood still, the last chunk's wait included
    first_wait: int = 0  # ticks before its first chunk (not steady state)
    chunks: int = 0
    latencies_s: list[float] = field(default_factory=list)
    seam_jumps: list[float] = field(default_factory=list)
    inner_steps: list[float] = field(default_factory=list)
    server_timing: list[dict[str, Any]] = field(default_factory=list)
    session: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def robot(url: str, index: int, steps: int, hz: float, asking: dict[str, Any], start_at: float, run: RobotRun, denoise: int | None = None) -> None:
    """One robot's episode (a thread): connect, wait for its start time, run, reset its session. ``denoise``: every
    request asks that many denoising steps (None: the server's)."""
    rng = np.random.default_rng(1000 + index)
    state = {"joints": tiny_task.random_state(rng), "gripper": 0.5}
    session_id = f"fleet-{index}-{time.monotonic_ns()}"

    def observe() -> dict[str, Any]:
        view = tiny_task.render(state["joints"], tiny_task.VIEW)
        return {
            "observation/exterior_image_0_left": view,
            "observation/exterior_image_1_left": view,
            "observation/wrist_image_left": view,
            "observation/joint_position": state["joints"].astype(np.float32),
            "observation/gripper_position": np.array([state["gripper"]], np.float32),
        }

    def act(action: np.ndarray) -> None:
        state["joints"], state["gripper"] = action[:7].astype(np.float64), float(action[7])

    try:
        with WebsocketPolicy(url, timeout=120.0) as policy:

            def infer(request: dict[str, Any]) -> dict[str, Any]:
                reply = policy(request if denoise is None else {**request, STEPS_KEY: denoise})
                if isinstance(reply, dict):
                    run.server_timing.append(dict(reply.get("server_timing") or {}))
                    run.session.append(dict(reply.get("session") or {}))
                return reply

            runner = AsyncChunkRunner(
                infer, control_hz=hz, prompt=tiny_task.PROMPT, mode="continuation", session_id=session_id, joint_columns=list(range(7)), **asking
            )
            time.sleep(max(0.0, start_at - time.monotonic()))
            report = runner.run(observe, act, steps)
            policy.reset(session_id)
        run.summary, run.latencies_s = report.summary(), report.latencies_s
        run.idle_steps, run.chunks = report.idle_steps, report.chunks
        run.first_wait = report.idle_per_chunk[0] if report.idle_per_chunk else report.idle_steps
        run.seam_jumps, run.inner_steps = report.seam_jumps, report.inner_steps
    except Exception as exc:  # reported in its row: one robot's failure is a result, not a crash of the bench
        run.error = f"robot {index}: {type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------------ one row


@dataclass
class Row:
    profile: str
    schedule: str
    asking: str
    robots: int
    denoise: int = REFERENCE_STEPS  # the denoising steps every call ran
    steady_idle_per_chunk: float = float("nan")
    deadline_misses: int | None = None  # None: the replies carry no deadline field
    seam_ratio: float = float("nan")
    chunks_per_s: float = float("nan")
    latency_p50_ms: float = float("nan")
    latency_p99_ms: float = float("nan")
    mean_batch: float = float("nan")
    overrun: float | None = None  # share of steps longer than the modelled time (None: no modelled time)
    real_step_p50_ms: float = float("nan")  # the policy's own step (under a modelled time: before its sleep)
    # a call's own work on the engine's encoder thread, outside the step and never modelled (a session's first call: its
    # text; a window start: CLIP and the image conditioning), over the calls that had any
    encode_p50_ms: float = float("nan")
    cores: tuple[float, float, float] | None = None  # busy meanwhile: the robots (this process), the server, the others
    error: str | None = None

    @property
    def serves(self) -> bool:
        """No robot stood still past its first chunk, and seams stayed within SEAM_LIMIT inner steps."""
        return self.error is None and self.steady_idle_per_chunk == 0.0 and self.seam_ratio <= SEAM_LIMIT


def measure(
    server: ServerSubprocess, profile: str, schedule: str, asking: str, robots: int, steps: int, hz: float, denoise: int | None = None
) -> Row:
    """``robots`` robots at once against ``server``, started staggered over one chunk (``denoise``: the denoising steps
    every request asks, None: the server's 16)."""
    url = f"ws://127.0.0.1:{server.port}"
    runs = [RobotRun() for _ in range(robots)]
    start = time.monotonic() + 1.0
    chunk_s = HORIZON / hz
    threads = [
        threading.Thread(target=robot, args=(url, i, steps, hz, ASKING[asking], start + i * chunk_s / robots, runs[i], denoise), daemon=True)
        for i in range(robots)
    ]
    cpu = CpuSplit(server.proc.pid)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    row = Row(profile, schedule, asking, robots, REFERENCE_STEPS if denoise is None else denoise)
    row.cores = cpu.cores()
    errors = [r.error for r in runs if r.error]
    ran = {s.get(STEPS_KEY) for r in runs for s in r.session}
    if not errors and ran != {row.denoise}:  # never another schedule than the row's, unnoticed
        errors = [f"the replies say {STEPS_KEY} {sorted(ran, key=str)}, the row asked {row.denoise}"]
    if errors:
        row.error = errors[0]
        return row
    summaries = [r.summary for r in runs]
    seams = [x for r in runs for x in r.seam_jumps]
    inner = [x for r in runs for x in r.inner_steps]
    timings = [t for r in runs for t in r.server_timing]
    sessions = [s for r in runs for s in r.session]
    # Steady idle: every tick stood still after the first chunk, a wait no reply ended yet included, per chunk
    # after the first (a robot with fewer than two chunks has no steady state: NaN, and the row serves nobody)
    row.steady_idle_per_chunk = float(np.mean([(r.idle_steps - r.first_wait) / (r.chunks - 1) if r.chunks > 1 else float("nan") for r in runs]))
    row.seam_ratio = float(np.median(seams) / np.median(inner)) if seams and inner and np.median(inner) > 0 else float("nan")
    row.chunks_per_s = float(np.mean([s["chunks_per_s"] for s in summaries]))
    latencies_ms = [1000.0 * x for r in runs for x in r.latencies_s]
    row.latency_p50_ms = float(np.median(latencies_ms)) if latencies_ms else float("nan")
    row.latency_p99_ms = float(np.percentile(latencies_ms, 99)) if latencies_ms else float("nan")
    if any(DEADLINE_SLACK in t for t in timings):
        row.deadline_misses = sum(t[DEADLINE_SLACK] < 0 for t in timings if DEADLINE_SLACK in t)
    batches = [s["batch_size"] for s in sessions if "batch_size" in s]
    row.mean_batch = float(np.mean(batches)) if batches else float("nan")
    overruns = [bool(s["modelled_step_overrun"]) for s in sessions if "modelled_step_overrun" in s]
    row.overrun = float(np.mean(overruns)) if overruns else None
    real = [s["real_step_ms"] for s in sessions if "real_step_ms" in s] or [t["infer_ms"] for t in timings if "infer_ms" in t]
    row.real_step_p50_ms = float(np.median(real)) if real else float("nan")
    encodes = [t["encode_ms"] for t in timings if t.get("encode_ms")]
    row.encode_p50_ms = float(np.median(encodes)) if encodes else float("nan")
    return row


# ------------------------------------------------------------------------------------ the server


def server_argv(checkpoint: str, profile: str, schedule: str, max_robots: int, t1_s: float | None) -> list[str]:
    sets = [
        f"policy.checkpoint={checkpoint}",
        f"engine.max_batch={max_robots}",
        f"engine.max_sessions={max_robots + 1}",
        "engine.kv_budget_gib=1.0",
        "engine.threads=1",  # one torch thread: the module's docstring
        "server.session_ttl_s=30",
    ]
    sets.append(f"engine.schedule={schedule}")
    if profile != CPU:
        sets += ["bench=true", f"engine.modelled_step_time={profile}"]
        if t1_s is not None:
            sets.append(f"engine.modelled_step_t1_s={t1_s}")
    argv = [sys.executable, "-m", "ardiff_server", "--config", "tiny", "--port", "0", "--log-level", "WARNING"]
    return argv + [arg for override in sets for arg in ("--set", override)]


# ------------------------------------------------------------------------------------ the table


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def row_line(row: Row) -> str:
    head = f"| {row.profile} | {row.denoise} | {row.schedule} | {row.asking} | {row.robots} |"
    if row.error is not None:
        return head + f" failed: {row.error} |" + " |" * 11
    misses = "-" if row.deadline_misses is None else str(row.deadline_misses)
    overrun = "-" if row.overrun is None else f"{row.overrun:.0%}"
    cores = " | ".join(f"{c:.2f}" for c in row.cores) if row.cores is not None else "- | - | -"
    return (
        head + f" {_num(row.steady_idle_per_chunk, '.2f')} | {misses} | {_num(row.seam_ratio, '.2f')} | {_num(row.chunks_per_s, '.2f')} | "
        f"{_num(row.latency_p50_ms, '.0f')} | {_num(row.latency_p99_ms, '.0f')} | {_num(row.mean_batch, '.2f')} | {overrun} | "
        f"{_num(row.real_step_p50_ms, '.0f')} | {_num(row.encode_p50_ms, '.0f')} | {cores} |"
    )


COLUMNS = (
    "profile",
    "denoise steps",
    "scheduler",
    "asking",
    "robots",
    "steady idle / robot / chunk",
    "deadline misses",
    "seam / inner",
    "chunks/s per robot",
    "latency p50 (ms)",
    "p99 (ms)",
    "mean batch",
    "overrun",
    "real step p50 (ms)",
    "encode p50 (ms)",
    "robots' cores",
    "server's cores",
    "others' cores",
)
TABLE_HEAD = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS)


def capacity(rows: list[Row], profile: str, schedule: str, asking: str, denoise: int = REFERENCE_STEPS) -> int | None:
    """The most robots served, counting up from the fewest measured (None: the configuration was not run)."""
    mine = sorted((r for r in rows if (r.profile, r.schedule, r.asking, r.denoise) == (profile, schedule, asking, denoise)), key=lambda r: r.robots)
    if not mine:
        return None
    served = 0
    for row in mine:
        if not row.serves:
            break
        served = row.robots
    return served


def capacity_line(rows: list[Row], limit: int) -> str:
    """The 14B's one line: arrival order with half-chunk asking against deadline order with adaptive asking (the
    issue's comparison; a configuration not run reads n/a)."""
    arrival = capacity(rows, "14b", "arrival", "half")
    deadline = capacity(rows, "14b", "deadline", "adaptive")
    show = lambda v: "n/a" if v is None else str(v)  # noqa: E731
    return CAPACITY_LINE.format(arrival=show(arrival), deadline=show(deadline), limit=limit)


# ------------------------------------------------------------------------------------ main


def scaled(profile: StepTimeProfile, factor: float) -> StepTimeProfile:
    """``profile`` ``factor`` times slower: with the control rate divided by ``factor``, the same schedule (the limit's
    ceil(f t(b_1)) + f (t(b_1) + .. + t(b_k)) <= H is unchanged by f -> f / k, t -> k t)."""
    return profile if factor == 1.0 else dataclasses.replace(profile, t1_s=profile.t1_s * factor)


def parse_counts(text: str) -> list[int]:
    counts = sorted({int(v) for v in text.split(",") if v.strip()})
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"expected robot counts >= 1, comma separated, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="14b,5b", help=f"modelled step times, of {sorted(PROFILES)} (default 14b,5b)")
    parser.add_argument("--robots", type=parse_counts, default=None, help="robot counts under a modelled time (default 1,2,3,4; --quick 1,2,3)")
    parser.add_argument("--cpu-robots", type=parse_counts, default=None, help="robot counts on the CPU's own time (default 1,2,3,4)")
    parser.add_argument("--no-cpu", action="store_true", help="skip the table on the CPU's own time")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="engine.schedule values (default arrival,deadline)")
    parser.add_argument("--asking", default=",".join(ASKING), help=f"asking modes, of {list(ASKING)} (default all)")
    parser.add_argument(
        "--denoise",
        type=parse_counts,
        default=None,
        help=f"denoising steps per call to find the capacity at, under a modelled time (default 16,8,4; {REFERENCE_STEPS}, always "
        f"run: the server's own, every configuration; others: {' / '.join(DENOISE_CONFIG)} only, to the first row that does not serve)",
    )
    parser.add_argument("--hz", type=float, default=15.0, help="control rate (default 15: a 24-action chunk lasts 1.6 s)")
    parser.add_argument("--steps", type=int, default=None, help="control steps per robot per row (default 240; --quick 120)")
    parser.add_argument("--t1-5b", type=float, default=None, help="the 5b profile's t(1) in seconds (default the profile's)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run the modelled profiles' schedule k times slower: t(b) x k and the control rate / k (the limit, idle steps, "
        "misses and seams are the same schedule's; latencies x k, chunks/s / k); for a CPU whose own step overruns t(b) "
        "(a loaded machine, the 5B's 0.15 s). Default 1; the CPU rows keep --hz",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="14b only (--profiles ignored) at N = 1..3 (and at 8 and 4 steps to capacity) and the CPU at N = 1..4, 120 steps: <= 10 min",
    )
    parser.add_argument("--train-steps", type=int, default=BENCH_STEPS, help=f"task model training steps (cached; default {BENCH_STEPS})")
    parser.add_argument("--checkpoint", help="a trained task checkpoint (default: train / use the cached one); builtin:tiny for a smoke run")
    parser.add_argument("--json", action="store_true", help="print one JSON object (every row) as the last line")
    args = parser.parse_args(argv)
    profiles = ["14b"] if args.quick else [p for p in args.profiles.split(",") if p]
    for name in profiles:
        step_time_profile(name)  # an unknown one stops here, by name
    robots = args.robots or ([1, 2, 3] if args.quick else [1, 2, 3, 4])
    cpu_robots = [] if args.no_cpu else (args.cpu_robots or [1, 2, 3, 4])
    steps = args.steps or (120 if args.quick else 240)
    denoise = sorted({REFERENCE_STEPS, *(args.denoise or [8, 4])}, reverse=True)  # the reference always: the capacity line's
    schedules = [s for s in args.schedules.split(",") if s]
    asking_modes = [a for a in args.asking.split(",") if a]
    for name in asking_modes:
        if name not in ASKING:
            parser.error(f"--asking: expected some of {list(ASKING)}, got {name!r}")
    started, load = time.perf_counter(), ForeignLoad()
    checkpoint = args.checkpoint or str(ensure_task_checkpoint(args.train_steps, log=lambda line: print(line, file=sys.stderr, flush=True)))
    if args.time_scale < 1.0:
        parser.error(f"--time-scale: expected a factor >= 1 (slower), got {args.time_scale:g}")
    scale, hz = args.time_scale, args.hz / args.time_scale  # the modelled profiles' control rate
    print(f"checkpoint {checkpoint}; {args.hz:g} Hz, {HORIZON}-action chunks ({HORIZON / args.hz:.2f} s), {steps} steps per robot per row")
    if scale != 1.0:
        print(f"time scale {scale:g}: the modelled profiles run at {hz:g} Hz with t(b) x {scale:g} (the same schedule, {scale:g}x slower)")
    print()

    model = {p: scaled(step_time_profile(p, args.t1_5b if p == "5b" else None), scale) for p in profiles}
    limits = {(p, n): fleet_limit(model[p].at_steps(n), hz=hz, max_batch=max(robots)) for p in profiles for n in denoise}
    # fewer denoising steps: the capacity configuration, from 1 robot to one past the limit at those steps
    fewer = {(p, n): list(range(1, limits[p, n] + 2)) for p in profiles for n in denoise if n != REFERENCE_STEPS}
    rows: list[Row] = []
    runs = [(p, robots) for p in profiles] + ([(CPU, cpu_robots)] if cpu_robots else [])
    print(TABLE_HEAD, flush=True)
    for profile, counts in runs:
        t1 = model[profile].t1_s if profile in model and model[profile] != PROFILES[profile] else None
        rate = args.hz if profile == CPU else hz
        for schedule in schedules:
            extra = {n: c for (p, n), c in fewer.items() if p == profile and schedule == DENOISE_CONFIG[0]}
            most = max([*counts, *(c for cs in extra.values() for c in cs)])
            with ServerSubprocess(f"{profile}/{schedule}", server_argv(checkpoint, profile, schedule, most, t1)) as server:
                for asking in asking_modes:
                    for count in counts:
                        rows.append(measure(server, profile, schedule, asking, count, steps, rate))
                        print(row_line(rows[-1]), flush=True)
                if DENOISE_CONFIG[1] in asking_modes:
                    for n, counts_n in extra.items():
                        for count in counts_n:
                            rows.append(measure(server, profile, schedule, DENOISE_CONFIG[1], count, steps, rate, denoise=n))
                            print(row_line(rows[-1]), flush=True)
                            if not rows[-1].serves:  # capacity counts up to the first row that does not serve
                                break

    print(f"\ncapacity: the most robots with 0 steady idle steps and seams <= {SEAM_LIMIT:g}x the inner step (of those run)")
    print("| profile | denoise steps | scheduler | asking | capacity | limit |\n|---|---|---|---|---|---|")
    for profile, _ in runs:
        configurations = [(REFERENCE_STEPS, s, a) for s in schedules for a in asking_modes]
        configurations += [(n, *DENOISE_CONFIG) for n in denoise if n != REFERENCE_STEPS and profile != CPU]
        for n, schedule, asking in configurations:
            served = capacity(rows, profile, schedule, asking, n)
            tried = max((r.robots for r in rows if (r.profile, r.schedule, r.asking, r.denoise) == (profile, schedule, asking, n)), default=0)
            shown = "n/a" if served is None else (f">= {served}" if served == tried else str(served))
            print(f"| {profile} | {n} | {schedule} | {asking} | {shown} | {limits.get((profile, n), '-')} |")
    for (profile, n), limit in limits.items():
        print(f"limit {profile} at {n} steps = {limit}: {limit_formula(model[profile], hz, max(robots), n)}")
    cores = load.cores()
    print(f"\n({time.perf_counter() - started:.0f} s; other processes used {_num(cores, '.2f')} cores meanwhile)")
    if ("14b", REFERENCE_STEPS) in limits:
        print(capacity_line(rows, limits["14b", REFERENCE_STEPS]), flush=True)
    if args.json:
        finite = lambda v: None if isinstance(v, float) and math.isnan(v) else v  # noqa: E731 (JSON has no NaN)
        shown_limits = {f"{p}@{n}": limit for (p, n), limit in limits.items()}
        print(json.dumps({"rows": [{k: finite(v) for k, v in asdict(r).items()} for r in rows], "limits": shown_limits}))


if __name__ == "__main__":
    main()
