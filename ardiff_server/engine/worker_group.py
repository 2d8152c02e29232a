"""One launch of a replica's worker processes: spawn, the Ready handshake, kill, join.

A :class:`WorkerGroup` is one rank (or a CFG-parallel pair of ranks) started with the ``spawn``
method (CUDA-safe) and the socket to rank 0, read and written by the front end's event loop
through asyncio streams. A group lives until its processes exit or are killed; a restart is a
new group. What to do when a group dies or gets stuck is the :class:`ProcessClient`'s call.
Torch-free: the worker module is imported here but loads torch only inside the child.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from ardiff_server.engine.channel import frame, read_message
from ardiff_server.engine.messages import EngineError, ErrorKind, Ready, StartFailed
from ardiff_server.net import free_port


class WorkerGroup:
    def __init__(self, procs: list[Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.procs = procs
        self.reader = reader
        self.writer = writer
        self.tasks: list[asyncio.Task] = []  # the client's reader task for this group
        self.dead = False

    @classmethod
    async def launch(
        cls, raw_config: dict, *, world_size: int, replica: int, log_level: int, arena_name: str | None, warmup: bool, startup_timeout_s: float
    ) -> tuple[WorkerGroup, Ready]:
        """Spawn the ranks and wait for rank 0's :class:`Ready`. Raises :class:`EngineError`
        (``UNAVAILABLE``) with the reason when they fail to start; nothing is left running then."""
        from ardiff_server.engine.worker import worker_main  # noqa: PLC0415 - loads torch only in the child

        parent, child = socket.socketpair()
        ctx = mp.get_context("spawn")
        port = free_port() if world_size > 1 else 0
        procs = [
            ctx.Process(
                target=worker_main,
                args=(rank, world_size, raw_config, child if rank == 0 else None, port, log_level, arena_name, warmup),
                name=f"ardiff-worker-r{replica}-{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        await asyncio.to_thread(_start_all, procs)
        child.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent, limit=2**16)
        group = cls(procs, reader, writer)
        try:
            ready = await group._first_message(startup_timeout_s)
        except BaseException:
            group.kill()
            writer.close()
            raise
        return group, ready

    async def _first_message(self, timeout_s: float) -> Ready:
        """The workers' Ready, or a clear failure (start-up error, early exit, timeout)."""
        read = asyncio.ensure_future(read_message(self.reader))
        deadline = time.monotonic() + timeout_s
        try:
            while not read.done():
                await asyncio.wait([read], timeout=0.5)
                if not read.done() and any(not p.is_alive() for p in self.procs):
                    await asyncio.wait([read], timeout=1.0)  # the failure message may still be in flight
                    if read.done():
                        break
                    raise EngineError(ErrorKind.UNAVAILABLE, f"worker exited during start-up (exit codes {self.exit_codes}); see its log above")
                if time.monotonic() > deadline:
                    raise EngineError(ErrorKind.UNAVAILABLE, f"worker not ready after {timeout_s:.0f} s")
            try:
                message = read.result()
            except (asyncio.IncompleteReadError, ConnectionError):
                raise EngineError(ErrorKind.UNAVAILABLE, "worker exited during start-up; see its log above") from None
        finally:
            read.cancel()
        if isinstance(message, StartFailed):
            raise EngineError(ErrorKind.UNAVAILABLE, f"worker failed to start: {message.error}", message.traceback)
        if not isinstance(message, Ready):
            raise EngineError(ErrorKind.UNAVAILABLE, f"worker sent {type(message).__name__} before Ready")
        return message

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def exit_codes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def alive(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def send(self, message: Any) -> None:
        """Queue a message for rank 0 (buffered by asyncio: never blocks the loop)."""
        if self.dead or self.writer.is_closing():
            raise ConnectionError("worker socket closed")
        self.writer.write(frame(message))

    def on_exit(self, callback: Callable[[WorkerGroup], None]) -> None:
        """Call ``callback(self)`` from the event loop as soon as any rank's process exits."""
        loop = asyncio.get_running_loop()
        for proc in self.procs:
            loop.add_reader(proc.sentinel, callback, self)

    def forget(self) -> None:
        """Stop watching this group (it is dead or being stopped): no more exit callbacks, reader cancelled."""
        self.dead = True
        loop = asyncio.get_running_loop()
        for proc in self.procs:
            loop.remove_reader(proc.sentinel)
        for task in self.tasks:
            task.cancel()

    def kill(self) -> None:
        """SIGKILL every rank still running (no waiting)."""
        for proc in self.procs:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    async def reap(self) -> None:
        """Kill what is left of a dead group and wait for its processes to be gone (no zombies;
        on a GPU, their memory is released before a successor starts)."""
        self.kill()
        await asyncio.to_thread(_join_all, self.procs)
        self.writer.close()

    async def stop(self, shutdown: Any, grace_s: float) -> None:
        """Send ``shutdown`` (served after the step in progress), wait up to ``grace_s`` for the
        ranks to exit, then kill what is left and reap them."""
        try:
            self.send(shutdown)
            await asyncio.wait_for(self.writer.drain(), grace_s)
        except (ConnectionError, RuntimeError, TimeoutError):
            pass
        self.forget()
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.reap()


def _start_all(procs: list[Any]) -> None:
    for proc in procs:
        proc.start()


def _join_all(procs: list[Any]) -> None:
    for proc in procs:
        proc.join(timeout=10)
