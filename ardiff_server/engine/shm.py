"""Camera arrays to the worker through shared memory, not through the pipe.

The front end copies each observation's arrays into a :class:`SharedArena` (one memcpy, which
replaces the copy decoding would make anyway) and sends the worker a small message whose array
fields are :class:`SharedArray` references. The worker maps the same region and reads the
arrays in place as read-only views. An allocation is freed when its request is answered or its
worker dies, never earlier, so a view is valid for the whole step.

Allocation is first-fit over a free list: few requests are in flight at once (one per robot),
so the lists stay short, and reusing the lowest offsets keeps the touched part of the region
(and so resident memory) small. When the arena is full or disabled, the observation travels
inline instead (pickled through the pipe): slower, never wrong.

The region is reserved up front (``posix_fallocate``) so that a full ``/dev/shm`` (64 MiB in a
default Docker container) fails at start-up with a clear message instead of a SIGBUS later.
"""

from __future__ import annotations

import bisect
import logging
import os
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.messages import pickled_by_fields

logger = logging.getLogger(__name__)

ALIGN = 64  # bytes; cache-line aligned arrays
INLINE_BYTES = 4096  # smaller arrays (joint states) travel inline: an allocation costs more than the bytes


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class SharedArray:
    """Where one array lives in the arena."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class InlineArray:
    """A small array carried in the message itself, as raw bytes (pickling an ndarray costs
    several times more than these three fields)."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class Allocation:
    offset: int
    size: int


class SharedArena:
    def __init__(self, shm: shared_memory.SharedMemory, *, owner: bool) -> None:
        self._shm = shm
        self.owner = owner
        self.size = shm.size
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, size), sorted by offset
        self.in_use = 0

    @classmethod
    def create(cls, size: int) -> SharedArena:
        """A new region of ``size`` bytes, reserved now. Raises OSError if the memory is not there."""
        shm = shared_memory.SharedMemory(create=True, size=size)
        try:
            fd = getattr(shm, "_fd", -1)
            if fd >= 0 and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
        except OSError:
            shm.close()
            shm.unlink()
            raise
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> SharedArena:
        # Python < 3.13 registers attached segments with the resource tracker it shares with the
        # creating process; the creator unlinks (and unregisters) it, so this is harmless.
        return cls(shared_memory.SharedMemory(name=name), owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    # -- front end: write -------------------------------------------------------------

    def put(self, observation: RobotObservation) -> tuple[RobotObservation, list[Allocation]] | None:
        """Copy the observation's arrays in; None (nothing allocated) if they do not fit."""
        allocations: list[Allocation] = []
        refs: dict[str, SharedArray | InlineArray] = {}
        for name, array in observation.arrays().items():
            if array.nbytes <= INLINE_BYTES:
                refs[name] = InlineArray(array.tobytes(), array.shape, array.dtype.str)
                continue
            allocation = self._allocate(array.nbytes)
            if allocation is None:
                for done in allocations:
                    self.free(done)
                return None
            allocations.append(allocation)
            target = np.ndarray(array.shape, dtype=array.dtype, buffer=self._shm.buf, offset=allocation.offset)
            target[...] = array
            refs[name] = SharedArray(allocation.offset, tuple(array.shape), array.dtype.str)
        return observation.with_arrays(refs), allocations

    def free(self, allocation: Allocation) -> None:
        self.in_use -= allocation.size
        index = bisect.bisect(self._free, (allocation.offset, 0))
        start, size = allocation.offset, allocation.size
        if index < len(self._free) and self._free[index][0] == start + size:  # merge with the next
            size += self._free.pop(index)[1]
        if index > 0 and sum(self._free[index - 1]) == start:  # merge with the previous
            start, previous = self._free[index - 1]
            size += previous
            self._free[index - 1] = (start, size)
        else:
            self._free.insert(index, (start, size))

    def _allocate(self, nbytes: int) -> Allocation | None:
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for index, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[index]
                else:
                    self._free[index] = (offset + size, free - size)
                self.in_use += size
                return Allocation(offset, size)
        return None

    # -- worker: read -------------------------------------------------------------------

    def view(self, observation: RobotObservation) -> RobotObservation:
        """The observation with every :class:`SharedArray` and :class:`InlineArray` replaced by a
        read-only array (a view of the region, or of the message's bytes)."""
        refs = {name: value for name, value in observation.values().items() if isinstance(value, SharedArray | InlineArray)}
        if not refs:
            return observation
        views = {}
        for name, ref in refs.items():
            if isinstance(ref, InlineArray):
                views[name] = np.frombuffer(ref.data, dtype=np.dtype(ref.dtype)).reshape(ref.shape)  # read-only: bytes
                continue
            array = np.ndarray(ref.shape, dtype=np.dtype(ref.dtype), buffer=self._shm.buf, offset=ref.offset)
            array.flags.writeable = False
            views[name] = array
        return observation.with_arrays(views)

    def close(self) -> None:
        try:
            self._shm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        if self.owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass


def create_arena(size_mib: int) -> SharedArena | None:
    """The configured arena, or None (observations go inline) where shared memory is short."""
    if size_mib <= 0:
        return None
    size = size_mib * 2**20
    try:
        return SharedArena.create(size)
    except OSError as exc:
        logger.warning(
            "no %d MiB of shared memory for camera frames (%s); observations go through the pipe instead "
            "(slower). Raise /dev/shm (docker run --shm-size=1g) or lower engine.shm_mib.",
            size_mib,
            exc,
        )
        return None
