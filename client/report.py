"""How ``ardiff-client`` reports a run: progress per call, the latency table, one
JSON object, the saved arrays (``--record``) and the trajectory plot (``--plot``)."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ardiff_client.records import CallRecord, Episode, jsonable
from ardiff_server.media import plot_actions


class Progress:
    """One update per call on stderr: a tqdm bar on a terminal, else a plain line (for logs)."""

    def __init__(self, total: int | None, enabled: bool = True) -> None:
        self._total, self._enabled, self._bar = total, enabled, None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, unit="call", file=sys.stderr, dynamic_ncols=True)

    def update(self, record: CallRecord) -> None:
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"rtt {record.rtt_ms:.0f} ms", refresh=False)
            self._bar.update(1)
            return
        total = f"/{self._total}" if self._total else ""
        timing = ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in record.server_timing.items())
        shape = "x".join(map(str, record.actions.shape))
        print(
            f"call {record.call}{total}: actions {shape} in {record.rtt_ms:.1f} ms" + (f" (server {timing})" if timing else ""),
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def summarize(records: Sequence[CallRecord]) -> dict[str, dict[str, float]]:
    """Latency statistics per column: ``round_trip_ms``, ``server.<key>``, ``policy.<phase>``.

    A column only counts the calls that reported it (bare-array replies report no timings).
    """
    columns: dict[str, list[float]] = {"round_trip_ms": [r.rtt_ms for r in records]}
    for prefix, attr in (("server", "server_timing"), ("policy", "policy_timing")):
        for record in records:
            for key, value in getattr(record, attr).items():
                columns.setdefault(f"{prefix}.{key}", []).append(value)
    return {name: _stats(values) for name, values in columns.items() if values}


def _stats(values: Sequence[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=np.float64)
    return {
        "n": int(array.size),
        "mean": float(array.mean()),
        "p50": float(np.percentile(array, 50)),
        "p99": float(np.percentile(array, 99)),
        "max": float(array.max()),
    }


def format_table(summary: Mapping[str, Mapping[str, float]]) -> str:
    width = max(len("latency (ms)"), *(len(name) for name in summary))
    lines = [f"{'latency (ms)':<{width}} {'n':>5} {'mean':>9} {'p50':>9} {'p99':>9} {'max':>9}"]
    for name, s in summary.items():
        lines.append(f"{name:<{width}} {s['n']:>5} {s['mean']:>9.1f} {s['p50']:>9.1f} {s['p99']:>9.1f} {s['max']:>9.1f}")
    return "\n".join(lines)


def episode_json(episode: Episode) -> dict[str, Any]:
    return {
        "url": episode.url,
        "metadata": jsonable(episode.metadata),
        "session_id": episode.session_id,
        "prompt": episode.prompt,
        "image_size": list(episode.size),
        "camera_keys": episode.camera_keys,
        "calls": len(episode.records),
        "ended": episode.ended,
        "error": episode.error,
        "reset_reply": jsonable(episode.reset_reply),
        "summary": summarize(episode.records),
        "records": [record.to_json() for record in episode.records],
    }


_ENDED = {"calls": "all done", "video": "the video ended", "error": "stopped by an error", "interrupted": "interrupted"}


def print_report(episode: Episode) -> None:
    shapes = sorted({"x".join(map(str, r.actions.shape)) for r in episode.records})
    formats = sorted({r.reply_format for r in episode.records})
    print(f"{episode.url}  session {episode.session_id}")
    print(
        f"{len(episode.records)} calls ({_ENDED[episode.ended]}), frames {episode.size[0]}x{episode.size[1]}, "
        f"cameras {', '.join(episode.camera_keys)}, actions {', '.join(shapes) or '-'}, "
        f"replies {', '.join(formats) or '-'}"
    )
    print(f"reset: {episode.reset_reply}")
    if episode.records:
        print(format_table(summarize(episode.records)))


def save_record(path: Path, episode: Episode) -> Path:
    """Write the episode's arrays to ``path`` (npz): actions (calls, N, D), states sent,
    per-call timings (NaN where a call did not report a column) and run metadata."""
    records = episode.records
    if records and records[0].state is not None:  # an embodiment's state keys, concatenated in order
        sent = {"state": np.array([_state_vector(r) for r in records], dtype=np.float64)}
    else:
        sent = {
            "joint_position": np.array([r.joint_position for r in records], dtype=np.float64).reshape(len(records), 7),
            "gripper_position": np.array([r.gripper_position for r in records], dtype=np.float64).reshape(len(records), 1),
        }
    arrays: dict[str, np.ndarray] = {
        "call": np.array([r.call for r in records], dtype=np.int64),
        "frames": np.array([r.frames for r in records], dtype=np.int64),
        "actions": _stack_chunks([r.actions for r in records]),
        **sent,
        "rtt_ms": np.array([r.rtt_ms for r in records], dtype=np.float64),
        "session_id": np.array(episode.session_id),
        "prompt": np.array(episode.prompt),
        "metadata_json": np.array(json.dumps(jsonable(episode.metadata))),
    }
    for prefix, attr in (("server", "server_timing"), ("policy", "policy_timing")):
        names = dict.fromkeys(key for r in records for key in getattr(r, attr))
        for name in names:
            values = [getattr(r, attr).get(name, math.nan) for r in records]
            arrays[f"{prefix}_{re.sub(r'[^A-Za-z0-9_]', '_', name)}"] = np.array(values, dtype=np.float64)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:  # a file object: numpy would append .npz to a bare name
        np.savez_compressed(file, **arrays)
    return path


def _stack_chunks(chunks: Sequence[np.ndarray]) -> np.ndarray:
    """(calls, N, D) float32; chunks of different lengths are NaN-padded to the longest."""
    if not chunks:
        return np.zeros((0, 0, 8), dtype=np.float32)
    horizon = max(c.shape[0] for c in chunks)
    dim = max(c.shape[1] for c in chunks)
    out = np.full((len(chunks), horizon, dim), np.nan, dtype=np.float32)
    for i, chunk in enumerate(chunks):
        out[i, : chunk.shape[0], : chunk.shape[1]] = chunk
    return out


def _state_vector(record: CallRecord) -> np.ndarray:
    return np.concatenate([np.ravel(v) for v in (record.state or {}).values()]) if record.state else np.zeros(0)


def plot_episode(path: Path, episode: Episode) -> Path:
    records = episode.records
    if records and records[0].state is not None:
        state = np.array([_state_vector(r) for r in records])
    else:
        state = np.concatenate([np.array([r.joint_position for r in records]), np.array([r.gripper_position for r in records])], axis=1)
    title = f"{episode.prompt!r}: {len(records)} calls, session {episode.session_id}"
    return plot_actions(_stack_chunks([r.actions for r in records]), path, state=state, title=title)
