"""The front end / worker seam: every message survives pickling field for field, and an
observation placed in shared memory reads back in the worker exactly as the front end had it."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from ardiff_policies.chunk import ChunkInfo
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine import messages
from ardiff_server.engine.messages import (
    ControlReply,
    Detach,
    End,
    EngineStats,
    ErrorKind,
    ErrorReply,
    Infer,
    InferReply,
    Ping,
    Pong,
    Shutdown,
)
from ardiff_server.engine.shm import INLINE_BYTES, InlineArray, SharedArena, SharedArray

STATS = (EngineStats(rank=0, session_ids=("ep-1", "ep-2"), steps=7, endings={"reset": 1}, kv_pages_total=64, kv_pages_free=60), EngineStats(rank=1))


def observation() -> RobotObservation:
    rng = np.random.default_rng(0)
    return RobotObservation(
        exterior_left=rng.integers(0, 256, (1, 48, 80, 3), dtype=np.uint8),
        exterior_right=rng.integers(0, 256, (4, 48, 80, 3), dtype=np.uint8),
        wrist=rng.integers(0, 256, (1, 48, 80, 3), dtype=np.uint8),
        joint_position=rng.uniform(-1, 1, 7).astype(np.float32),
        gripper_position=np.array([0.25], dtype=np.float32),
        prompt="pick up the cup",
    )


@pytest.mark.parametrize(
    "message",
    [
        End(3, "ep-1", "reset"),
        Detach(4, "ep-1", "switched"),
        Shutdown(),
        Ping(9),
        Pong(9, running=3, running_s=1.5),
        Pong(10),
        ControlReply(5, done=False, stats=STATS),
        ErrorReply(6, ErrorKind.POLICY, "boom", "Traceback ...", STATS),
        InferReply(7, "ep-1", np.ones((24, 8), np.float32), {"dit": 1.5}, {"dit_forwards": 18}, True, 1, 12.5, STATS, replica=1),
        InferReply(8, "ep-1", np.ones((24, 8), np.float32), {}, {}, False, 2, 9.0, chunk=ChunkInfo(chunk_id=2, frozen=4, continuation="applied")),
        InferReply(9, "ep-2", np.ones((32, 16), np.float32), {}, {"frame_start": 0}, True, 1, 3.0, chunk=ChunkInfo(call="infer", execute_from=16)),
        SharedArray(128, (1, 48, 80, 3), "|u1"),
        InlineArray(b"\x00" * 28, (7,), "<f4"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_message_round_trips_field_for_field(message):
    restored = pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(restored) is type(message)
    for field in dataclasses.fields(message):
        got, want = getattr(restored, field.name), getattr(message, field.name)
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want)
            assert got.dtype == want.dtype
        else:
            assert got == want, field.name


def test_a_chunk_record_pickles_as_its_values_and_says_only_what_is_set():
    """StepResult.chunk rides in every InferReply over the pipe: pickled as a tuple of its values in field order
    (a field added without its place in ``__reduce__`` would come back as None)."""
    chunk = ChunkInfo(chunk_id=3, frozen=0, continuation="window_restart", call="commit+infer", execute_from=0)
    assert pickle.loads(pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL)) == chunk
    assert chunk.__reduce__()[1] == tuple(getattr(chunk, f.name) for f in dataclasses.fields(ChunkInfo))
    assert ChunkInfo(chunk_id=1, frozen=0).set_fields() == {"chunk_id": 1, "frozen": 0}  # 0 is said, None is not
    assert ChunkInfo().set_fields() == {}


def test_every_message_class_pickles_by_fields():
    """A message added without ``@pickled_by_fields`` would still work, but through dataclasses'
    slow per-field ``__getstate__``; this keeps the seam's cost from creeping back."""
    classes = [c for c in vars(messages).values() if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == messages.__name__]
    assert len(classes) >= 10
    for cls in classes:
        assert "__reduce__" in vars(cls), f"{cls.__name__} lacks @pickled_by_fields"


def test_an_observation_through_shared_memory_reads_back_exactly():
    arena = SharedArena.create(2**20)
    try:
        original = observation()
        placed, allocations = arena.put(original)
        assert len(allocations) == 3  # the cameras; the small state vectors travel inline
        assert isinstance(placed.wrist, SharedArray) and isinstance(placed.joint_position, InlineArray)
        assert original.joint_position.nbytes <= INLINE_BYTES
        message = pickle.loads(pickle.dumps(Infer(1, "ep-1", placed), protocol=pickle.HIGHEST_PROTOCOL))
        seen = arena.view(message.observation)
        for name, array in original.arrays().items():
            got = getattr(seen, name)
            np.testing.assert_array_equal(got, array)
            assert got.dtype == array.dtype and got.shape == array.shape
            assert not got.flags.writeable  # the worker reads; it never writes the front end's memory
        assert seen.prompt == original.prompt and seen.cartesian_position is None
        for allocation in allocations:
            arena.free(allocation)
        assert arena.in_use == 0
    finally:
        arena.close()
