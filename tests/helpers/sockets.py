"""Process and socket helpers for end-to-end tests: a bare websocket client, RSS, polling."""

from __future__ import annotations

import base64
import os
import socket
import struct
import time


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set since it started or since :func:`reset_peak_rss` (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def reset_peak_rss(pid: int) -> None:
    """Start :func:`peak_rss_mib` over from the current resident set (Linux: ``5`` to ``/proc/<pid>/clear_refs``)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class RawWebSocket:
    """A bare websocket client on a plain socket: it can stop reading or send partial frames,
    which library clients (with their own reader threads and buffering) cannot."""

    def __init__(self, port: int, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket()
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        response = b""
        while not response.endswith(b"\r\n\r\n"):  # byte by byte: leave the metadata frame unread
            response += self.sock.recv(1)
        assert response.startswith(b"HTTP/1.1 101"), response

    @staticmethod
    def header(length: int, opcode: int = 0x2, fin: bool = True) -> bytes:
        """A client frame header. Mask key 0 (valid per RFC 6455) leaves the payload as is."""
        first = (0x80 if fin else 0) | opcode
        if length < 126:
            head = struct.pack("!BB", first, 0x80 | length)
        elif length < 2**16:
            head = struct.pack("!BBH", first, 0x80 | 126, length)
        else:
            head = struct.pack("!BBQ", first, 0x80 | 127, length)
        return head + b"\x00\x00\x00\x00"

    def read_frame(self, timeout: float) -> tuple[int, bytes]:
        self.sock.settimeout(timeout)
        first, second = self._read(2)
        length = second & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", self._read(2))
        elif length == 127:
            (length,) = struct.unpack("!Q", self._read(8))
        return first & 0x0F, self._read(length)

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the server closed the TCP connection")
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()
