"""What ``ardiff-client --async`` prints: a progress line per chunk while it runs (stderr), then the
episode's summary with units and what each number means (``--json`` prints ``EpisodeReport.summary()``
as it is instead)."""

from __future__ import annotations

import math

from ardiff_client.async_runner import ChunkEvent, EpisodeReport
from ardiff_policies.continuation import NO_PREVIOUS_CHUNK, PROMPT_CHANGE, UNKNOWN_CHUNK_ID

# Why a server served an asked-for continuation as a fresh chunk (ardiff_policies.continuation's reasons).
FRESH_MEANINGS = {
    NO_PREVIOUS_CHUNK: "no earlier chunk in the session to continue (its first call, or after a reset)",
    PROMPT_CHANGE: "the prompt changed: the old chunk plans another task",
    UNKNOWN_CHUNK_ID: "the chunk_id named is not the session's last chunk",
}
LABEL = 22  # width of the summary's names


def progress_line(event: ChunkEvent, steps: int, control_hz: float) -> str:
    """``chunk 3 at step 45/120 (3.0 s): 312 ms, 24 actions, frozen 5, 19 left to execute, idle 8 steps so far``."""
    fresh = f", served fresh: {event.continuation}" if event.continuation not in (None, "applied") else ""
    return (
        f"chunk {event.number} at step {event.step}/{steps} ({event.step / control_hz:.1f} s): {event.latency_s * 1000:.0f} ms, "
        f"{event.actions} actions, frozen {event.frozen}, {event.left} left to execute, idle {event.idle_steps} steps so far{fresh}"
    )


def summary_lines(report: EpisodeReport) -> list[str]:
    """The summary as text: each line a name (``LABEL`` wide) and its value with units and meaning."""
    s = report.summary()
    hz, seconds = report.control_hz, report.steps / report.control_hz
    first_wait = report.idle_per_chunk[0] if report.idle_per_chunk else report.idle_steps
    lines = [f"{s['mode']} at {hz:g} Hz: {s['steps']} control steps ({seconds:.1f} s), {s['chunks']} chunks ({s['chunks_per_s']:.2f} per s)"]

    def row(name: str, text: str) -> None:
        lines.append(f"  {name:{LABEL}s}{text}")

    row("idle", f"{s['idle_steps']} steps ({s['idle_steps'] / hz:.2f} s) the robot stood still, {first_wait} of them waiting for the first chunk")
    row("steady idle / chunk", f"{s['steady_idle_per_chunk']:.2f} steps per chunk after the first (0: the robot never waits for a chunk)")
    row("idle / chunk", f"{s['idle_steps_per_chunk']:.2f} steps per chunk, the first chunk's wait included")
    if report.latencies_s:
        row("latency", f"p50 {s['latency_p50_ms']:.1f} ms, p99 {s['latency_p99_ms']:.1f} ms (request sent to chunk received)")
    else:
        row("latency", "no reply arrived")
    if math.isnan(s["seam_ratio"]):
        row("seam", "no splice to measure (fewer than two chunks executed)")
    else:
        row(
            "seam",
            f"{s['seam_ratio']:.2f}x the median step inside a chunk (1x: as smooth as within a chunk): a jump of "
            f"{s['seam_jump']:.4f} against {s['median_inner_step']:.4f}, median L2 over the joint columns in action units",
        )
    if not math.isnan(s["old_step_at_seam"]):
        row(
            "old step at seam",
            f"{s['old_step_at_seam']:.4f}: the old chunk's own next step there, the seam of a continuation that follows it exactly",
        )
    if report.asked_left:
        row(
            "asking",
            f"{s['asking']}: {s['calls_per_chunk']:.2f} calls per chunk's worth of actions executed (1: one call per chunk), "
            f"asked with a median {s['asked_left_median']:.0f} actions left",
        )
    if report.frozen:
        row("frozen", f"{sum(report.frozen) / len(report.frozen):.1f} leading actions per chunk equal to what the robot executed meanwhile")
    if report.continuations_asked:
        fresh = sum(report.fresh_reasons.values())
        why = "; ".join(
            f"{reason} {count} ({FRESH_MEANINGS.get(reason, 'the reason the server gave')})" for reason, count in sorted(report.fresh_reasons.items())
        )
        served = f": {why}" if why else ""
        row("fresh chunks", f"{fresh} of {report.continuations_asked} continuations asked for were served as fresh chunks (frozen 0){served}")
    return lines
