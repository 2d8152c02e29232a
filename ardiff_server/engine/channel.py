"""How messages cross the socket between the front end and a worker: the one framing both use.

A frame is a 4-byte big-endian signed length, then the pickled :mod:`messages` object (our own
processes only: the websocket never carries pickle). The worker reads and writes its end with
blocking calls (:class:`WorkerChannel`: a reader thread and the engine's thread share it); the
front end reads its end with asyncio streams (:func:`read_message`) and writes through the
stream's buffer (:func:`frame`), so the event loop never blocks on a busy worker.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading
from typing import Any

HEADER = struct.Struct("!i")


def frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The next message on the front end's end (raises IncompleteReadError when the worker is gone)."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


class WorkerChannel:
    """The worker's end. Sends are serialized by a lock (the engine's thread replies while the
    reader thread answers pings); only the reader thread receives."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        data = frame(message)
        with self._lock:
            self.sock.sendall(data)

    def recv(self) -> Any:
        """The next message; EOFError when the front end closed its end."""
        (size,) = HEADER.unpack(self._recv_exactly(HEADER.size))
        return pickle.loads(self._recv_exactly(size))

    def _recv_exactly(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        while got < size:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise EOFError("the front end closed the channel")
            got += n
        return buffer
