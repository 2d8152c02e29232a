#!/usr/bin/env python
"""Paged KV cache vs upstream concat-and-slice: DiT self-attention per chunk, DROID geometry.

What is measured: only self-attention and its KV handling, per AR call ("chunk"), for

* ``paged``  -- ``ardiff_kv.PagedKVCache`` + ``ardiff_kv.paged_write_attend`` (the serving path): each forward
  writes its K/V into pages (``index_copy_``), gathers the visible pages and attends;
* ``concat`` -- ``ardiff_kv.DenseKVCache`` / ``DenseLayerKV.attend``, upstream DreamZero's
  ``cat(cache, new)[-window:]``: every forward concatenates the window, appends the action/state
  K/V and (prefill) clones the result back into the cache.

Geometry is DreamZero-DROID's: 880 tokens per latent frame (one page), a 9-frame window,
2-frame chunks, 24 action + 1 state token, head_dim 128; the number of heads and layers is
reduced (``--heads``, ``--layers``) so a run fits a few minutes on a small CPU. Time and bytes
scale linearly with heads x layers, so ratios carry over; absolute ms do not.

The call sequence is DreamZero's (``policies/dreamzero/policy.py``): per AR call one prefill
forward that commits (1 frame at a window start, else the 2 observed frames) and
``--denoise-steps`` denoise forwards (2 frames + 25 action/state tokens, never committed), for
each CFG branch; the window restarts every 4 calls (current_start_frame 0 -> 3 -> 5 -> 7 -> 9 ->
reset). q/k/v are random per layer: projections are not timed, only attention + KV handling.
All paths run in ONE process, interleaved forward by forward (alternating which goes first),
so machine noise hits all of them alike. The first call is a warm-up and is excluded. CPU time
other processes burn meanwhile is reported: with fewer free cores than threads, every parallel
op waits on a descheduled thread, which no interleaving cancels (use ``--threads 1`` then).

Reported per path: ms per chunk (mean / median), peak memory (RSS high-water of a fresh
subprocess that runs one window of that path alone, minus its RSS before the KV cache exists;
torch exposes no CPU allocator statistics), the KV bytes that are live or in flight (analytic),
and bytes copied per chunk (analytic, from the cat / clone / index_copy_ / index_select /
copy_ each path performs, checked against an instrumented run that counts the bytes those
aten ops write) with the wall time those copy ops take (torch profiler).

Why the 4-D variant: on CPU, ``scaled_dot_product_attention`` only takes its flash kernel for
4-D inputs; the paged ``sdpa`` backend passes 3-D ``(H, L, D)`` tensors and gets the math kernel,
which materializes the H x Lq x Lk score matrix. The script detects which kernel each path gets.

    python scripts/bench_kv.py                       # default run (a few minutes)
    python scripts/bench_kv.py --quick --json        # smoke run
    python scripts/bench_kv.py --heads 8 --dtypes float32 --paths paged,concat
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from benchlib import ForeignLoad, contended, contention_warning
from torch.utils._python_dispatch import TorchDispatchMode

from ardiff_kv import Branch, DenseKVCache, KVSpec, PagedKVCache, PagedLayerInputs, paged_write_attend
from ardiff_kv.attention import sdpa_paged_attention, write_attend

# DreamZero-DROID geometry (docs/spec.md §6).
PAGE = 880  # tokens per latent frame = one page
WINDOW = 9  # local_attn_size in latent frames
CHUNK = 2  # num_frame_per_block: latent frames per chunk
EXTRA = 25  # 24 action + 1 state tokens, attended after the video, never cached
HEAD_DIM = 128
CALLS_PER_WINDOW = 4  # current_start_frame 0 -> 3 -> 5 -> 7 -> 9 (restart)
ALL_PATHS = ("paged", "concat")
MIB = 2**20


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Forward:
    frames: int  # new video frames this forward brings
    commit: bool  # prefill (writes the cache) or denoise step (scratch)
    extra: int  # action/state tokens
    resident: int  # frames committed in this window before the forward

    @property
    def visible(self) -> int:
        """Frames attention sees: the cache plus the new frames, capped by the window."""
        return min(self.resident + self.frames, WINDOW)

    @property
    def kind(self) -> str:
        return f"{'prefill' if self.commit else 'denoise'}{self.frames}"


@dataclass(frozen=True)
class Call:
    index: int
    window_start: bool
    forwards: tuple[Forward, ...]

    @property
    def visible(self) -> int:
        """Frames the denoise forwards see: labels the call's position in the window."""
        return self.forwards[-1].visible


def rollout_plan(calls: int, denoise_steps: int) -> list[Call]:
    """DreamZero's call sequence: prefill (commit) then denoise forwards, window restart when full."""
    plan: list[Call] = []
    start_frame = resident = 0
    for index in range(calls):
        if start_frame >= WINDOW:
            start_frame = resident = 0
        window_start = start_frame == 0
        if window_start:
            prefill = Forward(1, True, 0, 0)  # the first frame's latent at timestep 0
            start_frame = 1
        else:
            prefill = Forward(CHUNK, True, 0, resident)  # the 2 observed latents
        resident += prefill.frames
        denoise = Forward(CHUNK, False, EXTRA, resident)
        plan.append(Call(index, window_start, (prefill,) + (denoise,) * denoise_steps))
        start_frame += CHUNK
    return plan


@dataclass(frozen=True)
class Setup:
    heads: int
    layers: int
    denoise_steps: int
    branches: tuple[Branch, ...]
    dtype: torch.dtype

    @property
    def token_bytes(self) -> int:
        """One token's K (or V) in one layer."""
        return self.heads * HEAD_DIM * torch.empty((), dtype=self.dtype).element_size()


LayerTensors = dict[str, tuple[torch.Tensor, ...]]  # kind -> (q, k, v, extra_k, extra_v)


def random_inputs(setup: Setup, seed: int = 0) -> list[LayerTensors]:
    """Per layer and forward kind, random (L, H, D) q / k / v, made once (not timed)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(tokens: int) -> torch.Tensor:
        return torch.randn(tokens, setup.heads, HEAD_DIM, generator=gen).to(setup.dtype)

    kinds = {"prefill1": (1, 0), f"prefill{CHUNK}": (CHUNK, 0), f"denoise{CHUNK}": (CHUNK, EXTRA)}
    layers = []
    for _ in range(setup.layers):
        tensors = {}
        for kind, (frames, extra) in kinds.items():
            video = frames * PAGE
            tensors[kind] = (rand(video + extra), rand(video), rand(video), rand(extra), rand(extra))
        layers.append(tensors)
    return layers


# ------------------------------------------------------------------------------- paths


AttendFn = Callable[..., torch.Tensor]


def kv_spec(setup: Setup) -> KVSpec:
    """Self-attention only: no cross-attention slots (they are the same for both paths)."""
    return KVSpec(
        num_layers=setup.layers,
        num_heads=setup.heads,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        window_pages=WINDOW,
        max_new_pages=CHUNK,
        max_extra_tokens=EXTRA,
        dtype=setup.dtype,
    )


def pool_pages(spec: KVSpec, num_branches: int) -> int:
    """Pages (null page included) of a pool that holds exactly one session."""
    return num_branches * spec.pages_per_branch + 1


def attend_op(cache: PagedKVCache, inputs: PagedLayerInputs, q, k, v, ek, ev, scale: float) -> torch.Tensor:
    """The serving path: the fused write + attend custom op."""
    return paged_write_attend(inputs, q, k, v, ek, ev, scale)


def attend_op_body(cache: PagedKVCache, inputs: PagedLayerInputs, q, k, v, ek, ev, scale: float) -> torch.Tensor:
    """What the custom op executes, called directly so a dispatch mode sees its aten ops."""
    return write_attend(q, k, v, ek, ev, scale, *inputs)


class PagedPath:
    """One session in a pool sized for exactly one session (what the engine reserves per session)."""

    def __init__(self, setup: Setup, attend: AttendFn) -> None:
        spec = kv_spec(setup)
        self.setup = setup
        self.cache = PagedKVCache(spec, num_pages=pool_pages(spec, len(setup.branches)), max_sessions=1, branches=setup.branches)
        self.session = self.cache.open_session("bench")
        self.attend = attend

    def reset_window(self) -> None:
        self.session.restart_window(keep_cross_text=True)

    def forward(self, branch: Branch, fwd: Forward, layers: list[LayerTensors], scale: float) -> None:
        ctx = self.session.begin_forward(branch, num_video_tokens=fwd.frames * PAGE, commit=fwd.commit, extra_tokens=fwd.extra)
        per_layer = ctx.prepare()
        for i, tensors in enumerate(layers):
            q, k, v, ek, ev = tensors[fwd.kind]
            out = self.attend(self.cache, per_layer[i], q, k, v, ek if fwd.extra else None, ev if fwd.extra else None, scale)
            out.flatten(-2)  # what the output projection reads (a view when the layout allows)
        self.session.complete(branch)

    def kv_bytes(self) -> int:
        return self.cache.storage.nbytes


class ConcatPath:
    """Upstream's concat-and-slice cache, one per CFG branch."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.caches = {b: DenseKVCache(setup.layers, WINDOW * PAGE) for b in setup.branches}

    def reset_window(self) -> None:
        for cache in self.caches.values():
            cache.reset()

    def forward(self, branch: Branch, fwd: Forward, layers: list[LayerTensors], scale: float) -> None:
        handles = self.caches[branch].layers(update=fwd.commit)
        for handle, tensors in zip(handles, layers):
            q, k, v, ek, ev = (t[None] for t in tensors[fwd.kind])
            out = handle.attend(q, k, v, ek if fwd.extra else None, ev if fwd.extra else None, scale)
            out.flatten(2)  # the DiT's output projection input

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.caches.values() for t in c.keys + c.values if t is not None)


def make_path(name: str, setup: Setup, *, instrumented: bool = False) -> PagedPath | ConcatPath:
    if name == "concat":
        return ConcatPath(setup)
    if name == "paged":
        return PagedPath(setup, attend_op_body if instrumented else attend_op)
    raise ValueError(f"unknown path {name!r}")


@torch.inference_mode()
def run_call(path: PagedPath | ConcatPath, call: Call, layers: list[LayerTensors]) -> float:
    """One AR call of one path; returns wall ms (window restart included: it is KV handling)."""
    return run_call_interleaved({"path": path}, call, layers)["path"]


@torch.inference_mode()
def run_call_interleaved(paths: dict[str, PagedPath | ConcatPath], call: Call, layers: list[LayerTensors]) -> dict[str, float]:
    """One AR call of every path, forward by forward, alternating which path goes first.

    Interleaving at forward granularity (tens of ms to a second) means a neighbour process that
    steals a core slows every path alike, which call-level alternation cannot promise.
    """
    scale = HEAD_DIM**-0.5
    ms = dict.fromkeys(paths, 0.0)
    names = list(paths)
    for index, fwd in enumerate(((None,) if call.window_start else ()) + call.forwards):
        for name in names if (call.index + index) % 2 == 0 else reversed(names):
            path = paths[name]
            start = time.perf_counter()
            if fwd is None:
                path.reset_window()
            else:
                for branch in path.setup.branches:
                    path.forward(branch, fwd, layers, scale)
            ms[name] += (time.perf_counter() - start) * 1000.0
    return ms


# ------------------------------------------------------------------- bytes, analytically


def forward_copy_bytes(path: str, fwd: Forward, setup: Setup) -> int:
    """Bytes one forward of one layer and branch copies (K and V), from the ops each path runs."""
    e = setup.token_bytes
    new, extra, visible = fwd.frames * PAGE, fwd.extra, fwd.visible * PAGE
    if path == "paged":
        writes = 2 * (new + extra)  # index_copy_ into the pages (video, then action/state scratch)
        gathered = 2 * -(-(visible + extra) // PAGE) * PAGE  # index_select of whole pages
        out = new + extra  # out[q0:q1] = o[0].transpose(0, 1)
        return (writes + gathered + out) * e
    if path == "concat":
        cached = fwd.resident * PAGE
        cat = 2 * (cached + new) if cached else 0  # cat(cache, new); no cat on an empty cache
        cat_extra = 2 * (visible + extra) if extra else 0  # cat(window, action/state)
        clone = 2 * visible if fwd.commit else 0  # the prefill replaces the cache
        return (cat + cat_extra + clone) * e
    raise ValueError(path)


def call_copy_bytes(path: str, call: Call, setup: Setup) -> int:
    return sum(forward_copy_bytes(path, f, setup) for f in call.forwards) * setup.layers * len(setup.branches)


def block_table_kernel_bytes(call: Call, setup: Setup) -> int:
    """A paged kernel reading pages in place (the GPU flash backend) only writes the new K/V."""
    return sum(2 * (f.frames * PAGE + f.extra) for f in call.forwards) * setup.token_bytes * setup.layers * len(setup.branches)


def kv_peak_bytes(path: str, plan: Sequence[Call], setup: Setup) -> int:
    """KV bytes alive at the worst moment: storage plus the copies one attend holds in flight.

    Concat: every layer and branch holding ``resident`` frames plus one attend's buffers (exact
    for denoise forwards, which set the peak; a prefill's layers are updated one by one).
    """
    e, nb, nl = setup.token_bytes, len(setup.branches), setup.layers
    if path != "concat":
        spec = kv_spec(setup)
        storage = 2 * (pool_pages(spec, nb) + nb * spec.scratch_pages_per_branch) * PAGE * e * nl
        gather = max(2 * -(-(f.visible * PAGE + f.extra) // PAGE) * PAGE for c in plan for f in c.forwards)
        return storage + gather * e
    peak = 0
    for call in plan:
        for fwd in call.forwards:
            resident = fwd.resident
            cache = 2 * resident * PAGE * e * nl * nb
            cat = 2 * (resident + fwd.frames) * PAGE if resident else 0
            in_flight = cat + (2 * (fwd.visible * PAGE + fwd.extra) if fwd.extra else 0) + (2 * fwd.visible * PAGE if fwd.commit else 0)
            peak = max(peak, cache + in_flight * e)
    return peak


# ---------------------------------------------------------------- instrumented checks


class CopyCounter(TorchDispatchMode):
    """Counts bytes written by data-movement aten ops on floating-point tensors."""

    MOVES = {"cat", "clone", "index_select", "index_copy_", "index_copy", "copy_", "_to_copy", "stack", "index_put_", "index", "slice_scatter"}
    IN_PLACE_SOURCE = {"index_copy_": 3, "copy_": 1, "index_put_": 2}  # arg index of the written data

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.MOVES:
            written = args[self.IN_PLACE_SOURCE[name]] if name in self.IN_PLACE_SOURCE else out
            tensors = written if isinstance(written, (list, tuple)) else [written]
            n = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point())
            self.bytes += n
            self.ops[name] = self.ops.get(name, 0) + n
        return out


def verify_copy_count(setup: Setup, paths: Sequence[str]) -> dict[str, Any]:
    """Run a window + restart per path under CopyCounter and compare with the analytic count."""
    small = replace(setup, heads=1, layers=1, denoise_steps=2)
    plan = rollout_plan(CALLS_PER_WINDOW + 1, small.denoise_steps)
    layers = random_inputs(small)
    result: dict[str, Any] = {}
    for name in paths:
        path = make_path(name, small, instrumented=True)
        mismatches = []
        for call in plan:
            with CopyCounter() as counter:
                run_call(path, call, layers)
            expected = call_copy_bytes(name, call, small)
            if counter.bytes != expected:
                mismatches.append({"call": call.index, "counted": counter.bytes, "analytic": expected, "ops": counter.ops})
        result[name] = {"ok": not mismatches, "mismatches": mismatches[:3]}
    return result


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def sdpa_kernels(dtype: torch.dtype) -> dict[str, str]:
    """Which CPU SDPA kernel each path's attention call reaches (flash or the math fallback)."""
    q = torch.randn(PAGE, 1, HEAD_DIM).to(dtype)
    pages = torch.randn(2, PAGE, 1, HEAD_DIM).to(dtype)
    table, cu_q, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, PAGE]), torch.tensor([2 * PAGE])
    no_slots = torch.zeros(0, dtype=torch.long)
    inputs = PagedLayerInputs(pages, pages, no_slots, no_slots, table, cu_q, lens, PAGE, 2 * PAGE, "sdpa")
    window = pages.flatten(0, 1)[None]  # (1, L, H, D), what the concat path hands to SDPA
    concat = DenseKVCache(1, 2 * PAGE).layers(update=False)[0]
    calls: dict[str, Callable[[], object]] = {
        "paged": lambda: sdpa_paged_attention(q, inputs, 0.1),  # the op's CPU backend
        "concat": lambda: concat.attend(q[None], window, window, None, None, 0.1),
    }
    kernels = {}
    for name, fn in calls.items():
        with OpLog() as oplog:
            fn()
        kernels[name] = "flash" if any("flash" in n for n in oplog.names) else "math"
    return kernels


def check_bf16() -> str | None:
    """None if CPU bf16 SDPA is usable, else why it is skipped (unsupported or absurdly slow)."""
    q32 = torch.randn(1, 2, 2 * PAGE, HEAD_DIM)
    k32 = torch.randn(1, 2, 5 * PAGE, HEAD_DIM)
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k = q32.to(dtype), k32.to(dtype)
        try:
            F.scaled_dot_product_attention(q, k, k)
        except RuntimeError as exc:
            return f"bf16 SDPA unsupported on this CPU build ({exc})"
        start = time.perf_counter()
        for _ in range(2):
            F.scaled_dot_product_attention(q, k, k)
        times[dtype] = time.perf_counter() - start
    if times[torch.bfloat16] > 4 * times[torch.float32]:
        return f"bf16 SDPA is {times[torch.bfloat16] / times[torch.float32]:.1f}x slower than fp32 here"
    return None


COPY_EVENTS = {"aten::cat", "aten::clone", "aten::index_select", "aten::index_copy_", "aten::copy_", "aten::stack"}


def _ancestors(event: Any) -> list[str]:
    names = []
    while event.cpu_parent is not None:
        event = event.cpu_parent
        names.append(event.name)
    return names


def profiled_copy_ms(names: Sequence[str], setup: Setup, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Wall ms the KV copy ops of one forward (all layers, all branches) take, per path and kind.

    Torch profiler over one window + restart with one denoise step per call (every denoise step
    copies the same bytes), paths interleaved forward by forward. A denoise forward changes no
    state, so it is repeated and the fastest repeat kept (another process stealing the core only
    ever adds time). Counts outermost copy ops (a clone's inner copy_ is part of the clone) and
    none inside SDPA (the math kernel's own casts are attention, not KV handling).
    """
    plan = rollout_plan(CALLS_PER_WINDOW + 1, 1)
    layers = random_inputs(setup)
    paths = {name: make_path(name, setup) for name in names}
    run_call_interleaved(paths, plan[0], layers)  # warm-up
    scale = HEAD_DIM**-0.5
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for call in plan[1:]:
            if call.window_start:
                for path in paths.values():
                    path.reset_window()
            for index, fwd in enumerate(call.forwards):
                for rep in range(1 if fwd.commit else repeats):
                    for name, path in paths.items():
                        with torch.profiler.record_function(f"fwd|{name}|{call.index}|{index}|{fwd.kind}|{rep}"):
                            for branch in setup.branches:
                                path.forward(branch, fwd, layers, scale)
    per_mark: dict[str, float] = {}
    for event in prof.events():
        if event.name not in COPY_EVENTS:
            continue
        up = _ancestors(event)
        if any(n in COPY_EVENTS or "scaled_dot_product" in n for n in up):
            continue
        mark = next((n for n in up if n.startswith("fwd|")), None)
        if mark is not None:
            per_mark[mark] = per_mark.get(mark, 0.0) + event.cpu_time_total
    fastest: dict[tuple[str, str, str, str], float] = {}  # (path, call, forward, kind) -> us
    for mark, us in per_mark.items():
        _, name, call_index, index, kind, _ = mark.split("|")
        key = (name, call_index, index, kind)
        fastest[key] = min(fastest.get(key, us), us)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for (name, _, _, kind), us in fastest.items():
        samples[name].setdefault(kind, []).append(us / 1000.0)
    return {name: {kind: statistics.fmean(v) for kind, v in kinds.items()} for name, kinds in samples.items()}


def call_copy_ms(per_forward: dict[str, float], call: Call) -> float:
    return sum(per_forward.get(f.kind, 0.0) for f in call.forwards)


# ------------------------------------------------------------------------ memory probe


def _rss_kib(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def probe_memory(name: str, setup: Setup) -> dict[str, float]:
    """Run in a fresh process: peak RSS growth over one window + restart of one path."""
    plan = rollout_plan(CALLS_PER_WINDOW, 1)  # one full window; every denoise step allocates the same
    layers = random_inputs(setup)
    run_call(make_path(name, setup), plan[0], layers)  # page in torch kernels and their scratch first
    try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
        base, method = _rss_kib("VmRSS"), "VmHWM"
    except OSError:
        base, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    path = make_path(name, setup)
    for call in plan:
        run_call(path, call, layers)
    peak = _rss_kib("VmHWM") if method == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": (peak - base) / 1024, "method": method}


def measure_memory(name: str, setup: Setup, threads: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--probe",
        name,
        "--dtypes",
        str(setup.dtype).removeprefix("torch."),
        "--heads",
        str(setup.heads),
        "--layers",
        str(setup.layers),
        "--branches",
        str(len(setup.branches)),
        "--denoise-steps",
        str(setup.denoise_steps),
        "--threads",
        str(threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"peak_mib": None, "method": f"probe failed: {proc.stderr.strip()[-200:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ the run


@dataclass
class PathResult:
    call_ms: list[float] = field(default_factory=list)  # measured calls only
    copied: list[int] = field(default_factory=list)
    copy_ms: list[float] = field(default_factory=list)  # profiled copy-op time, per measured call
    memory: dict[str, Any] = field(default_factory=dict)
    kv_peak: int = 0

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.call_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.call_ms)

    @property
    def copied_per_chunk(self) -> float:
        return statistics.fmean(self.copied)


def run_dtype(setup: Setup, paths: Sequence[str], calls: int, threads: int, memory: bool) -> tuple[dict[str, PathResult], list[Call]]:
    plan = rollout_plan(calls, setup.denoise_steps)
    layers = random_inputs(setup)
    runners = {name: make_path(name, setup) for name in paths}
    results = {name: PathResult() for name in paths}
    dtype_name = str(setup.dtype).removeprefix("torch.")
    for call in plan:
        ms = run_call_interleaved(runners, call, layers)
        if call.index > 0:  # call 0 is the warm-up
            for name in paths:
                results[name].call_ms.append(ms[name])
                results[name].copied.append(call_copy_bytes(name, call, setup))
        log(f"[{dtype_name}] call {call.index + 1}/{len(plan)} (window {call.visible} frames): " + "  ".join(f"{n} {ms[n]:.0f} ms" for n in paths))
    del runners
    log(f"[{dtype_name}] profiling copy ops")
    copy_ms = profiled_copy_ms(paths, setup)
    for name in paths:
        results[name].copy_ms = [call_copy_ms(copy_ms[name], call) for call in plan[1:]]
        results[name].kv_peak = kv_peak_bytes(name, plan, setup)
        if memory:
            log(f"[{dtype_name}] memory probe: {name}")
            results[name].memory = measure_memory(name, setup, threads)
    return results, plan[1:]


def by_window_position(results: dict[str, PathResult], measured: list[Call]) -> dict[str, dict[int, float]]:
    """Mean ms per path by the frames the denoise steps see (3, 5, 7, 9)."""
    out: dict[str, dict[int, float]] = {}
    for name, res in results.items():
        groups: dict[int, list[float]] = {}
        for call, ms in zip(measured, res.call_ms):
            groups.setdefault(call.visible, []).append(ms)
        out[name] = {v: statistics.fmean(g) for v, g in sorted(groups.items())}
    return out


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_table(dtype_name: str, results: dict[str, PathResult], positions: dict[str, dict[int, float]], foreign: float | None) -> None:
    ref = results["concat"]
    header = (
        f"{'path':<13}{'ms/chunk':>10}{'median':>10}{'ratio':>7}{'peak MiB':>10}{'KV MiB':>8}"
        f"{'copied MiB/chunk':>18}{'copy ratio':>12}{'copy ms/chunk':>15}"
    )
    print(f"\n{dtype_name}" + ("" if foreign is None else f" (other processes used {foreign:.2f} cores meanwhile)"))
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        print(
            f"{name:<13}{res.mean_ms:>10.1f}{res.median_ms:>10.1f}{res.mean_ms / ref.mean_ms:>7.2f}"
            f"{_num(res.memory.get('peak_mib')):>10}{res.kv_peak / MIB:>8.1f}"
            f"{res.copied_per_chunk / MIB:>18.1f}{res.copied_per_chunk / ref.copied_per_chunk:>12.2f}"
            f"{statistics.fmean(res.copy_ms):>15.1f}"
        )
    frames = list(next(iter(positions.values())))
    print(
        "ms/chunk by window fill (frames seen by the denoise steps): "
        + ", ".join(f"{v}f: " + " / ".join(f"{positions[n][v]:.0f}" for n in results) for v in frames)
        + f"  ({' / '.join(results)})"
    )


def summary_lines(report: dict[str, Any], setup: Setup) -> list[str]:
    """The "where paging wins" paragraph, from the numbers of the first dtype (and the others' ratios)."""
    first = report["by_dtype"][report["dtypes"][0]]
    paged, concat = first["paged"], first["concat"]
    ratio = lambda a, b, key: a[key] / b[key]  # noqa: E731
    lines = [
        f"where paging wins ({report['dtypes'][0]}, {setup.heads} head(s) x {setup.layers} layer(s), {len(setup.branches)} branch(es)):",
        f"- copies: paged moves {paged['bytes_copied_per_chunk'] / MIB:.0f} MiB per chunk (writes + page gather), concat "
        f"{concat['bytes_copied_per_chunk'] / MIB:.0f} MiB (cat + cat + clone): {ratio(paged, concat, 'bytes_copied_per_chunk'):.2f}x. "
        f"A block-table kernel reading pages in place (the GPU flash backend) would move only the writes: "
        f"{report['block_table_kernel_bytes_per_chunk'] / MIB:.0f} MiB "
        f"({report['block_table_kernel_bytes_per_chunk'] / concat['bytes_copied_per_chunk']:.2f}x).",
        f"- copy time (profiled): paged {paged['copy_ms_per_chunk']:.0f} ms, concat {concat['copy_ms_per_chunk']:.0f} ms per chunk "
        f"= {paged['copy_ms_per_chunk'] / paged['ms_per_chunk']:.1%} / {concat['copy_ms_per_chunk'] / concat['ms_per_chunk']:.1%} "
        f"of the chunk: on CPU the attention FLOPs dominate, so the copies paging saves barely move the clock.",
        f"- time: paged {paged['ms_per_chunk']:.0f} ms vs concat {concat['ms_per_chunk']:.0f} ms per chunk "
        f"({ratio(paged, concat, 'ms_per_chunk'):.2f}x).",
    ]
    kernels = report["sdpa_kernel"]
    if kernels.get("paged") == "math" and kernels.get("concat") == "flash":
        lines.append(
            "  The paged sdpa backend calls SDPA with 3-D (H, L, D) tensors, which CPU SDPA runs on its math kernel "
            "(H x Lq x Lk scores materialized); concat's 4-D call gets the flash kernel. That, not paging, decides "
            "the paged row's time and peak memory."
        )
    lines.append(
        "- memory: the paged pool is reserved up front for the worst case (window + in-flight chunk per branch); "
        "concat holds only what is cached but allocates fresh window-sized buffers every forward. Peak RSS growth: "
        + ", ".join(f"{name} {_num(row['peak_mib'], 0)} MiB" for name, row in first.items())
        + "; analytic KV (storage + copies in flight): "
        + ", ".join(f"{name} {row['kv_peak_mib']:.0f} MiB" for name, row in first.items())
        + "."
    )
    for dtype_name in report["dtypes"][1:]:
        other = report["by_dtype"][dtype_name]
        lines.append(
            f"- {dtype_name}: "
            + ", ".join(
                f"{name} {row['ms_per_chunk']:.0f} ms ({row['ms_per_chunk'] / other['concat']['ms_per_chunk']:.2f}x)" for name, row in other.items()
            )
            + " per chunk."
        )
    scale = 40 * 40 / (setup.heads * setup.layers) * 2 / torch.empty((), dtype=setup.dtype).element_size()
    lines.append(
        f"- at DreamZero-DROID scale (40 heads x 40 layers, bf16, same steps and branches) concat copies "
        f"{concat['bytes_copied_per_chunk'] * scale / 2**30:.0f} GiB per chunk, the paged sdpa path "
        f"{paged['bytes_copied_per_chunk'] * scale / 2**30:.0f} GiB, an in-place paged kernel "
        f"{report['block_table_kernel_bytes_per_chunk'] * scale / 2**30:.1f} GiB: where the GPU backend wins."
    )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=1, help="attention heads of head_dim 128 (DROID: 40)")
    parser.add_argument("--layers", type=int, default=1, help="DiT layers (DROID: 40)")
    parser.add_argument("--denoise-steps", type=int, default=16, help="denoise forwards per call (16: no DiT step cache)")
    parser.add_argument("--branches", type=int, choices=(1, 2), default=2, help="CFG branches run per forward")
    parser.add_argument("--windows", type=int, default=3, help="attention windows to roll through (4 calls each)")
    parser.add_argument("--dtypes", help="comma-separated torch dtypes (default float32,bfloat16; --quick: float32)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--paths", default="paged,concat", help="comma-separated: paged, concat")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-path peak-RSS subprocesses")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 head, 2 denoise steps, 1 window + restart")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: memory probe of one path
    args = parser.parse_args(argv)
    if args.quick:
        args.heads, args.denoise_steps, args.windows = 1, 2, 1
    if args.dtypes is None:
        args.dtypes = "float32" if args.quick else "float32,bfloat16"
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
    branches = (Branch.COND, Branch.UNCOND)[: args.branches]
    base = Setup(args.heads, args.layers, args.denoise_steps, branches, dtypes[0])

    if args.probe:
        print(json.dumps(probe_memory(args.probe, base)))
        return

    load = ForeignLoad()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not {"paged", "concat"} <= set(paths) or not set(paths) <= set(ALL_PATHS):
        raise SystemExit(f"--paths must include paged and concat, from {ALL_PATHS}")
    calls = 1 + CALLS_PER_WINDOW * args.windows  # + the warm-up call
    bf16_note = check_bf16() if torch.bfloat16 in dtypes else None
    if bf16_note:
        log(f"skipping bfloat16: {bf16_note}")
        dtypes = [d for d in dtypes if d != torch.bfloat16]
    log("checking the analytic copy count against an instrumented run")
    verified = verify_copy_count(base, paths)
    report: dict[str, Any] = {
        "bench": "kv",
        "torch": torch.__version__,
        "threads": args.threads,
        "geometry": {"page_tokens": PAGE, "window_frames": WINDOW, "chunk_frames": CHUNK, "extra_tokens": EXTRA, "head_dim": HEAD_DIM},
        "heads": args.heads,
        "layers": args.layers,
        "denoise_steps": args.denoise_steps,
        "branches": args.branches,
        "calls": calls,
        "measured_calls": calls - 1,
        "dtypes": [],
        "by_dtype": {},
        "bf16_note": bf16_note,
        "copy_count_verified": all(v["ok"] for v in verified.values()),
        "copy_count_check": verified,
        "sdpa_kernel": {},
        "foreign_load_cores_by_dtype": {},
    }
    print(
        f"bench_kv: DiT self-attention + KV handling per AR call, DROID geometry ({PAGE} tokens/frame, {WINDOW}-frame "
        f"window, {CHUNK}-frame chunks, {EXTRA} action/state tokens), {args.heads} heads x {HEAD_DIM}, {args.layers} "
        f"layer(s), 1 prefill + {args.denoise_steps} denoise forwards x {args.branches} branch(es) per call, "
        f"{calls - 1} calls over {args.windows} windows (+1 warm-up), {args.threads} threads"
    )
    for dtype in dtypes:
        dtype_name = str(dtype).removeprefix("torch.")
        setup = replace(base, dtype=dtype)
        dtype_load = ForeignLoad()
        results, measured = run_dtype(setup, paths, calls, args.threads, not args.no_memory)
        positions = by_window_position(results, measured)
        report["foreign_load_cores_by_dtype"][dtype_name] = dtype_load.cores()
        print_table(dtype_name, results, positions, dtype_load.cores())
        report["dtypes"].append(dtype_name)
        report["sdpa_kernel"][dtype_name] = sdpa_kernels(dtype)
        report["by_dtype"][dtype_name] = {
            name: {
                "ms_per_chunk": res.mean_ms,
                "ms_per_chunk_median": res.median_ms,
                "call_ms": res.call_ms,
                "peak_mib": res.memory.get("peak_mib"),
                "peak_method": res.memory.get("method"),
                "kv_peak_mib": res.kv_peak / MIB,
                "bytes_copied_per_chunk": res.copied_per_chunk,
                "copy_ms_per_chunk": statistics.fmean(res.copy_ms),
                "ms_by_window_frames": positions[name],
            }
            for name, res in results.items()
        }
        if dtype == dtypes[0]:
            report["block_table_kernel_bytes_per_chunk"] = statistics.fmean(block_table_kernel_bytes(c, setup) for c in measured)
    report["sdpa_kernel"] = report["sdpa_kernel"][report["dtypes"][0]]
    first = report["by_dtype"][report["dtypes"][0]]
    report |= {
        "dtype": report["dtypes"][0],
        "paged_ms_per_chunk": first["paged"]["ms_per_chunk"],
        "concat_ms_per_chunk": first["concat"]["ms_per_chunk"],
        "ms_ratio": first["paged"]["ms_per_chunk"] / first["concat"]["ms_per_chunk"],
        "paged_peak_mib": first["paged"]["peak_mib"],
        "concat_peak_mib": first["concat"]["peak_mib"],
        "paged_bytes_copied_per_chunk": first["paged"]["bytes_copied_per_chunk"],
        "concat_bytes_copied_per_chunk": first["concat"]["bytes_copied_per_chunk"],
        "copy_ratio": first["paged"]["bytes_copied_per_chunk"] / first["concat"]["bytes_copied_per_chunk"],
    }
    report["foreign_load_cores"] = load.cores()
    print()
    report["contended"] = contended(report["foreign_load_cores"], args.threads)
    if report["contended"]:
        print(contention_warning(report["foreign_load_cores"]))
    print(
        f"copy count: analytic == instrumented for {', '.join(verified)}: {report['copy_count_verified']}"
        + ("" if report["copy_count_verified"] else f" ({verified})")
    )
    if bf16_note:
        print(f"bfloat16 skipped: {bf16_note}")
    print("\n".join(summary_lines(report, base)))
    if args.json:
        print(json.dumps(report, default=float))


if __name__ == "__main__":
    main()
