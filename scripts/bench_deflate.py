"""What permessage-deflate costs a robot's observation frame (the reason ``server.compression`` is "none").

One 338 KiB frame (two 180x320 RGB camera images packed the openpi way) is sent over a local websocket
to an echo-free server that answers with a 1-byte frame; the round trip is timed with and without
deflate, and with the images JPEG-encoded instead. Camera images are noisy, so deflate shrinks them
little and spends the time compressing (client) and inflating (server event loop).

    .venv/bin/python scripts/bench_deflate.py [--rounds 50]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import numpy as np
from websockets.asyncio.server import serve
from websockets.sync.client import connect

from ardiff_server.wire.jpeg import encode_jpeg
from ardiff_server.wire.protocol import pack


def camera_frame(rng: np.random.Generator) -> np.ndarray:
    """A camera-like image: smooth scene plus sensor noise (not compressible to nothing, not random)."""
    y, x = np.mgrid[0:180, 0:320]
    scene = np.stack([127 + 90 * np.sin(x / (17 + 5 * c) + y / 23 + c) for c in range(3)], axis=-1)
    return np.clip(scene + rng.normal(0, 6, scene.shape), 0, 255).astype(np.uint8)


def frames() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    images = [camera_frame(rng) for _ in range(2)]
    raw = {f"observation/exterior_image_{i}_left": im for i, im in enumerate(images)}
    jpeg = {k: encode_jpeg(v, quality=90) for k, v in raw.items()}
    return {"raw": pack(raw), "jpeg": pack(jpeg)}


def run_server(port: int, compression: str | None, ready: threading.Event, stop: threading.Event) -> None:
    async def handler(ws):
        async for _ in ws:
            await ws.send(b"\x00")

    async def main():
        async with serve(handler, "127.0.0.1", port, compression=compression, max_size=None):
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)

    asyncio.run(main())


def measure(port: int, compression: str | None, frame: bytes, rounds: int) -> float:
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=run_server, args=(port, compression, ready, stop), daemon=True)
    thread.start()
    ready.wait(10)
    times = []
    with connect(f"ws://127.0.0.1:{port}", compression=compression, max_size=None) as ws:
        for _ in range(rounds + 3):
            started = time.perf_counter()
            ws.send(frame)
            ws.recv()
            times.append((time.perf_counter() - started) * 1000.0)
    stop.set()
    thread.join(5)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    payloads = frames()
    print(f"frame: raw {len(payloads['raw']) / 1024:.0f} KiB, JPEG q90 {len(payloads['jpeg']) / 1024:.0f} KiB")
    print("| frame | compression | round trip p50 (ms) |\n|---|---|---|")
    port = args.port
    for name, frame in payloads.items():
        for compression in (None, "deflate"):
            port += 1
            ms = measure(port, compression, frame, args.rounds)
            print(f"| {name} {len(frame) / 1024:.0f} KiB | {compression or 'none'} | {ms:.2f} |")


if __name__ == "__main__":
    main()
