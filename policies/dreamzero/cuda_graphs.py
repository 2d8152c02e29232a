"""CUDA-graph replay of DreamZero's denoise DiT forward (``engine.cuda_graphs``).

Every denoise step of a chunk runs the same DiT forward on new values, which is what a CUDA
graph replays without re-launching thousands of kernels. Graphs serve one session's denoise
forward (its local CFG branches, one sequence each); a batch of several sessions runs eagerly
(there would be a graph per combination of sessions). One graph is captured per tuple of
(branch, cross-attention slot, window position), one entry per sequence:

* the window position (``current_start_frame``) picks the RoPE rows, computed inside the graph;
* the cross-attention slot fixes where the cached text/image K/V live (read in place);
* everything else (latents, timesteps, y, actions, state, and the paged-attention metadata:
  slots, block table, sequence lengths) is copied into static buffers before each replay.

The paged op writes into the cache's pool tensors, whose addresses never change. Capture needs
an attention backend without host synchronization, ``flash`` or ``flex``: the ``sdpa`` backend
reads sequence lengths on the host, which a graph cannot. If a capture fails, the policy logs it
and runs eagerly.

Captures happen while serving (a new session brings a new cross slot), when the engine's encoder
thread may be running CUDA work on its own stream (:meth:`InputEncoder.prepare`). Under CUDA's
default ``global`` capture mode a potentially unsafe call from that thread (a ``cudaMalloc``, a
stream synchronize) invalidates the capture, and graphs would stay off for good. Captures run in
``thread_local`` mode (:data:`CAPTURE_ERROR_MODE`): only the capturing thread's own calls are
checked. The start-up log says so.

This module is exercised only on a GPU (CI has none); it stays importable everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ardiff_kv import PagedLayerInputs

logger = logging.getLogger(__name__)

GraphKey = tuple[tuple[int, int, int], ...]  # per sequence: (branch, cross slot, current_start_frame)
# torch.cuda.graph's capture_error_mode: another thread's CUDA work (the encoder thread) never breaks a capture.
CAPTURE_ERROR_MODE = "thread_local"


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    layer_inputs: list[PagedLayerInputs]
    video: torch.Tensor
    action: torch.Tensor


class DenoiseGraphs:
    def __init__(self, dit: torch.nn.Module, warmup_runs: int = 2) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.dit = dit
        self.warmup_runs = warmup_runs
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[GraphKey, _Captured] = {}
        self.failed = False
        logger.info(
            "CUDA graphs: the denoise forward is captured per (branch, cross slot, window position) on first use, "
            "capture_error_mode=%s (the encoder thread's CUDA work may run during a capture)",
            CAPTURE_ERROR_MODE,
        )

    def run(
        self, key: GraphKey, *, layer_inputs: list[PagedLayerInputs], cross_kv, current_start_frame: list[int], **tensors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Replay (capturing first if needed). None: graphs are unusable here, run eagerly."""
        if self.failed:
            return None
        captured = self.graphs.get(key)
        if captured is None:
            try:
                captured = self._capture(layer_inputs, cross_kv, current_start_frame, tensors)
            except Exception as exc:  # e.g. no flash backend: a host sync inside the op
                logger.warning("CUDA graph capture failed (%s); the denoise forward runs eagerly", exc)
                self.failed = True
                return None
            self.graphs[key] = captured
            logger.info("captured denoise graph %s (%d in all)", key, len(self.graphs))
        for name, value in tensors.items():
            captured.inputs[name].copy_(value)
        shared, fresh = captured.layer_inputs[0], layer_inputs[0]
        for field in ("video_slots", "extra_slots", "block_table", "cu_seqlens_q", "seq_lens"):
            getattr(shared, field).copy_(getattr(fresh, field))
        captured.graph.replay()
        return captured.video.clone(), captured.action.clone()

    def _capture(self, layer_inputs, cross_kv, current_start_frame, tensors) -> _Captured:
        inputs = {name: value.clone() for name, value in tensors.items()}
        first = layer_inputs[0]
        shared = {f: getattr(first, f).clone() for f in ("video_slots", "extra_slots", "block_table", "cu_seqlens_q", "seq_lens")}
        static_layers = [li._replace(**shared) for li in layer_inputs]  # every layer reads the same buffers

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            return self.dit(
                inputs["x"],
                inputs["timestep"],
                current_start_frame=current_start_frame,
                self_kv=static_layers,
                y=inputs.get("y"),
                cross_kv=cross_kv,
                action=inputs["action"],
                timestep_action=inputs["timestep_action"],
                state=inputs["state"],
            )

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, lazy tables)
            for _ in range(self.warmup_runs):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph, (video, action) = capture(forward, self.pool)
        return _Captured(graph, inputs, static_layers, video, action)


def capture(forward: Callable[[], Any], pool: Any) -> tuple[Any, Any]:
    """A CUDA graph of ``forward()`` (allocating from ``pool``) and what it returned, captured in :data:`CAPTURE_ERROR_MODE`."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE):
        out = forward()
    return graph, out
